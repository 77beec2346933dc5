"""The timing method, A/B: each sample synchronised before the next (measure_gpu.time_graph's method up to session
27) against every sample queued behind a spin on the GPU (its default since), side by side in one run, with the
CPUs idle and with them kept busy the way a sweep's compile farm keeps them.

    cd bench && python3 timing_hold.py --db ../tuning_db/h200.sqlite --load 0,16 \
        --keys "mla.q_a[M=16,N=1536%;kda.o_proj[M=16,N=7168,K=1536%;moe.block[tp=8,M=1,%bf16,routing=uniform]"

Each --keys pattern (SQL LIKE on the problem key, ';'-separated) names problems of the database; each is timed as
the sweep's measurer times it (the family's build, inputs and rotation sets) for its stored winner and, for a dense
problem, for cuBLAS. Both methods run alternately (old, queued, old, queued, ...: --reps of each) on the same graph
inputs, at every --load (that many spawned processes spinning on the CPUs meanwhile). Prints each one's median and
IQR over all its samples, queued/old, and the roofline fraction of a dense problem both ways; JSON to --out.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

import torch
from gemm import copy_bandwidth, floor_us, write_json  # bench/gemm.py (this script runs from bench/)
from sqlalchemy import select

from k3tune.errors import K3TuneError
from k3tune.kernels import family
from k3tune.plan.problems import Problem
from k3tune.search.measure_gpu import rotation_sets, time_graph
from k3tune.search.outcome import summarize
from k3tune.store.db import Database
from k3tune.store.models import ProblemRow, Winner


def _spin() -> None:
    while True:
        pass


class CpuLoad:
    """``n`` spawned processes that spin on the CPUs until the block exits."""

    def __init__(self, n: int):
        self.procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]

    def __enter__(self):
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.join()


def winners(path: str, patterns: list[str]) -> list[tuple[Problem, str, dict]]:
    """(problem, winning family, its params) of every problem whose key matches one of ``patterns``."""
    with Database(path, create=False, readonly=True).session() as s:
        out = []
        for pat in patterns:
            rows = s.execute(select(ProblemRow.op, ProblemRow.kind, ProblemRow.dims, Winner.family, Winner.params)
                             .join(ProblemRow, ProblemRow.id == Winner.problem_id)
                             .where(ProblemRow.key.like(pat))).all()
            if not rows:
                raise SystemExit(f"timing_hold: no winner in {path} for a problem key like {pat!r}")
            out += [(Problem(op, kind, tuple(dims.items())), fam, params) for op, kind, dims, fam, params in rows]
    return out


def time_both(fam, problem: Problem, params: dict, samples: int, reps: int) -> dict:
    """Correctness once (poisoned output), then ``reps`` x (old, queued) on one set of rotated inputs."""
    from k3tune.search.outcome import relative_error

    run = fam.build(problem, fam.config_from_params(problem, params))
    gen = torch.Generator(device="cuda").manual_seed(1234)
    inputs = fam.make_inputs(problem, torch.device("cuda"), gen)
    if "out" in inputs:
        inputs["out"].fill_(float("nan"))
    err = relative_error(run(inputs), fam.reference(problem, inputs))
    if not err <= fam.tolerance(problem):
        raise SystemExit(f"timing_hold: {fam.name} on {problem.key}: relative error {err:.3g}")
    sets = rotation_sets(fam, problem, inputs)
    old, new = [], []
    for _ in range(reps):
        old += time_graph(run, sets, samples, queued=False)
        new += time_graph(run, sets, samples, queued=True)
    o, n = summarize(old), summarize(new)  # the median and IQR a sweep records
    return {"old_us": o.median_us, "old_iqr": o.spread_us, "queued_us": n.median_us, "queued_iqr": n.spread_us,
            "queued_over_old": n.median_us / o.median_us}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="../tuning_db/h200.sqlite")
    ap.add_argument("--keys", required=True, help="';'-separated SQL LIKE patterns on problem keys")
    ap.add_argument("--load", default="0,16", help="CPU spinner processes, one run per value")
    ap.add_argument("--samples", type=int, default=14, help="replays per time_graph call (the sweep's round 1)")
    ap.add_argument("--reps", type=int, default=3, help="time_graph calls per method, alternating")
    ap.add_argument("--out", default="timing-hold.json")
    args = ap.parse_args()
    try:
        todo = winners(args.db, [k for k in args.keys.split(";") if k])
    except K3TuneError as e:
        raise SystemExit(f"timing_hold: {e}") from None
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, copy bandwidth {bw / 1e12:.2f} TB/s, db {args.db}; {args.samples} samples x {args.reps} calls "
          "a method", flush=True)
    rows = []
    for load in (int(x) for x in args.load.split(",")):
        with CpuLoad(load):
            for problem, fam_name, params in todo:
                variants = [(fam_name, params)]
                if problem.kind == "gemm" and fam_name != "gemm.cublas":
                    cublas = family("gemm.cublas")
                    variants.append((cublas.name, cublas.default_config(problem).params()))
                for name, knobs in variants:
                    r = {"load": load, "problem": problem.key, "family": name, "params": knobs,
                         **time_both(family(name), problem, knobs, args.samples, args.reps)}
                    roof = ""
                    if problem.kind == "gemm":
                        f = floor_us(problem, bw)
                        r["roof_old"], r["roof_queued"] = f / r["old_us"], f / r["queued_us"]
                        roof = f" roof {r['roof_old']:.3f} -> {r['roof_queued']:.3f}"
                    rows.append(r)
                    write_json(args.out, {"device": dev, "copy_bw": bw, "rows": rows})
                    print(f"load {load:<3}{problem.key[:60]:60} {name:20} old {r['old_us']:8.2f} "
                          f"(iqr {r['old_iqr']:.2f}) queued {r['queued_us']:8.2f} (iqr {r['queued_iqr']:.2f}) "
                          f"x{r['queued_over_old']:.3f}{roof}", flush=True)


if __name__ == "__main__":
    main()
