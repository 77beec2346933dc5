"""Inputs, torch reference, byte counts and the split-K reduce kernel shared by the dense decode GEMM families:
y[M,N] = x[M,K] @ W[N,K]^T. (No ``from __future__ import annotations``: the DSL evaluates kernel annotations.)"""

import functools

from k3tune.kernels.base import KernelFamily
from k3tune.plan.problems import Problem

BF16 = 2


def gemm_bytes(problem: Problem) -> float:
    m, n, k = problem["M"], problem["N"], problem["K"]
    return (n * k + m * k + m * n) * BF16


def gemm_flops(problem: Problem) -> float:
    return 2.0 * problem["M"] * problem["N"] * problem["K"]


def make_inputs(problem: Problem, device, generator) -> dict:
    import torch

    m, n, k = problem["M"], problem["N"], problem["K"]
    # scaled so that outputs stay O(1): errors are then relative to a meaningful norm
    # generated where they live (the generator's device): rotation sets of hundreds of MB stay cheap
    x = torch.randn(m, k, generator=generator, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=generator, device=device) / k**0.5).to(torch.bfloat16)
    return {"x": x, "w": w}


def reference(problem: Problem, inputs: dict):
    return inputs["x"].float() @ inputs["w"].float().t()


class DenseGemm(KernelFamily):
    """What every dense decode GEMM family shares: its inputs (x, the weight ``w`` that rotates past L2, and for the
    CuTe kernels the bf16 output they write, an fp32 split-K workspace of ``workspace_splits`` slices and a per-tile
    arrival counter where ``counters`` is set) and the fp32 reference."""

    kinds = frozenset({"gemm"})
    writes_out = True  # the kernel writes into inputs["out"] (cuBLAS returns a fresh tensor)
    workspace_splits = 0  # fp32 partials ws[split, M, N]
    counters = False  # one int32 arrival counter per (16-row tile, 8-token tile), reset by the tile's last CTA

    def make_inputs(self, problem: Problem, device, generator) -> dict:
        import torch

        inputs = make_inputs(problem, device, generator)
        m, n = problem["M"], problem["N"]
        if self.writes_out:
            inputs["out"] = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        if self.workspace_splits:
            inputs["ws"] = torch.empty(self.workspace_splits, m, n, dtype=torch.float32, device=device)
        if self.counters:
            inputs["counters"] = torch.zeros(n // 16 + 1, m // 8 + 1, dtype=torch.int32, device=device)
        return inputs

    def weight_names(self, problem: Problem) -> tuple[str, ...]:
        return ("w",)

    def reference(self, problem: Problem, inputs: dict):
        return reference(problem, inputs)


@functools.cache
def splitk_reduce():
    """Base class of the split-K GEMM kernels: ``reduce`` sums the slices' fp32 partials ``ws[split, M, N]``
    in slice order (deterministic) into bf16 ``y``, one output element per thread, 256 threads per CTA.
    Subclasses set ``self.split`` and ``self.pdl``; defined on first use so that importing k3tune never
    imports the DSL."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32

    class SplitKReduce:
        @cute.jit
        def launch_reduce(self, mWs: cute.Tensor, mY: cute.Tensor, stream):
            total = mY.shape[0] * mY.shape[1]
            self.reduce(mWs, mY).launch(grid=((total + 255) // 256, 1, 1), block=(256, 1, 1), stream=stream,
                                        use_pdl=self.pdl)

        @cute.kernel
        def reduce(self, mWs: cute.Tensor, mY: cute.Tensor):
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # the partials of the grid before (it triggered early)
                cute.arch.griddepcontrol_launch_dependents()
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            n = mY.shape[1]
            idx = bidx * 256 + tidx
            if idx < mY.shape[0] * n:
                t = idx // n
                r = idx % n
                acc = Float32(0.0)
                for z in cutlass.range_constexpr(self.split):
                    acc = acc + mWs[z, t, r]
                mY[t, r] = acc.to(BFloat16)

    return SplitKReduce
