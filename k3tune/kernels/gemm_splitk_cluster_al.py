"""Staged (GPU numerics not yet run): gemm_splitk_cluster with the leader's receive buffer placed in its own
pipeline ring, which is dead once its main loop is done, so a CTA needs only the ring's shared memory.

Why: at M = 16 a 16-row CTA's ring holds as many x bytes as W bytes and the receive buffer doubles. The M <= 8 winner's
layout (16 rows, 4 K warps, split 8, bk 128, 4 stages) then fits 5 CTAs a SM for the 5.8 its grid needs: two waves,
9.1 us against 6.0 at M = 8 (H200 ncu, NOTES.md session 17 r3). Without the 7 KB receive buffer it fits 6, with 3
stages 8, and a SM has room for the next kernel's CTAs to start their weight stages (PDL) while this one finishes.

The price is the order of the cluster's sum. In gemm_splitk_cluster the CTAs arrive on the cluster barrier before
their main loops, so a peer pushes its partial as soon as its own loop ends. Here every CTA arrives after its main loop
(release: the leader's last ring reads and cp.async writes come first), so a peer pushes only once the leader's loop
is done too. The rest is the parent's: rank 0 arms one mbarrier at the start for every peer's bytes, the peers push
with ``st.async.shared::cluster`` and rank 0 sums the slots in rank order (deterministic) and writes bf16.
GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k cluster_al``.
"""

import dataclasses
import functools

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_cluster import SPLITS, SplitKClusterGemm, recv_bytes
from k3tune.kernels.gemm_splitk_tc import SMEM_BUDGET, SplitKConfig, SplitKTensorCoreGemm, smem_bytes
from k3tune.plan.problems import Problem


def ring_bytes(cfg: SplitKConfig) -> int:
    return cfg.stages * (16 * cfg.m_tiles * cfg.warps_n + cfg.tile_m) * cfg.bk * 2


class SplitKClusterAliasGemm(SplitKClusterGemm):
    name = "gemm.splitk_cluster_al"
    priority = 43
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster")

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        return (cfg.split_k in SPLITS and cfg.reduce == 0 and SplitKTensorCoreGemm.valid(self, cfg, problem)
                and recv_bytes(cfg) <= ring_bytes(cfg) and smem_bytes(cfg) + 16 <= SMEM_BUDGET)

    def seeds(self, problem: Problem) -> list[SplitKConfig]:
        """The parent's, and at M <= 16 the M <= 8 winners' one-warp-row layout with 3 and 4 stages (s17-r1)."""
        out = super().seeds(problem)
        if problem["M"] <= 16:
            base = SplitKConfig(m_tiles=1, warps_n=1, warps_k=4, tile_m=8 if problem["M"] <= 8 else 16, split_k=8,
                                bk=128, stages=4, pdl=1)
            out += [c for c in (base, dataclasses.replace(base, stages=3)) if self.valid(c, problem)]
        return list(dict.fromkeys(out))

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
    x, w, y = (make_fake_compact_tensor(BFloat16, shape, stride_order=(1, 0), assumed_align=16)
               for shape in ((m, k), (n, k), (m, n)))
    kernel = _kernel_class()(m_tiles, warps_n, warps_k, tile_m, split, bk, stages, 0, pdl)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """gemm_splitk_cluster's kernel with the receive buffer in the ring and the cluster barrier after the main loop."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    class SplitKClusterAliasKernel(gemm_splitk_cluster._kernel_class()):
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
            # the leader's receive buffer is its ring (W's part first): written by the peers only after the barrier
            recv = cute.make_tensor(cute.recast_ptr(sW.iterator, dtype=Float32),
                                    cute.make_layout((S - 1) * 32 * WN * nacc))

            if rank == 0 and tidx == 0:
                cute.arch.mbarrier_init(bar.iterator, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar.iterator, (S - 1) * 32 * WN * nacc * 4)

            acc = self._mainloop(mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n)

            # every thread's ring reads and copies are done: the leader's ring may now be overwritten by the peers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            slot = (wrow * 32 + lane) * nacc
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

    return SplitKClusterAliasKernel
