"""Where a dense kernel's time goes: a fixed part and a streaming rate, from a line fitted over K.

    python bench/kline.py --family gemm.splitk_cluster --n 1536 --ks 4096,7168,14336,28672 --ms 8,16 \
        --configs '[{"warps_n": 1, "warps_k": 4, "tile_m": 8, "split_k": 8, "bk": 128, "stages": 4}]'

With N and the config fixed, K sets only how many stages each CTA streams (the grid, the cluster barrier, the
reduction and the store stay the same), so time = fixed + bytes / rate: the intercept is what one launch costs
whatever it streams (launch, ramp, tail, cross-CTA sum, store), the slope the steady-state rate of the main loop.
Each point is timed as bench/gemm.py times (CUDA graph, weights rotated past L2, median over rounds, checked
against the fp32 reference first). Knobs missing from a config keep the family's default; a config the family
cannot run at some M or K is reported and skipped. cuBLAS is fitted beside it on the same shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from gemm import copy_bandwidth, measure, write_json  # bench/gemm.py (this script runs from bench/)

from k3tune.errors import CannotImplement
from k3tune.kernels import family
from k3tune.plan.problems import Problem


def line(fam, params: dict, m: int, n: int, ks: list[int], samples: int, rounds: int) -> dict | None:
    points = []
    for k in ks:
        p = Problem("kline", "gemm", (("M", m), ("N", n), ("K", k)))
        try:
            cfg = fam.config_from_params(p, {**fam.default_config(p).params(), **params})
        except CannotImplement as e:
            print(f"  skip: {e}", flush=True)
            continue
        r = measure(fam.build(p, cfg), fam, p, samples, rounds)
        if r["err"] >= fam.tolerance(p):
            print(f"  WRONG {fam.name} {params} {p.key} err={r['err']:.3g}", flush=True)
            continue
        points.append({"K": k, "bytes": (n * k + m * k + m * n) * 2, **r})
        print(f"  {fam.name:20} M={m:<3} N={n} K={k:<6} {r['us']:7.2f} us (±{r['spread']:.2f})", flush=True)
    if len(points) < 2:
        return None
    per_byte, fixed = statistics.linear_regression([q["bytes"] for q in points], [q["us"] for q in points])
    resid = max(abs(q["us"] - fixed - per_byte * q["bytes"]) for q in points)
    return {"family": fam.name, "params": params, "M": m, "N": n, "fixed_us": fixed,
            "rate_tbps": 1e-6 / per_byte if per_byte > 0 else None, "max_residual_us": resid, "points": points}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True)
    ap.add_argument("--configs", default="[{}]", help="JSON list of knob dicts")
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--ks", default="4096,7168,14336,28672")
    ap.add_argument("--ms", default="8,16")
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-cublas", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        ks, ms = [int(k) for k in args.ks.split(",")], [int(m) for m in args.ms.split(",")]
        configs = json.loads(args.configs)
    except ValueError as e:
        ap.error(f"--ks/--ms take comma-separated integers and --configs a JSON list of knob dicts ({e})")
    fams = [(family(args.family), configs)]
    if not args.no_cublas:
        fams.append((family("gemm.cublas"), [{}]))
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, N {args.n}, K {ks}", flush=True)
    lines = []
    for fam, configs in fams:
        for params in configs:
            for m in ms:
                res = line(fam, params, m, args.n, ks, args.samples, args.rounds)
                if res:
                    lines.append(res)
                    rate = res["rate_tbps"]
                    rate_s = f"{rate:.2f} TB/s ({rate * 1e12 / bw:.2f} of copy)" if rate else "n/a (time falls with K)"
                    print(f"LINE {fam.name:20} M={m:<3} {json.dumps(params)} fixed {res['fixed_us']:.2f} us, "
                          f"rate {rate_s}, max residual {res['max_residual_us']:.2f} us", flush=True)
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bw_tbps": bw / 1e12, "lines": lines})


if __name__ == "__main__":
    main()
