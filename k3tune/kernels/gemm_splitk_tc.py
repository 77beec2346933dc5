"""Split-K tensor-core decode GEMM in CuTe DSL, swap-AB: y^T = W x^T, so N (weight rows) fills the MMA's M.

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation, warp-level ``mma.sync.m16n8k16`` (runs on
Hopper and Blackwell alike; decode is bound by reading W, not by the tensor cores).

Layout trick: within each 32-wide chunk of K, lane ``t`` loads 16 contiguous bytes of W (8 bf16 at
``k0 + (t % 4) * 8``) for rows ``g`` and ``g + 8`` (``g = t // 4``), and 16 contiguous bytes of x for token ``g``.
The MMA's logical K order is a permutation of the chunk's physical K, the same permutation for both
operands, so the products are unchanged while every global load is a 16-byte vector (``ld.global.nc.v4``
for the weights) and no shared-memory staging is needed.

Work split: a CTA has ``warps_n x warps_k`` warps. ``warps_n`` warps own different row tiles (they share the
tokens' x through L1); ``warps_k`` warps stride over the CTA's K slice and are reduced through shared memory.
``split_k`` CTAs share a row tile: each writes fp32 partials to a workspace, and the last one to arrive (a
per-tile counter) sums the slices in slice order and writes bf16 — one launch, deterministic, and the counter
is reset by that CTA so the launch can be replayed in a CUDA graph.

M (tokens) is dynamic: one compile per (m_tiles, warps_n, warps_k, tile_m, split_k, unroll, arch) serves
every M and every projection shape; tokens beyond M and rows beyond N are clamped on load and masked on
store. Constraints: K a multiple of 32 x split_k, 16-byte aligned rows.

Run the numerics check on a GPU: ``pytest -m gpu tests/test_gpu_kernels.py``.
"""

import functools
import math
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.plan.problems import Problem

MAX_M = 512
KCHUNK = 32  # K per MMA pair (two m16n8k16 steps)
MAX_SPLIT = 16
MAX_ACC = 64  # fp32 accumulators per thread: 4 x m_tiles x tile_m / 8
MAX_REGS = 176  # load-batch + accumulator registers per lane (see _registers)


@dataclass(frozen=True)
class SplitKConfig(KernelConfig):
    m_tiles: int = 1  # 16-row MMA tiles of W per warp
    warps_n: int = 4  # warps over row tiles
    warps_k: int = 1  # warps over the CTA's K slice
    tile_m: int = 8  # tokens per CTA (MMA N), a multiple of 8
    split_k: int = 1  # CTAs over K
    unroll: int = 4  # K chunks loaded as one batch before their MMAs: 16-byte loads in flight per lane


def _registers(cfg: SplitKConfig) -> int:
    """32-bit registers a lane holds for loads in flight and accumulators (spills past ~200)."""
    nt = cfg.tile_m // 8
    return 4 * cfg.unroll * (2 * cfg.m_tiles + nt) + 4 * cfg.m_tiles * nt


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class SplitKTensorCoreGemm(KernelFamily):
    name = "gemm.splitk_tc"
    kinds = frozenset({"gemm"})
    config_cls = SplitKConfig
    backends = frozenset({"gpu", "simulated"})
    priority = 40

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and problem["M"] <= MAX_M and problem["K"] % KCHUNK == 0

    def space(self, problem: Problem) -> dict[str, tuple]:
        m = problem["M"]
        tiles = tuple(t for t in (8, 16, 32, 64) if t <= max(8, _pow2_ceil(m)))
        return {
            "m_tiles": (1, 2, 4),
            "warps_n": (1, 2, 4),
            "warps_k": (1, 2, 4),
            "tile_m": tiles,
            "split_k": (1, 2, 4, 8, 16),
            "unroll": (1, 2, 4, 8),
        }

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        chunks = k // KCHUNK
        return (
            chunks % cfg.split_k == 0
            and chunks // cfg.split_k >= cfg.warps_k
            and 4 * cfg.m_tiles * cfg.tile_m // 8 <= MAX_ACC
            and _registers(cfg) <= MAX_REGS
            and 16 * cfg.m_tiles * cfg.warps_n <= _pow2_ceil(n)  # no CTA made mostly of clamped rows
        )

    def default(self, problem: Problem) -> SplitKConfig:
        return self.seeds(problem)[0] if self.seeds(problem) else SplitKConfig()

    def seeds(self, problem: Problem) -> list[SplitKConfig]:
        """Warp layouts that fill the GPU: each with the smallest split-K giving >= 2 CTAs per SM (H200/GB300)."""
        m, n = problem["M"], problem["N"]
        tile_m = min(64, max(8, _pow2_ceil(m)))
        out = []
        for mt, wn, wk, u in ((1, 1, 4, 8), (1, 2, 2, 8), (1, 4, 1, 8), (2, 2, 2, 4)):
            u = u if tile_m <= 16 else 2
            row_ctas = math.ceil(n / (16 * mt * wn)) * math.ceil(m / tile_m)
            for split in (1, 2, 4, 8, 16):
                cfg = SplitKConfig(m_tiles=mt, warps_n=wn, warps_k=wk, tile_m=tile_m, split_k=split, unroll=u)
                if self.valid(cfg, problem) and (row_ctas * split >= 264 or split == 16):
                    out.append(cfg)
                    break
        return out

    def work(self, problem: Problem, cfg: SplitKConfig) -> Work:
        m, n = problem["M"], problem["N"]
        rows = 16 * cfg.m_tiles * cfg.warps_n
        m_passes = math.ceil(m / cfg.tile_m)
        ctas = math.ceil(n / rows) * m_passes * cfg.split_k
        partial = (cfg.split_k - 1) * m * n * 4 * 2 if cfg.split_k > 1 else 0
        return Work(
            # each token tile beyond the first re-reads W, mostly from L2
            hbm_bytes=gemm_common.gemm_bytes(problem) * (1 + 0.25 * (m_passes - 1)) + partial,
            flops=2.0 * cfg.tile_m * m_passes * n * problem["K"],
            ctas=ctas,
            inflight_bytes_per_cta=cfg.warps_n * cfg.warps_k * 32 * 32 * cfg.m_tiles * cfg.unroll,  # W bytes per batch
            tensor_cores=True,
            ctas_per_sm=min(16, 2048 // (cfg.warps_n * cfg.warps_k * 32)),
            launches=1,
            extra_us=0.1 * math.log2(cfg.split_k) + 0.05 * cfg.warps_k,
        )

    # ---- the measurer's interface --------------------------------------------------------------
    def make_inputs(self, problem: Problem, device, generator) -> dict:
        import torch

        inputs = gemm_common.make_inputs(problem, device, generator)
        m, n = problem["M"], problem["N"]
        inputs["out"] = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        inputs["ws"] = torch.empty(MAX_SPLIT, m, n, dtype=torch.float32, device=device)
        # one arrival counter per (row tile, token tile); the last CTA of a tile resets its counter
        inputs["counters"] = torch.zeros(n // 16 + 1, m // 8 + 1, dtype=torch.int32, device=device)
        return inputs

    def weight_names(self, problem: Problem) -> tuple[str, ...]:
        return ("w",)

    def reference(self, problem: Problem, inputs: dict):
        return gemm_common.reference(problem, inputs)

    def build(self, problem: Problem, cfg: SplitKConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        fn = compiled(cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.tile_m, cfg.split_k, cfg.unroll, current_arch())

        def run(inputs: dict):
            fn(*runtime_args(inputs), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        def runtime_args(inputs: dict):
            x = (from_dlpack(inputs["x"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=KCHUNK))
            w = (from_dlpack(inputs["w"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=KCHUNK))
            y = from_dlpack(inputs["out"], assumed_align=16).mark_layout_dynamic()
            ws = from_dlpack(inputs["ws"], assumed_align=16).mark_layout_dynamic()
            cnt = from_dlpack(inputs["counters"], assumed_align=4).mark_layout_dynamic()
            return x, w, y, ws, cnt

        return run


@functools.cache
def compiled(m_tiles: int, warps_n: int, warps_k: int, tile_m: int, split: int, unroll: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=KCHUNK)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    ws = make_fake_compact_tensor(Float32, (cute.sym_int(), m, n), stride_order=(2, 1, 0), assumed_align=16)
    cnt = make_fake_compact_tensor(Int32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=4)
    kernel = _kernel_class()(m_tiles, warps_n, warps_k, tile_m, split, unroll)
    return cute.compile(kernel, x, w, y, ws, cnt, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """The CuTe DSL kernel, defined on first use so that importing k3tune never imports the DSL."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32

    VEC = 8

    class SplitKTcKernel:
        def __init__(self, m_tiles, warps_n, warps_k, tile_m, split, unroll):
            self.mt, self.wn, self.wk, self.nt = m_tiles, warps_n, warps_k, tile_m // 8
            self.split, self.unroll = split, unroll
            self.rows = 16 * m_tiles * warps_n

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
                     mCnt: cute.Tensor, stream: cuda.CUstream):
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + 8 * self.nt - 1) // (8 * self.nt), self.split)
            self.kernel(mX, mW, mY, mWs, mCnt).launch(grid=grid, block=(self.wn * self.wk * 32, 1, 1),
                                                      stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor):
            MT, NT, WN, WK, S = self.mt, self.nt, self.wn, self.wk, self.split
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, bidz = cute.arch.block_idx()
            m = mX.shape[0]
            n = mW.shape[0]
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4
            c = lane % 4
            wrow = warp % WN
            wkk = warp // WN
            row0 = bidx * self.rows + wrow * 16 * MT
            tok0 = bidy * 8 * NT
            chunks = mW.shape[1] // (KCHUNK * S)  # 32-wide K chunks in this CTA's slice
            kc0 = bidz * chunks

            gW = cute.zipped_divide(mW, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
            x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))

            # rows and tokens this lane loads (clamped: out-of-range lanes compute values nobody stores)
            wrows = []
            for i in cutlass.range_constexpr(2 * MT):
                wrows.append(cutlass.min(row0 + (i // 2) * 16 + (i % 2) * 8 + g, n - 1))
            toks = []
            for j in cutlass.range_constexpr(NT):
                toks.append(cutlass.min(tok0 + j * 8 + g, m - 1))

            acc = cute.make_rmem_tensor(cute.make_layout((4, MT, NT)), Float32)
            acc.fill(0.0)
            U = self.unroll
            rw = cute.make_rmem_tensor(cute.make_layout((VEC, 2 * MT, U)), BFloat16)
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, NT, U)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, MT)), BFloat16)  # MMA operand order (PTX a0..a7)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)
            tmp = cute.make_rmem_tensor(cute.make_layout((4, MT, NT)), Float32)
            # batches of U consecutive chunks: every load of a batch is issued before the first MMA, so a warp
            # keeps U x (2 MT + NT) 16-byte loads per lane in flight instead of waiting a round trip per chunk.
            # No branch may separate a load from its MMA (the compiler would sink the load into it): whole
            # batches first, then one batch whose clamped tail is masked arithmetically.
            full = chunks - chunks % (WK * U)
            for kb in cutlass.range(wkk * U, full, WK * U):
                self._batch(gW, gX, w_atom, x_atom, mma, wrows, toks, kc0, kb, chunks, c, rw, rx, fa, fb, acc, tmp,
                            False)
            if full < chunks:
                self._batch(gW, gX, w_atom, x_atom, mma, wrows, toks, kc0, full + wkk * U, chunks, c, rw, rx, fa, fb,
                            acc, tmp, True)

            nacc = 4 * MT * NT
            smem = cutlass.utils.SmemAllocator()
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

            if cutlass.const_expr(S == 1):
                if wkk == 0:
                    self._store(acc, mY, row0, tok0, g, c, m, n)
            else:
                if wkk == 0:
                    self._store(acc, mWs[bidz, None, None], row0, tok0, g, c, m, n)
                cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
                if tidx == 0:
                    old = cute.arch.atomic_add((mCnt.iterator + (bidx * mCnt.shape[1] + bidy)), Int32(1),
                                               sem="acq_rel", scope="gpu")
                    flag[0] = old
                cute.arch.sync_threads()
                if flag[0] == S - 1:  # the last CTA of this tile: sum the slices in order, write bf16
                    cute.arch.fence_acq_rel_gpu()
                    if wkk == 0:
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = Float32(0.0)
                        for z in cutlass.range_constexpr(S):
                            self._accumulate(acc, mWs[z, None, None], row0, tok0, g, c, m, n)
                        self._store(acc, mY, row0, tok0, g, c, m, n)
                    if tidx == 0:
                        mCnt[bidx, bidy] = Int32(0)

        @cute.jit
        def _batch(self, gW, gX, w_atom, x_atom, mma, wrows, toks, kc0, kb, chunks, c, rw, rx, fa, fb, acc, tmp,
                   masked: cutlass.Constexpr):
            MT, NT, U = self.mt, self.nt, self.unroll
            for u in cutlass.range_constexpr(U):
                kv = (kc0 + cutlass.min(kb + u, chunks - 1)) * 4 + c  # lane's 16-byte vector along K
                for i in cutlass.range_constexpr(2 * MT):
                    cute.copy(w_atom, gW[(None, (wrows[i], kv))], rw[None, i, u])
                for j in cutlass.range_constexpr(NT):
                    cute.copy(x_atom, gX[(None, (toks[j], kv))], rx[None, j, u])
            for u in cutlass.range_constexpr(U):
                if cutlass.const_expr(masked):
                    tmp.fill(0.0)
                for s in cutlass.range_constexpr(2):  # two k16 steps: vector elements 4s..4s+3
                    for i in cutlass.range_constexpr(MT):
                        for h in cutlass.range_constexpr(2):  # a0a1/a4a5 (row g), a2a3/a6a7 (row g+8)
                            fa[4 * h, i] = rw[4 * s + 2 * h, 2 * i, u]
                            fa[4 * h + 1, i] = rw[4 * s + 2 * h + 1, 2 * i, u]
                            fa[4 * h + 2, i] = rw[4 * s + 2 * h, 2 * i + 1, u]
                            fa[4 * h + 3, i] = rw[4 * s + 2 * h + 1, 2 * i + 1, u]
                    for j in cutlass.range_constexpr(NT):
                        for v in cutlass.range_constexpr(4):
                            fb[v, j] = rx[4 * s + v, j, u]
                    if cutlass.const_expr(masked):
                        cute.gemm(mma, tmp, fa, fb, tmp)
                    else:
                        cute.gemm(mma, acc, fa, fb, acc)
                if cutlass.const_expr(masked):
                    keep = cutlass.max(cutlass.min(chunks - kb - u, 1), 0).to(Float32)  # 1 inside K, else 0
                    for e in cutlass.range_constexpr(4 * MT * NT):
                        acc[e] = acc[e] + tmp[e] * keep

        @cute.jit
        def _store(self, acc: cute.Tensor, out: cute.Tensor, row0, tok0, g, c, m, n):
            # accumulator element e = (h*2 + j): row g + 8h, token 2c + j of the (i, jt) tile
            for i in cutlass.range_constexpr(self.mt):
                for jt in cutlass.range_constexpr(self.nt):
                    for e in cutlass.range_constexpr(4):
                        r = row0 + i * 16 + g + 8 * (e // 2)
                        t = tok0 + jt * 8 + 2 * c + (e % 2)
                        if r < n and t < m:
                            out[t, r] = acc[e, i, jt].to(out.element_type)

        @cute.jit
        def _accumulate(self, acc: cute.Tensor, part: cute.Tensor, row0, tok0, g, c, m, n):
            # clamped indices, no branch: the loads of every slice issue together (a branch would serialise them)
            for i in cutlass.range_constexpr(self.mt):
                for jt in cutlass.range_constexpr(self.nt):
                    for e in cutlass.range_constexpr(4):
                        r = cutlass.min(row0 + i * 16 + g + 8 * (e // 2), n - 1)
                        t = cutlass.min(tok0 + jt * 8 + 2 * c + (e % 2), m - 1)
                        acc[e, i, jt] = acc[e, i, jt] + part[t, r]

    return SplitKTcKernel
