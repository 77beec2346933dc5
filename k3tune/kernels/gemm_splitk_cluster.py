"""Split-K tensor-core decode GEMM whose split CTAs form one thread-block cluster and sum their partials in the
leader's shared memory: no workspace, no counter, no second kernel (staged: GPU numerics not yet run).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation. The main loop is gemm_splitk_tc's (the same
``mma.sync`` swap-AB kernel, ring of ``cp.async`` stages, warps over rows and K), inherited from its kernel class;
only the end differs. The ``split_k`` CTAs of a (row tile, token tile) are launched as one cluster along grid z;
after the K loop, rank 0 initialises one mbarrier expecting every peer's bytes, a cluster barrier makes it visible,
each peer pushes its accumulators into its own slot of rank 0's receive buffer with ``st.async.shared::cluster``
(16 bytes a store, completion counted on rank 0's mbarrier), and rank 0 waits, adds the slots in rank order
(deterministic) and writes bf16. Why: the second kernel of the split-K winners costs ~1-2 us on 2-5 us floors
(NOTES.md, session 13), and the few-row projections need split-K at M = 16-64 to own enough rows per CTA.

The main loop's body is a copy of gemm_splitk_tc's ``kernel`` (its helpers are inherited): moving it into a method of
its own there re-keys every splitk_tc winner, so that waits for the next dense re-sweep. Cluster sizes 2, 4 and 8
(portable). With ``pdl = 1`` the launch allows programmatic dependent launch as in
gemm_splitk_tc. M, N and K are dynamic. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k cluster``.
"""

import dataclasses
import functools

from k3tune.kernels import gemm_splitk_tc
from k3tune.kernels.base import Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_tc import SMEM_BUDGET, SplitKConfig, SplitKTensorCoreGemm, smem_bytes
from k3tune.plan.problems import Problem

SPLITS = (2, 4, 8)  # portable cluster sizes


def recv_bytes(cfg: SplitKConfig) -> int:
    """Rank 0's receive buffer: every peer's accumulators of its K-warp-0 threads."""
    return (cfg.split_k - 1) * 32 * cfg.warps_n * 4 * cfg.m_tiles * (cfg.tile_m // 8) * 4


class SplitKClusterGemm(SplitKTensorCoreGemm):
    name = "gemm.splitk_cluster"
    priority = 42
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc")  # its main loop is splitk_tc's

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and problem["K"] % (32 * SPLITS[0]) == 0  # a split of whole 32-K chunks

    def space(self, problem: Problem) -> dict[str, tuple]:
        return {**super().space(problem), "split_k": SPLITS, "reduce": (0,)}

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        return (cfg.split_k in SPLITS and cfg.reduce == 0 and super().valid(cfg, problem)
                and smem_bytes(cfg) + recv_bytes(cfg) + 16 <= SMEM_BUDGET)

    def canonical(self, params: dict) -> dict:
        return params

    def seeds(self, problem: Problem) -> list[SplitKConfig]:
        """gemm_splitk_tc's seeds with their split clamped to a portable cluster (8) and summed in the cluster."""
        out = []
        for cfg in super().seeds(problem):
            c = dataclasses.replace(cfg, split_k=min(8, max(2, cfg.split_k)), reduce=0)
            if self.valid(c, problem):
                out.append(c)
        return list(dict.fromkeys(out))

    def work(self, problem: Problem, cfg: SplitKConfig) -> Work:
        w = super().work(problem, cfg)
        m, n = problem["M"], problem["N"]
        partial = (cfg.split_k - 1) * m * n * 4 * 2
        return dataclasses.replace(w, hbm_bytes=w.hbm_bytes - partial, launches=1,
                                   extra_us=0.3 + 0.05 * cfg.warps_k)  # cluster barrier + the push and the sum

    def build(self, problem: Problem, cfg: SplitKConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        fn = compiled(cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl,
                      current_arch())

        def run(inputs: dict):
            x = (from_dlpack(inputs["x"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            w = (from_dlpack(inputs["w"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            y = from_dlpack(inputs["out"], assumed_align=16).mark_layout_dynamic()
            fn(x, w, y, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        return run


@functools.cache
def compiled(m_tiles: int, warps_n: int, warps_k: int, tile_m: int, split: int, bk: int, stages: int, pdl: int,
             arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    kernel = _kernel_class()(m_tiles, warps_n, warps_k, tile_m, split, bk, stages, 0, pdl)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """gemm_splitk_tc's kernel with the cluster launch and the cluster sum; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64

    class SplitKClusterKernel(gemm_splitk_tc._kernel_class()):
        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + self.tm - 1) // self.tm, self.split)
            self.kernel(mX, mW, mY).launch(grid=grid, block=(self.threads, 1, 1), cluster=[1, 1, self.split],
                                           stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor):
            MT, NT, WN, WK, S, P = self.mt, self.nt, self.wn, self.wk, self.split, self.stages
            ROWS, TM, BK = self.rows, self.tm, self.bk
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, bidz = cute.arch.block_idx()
            rank = cute.arch.block_idx_in_cluster()
            m = mX.shape[0]
            n = mW.shape[0]
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4
            c = lane % 4
            wrow = warp % WN
            wkk = warp // WN
            row0 = bidx * ROWS
            tok0 = bidy * TM
            ktiles = mW.shape[1] // (BK * S)
            kt0 = bidz * ktiles
            nacc = 4 * MT * NT

            smem = cutlass.utils.SmemAllocator()
            sW = smem.allocate_tensor(BFloat16, cute.make_layout(P * ROWS * BK), 128)
            sX = smem.allocate_tensor(BFloat16, cute.make_layout(P * TM * BK), 128)
            recv = smem.allocate_tensor(Float32, cute.make_layout((S - 1) * 32 * WN * nacc), 16)
            bar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)
            g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                      BFloat16, num_bits_per_copy=128)
            s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))

            acc = cute.make_rmem_tensor(cute.make_layout((4, MT, NT)), Float32)
            acc.fill(0.0)
            rw = cute.make_rmem_tensor(cute.make_layout((8, 2 * MT)), BFloat16)
            rx = cute.make_rmem_tensor(cute.make_layout((8, NT)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, MT)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)

            # rank 0's mbarrier expects every peer's bytes before anyone can push (the cluster barrier below)
            if rank == 0 and tidx == 0:
                cute.arch.mbarrier_init(bar.iterator, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar.iterator, (S - 1) * 32 * WN * nacc * 4)
            cute.arch.cluster_arrive_relaxed()

            # the main loop of gemm_splitk_tc (its prologue, ring and compute)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + s, s, tidx, row0, n)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x and y only from here on
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_x(mX, sX, g2s, kt0 + s, s, tidx, tok0, m)
                cute.arch.cp_async_commit_group()
            for kt in cutlass.range(ktiles):
                cute.arch.cp_async_wait_group(P - 2)
                cute.arch.sync_threads()
                nk = kt + P - 1
                if nk < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + nk, nk % P, tidx, row0, n)
                    self._issue_x(mX, sX, g2s, kt0 + nk, nk % P, tidx, tok0, m)
                cute.arch.cp_async_commit_group()
                self._compute(sW, sX, s2r, mma, kt % P, wrow, wkk, g, c, rw, rx, fa, fb, acc)
            cute.arch.cp_async_wait_group(0)

            if cutlass.const_expr(WK > 1):  # the K warps, in warp order, as gemm_splitk_tc does
                red = smem.allocate_tensor(Float32, cute.make_layout((nacc, 32, WN, WK - 1)), 16)
                if wkk > 0:
                    for e in cutlass.range_constexpr(nacc):
                        red[e, lane, wrow, wkk - 1] = acc[e]
                cute.arch.sync_threads()
                if wkk == 0:
                    for q in cutlass.range_constexpr(WK - 1):
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = acc[e] + red[e, lane, wrow, q]

            cute.arch.cluster_wait()  # rank 0's mbarrier is initialised and armed
            slot = (wrow * 32 + lane) * nacc  # this thread's accumulators in a peer's slot
            if wkk == 0 and rank > 0:
                flat = cute.make_rmem_tensor(cute.make_layout(nacc), Float32)
                for e in cutlass.range_constexpr(nacc):
                    flat[e] = acc[e]
                bits = cute.recast_tensor(flat, Int32)
                base = (rank - 1) * 32 * WN * nacc + slot
                for q in cutlass.range_constexpr(nacc // 4):
                    cute.arch.store_async_dsmem((recv.iterator + (base + 4 * q)).align(16),
                                                (bits[4 * q], bits[4 * q + 1], bits[4 * q + 2], bits[4 * q + 3]),
                                                bar.iterator, 0)
            if rank == 0:
                cute.arch.mbarrier_wait(bar.iterator, 0)
                if wkk == 0:
                    for z in cutlass.range_constexpr(S - 1):  # rank order: deterministic
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = acc[e] + recv[z * 32 * WN * nacc + slot + e]
                    self._store(acc, mY, row0 + wrow * 16 * MT, tok0, g, c, m, n)

    return SplitKClusterKernel
