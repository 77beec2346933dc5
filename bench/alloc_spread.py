"""How much a dense GEMM's time moves with where its weights live in HBM: the same kernels timed on several
independent allocations of their inputs, in one process, rounds interleaved.

    python bench/alloc_spread.py --db ../tuning_db/h200.sqlite --problems 8:kda.qkvg_proj:1,8:kda.qkvg_proj:4 --rounds 6

bench/gemm.py times every variant of a problem on the same memory (the caching allocator hands the freed
blocks straight back), while a sweep times each trial on its own allocation in whichever worker runs it. If
times depend on the physical placement of the weights, the spread across rounds here is the run-to-run spread
that a single run's interquartile range does not show. Each round keeps its buffers alive so the next round
gets fresh memory. Prints per-variant medians per round, their range, and the within-round IQR.

Probes of why a sweep's worker times differ from this fresh process's: ``--idle-ms`` leaves the GPU idle before
each timing (its clocks drop as they would while a worker waits on a build), ``--warmup-ms`` replays that long
before timing, ``--fragment N`` allocates and frees N tensors of mixed sizes first (a long-lived worker's
allocator), ``--extra family:json`` (repeatable) adds a variant with given params (e.g. a config a sweep picked;
skipped on problems it does not fit).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from k3tune.errors import CannotImplement
from k3tune.kernels import family
from k3tune.plan import model as models, problems as plans, spec as specs
from k3tune.runtime import Selector
from k3tune.search.measure_gpu import rotation_sets, time_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="../tuning_db/h200.sqlite")
    ap.add_argument("--problems", default="8:kda.qkvg_proj:1,8:kda.qkvg_proj:4,16:kda.o_proj:1,8:mla.q_a:16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--out", default="alloc-spread.json")
    ap.add_argument("--idle-ms", type=float, default=0.0)
    ap.add_argument("--warmup-ms", type=float, default=0.0)
    ap.add_argument("--fragment", type=int, default=0)
    ap.add_argument("--extra", action="append", default=[], help="family:json params, e.g. gemm.smallm:{...}")
    args = ap.parse_args()
    sp, model = specs.load(), models.load()
    sel = Selector.load(args.db, spec=sp, model=model)
    print(f"# {torch.cuda.get_device_name()}, db {args.db}, table {sel.hash}")
    cublas = family("gemm.cublas")
    keep, rng = [], random.Random(0)
    for i in range(args.fragment):  # a long-lived worker's allocator: mixed sizes, half of them still held
        t = torch.empty(rng.choice([1, 3, 17, 90, 400]) << 18, dtype=torch.uint8, device="cuda")
        if i % 2:
            keep.append(t)
    report = []
    for item in args.problems.split(","):
        tp, op, m = item.split(":")
        tp, m = int(tp), int(m)
        p = plans.Problem(op, "gemm", plans.OPS[op].dims(model, plans.Deployment(tp, m, 1, 0, 8192), sp))
        choice = sel.lookup(op, tp, min(m, 64), max(0, m // 64 - 1))
        variants = {"cublas": (cublas, cublas.default_config(p))}
        fam = family(choice.family)
        if fam.name != "gemm.cublas":
            variants[f"tuned:{fam.name}"] = (fam, fam.config_from_params(p, dict(choice.params)))
        for i, ex in enumerate(args.extra):
            name, params = ex.split(":", 1)
            try:
                variants[f"extra{i}:{name}"] = (family(name), family(name).config_from_params(p, json.loads(params)))
            except CannotImplement as e:  # e.g. a 16-token tile at M = 4: the other problems still run
                print(f"# extra{i} skipped for {p.key}: {e}")
        runs = {name: f.build(p, cfg) for name, (f, cfg) in variants.items()}
        held, per = [], {name: [] for name in variants}
        for r in range(args.rounds):
            gen = torch.Generator(device="cuda").manual_seed(1000 + r)
            for name, (f, _) in variants.items():
                inputs = f.make_inputs(p, torch.device("cuda"), gen)
                sets = rotation_sets(f, p, inputs)
                held.append(sets)  # keep this round's memory so the next round lands elsewhere
                if args.idle_ms:
                    torch.cuda.synchronize()
                    time.sleep(args.idle_ms / 1e3)
                t = sorted(time_graph(runs[name], sets, args.samples, warmup_ms=args.warmup_ms))
                q = statistics.quantiles(t, n=4)
                per[name].append({"us": statistics.median(t), "iqr": q[2] - q[0],
                                  "w_ptr": hex(sets[0][f.weight_names(p)[0]].data_ptr())})
        del held
        torch.cuda.empty_cache()
        for name, rows in per.items():
            us = [x["us"] for x in rows]
            line = {"tp": tp, "op": op, "M": m, "variant": name, "round_us": us,
                    "range_us": max(us) - min(us), "median_us": statistics.median(us),
                    "within_iqr_us": statistics.median(x["iqr"] for x in rows)}
            report.append(line)
            print(f"tp{tp:<3}{op:18}M={m:<4}{name:22} rounds " + " ".join(f"{u:6.2f}" for u in us)
                  + f"  range {line['range_us']:.2f}  within-round IQR {line['within_iqr_us']:.2f}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
