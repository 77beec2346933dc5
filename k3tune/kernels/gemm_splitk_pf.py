"""gemm.splitk_cluster that pulls the rest of its K slice of W into L2 while the kernel before it finishes
(staged, session 54).

Why: bench/kline.py (s54, H100) splits a launch's time into a fixed part and a streaming rate over K. With
programmatic dependent launch (PDL) the fixed part of splitk_cluster at M = 8 falls from 2.4 us to 0.6, of the
16-token layouts at M = 16 from 3.3 to 1.2, and of wgmma_ck from 3.2 to 1.0: the CTAs of the next launch that find
a free slot load their first ring stages while the previous launch drains, and that is most of what keeps HBM busy
across the boundary. Those CTAs then wait (``griddepcontrol.wait``) with only ``stages - 1`` stages requested.
Here, before that wait, each of them also asks L2 for the rest of its rows' K slice (``cp.async.bulk.prefetch.L2``,
one row a thread, as gemm_smallm's PDL path does), so that HBM streams the next launch's weights through the
previous launch's tail and the CTA's K loop then reads them from L2. Best effort: nothing waits on a prefetch and
nothing it does changes a result; without PDL the prefetch is not issued and the kernel is splitk_cluster's.

The main loop is gemm_splitk_tc's with that prologue, the launch and the cluster sum gemm_splitk_cluster's
(inherited). M, N and K are dynamic. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k splitk_pf``.
"""

import functools

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_cluster import SplitKClusterGemm
from k3tune.kernels.gemm_splitk_tc import SplitKConfig
from k3tune.plan.problems import Problem


class SplitKPrefetchGemm(SplitKClusterGemm):
    name = "gemm.splitk_pf"
    priority = 43
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster")

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
    """gemm_splitk_cluster's kernel with the prefetching prologue; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from cutlass.experimental.primitives import cp_async_bulk_prefetch

    VEC = 8

    class SplitKPrefetchKernel(gemm_splitk_cluster._kernel_class()):
        @cute.jit
        def _mainloop(self, mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n):
            """gemm_splitk_tc's main loop with the L2 prefetch of the slice's W beyond the prologue's stages
            between the prologue's W loads and ``griddepcontrol.wait``."""
            WN, WK, P = self.wn, self.wk, self.stages
            warp = tidx // 32
            lane = tidx % 32
            wrow = warp % WN
            wkk = warp // WN
            g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                      BFloat16, num_bits_per_copy=128)
            s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
            MT, NT = self.mt, self.nt
            g = lane // 4
            c = lane % 4

            acc = cute.make_rmem_tensor(cute.make_layout((4, MT, NT)), Float32)
            acc.fill(0.0)
            rw = cute.make_rmem_tensor(cute.make_layout((VEC, 2 * MT)), BFloat16)
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, NT)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, MT)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + s, s, tidx, row0, n)
            if cutlass.const_expr(self.pdl):
                # the rest of this CTA's rows' K slice into L2, one row a thread (rows past N clamped), then wait
                if ktiles > P - 1 and tidx < self.rows:
                    r = cutlass.min(row0 + tidx, n - 1)
                    cp_async_bulk_prefetch(mW.iterator + (r * mW.shape[1] + (kt0 + P - 1) * self.bk),
                                           (ktiles - (P - 1)) * self.bk * 2)
                cute.arch.griddepcontrol_wait()  # x, y, the workspace and the counters: only from here on
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

            nacc = 4 * MT * NT
            if cutlass.const_expr(WK > 1):  # reduce the K warps in warp order (deterministic)
                red = smem.allocate_tensor(Float32, cute.make_layout((nacc, 32, WN, WK - 1)), 16)
                if wkk > 0:
                    for e in cutlass.range_constexpr(nacc):
                        red[e, lane, wrow, wkk - 1] = acc[e]
                cute.arch.sync_threads()
                if wkk == 0:
                    for q in cutlass.range_constexpr(WK - 1):
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = acc[e] + red[e, lane, wrow, q]
            return acc

    return SplitKPrefetchKernel
