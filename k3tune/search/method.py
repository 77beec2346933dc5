"""How a backend times a trial, as a digest recorded with every trial (its ``method``).

A stored trial is reused only by a sweep whose backend times the same way: the same measuring code and the same
libraries it times through. A cuBLAS trial timed in an early session by an older measurer (fewer rotated weight
copies, other graph sizes) reads 25.5 us where the current measurer reads 23.96 us; reused beside fresh trials it
made a slower kernel win. The kernel's own source is the family digest, already part of the trial's key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from importlib.metadata import PackageNotFoundError, distributions, version

_CODE = {  # the modules whose source decides the number a backend records
    "gpu": ("k3tune.search.measure_gpu", "k3tune.search.outcome"),
    "cpu": ("k3tune.search.measure_cpu", "k3tune.search.outcome"),
    "simulated": ("k3tune.search.simulate", "k3tune.search.outcome", "k3tune.plan.hardware", "k3tune.plan.links"),
    "collective": ("k3tune.search.measure_collective", "k3tune.search.outcome"),
}
_LIBS = {"gpu": ("torch", "nvidia-cublas"), "cpu": ("torch",), "simulated": (),
         "collective": ("torch", "nvidia-nccl")}  # distributions, by name prefix


def _source(module: str) -> bytes:
    spec = importlib.util.find_spec(module)  # read, not imported: the driver never loads CUDA code
    with open(spec.origin, "rb") as f:
        return f.read()


def _versions(prefix: str) -> list[str]:
    if "-" not in prefix:
        try:
            return [f"{prefix}={version(prefix)}"]
        except PackageNotFoundError:
            return [f"{prefix}=none"]
    return sorted(f"{d.metadata['Name']}={d.version}" for d in distributions()
                  if (d.metadata["Name"] or "").lower().startswith(prefix))


@functools.cache
def method_digest(backend: str) -> str:
    """Digest of what decides how ``backend`` ("gpu", "cpu", "simulated", "collective") times a trial."""
    if backend not in _CODE:
        raise ValueError(f"unknown measurement backend {backend!r}")
    h = hashlib.sha256(backend.encode())
    for m in _CODE[backend]:
        h.update(_source(m))
    for lib in _LIBS[backend]:
        h.update("|".join(_versions(lib)).encode())
    return h.hexdigest()[:16]
