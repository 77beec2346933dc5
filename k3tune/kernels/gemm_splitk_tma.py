"""gemm.splitk_cluster with its ring fed by TMA: one thread issues a stage's W and x tiles (staged; NOTES.md s30).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation, warp-level ``mma.sync.m16n8k16`` swap-AB as in
gemm_splitk_tc, split-K CTAs as one cluster summed in the leader's shared memory as in gemm_splitk_cluster. Why:
at M = 16 the cp.async ring of those kernels is issue-bound (s17-r3 counters: ~36% more instructions per weight
byte than at M = 8, the x tile's copies and their address arithmetic as many as W's), and the six 22 MB problems
stop at 0.76-0.83 of the HBM roofline. Here the copies leave the issue slots: one elected thread of warp 0 issues
a TMA of the stage's W tile (rows x bk) and of its x tile (tile_m x bk) into a ring of 128-byte-swizzled K-major
buffers with a full/empty mbarrier pair per stage (``PipelineTmaAsync``, as gemm_wgmma), so the main loop is only
the 16-byte shared-memory operand loads, the MMAs and the barrier waits. Rows past N and tokens past M are
zero-filled by TMA (nothing clamped, nothing fetched for them) and masked on store.

Operand reads: the 128-byte swizzle puts 16-byte vector ``v`` of row ``r`` (within a 64-wide K block) at
``v ^ (r % 8)``. Lane ``(g, c)`` (g = lane // 4, c = lane % 4) reads rows ``g`` and ``g + 8`` of W and token ``g``
of x; for the 32-wide K chunk ``ch`` it reads logical vector ``2c + ch % 2`` of block ``ch // 2`` (the same K
permutation for both operands, so the products are unchanged). Rows ``g`` and ``g + 1`` of a quarter-warp then hit
vectors of opposite parity: conflict-free. Each K warp takes a contiguous run of the stage's chunks; the K warps
and the split CTAs are summed in warp and rank order (deterministic).

The refill of a slot is issued at the top of the next stage (the slot of stage kt - 1, which every warp has
released by then), so ``stages - 1`` tiles stay in flight while one is computed. With ``pdl = 1`` the first
stages of W are requested before the kernel waits for the grid before it (W depends on no kernel), x after.
Constraints: bk 64 or 128 (whole swizzle atoms), K a multiple of bk x split_k, 16-byte aligned rows; sm_90a and
sm_100a (TMA and mma.sync on both). GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k splitk_tma``.
"""

import dataclasses
import functools

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_cluster import SPLITS, SplitKClusterGemm, recv_bytes
from k3tune.kernels.gemm_splitk_tc import KCHUNK, MAX_ACC, SMEM_BUDGET, SplitKConfig, _pow2_ceil
from k3tune.plan.problems import Problem


def smem_bytes(cfg: SplitKConfig) -> int:
    """Ring (1024-byte aligned), K-warp reduction buffer, the leader's receive buffer and the mbarriers."""
    rows = 16 * cfg.m_tiles * cfg.warps_n
    ring = cfg.stages * (rows + cfg.tile_m) * cfg.bk * 2
    red = 4 * cfg.m_tiles * (cfg.tile_m // 8) * 32 * cfg.warps_n * (cfg.warps_k - 1) * 4
    return ring + red + recv_bytes(cfg) + 16 * cfg.stages + 2 * 1024 + 64


class SplitKTmaGemm(SplitKClusterGemm):
    name = "gemm.splitk_tma"
    priority = 43
    feed = 0  # TMA
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster")

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and problem["K"] % 128 == 0  # a 2-split of 64-wide stages

    def space(self, problem: Problem) -> dict[str, tuple]:
        top = max(16, _pow2_ceil(problem["M"]))
        return {**super().space(problem), "tile_m": tuple(t for t in (16, 32) if t <= top), "bk": (64, 128)}

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        rows = 16 * cfg.m_tiles * cfg.warps_n
        return (cfg.split_k in SPLITS and cfg.reduce == 0 and cfg.bk in (64, 128) and cfg.tile_m in (16, 32)
                and k % (cfg.bk * cfg.split_k) == 0
                and (cfg.bk // KCHUNK) % cfg.warps_k == 0
                and 4 * cfg.m_tiles * cfg.tile_m // 8 <= MAX_ACC
                and smem_bytes(cfg) <= SMEM_BUDGET
                and rows <= max(16, _pow2_ceil(n)))

    def seeds(self, problem: Problem) -> list[SplitKConfig]:
        """splitk_cluster's seeds at 16-token tiles or more (x is the MMA's 16-row A here) and bk 64 or 128 (whole
        swizzle atoms), each also at one stage more (a TMA ring keeps every stage but the one computed in flight,
        the cp.async ring one fewer)."""
        out = []
        for cfg in SplitKClusterGemm().seeds(problem):  # under splitk_cluster's own validity
            cfg = dataclasses.replace(cfg, tile_m=max(16, cfg.tile_m), bk=max(64, cfg.bk))
            for c in (cfg, dataclasses.replace(cfg, stages=cfg.stages + 1)):
                if self.valid(c, problem):
                    out.append(c)
        return list(dict.fromkeys(out))

    def default(self, problem: Problem) -> SplitKConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else SplitKConfig(m_tiles=1, warps_n=1, warps_k=2, tile_m=16, split_k=2, bk=64,
                                                   stages=4, reduce=0, pdl=0)

    def build(self, problem: Problem, cfg: SplitKConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        fn = compiled(cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl,
                      current_arch(), self.feed)

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
             arch: str, feed: int = 0):
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
    kernel = _kernel_class()(m_tiles, warps_n, warps_k, tile_m, split, bk, stages, pdl, feed)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """splitk_cluster's kernel (its store, cluster sum and knobs) with a TMA ring; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.nvgpu import cpasync
    from cutlass.tensor_utils import LayoutEnum

    from cutlass._mlir.dialects import llvm, nvvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    VEC = 8

    @dsl_user_op
    def _ldsm_x4(addr, *, loc=None, ip=None):
        """ldmatrix.sync.aligned.m8n8.x4.shared.b16 at shared-memory byte address ``addr``: four 8x8 bf16
        matrices, lane l giving row l % 8 of matrix l // 8; returns this lane's four 32-bit fragments in matrix
        order."""
        ptr = cute.make_ptr(BFloat16, addr, cute.AddressSpace.smem, assumed_align=16, loc=loc, ip=ip)
        res = nvvm.ldmatrix(ptr.to_llvm_ptr(loc=loc, ip=ip), 4, nvvm.MMALayout.row,
                            results=[llvm.StructType.get_literal([T.i32()] * 4)], loc=loc, ip=ip)
        return [Int32(llvm.extractvalue(T.i32(), res, [e], loc=loc, ip=ip)) for e in range(4)]

    class SplitKTmaKernel(gemm_splitk_cluster._kernel_class()):
        def __init__(self, m_tiles, warps_n, warps_k, tile_m, split, bk, stages, pdl, feed):
            super().__init__(m_tiles, warps_n, warps_k, tile_m, split, bk, stages, 0, pdl)
            self.feed = feed  # 0: TMA by one thread, 1: cp.async by every thread

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
            tile = (self.rows, self.tm, self.bk)
            a_staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, BFloat16, self.stages)
            b_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, BFloat16, self.stages)
            tma_w, tW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                    cute.slice_(a_staged, (None, None, 0)), (self.rows, self.bk))
            tma_x, tX = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                                    cute.slice_(b_staged, (None, None, 0)), (self.tm, self.bk))
            nacc = 4 * self.mt * self.nt

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[Int64, self.stages * 2]
                recv_bar: cute.struct.MemRange[Int64, 1]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_staged)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_staged)], 1024]
                red: cute.struct.Align[cute.struct.MemRange[Float32, max(4, nacc * 32 * self.wn * (self.wk - 1))],
                                       16]
                recv: cute.struct.Align[cute.struct.MemRange[Float32, max(4, (self.split - 1) * 32 * self.wn * nacc)],
                                        16]

            self.storage = Storage
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + self.tm - 1) // self.tm, self.split)
            self.kernel(tma_w, tW, tma_x, tX, mW, mX, mY, a_staged, b_staged).launch(
                grid=grid, block=(self.threads, 1, 1), cluster=[1, 1, self.split], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                   mWr: cute.Tensor, mXr: cute.Tensor, mY: cute.Tensor, a_staged: cute.ComposedLayout,
                   b_staged: cute.ComposedLayout):
            MT, NT, WN, WK, S, P = self.mt, self.nt, self.wn, self.wk, self.split, self.stages
            ROWS, TM, BK = self.rows, self.tm, self.bk
            CPW = self.kc // WK  # 32-wide K chunks per K warp per stage
            NT16 = TM // 16  # 16-token MMA tiles (the MMA's M)
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, bidz = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            m = mY.shape[0]
            n = mY.shape[1]
            lane = tidx % 32
            g = lane // 4
            c = lane % 4
            wrow = warp % WN
            wkk = warp // WN
            row0 = bidx * ROWS
            tok0 = bidy * TM
            nacc = 4 * MT * NT

            if cutlass.const_expr(self.pdl and self.feed == 0):
                cute.arch.griddepcontrol_launch_dependents()
            if cutlass.const_expr(self.feed == 0):
                if warp == 0:
                    cpasync.prefetch_descriptor(tma_w)
                    cpasync.prefetch_descriptor(tma_x)

            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(self.storage)
            bar = st.recv_bar.data_ptr()
            # rank 0's mbarrier expects every peer's bytes before anyone can push (the cluster barrier below)
            if rank == 0 and tidx == 0:
                cute.arch.mbarrier_init(bar, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar, (S - 1) * 32 * WN * nacc * 4)
            cute.arch.cluster_arrive_relaxed()

            stage_bytes = (cute.size_in_bytes(BFloat16, cute.slice_(a_staged, (None, None, 0)))
                           + cute.size_in_bytes(BFloat16, cute.slice_(b_staged, (None, None, 0))))
            pipe = None
            if cutlass.const_expr(self.feed == 0):
                pipe = pipeline.PipelineTmaAsync.create(
                    barrier_storage=st.bars.data_ptr(), num_stages=P,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
                    tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            sWt = st.sW.get_tensor(a_staged.outer, swizzle=a_staged.inner)
            sXt = st.sX.get_tensor(b_staged.outer, swizzle=b_staged.inner)
            tile = (ROWS, TM, BK)
            gW = cute.local_tile(mW, tile, (bidx, bidy, None), proj=(1, None, 1))
            gX = cute.local_tile(mX, tile, (bidx, bidy, None), proj=(None, 1, 1))
            tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sWt, 0, 2),
                                             cute.group_modes(gW, 0, 2))
            tXs, tXg = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sXt, 0, 2),
                                             cute.group_modes(gX, 0, 2))
            ktiles = cute.size(gW, mode=[2]) // S
            kt0 = bidz * ktiles

            # ldmatrix row addresses of this lane (element offsets in stage 0). The 128-byte swizzle puts 16-byte
            # vector v of row r (within a 64-wide K block) at v ^ (r % 8); every row a lane addresses has r % 8 ==
            # lane % 8. x is the MMA's A (16 tokens x k16: matrices tokens 0-7 / 8-15 x K 0-7 / 8-15), W its B (16
            # rows x k16: two n8 tiles, K 0-7 / 8-15 each).
            l8 = lane % 8
            xrow = l8 + 8 * ((lane // 8) % 2)
            xkh = lane // 16
            wrow_l = wrow * 16 * MT + l8 + 8 * (lane // 16)
            wkh = (lane // 8) % 2
            # absolute shared-memory byte addresses of this lane's rows in stage 0
            xaddr = []
            waddr = []
            xb = st.sX.data_ptr().toint()
            wb = st.sW.data_ptr().toint()
            for cc in cutlass.range_constexpr(CPW):
                for s in cutlass.range_constexpr(2):
                    ks = (wkk * CPW + cc) * 2 + s  # this warp's k16 step within the stage
                    xaddr.append(xb + ((ks // 4) * TM * 128 + xrow * 128 + ((((ks % 4) * 2 + xkh) ^ l8) * 16)))
                    waddr.append(wb + ((ks // 4) * ROWS * 128 + wrow_l * 128 + ((((ks % 4) * 2 + wkh) ^ l8) * 16)))
            mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
            acc = cute.make_rmem_tensor(cute.make_layout((4, NT16, 2 * MT)), Float32)
            acc.fill(0.0)
            fa = cute.make_rmem_tensor(cute.make_layout((8, NT16)), BFloat16)  # x: PTX a0..a7 per token tile
            fb = cute.make_rmem_tensor(cute.make_layout((4, 2 * MT)), BFloat16)  # W: b0..b3 per n8 tile
            fa32 = cute.recast_tensor(fa, Int32)
            fb32 = cute.recast_tensor(fb, Int32)

            if cutlass.const_expr(self.feed == 0):  # one thread issues TMA copies (full/empty mbarriers)
                # prologue: W of the first stages (no dependence on the grid before), then x once that grid is done
                pre = cutlass.min(P, ktiles)
                if warp == 0:
                    for j in cutlass.range(pre, unroll=1):
                        ps = self._state(j, 1)
                        pipe.producer_acquire(ps)
                        cute.copy(tma_w, tWg[(None, kt0 + j)], tWs[(None, ps.index)], tma_bar_ptr=pipe.producer_get_barrier(ps))
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()  # x and y only from here on
                if warp == 0:
                    for j in cutlass.range(pre, unroll=1):
                        ps = self._state(j, 1)
                        cute.copy(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)], tma_bar_ptr=pipe.producer_get_barrier(ps))


                for kt in cutlass.range(ktiles, unroll=1):
                    if warp == 0 and kt > 0:
                        j = kt - 1 + P  # refill the slot of stage kt - 1: every warp released it a stage ago
                        if j < ktiles:
                            ps = self._state(j, 1)
                            pipe.producer_acquire(ps)
                            cute.copy(tma_w, tWg[(None, kt0 + j)], tWs[(None, ps.index)],
                                      tma_bar_ptr=pipe.producer_get_barrier(ps))
                            cute.copy(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)],
                                      tma_bar_ptr=pipe.producer_get_barrier(ps))
                    cs = self._state(kt, 0)
                    pipe.consumer_wait(cs)
                    wslot = cs.index * (ROWS * BK * 2)
                    xslot = cs.index * (TM * BK * 2)
                    self._ldsm_stage(mma, xaddr, waddr, xslot, wslot, fa, fb, fa32, fb32, acc)
                    pipe.consumer_release(cs)

            else:  # every thread issues cp.async copies into the same swizzled layout (commit groups)
                g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                          num_bits_per_copy=128)
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_launch_dependents()
                for s0 in cutlass.range_constexpr(P - 1):
                    if s0 < ktiles:
                        self._issue_swz(mWr, st.sW.data_ptr(), g2s, tidx, kt0 + s0, s0, ROWS, row0, n, False)
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()  # x and y only from here on
                for s0 in cutlass.range_constexpr(P - 1):
                    if s0 < ktiles:
                        self._issue_swz(mXr, st.sX.data_ptr(), g2s, tidx, kt0 + s0, s0, TM, tok0, m, True)
                    cute.arch.cp_async_commit_group()
                for kt in cutlass.range(ktiles, unroll=1):
                    cute.arch.cp_async_wait_group(P - 2)  # this thread's copies of stage kt have landed
                    cute.arch.sync_threads()  # everyone's have; and everyone is done with the slot refilled next
                    nk = kt + P - 1
                    if nk < ktiles:
                        self._issue_swz(mWr, st.sW.data_ptr(), g2s, tidx, kt0 + nk, nk % P, ROWS, row0, n, False)
                        self._issue_swz(mXr, st.sX.data_ptr(), g2s, tidx, kt0 + nk, nk % P, TM, tok0, m, True)
                    cute.arch.cp_async_commit_group()
                    slot = kt % P
                    self._ldsm_stage(mma, xaddr, waddr, slot * (TM * BK * 2), slot * (ROWS * BK * 2), fa, fb, fa32,
                                     fb32, acc)
                cute.arch.cp_async_wait_group(0)

            if cutlass.const_expr(WK > 1):  # reduce the K warps in warp order (deterministic)
                red = cute.make_tensor(st.red.data_ptr(), cute.make_layout((nacc, 32, WN, WK - 1)))
                if wkk > 0:
                    for e in cutlass.range_constexpr(nacc):
                        red[e, lane, wrow, wkk - 1] = acc[e]
                cute.arch.sync_threads()
                if wkk == 0:
                    for q in cutlass.range_constexpr(WK - 1):
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = acc[e] + red[e, lane, wrow, q]

            recv = cute.make_tensor(st.recv.data_ptr(), cute.make_layout((S - 1) * 32 * WN * nacc))
            self._cluster_sum(acc, recv, bar, rank, wrow, wkk, lane, g, c, row0, tok0, m, n, mY)

        @cute.jit
        def _ldsm_stage(self, mma, xaddr, waddr, xslot, wslot, fa, fb, fa32, fb32, acc):
            """One ring stage of this warp: its k16 steps, x (A) and W (B) by ldmatrix, the MMAs."""
            for q in cutlass.range_constexpr(len(xaddr)):
                for jt in cutlass.range_constexpr(self.tm // 16):
                    r = _ldsm_x4(xaddr[q] + (xslot + jt * 16 * 128))
                    for e in cutlass.range_constexpr(4):
                        fa32[e, jt] = r[e]
                for i in cutlass.range_constexpr(self.mt):
                    r = _ldsm_x4(waddr[q] + (wslot + i * 16 * 128))
                    fb32[0, 2 * i] = r[0]
                    fb32[1, 2 * i] = r[1]
                    fb32[0, 2 * i + 1] = r[2]
                    fb32[1, 2 * i + 1] = r[3]
                cute.gemm(mma, acc, fa, fb, acc)

        @cute.jit
        def _issue_swz(self, mSrc, sDst, g2s, tidx, kt, slot, tile_rows: cutlass.Constexpr, row0, limit,
                       tokens: cutlass.Constexpr):
            """cp.async of stage ``kt``'s tile (rows x bk) into ring slot ``slot`` in the TMA's 128-byte-swizzled
            K-major layout: 64-wide K blocks of ``tile_rows`` 128-byte rows, vector v of row r at v ^ (r % 8). W
            rows past N are clamped (never stored); x tokens past M are not loaded (their MMA rows are never
            stored)."""
            VR = self.bk // VEC
            total = tile_rows * VR
            for i in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
                q = tidx + i * self.threads
                r = q // VR
                j = q % VR
                dst = sDst + (slot * tile_rows * self.bk + (j // 8) * tile_rows * 64 + r * 64 + ((j % 8) ^ (r % 8)) * VEC)
                if q < total:
                    if cutlass.const_expr(tokens):
                        if row0 + r < limit:
                            src = mSrc.iterator + ((row0 + r) * mSrc.shape[1] + kt * self.bk + j * VEC)
                            cute.copy(g2s, self._vec(src), self._vec(dst))
                    else:
                        src = mSrc.iterator + (cutlass.min(row0 + r, limit - 1) * mSrc.shape[1] + kt * self.bk + j * VEC)
                        cute.copy(g2s, self._vec(src), self._vec(dst))

        @cute.jit
        def _cluster_sum(self, acc, recv, bar, rank, wrow, wkk, lane, g, c, row0, tok0, m, n, mY):
            """Peers push their K-warp-0 accumulators into rank 0's receive buffer; rank 0 adds them in rank order
            and stores bf16 (gemm_splitk_cluster's end)."""
            WN, S, MT = self.wn, self.split, self.mt
            nacc = 4 * MT * self.nt
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
                                                bar, 0)
            if rank == 0:
                cute.arch.mbarrier_wait(bar, 0)
                if wkk == 0:
                    for z in cutlass.range_constexpr(S - 1):  # rank order: deterministic
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = acc[e] + recv[z * 32 * WN * nacc + slot + e]
                    self._store(acc, mY, row0 + wrow * 16 * MT, tok0, g, c, m, n)

        @cute.jit
        def _store(self, acc: cute.Tensor, out: cute.Tensor, row0, tok0, g, c, m, n):
            # accumulator element e of (token tile jt, n8 tile q) = token 16 jt + g + 8 (e // 2), row 8 q + 2c + e % 2
            for jt in cutlass.range_constexpr(self.tm // 16):
                for q in cutlass.range_constexpr(2 * self.mt):
                    for e in cutlass.range_constexpr(4):
                        t = tok0 + jt * 16 + g + 8 * (e // 2)
                        r = row0 + q * 8 + 2 * c + (e % 2)
                        if r < n and t < m:
                            out[t, r] = acc[e, jt, q].to(out.element_type)

        @cute.jit
        def _state(self, j, producer: cutlass.Constexpr):
            """Pipeline state of stage ``j``: slot j % P, phase from j // P (gemm_wgmma's rule)."""
            P = self.stages
            return pipeline.PipelineState(P, j, j % P, ((j // P) % 2) ^ producer)

    return SplitKTmaKernel


class SplitKLdsmGemm(SplitKTmaGemm):
    """The same kernel with the ring fed by cp.async from every thread (splitk_cluster's copies) into the same
    swizzled layout: only the operand reads (ldmatrix, x as the 16-token A) differ from splitk_cluster."""
    name = "gemm.splitk_ldsm"
    priority = 43
    feed = 1
