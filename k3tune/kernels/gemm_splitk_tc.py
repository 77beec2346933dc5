"""Split-K tensor-core decode GEMM (M from 8 to 512), swap-AB: y^T = W x^T so that N fills the MMA's M.

Space declared here for the simulated backend; the CuTe DSL kernel lands with the GEMM issue, until then the
family is ``declared_only``. Knobs: N tile, token tile, K tile, split-K factor, pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.plan.problems import Problem

MIN_M, MAX_M = 8, 512
SMEM_BYTES = 227 * 1024


@dataclass(frozen=True)
class SplitKConfig(KernelConfig):
    tile_n: int = 128
    tile_m: int = 16
    tile_k: int = 128
    split_k: int = 1
    stages: int = 4


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class SplitKTensorCoreGemm(KernelFamily):
    name = "gemm.splitk_tc"
    kinds = frozenset({"gemm"})
    config_cls = SplitKConfig
    backends = frozenset({"simulated"})
    declared_only = True
    priority = 40

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and MIN_M <= problem["M"] <= MAX_M and problem["K"] % 64 == 0

    def space(self, problem: Problem) -> dict[str, tuple]:
        m = problem["M"]
        return {
            "tile_n": tuple(t for t in (64, 128, 256) if problem["N"] % 64 == 0 or t == 64),
            "tile_m": tuple(t for t in (8, 16, 32, 64, 128) if t <= max(8, _pow2_ceil(m))),
            "tile_k": (64, 128),
            "split_k": (1, 2, 4, 8, 16),
            "stages": (2, 3, 4, 6),
        }

    def _smem(self, cfg: SplitKConfig) -> int:
        return cfg.stages * (cfg.tile_n + cfg.tile_m) * cfg.tile_k * 2

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        k_tiles = problem["K"] // cfg.tile_k
        return problem["K"] % cfg.tile_k == 0 and k_tiles % cfg.split_k == 0 and self._smem(cfg) <= SMEM_BYTES

    def default(self, problem: Problem) -> SplitKConfig:
        return SplitKConfig(tile_m=min(64, max(8, _pow2_ceil(problem["M"]))), split_k=2 if problem["N"] < 4096 else 1)

    def work(self, problem: Problem, cfg: SplitKConfig) -> Work:
        m, n = problem["M"], problem["N"]
        ctas = math.ceil(n / cfg.tile_n) * math.ceil(m / cfg.tile_m) * cfg.split_k
        m_tiles = math.ceil(m / cfg.tile_m)
        return Work(
            # each token tile re-reads the weights; split-K partials go through an fp32 workspace
            hbm_bytes=gemm_common.gemm_bytes(problem) * m_tiles ** 0.5 + (cfg.split_k - 1) * m * n * 8,
            flops=2.0 * cfg.tile_m * m_tiles * n * problem["K"],
            ctas=ctas,
            inflight_bytes_per_cta=min(cfg.stages, 4) * cfg.tile_n * cfg.tile_k * 2,
            tensor_cores=True,
            ctas_per_sm=max(1, SMEM_BYTES // self._smem(cfg)),
            launches=2 if cfg.split_k > 1 else 1,
            extra_us=0.3 + 0.05 * cfg.stages,
        )
