"""gemm.splitk_cluster with rank 0's receive buffer laid over its own ring (staged, session 54).

Why: at M = 16 splitk_cluster's 16-token tile costs ~1 us more than its 8-token tile at M = 8 on the 22 MB
projections (NOTES.md, s48), and bench/kline.py (s54, H100) puts that in the fixed part of each launch, not the
streaming rate. With the M = 8 winner's layout (16 rows, 4 K warps, split 8, a 4-stage 128-wide ring) the
16-token tile's ring is 32 KB, and the receive buffer for rank 0's 7 peers (7 KB, allocated in every CTA) takes
the CTA to 43 KB: 5 CTAs a SM, so the 768 CTAs of a 1536-row op take two waves. Here the peers push into rank 0's
ring, which rank 0 no longer needs once its K loop is done: the cluster barrier that arms rank 0's mbarrier moves
from before the main loop to after it, so no peer pushes before every CTA of the cluster (rank 0 included) has
left its K loop. The same layout is then 36 KB: 6 CTAs a SM, one wave. The price: a peer waits at that barrier
for the cluster's slowest CTA instead of pushing as soon as it is done (rank 0 waited for the slowest anyway).

The main loop and the K-warp sum are gemm_splitk_tc's, the launch gemm_splitk_cluster's (inherited); the partials
are summed in rank order (deterministic). M, N and K are dynamic. GPU numerics:
``pytest -m gpu tests/test_gpu_kernels.py -k splitk_alias``.
"""

import functools

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_cluster import SPLITS, SplitKClusterGemm, recv_bytes
from k3tune.kernels.gemm_splitk_tc import SMEM_BUDGET, SplitKConfig, SplitKTensorCoreGemm, smem_bytes
from k3tune.plan.problems import Problem


def ring_bytes(cfg: SplitKConfig) -> int:
    return cfg.stages * (16 * cfg.m_tiles * cfg.warps_n + cfg.tile_m) * cfg.bk * 2


class SplitKAliasGemm(SplitKClusterGemm):
    name = "gemm.splitk_alias"
    priority = 43
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster")

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        return (cfg.split_k in SPLITS and cfg.reduce == 0 and SplitKTensorCoreGemm.valid(self, cfg, problem)
                and smem_bytes(cfg) + 16 <= SMEM_BUDGET and recv_bytes(cfg) <= ring_bytes(cfg))

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
    """gemm_splitk_cluster's kernel with the receive buffer on the ring; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    class SplitKAliasKernel(gemm_splitk_cluster._kernel_class()):
        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor):
            MT, NT, WN, S = self.mt, self.nt, self.wn, self.split
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
            row0 = bidx * self.rows
            tok0 = bidy * self.tm
            ktiles = mW.shape[1] // (self.bk * S)
            kt0 = bidz * ktiles
            nacc = 4 * MT * NT

            smem = cutlass.memory.SmemAllocator()
            sW, sX = self._ring(smem)
            bar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)
            recv = cute.make_tensor(cute.recast_ptr(sW.iterator, dtype=Float32),
                                    cute.make_layout((S - 1) * 32 * WN * nacc))  # rank 0's ring, once it is done

            if rank == 0 and tidx == 0:
                cute.arch.mbarrier_init(bar.iterator, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar.iterator, (S - 1) * 32 * WN * nacc * 4)

            acc = self._mainloop(mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n)

            # every thread of the cluster is past its main loop (rank 0's ring is free) and rank 0's mbarrier armed
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
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

    return SplitKAliasKernel
