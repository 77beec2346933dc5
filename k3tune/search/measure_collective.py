"""Measuring TP collectives on a group of this machine's GPUs (the ``allreduce`` problems).

A one-GPU sweep worker cannot run a collective, so these problems are measured here: one spawned process
per GPU of the group, NCCL with NVLink SHARP off and no multicast anywhere (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). For each problem every rank builds its inputs
(kernels/allreduce.py: distinct o_proj weights per layer, a symmetric-memory buffer), and for each variant:

- correctness first: the outputs poisoned, one step run, the new residual and its RMSNorm compared with an
  fp32 reference (every rank's partial product all-gathered, summed in rank order); a failure on any rank is
  the variant's failure on all (``all_gather_object``), recorded and not timed;
- then timing: a CUDA graph of ``layers`` steps replayed after a warm-up, all ranks together; the variant's
  time per step is the slowest rank's median (and that rank's interquartile range).

Rank 0 appends each result to a JSON-lines file as it lands, after a ``start`` line. A variant that crashes
or hangs the group (the parent's deadline) costs that variant: it is recorded as failed, the group is torn
down, and a fresh group measures what is left.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from k3tune.plan.problems import Problem
from k3tune.search.outcome import Outcome, relative_error, summarize

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(items: list[tuple[Problem, list[dict]]], gpus: int, *, layers: int = 8, samples: int = 20,
            deadline_s: float = 120.0, tolerance: float = 2e-2) -> dict[tuple[str, str], Outcome]:
    """Outcome per (problem key, params key) for each problem's list of params (``{"variant": ...}``), on a
    group of ``gpus`` processes (GPUs 0..gpus-1). ``deadline_s``: the longest one variant may take before
    the group is declared hung."""
    import torch.multiprocessing as mp

    from k3tune.kernels.base import params_key

    results: dict[tuple[str, str], Outcome] = {}
    todo = [(p, prm) for p, prms in items for prm in prms]
    with tempfile.TemporaryDirectory(prefix="k3tune-collective-") as tmp:
        attempt = 0
        while todo:
            attempt += 1
            log = Path(tmp) / f"results{attempt}.jsonl"
            ctx = mp.get_context("spawn")
            env = {**NO_MULTICAST, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
            procs = [ctx.Process(target=_rank_main, args=(r, gpus, env, todo, str(log), layers, samples, tolerance),
                                 daemon=True) for r in range(gpus)]
            for p in procs:
                p.start()
            last = time.monotonic()
            seen = 0
            while any(p.is_alive() for p in procs):
                time.sleep(0.2)
                lines = log.read_text().splitlines() if log.exists() else []
                if len(lines) > seen:
                    seen, last = len(lines), time.monotonic()
                if time.monotonic() - last > deadline_s or any(p.exitcode not in (None, 0) for p in procs):
                    break
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            before, started = len(results), None
            for line in (log.read_text().splitlines() if log.exists() else []):
                rec = json.loads(line)
                if "start" in rec:
                    started = (rec["start"], rec["params_key"])
                else:
                    results[(rec["problem"], rec["params_key"])] = Outcome(**rec["outcome"])
                    started = None
            codes = [q.exitcode for q in procs]
            if started is not None:  # the variant that crashed or hung the group: it alone is lost
                why = "the group hung" if all(c in (None, -9) for c in codes) else f"ranks exited with {codes}"
                results[started] = Outcome("runtime_failed", error=f"{why} while measuring it")
            left = [(p, prm) for p, prm in todo if (p.key, params_key(prm)) not in results]
            if left and len(results) == before:  # no progress and no culprit: the group cannot run at all
                for p, prm in left:
                    results[(p.key, params_key(prm))] = Outcome(
                        "runtime_failed", error=f"the group of {gpus} GPUs did not start (exit codes {codes})")
                left = []
            todo = left
    return results


def _rank_main(rank: int, world: int, env: dict, todo: list, log: str, layers: int, samples: int,
               tolerance: float) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from k3tune.kernels.allreduce import (
        AllReduceConfig,
        rank_inputs,
        rank_reference,
        rank_step,
    )
    from k3tune.kernels.base import params_key
    from k3tune.search.measure_gpu import time_graph

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)

    def write(rec: dict) -> None:
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def agreed(local):
        every = [None] * world
        dist.all_gather_object(every, local)
        return every

    by_problem: dict[str, tuple[Problem, list[dict]]] = {}
    for p, prm in todo:
        by_problem.setdefault(p.key, (p, []))[1].append(prm)
    try:
        for problem, prms in by_problem.values():
            inputs = rank_inputs(problem, rank, layers, dev)
            ref, ref_n = rank_reference(inputs)
            for prm in prms:
                key = params_key(prm)
                write({"start": problem.key, "params_key": key})
                failure = None
                try:
                    step = rank_step(AllReduceConfig(**prm), inputs)
                    inputs["out"].fill_(float("nan"))
                    inputs["normed"].fill_(float("nan"))
                    h, n = step(0)
                    torch.cuda.synchronize()
                    err = max(relative_error(h, ref), relative_error(n, ref_n))
                    if err > tolerance:
                        failure = ("wrong_result", f"relative error {err:.3g} > {tolerance}")
                except Exception as e:  # reported on every rank, then skipped
                    failure = ("runtime_failed", f"{type(e).__name__}: {str(e)[:300]}")
                failures = [f for f in agreed(failure) if f]
                if failures:
                    write({"problem": problem.key, "params_key": key,
                           "outcome": asdict(Outcome(failures[0][0], error=failures[0][1]))})
                    continue
                dist.barrier()
                try:  # a capture can fail where eager runs did: the same on every rank
                    times = time_graph(lambda _, s=step: [s(i) for i in range(layers)], [{}], samples)
                    mine = summarize([t / layers for t in times])
                    local = (mine.median_us, mine.spread_us, mine.samples)
                except Exception as e:
                    local = f"{type(e).__name__}: {str(e)[:300]}"
                every = agreed(local)
                bad = [v for v in every if isinstance(v, str)]
                if bad:
                    out = Outcome("runtime_failed", error=bad[0])
                else:
                    med, spread, n_s = max(every)  # the slowest rank sets the step's time
                    out = Outcome("ok", median_us=med, spread_us=spread, samples=n_s)
                write({"problem": problem.key, "params_key": key, "outcome": asdict(out)})
            del inputs
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def fastest(outcomes: dict[str, Outcome], order: list[str]) -> str | None:
    """The params key to record as winner: the fastest median; a statistical tie (within the faster one's
    spread) goes to the earlier entry of ``order`` (safest first)."""
    ok = {k: o for k, o in outcomes.items() if o.status == "ok"}
    if not ok:
        return None
    best = min(ok, key=lambda k: ok[k].median_us)
    for k in order:
        if k in ok and ok[k].median_us <= ok[best].median_us + (ok[best].spread_us or 0.0):
            return k
    return best


