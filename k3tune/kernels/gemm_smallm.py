"""Small-M decode GEMM (M <= 16) in CuTe DSL: y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation.

CUDA-core FMA. Each CTA owns ``rows_per_cta`` rows of W (output columns) and one of ``split_k`` slices of K;
its warps stride over the slice in 16-byte vectors (8 bf16 per lane per load, non-coherent ``ld.global.nc.v4``),
keep one fp32 accumulator per (row, token) in registers, reduce across lanes with shuffles and across warps
through shared memory. With ``split_k > 1`` each slice writes fp32 partials to a workspace and a second,
deterministic kernel sums them in slice order and writes bf16 (no atomics: results are reproducible).

The K loop can be unrolled (``unroll``) to keep more loads in flight; the dot products are FMA chains over
an fp32 copy of the tokens' slice of x. With ``pdl`` the launches allow programmatic dependent launch: a CTA pulls
its rows' K slice into L2 (``cp.async.bulk.prefetch.L2``) while the kernel before it finishes, then waits for that
grid (``griddepcontrol.wait``) before touching x, the output or the workspace; an ordinary launch when the kernel
before it does not trigger (these trigger at their start).

Constraints: M <= 16 (a compile-time constant: one binary per M), K a multiple of 8 x split_k, N a multiple of
rows_per_cta, 16-byte aligned rows. N and K are dynamic: one compile serves every projection of a given M.
Launches take the caller's stream, so they can be captured in a CUDA graph.

Run the numerics check on a GPU: ``pytest -m gpu tests/test_gpu_kernels.py``.
"""


import functools
import math
import os
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, Work
from k3tune.plan.problems import Problem

MAX_M = 16
VEC = 8  # bf16 elements per 16-byte load
MAX_SPLIT = 16
MAX_ACC = 32  # fp32 accumulators per thread (rows x tokens); x's fp32 slice takes 8 x M more registers


@dataclass(frozen=True)
class SmallMConfig(KernelConfig):
    rows_per_cta: int = 4
    warps: int = 4
    split_k: int = 1
    unroll: int = 1  # K-loop iterations unrolled: more 16-byte loads in flight per thread
    pdl: int = 0  # 1: programmatic dependent launch (the CTA's weights pulled into L2 as the kernel before ends)


class SmallMGemm(gemm_common.DenseGemm):
    name = "gemm.smallm"
    workspace_splits = MAX_SPLIT
    config_cls = SmallMConfig
    backends = frozenset({"gpu", "simulated"})
    priority = 30
    depends_on = ("k3tune.kernels.gemm_common",)  # inputs, the fp32 reference and the split-K reduce kernel
    off = {"pdl": 0}  # programmatic dependent launch is recorded only where it pays beyond the noise

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and problem["M"] <= MAX_M and problem["K"] % VEC == 0

    def space(self, problem: Problem) -> dict[str, tuple]:
        n, m = problem["N"], problem["M"]
        return {
            "rows_per_cta": tuple(r for r in (1, 2, 4, 8) if n % r == 0 and r * m <= MAX_ACC),
            "warps": (2, 4, 8),
            "split_k": (1, 2, 4, 8, 16),
            "unroll": (1, 2, 4),
            "pdl": (0, 1),
        }

    def valid(self, cfg: SmallMConfig, problem: Problem) -> bool:
        # each split of K gets whole 16-byte vectors and at least one vector per lane of a warp
        k = problem["K"]
        return k % (cfg.split_k * VEC) == 0 and k // cfg.split_k >= 32 * VEC

    def default(self, problem: Problem) -> SmallMConfig:
        n = problem["N"]
        split = 1 if n >= 4096 else 4
        rows = max(r for r in (1, 2, 4) if n % r == 0 and r * problem["M"] <= MAX_ACC)
        return SmallMConfig(rows_per_cta=rows, warps=4, split_k=split, unroll=2)

    def work(self, problem: Problem, cfg: SmallMConfig) -> Work:
        m, n = problem["M"], problem["N"]
        ctas = math.ceil(n / cfg.rows_per_cta) * cfg.split_k
        partial = (cfg.split_k - 1) * m * n * 4 * 2
        return Work(
            hbm_bytes=gemm_common.gemm_bytes(problem) + partial,
            flops=gemm_common.gemm_flops(problem),
            ctas=ctas,
            inflight_bytes_per_cta=cfg.warps * 32 * 16 * min(cfg.rows_per_cta * cfg.unroll, 8),
            ctas_per_sm=min(16, 2048 // (cfg.warps * 32)),
            launches=2 if cfg.split_k > 1 else 1,
            extra_us=0.15 * math.log2(cfg.split_k) + 0.02 * m * cfg.rows_per_cta,
        )

    # ---- the measurer's interface --------------------------------------------------------------

    def build(self, problem: Problem, cfg: SmallMConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        fn = compiled(problem["M"], cfg.rows_per_cta, cfg.warps, cfg.split_k, cfg.unroll, current_arch(), cfg.pdl)

        def run(inputs: dict):
            x = from_dlpack(inputs["x"], assumed_align=16).mark_compact_shape_dynamic(mode=1, divisibility=VEC)
            w = (from_dlpack(inputs["w"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=VEC))
            y = from_dlpack(inputs["out"], assumed_align=16).mark_compact_shape_dynamic(mode=1)
            ws = (from_dlpack(inputs["ws"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                  .mark_compact_shape_dynamic(mode=2))
            fn(x, w, y, ws, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        return run


def current_arch() -> str:
    """The arch to compile for: the local GPU's, else $CUTE_DSL_ARCH, else sm_90a."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}a"
    except ImportError:
        pass
    return os.environ.get("CUTE_DSL_ARCH", "sm_90a")


@functools.cache
def compiled(m: int, rows: int, warps: int, split: int, unroll: int, arch: str, pdl: int = 0):
    """Compile once per (M, rows, warps, split, unroll, arch, pdl); N and K are dynamic. Never call inside a
    capture."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    n, k = cute.sym_int(), cute.sym_int(divisibility=VEC)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    ws = make_fake_compact_tensor(Float32, (cute.sym_int(), m, n), stride_order=(2, 1, 0), assumed_align=16)
    kernel = _kernel_class()(m, rows, warps, split, unroll, pdl)
    return cute.compile(kernel, x, w, y, ws, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """The CuTe DSL kernel, defined on first use so that importing k3tune never imports the DSL."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32
    from cutlass.experimental.primitives import cp_async_bulk_prefetch

    class SmallMGemvKernel(gemm_common.splitk_reduce()):
        def __init__(self, m: int, rows: int, warps: int, split: int, unroll: int, pdl: int = 0):
            self.m, self.rows, self.warps, self.split, self.unroll = m, rows, warps, split, unroll
            self.pdl = bool(pdl)

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
                     stream: cuda.CUstream):
            n = mW.shape[0]
            self.kernel(mX, mW, mY, mWs).launch(grid=(n // self.rows, self.split, 1),
                                                block=(self.warps * 32, 1, 1), stream=stream, use_pdl=self.pdl)
            if cutlass.const_expr(self.split > 1):
                self.launch_reduce(mWs, mY, stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
            M, R, W = self.m, self.rows, self.warps
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            chunks = mW.shape[1] // (VEC * self.split)  # 16-byte vectors in this CTA's K slice
            c0 = bidy * chunks
            n0 = bidx * R
            gW = cute.zipped_divide(mW, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
            x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            acc = cute.make_rmem_tensor(cute.make_layout(R * M), Float32)
            acc.fill(0.0)
            rw = cute.make_rmem_tensor_like(gW[(None, (0, 0))])
            rx = cute.make_rmem_tensor_like(gX[(None, (0, 0))])
            wf = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            xf = cute.make_rmem_tensor(cute.make_layout((VEC, M)), Float32)
            if cutlass.const_expr(self.pdl):
                # the weights depend on no kernel: pull this CTA's rows of its K slice into L2 while the previous
                # kernel finishes, then wait for that grid before x, the output or the workspace is touched
                cute.arch.griddepcontrol_launch_dependents()
                if tidx < R:
                    cp_async_bulk_prefetch(mW.iterator + ((n0 + tidx) * mW.shape[1] + c0 * VEC), chunks * VEC * 2)
                cute.arch.griddepcontrol_wait()
            for c in cutlass.range(warp * 32 + lane, chunks, W * 32, unroll=self.unroll):
                cc = c0 + c
                for mi in cutlass.range_constexpr(M):  # the tokens' slice of x, once per chunk, in fp32
                    cute.copy(x_atom, gX[(None, (mi, cc))], rx)
                    xv = rx.load().to(Float32)
                    for j in cutlass.range_constexpr(VEC):
                        xf[j, mi] = xv[j]
                for r in cutlass.range_constexpr(R):
                    cute.copy(w_atom, gW[(None, (n0 + r, cc))], rw)
                    wf.store(rw.load().to(Float32))
                    for mi in cutlass.range_constexpr(M):
                        a = acc[r * M + mi]
                        for j in cutlass.range_constexpr(VEC):  # an FMA chain: no per-vector reduction tree
                            a = a + wf[j] * xf[j, mi]
                        acc[r * M + mi] = a
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((W, R * M)), 16)
            for i in cutlass.range_constexpr(R * M):
                v = cute.arch.warp_reduction_sum(acc[i])
                if lane == 0:
                    red[warp, i] = v
            cute.arch.sync_threads()
            if tidx < R * M:
                s = Float32(0.0)
                for wi in cutlass.range_constexpr(W):
                    s = s + red[wi, tidx]
                r = tidx // M
                mi = tidx % M
                if cutlass.const_expr(self.split == 1):
                    mY[mi, n0 + r] = s.to(BFloat16)
                else:
                    mWs[bidy, mi, n0 + r] = s

    return SmallMGemvKernel
