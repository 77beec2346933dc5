"""gemm.splitk_cluster with x in a ring of its own, fed by bulk copies (staged, session 54).

Why: at M = 16 the 16-token tile doubles x's share of every ring stage, so splitk_cluster's CTAs of the M = 8
winner's layout (16 rows, split 8, a 4-stage 128-wide ring) no longer fit 7 a SM; bench/timeline.py (s54-r8) showed
that the M = 8 winner's many short CTAs are what keeps HBM busy across launches under PDL. x is L2-resident, so it
needs a shallower ring than W: here W streams through its ``stages``-deep ``cp.async`` ring as before and x through
a 2-slot ring filled one stage ahead by ``cp.async.bulk`` (one 16-byte-aligned row a copy, counted on the slot's
mbarrier, so a wait for x never waits for the W issued beside it). x rows are padded by 16 bytes (conflict-free
reads without a swizzle), and the K-warp sum's buffer lies over the x ring once the K loop is done. The M = 8
winner's layout with a 16-token tile is then 16 + 8.5 + 7 (rank 0's receive buffer) KB: 6 CTAs a SM.

The cluster sum and launch are gemm_splitk_cluster's (inherited); the K loop is gemm_splitk_tc's with the x ring.
M, N and K are dynamic. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k splitk_xring``.
"""

import functools

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_cluster import SPLITS, SplitKClusterGemm, recv_bytes
from k3tune.kernels.gemm_splitk_tc import KCHUNK, MAX_ACC, SMEM_BUDGET, SplitKConfig, _pow2_ceil
from k3tune.plan.problems import Problem

XSLOTS = 2  # x ring depth
XPAD = 8  # bf16 elements of padding per x row (16 bytes)


def smem_bytes(cfg: SplitKConfig) -> int:
    rows = 16 * cfg.m_tiles * cfg.warps_n
    return (cfg.stages * rows * cfg.bk * 2 + XSLOTS * cfg.tile_m * (cfg.bk + XPAD) * 2 + recv_bytes(cfg)
            + 8 * XSLOTS + 16)


def red_bytes(cfg: SplitKConfig) -> int:
    return 4 * cfg.m_tiles * (cfg.tile_m // 8) * 32 * cfg.warps_n * (cfg.warps_k - 1) * 4


class SplitKXringGemm(SplitKClusterGemm):
    name = "gemm.splitk_xring"
    priority = 43
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster")

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        return (cfg.split_k in SPLITS and cfg.reduce == 0
                and k % (cfg.bk * cfg.split_k) == 0
                and (cfg.bk // KCHUNK) % cfg.warps_k == 0
                and 4 * cfg.m_tiles * cfg.tile_m // 8 <= MAX_ACC
                and 16 * cfg.m_tiles * cfg.warps_n <= _pow2_ceil(n)
                and smem_bytes(cfg) <= SMEM_BUDGET
                and red_bytes(cfg) <= XSLOTS * cfg.tile_m * (cfg.bk + XPAD) * 2)

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
    """gemm_splitk_cluster's kernel with the x ring; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int64
    from cutlass.experimental.primitives import cp_async_bulk_shared_cluster_global

    VEC = 8

    class SplitKXringKernel(gemm_splitk_cluster._kernel_class()):
        @cute.jit
        def _ring(self, smem):
            """W's ring as gemm_splitk_tc's; x's: XSLOTS slots of tile_m padded rows, and their mbarriers."""
            XLD = self.bk + XPAD
            sW = smem.allocate_tensor(BFloat16, cute.make_layout(self.stages * self.rows * self.bk), 128)
            sX = smem.allocate_tensor(BFloat16, cute.make_layout(XSLOTS * self.tm * XLD), 128)
            xbar = smem.allocate_tensor(Int64, cute.make_layout(XSLOTS), 8)
            return sW, (sX, xbar)

        @cute.jit
        def _issue_xb(self, mX, sX, xbar, kt, slot, tidx, tok0, m):
            """Stage ``kt``'s x tile into x slot ``slot``: one bulk copy a token row (tokens past M not loaded),
            all by thread 0 after it arms the slot's mbarrier for their bytes."""
            XLD = self.bk + XPAD
            if tidx == 0:
                valid = cutlass.min(m - tok0, self.tm)
                cute.arch.mbarrier_arrive_and_expect_tx(xbar.iterator + slot, valid * self.bk * 2)
                for r in cutlass.range_constexpr(self.tm):
                    if tok0 + r < m:
                        cp_async_bulk_shared_cluster_global(
                            sX.iterator + ((slot * self.tm + r) * XLD),
                            mX.iterator + ((tok0 + r) * mX.shape[1] + kt * self.bk),
                            xbar.iterator + slot, self.bk * 2)

        @cute.jit
        def _mainloop(self, mX, mW, sW, sXb, smem, tidx, row0, tok0, kt0, ktiles, m, n):
            """gemm_splitk_tc's K loop with x from its own ring: W ``stages - 1`` ahead by cp.async, x one stage
            ahead by bulk copies. Returns the accumulators, whole in K warp 0 (the K warps summed in warp order)."""
            MT, NT, WN, WK, P = self.mt, self.nt, self.wn, self.wk, self.stages
            sX, xbar = sXb
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4
            c = lane % 4
            wrow = warp % WN
            wkk = warp // WN
            g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                      BFloat16, num_bits_per_copy=128)
            s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
            acc = cute.make_rmem_tensor(cute.make_layout((4, MT, NT)), Float32)
            acc.fill(0.0)
            rw = cute.make_rmem_tensor(cute.make_layout((VEC, 2 * MT)), BFloat16)
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, NT)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, MT)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)

            if tidx == 0:
                for i in cutlass.range_constexpr(XSLOTS):
                    cute.arch.mbarrier_init(xbar.iterator + i, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + s, s, tidx, row0, n)
                cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x and y only from here on
            for s in cutlass.range_constexpr(XSLOTS - 1):
                if s < ktiles:
                    self._issue_xb(mX, sX, xbar, kt0 + s, s, tidx, tok0, m)
            for kt in cutlass.range(ktiles):
                cute.arch.cp_async_wait_group(P - 2)  # this thread's W copies of stage kt have landed
                cute.arch.sync_threads()  # everyone's have; and everyone is done with the slots refilled next
                nk = kt + P - 1
                if nk < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + nk, nk % P, tidx, row0, n)
                cute.arch.cp_async_commit_group()
                nx = kt + XSLOTS - 1
                if nx < ktiles:
                    self._issue_xb(mX, sX, xbar, kt0 + nx, nx % XSLOTS, tidx, tok0, m)
                cute.arch.mbarrier_wait(xbar.iterator + kt % XSLOTS, (kt // XSLOTS) % 2)
                self._compute_x(sW, sX, s2r, mma, kt % P, kt % XSLOTS, wrow, wkk, g, c, rw, rx, fa, fb, acc)
            cute.arch.cp_async_wait_group(0)

            nacc = 4 * MT * NT
            if cutlass.const_expr(WK > 1):  # the K warps summed in warp order, over the x ring (done with)
                cute.arch.sync_threads()
                red = cute.make_tensor(cute.recast_ptr(sX.iterator, dtype=Float32),
                                       cute.make_layout((nacc, 32, WN, WK - 1)))
                if wkk > 0:
                    for e in cutlass.range_constexpr(nacc):
                        red[e, lane, wrow, wkk - 1] = acc[e]
                cute.arch.sync_threads()
                if wkk == 0:
                    for q in cutlass.range_constexpr(WK - 1):
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = acc[e] + red[e, lane, wrow, q]
            return acc

        @cute.jit
        def _compute_x(self, sW, sX, s2r, mma, slot, xslot, wrow, wkk, g, c, rw, rx, fa, fb, acc):
            """gemm_splitk_tc's ``_compute`` with x read from its padded, unswizzled ring."""
            MT, NT, WK = self.mt, self.nt, self.wk
            XLD = self.bk + XPAD
            flip = (g % 2) * self.swz
            for cc in cutlass.range_constexpr(self.kc // WK):
                q = (wkk + cc * WK) * 4 + c  # this lane's vector of the 32-wide chunk
                pos = q ^ flip
                for i in cutlass.range_constexpr(2 * MT):
                    r = wrow * 16 * MT + (i // 2) * 16 + (i % 2) * 8 + g
                    cute.copy(s2r, self._vec(sW.iterator + ((slot * self.rows + r) * self.bk + pos * VEC)), rw[None, i])
                for j in cutlass.range_constexpr(NT):
                    cute.copy(s2r, self._vec(sX.iterator + ((xslot * self.tm + j * 8 + g) * XLD + q * VEC)),
                              rx[None, j])
                for s in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(MT):
                        for h in cutlass.range_constexpr(2):
                            fa[4 * h, i] = rw[4 * s + 2 * h, 2 * i]
                            fa[4 * h + 1, i] = rw[4 * s + 2 * h + 1, 2 * i]
                            fa[4 * h + 2, i] = rw[4 * s + 2 * h, 2 * i + 1]
                            fa[4 * h + 3, i] = rw[4 * s + 2 * h + 1, 2 * i + 1]
                    for j in cutlass.range_constexpr(NT):
                        for v in cutlass.range_constexpr(4):
                            fb[v, j] = rx[4 * s + v, j]
                    cute.gemm(mma, acc, fa, fb, acc)

    return SplitKXringKernel
