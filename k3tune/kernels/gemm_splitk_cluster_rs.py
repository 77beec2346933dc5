"""gemm.splitk_cluster with the partials reduce-scattered over the cluster instead of gathered to its leader
(staged: compiled on the CPU, GPU numerics not yet run).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation: gemm_splitk_cluster's main loop (splitk_tc's ring,
inherited) and cluster along grid z, with another end. There every peer pushes all its accumulators into rank 0's
shared memory and rank 0 sums and stores the whole tile: one SM receives (split - 1) x the tile's fp32 partials
over the SM-to-SM network and does all the adds (s14-r1/r4 probes: at M = 32-64 the cluster kernel lost to
splitk_tc's second kernel, kv_a M = 32 8.3 vs 5.8 us, while it won at M = 16 where the tile is half as big).
Here lane ``l`` of every warp is owned by rank ``l % split``: each thread pushes its accumulators (16 bytes a
``st.async``, counted on the owner's mbarrier) to the owner of its lane, and the owners (1/split of each CTA's
threads) sum the split slices in rank order (deterministic: the same order as the leader's sum) and store their
own outputs. Every SM then receives and adds (split - 1) / split of one tile, and all CTAs store.

Each CTA arms its own mbarrier for the bytes it will receive before the cluster barrier that lets the pushes start
(the main loop runs between its two halves); an owner writes its own slice into its receive buffer, waits, and
sums slots 0 .. split-1. Split sizes 2, 4, 8 (portable clusters; 32 lanes divide among them). GPU numerics:
``pytest -m gpu tests/test_gpu_kernels.py -k cluster_rs``. Staged in its own module so that gemm_splitk_cluster's
shipped winners keep their key; at the re-sweep that ships it, the sum becomes a knob of gemm_splitk_cluster.
"""

import dataclasses
import functools

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.base import Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_cluster import SplitKClusterGemm
from k3tune.kernels.gemm_splitk_tc import SMEM_BUDGET, SplitKConfig, SplitKTensorCoreGemm, smem_bytes
from k3tune.plan.problems import Problem


def recv_bytes(cfg: SplitKConfig) -> int:
    """Every CTA's receive buffer: one slot per rank of the accumulators of the lanes it owns (its own slot
    included): as many fp32 as one CTA's K-warp-0 accumulators."""
    return 32 * cfg.warps_n * 4 * cfg.m_tiles * (cfg.tile_m // 8) * 4


class SplitKClusterRsGemm(SplitKClusterGemm):
    name = "gemm.splitk_cluster_rs"
    priority = 41
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster")

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        return (cfg.split_k in gemm_splitk_cluster.SPLITS and cfg.reduce == 0
                and SplitKTensorCoreGemm.valid(self, cfg, problem)  # the ring's own rules (not the leader's buffer)
                and smem_bytes(cfg) + recv_bytes(cfg) + 16 <= SMEM_BUDGET)

    def seeds(self, problem: Problem) -> list[SplitKConfig]:
        """gemm_splitk_tc's seed layouts (under its own rules) at clusters of 8 and of 4, summed by reduce-scatter
        (the sum no longer grows with the cluster on one SM, so the larger cluster is worth a trial at every M)."""
        out = []
        for cfg in SplitKTensorCoreGemm().seeds(problem):
            for split in (8, 4):
                c = dataclasses.replace(cfg, split_k=split, reduce=0)
                if self.valid(c, problem):
                    out.append(c)
        return list(dict.fromkeys(out))

    def work(self, problem: Problem, cfg: SplitKConfig) -> Work:
        return dataclasses.replace(super().work(problem, cfg), extra_us=0.3)  # the cluster barrier; sums spread

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
    """gemm_splitk_cluster's kernel (its launch, ring and main loop) with the reduce-scatter end."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    class SplitKClusterRsKernel(gemm_splitk_cluster._kernel_class()):
        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor):
            MT, NT, WN, S = self.mt, self.nt, self.wn, self.split
            LPR = 32 // S  # lanes of a warp each rank owns
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
            # [source rank][owned lane][warp row][accumulator]
            recv = smem.allocate_tensor(Float32, cute.make_layout(S * LPR * WN * nacc), 16)
            bar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)

            # every CTA's mbarrier expects its owned lanes' accumulators from every peer before anyone can push
            if tidx == 0:
                cute.arch.mbarrier_init(bar.iterator, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar.iterator, (S - 1) * LPR * WN * nacc * 4)
            cute.arch.cluster_arrive_relaxed()

            acc = self._mainloop(mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n)

            cute.arch.cluster_wait()  # every CTA's mbarrier is initialised and armed
            owner = lane % S
            slot = ((rank * LPR + lane // S) * WN + wrow) * nacc  # this thread's accumulators in its owner's buffer
            if wkk == 0 and owner != rank:
                flat = cute.make_rmem_tensor(cute.make_layout(nacc), Float32)
                for e in cutlass.range_constexpr(nacc):
                    flat[e] = acc[e]
                bits = cute.recast_tensor(flat, Int32)
                for q in cutlass.range_constexpr(nacc // 4):
                    cute.arch.store_async_dsmem((recv.iterator + (slot + 4 * q)).align(16),
                                                (bits[4 * q], bits[4 * q + 1], bits[4 * q + 2], bits[4 * q + 3]),
                                                bar.iterator, owner)
            if wkk == 0 and owner == rank:
                for e in cutlass.range_constexpr(nacc):  # its own slice, in its rank's slot
                    recv[slot + e] = acc[e]
                cute.arch.mbarrier_wait(bar.iterator, 0)
                for e in cutlass.range_constexpr(nacc):
                    acc[e] = Float32(0.0)
                for z in cutlass.range_constexpr(S):  # rank order: deterministic
                    src = ((z * LPR + lane // S) * WN + wrow) * nacc
                    for e in cutlass.range_constexpr(nacc):
                        acc[e] = acc[e] + recv[src + e]
                self._store(acc, mY, row0 + wrow * 16 * MT, tok0, g, c, m, n)

    return SplitKClusterRsKernel
