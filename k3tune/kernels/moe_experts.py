"""The routed-expert part of K3's decode MoE block as three CuTe DSL kernels (bf16 weights, fp32 math), so
that the tuned block's critical path is a handful of launches instead of dozens of torch ops:

``route``: one warp per token: sigmoid of the router scores, top-k of score + correction bias (k rounds of
a warp argmax, ties to the lower expert id), weights = the chosen sigmoid scores renormalised x scaling.
``w13`` (+ SiTU): CTA (slot, j) for slot = token x k + choice: the j-th tile of ``rows`` intermediate rows of
the chosen expert, gate and up rows read once; act[slot, r] = situ(x . gate_r, x . up_r) (bf16).
``w2``: CTA (slot, j): the j-th tile of ``rows`` latent rows; out[slot, r] = weight[slot] * act[slot] . w2_r.
``sum_norm``: one CTA per token: the token's k slots summed in slot order (deterministic), times ``scale``
(where an emulated all-reduce lands), RMSNorm with the latent norm's weight, bf16 out.

One CTA per (token, choice) needs no per-expert token lists (no sort, no data-dependent shapes: the block
captures in a CUDA graph); an expert chosen by several tokens is read once per token, from L2 when those
CTAs run together (at decode most experts are chosen once: batch 64 x top-16 touches ~620 of 896).

Inside a GEMV CTA the warps stride over K in 16-byte vectors (``ld.global.nc.v4`` for weights); a lane
loads ``unroll`` vectors of every row before its FMAs (no branch between a load and its use: the K tail is
masked arithmetically); lanes reduce with shuffles, warps through shared memory.

Status: compiled on the CPU for sm_90a and sm_100a (tests/test_kernel_compile.py); numerics checked on a GPU
by tests/test_gpu_moe.py.
"""

import functools
import os
from dataclasses import dataclass

VEC = 8


@dataclass(frozen=True)
class ExpertKernelConfig:
    rows: int = 4  # intermediate (w13) or latent (w2) rows per CTA
    warps: int = 4
    unroll: int = 4  # 16-byte vectors per row a lane loads before its FMAs


def current_arch() -> str:
    from k3tune.kernels.gemm_smallm import current_arch as arch

    return arch()


NEG = -3.0e38


def _fake_args(kind: str, arch: str):
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    b, k, t = cute.sym_int(), cute.sym_int(), cute.sym_int()
    top = fake(Int32, (b, k), stride_order=(1, 0), assumed_align=4)
    wt = fake(Float32, (b, k), stride_order=(1, 0), assumed_align=4)
    if kind == "route":
        y = fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2)
        return y, fake(Float32, (cute.sym_int(),), assumed_align=4), top, wt
    if kind == "situ":
        return (fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2),
                fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2))
    if kind == "sum_norm":
        return (fake(Float32, (t, cute.sym_int(divisibility=4)), stride_order=(1, 0), assumed_align=16),
                fake(BFloat16, (cute.sym_int(),), assumed_align=2),
                fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2))
    n, kk = cute.sym_int(), cute.sym_int(divisibility=VEC)
    x = fake(BFloat16, (cute.sym_int(), kk), stride_order=(1, 0), assumed_align=16)
    w = fake(BFloat16, (cute.sym_int(), n, kk), stride_order=(2, 1, 0), assumed_align=16)
    out = (fake(BFloat16, (t, cute.sym_int()), stride_order=(1, 0), assumed_align=2) if kind == "w13"
           else fake(Float32, (t, n), stride_order=(1, 0), assumed_align=4))
    return x, w, out, top, wt


@functools.cache
def compiled(kind: str, knobs: tuple, arch: str):
    """One compile per kernel kind, knob tuple and arch; batch, widths and expert counts are dynamic.
    knobs: w13 (rows, warps, unroll, beta, linear_beta); w2 (rows, warps, unroll); route (experts, top_k,
    scaling, forced); sum_norm (top_k, eps); situ (beta, linear_beta). Never call inside a capture."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    classes = _kernel_classes()
    kern = classes[kind](*knobs)
    return cute.compile(kern, *_fake_args(kind, arch), make_fake_stream(), options=f"--gpu-arch {arch}")


def route(scores_and_latent, bias, top, weights, top_k: int, scaling: float, forced: bool = False, stream=None):
    """top [B, k] int32, weights [B, k] fp32 from the router scores (the first len(bias) columns).
    ``forced``: ``top`` already holds the experts (an imposed routing, for measurement); only the weights
    are computed, in the same single launch."""
    from k3tune.errors import ConfigError

    if not 0 < top_k <= 32:
        raise ConfigError(f"the route kernel keeps one choice per lane of a warp: top_k {top_k} is not in 1..32")
    fn = compiled("route", (bias.shape[0], top_k, float(scaling), forced), current_arch())
    fn(_t(scores_and_latent, 2), _t(bias, 4), _t(top, 4), _t(weights, 4), _stream(stream))


def run_w13(cfg: ExpertKernelConfig, latent, w13, act, top, weights, beta: float, linear_beta: float, stream=None):
    """act[slot, :I] = situ(latent[token] . gate rows, latent[token] . up rows) for slot = token x k + choice."""
    fn = compiled("w13", (cfg.rows, cfg.warps, cfg.unroll, float(beta), float(linear_beta)), current_arch())
    fn(_t(latent, 16), _t(w13, 16), _t(act, 2), _t(top, 4), _t(weights, 4), _stream(stream))


def run_w2(cfg: ExpertKernelConfig, act, w2, out, top, weights, stream=None):
    """out[slot, :L] = weight[slot] * act[slot] . w2 rows (fp32)."""
    fn = compiled("w2", (cfg.rows, cfg.warps, cfg.unroll), current_arch())
    fn(_t(act, 16), _t(w2, 16), _t(out, 4), _t(top, 4), _t(weights, 4), _stream(stream))


def sum_norm(per_slot, norm_weight, out, top_k: int, eps: float, stream=None):
    """out[b] = RMSNorm(sum_j per_slot[b k + j]) x norm_weight, bf16. RMSNorm(c x) = x / sqrt(mean(x^2) +
    eps / c^2): a caller whose sum is all-reduced by c identical ranks passes eps / c^2."""
    fn = compiled("sum_norm", (top_k, float(eps)), current_arch())
    fn(_t(per_slot, 16), _t(norm_weight, 2), _t(out, 2), _stream(stream))


def situ_rows(h, out, beta: float, linear_beta: float, stream=None):
    """out[b, i] = situ(h[b, i], h[b, n + i]) for h [B, 2n] (gate columns, then up columns), bf16."""
    fn = compiled("situ", (float(beta), float(linear_beta)), current_arch())
    fn(_t(h, 2), _t(out, 2), _stream(stream))


def _t(x, align: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(x, assumed_align=align).mark_layout_dynamic(leading_dim=x.dim() - 1)


def _stream(stream):
    import torch
    from cuda.bindings import driver as cuda

    return cuda.CUstream((stream or torch.cuda.current_stream()).cuda_stream)


@functools.cache
def _kernel_classes():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32

    class ExpertGemv:
        def __init__(self, which, rows, warps, unroll, beta=0.0, linear_beta=0.0):
            self.w13 = which == "w13"
            self.rows, self.warps, self.unroll = rows, warps, unroll
            self.beta, self.lin = beta, linear_beta
            self.nrows = 2 * rows if self.w13 else rows  # weight rows a CTA reads: gate + up for w13

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mTop: cute.Tensor,
                     mWt: cute.Tensor, stream: cuda.CUstream):
            slots = mTop.shape[0] * mTop.shape[1]
            out_rows = mW.shape[1] // 2 if cutlass.const_expr(self.w13) else mW.shape[1]
            self.kernel(mX, mW, mOut, mTop, mWt).launch(
                grid=(slots, (out_rows + self.rows - 1) // self.rows, 1), block=(self.warps * 32, 1, 1),
                stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mTop: cute.Tensor, mWt: cute.Tensor):
            R, NR, W, U = self.rows, self.nrows, self.warps, self.unroll
            tidx, _, _ = cute.arch.thread_idx()
            slot, bidy, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            k = mTop.shape[1]
            tok = slot // k
            e = mTop[tok, slot % k]
            half = mW.shape[1] // 2
            out_rows = half if cutlass.const_expr(self.w13) else mW.shape[1]
            nvec = mW.shape[2] // VEC
            xrow = tok if cutlass.const_expr(self.w13) else slot
            gW = cute.zipped_divide(mW[e, None, None], (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
            x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            wrow = []
            for r in cutlass.range_constexpr(NR):  # gate rows, then (w13) the matching up rows
                base = cutlass.min(bidy * R + (r % R), out_rows - 1)
                wrow.append(base + half if cutlass.const_expr(self.w13 and r >= R) else base)
            acc = cute.make_rmem_tensor(cute.make_layout(NR), Float32)
            acc.fill(0.0)
            rw = cute.make_rmem_tensor(cute.make_layout((VEC, NR, U)), BFloat16)
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, U)), BFloat16)
            for v0 in cutlass.range(warp * 32 * U + lane, nvec, W * 32 * U):
                for u in cutlass.range_constexpr(U):  # every load of the batch first
                    v = cutlass.min(v0 + u * 32, nvec - 1)
                    for r in cutlass.range_constexpr(NR):
                        cute.copy(w_atom, gW[(None, (wrow[r], v))], rw[None, r, u])
                    cute.copy(x_atom, gX[(None, (xrow, v))], rx[None, u])
                for u in cutlass.range_constexpr(U):
                    keep = cutlass.max(cutlass.min(nvec - (v0 + u * 32), 1), 0).to(Float32)
                    xv = rx[None, u].load().to(Float32)
                    for r in cutlass.range_constexpr(NR):
                        wv = rw[None, r, u].load().to(Float32)
                        a = Float32(0.0)
                        for j in cutlass.range_constexpr(VEC):
                            a = a + wv[j] * xv[j]
                        acc[r] = acc[r] + a * keep
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((W, NR)), 16)
            for r in cutlass.range_constexpr(NR):
                val = cute.arch.warp_reduction_sum(acc[r])
                if lane == 0:
                    red[warp, r] = val
            cute.arch.sync_threads()
            if tidx < R:
                row = bidy * R + tidx
                if row < out_rows:
                    s = Float32(0.0)
                    for wi in cutlass.range_constexpr(W):
                        s = s + red[wi, tidx]
                    if cutlass.const_expr(self.w13):
                        up = Float32(0.0)
                        for wi in cutlass.range_constexpr(W):
                            up = up + red[wi, R + tidx]
                        up = cutlass.max(cutlass.min(up, Float32(self.lin)), Float32(-self.lin))
                        gate_sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-Float32(self.beta) * s))
                        mOut[slot, row] = (s * gate_sig * up).to(BFloat16)
                    else:
                        mOut[slot, row] = s * mWt[tok, slot % k]

    class Route:
        def __init__(self, experts, top_k, scaling, forced=False):
            self.E, self.K, self.scaling, self.forced = experts, top_k, scaling, forced
            self.per = (experts + 31) // 32

        @cute.jit
        def __call__(self, mY: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor, mWt: cute.Tensor,
                     stream: cuda.CUstream):
            self.kernel(mY, mBias, mTop, mWt).launch(grid=(mTop.shape[0], 1, 1), block=(32, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mY: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor, mWt: cute.Tensor):
            lane, _, _ = cute.arch.thread_idx()
            b, _, _ = cute.arch.block_idx()
            if cutlass.const_expr(self.forced):
                s = Float32(0.0)
                if lane < self.K:
                    s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-mY[b, mTop[b, lane]].to(Float32)))
                total_f = cute.arch.warp_reduction_sum(s)
                if lane < self.K:
                    mWt[b, lane] = s * (Float32(self.scaling) / total_f)
                return
            vals = cute.make_rmem_tensor(cute.make_layout(self.per), Float32)
            sig = cute.make_rmem_tensor(cute.make_layout(self.per), Float32)
            for i in cutlass.range_constexpr(self.per):
                e = cutlass.min(lane + 32 * i, self.E - 1)
                s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-mY[b, e].to(Float32)))
                inside = cutlass.min(self.E - (lane + 32 * i), 1)  # 1 for a real expert, <= 0 past the end
                sig[i] = s
                vals[i] = s + mBias[e] if cutlass.const_expr(32 * (i + 1) <= self.E) else \
                    Float32(cutlass.select_(inside > 0, s + mBias[e], Float32(NEG)))
            total = Float32(0.0)
            my_w = Float32(0.0)  # lane r keeps the r-th choice: no lane reads another lane's stores
            my_id = Int32(0)
            for r in cutlass.range_constexpr(self.K):
                best = Float32(NEG)
                for i in cutlass.range_constexpr(self.per):
                    best = cute.arch.fmax(best, vals[i])
                best = cute.arch.warp_reduction_max(best)
                idx = Int32(1 << 30)
                for i in cutlass.range_constexpr(self.per):  # the lowest expert id holding the best score
                    idx = cutlass.min(idx, Int32(cutlass.select_(vals[i] == best, lane + 32 * i, Int32(1 << 30))))
                idx = cute.arch.warp_reduction(idx, lambda x, y: cutlass.min(x, y))
                chosen = Float32(0.0)
                for i in cutlass.range_constexpr(self.per):
                    hit = lane + 32 * i == idx
                    chosen = chosen + Float32(cutlass.select_(hit, sig[i], Float32(0.0)))
                    vals[i] = Float32(cutlass.select_(hit, Float32(NEG), vals[i]))
                chosen = cute.arch.warp_reduction_sum(chosen)
                total = total + chosen
                my_w = Float32(cutlass.select_(lane == r, chosen, my_w))
                my_id = Int32(cutlass.select_(lane == r, idx, my_id))
            if lane < self.K:
                mTop[b, lane] = my_id
                mWt[b, lane] = my_w * (Float32(self.scaling) / total)

    class SumNorm:
        THREADS = 256

        def __init__(self, top_k, eps):
            self.K, self.eps = top_k, eps

        @cute.jit
        def __call__(self, mP: cute.Tensor, mG: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
            self.kernel(mP, mG, mOut).launch(grid=(mOut.shape[0], 1, 1), block=(self.THREADS, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mP: cute.Tensor, mG: cute.Tensor, mOut: cute.Tensor):
            T = self.THREADS
            tidx, _, _ = cute.arch.thread_idx()
            b, _, _ = cute.arch.block_idx()
            n = mOut.shape[1]
            sq = Float32(0.0)
            for c in cutlass.range(tidx, n, T):  # first pass: the sum over slots, and its square
                s = Float32(0.0)
                for j in cutlass.range_constexpr(self.K):
                    s = s + mP[b * self.K + j, c]
                sq = sq + s * s
            sq = cute.arch.warp_reduction_sum(sq)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(T // 32), 16)
            if tidx % 32 == 0:
                red[tidx // 32] = sq
            cute.arch.sync_threads()
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(T // 32):
                tot = tot + red[w]
            inv = cute.math.rsqrt(tot / n.to(Float32) + Float32(self.eps))
            for c in cutlass.range(tidx, n, T):  # second pass (the slots are in L1/L2 now)
                s = Float32(0.0)
                for j in cutlass.range_constexpr(self.K):
                    s = s + mP[b * self.K + j, c]
                mOut[b, c] = (s * inv * mG[c].to(Float32)).to(BFloat16)

    class Situ:
        THREADS = 256

        def __init__(self, beta, linear_beta):
            self.beta, self.lin = beta, linear_beta

        @cute.jit
        def __call__(self, mH: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
            n = mOut.shape[1]
            self.kernel(mH, mOut).launch(grid=(mOut.shape[0], (n + self.THREADS - 1) // self.THREADS, 1),
                                         block=(self.THREADS, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mH: cute.Tensor, mOut: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            b, j, _ = cute.arch.block_idx()
            n = mOut.shape[1]
            i = j * self.THREADS + tidx
            if i < n:
                g = mH[b, i].to(Float32)
                u = cutlass.max(cutlass.min(mH[b, n + i].to(Float32), Float32(self.lin)), Float32(-self.lin))
                mOut[b, i] = (g / (Float32(1.0) + cute.math.exp(-Float32(self.beta) * g)) * u).to(BFloat16)

    return {"w13": lambda *k: ExpertGemv("w13", *k), "w2": lambda *k: ExpertGemv("w2", *k), "route": Route,
            "sum_norm": SumNorm, "situ": Situ}
