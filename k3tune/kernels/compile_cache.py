"""Compiled CuTe DSL kernels cached on disk, shared by every process of a machine: the sweep's GPU workers
(each otherwise recompiles what another already compiled: compilation was 73% of a measured 1-GPU sweep),
resumed sweeps and serving start-up.

A kernel is keyed by its kind, its compile-time knobs, the target arch, the DSL version and the source of
the modules that generate it: change any and it is a different file. Entries are ELF objects written by the
DSL (``dump_to_object``: host launch code + cubin), written to a temporary file and renamed (a crashed
writer leaves no partial entry), and loaded with ``cute.runtime.load_module``. The cache is an optimisation:
an entry that cannot be written or loaded is compiled again, never an error.

``K3TUNE_KERNEL_CACHE``: the directory (default ``~/.cache/k3tune/kernels``); ``off`` disables it.
Modules behind shipped winners are not edited to use it: ``install()`` routes their ``compiled`` through it
per process (sweep workers, with ``K3TUNE_WORKER_KERNEL_CACHE=1``).

Status: the dump/load round trip is tested on the CPU (tests/test_compile_cache.py); the tensor-core expert
kernels and the fused all-reduce use it; launching a loaded kernel on a GPU is checked by their GPU tests.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path | None:
    from k3tune import settings

    return settings.load().kernel_cache


def entry_name(kind: str, key: tuple, modules: tuple[str, ...]) -> str:
    import cutlass

    src = "".join(_source(m) for m in modules)
    h = hashlib.sha256(repr((kind, key, getattr(cutlass, "__version__", ""), src)).encode()).hexdigest()[:24]
    return f"{kind}-{h}"


def cached_compile(kind: str, key: tuple, modules: tuple[str, ...], compile_fn: Callable):
    """``compile_fn()`` (a ``cute.compile`` call), or the same kernel loaded from the disk cache."""
    root = cache_dir()
    if root is None:
        return compile_fn()
    name = entry_name(kind, key, modules)
    prefix = "k3t_" + name.replace("-", "_").replace(".", "_")
    path = root / f"{name}.o"
    loaded = _load(path, prefix)
    if loaded is not None:
        return loaded
    lock = _lock(root, name)  # another process compiling this kernel: wait for it rather than compile twice
    try:
        loaded = _load(path, prefix)  # written by the lock's previous holder
        if loaded is not None:
            return loaded
        fn = compile_fn()
        COMPILED.append(name)
        try:
            _runtime_for_cpu()
            data = fn.dump_to_object(prefix)
            fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: concurrent writers of one entry leave one whole file
        except Exception:  # caching is an optimisation: the compiled kernel is returned regardless
            pass
        return fn
    finally:
        if lock is not None:
            os.close(lock)  # releases it


COMPILED: list[str] = []  # entries this process compiled (rather than loaded): for tests and reports
LOCK_WAIT_S = 120.0  # longest wait for a live process compiling the same kernel; then compile regardless


def _load(path: Path, prefix: str):
    if not path.exists():
        return None
    try:
        from cutlass.cute.runtime import load_module

        _runtime_for_cpu()
        return getattr(load_module(str(path)), prefix)
    except Exception:  # unreadable or from another DSL build: compile it again (and replace it)
        path.unlink(missing_ok=True)
        return None


def _lock(root: Path, name: str) -> int | None:
    """A descriptor holding the entry's compile lock (``flock``), once no other process holds it; None when
    the cache directory is not writable or the holder is still compiling after LOCK_WAIT_S (compile
    without it). The kernel releases a lock when its holder exits, killed or not, so a worker killed while
    compiling (the sweep's kill -9 test) delays nobody; lock files stay (unlinking one races a waiter)."""
    import fcntl
    import time

    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / f".{name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        return None
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.05)
        except OSError:  # a filesystem without locks: compile
            os.close(fd)
            return None


# kernel modules whose ``compiled(...)`` (hashable knobs + arch) can be put behind the cache without editing
# them (editing a family's module re-keys its shipped winners), and the sources that generate their code
KERNEL_MODULES = {
    "k3tune.kernels.gemm_smallm": ("k3tune.kernels.gemm_smallm", "k3tune.kernels.gemm_common"),
    "k3tune.kernels.gemm_splitk_tc": ("k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_common"),
    "k3tune.kernels.gemm_wgmma": ("k3tune.kernels.gemm_wgmma", "k3tune.kernels.gemm_common"),
    "k3tune.kernels.gemm_stream": ("k3tune.kernels.gemm_stream", "k3tune.kernels.gemm_common"),
    "k3tune.kernels.gemm_splitk_cluster": ("k3tune.kernels.gemm_splitk_cluster", "k3tune.kernels.gemm_splitk_tc",
                                           "k3tune.kernels.gemm_common"),
    "k3tune.kernels.gemm_wgmma_ck": ("k3tune.kernels.gemm_wgmma_ck", "k3tune.kernels.gemm_wgmma",
                                     "k3tune.kernels.gemm_common"),
    "k3tune.kernels.moe_experts": ("k3tune.kernels.moe_experts",),
    "k3tune.kernels.l2_prefetch": ("k3tune.kernels.l2_prefetch",),
}


def install(modules: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """Route these modules' ``compiled`` through the disk cache, in this process (a sweep worker calls it
    when K3TUNE_WORKER_KERNEL_CACHE=1: opt-in until loaded kernels have been checked on a GPU). Returns the
    modules patched; idempotent."""
    import importlib

    done = []
    for name, sources in (modules or KERNEL_MODULES).items():
        mod = importlib.import_module(name)
        if getattr(mod.compiled, "_k3tune_cached", False):
            done.append(name)
            continue
        inner = getattr(mod.compiled, "__wrapped__", mod.compiled)
        kind = name.rsplit(".", 1)[-1]

        def wrapped(*args, _inner=inner, _kind=kind, _sources=sources):
            return cached_compile(_kind, args, _sources, lambda: _inner(*args))

        cached = functools.cache(wrapped)
        cached._k3tune_cached = True
        mod.compiled = cached  # the module's own calls look the name up at call time
        done.append(name)
    return done


@functools.cache
def _source(module: str) -> str:
    import importlib

    return inspect.getsource(importlib.import_module(module))


@functools.cache
def _runtime_for_cpu() -> None:
    """On a machine without a GPU the DSL's host code needs its runtime library loaded globally to be dumped
    or loaded (on a GPU machine the CUDA runtime provides those symbols: nothing is loaded there)."""
    import ctypes

    import torch

    if torch.cuda.is_available():
        return
    import nvidia_cutlass_dsl

    for base in nvidia_cutlass_dsl.__path__:  # a namespace package
        for lib in sorted(Path(base).glob("cu*/lib/libcute_dsl_runtime.so")):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            return
