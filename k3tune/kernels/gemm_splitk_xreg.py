"""gemm.splitk_cluster with x kept out of shared memory: each warp loads its x operands from global (L2) into
registers one stage ahead, and only W streams through the ring (staged; NOTES.md s30).

Why: at M = 16 the 16-token tile doubles x's share of every ring stage, so shared memory admits 5 CTAs a SM
instead of 7 and the grid needs 1.16 waves; neither tile is issue-bound (s30-r5 ncu: 27% of issue slots busy,
58% of cycles with no eligible warp). Without x in the ring a stage is the W tile alone and the 16-token tile
keeps the 8-token tile's residency. A lane's x operand for a 32-wide K chunk is one 16-byte vector of token
``g`` (the logical vector gemm_splitk_tc's operand layout assigns it), so a stage costs each warp ``tile_m / 8``
16-byte loads per chunk, issued a stage before they are used (the W ring's stage time covers their L2 latency).
Tokens past M are not loaded (their MMA columns are never stored). The rest (W ring, operand order, K-warp and
cluster sums, PDL: W before the wait, x after) is gemm_splitk_cluster's. GPU numerics: ``pytest -m gpu
tests/test_gpu_kernels.py -k splitk_xreg``.
"""

import dataclasses
import functools

from k3tune.kernels import gemm_splitk_cluster
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.kernels.gemm_splitk_cluster import SplitKClusterGemm, recv_bytes
from k3tune.kernels.gemm_splitk_tc import KCHUNK, SMEM_BUDGET, SplitKConfig
from k3tune.plan.problems import Problem


def smem_bytes(cfg: SplitKConfig) -> int:
    """The W ring, the K-warp reduction buffer and the leader's receive buffer: no x."""
    rows = 16 * cfg.m_tiles * cfg.warps_n
    red = 4 * cfg.m_tiles * (cfg.tile_m // 8) * 32 * cfg.warps_n * (cfg.warps_k - 1) * 4
    return cfg.stages * rows * cfg.bk * 2 + red + recv_bytes(cfg) + 32


class SplitKXregGemm(SplitKClusterGemm):
    name = "gemm.splitk_xreg"
    priority = 43
    depends_on = ("k3tune.kernels.gemm_common", "k3tune.kernels.gemm_splitk_tc", "k3tune.kernels.gemm_splitk_cluster")

    def valid(self, cfg: SplitKConfig, problem: Problem) -> bool:
        base = dataclasses.replace(cfg, stages=2, tile_m=8)  # splitk_cluster's rules but its x-inclusive smem sum
        x_vectors = cfg.bk // KCHUNK // cfg.warps_k * cfg.tile_m // 8  # a lane's x vectors a stage (twice in registers)
        return (super().valid(base, problem) and cfg.tile_m <= 32 and x_vectors <= 4
                and smem_bytes(cfg) <= SMEM_BUDGET)

    def seeds(self, problem: Problem) -> list[SplitKConfig]:
        """splitk_cluster's seeds (under its own rules), where valid here."""
        return [c for c in SplitKClusterGemm().seeds(problem) if self.valid(c, problem)]

    def build(self, problem: Problem, cfg: SplitKConfig):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        fn = compiled(cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl,
                      current_arch())

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
             arch: str):
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
    kernel = _kernel_class()(m_tiles, warps_n, warps_k, tile_m, split, bk, stages, 0, pdl)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    """splitk_cluster's kernel with a W-only ring and x in registers; defined on first use."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32

    VEC = 8

    class SplitKXregKernel(gemm_splitk_cluster._kernel_class()):
        @cute.jit
        def _ring(self, smem):
            """The W ring only (the x buffer is never read: a minimal one keeps the parent's signature)."""
            sW = smem.allocate_tensor(BFloat16, cute.make_layout(self.stages * self.rows * self.bk), 128)
            return sW, sW

        @cute.jit
        def _load_x(self, g2r, mX, rx, kt, wkk, c, g, tok0, m):
            """This lane's x vectors of stage ``kt``: per chunk of its K warp and token tile, logical vector
            ``chunk * 4 + c`` of token ``tok0 + 8 j + g`` (tokens past M are not loaded)."""
            K = mX.shape[1]
            for cc in cutlass.range_constexpr(self.kc // self.wk):
                pos = (wkk + cc * self.wk) * 4 + c
                for j in cutlass.range_constexpr(self.nt):
                    t = tok0 + j * 8 + g
                    if t < m:
                        src = mX.iterator + (t * K + kt * self.bk + pos * VEC)
                        cute.copy(g2r, self._vec(src), rx[None, cc, j])

        @cute.jit
        def _mainloop(self, mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n):
            """gemm_splitk_tc's ring for W alone; x from registers loaded one stage ahead. Returns the accumulators,
            whole in K warp 0."""
            MT, NT, WN, WK, P = self.mt, self.nt, self.wn, self.wk, self.stages
            CPW = self.kc // WK
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
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, CPW, NT)), BFloat16)  # this stage's x
            rn = cute.make_rmem_tensor(cute.make_layout((VEC, CPW, NT)), BFloat16)  # the next stage's
            rx.fill(0.0)
            rn.fill(0.0)
            fa = cute.make_rmem_tensor(cute.make_layout((8, MT)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(P - 1):  # W of the first stages: one commit group each
                if s < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + s, s, tidx, row0, n)
                cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # x and y only from here on
            self._load_x(s2r, mX, rx, kt0, wkk, c, g, tok0, m)
            flip = (g % 2) * self.swz
            for kt in cutlass.range(ktiles, unroll=1):
                if kt + 1 < ktiles:
                    self._load_x(s2r, mX, rn, kt0 + kt + 1, wkk, c, g, tok0, m)
                cute.arch.cp_async_wait_group(P - 2)  # this thread's copies of stage kt have landed
                cute.arch.sync_threads()  # everyone's have; and everyone is done with the slot refilled next
                nk = kt + P - 1
                if nk < ktiles:
                    self._issue_w(mW, sW, g2s, kt0 + nk, nk % P, tidx, row0, n)
                cute.arch.cp_async_commit_group()
                slot = kt % P
                for cc in cutlass.range_constexpr(CPW):
                    pos = ((wkk + cc * WK) * 4 + c) ^ flip  # this lane's W vector of the chunk (swizzled)
                    for i in cutlass.range_constexpr(2 * MT):
                        r = wrow * 16 * MT + (i // 2) * 16 + (i % 2) * 8 + g
                        cute.copy(s2r, self._vec(sW.iterator + ((slot * self.rows + r) * self.bk + pos * VEC)),
                                  rw[None, i])
                    for s in cutlass.range_constexpr(2):  # two k16 steps: vector elements 4s..4s+3
                        for i in cutlass.range_constexpr(MT):
                            for h in cutlass.range_constexpr(2):
                                fa[4 * h, i] = rw[4 * s + 2 * h, 2 * i]
                                fa[4 * h + 1, i] = rw[4 * s + 2 * h + 1, 2 * i]
                                fa[4 * h + 2, i] = rw[4 * s + 2 * h, 2 * i + 1]
                                fa[4 * h + 3, i] = rw[4 * s + 2 * h + 1, 2 * i + 1]
                        for j in cutlass.range_constexpr(NT):
                            for v in cutlass.range_constexpr(4):
                                fb[v, j] = rx[4 * s + v, cc, j]
                        cute.gemm(mma, acc, fa, fb, acc)
                for e in cutlass.range_constexpr(VEC * CPW * NT):
                    rx[e] = rn[e]
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

    return SplitKXregKernel
