"""gemm.wgmma with split-K summed inside the one launch by the last CTA of each tile (staged, session 16: GPU
numerics and a probe first; NOTES.md).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation, M <= 64: gemm_wgmma's swap-AB warpgroup MMA and
TMA ring. Why a third split-K end for that main loop: at M = 8-16 on the 1536 x 7168 projections (24 row tiles of
64) gemm_wgmma_ck's best keeps 96 of the 132 SMs busy (split 4, 7.08 us at M = 16 against a 5.3 us floor), because
a cluster of 5 or 6 CTAs with a deep ring does not fit the GPCs all at once: ncu reports 22 active clusters of 5
for 24 tiles, and the second wave makes split 5 1.4x slower than split 4 (s16-r1, r5). A tile whose CTAs need not
be co-resident takes any split: 5 (120 CTAs), or 11 with two CTAs per SM. gemm_wgmma's own split needs a second
kernel (one more launch, ~1-2 us at these sizes).

Here the ``split_k`` CTAs of a tile (2-16, K slices uneven by at most one K step, as gemm_wgmma_ck's) each write
their fp32 partial to the workspace ``ws[z]``; each then fences and takes a ticket from the tile's arrival counter,
and the CTA that arrives last sums the slices in slice order (deterministic, whatever the arrival order), writes
bf16 and resets the counter to 0 for the next launch (a CUDA graph replays it). The partials are 2 x split x M x N
x 4 bytes of L2 traffic (4.5% of the weight bytes at M = 16, split 5), which is why M stops at 64. With
``pdl = 1`` the first W stages are requested before the wait for the grid before; x, y, the workspace and the
counters are touched only after it.

Hopper only (wgmma). Constraints: K a multiple of bk, at least two K steps per slice, 16-byte aligned rows.
GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k wgmma_sk``.
"""

import dataclasses
import functools
import math

from k3tune.errors import CannotImplement
from k3tune.kernels import gemm_wgmma
from k3tune.kernels.base import Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_wgmma import SMEM_BUDGET, WgmmaConfig, WgmmaGemm, _pow2_ceil, smem_bytes
from k3tune.plan.problems import Problem

MAX_M = 64  # beyond, the partials' traffic grows with M x split (gemm_wgmma_ck sums them over DSMEM instead)
SPLITS = (2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 14, 16)
SMS = 132  # H200 SMs: the seeds' one-wave rule (the search measures the others)
SMEM_PER_SM = 227 * 1024


class WgmmaSplitKGemm(WgmmaGemm):
    name = "gemm.wgmma_sk"
    workspace_splits = max(SPLITS)
    counters = True  # one arrival counter per (row tile, token tile): counters[tile_n, tile_m]
    priority = 46
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_wgmma")  # its ring and tiling are wgmma's

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and problem["M"] <= MAX_M

    def space(self, problem: Problem) -> dict[str, tuple]:
        return {**super().space(problem), "split_k": SPLITS}

    def valid(self, cfg: WgmmaConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        return (cfg.split_k in SPLITS
                and k % cfg.bk == 0 and k // cfg.bk >= 2 * cfg.split_k  # every slice at least two K steps
                and smem_bytes(cfg) + 16 <= SMEM_BUDGET
                and 64 * cfg.warpgroups <= max(64, _pow2_ceil(n)))

    def seeds(self, problem: Problem) -> list[WgmmaConfig]:
        """gemm_wgmma's seed layouts (token tile, K step, ring) at the split that fills the SMs most evenly in one
        wave (``one_wave_split``) and at 4 and 8."""
        out = []
        for cfg in WgmmaGemm().seeds(problem):
            for split in (one_wave_split(problem, cfg), 4, 8):
                c = dataclasses.replace(cfg, split_k=split)
                if self.valid(c, problem):
                    out.append(c)
        return list(dict.fromkeys(out))

    def default(self, problem: Problem) -> WgmmaConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else WgmmaConfig(tile_m=8, split_k=2)

    def work(self, problem: Problem, cfg: WgmmaConfig) -> Work:
        two = super().work(problem, cfg)
        return dataclasses.replace(two, launches=1, extra_us=0.5)  # the fence, the ticket and the last CTA's sum

    def build(self, problem: Problem, cfg: WgmmaConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        arch = current_arch()
        if not arch.startswith("sm_90"):
            raise CannotImplement(f"{self.name} needs Hopper wgmma (sm_90a), not {arch}")
        fn = compiled(cfg.warpgroups, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl, arch)

        def run(inputs: dict):
            x = (from_dlpack(inputs["x"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            w = (from_dlpack(inputs["w"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            y = from_dlpack(inputs["out"], assumed_align=16).mark_layout_dynamic()
            ws = from_dlpack(inputs["ws"], assumed_align=16).mark_layout_dynamic()
            cnt = from_dlpack(inputs["counters"], assumed_align=4).mark_layout_dynamic()
            fn(x, w, y, ws, cnt, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        return run


def one_wave_split(problem: Problem, cfg: WgmmaConfig) -> int:
    """The split whose CTAs fill the most SMs in one wave (CTAs per SM from the ring's shared memory), the K slices
    as even as may be; the smaller split on a tie."""
    tiles = math.ceil(problem["N"] / (64 * cfg.warpgroups)) * math.ceil(problem["M"] / cfg.tile_m)
    steps = problem["K"] // cfg.bk
    slots = SMS * max(1, min(2048 // (128 * cfg.warpgroups), SMEM_PER_SM // (smem_bytes(cfg) + 16)))

    def fill(s: int) -> float:
        ctas = tiles * s
        return (ctas / slots) / math.ceil(ctas / slots) * (steps / s) / math.ceil(steps / s)

    fits = [s for s in SPLITS if steps >= 2 * s] or [SPLITS[0]]
    return max(fits, key=lambda s: (round(fill(s), 2), -s))


@functools.cache
def compiled(warpgroups: int, tile_m: int, split: int, bk: int, stages: int, pdl: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if not arch.startswith("sm_90"):
        raise CannotImplement(f"gemm.wgmma_sk needs Hopper wgmma (sm_90a), not {arch}")
    if split not in SPLITS:
        raise CannotImplement(f"gemm.wgmma_sk: split {split} is not one of {SPLITS}")
    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    ws = make_fake_compact_tensor(Float32, (cute.sym_int(), m, n), stride_order=(2, 1, 0), assumed_align=16)
    cnt = make_fake_compact_tensor(Int32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=4)
    kernel = _kernel_class()(warpgroups, tile_m, split, bk, stages, pdl)
    return cute.compile(kernel, x, w, y, ws, cnt, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """gemm_wgmma's kernel with uneven K slices and the last-arriving CTA's sum; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    class WgmmaSkKernel(gemm_wgmma._kernel_class()):
        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor,
                     stream: cuda.CUstream):
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
                (self.wg, 1, 1), tiler_mn=(64, self.tm))
            a_staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile, BFloat16, self.stages)
            b_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile, BFloat16, self.stages)
            tma_w, tW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                    cute.slice_(a_staged, (None, None, 0)), (self.rows, self.bk))
            tma_x, tX = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                                    cute.slice_(b_staged, (None, None, 0)), (self.tm, self.bk))

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                ticket: cute.struct.MemRange[Int32, 4]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_staged)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_staged)], 1024]
                sOut: cute.struct.Align[cute.struct.MemRange[Float32, self.tm * self.ld], 16]

            self.storage = Storage
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + self.tm - 1) // self.tm, self.split)
            self.kernel(tma_w, tW, tma_x, tX, mY, mWs, mCnt, tiled_mma, a_staged, b_staged).launch(
                grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                   mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor, tiled_mma: cute.TiledMma,
                   a_staged: cute.ComposedLayout, b_staged: cute.ComposedLayout):
            P, ROWS, TM, S = self.stages, self.rows, self.tm, self.split
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, bidz = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            m = mY.shape[0]
            n = mY.shape[1]
            row0 = bidx * ROWS
            tok0 = bidy * TM

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            if warp == 0:
                cpasync.prefetch_descriptor(tma_w)
                cpasync.prefetch_descriptor(tma_x)

            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(self.storage)
            stage_bytes = (cute.size_in_bytes(BFloat16, cute.slice_(a_staged, (None, None, 0)))
                           + cute.size_in_bytes(BFloat16, cute.slice_(b_staged, (None, None, 0))))
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.bars.data_ptr(), num_stages=P,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
                tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            sW = st.sW.get_tensor(a_staged.outer, swizzle=a_staged.inner)
            sX = st.sX.get_tensor(b_staged.outer, swizzle=b_staged.inner)
            sOut = cute.make_tensor(st.sOut.data_ptr(), cute.make_layout((TM, ROWS), stride=(self.ld, 1)))
            ticket = cute.make_tensor(st.ticket.data_ptr(), cute.make_layout(4))

            gW = cute.local_tile(mW, self.tile, (bidx, bidy, None), proj=(1, None, 1))
            gX = cute.local_tile(mX, self.tile, (bidx, bidy, None), proj=(None, 1, 1))
            tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                             cute.group_modes(gW, 0, 2))
            tXs, tXg = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                             cute.group_modes(gX, 0, 2))
            steps = cute.size(gW, mode=[2])
            kt0 = bidz * steps // S  # slices uneven by at most one K step
            ktiles = (bidz + 1) * steps // S - kt0

            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(wg_idx * 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
            cC = cute.make_identity_tensor((ROWS, TM))
            tCcC = tiled_mma.get_slice(tidx).partition_C(cC)
            acc = cute.make_rmem_tensor(tCcC.shape, Float32)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            kblocks = cute.size(tCrA, mode=[2])

            pre = cutlass.min(P, ktiles)
            if warp == 0:
                for j in cutlass.range(pre, unroll=1):
                    ps = self._state(j, 1)
                    pipe.producer_acquire(ps)
                    cute.copy(tma_w, tWg[(None, kt0 + j)], tWs[(None, ps.index)], tma_bar_ptr=pipe.producer_get_barrier(ps))
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x, y, the workspace and the counters only from here on
            if warp == 0:
                for j in cutlass.range(pre, unroll=1):
                    ps = self._state(j, 1)
                    cute.copy(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)], tma_bar_ptr=pipe.producer_get_barrier(ps))

            for kt in cutlass.range(ktiles, unroll=1):
                cs = self._state(kt, 0)
                pipe.consumer_wait(cs)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(kblocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, cs.index)], tCrB[(None, None, kb, cs.index)], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if kt > 0:
                    pipe.consumer_release(self._state(kt - 1, 0))
                    j = kt - 1 + P
                    if warp == 0 and j < ktiles:
                        ps = self._state(j, 1)
                        pipe.producer_acquire(ps)
                        cute.copy(tma_w, tWg[(None, kt0 + j)], tWs[(None, ps.index)],
                                  tma_bar_ptr=pipe.producer_get_barrier(ps))
                        cute.copy(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)],
                                  tma_bar_ptr=pipe.producer_get_barrier(ps))
            warpgroup.wait_group(0)

            # this slice's partial: accumulators -> sOut[token][row] -> row-contiguous stores of ws[z]
            for i in cutlass.range_constexpr(cute.size(acc)):
                rt = tCcC[i]
                sOut[rt[1], rt[0]] = acc[i]
            cute.arch.sync_threads()
            per = (TM * ROWS + self.threads - 1) // self.threads
            for j in cutlass.range_constexpr(per):
                q = tidx + j * self.threads
                t = q // ROWS
                r = q % ROWS
                if q < TM * ROWS and tok0 + t < m and row0 + r < n:
                    mWs[bidz, tok0 + t, row0 + r] = sOut[t, r]
            cute.arch.fence_acq_rel_gpu()  # this CTA's partial is visible before its ticket
            cute.arch.sync_threads()
            if tidx == 0:
                ticket[0] = cute.arch.atomic_add((mCnt.iterator + (bidx * mCnt.shape[1] + bidy)), Int32(1),
                                                 sem="acq_rel", scope="gpu")
            cute.arch.sync_threads()
            if ticket[0] == S - 1:  # the tile's last CTA: every slice is in; sum them in slice order, write bf16
                cute.arch.fence_acq_rel_gpu()
                for j in cutlass.range_constexpr(per):
                    q = tidx + j * self.threads
                    t = q // ROWS
                    r = q % ROWS
                    if q < TM * ROWS and tok0 + t < m and row0 + r < n:
                        total = Float32(0.0)
                        for z in cutlass.range_constexpr(S):
                            total = total + mWs[z, tok0 + t, row0 + r]
                        mY[tok0 + t, row0 + r] = total.to(BFloat16)
                if tidx == 0:
                    mCnt[bidx, bidy] = Int32(0)  # ready for the next launch

    return WgmmaSkKernel
