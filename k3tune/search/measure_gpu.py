"""The GPU measurer: correctness first, then timing under decode conditions.

For each candidate:
1. build it (compile time recorded apart);
2. run it once on fresh random inputs with its output poisoned (NaN) and compare with the fp32 torch
   reference: a result over the family's bound is ``wrong_result`` and is not timed;
3. capture a CUDA graph of many launches that cycle through enough copies of the weights to exceed L2
   (decode reads weights from HBM), warm up, then time replays with CUDA events — on ``ALLOC_ROUNDS``
   independent allocations of those copies where they are small (dense GEMMs), ``samples`` replays in all;
   the per-launch median and interquartile range over every replay are recorded. The replays and their events
   are queued behind a spin on the GPU, so no replay waits on the host (see ``time_graph``).
A CUDA error poisons the context: the outcome says so and the worker is replaced.
"""

from __future__ import annotations

import math
import os
import time

from k3tune.errors import CannotImplement
from k3tune.kernels import family as get_family
from k3tune.search.outcome import Outcome, Task, relative_error, summarize

ROTATE_L2_FACTOR = 3  # weight copies span at least this many L2 capacities
ALLOC_ROUNDS = 3  # each trial is timed on this many independent allocations of its weights ...
ROUNDS_MAX_BYTES = 2 << 30  # ... where one round's weight copies fit in this (a block's are timed on one)
MAX_ROTATION_BYTES = 8 << 30
MIN_LAUNCHES = 20  # per graph: amortises the GPU's own cost of starting a replay
WARMUP_REPLAYS = 3
HOLD_CYCLES = 4_000_000  # SM clock cycles (~2 ms at 1.98 GHz) the GPU spins while the host queues the timed replays


def _l2_bytes() -> int:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 << 20))


def _weight_bytes(inputs: dict, names) -> int:
    return sum(inputs[n].numel() * inputs[n].element_size() for n in names)


def rotation_sets(fam, problem, inputs: dict) -> list[dict]:
    """Copies of the inputs whose weights sit at distinct addresses, enough that their bytes exceed L2 several
    times. Each copy is a clone of the inputs' weights (L2 holds addresses, not values: the same random numbers
    at another address miss it alike); a clone is one copy kernel, where making every copy's inputs anew (all of
    them, with their workspaces) cost the worker ~0.15 ms of CPU each, 40-57 copies per round for the small
    projections."""
    names = fam.weight_names(problem)
    wbytes = _weight_bytes(inputs, names)
    if not names or wbytes == 0:
        return [inputs]
    n = max(1, math.ceil(ROTATE_L2_FACTOR * _l2_bytes() / wbytes))
    n = min(n, max(1, MAX_ROTATION_BYTES // wbytes), 256)
    return [inputs] + [{**inputs, **{k: inputs[k].clone() for k in names}} for _ in range(n - 1)]


def alloc_rounds(fam, problem, inputs: dict) -> int:
    """How many allocation rounds a trial gets: ALLOC_ROUNDS where its weights are small enough to make again
    cheaply, else 1 (and 1 where it has no weights to move)."""
    names = fam.weight_names(problem)
    wbytes = _weight_bytes(inputs, names)
    if not names or wbytes == 0:
        return 1
    return ALLOC_ROUNDS if max(wbytes, ROTATE_L2_FACTOR * _l2_bytes()) <= ROUNDS_MAX_BYTES else 1


def time_rounds(run, fam, problem, inputs: dict, generator, samples: int, rounds: int) -> list[list[float]]:
    """Per round, the per-launch times of ``run`` on its own allocation of the weight copies (round 0 on
    ``inputs``' own weights), ``samples`` replays split among the rounds. Every round's buffers are held until the
    last is timed, so each lands on fresh memory. Where the weights sit in HBM moves some shapes' times by up to
    10%, bimodally (bench/alloc_spread.py on the H200, session 8), which the replays of one graph never show: a
    trial timed on one allocation can win or lose on its luck."""
    names = fam.weight_names(problem)
    held, out = [], []
    per = max(3, samples // rounds) if rounds > 1 else samples
    for r in range(rounds):
        base = inputs
        if r:
            fresh = fam.make_inputs(problem, inputs[names[0]].device, generator)
            base = {**inputs, **{k: fresh[k] for k in names}}
        sets = rotation_sets(fam, problem, base)
        held.append(sets)
        out.append(time_graph(run, sets, per))
    return out


class GpuBackend:
    kind = "gpu"

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("GpuBackend needs a CUDA GPU")
        torch.cuda.init()
        self.device = torch.device("cuda", torch.cuda.current_device())
        if os.environ.get("K3TUNE_WORKER_KERNEL_CACHE") == "1":  # share compiled kernels with the other workers
            from k3tune.kernels.compile_cache import install

            install()

    def measure(self, task: Task) -> Outcome:
        import torch

        fam = get_family(task.family)
        try:
            cfg = fam.config_from_params(task.problem, task.params)
        except CannotImplement as e:
            return Outcome("invalid", error=str(e))
        t0 = time.perf_counter()
        try:
            run = fam.build(task.problem, cfg)
        except CannotImplement as e:
            return Outcome("invalid", error=str(e))
        except Exception as e:  # DSL/MLIR compile errors have no common base class
            return Outcome("compile_failed", error=f"{type(e).__name__}: {str(e)[:500]}")
        compile_s = time.perf_counter() - t0
        try:
            return self._check_and_time(fam, task, run, compile_s)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            return Outcome("runtime_failed", error=f"out of memory: {str(e)[:300]}", compile_s=compile_s)
        except RuntimeError as e:  # CUDA errors (torch.AcceleratorError is one) poison the context
            return Outcome("runtime_failed", error=str(e)[:500], compile_s=compile_s, poisoned=True)

    def _check_and_time(self, fam, task: Task, run, compile_s: float) -> Outcome:
        import torch

        gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(os.urandom(4), "little"))
        inputs = fam.make_inputs(task.problem, self.device, gen)
        if "out" in inputs:
            inputs["out"].fill_(float("nan"))
        out = run(inputs)
        torch.cuda.synchronize()
        err = relative_error(out, fam.reference(task.problem, inputs))
        tol = fam.tolerance(task.problem)
        if not err <= tol:
            return Outcome("wrong_result", error=f"relative error {err:.3g} > {tol:.3g}", compile_s=compile_s)

        per_round = time_rounds(run, fam, task.problem, inputs, gen, task.samples,
                                alloc_rounds(fam, task.problem, inputs))
        return summarize([t for r in per_round for t in r], compile_s=compile_s)


def time_graph(run, sets: list[dict], samples: int, warmup_ms: float = 0.0, queued: bool = True) -> list[float]:
    """Per-launch times (us) of ``run``: a CUDA graph of many launches cycling through the rotation sets,
    warmed up (WARMUP_REPLAYS replays, then more until ``warmup_ms`` have passed), then replayed ``samples``
    times between CUDA events.

    ``queued``: the timed replays and their events are all queued behind a ``HOLD_CYCLES`` spin on the GPU, then
    synchronised once, so the GPU never waits on the host inside a sample. Synchronising after each sample
    instead (``queued=False``, the method up to session 27, kept for bench/timing_hold.py's comparison) leaves
    the stream idle when the next sample's start event is recorded: the host's graph launch then falls inside
    the sample, and a host thread descheduled there (a sweep's compile farm keeps the CPUs busy) adds its
    whole stall to it (s27: 11-15% of the re-measured block trials with an IQR above 3% of their median)."""
    import torch

    launches = max(MIN_LAUNCHES, len(sets))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the allocator and any lazy init outside the capture
        for s in sets[:2]:
            run(s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            run(sets[i % len(sets)])
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < warmup_ms:
        graph.replay()
        torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    if queued:
        torch.cuda._sleep(HOLD_CYCLES)
    for a, b in pairs:
        a.record()
        graph.replay()
        b.record()
        if not queued:
            b.synchronize()
    torch.cuda.synchronize()
    del graph
    return [a.elapsed_time(b) * 1000.0 / launches for a, b in pairs]
