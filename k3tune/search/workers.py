"""One measurement worker process per GPU, started with ``spawn`` and pinned with CUDA_VISIBLE_DEVICES.

A candidate that crashes its worker, hangs past the trial timeout, or poisons the CUDA context costs one
trial: the pool records the failure, starts a fresh worker on the same GPU, and the sweep goes on.

A GPU that is lost (its worker fails to start ``RETIRE_AFTER`` times in a row: a start is where CUDA is
initialised, so kernels cannot cause it) is retired with a warning: the sweep goes on with the others, and
stops with WorkerError only when every worker is retired. Workers see K3TUNE_WORKER_SLOT and
K3TUNE_WORKER_RESTARTS in their environment.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from k3tune.errors import WorkerError
from k3tune.search.outcome import Outcome, Task

STARTUP_TIMEOUT_S = 300.0
RETIRE_AFTER = 2  # consecutive failed starts of one slot's worker: its GPU is taken as lost


def make_backend(spec: tuple):
    kind = spec[0]
    if kind == "simulated":
        from k3tune.plan.hardware import spec as hw_spec
        from k3tune.search.simulate import SimulatedBackend

        return SimulatedBackend(hw_spec(spec[1]), seed=spec[2])
    if kind == "cpu":
        from k3tune.search.measure_cpu import CpuBackend

        return CpuBackend()
    if kind == "gpu":
        from k3tune.search.measure_gpu import GpuBackend

        return GpuBackend()
    raise ValueError(f"unknown backend {kind}")


def worker_main(conn: Connection, backend_spec: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    t0 = time.monotonic()
    try:
        backend = make_backend(backend_spec)
    except Exception as e:  # report why the worker cannot serve, then exit
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid(), time.monotonic() - t0))  # seconds its backend took to start (CUDA init)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        wall, cpu = time.perf_counter(), time.process_time()
        outcome = backend.measure(task)
        # where a worker's time goes: wall vs its CPU time (less CPU than wall: it waited, descheduled or blocked)
        conn.send((task.task_id, outcome, time.perf_counter() - wall, time.process_time() - cpu))
        if outcome.poisoned:
            return


@dataclass
class _Slot:
    index: int
    proc: mp.Process | None = None
    conn: Connection | None = None
    task: Task | None = None
    deadline: float = 0.0
    ready: bool = False
    restarts: int = 0
    start_failures: int = 0  # consecutive
    retired: str | None = None  # why this slot's GPU was given up
    started: float = field(default_factory=time.monotonic)
    ready_after: float | None = None  # seconds from the process start until it reported ready
    backend_s: float | None = None  # of which its backend's start (the rest: spawn and imports)


class WorkerPool:
    def __init__(self, n: int, backend_spec: tuple, trial_timeout_s: float, pin_gpus: bool, env: dict | None = None):
        self.backend_spec = backend_spec
        self.env = dict(env or {})  # extra environment for every worker
        self.timeout = trial_timeout_s
        self.pin = pin_gpus
        self.ctx = mp.get_context("spawn")
        self.slots = [_Slot(i) for i in range(n)]
        self.replaced = 0
        self.busy_s = 0.0  # summed over workers and trials: wall seconds inside measure() ...
        self.busy_cpu_s = 0.0  # ... and the worker's CPU seconds in them
        self.retired: list[str] = []
        self._started = False

    def start(self) -> WorkerPool:
        """Start every slot's worker (once: a pool started early is not started again by ``with``)."""
        if not self._started:
            self._started = True
            for s in self.slots:
                self._start(s)
        return self

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, slot: _Slot) -> None:
        parent, child = self.ctx.Pipe()
        child_env = {**self.env, "K3TUNE_WORKER_SLOT": str(slot.index), "K3TUNE_WORKER_RESTARTS": str(slot.restarts)}
        if self.pin:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            child_env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[slot.index] if visible else str(slot.index)
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)  # spawn copies the parent's environment at start()
        try:
            proc = self.ctx.Process(target=worker_main, args=(child, self.backend_spec), daemon=True,
                                    name=f"k3tune-worker-{slot.index}")
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        slot.proc, slot.conn, slot.task, slot.ready = proc, parent, None, False
        slot.started = time.monotonic()

    def _kill(self, slot: _Slot) -> None:
        if slot.proc is not None and slot.proc.is_alive():
            slot.proc.kill()
        if slot.proc is not None:
            slot.proc.join(5)
        if slot.conn is not None:
            slot.conn.close()

    def _replace(self, slot: _Slot) -> None:
        self._kill(slot)
        slot.restarts += 1
        self.replaced += 1
        self._start(slot)

    def _start_failed(self, slot: _Slot, why: str) -> None:
        """A worker that could not start: try once more, then retire the slot (its GPU is lost)."""
        slot.start_failures += 1
        if slot.start_failures < RETIRE_AFTER:
            self._replace(slot)
            return
        self._kill(slot)
        slot.proc, slot.conn, slot.task, slot.ready, slot.retired = None, None, None, False, why
        self.retired.append(f"worker {slot.index}: {why}")
        if all(s.retired for s in self.slots):
            more = f" (all {len(self.slots)} workers retired)" if len(self.slots) > 1 else ""
            raise WorkerError(f"measurement worker {slot.index} {why}{more}")

    def idle(self) -> list[int]:
        return [s.index for s in self.slots if s.ready and s.task is None]

    def startup(self) -> list[dict]:
        """Per slot, how its current worker's start went: seconds until ready, and the backend's share."""
        return [{"slot": s.index, "ready_s": s.ready_after, "backend_s": s.backend_s} for s in self.slots]

    def all_ready(self) -> bool:
        """Every slot that has not been retired has a worker that reported ready (and may be busy)."""
        return all(s.ready for s in self.slots if not s.retired)

    def busy(self) -> int:
        return sum(1 for s in self.slots if s.task is not None)

    def submit(self, index: int, task: Task) -> None:
        slot = self.slots[index]
        slot.task = task
        slot.deadline = time.monotonic() + self.timeout
        slot.conn.send(task)

    def poll(self, timeout: float) -> list[tuple[Task, Outcome]]:
        """Finished tasks, including those lost to a crashed or hung worker."""
        done: list[tuple[Task, Outcome]] = []
        conns = {s.conn: s for s in self.slots if s.conn is not None}
        now = time.monotonic()
        waits = [s.deadline - now for s in self.slots if s.task is not None]
        for ready in wait(list(conns), timeout=max(0.0, min([timeout, *waits]))):
            slot = conns[ready]
            try:
                msg = ready.recv()
            except (EOFError, OSError):
                slot.proc.join(5)
                code = slot.proc.exitcode
                if slot.task is not None:
                    why = f"worker died (signal {-code})" if code and code < 0 else f"worker exited with code {code}"
                    done.append((slot.task, Outcome("runtime_failed", error=why)))
                elif not slot.ready:
                    self._start_failed(slot, f"died while starting (exit code {code})")
                    continue
                self._replace(slot)
                continue
            if msg[0] == "ready":
                slot.ready, slot.start_failures = True, 0
                slot.ready_after = time.monotonic() - slot.started
                slot.backend_s = msg[2]
            elif msg[0] == "error":
                self._start_failed(slot, f"cannot start: {msg[1]}")
            else:
                task, slot.task = slot.task, None
                done.append((task, msg[1]))
                self.busy_s += msg[2]
                self.busy_cpu_s += msg[3]
                if msg[1].poisoned:
                    self._replace(slot)
        now = time.monotonic()
        for slot in self.slots:
            if slot.task is not None and now > slot.deadline:
                done.append((slot.task, Outcome("timeout", error=f"no result within {self.timeout:.0f} s")))
                self._replace(slot)
            elif not slot.ready and not slot.retired and now - slot.started > STARTUP_TIMEOUT_S:
                self._start_failed(slot, f"did not start within {STARTUP_TIMEOUT_S:.0f} s")
        return done

    def close(self) -> None:
        """Stop every worker; a closed pool is never started (again)."""
        self._started = True
        for s in self.slots:
            try:
                if s.conn is not None and s.proc is not None and s.proc.is_alive():
                    s.conn.send(None)
            except OSError:
                pass
        for s in self.slots:
            if s.proc is not None:
                s.proc.join(2)
            self._kill(s)
