"""gemm.wgmma with the split-K CTAs of a tile as one thread-block cluster, their partials reduce-scattered over
DSMEM (shipped with the session-15 H200 database: s15-r3 probe, r4 sweep, r5/r6 benches in NOTES.md).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation: gemm_wgmma's swap-AB warpgroup MMA, TMA ring
and staged epilogue, with another end for split-K. There every split CTA writes its fp32 partial to a workspace
in global memory and a second kernel sums the slices: 2 x split x M x N x 4 bytes of extra traffic and one more
launch, which at M = 64 is 29% of q_a's weight bytes at split 8 (s15-r1: q_a M = 64 split 8 13.7 us against
split 4 10.9, floor 5.3). Here the ``split_k`` CTAs of a tile (2-8, any count: a portable cluster along grid z)
stage their partials in shared memory as gemm_wgmma does, and the tile's 16-byte vectors are divided among them
in contiguous chunks: every CTA pushes each vector it does not own to its owner (``st.async``, counted on the
owner's mbarrier), and each owner sums its chunk over the split slices in rank order (deterministic) and stores
it. Nothing of the partials leaves the SMs, there is no second kernel, and every CTA of the cluster stores.

The K slices may differ by one K step (CTA z takes steps z*T/S .. (z+1)*T/S), so the split need not divide K's
steps: the H200's 132 SMs are 12 x 11 while K3's row-tile counts are 2^a x 3, and splits such as 5 or 6 fill
the SMs where 4 and 8 leave them idle or doubled. Each CTA arms its mbarrier for the bytes it will receive
before the cluster barrier that lets the pushes start (the main loop runs between its two halves). Hopper only,
like gemm_wgmma. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k wgmma_ck``.

Its own module (not a knob of gemm_wgmma) so that gemm_wgmma's winners kept their key when it was added.
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

SPLITS = (2, 3, 4, 5, 6, 7, 8)  # CTAs of a cluster along K (portable cluster sizes), slices uneven by <= 1 step
SMS = 132  # H200 SMs: the seeds' balance rule (the search measures the others)


def chunk_vectors(cfg: WgmmaConfig) -> int:
    """16-byte vectors of the staged tile each rank owns (the last rank may own fewer)."""
    return math.ceil(cfg.tile_m * 64 * cfg.warpgroups // 4 / cfg.split_k)


def recv_bytes(cfg: WgmmaConfig) -> int:
    """Every CTA's receive buffer: one slot per rank of the chunk it owns."""
    return cfg.split_k * chunk_vectors(cfg) * 16


class WgmmaClusterKGemm(WgmmaGemm):
    name = "gemm.wgmma_ck"
    workspace_splits = 0  # the partials stay in shared memory
    priority = 44
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_wgmma")  # its ring and epilogue are wgmma's

    def space(self, problem: Problem) -> dict[str, tuple]:
        return {**super().space(problem), "split_k": SPLITS}

    def valid(self, cfg: WgmmaConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        return (cfg.split_k in SPLITS
                and k % cfg.bk == 0 and k // cfg.bk >= 2 * cfg.split_k  # every slice at least two K steps
                and smem_bytes(cfg) + recv_bytes(cfg) + 16 <= SMEM_BUDGET
                and 64 * cfg.warpgroups <= max(64, _pow2_ceil(n)))

    def seeds(self, problem: Problem) -> list[WgmmaConfig]:
        """gemm_wgmma's seed layouts (token tile, K step, ring) at the split that balances the grid best on the
        SMs (``balanced_split``) and at 4 and 8."""
        out = []
        for cfg in WgmmaGemm().seeds(problem):
            for split in (balanced_split(problem, cfg), 4, 8):
                c = dataclasses.replace(cfg, split_k=split)
                if self.valid(c, problem):
                    out.append(c)
        return list(dict.fromkeys(out))

    def default(self, problem: Problem) -> WgmmaConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else WgmmaConfig(tile_m=8, split_k=2)

    def work(self, problem: Problem, cfg: WgmmaConfig) -> Work:
        unsplit = super().work(problem, dataclasses.replace(cfg, split_k=1))
        return dataclasses.replace(unsplit, ctas=unsplit.ctas * cfg.split_k, extra_us=0.4)  # cluster barrier, DSMEM

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
            fn(x, w, y, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        return run


def balanced_split(problem: Problem, cfg: WgmmaConfig) -> int:
    """The split whose grid keeps the SMs most evenly busy: the fraction of the busiest SM's work that is the
    average's, from the CTA count (its waves over the SMs) and the uneven K slices; the smaller split on a tie."""
    rows = 64 * cfg.warpgroups
    tiles = math.ceil(problem["N"] / rows) * math.ceil(problem["M"] / cfg.tile_m)
    steps = problem["K"] // cfg.bk

    def balance(s: int) -> float:
        ctas = tiles * s
        return (ctas / SMS) / math.ceil(ctas / SMS) * (steps / s) / math.ceil(steps / s)

    fits = [s for s in SPLITS if steps >= 2 * s] or [SPLITS[0]]
    return max(fits, key=lambda s: (round(balance(s), 2), -s))


@functools.cache
def compiled(warpgroups: int, tile_m: int, split: int, bk: int, stages: int, pdl: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if not arch.startswith("sm_90"):
        raise CannotImplement(f"gemm.wgmma_ck needs Hopper wgmma (sm_90a), not {arch}")
    if split not in SPLITS:
        raise CannotImplement(f"gemm.wgmma_ck: split {split} is not a portable cluster along K {SPLITS}")
    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    kernel = _kernel_class()(warpgroups, tile_m, split, bk, stages, pdl)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """gemm_wgmma's kernel with the cluster launch along K and the DSMEM reduce-scatter; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    class WgmmaCkKernel(gemm_wgmma._kernel_class()):
        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
                (self.wg, 1, 1), tiler_mn=(64, self.tm))
            a_staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile, BFloat16, self.stages)
            b_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile, BFloat16, self.stages)
            tma_w, tW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                    cute.slice_(a_staged, (None, None, 0)), (self.rows, self.bk))
            tma_x, tX = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                                    cute.slice_(b_staged, (None, None, 0)), (self.tm, self.bk))
            vecs = self.tm * self.rows // 4
            self.chunk = (vecs + self.split - 1) // self.split

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                recv_bar: cute.struct.MemRange[cutlass.Int64, 1]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_staged)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_staged)], 1024]
                sOut: cute.struct.Align[cute.struct.MemRange[Float32, self.tm * self.ld], 16]
                recv: cute.struct.Align[cute.struct.MemRange[Float32, self.split * self.chunk * 4], 16]

            self.storage = Storage
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + self.tm - 1) // self.tm, self.split)
            self.kernel(tma_w, tW, tma_x, tX, mY, tiled_mma, a_staged, b_staged).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=[1, 1, self.split], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                   mY: cute.Tensor, tiled_mma: cute.TiledMma,
                   a_staged: cute.ComposedLayout, b_staged: cute.ComposedLayout):
            P, ROWS, TM, S, CH = self.stages, self.rows, self.tm, self.split, self.chunk
            VECS = TM * ROWS // 4
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, bidz = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            m = mY.shape[0]
            n = mY.shape[1]
            row0 = bidx * ROWS
            tok0 = bidy * TM
            owned = cutlass.min(VECS - rank * CH, CH)  # vectors this rank sums and stores

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            if warp == 0:
                cpasync.prefetch_descriptor(tma_w)
                cpasync.prefetch_descriptor(tma_x)

            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(self.storage)
            bar = st.recv_bar.data_ptr()
            # every CTA's mbarrier expects its chunk from every peer before anyone can push (the cluster barrier
            # is split around the main loop)
            if tidx == 0:
                cute.arch.mbarrier_init(bar, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar, (S - 1) * owned * 16)
            cute.arch.cluster_arrive_relaxed()

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
            recv = cute.make_tensor(st.recv.data_ptr(), cute.make_layout((S, CH, 4), stride=(CH * 4, 4, 1)))

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
                cute.arch.griddepcontrol_wait()  # x and y only from here on
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

            for i in cutlass.range_constexpr(cute.size(acc)):
                rt = tCcC[i]
                sOut[rt[1], rt[0]] = acc[i]
            cute.arch.sync_threads()
            cute.arch.cluster_wait()  # every peer's mbarrier is initialised and armed

            # every vector of the staged tile to its owner's slot for this rank: pushed to a peer, copied locally
            for j in cutlass.range_constexpr((VECS + self.threads - 1) // self.threads):
                v = tidx + j * self.threads
                if v < VECS:
                    owner = v // CH
                    t = v * 4 // ROWS
                    r = v * 4 % ROWS
                    vals = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                    for e in cutlass.range_constexpr(4):
                        vals[e] = sOut[t, r + e]
                    if owner == rank:
                        for e in cutlass.range_constexpr(4):
                            recv[rank, v - owner * CH, e] = vals[e]
                    else:
                        bits = cute.recast_tensor(vals, Int32)
                        cute.arch.store_async_dsmem((recv.iterator + ((rank * CH + v - owner * CH) * 4)).align(16),
                                                    (bits[0], bits[1], bits[2], bits[3]), bar, owner)
            cute.arch.sync_threads()  # this CTA's own slice is in place
            cute.arch.mbarrier_wait(bar, 0)  # and every peer's

            # this rank's chunk summed over the slices in rank order (deterministic) and stored
            for j in cutlass.range_constexpr((CH + self.threads - 1) // self.threads):
                i = tidx + j * self.threads
                if i < owned:
                    v = rank * CH + i
                    t = v * 4 // ROWS
                    r = v * 4 % ROWS
                    total = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                    total.fill(0.0)
                    for z in cutlass.range_constexpr(S):
                        for e in cutlass.range_constexpr(4):
                            total[e] = total[e] + recv[z, i, e]
                    if tok0 + t < m:
                        for e in cutlass.range_constexpr(4):
                            if row0 + r + e < n:
                                mY[tok0 + t, row0 + r + e] = total[e].to(BFloat16)

    return WgmmaCkKernel
