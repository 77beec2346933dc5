"""Whole-slice streaming decode GEMM in CuTe DSL (M <= 8): each CTA's weight rows, the whole of K, are requested at
once into shared memory, so the bytes in flight are the whole problem and no split of K (no second kernel) is needed.

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation. Why another small-M kernel: on the K = 7168
projections with few rows (router, kv_a, q_a, gate, shared w13: N = 280-1536) the others need split-K for enough
CTAs and bytes in flight, and its second (reduce) kernel costs ~1-2 us on 2-5 us floors (NOTES.md, session 13).
Here a CTA owns ``rows`` rows (N / rows CTAs) and one thread of warp 0 issues, at the CTA's start, one TMA copy per
256-wide chunk of K (rows x 256 bf16, its own mbarrier): up to ~200 KB per CTA in flight with no registers held and
no ring to recycle (each barrier completes once, phase 0). Rows past N are zero-filled by TMA and masked on store.

Warp ``w`` takes chunks w, w + warps, ...; x's 16-byte vectors for a chunk are loaded (from L2: x is tiny) before
the chunk's barrier is waited on, so their latency hides behind it. Two compute paths (``mma``):
- 0, CUDA-core FMA (M <= 4): lane ``l`` covers K columns 8l..8l+7 of the chunk for every row and token; the
  rows x M sums are reduced across lanes with shuffles. Issue-bound beyond M = 1-2 (session 13: q_a M = 4 8.3 us).
- 1, ``mma.sync.m16n8k16`` swap-AB (rows <= 16 on the MMA's M, tokens on its N): lane (g, q) takes vector q of
  each 32-wide block of K for rows g and g + 8 and token g, as gemm_splitk_tc does (the MMA's logical K order is a
  permutation of the block's physical K, the same for both operands); rows past ``rows`` and tokens past M read
  clamped data whose results are never stored. Beyond M = 8 every CTA re-reading x from L2 (M / rows of the
  weight traffic) makes the L2 the limit, and the split-K kernels win (session 13: q_a M = 16 9.5 vs 8.0 us).
Partial sums are reduced across warps through shared memory in warp order (deterministic) and written as bf16.

With ``pdl = 1`` the launch allows programmatic dependent launch: the weight copies (which depend on no kernel) are
issued before the kernel waits for the grid before it, and x and the output are touched only after that wait.

Constraints: M <= 8 and K a multiple of 256 (compile-time: one binary per M, K and knob set; N is dynamic),
rows x K x 2 bytes within the shared-memory budget, 16-byte aligned rows. TMA and mma.sync: Hopper and Blackwell
alike. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k stream``.
"""

import functools
import math
import os
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.plan.problems import Problem

MAX_M = 8  # beyond, every CTA re-reading x from L2 (M/rows of W's traffic) loses to the split-K kernels (session 13)
MAX_M_FMA = 4  # the FMA path is bound by instruction issue beyond (NOTES.md, session 13)
MAX_ROWS_MMA = 16  # one m16 tile: rows g and g + 8 of each lane
BK = 256  # K per chunk: 32 lanes x 8 bf16 (one 16-byte vector per lane and row)
VEC = 8
MIN_WARPS = 4  # a warp takes whole chunks: K >= 4 x 256
MAX_ACC = 48  # fp32 accumulators per thread (rows x M)
SMEM_BUDGET = 210 * 1024  # the weight slice, the mbarriers and the cross-warp sums (H200: 227 KB per block)
SMEM_PER_SM = 227 * 1024
SMS = 132  # H200 SMs: the seed's one-wave rule (the search measures the others)


@dataclass(frozen=True)
class StreamConfig(KernelConfig):
    rows: int = 4  # weight rows per CTA (N / rows CTAs)
    warps: int = 8  # warps over the chunks of K
    mma: int = 0  # 0: CUDA-core FMA (M <= 4); 1: tensor-core mma.sync m16n8k16 (rows on the MMA's M, tokens on N)
    pdl: int = 0  # 1: programmatic dependent launch (the weight copies issued before the wait)


def smem_bytes(cfg: StreamConfig, problem: Problem) -> int:
    chunks = problem["K"] // BK
    red = cfg.warps * 4 * _n_tiles(problem["M"]) * 32 if cfg.mma else cfg.warps * cfg.rows * problem["M"]
    return cfg.rows * problem["K"] * 2 + 16 * chunks + red * 4 + 256


def _n_tiles(m: int) -> int:
    return (m + 7) // 8


class StreamGemm(gemm_common.DenseGemm):
    name = "gemm.stream"
    config_cls = StreamConfig
    backends = frozenset({"gpu", "simulated"})
    priority = 35
    depends_on = ("k3tune.kernels.gemm_common",)  # inputs and the fp32 reference
    off = {"pdl": 0}

    def can_implement(self, problem: Problem) -> bool:
        return (super().can_implement(problem) and problem["M"] <= MAX_M and problem["K"] % BK == 0
                and problem["K"] // BK >= MIN_WARPS and problem["K"] * 2 <= SMEM_BUDGET - 4096)

    def space(self, problem: Problem) -> dict[str, tuple]:
        m, n = problem["M"], problem["N"]
        return {
            "rows": tuple(r for r in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
                          if (r * m <= MAX_ACC or m > MAX_M_FMA) and r <= max(1, n)),
            "warps": (MIN_WARPS, 8, 16),
            "mma": (0, 1) if m <= MAX_M_FMA else (1,),
            "pdl": (0, 1),
        }

    def valid(self, cfg: StreamConfig, problem: Problem) -> bool:
        m = problem["M"]
        fits = cfg.rows <= MAX_ROWS_MMA if cfg.mma else (m <= MAX_M_FMA and cfg.rows * m <= MAX_ACC)
        return fits and smem_bytes(cfg, problem) <= SMEM_BUDGET and cfg.warps <= problem["K"] // BK

    def ctas_per_sm(self, cfg: StreamConfig, problem: Problem) -> int:
        return max(1, min(32, 2048 // (32 * cfg.warps), SMEM_PER_SM // smem_bytes(cfg, problem)))

    def default(self, problem: Problem) -> StreamConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else StreamConfig()

    def seeds(self, problem: Problem) -> list[StreamConfig]:
        """The fewest rows per CTA whose grid runs in one wave (every CTA resident, so all of W is requested at
        once) and the next row count up, and the most rows that still give every SM a CTA (one CTA per SM, the
        least x traffic); FMA at M = 1, the MMA beyond; 16 warps where K has the chunks for them, and PDL. (The
        session-13 probe's best: 4-12 rows, 16 warps.)"""
        n, chunks = problem["N"], problem["K"] // BK
        warps = 16 if chunks >= 16 else 8 if chunks >= 8 else MIN_WARPS
        mma = int(problem["M"] > 1)
        fits = [r for r in self.space(problem)["rows"] if self.valid(StreamConfig(r, warps, mma, 1), problem)]
        if not fits:
            return []
        one_wave = [r for r in fits
                    if math.ceil(n / r) <= SMS * self.ctas_per_sm(StreamConfig(r, warps, mma, 1), problem)]
        best = one_wave[0] if one_wave else fits[-1]
        i = fits.index(best)
        per_sm = [r for r in fits if math.ceil(n / r) >= SMS]
        picks = [best] + fits[i + 1:i + 2] + per_sm[-1:] + ([r for r in (8, 12) if r in fits] if mma else [])
        return [StreamConfig(r, warps, mma, 1) for r in dict.fromkeys(picks)]

    def work(self, problem: Problem, cfg: StreamConfig) -> Work:
        m, n, k = problem["M"], problem["N"], problem["K"]
        ctas = math.ceil(n / cfg.rows)
        return Work(
            hbm_bytes=gemm_common.gemm_bytes(problem) + (ctas * cfg.rows - n) * k * 2,
            flops=gemm_common.gemm_flops(problem) * ((16 * 8 * _n_tiles(m)) / (cfg.rows * m) if cfg.mma else 1),
            ctas=ctas,
            inflight_bytes_per_cta=cfg.rows * k * 2,
            tensor_cores=bool(cfg.mma),
            ctas_per_sm=self.ctas_per_sm(cfg, problem),
            extra_us=0.05 if cfg.mma else 0.01 * cfg.rows * m * 5,  # the lane and warp reductions
        )

    # ---- the measurer's interface --------------------------------------------------------------

    def build(self, problem: Problem, cfg: StreamConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        m, k = problem["M"], problem["K"]
        fn = compiled(m, cfg.rows, cfg.warps, k, cfg.pdl, current_arch(), cfg.mma)

        def run(inputs: dict):
            if tuple(inputs["x"].shape) != (m, k) or inputs["w"].shape[1] != k:
                raise ValueError(f"gemm.stream was compiled for M={m}, K={k}, not x {tuple(inputs['x'].shape)}")
            x = from_dlpack(inputs["x"], assumed_align=16)
            w = from_dlpack(inputs["w"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
            y = from_dlpack(inputs["out"], assumed_align=16).mark_compact_shape_dynamic(mode=1)
            fn(x, w, y, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        return run


@functools.cache
def compiled(m: int, rows: int, warps: int, k: int, pdl: int, arch: str, mma: int = 0):
    """Compile once per (M, rows, warps, K, pdl, arch, mma); N is dynamic. Never call inside a capture."""
    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    n = cute.sym_int()
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    kernel = _kernel_class()(m, rows, warps, k, pdl, mma)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """The CuTe DSL kernel, defined on first use so that importing k3tune never imports the DSL."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import cpasync

    class StreamKernel:
        def __init__(self, m, rows, warps, k, pdl, mma):
            self.m, self.rows, self.warps, self.k = m, rows, warps, k
            self.chunks = k // BK
            self.pdl = bool(pdl)
            self.mma = bool(mma)
            self.nt = _n_tiles(m)
            self.nred = 4 * self.nt * 32 if self.mma else rows * m  # cross-warp partial sums per warp

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
            R, C = self.rows, self.chunks
            s_chunk = cute.make_layout((R, BK), stride=(BK, 1))
            tma_w, tW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW, s_chunk, (R, BK))

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, C * 2]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, R * BK * C], 128]
                red: cute.struct.Align[cute.struct.MemRange[Float32, self.warps * self.nred], 16]

            self.storage = Storage
            n = mW.shape[0]
            self.kernel(tma_w, tW, mX, mY).launch(grid=((n + R - 1) // R, 1, 1), block=[self.warps * 32, 1, 1],
                                                  stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor):
            R, W, C = self.rows, self.warps, self.chunks
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tidx % 32
            n = mY.shape[1]
            row0 = bidx * R

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            if warp == 0:
                cpasync.prefetch_descriptor(tma_w)
            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(self.storage)
            # one stage per chunk, each filled once: the consumers wait for phase 0 and never release
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.bars.data_ptr(), num_stages=C,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, W),
                tx_count=R * BK * 2, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            sW = st.sW.get_tensor(cute.make_layout((R, BK, C), stride=(BK, 1, R * BK)))
            gW = cute.local_tile(mW, (R, BK), (bidx, None))  # (R, BK, chunks) of this CTA's rows
            tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                             cute.group_modes(gW, 0, 2))
            if warp == 0:  # the whole slice, requested at once: it depends on no kernel
                for c in cutlass.range(C, unroll=1):
                    ps = pipeline.PipelineState(C, c, c, 1)
                    pipe.producer_acquire(ps)
                    cute.copy(tma_w, tWg[(None, c)], tWs[(None, c)], tma_bar_ptr=pipe.producer_get_barrier(ps))
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x and the output only from here on

            vW = cute.zipped_divide(sW, (1, VEC, 1))  # ((1, 8, 1), (R, 32, chunks)): one 16-byte vector each
            gX = cute.zipped_divide(mX, (1, VEC))  # ((1, 8), (M, K / 8))
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            if cutlass.const_expr(self.mma):
                self._mma_path(vW, gX, mY, atom, pipe, st, warp, lane, tidx, row0, n)
            else:
                self._fma_path(vW, gX, mY, atom, pipe, st, warp, lane, tidx, row0, n)

        @cute.jit
        def _fma_path(self, vW, gX, mY, atom, pipe, st, warp, lane, tidx, row0, n):
            R, M, W, C = self.rows, self.m, self.warps, self.chunks
            red = st.red.get_tensor(cute.make_layout((W, R * M), stride=(R * M, 1)))
            acc = cute.make_rmem_tensor(cute.make_layout(R * M), Float32)
            acc.fill(0.0)
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, M), stride=(1, VEC)), BFloat16)
            xf = cute.make_rmem_tensor(cute.make_layout((VEC, M)), Float32)
            rw = cute.make_rmem_tensor_like(vW[(None, (0, 0, 0))])
            wf = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            for c in cutlass.range(warp, C, W, unroll=1):
                for mi in cutlass.range_constexpr(M):  # issued before the wait: their latency hides behind it
                    cute.copy(atom, gX[(None, (mi, c * 32 + lane))], rx[(None, mi)])
                pipe.consumer_wait(pipeline.PipelineState(C, c, c, 0))
                for mi in cutlass.range_constexpr(M):
                    xv = rx[(None, mi)].load().to(Float32)
                    for j in cutlass.range_constexpr(VEC):
                        xf[j, mi] = xv[j]
                for r in cutlass.range_constexpr(R):
                    cute.copy(atom, vW[(None, (r, lane, c))], rw)
                    wf.store(rw.load().to(Float32))
                    for mi in cutlass.range_constexpr(M):
                        a = acc[r * M + mi]
                        for j in cutlass.range_constexpr(VEC):  # an FMA chain per (row, token)
                            a = a + wf[j] * xf[j, mi]
                        acc[r * M + mi] = a

            for i in cutlass.range_constexpr(R * M):
                v = cute.arch.warp_reduction_sum(acc[i])
                if lane == 0:
                    red[warp, i] = v
            cute.arch.sync_threads()
            if tidx < R * M:
                s = Float32(0.0)
                for wi in cutlass.range_constexpr(W):  # warp order: deterministic
                    s = s + red[wi, tidx]
                r = tidx // M
                mi = tidx % M
                if row0 + r < n:
                    mY[mi, row0 + r] = s.to(BFloat16)

        @cute.jit
        def _mma_path(self, vW, gX, mY, atom, pipe, st, warp, lane, tidx, row0, n):
            """mma.sync m16n8k16, swap-AB: the A operand is rows g and g + 8 of the CTA's slice (rows past ``rows``
            read a clamped row: their results are never stored), B is token g of each 8-token tile (clamped
            likewise). Lane (g, q) takes the 16-byte vector q of every 32-wide block of K for its rows and tokens:
            the MMA's logical K order is a permutation of the block's physical K, the same for both operands."""
            R, M, W, C, NT = self.rows, self.m, self.warps, self.chunks, self.nt
            KB = BK // 32  # 32-wide blocks per chunk
            g = lane // 4
            q = lane % 4
            ra = cutlass.min(g, R - 1)
            rb = cutlass.min(g + 8, R - 1)
            red = st.red.get_tensor(cute.make_layout((W, 4 * NT, 32), stride=(4 * NT * 32, 32, 1)))
            mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
            acc = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)
            acc.fill(0.0)
            acc1 = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)  # the odd k16 steps: two chains
            acc1.fill(0.0)
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, KB, NT), stride=(1, VEC, VEC * KB)), BFloat16)
            rw = cute.make_rmem_tensor(cute.make_layout((VEC, 2), stride=(1, VEC)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, 1)), BFloat16)  # MMA operand order (PTX a0..a7)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)
            for c in cutlass.range(warp, C, W, unroll=1):
                for j in cutlass.range_constexpr(NT):  # x first: its latency hides behind the wait for W
                    tok = cutlass.min(j * 8 + g, M - 1)
                    for kb in cutlass.range_constexpr(KB):
                        cute.copy(atom, gX[(None, (tok, c * 32 + kb * 4 + q))], rx[(None, kb, j)])
                pipe.consumer_wait(pipeline.PipelineState(C, c, c, 0))
                for kb in cutlass.range_constexpr(KB):
                    cute.copy(atom, vW[(None, (ra, kb * 4 + q, c))], rw[(None, 0)])
                    if cutlass.const_expr(R > 8):
                        cute.copy(atom, vW[(None, (rb, kb * 4 + q, c))], rw[(None, 1)])
                    for s in cutlass.range_constexpr(2):  # two k16 steps: vector elements 4s..4s+3
                        for h in cutlass.range_constexpr(2):  # a0a1/a4a5 (row g), a2a3/a6a7 (row g+8)
                            fa[4 * h, 0] = rw[4 * s + 2 * h, 0]
                            fa[4 * h + 1, 0] = rw[4 * s + 2 * h + 1, 0]
                            if cutlass.const_expr(R > 8):
                                fa[4 * h + 2, 0] = rw[4 * s + 2 * h, 1]
                                fa[4 * h + 3, 0] = rw[4 * s + 2 * h + 1, 1]
                            else:
                                fa[4 * h + 2, 0] = rw[4 * s + 2 * h, 0]
                                fa[4 * h + 3, 0] = rw[4 * s + 2 * h + 1, 0]
                        for j in cutlass.range_constexpr(NT):
                            for v in cutlass.range_constexpr(4):
                                fb[v, j] = rx[4 * s + v, kb, j]
                        if cutlass.const_expr(s == 0):
                            cute.gemm(mma, acc, fa, fb, acc)
                        else:
                            cute.gemm(mma, acc1, fa, fb, acc1)

            for e in cutlass.range_constexpr(4 * NT):  # warps 1.. hand their sums to warp 0, summed in warp order
                red[warp, e, lane] = acc[e % 4, 0, e // 4] + acc1[e % 4, 0, e // 4]
            cute.arch.sync_threads()
            if warp == 0:
                m = mY.shape[0]
                for jt in cutlass.range_constexpr(NT):
                    for e in cutlass.range_constexpr(4):  # element e: row g + 8 (e // 2), token 2q + e % 2
                        s = Float32(0.0)
                        for wi in cutlass.range_constexpr(W):
                            s = s + red[wi, jt * 4 + e, lane]
                        r = g + 8 * (e // 2)
                        t = jt * 8 + 2 * q + (e % 2)
                        if r < R and row0 + r < n and t < m:
                            mY[t, row0 + r] = s.to(BFloat16)

    return StreamKernel
