"""Compiling a sweep's candidate kernels ahead, on the machine's CPU cores, into the shared disk cache.

CuTe DSL compilation runs on the CPU and took ~70% of a measured dense sweep: each GPU worker compiled the
kernel it was about to time, one at a time, and two workers often compiled the same one. A farm of
``procs`` spawned CPU processes (no CUDA context) compiles the candidates each search will queue (its default,
seeds, warm starts, or its whole space when that is small), for every problem of the sweep in claim order
(``submit_known``: a backlog fed to the processes a few at a time), so that it compiles ahead of the workers rather
than racing them for the problem they have just opened, and builds what an open problem needs next (``submit``)
before the backlog. The workers load them from the cache (kernels/compile_cache.py, whose per-entry lock makes
a worker wait for a compile in progress instead of repeating it). The driver asks ``ready`` before it hands a
candidate out and hands out first those whose kernels are built, so that a worker waits on a compile only when no
built candidate is left to measure (a measured 2-GPU sweep had both GPUs idle for seconds while their workers
waited on big tensor-core builds).

Farmed: the families whose ``build`` compiles eagerly from knobs and shapes alone (``FARMED``), and any family
with a ``prebuild(problem, cfg)`` that compiles, from the knobs alone, the kernels its ``build`` would compile
later (a block family builds its executor at measurement time, on the GPU worker; its prebuild compiles that
executor's tuned kernels here). The farm is an optimisation: a failed or slow compile here only means the worker
compiles it itself (and records a failure, if any).
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import Future, ProcessPoolExecutor

from k3tune.plan.problems import Problem

# families whose build() compiles its kernel from the problem and the config alone (no GPU memory needed)
FARMED = frozenset({"gemm.smallm", "gemm.splitk_tc", "gemm.stream", "gemm.wgmma", "gemm.splitk_cluster",
                    "gemm.wgmma_ck"})


def _prebuild(fam):
    """The family's ``prebuild`` (compiles its kernels from knobs alone), or None."""
    fn = getattr(fam, "prebuild", None)
    return fn if callable(fn) else None


@functools.cache
def farmed(family: str) -> bool:
    """Whether the farm builds this family's candidates: FARMED, or the family has a ``prebuild``."""
    from k3tune.errors import K3TuneError
    from k3tune.kernels import family as get_family

    if family in FARMED:
        return True
    try:
        return _prebuild(get_family(family)) is not None
    except K3TuneError:  # not registered here
        return False


def _init(arch: str) -> None:
    # not niced: a worker that needs a kernel the farm is building waits on that build (the cache's per-entry
    # lock), so a niced farm slowed the workers (measured on 2 H200s: 76 s of worker time in builds vs 46 s)
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    from k3tune.kernels import compile_cache

    compile_cache.install()


def _compile(problem: Problem, family: str, params: dict) -> str:
    from k3tune.kernels import family as get_family

    fam = get_family(family)
    cfg = fam.config_from_params(problem, params)
    (_prebuild(fam) or fam.build)(problem, cfg)
    return family


def default_procs(workers: int) -> int:
    """The farm's size when the user names none: every CPU core this process may use, less one per GPU worker
    and one for the driver, at most 8 per worker (compiles outrun measurements well before that) and 64 in all
    (each process holds a compiler in memory)."""
    return max(0, min(usable_cores() - workers - 1, 8 * workers, 64))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class CompileFarm:
    """``with CompileFarm(procs, arch) as farm: farm.submit(problem, family, params)``; duplicates are
    submitted once. ``procs`` 0 makes every call a no-op.

    Two queues: ``submit`` (a candidate wanted soon: an open problem's next TPE sample or queued candidate) goes
    to the processes at once; ``submit_known`` (every problem's known candidates, for problems opened later) goes
    to a backlog that feeds the processes only while fewer than ``depth`` builds are queued or running. The
    processes take work in order, so with every known candidate submitted at once (1638 for the dense H200 spec,
    ~160 s of builds on 29 processes) a TPE sample waited behind all of them: on 2 H200s, 53 of the 55 builds
    that held a worker up were TPE samples (41 of its 46 s inside builds)."""

    def __init__(self, procs: int, arch: str, depth: int | None = None):
        import multiprocessing as mp

        self.procs = procs
        self.depth = 2 * procs if depth is None else depth
        self.pool = (ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"), initializer=_init,
                                         initargs=(arch,)) if procs > 0 else None)
        self.futures: dict[tuple[str, str, str], Future] = {}
        self.backlog: dict[tuple[str, str, str], tuple[Problem, str, dict]] = {}  # in order, not yet submitted
        self._queued: set[Future] = set()  # submitted, not known to be done

    def __enter__(self) -> CompileFarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _key(problem: Problem, family: str, params: dict) -> tuple[str, str, str]:
        from k3tune.kernels import params_key

        return (problem.key, family, params_key(params))

    def _start(self, key, problem: Problem, family: str, params: dict) -> None:
        f = self.pool.submit(_compile, problem, family, params)
        self.futures[key] = f
        self._queued.add(f)

    def submit(self, problem: Problem, family: str, params: dict) -> bool:
        """Build one candidate's kernel now (ahead of the backlog); False when not farmed (family, already
        submitted, or no farm)."""
        key = self._key(problem, family, params)
        if self.pool is None or not farmed(family) or key in self.futures:
            return False
        self.backlog.pop(key, None)
        self._start(key, problem, family, params)
        return True

    def top_up(self) -> int:
        """Feed the backlog to the processes while fewer than ``depth`` builds are queued or running; how many."""
        if self.pool is None:
            return 0
        self._queued = {f for f in self._queued if not f.done()}
        return self._feed(self.depth)

    def _feed(self, depth: float) -> int:
        """Start backlog builds in order while fewer than ``depth`` are queued; how many."""
        n = 0
        while self.backlog and len(self._queued) < depth:
            key = next(iter(self.backlog))
            self._start(key, *self.backlog.pop(key))
            n += 1
        return n

    def ready(self, problem: Problem, family: str, params: dict) -> bool:
        """False only while the farm is compiling (or has queued) this candidate's kernel: a worker handed it
        now would wait. Anything the farm does not build (no farm, a family not farmed, never submitted, or
        still in the backlog) is ready as far as the farm can tell."""
        f = self.futures.get(self._key(problem, family, params))
        return f is None or f.done()

    def submit_known(self, problems: list[Problem], backend: str, settings, warm_for,
                     hardware: str | None = None) -> int:
        """Every problem's candidates known before anything is measured (defaults, seeds, warm starts
        ``warm_for(problem)``, a small space whole) among the families offered on ``hardware`` (a class key), into
        the backlog in the given order (claim order), so that the farm compiles ahead of the workers without holding
        up what they need now. Returns how many."""
        from k3tune.kernels import families_for
        from k3tune.search.strategy import known_candidates

        n = 0
        for p in problems if self.pool is not None else ():
            fams = families_for(p, backend, hardware=hardware)
            if any(farmed(f.name) for f in fams):
                for cand in known_candidates(p, fams, settings, warm_for(p)):
                    key = self._key(p, cand.family, cand.params)
                    if farmed(cand.family) and key not in self.futures and key not in self.backlog:
                        self.backlog[key] = (p, cand.family, cand.params)
                        n += 1
        self.top_up()
        return n

    def wait(self) -> tuple[int, int]:
        """Build everything submitted and in the backlog, and block until done: (done, failed). For tests and
        reports."""
        if self.pool is not None:
            self._feed(math.inf)
        failed = 0
        for f in self.futures.values():
            try:
                f.result()
            except Exception:  # the worker will compile it itself and record what fails
                failed += 1
        return len(self.futures), failed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
