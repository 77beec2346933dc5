"""Small-M decode GEMM (M <= 16): CUDA-core FMA, 16-byte weight loads, K split across warps and CTAs.

Space declared here for the simulated backend; the CuTe DSL kernel lands with the GEMM issue, until then the
family is ``declared_only`` and never offered to a GPU sweep.
Knobs: output rows per CTA, warps per CTA, split-K across CTAs (reduced by a second pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.plan.problems import Problem

MAX_M = 16
VEC = 8  # bf16 elements per 16-byte load


@dataclass(frozen=True)
class SmallMConfig(KernelConfig):
    rows_per_cta: int = 4
    warps: int = 4
    split_k: int = 1


class SmallMGemm(KernelFamily):
    name = "gemm.smallm"
    kinds = frozenset({"gemm"})
    config_cls = SmallMConfig
    backends = frozenset({"simulated"})
    declared_only = True
    priority = 30

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and problem["M"] <= MAX_M and problem["K"] % VEC == 0

    def space(self, problem: Problem) -> dict[str, tuple]:
        n = problem["N"]
        return {
            "rows_per_cta": tuple(r for r in (1, 2, 4, 8) if n % r == 0),
            "warps": (2, 4, 8),
            "split_k": (1, 2, 4, 8, 16),
        }

    def valid(self, cfg: SmallMConfig, problem: Problem) -> bool:
        # each split of K gets whole 16-byte vectors and at least one vector per lane of a warp
        k = problem["K"]
        return k % (cfg.split_k * VEC) == 0 and k // cfg.split_k >= 32 * VEC

    def default(self, problem: Problem) -> SmallMConfig:
        n = problem["N"]
        split = 1 if n >= 4096 else 4
        return SmallMConfig(rows_per_cta=4 if n % 4 == 0 else 1, warps=4, split_k=split)

    def work(self, problem: Problem, cfg: SmallMConfig) -> Work:
        m, n, k = problem["M"], problem["N"], problem["K"]
        ctas = math.ceil(n / cfg.rows_per_cta) * cfg.split_k
        partial = (cfg.split_k - 1) * m * n * 4 * 2
        return Work(
            hbm_bytes=gemm_common.gemm_bytes(problem) + partial,
            flops=gemm_common.gemm_flops(problem),
            ctas=ctas,
            inflight_bytes_per_cta=cfg.warps * 32 * 16 * min(cfg.rows_per_cta, 4),
            ctas_per_sm=min(16, 2048 // (cfg.warps * 32)),
            launches=2 if cfg.split_k > 1 else 1,
            extra_us=0.15 * math.log2(cfg.split_k) + 0.02 * m * cfg.rows_per_cta,
        )
