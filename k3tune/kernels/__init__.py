"""Kernel registry: every family, which problems it implements, and the digests that key tuning results."""

from __future__ import annotations

import functools
import hashlib
from importlib.metadata import PackageNotFoundError, version

from k3tune.errors import ConfigError
from k3tune.kernels.allreduce import TpAllReduce
from k3tune.kernels.base import BACKENDS, KernelConfig, KernelFamily, Work, count_configs, params_key
from k3tune.kernels.cpu_double import CpuGemm
from k3tune.kernels.gemm_cublas import CublasGemm
from k3tune.kernels.gemm_smallm import SmallMGemm
from k3tune.kernels.gemm_splitk_cluster import SplitKClusterGemm
from k3tune.kernels.gemm_splitk_tc import SplitKTensorCoreGemm
from k3tune.kernels.gemm_stream import StreamGemm
from k3tune.kernels.gemm_wgmma import WgmmaGemm
from k3tune.kernels.gemm_wgmma_ck import WgmmaClusterKGemm
from k3tune.kernels.gemm_wgmma_cktrig import WgmmaCkTriggerGemm
from k3tune.kernels.kda_decode import KdaFused, KdaTorch
from k3tune.kernels.mla_decode import MlaSplitKv, MlaTorch
from k3tune.kernels.moe_block import MoeOverlap, MoeStock
from k3tune.plan.problems import OPS, Problem

__all__ = ["FAMILIES", "LANDED_ON", "STAGED", "KernelConfig", "KernelFamily", "Work", "count_configs", "family",
           "families_for", "op_digest", "op_families", "params_key", "safe_default"]

FAMILIES: dict[str, KernelFamily] = {
    f.name: f
    for f in [CublasGemm(), SmallMGemm(), SplitKTensorCoreGemm(), WgmmaGemm(), StreamGemm(), SplitKClusterGemm(),
              WgmmaClusterKGemm(), WgmmaCkTriggerGemm(),
              KdaTorch(), KdaFused(), MlaTorch(),
              MlaSplitKv(), MoeStock(), MoeOverlap(), CpuGemm(), TpAllReduce()]
}

# Families whose GPU code has landed but whose op kind's shipped winners were tuned without them. Adding a family
# to FAMILIES re-keys every winner of the ops it could serve (op_digest), so a staged family is built, tested and
# probed by name (``family``) but offered to a sweep and keyed only where K3TUNE_EXTRA_FAMILIES names it
# (comma-separated; the re-sweep that ships it), until it moves to FAMILIES with that database. (gemm.wgmma was
# staged so until its dense re-sweep shipped, session 12; gemm.stream until session 13's; gemm.splitk_cluster until
# session 14's; gemm.wgmma_ck until session 15's; gemm.wgmma_cktrig, landed on the H100 in session 60 and the H200 in
# session 67, until every shipped table had it, session 67.)
# Session 30's splitk_tma, splitk_ldsm, splitk_xreg and session 54's splitk_alias (87ba501), splitk_pf (b07cf86),
# wgmma_ckr (7c63ab5), splitk_xring (cb67ed7) and session 55's splitk_trig (aabc50e) were staged, refuted on a GPU
# and removed.
STAGED: dict[str, KernelFamily] = {}

# Staged families whose re-sweep has shipped for some hardware but not yet for all: offered and keyed as landed on
# the hardware named here (by its measured class key, ``Fingerprint.class_key``), staged elsewhere, so that one
# table's re-sweep ships without making the others stale. A family moves to FAMILIES when every shipped table has it.
LANDED_ON: dict[str, frozenset[str]] = {}


_EXTRA_ERROR: list[str] = []  # a bad K3TUNE_EXTRA_FAMILIES, raised on first use (an import-time raise is a traceback)


def _extra_families() -> None:
    from k3tune import settings

    _EXTRA_ERROR.clear()
    for name in settings.load().extra_families:
        if name not in STAGED and name not in FAMILIES:
            _EXTRA_ERROR.append(f"K3TUNE_EXTRA_FAMILIES names '{name}', which is no staged family "
                                f"(staged: {', '.join(STAGED) or 'none'})")
            continue
        FAMILIES.setdefault(name, STAGED.get(name))


_extra_families()


def family(name: str) -> KernelFamily:
    _check_extra()
    if name in FAMILIES:
        return FAMILIES[name]
    if name in STAGED:
        return STAGED[name]
    raise ConfigError(f"unknown kernel family '{name}' (known: {', '.join([*FAMILIES, *STAGED])})")


def _check_extra() -> None:
    if _EXTRA_ERROR:
        raise ConfigError(_EXTRA_ERROR[0])


def check_backend(backend: str) -> None:
    """A bad K3TUNE_EXTRA_FAMILIES or backend: ConfigError (a sweep asks before it opens its database)."""
    _check_extra()
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend '{backend}' (known: {', '.join(BACKENDS)})")


def _offered(hardware: str | None) -> list[KernelFamily]:
    """FAMILIES, and the staged families landed on ``hardware`` (a class key; None: on no hardware in particular).
    Its callers have checked K3TUNE_EXTRA_FAMILIES already (``check_backend``)."""
    landed = [STAGED[n] for n, keys in LANDED_ON.items() if hardware in keys and n not in FAMILIES]
    return [*FAMILIES.values(), *landed]


@functools.cache
def _candidates(kind: str, backend: str, hardware: str | None = None) -> tuple[KernelFamily, ...]:
    check_backend(backend)
    found = [f for f in _offered(hardware) if backend in f.backends and kind in f.kinds]
    return tuple(sorted(found, key=lambda f: (f.priority, f.name)))


def families_for(problem: Problem, backend: str, arch: str | None = None,
                 hardware: str | None = None) -> list[KernelFamily]:
    """Families that implement the problem (with at least one valid config) and may run on the backend (and, where
    ``arch`` is given, have code for it), safest first; with ``hardware`` (a class key), those landed on it too."""
    return [f for f in _candidates(problem.kind, backend, hardware)
            if f.supports(arch) and f.can_implement(problem) and f.runs_on(problem, backend) and _has_config(f, problem)]


@functools.lru_cache(maxsize=65536)
def _has_config(f: KernelFamily, problem: Problem) -> bool:
    """A family can admit a problem's shape yet have no valid config for it (e.g. the small-M GEMM's warps
    over a K of 224): such a family is not offered, searched or served."""
    from k3tune.errors import CannotImplement

    try:
        f.default_config(problem)
        return True
    except CannotImplement:
        return False


@functools.cache
def _dsl_version() -> str:
    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:  # recorded as such, and part of the key all the same
        return "none"


def op_families(op: str, backend: str, hardware: str | None = None) -> list[KernelFamily]:
    """Every family that may serve the op on the backend (whether or not it implements a given shape); with
    ``hardware`` (a class key), the staged families landed on it too."""
    check_backend(backend)
    kind = OPS[op].kind if op in OPS else op
    return [f for f in _offered(hardware)
            if backend in f.backends and kind in f.kinds and (f.ops is None or op in f.ops)]


@functools.cache
def op_digest(op: str, backend: str, hardware: str | None = None) -> str:
    """Digest of every family that may serve the op on the backend (on ``hardware``, a class key: see LANDED_ON):
    a change to any of them, or a family added or removed, makes the op's tuned winners stale. On a GPU an op that
    runs other ops' tuned kernels (``OpDef.runs``: the MoE block's dense projections) also takes their digests: a
    dense kernel changed under a block makes the block's winners stale too. (The simulated block models its dense
    phases itself.) Hardware with no landed family digests as ``hardware=None``."""
    parts = sorted(f"{f.name}:{f.digest}" for f in op_families(op, backend, hardware))
    parts.append(f"cutlass-dsl:{_dsl_version()}" if backend == "gpu" else "")
    if backend == "gpu" and op in OPS:
        parts += [f"runs {r}:{op_digest(r, backend, hardware)}" for r in OPS[op].runs]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def safe_default(problem: Problem) -> tuple[KernelFamily, KernelConfig]:
    """What serving runs without a tuned entry: the safest family that has real GPU code."""
    for f in families_for(problem, "gpu"):
        return f, f.default_config(problem)
    for f in families_for(problem, "simulated"):  # blocks whose executor has not landed: still named
        return f, f.default_config(problem)
    raise ConfigError(f"no kernel family implements {problem.key}")
