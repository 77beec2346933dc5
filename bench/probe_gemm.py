"""A designed grid of one kernel family's configs against cuBLAS, on chosen dense problems (a probe for kernel
work, not the sweep): every config is checked against the fp32 reference, then timed like bench/gemm.py
(CUDA graphs, weights rotated past L2, median and IQR).

    python bench/probe_gemm.py --family gemm.splitk_tc --ms 1,8,16,64 \
        --grid '{"m_tiles": [1, 2], "warps_n": [2, 4], "split_k": [1, 4, 8]}'

Knobs missing from --grid keep the family's default for the problem. Prints one line per config and the
best per problem, with the fraction of the roofline (bytes / measured copy bandwidth). ``--compile-procs N``
builds every config of the grid first on N CPU processes into the disk kernel cache (the sweep's compile farm),
so that a large grid is not timed one compile at a time.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from gemm import copy_bandwidth, floor_us, measure, profile_once  # bench/gemm.py (this script runs from bench/)

from k3tune.errors import CannotImplement
from k3tune.kernels import family
from k3tune.plan import model as models
from k3tune.plan import problems as plans
from k3tune.plan import spec as specs

DEFAULT_OPS = "kda.qkvg_proj,kda.o_proj,moe.router_latent,moe.shared_w13,mla.kv_a"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="gemm.splitk_tc")
    ap.add_argument("--ops", default=DEFAULT_OPS)
    ap.add_argument("--tps", default="8,16")
    ap.add_argument("--ms", default="1,8,16,64")
    ap.add_argument("--grid", default="{}", help="JSON: knob -> list of values")
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--compile-procs", type=int, default=0,
                    help="build the grid's kernels first on this many CPU processes (the disk kernel cache)")
    ap.add_argument("--profile", action="store_true",
                    help="no timing: each config (and cuBLAS) runs once eagerly in NVTX ranges profile > <name> for ncu "
                         "(ncu --clock-control none --nvtx --nvtx-include profile/ --print-nvtx-rename kernel ...)")
    args = ap.parse_args()
    sp, model = specs.load(), models.load()
    fam, cublas = family(args.family), family("gemm.cublas")
    grid = json.loads(args.grid)
    points = [(tp, op, m, plans.Problem(op, "gemm", plans.OPS[op].dims(model, plans.Deployment(tp, m, 1, 0, 8192), sp)))
              for tp, op, m in itertools.product([int(t) for t in args.tps.split(",")], args.ops.split(","),
                                                 [int(x) for x in args.ms.split(",")])]
    if args.compile_procs > 0:
        prebuild(fam, [p for *_, p in points], grid, args.compile_procs)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, family {fam.name}, grid {grid}")
    for tp, op, m, p in points:
        floor = floor_us(p, bw)
        if args.profile:
            profile(cublas, p, cublas.default_config(p), f"tp{tp}/{op}/M{m}/cublas")
            for knobs, _, cfg in configs(fam, p, grid):
                profile(fam, p, cfg, f"tp{tp}/{op}/M{m}/{fam.name}/{json.dumps(knobs)}")
            continue
        base = measure(cublas.build(p, cublas.default_config(p)), cublas, p, args.samples)
        best = None
        for knobs, params, cfg in configs(fam, p, grid):
            r = measure(fam.build(p, cfg), fam, p, args.samples)
            ok = r["err"] < fam.tolerance(p)
            tag = "" if ok else f" WRONG err={r['err']:.3g}"
            print(f"  tp{tp} {op:18} M={m:<3} {json.dumps(knobs)} {r['us']:7.2f} (±{r['iqr']:.2f})"
                  f" roof {floor / r['us']:.2f}{tag}", flush=True)
            if ok and (best is None or r["us"] < best[0]["us"]):
                best = (r, params)
        if best:
            print(f"BEST tp{tp} {op:18} M={m:<3} N={p['N']:<5} K={p['K']:<5} {best[0]['us']:7.2f} cublas {base['us']:7.2f} "
                  f"speedup {base['us'] / best[0]['us']:.2f}x roof {floor / best[0]['us']:.2f} {json.dumps(best[1])}",
                  flush=True)


def configs(fam, problem, grid: dict):
    """(the grid's knobs, full params, config) for every grid point the family can implement; knobs missing from
    the grid keep the family's default for the problem."""
    for values in itertools.product(*grid.values()):
        knobs = dict(zip(grid, values))
        params = {**fam.default_config(problem).params(), **knobs}
        try:
            yield knobs, params, fam.config_from_params(problem, params)
        except CannotImplement:
            continue


def prebuild(fam, problems, grid: dict, procs: int) -> None:
    """Every grid config of every problem compiled on ``procs`` CPU processes into the disk kernel cache, which
    this process then reads (compile_cache.install)."""
    import time

    from k3tune.kernels import compile_cache
    from k3tune.kernels.gemm_smallm import current_arch
    from k3tune.search.compile_farm import CompileFarm

    compile_cache.install()
    t0, n = time.perf_counter(), 0
    with CompileFarm(procs, current_arch()) as farm:
        for p in problems:
            for _, params, _ in configs(fam, p, grid):
                n += farm.submit(p, fam.name, params)
        failed = sum(1 for f in farm.futures.values() if f.exception() is not None)
    print(f"# built {n} kernels on {procs} processes in {time.perf_counter() - t0:.0f} s ({failed} failed)", flush=True)


def profile(fam, problem, cfg, name: str) -> None:
    inputs = fam.make_inputs(problem, torch.device("cuda"), torch.Generator(device="cuda").manual_seed(1234))
    run = fam.build(problem, cfg)
    profile_once(lambda: run(inputs), name)
    print(f"profiled {name}", flush=True)


if __name__ == "__main__":
    main()
