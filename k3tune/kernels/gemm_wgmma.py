"""Hopper ``wgmma`` decode GEMM in CuTe DSL, swap-AB: y^T = W x^T, so weight rows fill the wgmma's M of 64.

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation. Why a second tensor-core family: the
``mma.sync`` kernel (gemm_splitk_tc.py) is bound by instruction issue at M >= 32 (~11 instructions per MMA on the
H200: fragment loads with swizzled addresses, masked cp.async, NOTES.md session 11), while a warpgroup MMA reads
both operands from shared memory: one instruction per 64 x tile_m x 16 and no fragment loads.

Per CTA: ``warpgroups`` x 64 weight rows and ``tile_m`` tokens (the wgmma N: 8-64). One thread of warp 0 issues
TMA copies of the W tile (rows x bk) and of the x tile (tokens x bk) into a ring of ``stages`` 128-byte-swizzled
K-major buffers with one mbarrier pair per stage (full: the bytes landed; empty: every warp's wgmmas on it
retired); rows past N and tokens past M are zero-filled by TMA and masked on store. A stage's wgmmas keep running
while the next stage's issue (``wait_group 1``), and its buffer is refilled one stage later. The accumulators go
through shared memory so that the output (or the split-K partial) is written row-contiguous.

``split_k`` CTAs share a tile: each writes its fp32 partial ``ws[z]`` and a second kernel sums the slices in slice
order (deterministic). With ``pdl = 1`` the launch allows programmatic dependent launch: the first stages of W
(which depend on no kernel) are requested before the kernel waits for the grid before it, and x, the output and
the workspace are touched only after that wait.

Hopper only: ``build`` declares CannotImplement on another arch (Blackwell has no wgmma: it needs tcgen05).
M is dynamic: one compile per knob set and arch serves every M and every shape. Constraints: K a multiple of
bk x split_k, 16-byte aligned rows. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k wgmma``.
"""

import functools
import math
from dataclasses import dataclass

from k3tune.errors import CannotImplement
from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.plan.problems import Problem

MAX_M = 512
MAX_SPLIT = 8
SMEM_BUDGET = 200 * 1024  # ring + staging per CTA (H200: 227 KB per SM): one CTA per SM may keep ~180 KB in flight
PAD = 4  # fp32 words of padding per staged token row: conflict-free accumulator writes


@dataclass(frozen=True)
class WgmmaConfig(KernelConfig):
    warpgroups: int = 1  # 64-row wgmma tiles of W per CTA, one warpgroup each
    tile_m: int = 8  # tokens per CTA: the wgmma N
    split_k: int = 1  # CTAs over K, summed by a second kernel
    bk: int = 64  # K per stage (64: one 128-byte swizzle atom per row)
    stages: int = 4  # buffers in the ring
    pdl: int = 0  # 1: programmatic dependent launch


def smem_bytes(cfg: WgmmaConfig) -> int:
    rows = 64 * cfg.warpgroups
    ring = cfg.stages * (rows + cfg.tile_m) * cfg.bk * 2
    staging = cfg.tile_m * (rows + PAD) * 4
    return ring + staging + 16 * cfg.stages + 2048  # mbarriers, 1024-byte alignment of the two ring buffers


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class WgmmaGemm(gemm_common.DenseGemm):
    name = "gemm.wgmma"
    workspace_splits = MAX_SPLIT
    config_cls = WgmmaConfig
    backends = frozenset({"gpu", "simulated"})
    priority = 45
    archs = ("sm_90",)  # Hopper only: Blackwell has no wgmma (a simulated GB300 sweep had picked it)
    depends_on = ("k3tune.kernels.gemm_common",)  # inputs, the fp32 reference and the split-K reduce kernel
    off = {"pdl": 0}

    def can_implement(self, problem: Problem) -> bool:
        return super().can_implement(problem) and problem["M"] <= MAX_M and problem["K"] % 64 == 0

    def space(self, problem: Problem) -> dict[str, tuple]:
        m = problem["M"]
        return {
            "warpgroups": (1, 2),
            "tile_m": tuple(t for t in (8, 16, 32, 64) if t <= max(8, _pow2_ceil(m))),
            "split_k": (1, 2, 4, 8),
            "bk": (64, 128),
            "stages": (2, 4, 6, 8),
            "pdl": (0, 1),
        }

    def valid(self, cfg: WgmmaConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        return (k % (cfg.bk * cfg.split_k) == 0
                and smem_bytes(cfg) <= SMEM_BUDGET
                and 64 * cfg.warpgroups <= max(64, _pow2_ceil(n)))

    def default(self, problem: Problem) -> WgmmaConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else WgmmaConfig()

    def seeds(self, problem: Problem) -> list[WgmmaConfig]:
        """One 64-row warpgroup per CTA with the smallest split giving >= 1 CTA per SM, the unsplit deep ring
        (split-K writes and re-reads split x M x N fp32) and, from M = 16, split 4 and 8 with 128-wide K steps on a
        4-stage ring; all with PDL."""
        m, n = problem["M"], problem["N"]
        tile_m = min(64, max(8, _pow2_ceil(m)))
        row_ctas = math.ceil(n / 64) * math.ceil(m / tile_m)
        out = []
        for split in (1, 2, 4, 8):
            cfg = WgmmaConfig(warpgroups=1, tile_m=tile_m, split_k=split, bk=64, stages=6, pdl=1)
            if self.valid(cfg, problem) and (row_ctas * split >= 132 or split == MAX_SPLIT):
                out.append(cfg)
                break
        deep = WgmmaConfig(warpgroups=1, tile_m=tile_m, split_k=1, bk=128, stages=8, pdl=1)
        while not self.valid(deep, problem) and deep.stages > 2:
            deep = WgmmaConfig(1, tile_m, 1, 128, deep.stages - 2, 1)
        if self.valid(deep, problem):
            out.append(deep)
        if m >= 16:  # the s12-r5 probe's corner: q_a M = 64 10.7 us there against the sweep's best 14.5
            for split in (4, 8):
                wide = WgmmaConfig(warpgroups=1, tile_m=tile_m, split_k=split, bk=128, stages=4, pdl=1)
                if self.valid(wide, problem):
                    out.append(wide)
        return list(dict.fromkeys(out))

    def work(self, problem: Problem, cfg: WgmmaConfig) -> Work:
        m, n = problem["M"], problem["N"]
        rows = 64 * cfg.warpgroups
        m_passes = math.ceil(m / cfg.tile_m)
        ctas = math.ceil(n / rows) * m_passes * cfg.split_k
        partial = 2 * cfg.split_k * m * n * 4 if cfg.split_k > 1 else 0
        return Work(
            hbm_bytes=gemm_common.gemm_bytes(problem) * (1 + 0.25 * (m_passes - 1)) + partial,
            flops=2.0 * cfg.tile_m * m_passes * n * problem["K"],
            ctas=ctas,
            inflight_bytes_per_cta=(cfg.stages - 1) * rows * cfg.bk * 2,
            tensor_cores=True,
            ctas_per_sm=max(1, min(8, 2048 // (128 * cfg.warpgroups), 227 * 1024 // smem_bytes(cfg))),
            launches=2 if cfg.split_k > 1 else 1,
            extra_us=0.2,  # mbarrier set-up and the staged epilogue
        )

    # ---- the measurer's interface --------------------------------------------------------------

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
            fn(x, w, y, ws, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        return run


@functools.cache
def compiled(warpgroups: int, tile_m: int, split: int, bk: int, stages: int, pdl: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if not arch.startswith("sm_90"):
        raise CannotImplement(f"gemm.wgmma needs Hopper wgmma (sm_90a), not {arch}")
    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    ws = make_fake_compact_tensor(Float32, (cute.sym_int(), m, n), stride_order=(2, 1, 0), assumed_align=16)
    kernel = _kernel_class()(warpgroups, tile_m, split, bk, stages, pdl)
    return cute.compile(kernel, x, w, y, ws, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """The CuTe DSL kernel, defined on first use so that importing k3tune never imports the DSL."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    class WgmmaKernel(gemm_common.splitk_reduce()):
        def __init__(self, warpgroups, tile_m, split, bk, stages, pdl):
            self.wg, self.tm, self.split, self.bk, self.stages = warpgroups, tile_m, split, bk, stages
            self.pdl = bool(pdl)
            self.rows = 64 * warpgroups
            self.threads = 128 * warpgroups
            self.tile = (self.rows, tile_m, bk)
            self.ld = self.rows + PAD  # staged accumulators: [token][row], padded

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
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
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_staged)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_staged)], 1024]
                sOut: cute.struct.Align[cute.struct.MemRange[Float32, self.tm * self.ld], 16]

            self.storage = Storage
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + self.tm - 1) // self.tm, self.split)
            self.kernel(tma_w, tW, tma_x, tX, mY, mWs, tiled_mma, a_staged, b_staged).launch(
                grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)
            if cutlass.const_expr(self.split > 1):
                self.launch_reduce(mWs, mY, stream)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                   mY: cute.Tensor, mWs: cute.Tensor, tiled_mma: cute.TiledMma,
                   a_staged: cute.ComposedLayout, b_staged: cute.ComposedLayout):
            P, ROWS, TM = self.stages, self.rows, self.tm
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

            # (tile rows/tokens, bk, K tiles) views of this CTA's rows and tokens; TMA partitions over them
            gW = cute.local_tile(mW, self.tile, (bidx, bidy, None), proj=(1, None, 1))
            gX = cute.local_tile(mX, self.tile, (bidx, bidy, None), proj=(None, 1, 1))
            tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                             cute.group_modes(gW, 0, 2))
            tXs, tXg = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                             cute.group_modes(gX, 0, 2))
            ktiles = cute.size(gW, mode=[2]) // self.split
            kt0 = bidz * ktiles

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

            # Pipeline states are built from the stage number (slot j % P, phase from j // P) rather than advanced:
            # a state object advanced inside a dynamic ``if`` does not carry its update out of it.
            # prologue: W of the first stages (no dependence on the grid before), then x once that grid is done
            pre = cutlass.min(P, ktiles)
            if warp == 0:
                for j in cutlass.range(pre, unroll=1):
                    ps = self._state(j, 1)
                    pipe.producer_acquire(ps)
                    cute.copy(tma_w, tWg[(None, kt0 + j)], tWs[(None, ps.index)], tma_bar_ptr=pipe.producer_get_barrier(ps))
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x, y and the workspace only from here on
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
                warpgroup.wait_group(1)  # the stage before this one has retired: its buffer may be refilled
                if kt > 0:
                    pipe.consumer_release(self._state(kt - 1, 0))
                    j = kt - 1 + P  # the stage that refills the slot just released
                    if warp == 0 and j < ktiles:
                        ps = self._state(j, 1)
                        pipe.producer_acquire(ps)  # every warp has released the slot
                        cute.copy(tma_w, tWg[(None, kt0 + j)], tWs[(None, ps.index)],
                                  tma_bar_ptr=pipe.producer_get_barrier(ps))
                        cute.copy(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)],
                                  tma_bar_ptr=pipe.producer_get_barrier(ps))
            warpgroup.wait_group(0)

            # epilogue: accumulators -> sOut[token][row] -> row-contiguous stores of y (or of this slice's partial)
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
                    if cutlass.const_expr(self.split == 1):
                        mY[tok0 + t, row0 + r] = sOut[t, r].to(BFloat16)
                    else:
                        mWs[bidz, tok0 + t, row0 + r] = sOut[t, r]

        @cute.jit
        def _state(self, j, producer: cutlass.Constexpr):
            """Pipeline state of stage ``j``: slot j % P; the consumer waits for the (j // P)-th completion of the
            slot's full barrier, the producer for the (j // P - 1)-th of its empty one (none for j < P: parity 1 on
            a fresh barrier passes)."""
            P = self.stages
            return pipeline.PipelineState(P, j, j % P, ((j // P) % 2) ^ producer)

    return WgmmaKernel
