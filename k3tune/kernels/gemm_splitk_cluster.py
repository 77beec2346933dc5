"""Split-K tensor-core decode GEMM whose split CTAs form one thread-block cluster and sum their partials in the
leader's shared memory: no workspace, no counter, no second kernel (GPU numerics passed on the H200, s14-r1).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation. The main loop is gemm_splitk_tc's (the same
``mma.sync`` swap-AB kernel, ring of ``cp.async`` stages, warps over rows and K), inherited from its kernel class;
only the end differs. The ``split_k`` CTAs of a (row tile, token tile) are launched as one cluster along grid z;
after the K loop, rank 0 initialises one mbarrier expecting every peer's bytes, a cluster barrier makes it visible,
each peer pushes its accumulators into its own slot of rank 0's receive buffer with ``st.async.shared::cluster``
(16 bytes a store, completion counted on rank 0's mbarrier), and rank 0 waits, adds the slots in rank order
(deterministic) and writes bf16. Why: the second kernel of the split-K winners costs ~1-2 us on 2-5 us floors
(NOTES.md, session 13), and the few-row projections need split-K at M = 16-64 to own enough rows per CTA.

The main loop and the K-warp sum are gemm_splitk_tc's (``_ring``, ``_mainloop``, inherited). Cluster sizes 2, 4 and 8
(portable). With ``pdl = 1`` the launch allows programmatic dependent launch as in
gemm_splitk_tc. M, N and K are dynamic. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k cluster``.
"""

import dataclasses
import functools

from k3tune.kernels import gemm_splitk_tc
from k3tune.kernels.base import Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_tc import SMEM_BUDGET, SplitKConfig, SplitKTensorCoreGemm, _pow2_ceil, smem_bytes
from k3tune.plan.problems import Problem

SPLITS = (2, 4, 8)  # portable cluster sizes
# (M up to, [(m_tiles, warps_n, warps_k, bk, stages, split_k)]): the best configs of the whole space at M = 2, 8 and 16
# on TP8 mla.q_a (1536 x 7168) and kda.o_proj (7168 x 1536), H200, bench/probe_gemm.py (NOTES.md, s17-r1). At M <= 8
# the one-warp-row layout with 4 K warps and a 4-stage ring took q_a to 6.0 us (0.88 of the floor; the sweep's pick
# 6.2-6.5 us ran a 6-stage ring: 7.6 us) and o_proj to 5.6 (0.93; the pick, splitk_tc, 6.3).
PROBED = ((8, [(1, 1, 4, 128, 4, 8), (1, 2, 2, 64, 4, 4), (1, 1, 4, 128, 4, 2)]),
          (16, [(1, 2, 2, 128, 6, 4), (1, 2, 2, 128, 4, 2)]))


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
        """gemm_splitk_tc's seed layouts (chosen under its own rules: its splits go to 16) at a cluster of 8 up to
        M = 16 and of 4 beyond (the s14-r1 probe's best on the 576- to 1536-row ops), summed in the cluster. (Under
        this family's rules the narrow ops had no seed at all: their splitk_tc seeds split 16, and the default left
        was a 2-stage, 32-wide ring 2x slower than cuBLAS.) Then PROBED's layouts for the problem's M: the whole
        space's best on the 22 MB ops, which the sweep's ~20 trials a problem did not reach (s17-r1)."""
        m = problem["M"]
        out = []
        for cfg in SplitKTensorCoreGemm().seeds(problem):
            for split in (8, 4) if m <= 16 else (4, 8):
                c = dataclasses.replace(cfg, split_k=split, reduce=0)
                if self.valid(c, problem):
                    out.append(c)
                    break
        tile_m = min(32, max(8, _pow2_ceil(m)))
        for top, layouts in PROBED:
            if m <= top:
                for mt, wn, wk, bk, st, split in layouts:
                    c = SplitKConfig(m_tiles=mt, warps_n=wn, warps_k=wk, tile_m=tile_m, split_k=split, bk=bk,
                                     stages=st, pdl=1)
                    if self.valid(c, problem):
                        out.append(c)
                break
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
    from cutlass import Float32, Int32, Int64

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
            recv = smem.allocate_tensor(Float32, cute.make_layout((S - 1) * 32 * WN * nacc), 16)
            bar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)

            # rank 0's mbarrier expects every peer's bytes before anyone can push (the cluster barrier below)
            if rank == 0 and tidx == 0:
                cute.arch.mbarrier_init(bar.iterator, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar.iterator, (S - 1) * 32 * WN * nacc * 4)
            cute.arch.cluster_arrive_relaxed()

            # gemm_splitk_tc's main loop and K-warp sum (the same ring, the same order)
            acc = self._mainloop(mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n)

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
