"""gemm.splitk_cluster that lets the next launch start late in its K loop instead of at its start (staged,
session 55).

Why: bench/kline.py (s54, H100) puts the M = 16 loss in each launch's fixed part (1.2 us for the best 16-token
layout, 0.6 for the M = 8 winner), and bench/timeline.py shows why the M = 8 winner's is small: its 768 short CTAs
end over 3.3 us and the next launch's CTAs, taking each freed slot, issue their first W stages while the launch
before drains, so HBM stays busy across the boundary. splitk_cluster triggers the next launch
(``griddepcontrol.launch_dependents``) at its start. With the 16-token layouts' 192 CTAs and free slots for all of
the next launch's, that launch's CTAs start at once, load their first ``stages - 1`` W stages early, and wait idle
with them landed; when the launch before completes there is nothing in flight until they have read x and refilled
the ring. Here each CTA triggers when ``late`` stages of its K loop are left (``late`` = 0: at the start, as
splitk_cluster), so the next launch's first W stages are requested while this one drains its ring, sums the cluster
and stores, and are still streaming when it completes.

Only where ``griddepcontrol.launch_dependents`` runs differs from splitk_cluster (whose cluster launch, sum and
store this inherits); the main loop is gemm_splitk_tc's, copied with the trigger moved, since an edit to that keyed
module would make its shipped winners stale. M, N and K are dynamic. GPU numerics:
``pytest -m gpu tests/test_gpu_kernels.py -k splitk_trig``.
"""

import functools
from dataclasses import dataclass

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.gemm_splitk_cluster import SplitKClusterGemm
from k3tune.kernels.gemm_splitk_tc import SplitKConfig
from k3tune.kernels.pdl_trigger import LateTrigger, compile_dense
from k3tune.plan.problems import Problem


@dataclass(frozen=True)
class TrigConfig(SplitKConfig):
    late: int = 0  # K-loop stages left when the next launch may start (with pdl): 0 at the start (splitk_cluster's),
    # more than the slice has: at its first stage, after griddepcontrol.wait (one launch ahead at most)


class SplitKTriggerGemm(LateTrigger, SplitKClusterGemm):
    name = "gemm.splitk_trig"
    parent = "gemm.splitk_cluster"
    priority = 43
    config_cls = TrigConfig
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster",
                  "k3tune.kernels.pdl_trigger")

    def ktiles(self, problem: Problem, params: dict) -> int:
        return problem["K"] // (params["bk"] * params["split_k"])

    def compile(self, cfg: TrigConfig, arch: str):
        return compiled(cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl,
                        cfg.late, arch)


@functools.cache
def compiled(m_tiles: int, warps_n: int, warps_k: int, tile_m: int, split: int, bk: int, stages: int, pdl: int,
             late: int, arch: str):
    """Compile once per knob set and arch; M, N and K are dynamic. Never call inside a capture."""
    kernel = _kernel_class()(m_tiles, warps_n, warps_k, tile_m, split, bk, stages, 0, pdl)
    kernel.late = late
    return compile_dense(kernel, bk, arch)


@functools.cache
def _kernel_class():
    """gemm_splitk_cluster's kernel with the trigger placed ``self.late`` stages before the end of the K loop;
    defined on first use."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32

    VEC = 8

    class SplitKTriggerKernel(gemm_splitk_cluster._kernel_class()):
        late = 0

        @cute.jit
        def _mainloop(self, mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n):
            """gemm_splitk_tc's main loop and K-warp sum with ``griddepcontrol.launch_dependents`` at the
            iteration that has ``late`` stages left (the first, where the slice is shorter)."""
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
            fa = cute.make_rmem_tensor(cute.make_layout((8, MT)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)

            if cutlass.const_expr(self.pdl and self.late == 0):
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + s, s, tidx, row0, n)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x, y and the cluster's buffers: only from here on
            for s in cutlass.range_constexpr(P - 1):
                if s < ktiles:
                    self._issue_x(mX, sX, g2s, kt0 + s, s, tidx, tok0, m)
                cute.arch.cp_async_commit_group()
            fire = ktiles - self.late
            if fire < 0:
                fire = 0
            for kt in cutlass.range(ktiles):
                if cutlass.const_expr(self.pdl and self.late > 0):
                    if kt == fire:
                        cute.arch.griddepcontrol_launch_dependents()
                cute.arch.cp_async_wait_group(P - 2)
                cute.arch.sync_threads()
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

    return SplitKTriggerKernel
