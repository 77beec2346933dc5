"""Split-K tensor-core decode GEMM in CuTe DSL, swap-AB: y^T = W x^T, so N (weight rows) fills the MMA's M.

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation, warp-level ``mma.sync.m16n8k16`` (runs on
Hopper and Blackwell alike; decode is bound by reading W, not by the tensor cores).

Pipeline: the CTA's tiles of W (``16 m_tiles warps_n`` rows x ``bk``) and of x (``tile_m`` tokens x ``bk``) stream
through a ring of ``stages`` shared-memory buffers with ``cp.async`` (16-byte copies that bypass L1, issued by
every thread, consecutive threads on consecutive bytes of a row): ``stages - 1`` tiles are in flight while one is
computed, so the bytes a CTA keeps in flight do not depend on registers, and x is read from HBM/L2 once per CTA.
(A register-direct version, where each warp loaded its own operands, reached 0.63 of DRAM bandwidth at 18%
achieved occupancy on the H200: NOTES.md, session 6.)

Operand layout: within each 32-wide chunk of K, lane ``t`` reads 16 contiguous bytes (8 bf16 at ``(t % 4) * 8``)
of rows ``g`` and ``g + 8`` (``g = t // 4``) of the W tile and of token ``g`` of the x tile. The MMA's logical K
order is a permutation of the chunk's physical K, the same for both operands, so the products are unchanged
and every shared-memory read is one 16-byte vector (no ldmatrix). Rows of 128 or 256 bytes would put rows
``g`` and ``g + 1`` of a quarter-warp on the same banks: the 16-byte vector ``j`` of row ``r`` is stored at
``j ^ 4 (r & 1)`` (conflict-free reads; rows of 64 bytes need no swizzle).

Work split: ``warps_n`` warps own different row tiles; ``warps_k`` warps take different 32-wide chunks of each
stage and are reduced through shared memory in warp order. ``split_k`` CTAs share a row tile: each writes fp32
partials to a workspace, and the last one to arrive (a per-tile counter) sums the slices in slice order and
writes bf16 — one launch, deterministic, and that CTA resets the counter so the launch replays in a CUDA graph.
With ``pdl = 1`` the launches allow programmatic dependent launch: a kernel starts while the one before it in the
stream finishes (if that one triggers, as these do at their start), loads its first W stages (they depend on no
kernel), and waits for the previous grid before it touches x, the output, the workspace or the counters. A
predecessor that never triggers makes it an ordinary launch. Its gain is real only in a chain of such kernels
(bench/gemm.py reports the tuned time with PDL off beside it).
With ``reduce = 1`` the CTAs only write their partials and a second kernel sums them in slice order (two launches,
no fence/atomic chain at the end of the first). (A thread-block cluster reducing the split CTAs' partials over
DSMEM was measured slower, 1.1-1.2x, on the H200: NOTES.md, session 6.)

M (tokens) is dynamic: one compile per knob set and arch serves every M and every projection shape; tokens
beyond M are not loaded, rows beyond N are clamped on load, and both are masked on store. Constraints: K a
multiple of bk x split_k, 16-byte aligned rows.

Run the numerics check on a GPU: ``pytest -m gpu tests/test_gpu_kernels.py``.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.plan.problems import Problem

MAX_M = 512
KCHUNK = 32  # K per MMA pair (two m16n8k16 steps)
MAX_SPLIT = 16
MAX_ACC = 64  # fp32 accumulators per thread: 4 x m_tiles x tile_m / 8
SMEM_BUDGET = 100 * 1024  # pipeline + reduction bytes per CTA (H200: 227 KB per SM; two CTAs still fit)


@dataclass(frozen=True)
class SplitKConfig(KernelConfig):
    m_tiles: int = 1  # 16-row MMA tiles of W per warp
    warps_n: int = 4  # warps over row tiles
    warps_k: int = 1  # warps over the 32-wide K chunks of each stage
    tile_m: int = 8  # tokens per CTA (MMA N), a multiple of 8
    split_k: int = 1  # CTAs over K
    bk: int = 64  # K per pipeline stage
    stages: int = 4  # shared-memory buffers in the ring: stages - 1 tiles in flight
    reduce: int = 0  # split-K partials summed by 0: the tile's last CTA (one launch), 1: a second kernel
    pdl: int = 0  # 1: programmatic dependent launch: the first stages of W load while the previous kernel finishes


def smem_bytes(cfg: SplitKConfig) -> int:
    rows = 16 * cfg.m_tiles * cfg.warps_n
    ring = cfg.stages * (rows + cfg.tile_m) * cfg.bk * 2
    red = 4 * cfg.m_tiles * (cfg.tile_m // 8) * 32 * cfg.warps_n * (cfg.warps_k - 1) * 4
    return ring + red + 16


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class SplitKTensorCoreGemm(gemm_common.DenseGemm):
    name = "gemm.splitk_tc"
    workspace_splits = MAX_SPLIT
    counters = True
    config_cls = SplitKConfig
    backends = frozenset({"gpu", "simulated"})
    priority = 40
    depends_on = ("k3tune.kernels.gemm_common",)  # inputs, the fp32 reference and the split-K reduce kernel
    off = {"pdl": 0}  # programmatic dependent launch is recorded only where it pays beyond the noise

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
            "bk": (32, 64, 128),
            "stages": (2, 3, 4, 6, 8),
            "reduce": (0, 1),
            "pdl": (0, 1),
        }

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        return (
            k % (cfg.bk * cfg.split_k) == 0
            and (cfg.bk // KCHUNK) % cfg.warps_k == 0  # each K warp takes the same number of chunks per stage
            and 4 * cfg.m_tiles * cfg.tile_m // 8 <= MAX_ACC
            and smem_bytes(cfg) <= SMEM_BUDGET
            and 16 * cfg.m_tiles * cfg.warps_n <= _pow2_ceil(n)  # no CTA made mostly of clamped rows
        )

    def canonical(self, params: dict) -> dict:
        """Without split-K there is nothing to reduce: the reduce knob is ignored."""
        return {**params, "reduce": 0} if params.get("split_k") == 1 else params

    def default(self, problem: Problem) -> SplitKConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else SplitKConfig()

    def seeds(self, problem: Problem) -> list[SplitKConfig]:
        """Layouts that fill the GPU: each with the smallest split-K giving >= 2 CTAs per SM (H200/GB300), with
        programmatic dependent launch (each of the 84 tensor-core winners of the H200 dense sweep used it; the
        search remeasures the leader without it, ``off``). Token tiles stop at 32: at M = 64 every 64-token tile
        the H200 sweeps measured lost to cuBLAS (TP8 kda.o_proj 16.1 us vs 8.7) while 32-token ones won on the
        narrow shapes (mla.kv_a 7.8 vs 9.2). The one-warp-row layout runs a 6-stage ring (22 of those winners)."""
        m, n = problem["M"], problem["N"]
        tile_m = min(32, max(8, _pow2_ceil(m)))
        out = []
        for mt, wn, wk, bk, st in ((1, 4, 1, 64, 4), (1, 2, 2, 128, 4), (2, 2, 1, 64, 4), (1, 1, 4, 128, 6)):
            row_ctas = math.ceil(n / (16 * mt * wn)) * math.ceil(m / tile_m)
            for split in (1, 2, 4, 8, 16):
                for b in (bk, 64, 32):  # K slices too short for this bk take a smaller one
                    cfg = SplitKConfig(m_tiles=mt, warps_n=wn, warps_k=min(wk, b // KCHUNK), tile_m=tile_m,
                                       split_k=split, bk=b, stages=st, pdl=1)
                    if self.valid(cfg, problem):
                        break
                if self.valid(cfg, problem) and (row_ctas * split >= 264 or split == 16):
                    out.append(cfg)
                    if split > 1:  # the same split, summed by a second kernel
                        out.append(dataclasses.replace(cfg, reduce=1))
                    break
        return list(dict.fromkeys(out))

    def work(self, problem: Problem, cfg: SplitKConfig) -> Work:
        m, n = problem["M"], problem["N"]
        rows = 16 * cfg.m_tiles * cfg.warps_n
        m_passes = math.ceil(m / cfg.tile_m)
        ctas = math.ceil(n / rows) * m_passes * cfg.split_k
        partial = (cfg.split_k - 1) * m * n * 4 * 2 if cfg.split_k > 1 else 0
        threads = cfg.warps_n * cfg.warps_k * 32
        return Work(
            # each token tile beyond the first re-reads W, mostly from L2
            hbm_bytes=gemm_common.gemm_bytes(problem) * (1 + 0.25 * (m_passes - 1)) + partial,
            flops=2.0 * cfg.tile_m * m_passes * n * problem["K"],
            ctas=ctas,
            inflight_bytes_per_cta=(cfg.stages - 1) * rows * cfg.bk * 2,  # W tiles in flight in the ring
            tensor_cores=True,
            ctas_per_sm=max(1, min(16, 2048 // threads, 227 * 1024 // smem_bytes(cfg))),
            launches=2 if cfg.reduce and cfg.split_k > 1 else 1,
            extra_us=0.1 * math.log2(cfg.split_k) + 0.05 * cfg.warps_k,
        )

    # ---- the measurer's interface --------------------------------------------------------------

    def build(self, problem: Problem, cfg: SplitKConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        fn = compiled(cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages,
                      cfg.reduce, cfg.pdl, current_arch())

        def run(inputs: dict):
            fn(*runtime_args(inputs), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        def runtime_args(inputs: dict):
            x = (from_dlpack(inputs["x"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            w = (from_dlpack(inputs["w"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            y = from_dlpack(inputs["out"], assumed_align=16).mark_layout_dynamic()
            ws = from_dlpack(inputs["ws"], assumed_align=16).mark_layout_dynamic()
            cnt = from_dlpack(inputs["counters"], assumed_align=4).mark_layout_dynamic()
            return x, w, y, ws, cnt

        return run


@functools.cache
def compiled(m_tiles: int, warps_n: int, warps_k: int, tile_m: int, split: int, bk: int, stages: int, reduce: int,
             pdl: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    ws = make_fake_compact_tensor(Float32, (cute.sym_int(), m, n), stride_order=(2, 1, 0), assumed_align=16)
    cnt = make_fake_compact_tensor(Int32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=4)
    kernel = _kernel_class()(m_tiles, warps_n, warps_k, tile_m, split, bk, stages, reduce, pdl)
    return cute.compile(kernel, x, w, y, ws, cnt, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """The CuTe DSL kernel, defined on first use so that importing k3tune never imports the DSL."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32

    VEC = 8

    class SplitKTcKernel(gemm_common.splitk_reduce()):
        def __init__(self, m_tiles, warps_n, warps_k, tile_m, split, bk, stages, reduce, pdl):
            self.mt, self.wn, self.wk, self.nt = m_tiles, warps_n, warps_k, tile_m // 8
            self.tm, self.split, self.bk, self.stages = tile_m, split, bk, stages
            self.second = bool(reduce) and split > 1  # partials summed by a second kernel
            self.pdl = bool(pdl)
            self.rows = 16 * m_tiles * warps_n
            self.threads = 32 * warps_n * warps_k
            self.vr = bk // VEC  # 16-byte vectors per row of a stage
            self.kc = bk // KCHUNK  # 32-wide chunks per stage
            self.swz = 4 if self.vr >= 8 else 0  # rows of 128/256 bytes: vector j of row r sits at j ^ 4 (r & 1)
            self.w_copies = self.rows * self.vr // self.threads  # exact (valid() guarantees it)
            self.x_copies = (tile_m * self.vr + self.threads - 1) // self.threads

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
                     mCnt: cute.Tensor, stream: cuda.CUstream):
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + self.tm - 1) // self.tm, self.split)
            self.kernel(mX, mW, mY, mWs, mCnt).launch(grid=grid, block=(self.threads, 1, 1), stream=stream,
                                                      use_pdl=self.pdl)
            if cutlass.const_expr(self.second):
                self.launch_reduce(mWs, mY, stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor):
            MT, NT, WN, S = self.mt, self.nt, self.wn, self.split
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
            row0 = bidx * self.rows
            tok0 = bidy * self.tm
            ktiles = mW.shape[1] // (self.bk * S)  # stages of K in this CTA's slice
            kt0 = bidz * ktiles

            smem = cutlass.memory.SmemAllocator()
            sW, sX = self._ring(smem)
            acc = self._mainloop(mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n)
            nacc = 4 * MT * NT

            wrow0 = row0 + wrow * 16 * MT
            if cutlass.const_expr(S == 1):
                if wkk == 0:
                    self._store(acc, mY, wrow0, tok0, g, c, m, n)
            elif cutlass.const_expr(self.second):
                if wkk == 0:
                    self._store(acc, mWs[bidz, None, None], wrow0, tok0, g, c, m, n)
            else:
                if wkk == 0:
                    self._store(acc, mWs[bidz, None, None], wrow0, tok0, g, c, m, n)
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
                            self._accumulate(acc, mWs[z, None, None], wrow0, tok0, g, c, m, n)
                        self._store(acc, mY, wrow0, tok0, g, c, m, n)
                    if tidx == 0:
                        mCnt[bidx, bidy] = Int32(0)

        @cute.jit
        def _ring(self, smem):
            """The ring buffers [stage][row][vector position][8 elements]; every vector is addressed through a
            pointer aligned to 16 bytes and viewed as a flat 8-element tensor (a nested (1, 8) view makes the copy
            emit eight misaligned 16-byte copies)."""
            sW = smem.allocate_tensor(BFloat16, cute.make_layout(self.stages * self.rows * self.bk), 128)
            sX = smem.allocate_tensor(BFloat16, cute.make_layout(self.stages * self.tm * self.bk), 128)
            return sW, sX

        @cute.jit
        def _mainloop(self, mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n):
            """This CTA's K slice (``ktiles`` stages from stage ``kt0``) of its row and token tile, through the
            ring; the K warps summed in warp order (deterministic). Returns the accumulators, whole in K warp 0."""
            MT, NT, WN, WK, P = self.mt, self.nt, self.wn, self.wk, self.stages
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
            fa = cute.make_rmem_tensor(cute.make_layout((8, MT)), BFloat16)  # MMA operand order (PTX a0..a7)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)

            # prologue: the first P - 1 stages in flight. W first (it depends on no kernel: with PDL it loads while
            # the previous kernel finishes), then, once the previous grid is complete, x stage by stage: one commit
            # group per stage (the first also holds every prologue W tile; empty groups past the slice)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + s, s, tidx, row0, n)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x, y, the workspace and the counters: only from here on
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_x(mX, sX, g2s, kt0 + s, s, tidx, tok0, m)
                cute.arch.cp_async_commit_group()
            for kt in cutlass.range(ktiles):
                cute.arch.cp_async_wait_group(P - 2)  # this thread's copies of stage kt have landed
                cute.arch.sync_threads()  # everyone's have; and everyone is done with the slot refilled next
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

        @cute.jit
        def _vec(self, ptr):
            return cute.make_tensor(ptr.align(16), cute.make_layout(VEC))

        @cute.jit
        def _issue_w(self, mW, sW, g2s, kt, slot, tidx, row0, n):
            """cp.async of stage ``kt``'s W tile (K from kt*bk) into ring slot ``slot``: consecutive threads copy
            consecutive 16-byte vectors of a row (rows past N are clamped: nobody stores them)."""
            for i in cutlass.range_constexpr(self.w_copies):
                self._copy_vec(mW, sW, g2s, tidx + i * self.threads, kt * self.bk, slot, self.rows, row0, n)

        @cute.jit
        def _issue_x(self, mX, sX, g2s, kt, slot, tidx, tok0, m):
            """The same for the x tile; its vectors need not divide among the threads. Tokens past M are not
            loaded at all: their smem rows hold whatever they held, which reaches only accumulator columns that
            are never stored (each token is its own MMA column). Loading them clamped to token M - 1 made every
            CTA fetch the same few L2 lines several times a stage: with a 7168 x 1536 weight the same kernel took
            6.6 us at M = 8, 8.4 at M = 4 and 9.9 at M = 2 (H200, bench/alloc_spread.py, NOTES session 10)."""
            for i in cutlass.range_constexpr(self.x_copies):
                q = tidx + i * self.threads
                if cutlass.const_expr((i + 1) * self.threads <= self.tm * self.vr):
                    if tok0 + q // self.vr < m:
                        self._copy_vec(mX, sX, g2s, q, kt * self.bk, slot, self.tm, tok0, m)
                else:
                    if q < self.tm * self.vr and tok0 + q // self.vr < m:
                        self._copy_vec(mX, sX, g2s, q, kt * self.bk, slot, self.tm, tok0, m)

        @cute.jit
        def _copy_vec(self, mSrc, sDst, g2s, q, k0, slot, tile_rows: cutlass.Constexpr, row0, limit):
            """Vector ``q`` of a tile (row q // VR, vector q % VR) from global row ``row0 + r`` (clamped below
            ``limit``) at K ``k0`` to its swizzled place in ring slot ``slot``."""
            VR, BK = self.vr, self.bk
            r = q // VR
            j = q % VR
            src = mSrc.iterator + (cutlass.min(row0 + r, limit - 1) * mSrc.shape[1] + k0 + j * VEC)
            dst = sDst.iterator + ((slot * tile_rows + r) * BK + (j ^ ((r % 2) * self.swz)) * VEC)
            cute.copy(g2s, self._vec(src), self._vec(dst))

        @cute.jit
        def _compute(self, sW, sX, s2r, mma, slot, wrow, wkk, g, c, rw, rx, fa, fb, acc):
            MT, NT, WK = self.mt, self.nt, self.wk
            flip = (g % 2) * self.swz  # rows g and g + 8 (and token g) share the parity of g
            for cc in cutlass.range_constexpr(self.kc // WK):
                pos = ((wkk + cc * WK) * 4 + c) ^ flip  # this lane's vector of the 32-wide chunk
                for i in cutlass.range_constexpr(2 * MT):
                    r = wrow * 16 * MT + (i // 2) * 16 + (i % 2) * 8 + g
                    cute.copy(s2r, self._vec(sW.iterator + ((slot * self.rows + r) * self.bk + pos * VEC)), rw[None, i])
                for j in cutlass.range_constexpr(NT):
                    cute.copy(s2r, self._vec(sX.iterator + ((slot * self.tm + j * 8 + g) * self.bk + pos * VEC)),
                              rx[None, j])
                for s in cutlass.range_constexpr(2):  # two k16 steps: vector elements 4s..4s+3
                    for i in cutlass.range_constexpr(MT):
                        for h in cutlass.range_constexpr(2):  # a0a1/a4a5 (row g), a2a3/a6a7 (row g+8)
                            fa[4 * h, i] = rw[4 * s + 2 * h, 2 * i]
                            fa[4 * h + 1, i] = rw[4 * s + 2 * h + 1, 2 * i]
                            fa[4 * h + 2, i] = rw[4 * s + 2 * h, 2 * i + 1]
                            fa[4 * h + 3, i] = rw[4 * s + 2 * h + 1, 2 * i + 1]
                    for j in cutlass.range_constexpr(NT):
                        for v in cutlass.range_constexpr(4):
                            fb[v, j] = rx[4 * s + v, j]
                    cute.gemm(mma, acc, fa, fb, acc)

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
