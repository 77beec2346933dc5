"""The dense projections of one decode layer launched back to back, as a decode step runs them: the tuned
choices, the same choices with programmatic dependent launch (PDL) off, and cuBLAS, side by side.

    python bench/chain.py --db tuning_db/h200.sqlite [--ms 1,2,4,8,16,32,64] [--samples 9]

bench/gemm.py times each problem alone, in a graph of many launches of the same kernel: a tuned kernel with
PDL then overlaps its prologue with the launch before it, which is itself. Here each graph step is the layer's
sequence (a KDA layer: q/k/v+gate, o_proj, router+latent, latent up, shared w13, shared w2; an MLA layer: q_a,
kv_a, q_b, gate, o_proj and the same MoE projections), every op cycling through weight copies that exceed L2,
so PDL overlaps a kernel only with the different kernel before it, and only where that one triggers early
(cuBLAS kernels do not). Reports per-step medians and spreads, the ratios, and the step's roofline floor
(all its bytes / measured copy bandwidth). Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from gemm import copy_bandwidth, floor_us  # bench/gemm.py (this script runs from bench/)

from k3tune.kernels import family
from k3tune.plan import model as models, problems as plans, spec as specs
from k3tune.runtime import Selector
from k3tune.search.measure_gpu import rotation_sets, time_graph

LAYERS = {
    "kda": ["kda.qkvg_proj", "kda.o_proj", "moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2"],
    "mla": ["mla.q_a", "mla.kv_a", "mla.q_b", "mla.gate", "mla.o_proj", "moe.router_latent", "moe.latent_up",
            "moe.shared_w13", "moe.shared_w2"],
}


def chain_time(ops: list[tuple], samples: int) -> dict:
    """ops: (family, problem, config) per op, launched in order each step; per-step median and IQR (us)."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    runs, sets = [], []
    for fam, p, cfg in ops:
        inputs = fam.make_inputs(p, torch.device("cuda"), gen)
        runs.append(fam.build(p, cfg))
        sets.append(rotation_sets(fam, p, inputs))
    n = max(len(s) for s in sets)
    steps = [[s[i % len(s)] for s in sets] for i in range(n)]

    def step(inputs):
        for run, x in zip(runs, inputs):
            run(x)

    t = sorted(time_graph(step, steps, samples))
    q = statistics.quantiles(t, n=4)
    return {"us": statistics.median(t), "iqr": q[2] - q[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="tuning_db/h200.sqlite")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--out", default="bench-chain.json")
    args = ap.parse_args()
    sp, model = specs.load(), models.load()
    sel = Selector.load(args.db, spec=sp, model=model)
    bw = copy_bandwidth()
    cublas = family("gemm.cublas")
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, db {args.db}, table {sel.hash}")
    rows = []
    for tp in (8, 16):
        for layer, names in LAYERS.items():
            for m in (int(x) for x in args.ms.split(",")):
                tuned, plain, base, floor, picks = [], [], [], 0.0, []
                for op in names:
                    p = plans.Problem(op, "gemm", plans.OPS[op].dims(model, plans.Deployment(tp, m, 1, 0, 8192), sp))
                    choice = sel.lookup(op, tp, m, 0)
                    fam, params = family(choice.family), dict(choice.params)
                    cfg = fam.config_from_params(p, params) if fam.can_implement(p) else None
                    if cfg is None:
                        fam, params, cfg = cublas, {}, cublas.default_config(p)
                    tuned.append((fam, p, cfg))
                    off = {**params, **{k: v for k, v in fam.off.items() if k in params}}
                    plain.append((fam, p, fam.config_from_params(p, off) if off != params else cfg))
                    base.append((cublas, p, cublas.default_config(p)))
                    floor += floor_us(p, bw)
                    picks.append(f"{op}:{fam.name}{'+pdl' if params.get('pdl') else ''}")
                row = {"tp": tp, "layer": layer, "M": m, "floor_us": floor, "picks": picks,
                       "tuned": chain_time(tuned, args.samples), "tuned_nopdl": chain_time(plain, args.samples),
                       "cublas": chain_time(base, args.samples)}
                rows.append(row)
                t, o, c = row["tuned"]["us"], row["tuned_nopdl"]["us"], row["cublas"]["us"]
                print(f"tp{tp:<3}{layer} M={m:<3} tuned {t:7.2f} (±{row['tuned']['iqr']:.2f}) PDL off {o:7.2f} "
                      f"cublas {c:7.2f} (±{row['cublas']['iqr']:.2f}) speedup {c / t:.2f}x (PDL off {c / o:.2f}x) "
                      f"roof {floor / t:.2f}  {' '.join(picks)}", flush=True)
    summary = {"device": torch.cuda.get_device_name(), "copy_bw_tbps": bw / 1e12,
               "geomean_speedup_vs_cublas": statistics.geometric_mean(r["cublas"]["us"] / r["tuned"]["us"] for r in rows),
               "geomean_speedup_vs_cublas_pdl_off": statistics.geometric_mean(
                   r["cublas"]["us"] / r["tuned_nopdl"]["us"] for r in rows)}
    print(json.dumps(summary, indent=2))
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
