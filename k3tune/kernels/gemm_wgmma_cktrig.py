"""gemm.wgmma_ck that lets the next launch start late in its K loop instead of at its start (staged, session 55).

Why: bench/kline.py (s54, H100) puts the M = 16 loss in each launch's fixed part (~1 us for the 16-token layouts,
0.6 for the M = 8 winner), and bench/timeline.py shows why the M = 8 winner's is small: its 768 short CTAs end over
3.3 us and the next launch's CTAs, taking each freed slot, issue their first W stages while the launch before
drains, so HBM stays busy across the boundary. wgmma_ck triggers the next launch
(``griddepcontrol.launch_dependents``) at its start. With few long CTAs and free slots for all of the next launch's,
that launch's CTAs start at once, load their first W stages early, and wait idle with them landed; when the launch
before completes there is nothing in flight until they have read x and refilled the ring. Here each CTA triggers
when ``late`` stages of its K loop are left (more than the slice has: at its first stage, after
``griddepcontrol.wait``; at the start is wgmma_ck itself, so late 0 is a config only without PDL), so the next
launch's first W stages are requested while this one drains its ring, sums the cluster and stores, and are still
streaming when it completes.

Measured on the H100 (the sweep's picks against the shipped table, one call each): M = 16 0.855 -> 0.896 of the
roofline at the floor >= 5 us (s56-r1), M = 32 and 64 +2.2% geomean, up to 13% a problem (s56-r3). The same
trigger on splitk_cluster (gemm.splitk_trig, s55) tied the M <= 8 picks (s56-r4), whose short CTAs already end
staggered, and was removed.

The kernel is wgmma_ck's, copied with the trigger moved, since an edit to that keyed module would make its shipped
winners stale. Hopper only. GPU numerics: ``pytest -m gpu tests/test_gpu_kernels.py -k wgmma_cktrig``.
"""

import functools
from dataclasses import dataclass

from k3tune.errors import CannotImplement
from k3tune.kernels import gemm_wgmma_ck
from k3tune.kernels.gemm_wgmma import WgmmaConfig
from k3tune.kernels.gemm_wgmma_ck import SPLITS, WgmmaClusterKGemm
from k3tune.kernels.pdl_trigger import LateTrigger, compile_dense
from k3tune.plan.problems import Problem


@dataclass(frozen=True)
class WgmmaTrigConfig(WgmmaConfig):
    late: int = 0  # K-loop stages left when the next launch may start (with pdl; 0 without): 0 would be at the start,
    # wgmma_ck's kernel, searched under that name


class WgmmaCkTriggerGemm(LateTrigger, WgmmaClusterKGemm):
    name = "gemm.wgmma_cktrig"
    parent = "gemm.wgmma_ck"
    priority = 45
    config_cls = WgmmaTrigConfig
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_wgmma", "k3tune.kernels.gemm_wgmma_ck",
                  "k3tune.kernels.pdl_trigger")

    def ktiles(self, problem: Problem, params: dict) -> int:
        return problem["K"] // params["bk"] // params["split_k"]  # the shorter slices of an uneven split

    def compile(self, cfg: WgmmaTrigConfig, arch: str):
        return compiled(cfg.warpgroups, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl, cfg.late, arch)


@functools.cache
def compiled(warpgroups: int, tile_m: int, split: int, bk: int, stages: int, pdl: int, late: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    if not arch.startswith("sm_90"):
        raise CannotImplement(f"gemm.wgmma_cktrig needs Hopper wgmma (sm_90a), not {arch}")
    if split not in SPLITS:
        raise CannotImplement(f"gemm.wgmma_cktrig: split {split} is not a portable cluster along K {SPLITS}")
    kernel = _kernel_class()(warpgroups, tile_m, split, bk, stages, pdl)
    kernel.late = late
    return compile_dense(kernel, bk, arch)


@functools.cache
def _kernel_class():
    """gemm_wgmma_ck's kernel with the trigger placed ``self.late`` stages before the end of the K loop; defined on
    first use."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup

    class WgmmaCkTriggerKernel(gemm_wgmma_ck._kernel_class()):
        late = 0

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

            if cutlass.const_expr(self.pdl and self.late == 0):
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

            fire = ktiles - self.late
            if fire < 0:
                fire = 0
            for kt in cutlass.range(ktiles, unroll=1):
                if cutlass.const_expr(self.pdl and self.late > 0):
                    if kt == fire:
                        cute.arch.griddepcontrol_launch_dependents()
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

    return WgmmaCkTriggerKernel
