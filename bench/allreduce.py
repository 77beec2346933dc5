"""KDA o_proj + TP all-reduce + residual add + the next RMSNorm on a TP group of this machine's GPUs, every
variant side by side in one run, batch 1..64 (k3tune/kernels/allreduce.py):

  nccl            projection, NCCL all-reduce, add, torch RMSNorm: what a stock engine runs (the baseline)
  symm_one_shot   projection into symmetric memory, torch's one-shot all-reduce, add, norm
  symm_two_shot   projection into symmetric memory, torch's two-shot all-reduce (in place), add, norm
  fused_one_shot  projection into symmetric memory, barrier, k3tune's one-shot all-reduce + residual + norm
                  kernel: one launch after the projection

    python bench/allreduce.py [--gpus 2] [--batches 1,2,4,8,16,32,64] [--model-tp 8] [--out F]

Measured by k3tune/search/measure_collective.py, as a sweep measures them: one process per GPU, NVLS and
multicast off, fp32-checked first, then a CUDA graph of ``--layers`` steps with distinct weights (read from
HBM), warmed up, all ranks replaying together; a step's time is the slowest rank's median. The projection
is the per-rank o_proj of a ``--model-tp`` deployment (K = 12288 / tp, N = 7168); the collective runs on
the ``--gpus`` ranks present. Prints the table (ratios to nccl); JSON to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

N_HIDDEN, KDA_WIDTH = 7168, 12288


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--model-tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", default="bench-allreduce.json")
    args = ap.parse_args()
    import torch

    from k3tune.kernels.allreduce import VARIANTS
    from k3tune.kernels.base import params_key
    from k3tune.plan.problems import Problem
    from k3tune.search.measure_collective import measure

    problems = [Problem("tp.allreduce", "allreduce", (("group", args.gpus), ("M", int(m)), ("N", N_HIDDEN),
                                                      ("K", KDA_WIDTH // args.model_tp)))
                for m in args.batches.split(",")]
    res = measure([(p, [{"variant": v} for v in VARIANTS]) for p in problems], args.gpus, layers=args.layers,
                  samples=args.samples)
    rows = []
    for p in problems:
        row = {"M": p["M"], "K": p["K"]}
        for v in VARIANTS:
            o = res[(p.key, params_key({"variant": v}))]
            row[v] = {"us": o.median_us, "iqr": o.spread_us} if o.status == "ok" else {"failed": o.error}
        base = row["nccl"].get("us")
        print(f"group {args.gpus} M {p['M']:<3} " + " ".join(
            f"{v} {row[v]['us']:6.1f}" + (f" x{base / row[v]['us']:.2f}" if base else "") if "us" in row[v]
            else f"{v} FAILED ({row[v]['failed']})" for v in VARIANTS), flush=True)
        rows.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "group": args.gpus,
                                          "model_tp": args.model_tp, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
