"""cuBLAS baseline for the dense decode projections: ``torch.matmul`` in bf16, as a stock engine runs it.

It stays a variant of every dense op, so a tuned choice is never slower than the stock one. No knobs.
Runs on any CUDA GPU and on the CPU (as the CPU backend's reference point).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, Work
from k3tune.plan.problems import Problem


@dataclass(frozen=True)
class CublasConfig(KernelConfig):
    pass


class CublasGemm(gemm_common.DenseGemm):
    name = "gemm.cublas"
    writes_out = False  # torch.matmul returns its own tensor
    config_cls = CublasConfig
    backends = frozenset({"gpu", "simulated", "cpu"})
    priority = 10  # the safe choice wins statistical ties
    depends_on = ("k3tune.kernels.gemm_common",)  # inputs, the fp32 reference and the split-K reduce kernel

    def work(self, problem: Problem, cfg: CublasConfig) -> Work:
        m, n = problem["M"], problem["N"]
        ctas = math.ceil(n / 128) * math.ceil(m / 64)
        split = max(1, min(4, 66 // ctas))  # cuBLAS splits K when the grid is small
        return Work(
            hbm_bytes=gemm_common.gemm_bytes(problem) + (split - 1) * m * n * 8,
            flops=gemm_common.gemm_flops(problem),
            ctas=ctas * split,
            inflight_bytes_per_cta=64 * 1024,  # multi-stage pipeline: fits the H200 cuBLAS table
            tensor_cores=True,
            extra_us=1.0,
        )

    def build(self, problem: Problem, cfg: CublasConfig):
        import torch

        def run(inputs: dict):
            return torch.matmul(inputs["x"], inputs["w"].t())

        return run
