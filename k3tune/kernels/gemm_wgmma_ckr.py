"""gemm.wgmma_ck with the cluster sum on rank 0 alone (staged, session 54).

Why: bench/kline.py (s54, H100) puts wgmma_ck's cost over splitk_cluster at M = 16 in the fixed part of a launch
(0.97 us against splitk_cluster's 0.60 at M = 8, both with PDL), and moving splitk_cluster's push behind a barrier
that waits for the cluster's slowest CTA (s54's splitk_alias) raised that fixed part by ~1.1 us: a CTA that waits for
its peers keeps its slot from the next launch's CTAs, which PDL starts early. wgmma_ck's reduce-scatter makes every
CTA wait for a chunk from every peer. Here, as in gemm_splitk_cluster, the peers push their whole staged tile to
rank 0 (``st.async``, counted on rank 0's mbarrier) and exit at once; rank 0 sums the slices in rank order and
stores. The price: rank 0's receive buffer holds (split - 1) tiles, and it alone sums and stores.

The main loop is wgmma_ck's (the kernel body is its own copy, with the end changed). Hopper only. GPU numerics:
``pytest -m gpu tests/test_gpu_kernels.py -k wgmma_ckr``.
"""

import functools

from k3tune.errors import CannotImplement
from k3tune.kernels import gemm_wgmma_ck
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_wgmma import SMEM_BUDGET, WgmmaConfig, _pow2_ceil, smem_bytes
from k3tune.kernels.gemm_wgmma_ck import SPLITS, WgmmaClusterKGemm
from k3tune.plan.problems import Problem


def recv_bytes(cfg: WgmmaConfig) -> int:
    """Rank 0's receive buffer: every peer's staged fp32 tile."""
    return (cfg.split_k - 1) * cfg.tile_m * 64 * cfg.warpgroups * 4


class WgmmaRank0Gemm(WgmmaClusterKGemm):
    name = "gemm.wgmma_ckr"
    priority = 45
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_wgmma", "k3tune.kernels.gemm_wgmma_ck")

    def valid(self, cfg: WgmmaConfig, problem: Problem) -> bool:
        k, n = problem["K"], problem["N"]
        return (cfg.split_k in SPLITS
                and k % cfg.bk == 0 and k // cfg.bk >= 2 * cfg.split_k
                and smem_bytes(cfg) + recv_bytes(cfg) + 16 <= SMEM_BUDGET
                and 64 * cfg.warpgroups <= max(64, _pow2_ceil(n)))

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


@functools.cache
def compiled(warpgroups: int, tile_m: int, split: int, bk: int, stages: int, pdl: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if not arch.startswith("sm_90"):
        raise CannotImplement(f"gemm.wgmma_ckr needs Hopper wgmma (sm_90a), not {arch}")
    if split not in SPLITS:
        raise CannotImplement(f"gemm.wgmma_ckr: split {split} is not a portable cluster along K {SPLITS}")
    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    kernel = _kernel_class()(warpgroups, tile_m, split, bk, stages, pdl)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """wgmma_ck's kernel with the sum on rank 0; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    class WgmmaRank0Kernel(gemm_wgmma_ck._kernel_class()):
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

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                recv_bar: cute.struct.MemRange[cutlass.Int64, 1]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_staged)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_staged)], 1024]
                sOut: cute.struct.Align[cute.struct.MemRange[Float32, self.tm * self.ld], 16]
                recv: cute.struct.Align[cute.struct.MemRange[Float32, (self.split - 1) * vecs * 4], 16]

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
            P, ROWS, TM, S = self.stages, self.rows, self.tm, self.split
            VECS = TM * ROWS // 4
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
            bar = st.recv_bar.data_ptr()
            # rank 0's mbarrier expects every peer's whole tile before anyone can push (the cluster barrier is split
            # around the main loop)
            if rank == 0 and tidx == 0:
                cute.arch.mbarrier_init(bar, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar, (S - 1) * VECS * 16)
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
            recv = cute.make_tensor(st.recv.data_ptr(), cute.make_layout((S - 1, VECS, 4), stride=(VECS * 4, 4, 1)))

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
            cute.arch.cluster_wait()  # rank 0's mbarrier is initialised and armed

            if rank > 0:  # the whole staged tile to rank 0's slot for this rank, then done
                for j in cutlass.range_constexpr((VECS + self.threads - 1) // self.threads):
                    v = tidx + j * self.threads
                    if v < VECS:
                        t = v * 4 // ROWS
                        r = v * 4 % ROWS
                        vals = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                        for e in cutlass.range_constexpr(4):
                            vals[e] = sOut[t, r + e]
                        bits = cute.recast_tensor(vals, Int32)
                        cute.arch.store_async_dsmem((recv.iterator + (((rank - 1) * VECS + v) * 4)).align(16),
                                                    (bits[0], bits[1], bits[2], bits[3]), bar, 0)
            else:  # rank 0: its own slice, then every peer's in rank order (deterministic), stored as bf16
                cute.arch.mbarrier_wait(bar, 0)
                for j in cutlass.range_constexpr((VECS + self.threads - 1) // self.threads):
                    v = tidx + j * self.threads
                    if v < VECS:
                        t = v * 4 // ROWS
                        r = v * 4 % ROWS
                        total = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                        for e in cutlass.range_constexpr(4):
                            total[e] = sOut[t, r + e]
                        for z in cutlass.range_constexpr(S - 1):
                            for e in cutlass.range_constexpr(4):
                                total[e] = total[e] + recv[z, v, e]
                        if tok0 + t < m:
                            for e in cutlass.range_constexpr(4):
                                if row0 + r + e < n:
                                    mY[tok0 + t, row0 + r + e] = total[e].to(BFloat16)

    return WgmmaRank0Kernel
