"""Dense decode GEMMs on the local GPU: the tuned choice, cuBLAS and (optionally) Inductor's
max-autotune pick, side by side under identical decode conditions.

    python bench/gemm.py --db tuning_db/h200.sqlite [--ms 1,2,4,8,16,32,64,128,256,512] [--inductor 1,8,64]

Every variant of a problem runs in the same process, in a CUDA graph of many launches cycling through
weight copies that exceed L2 several times (decode reads weights from HBM), after a warm-up; medians and
interquartile ranges of the per-launch time are reported. The roofline floor is (weights + activations +
output bytes) / measured copy bandwidth (a 2 GiB device-to-device copy, bytes read + written).
A tuned choice with programmatic dependent launch (``pdl``) overlaps its first weight loads with the launch
before it in the graph, which is the same kernel here: a gain a decode step sees only between such kernels,
so those rows are also timed with PDL off, and the summary gives the geomean both ways.
Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from k3tune.kernels import family
from k3tune.plan import model as models, problems as plans, spec as specs
from k3tune.runtime import Selector
from k3tune.search.measure_gpu import time_rounds
from k3tune.search.outcome import relative_error

DENSE_OPS = [n for n, o in plans.OPS.items() if o.kind == "gemm"]


def write_json(path: str, obj) -> None:
    """``obj`` as JSON at ``path``, whole or not at all (a temp file beside it, then a rename): a bench killed by its
    timeout leaves the last complete write, never half a file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * (1 << 31) / statistics.median(times)


def floor_us(problem, bw: float) -> float:
    """Roofline floor of a dense problem: weights + activations + output bytes / copy bandwidth."""
    m, n, k = problem["M"], problem["N"], problem["K"]
    return (n * k + m * k + m * n) * 2 / bw * 1e6


def inductor_run(problem):
    """Inductor's max-autotune pick for this problem, compiled afresh: every problem compiles the same function,
    and past dynamo's ``recompile_limit`` (8) shapes dynamo runs it eagerly, i.e. cuBLAS, with one warning (until
    session 48 every Inductor column but its first 8 problems was cuBLAS). ``run.compiled()`` says whether it was."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    fn = torch.compile(lambda x, w: torch.matmul(x, w.t()), mode="max-autotune-no-cudagraphs", dynamic=False)

    def run(inputs):
        return fn(inputs["x"], inputs["w"])

    run.compiled = lambda: counters["stats"]["unique_graphs"] > graphs
    return run


def profile_once(step, name: str) -> None:
    """For Nsight Compute: ``step()`` once to warm up (compile, caches), then once in NVTX ranges profile > name
    (``ncu --nvtx --nvtx-include profile/ --print-nvtx-rename kernel`` catches exactly those launches)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    torch.cuda.nvtx.range_push(name)
    step()
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def measure(run, fam, problem, samples: int, rounds: int = 1) -> dict:
    """Correctness once (poisoned output), then ``samples`` replays over ``rounds`` independent allocations of
    the weights (measure_gpu.time_rounds, as the sweep's measurer does). The median over the rounds' medians is
    reported and the rounds' range is the run-to-run spread. Variants of one problem are measured one after
    another, so round r of each reuses the blocks round r of the previous one freed (paired)."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    inputs = fam.make_inputs(problem, torch.device("cuda"), gen)
    if "out" in inputs:
        inputs["out"].fill_(float("nan"))
    err = relative_error(run(inputs), fam.reference(problem, inputs))
    per_round = [sorted(t) for t in time_rounds(run, fam, problem, inputs, gen, samples, rounds)]
    medians = [statistics.median(t) for t in per_round]
    iqr = statistics.median(q[2] - q[0] for q in (statistics.quantiles(t, n=4) for t in per_round))
    rng = max(medians) - min(medians)
    return {"us": statistics.median(medians), "iqr": iqr, "range": rng, "spread": max(iqr, rng),
            "rounds_us": medians, "err": err}


def summarize(rows: list[dict], dev: str, bw: float) -> dict:
    """The bars' figures over ``rows``: geomean speedups at M <= 64 (over cuBLAS, with PDL off, over Inductor where
    timed), problems slower than cuBLAS beyond the spread, the least roofline fraction at M <= 16 (floor >= 5 us)."""
    small = [r for r in rows if r["M"] <= 64]
    geo = math.exp(sum(math.log(r["cublas"]["us"] / r["tuned"]["us"]) for r in small) / len(small))
    # spread: the larger of a variant's within-graph IQR and its range over the allocation rounds
    slower = [r for r in rows if r["tuned"]["us"] - r["cublas"]["us"] > r["tuned"]["spread"] + r["cublas"]["spread"]]
    roof = [r for r in rows if r["M"] <= 16 and r["floor_us"] >= 5]
    summary = {"device": dev, "copy_bw_tbps": bw / 1e12, "rows": len(rows), "geomean_speedup_vs_cublas_m_le_64": geo,
               "slower_than_cublas_beyond_spread": [(r["tp"], r["op"], r["M"]) for r in slower],
               "min_roofline_frac_m_le_16_floor_ge_5us": min((r["floor_us"] / r["tuned"]["us"] for r in roof), default=None)}
    summary["geomean_speedup_vs_cublas_by_m"] = {  # where the geomean is won and lost
        m: math.exp(statistics.mean(math.log(r["cublas"]["us"] / r["tuned"]["us"]) for r in small if r["M"] == m))
        for m in sorted({r["M"] for r in small})}
    if any("tuned_nopdl" in r for r in rows):  # the same choices with programmatic dependent launch off
        summary["geomean_speedup_vs_cublas_m_le_64_pdl_off"] = math.exp(sum(
            math.log(r["cublas"]["us"] / r.get("tuned_nopdl", r["tuned"])["us"]) for r in small) / len(small))
    if any("inductor" in r for r in rows):
        ind = [r for r in small if "inductor" in r]
        summary["geomean_speedup_vs_inductor"] = math.exp(sum(math.log(r["inductor"]["us"] / r["tuned"]["us"])
                                                              for r in ind) / len(ind))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="tuning_db/h200.sqlite")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--tps", default="8,16", help="TP sizes (a table swept for one of them: s56-r4)")
    ap.add_argument("--ops", default="", help="only these dense ops (comma-separated; a cut run's rest)")
    ap.add_argument("--inductor", default="", help="M values at which to also time Inductor's pick (slow)")
    ap.add_argument("--samples", type=int, default=15, help="replays per variant, split among the rounds")
    ap.add_argument("--rounds", type=int, default=3, help="independent input allocations per variant")
    ap.add_argument("--out", default="bench-gemm.json")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="no GPU: the summary over the rows of these "
                    "outputs of one device (e.g. two calls' M ranges, or a run its timeout cut: rows are written as "
                    "they are measured)")
    args = ap.parse_args()
    if args.summarize:
        outs = [json.loads(Path(f).read_text()) for f in args.summarize]
        devs = {(o["summary"]["device"], round(o["summary"]["copy_bw_tbps"], 2)) for o in outs}
        if len({d for d, _ in devs}) != 1:
            raise SystemExit(f"--summarize: outputs of different devices: {sorted(devs)}")
        rows = [r for o in outs for r in o["rows"]]
        keys = [(r["tp"], r["op"], r["M"]) for r in rows]
        if len(set(keys)) != len(keys):
            raise SystemExit("--summarize: a problem appears in more than one output")
        print(json.dumps(summarize(rows, outs[0]["summary"]["device"], outs[0]["summary"]["copy_bw_tbps"] * 1e12),
                         indent=2))
        return
    ms = [int(x) for x in args.ms.split(",")]
    tps = [int(x) for x in args.tps.split(",")]
    if not set(tps) <= {8, 16}:
        raise SystemExit(f"--tps: {args.tps}: the dense tables cover TP 8 and 16")
    ind_ms = {int(x) for x in args.inductor.split(",") if x}
    wanted = set(args.ops.split(",")) if args.ops else set(DENSE_OPS)
    if unknown := sorted(wanted - set(DENSE_OPS)):
        raise SystemExit(f"--ops: not dense ops: {unknown}")
    ops = [o for o in DENSE_OPS if o in wanted]
    sp = specs.load()
    model = models.load()
    sel = Selector.load(args.db, spec=sp, model=model)
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, copy bandwidth {bw / 1e12:.2f} TB/s, db {args.db}, table {sel.hash}")
    rows, seen = [], set()
    cublas = family("gemm.cublas")
    for tp in tps:
        for op in ops:
            for m in ms:
                # tokens per step m: batch m (m <= 64), else batch 64 with draft m/64 - 1
                batch, draft = min(m, 64), max(0, m // 64 - 1)
                p = plans.Problem(op, "gemm", plans.OPS[op].dims(model, plans.Deployment(tp, m, 1, 0, 8192), sp))
                if (p.key, tp) in seen:
                    continue
                seen.add((p.key, tp))
                choice = sel.lookup(op, tp, batch, draft)
                fam = family(choice.family)
                row = {"tp": tp, "op": op, "M": m, "N": p["N"], "K": p["K"], "choice": choice.family,
                       "params": dict(choice.params), "source": choice.source}
                floor = floor_us(p, bw)
                row["floor_us"] = floor
                row["cublas"] = measure(cublas.build(p, cublas.default_config(p)), cublas, p, args.samples, args.rounds)
                cfg = fam.config_from_params(p, dict(choice.params)) if fam.can_implement(p) else None
                if cfg is not None and fam.name != "gemm.cublas":
                    row["tuned"] = measure(fam.build(p, cfg), fam, p, args.samples, args.rounds)
                    if row["params"].get("pdl"):  # its gain needs a chain of such kernels: show it without
                        plain = fam.config_from_params(p, fam.canonical({**row["params"], "pdl": 0}))
                        row["tuned_nopdl"] = measure(fam.build(p, plain), fam, p, args.samples, args.rounds)
                else:
                    row["tuned"] = row["cublas"]
                if m in ind_ms:
                    t0 = time.perf_counter()
                    run = inductor_run(p)
                    row["inductor"] = measure(run, cublas, p, args.samples, args.rounds)
                    if not run.compiled():
                        raise SystemExit(f"tp{tp} {p.key}: dynamo compiled no graph, so the Inductor column would "
                                         "be eager cuBLAS")
                    row["inductor"]["compile_s"] = time.perf_counter() - t0
                rows.append(row)
                write_json(args.out, {"summary": {"device": dev, "copy_bw_tbps": bw / 1e12, "partial": True},
                                      "rows": rows})  # a run cut by its timeout keeps what it measured
                ind = f" ind {row['inductor']['us']:7.2f}" if "inductor" in row else ""
                if "tuned_nopdl" in row:
                    ind += f" (PDL off {row['tuned_nopdl']['us']:7.2f})"
                print(f"tp{tp:<3}{op:18}M={m:<4}N={p['N']:<6}K={p['K']:<6} tuned {row['tuned']['us']:7.2f} "
                      f"(±{row['tuned']['spread']:.2f}) cublas {row['cublas']['us']:7.2f} (±{row['cublas']['spread']:.2f})"
                      f"{ind} speedup {row['cublas']['us'] / row['tuned']['us']:.2f}x roof {floor / row['tuned']['us']:.2f}"
                      f" [{choice.family} {choice.source}]", flush=True)
    summary = summarize(rows, dev, bw)
    print(json.dumps(summary, indent=2))
    write_json(args.out, {"summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
