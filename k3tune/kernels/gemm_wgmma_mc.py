"""gemm.wgmma with the token tile multicast across a cluster of CTAs along the weight rows (staged: compiled on the
CPU, GPU numerics not yet run).

y[M,N] = x[M,K] @ W[N,K]^T, bf16 in and out, fp32 accumulation: gemm_wgmma's swap-AB warpgroup MMA, TMA ring
and epilogue, with one change. There every CTA reads its token tile x[tok0:tok0+tile_m, k-slice] from L2 itself, so
x's traffic is M / rows of the weights' (at M = 64 on 64-row tiles, as much as W: the 1536 x 7168 projections run at
~0.5 of the HBM roofline there, NOTES.md session 14, with the L2 serving twice the weight bytes). Here the
``cluster`` CTAs that own neighbouring row tiles (same token tile, same K slice) form one thread-block cluster
along grid x; each issues the TMA of 1/cluster of every x stage with a multicast mask over the cluster, so the
tile lands in every CTA's ring while the L2 serves it once.

The ring's empty barriers count every cluster CTA's consumer warps (a slot is refilled only when every CTA that
receives this CTA's x slice has retired its wgmmas on it: ``PipelineTmaAsync`` signals the peers' barriers); a full
barrier expects the CTA's W tile and the whole x tile (its own slice and the peers'). The grid along the rows is
rounded up to whole clusters (tiles past N are zero-filled by TMA and never stored), and a cluster barrier at the
end keeps every CTA resident until its peers' last remote arrivals. Split-K, PDL and the epilogue are gemm_wgmma's.
Hopper only, like gemm_wgmma. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k wgmma_mc``.

Staged in its own module so that gemm_wgmma's shipped winners keep their key; at the re-sweep that ships it, the
cluster becomes a knob of gemm_wgmma (1 = today's kernel) and this module goes.
"""

import dataclasses
import functools
from dataclasses import dataclass

from k3tune.errors import CannotImplement
from k3tune.kernels import gemm_wgmma
from k3tune.kernels.base import Work
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_wgmma import WgmmaConfig, WgmmaGemm
from k3tune.plan.problems import Problem

CLUSTERS = (2, 4)  # CTAs sharing one x tile (portable cluster sizes)


@dataclass(frozen=True)
class WgmmaMcConfig(WgmmaConfig):
    cluster: int = 2  # CTAs along the weight rows that share (multicast) each x stage


class WgmmaMulticastGemm(WgmmaGemm):
    name = "gemm.wgmma_mc"
    config_cls = WgmmaMcConfig
    priority = 44
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_wgmma")  # its ring and epilogue are wgmma's

    def can_implement(self, problem: Problem) -> bool:
        """Only where an x stage splits into whole swizzle atoms for the smallest cluster: a token tile of 16 or
        more, or a 128-wide K step (K = 448 at M <= 8 has neither)."""
        if not super().can_implement(problem):
            return False
        space = super().space(problem)
        return any((t // 8) * (b // 64) % CLUSTERS[0] == 0 and problem["K"] % b == 0
                   for t in space["tile_m"] for b in space["bk"])

    def space(self, problem: Problem) -> dict[str, tuple]:
        return {**super().space(problem), "cluster": CLUSTERS}

    def valid(self, cfg: WgmmaMcConfig, problem: Problem) -> bool:
        # each CTA's slice of an x stage is whole 8-token x 64-K swizzle atoms (1 KB)
        return (cfg.cluster in CLUSTERS and (cfg.tile_m // 8) * (cfg.bk // 64) % cfg.cluster == 0
                and super().valid(cfg, problem))

    def seeds(self, problem: Problem) -> list[WgmmaMcConfig]:
        """gemm_wgmma's seeds (under its own rules) at clusters of 4 and 2, where the x tile divides."""
        out = []
        for cfg in WgmmaGemm().seeds(problem):
            for c in (4, 2):
                mc = WgmmaMcConfig(**dataclasses.asdict(cfg), cluster=c)
                if self.valid(mc, problem):
                    out.append(mc)
                    break
        return list(dict.fromkeys(out))

    def default(self, problem: Problem) -> WgmmaMcConfig:
        seeds = self.seeds(problem)
        return seeds[0] if seeds else WgmmaMcConfig(tile_m=16, bk=64, cluster=2)

    def work(self, problem: Problem, cfg: WgmmaMcConfig) -> Work:
        return dataclasses.replace(super().work(problem, cfg), extra_us=0.3)  # + the cluster barriers

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
            tma_x, tX = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), mX,
                                                    cute.slice_(b_staged, (None, None, 0)), (self.tm, self.bk),
                                                    num_multicast=C)

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
            self.kernel(tma_w, tW, tma_x, tX, mY, mWs, tiled_mma, a_staged, b_staged).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=[C, 1, 1], stream=stream, use_pdl=self.pdl)
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
            x_mask = cpasync.create_tma_multicast_mask(cta_layout, (0, rank, 0, 0), 1)
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
                    cute.copy(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)],
                              tma_bar_ptr=pipe.producer_get_barrier(ps), mcast_mask=x_mask)

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
                        cute.copy(tma_x, tXg[(None, kt0 + j)], tXs[(None, ps.index)],
                                  tma_bar_ptr=pipe.producer_get_barrier(ps), mcast_mask=x_mask)
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
            # no CTA leaves while a peer may still arrive on its empty barriers or multicast into its ring
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    return WgmmaMcKernel
