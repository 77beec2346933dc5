"""The CPU backend: times families that run on the CPU (the test double and torch baselines) for real,
checking each against its fp32 reference on fresh random inputs first. Labelled ``cpu``, never served."""

from __future__ import annotations

import os
import time

from k3tune.errors import CannotImplement
from k3tune.kernels import family as get_family
from k3tune.search.outcome import Outcome, Task, relative_error, summarize


class CpuBackend:
    kind = "cpu"

    def __init__(self) -> None:
        from k3tune.kernels.cpu_double import check_device

        check_device()  # first: a 'device' that is lost fails its worker's start at once
        import torch  # noqa: F401  start-up, before the worker reports ready (as the GPU backend's CUDA init):
        # imported by the first trial instead, it ran under that trial's timeout (on a loaded 2-core CI machine
        # a crash trial read as a timeout)

    def measure(self, task: Task) -> Outcome:
        import torch

        fam = get_family(task.family)
        try:
            cfg = fam.config_from_params(task.problem, task.params)
        except CannotImplement as e:
            return Outcome("invalid", error=str(e))
        t0 = time.perf_counter()
        run = fam.build(task.problem, cfg)
        compile_s = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        inputs = fam.make_inputs(task.problem, "cpu", gen)
        try:
            out = run(inputs)
        except RuntimeError as e:
            return Outcome("runtime_failed", error=str(e)[:500], compile_s=compile_s, poisoned=True)
        err = relative_error(out, fam.reference(task.problem, inputs))
        if err > fam.tolerance(task.problem):
            return Outcome("wrong_result", error=f"relative error {err:.3g} > {fam.tolerance(task.problem):.3g}",
                           compile_s=compile_s)
        times = []
        for _ in range(task.samples):
            t = time.perf_counter()
            run(inputs)
            times.append((time.perf_counter() - t) * 1e6)
        return summarize(times, compile_s=compile_s)
