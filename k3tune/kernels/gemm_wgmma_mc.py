"""gemm.wgmma with the token tile multicast across a cluster of CTAs along the weight rows, and split-K factors
that balance the grid on the GPU's SMs (staged: compiled on the CPU, GPU numerics not yet run).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation: gemm_wgmma's swap-AB warpgroup MMA, TMA ring
and epilogue, with two changes.

- **x multicast** (``cluster`` 2 or 4; 1 is gemm_wgmma's loads). There every CTA reads its token tile
  x[tok0:tok0+tile_m, k-slice] from L2 itself, so x's traffic is M / rows of the weights' (at M = 64 on 64-row
  tiles, as much as W: the 1536 x 7168 projections run at ~0.5 of the HBM roofline there, NOTES.md session 14,
  with the L2 serving twice the weight bytes). Here the ``cluster`` CTAs that own neighbouring row tiles (same
  token tile, same K slice) form one thread-block cluster along grid x; each issues the TMA of 1/cluster of every
  x stage with a multicast mask over the cluster, so the tile lands in every CTA's ring while the L2 serves it
  once. The ring's empty barriers count every cluster CTA's consumer warps (a slot is refilled only when every CTA
  that receives this CTA's x slice has retired its wgmmas on it: ``PipelineTmaAsync`` signals the peers' barriers);
  a full barrier expects the CTA's W tile and the whole x tile. The grid along the rows is rounded up to whole
  clusters (tiles past N are zero-filled by TMA and never stored), and a cluster barrier at the end keeps every CTA
  resident until its peers' last remote arrivals.
- **balanced split-K** (``split_k`` also 3, 6, 11, 12): the K slices may differ by one K step (CTA z takes steps
  z*T/S .. (z+1)*T/S), so the split need not divide K's steps. The H200's 132 SMs are 12 x 11 while the K3 row-tile
  counts are 2^a x 3 (24 tiles of 64 rows at N = 1536, 12 at 768, 48 at 3072): gemm_wgmma's splits of 4 or 8 give
  96 or 192 CTAs there (36 SMs idle, or 60 SMs with twice the work), 11 gives 264 (two per SM).

Split-K partials go to the workspace and a second kernel sums them in slice order, PDL and the epilogue are
gemm_wgmma's. Hopper only, like gemm_wgmma. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k wgmma_mc``.

Staged in its own module so that gemm_wgmma's shipped winners keep their key; at the re-sweep that ships it, this
kernel replaces gemm_wgmma's (cluster 1 and the power-of-two splits are today's kernel) and the module goes.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

from k3tune.errors import CannotImplement
from k3tune.kernels import gemm_wgmma
from k3tune.kernels.base import Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_wgmma import SMEM_BUDGET, WgmmaConfig, WgmmaGemm, _pow2_ceil, smem_bytes
from k3tune.plan.problems import Problem

CLUSTERS = (1, 2, 4)  # CTAs sharing one x tile (portable cluster sizes; 1: no multicast)
SPLITS = (1, 2, 3, 4, 6, 8, 11, 12, 16)  # K slices, uneven by at most one K step
MAX_SPLIT = 16
SMS = 132  # H200 SMs: the seeds' balance rule (the search measures the others)


@dataclass(frozen=True)
class WgmmaMcConfig(WgmmaConfig):
    cluster: int = 2  # CTAs along the weight rows that share (multicast) each x stage; 1: each loads its own


class WgmmaMulticastGemm(WgmmaGemm):
    name = "gemm.wgmma_mc"
    config_cls = WgmmaMcConfig
    workspace_splits = MAX_SPLIT
    priority = 44
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_wgmma")  # its ring and epilogue are wgmma's

    def space(self, problem: Problem) -> dict[str, tuple]:
        return {**super().space(problem), "split_k": SPLITS, "cluster": CLUSTERS}

    def valid(self, cfg: WgmmaMcConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        return (cfg.cluster in CLUSTERS and cfg.split_k in SPLITS
                and k % cfg.bk == 0 and k // cfg.bk >= 2 * cfg.split_k  # every slice at least two K steps
                # each CTA's slice of an x stage is whole 8-token x 64-K swizzle atoms (1 KB)
                and (cfg.tile_m // 8) * (cfg.bk // 64) % cfg.cluster == 0
                and smem_bytes(cfg) <= SMEM_BUDGET
                and 64 * cfg.warpgroups <= max(64, _pow2_ceil(n)))

    def seeds(self, problem: Problem) -> list[WgmmaMcConfig]:
        """gemm_wgmma's seed layouts (token tile, K step, ring) at the split that balances the grid best on the
        SMs (``balanced_split``), each with the largest cluster its x tile divides into and without one."""
        out = []
        for cfg in WgmmaGemm().seeds(problem):
            atoms = (cfg.tile_m // 8) * (cfg.bk // 64)  # 1 KB swizzle atoms in an x stage
            largest = next((c for c in (4, 2) if atoms % c == 0), 1)
            for c in dict.fromkeys((largest, 1)):
                mc = WgmmaMcConfig(**{**dataclasses.asdict(cfg), "split_k": balanced_split(problem, cfg)}, cluster=c)
                if self.valid(mc, problem):
                    out.append(mc)
        return list(dict.fromkeys(out))

    def default(self, problem: Problem) -> WgmmaMcConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else WgmmaMcConfig(tile_m=8, bk=64, cluster=1)

    def work(self, problem: Problem, cfg: WgmmaMcConfig) -> Work:
        return dataclasses.replace(super().work(problem, cfg), extra_us=0.3 if cfg.cluster > 1 else 0.2)

    def build(self, problem: Problem, cfg: WgmmaMcConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        arch = current_arch()
        if not arch.startswith("sm_90"):
            raise CannotImplement(f"{self.name} needs Hopper wgmma (sm_90a), not {arch}")
        fn = compiled(cfg.warpgroups, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl, cfg.cluster, arch)

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


def balanced_split(problem: Problem, cfg: WgmmaConfig) -> int:
    """The split whose grid keeps the SMs most evenly busy: the fraction of the busiest SM's work that is the
    average's, from the CTA count (its waves over the SMs) and the uneven K slices; the smaller split on a tie
    (fewer partials to write and sum)."""
    rows = 64 * cfg.warpgroups
    tiles = math.ceil(problem["N"] / rows) * math.ceil(problem["M"] / cfg.tile_m)
    steps = problem["K"] // cfg.bk

    def balance(s: int) -> float:
        ctas = tiles * s
        return (ctas / SMS) / math.ceil(ctas / SMS) * (steps / s) / math.ceil(steps / s)

    fits = [s for s in SPLITS if steps >= 2 * s] or [1]
    return max(fits, key=lambda s: (round(balance(s), 2), -s))


@functools.cache
def compiled(warpgroups: int, tile_m: int, split: int, bk: int, stages: int, pdl: int, cluster: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if not arch.startswith("sm_90"):
        raise CannotImplement(f"gemm.wgmma_mc needs Hopper wgmma (sm_90a), not {arch}")
    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    ws = make_fake_compact_tensor(Float32, (cute.sym_int(), m, n), stride_order=(2, 1, 0), assumed_align=16)
    kernel = _kernel_class()(warpgroups, tile_m, split, bk, stages, pdl, cluster)
    return cute.compile(kernel, x, w, y, ws, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """gemm_wgmma's kernel with the x tile multicast over a cluster; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    class WgmmaMcKernel(gemm_wgmma._kernel_class()):
        def __init__(self, warpgroups, tile_m, split, bk, stages, pdl, cluster):
            super().__init__(warpgroups, tile_m, split, bk, stages, pdl)
            self.cluster = cluster

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
                     stream: cuda.CUstream):
            C = self.cluster
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
                (self.wg, 1, 1), tiler_mn=(64, self.tm))
            a_staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile, BFloat16, self.stages)
            b_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile, BFloat16, self.stages)
            tma_w, tW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                    cute.slice_(a_staged, (None, None, 0)), (self.rows, self.bk))
            if cutlass.const_expr(C > 1):
                tma_x, tX = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), mX,
                                                        cute.slice_(b_staged, (None, None, 0)), (self.tm, self.bk),
                                                        num_multicast=C)
            else:
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
            row_tiles = (n + self.rows - 1) // self.rows
            grid = ((row_tiles + C - 1) // C * C, (m + self.tm - 1) // self.tm, self.split)
            if cutlass.const_expr(C > 1):
                self.kernel(tma_w, tW, tma_x, tX, mY, mWs, tiled_mma, a_staged, b_staged).launch(
                    grid=grid, block=[self.threads, 1, 1], cluster=[C, 1, 1], stream=stream, use_pdl=self.pdl)
            else:
                self.kernel(tma_w, tW, tma_x, tX, mY, mWs, tiled_mma, a_staged, b_staged).launch(
                    grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)
            if cutlass.const_expr(self.split > 1):
                self.launch_reduce(mWs, mY, stream)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                   mY: cute.Tensor, mWs: cute.Tensor, tiled_mma: cute.TiledMma,
                   a_staged: cute.ComposedLayout, b_staged: cute.ComposedLayout):
            P, ROWS, TM, C = self.stages, self.rows, self.tm, self.cluster
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, bidz = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
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
            cta_layout = cute.make_layout((1, C, 1, 1))  # (V, M, N, K): the cluster along the MMA's M (W rows)
            # a slot's empty barrier: one arrival per consumer warp of every CTA this CTA's x slice lands in;
            # create() ends with a cluster barrier, so every peer's barriers are initialised before any multicast
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.bars.data_ptr(), num_stages=P,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, C * (self.threads // 32)),
                tx_count=stage_bytes, cta_layout_vmnk=cta_layout)
            x_mask = cpasync.create_tma_multicast_mask(cta_layout, (0, rank, 0, 0), 1) if C > 1 else None
            sW = st.sW.get_tensor(a_staged.outer, swizzle=a_staged.inner)
            sX = st.sX.get_tensor(b_staged.outer, swizzle=b_staged.inner)
            sOut = cute.make_tensor(st.sOut.data_ptr(), cute.make_layout((TM, ROWS), stride=(self.ld, 1)))

            gW = cute.local_tile(mW, self.tile, (bidx, bidy, None), proj=(1, None, 1))
            gX = cute.local_tile(mX, self.tile, (bidx, bidy, None), proj=(None, 1, 1))
            tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                             cute.group_modes(gW, 0, 2))
            # this CTA's 1/C of every x stage (the peers issue the rest into this CTA's ring)
            tXs, tXg = cpasync.tma_partition(tma_x, rank, cute.make_layout(C), cute.group_modes(sX, 0, 2),
                                             cute.group_modes(gX, 0, 2))
            steps = cute.size(gW, mode=[2])
            kt0 = bidz * steps // self.split  # slices uneven by at most one K step
            ktiles = (bidz + 1) * steps // self.split - kt0

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
                cute.arch.griddepcontrol_wait()  # x, y and the workspace only from here on
            if warp == 0:
                for j in cutlass.range(pre, unroll=1):
                    ps = self._state(j, 1)
                    self._copy_x(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)], pipe.producer_get_barrier(ps),
                                 x_mask)

            for kt in cutlass.range(ktiles, unroll=1):
                cs = self._state(kt, 0)
                pipe.consumer_wait(cs)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(kblocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, cs.index)], tCrB[(None, None, kb, cs.index)], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if kt > 0:
                    pipe.consumer_release(self._state(kt - 1, 0))  # signals every peer's empty barrier too
                    j = kt - 1 + P
                    if warp == 0 and j < ktiles:
                        ps = self._state(j, 1)
                        pipe.producer_acquire(ps)  # every warp of every receiving CTA has released the slot
                        cute.copy(tma_w, tWg[(None, kt0 + j)], tWs[(None, ps.index)],
                                  tma_bar_ptr=pipe.producer_get_barrier(ps))
                        self._copy_x(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)],
                                     pipe.producer_get_barrier(ps), x_mask)
            warpgroup.wait_group(0)

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
            if cutlass.const_expr(C > 1):  # no CTA leaves while a peer may still arrive on its barriers
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()

        @cute.jit
        def _copy_x(self, tma_x, src, dst, bar, mask):
            if cutlass.const_expr(self.cluster > 1):
                cute.copy(tma_x, src, dst, tma_bar_ptr=bar, mcast_mask=mask)
            else:
                cute.copy(tma_x, src, dst, tma_bar_ptr=bar)

    return WgmmaMcKernel
