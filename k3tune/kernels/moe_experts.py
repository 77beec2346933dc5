"""Grouped routed-expert GEMVs for decode in CuTe DSL (bf16 weights, fp32 accumulation), one launch per
projection over every selected expert:

``w13`` (+ SiTU): CTA (i, j) takes the i-th distinct selected expert and its j-th tile of ``rows`` intermediate
rows; it reads those gate rows and the matching up rows once and, for every token routed to the expert,
writes act[slot, r] = situ(x . gate_r, x . up_r) (bf16). ``w2``: CTA (i, j) takes the expert's j-th tile of
``rows`` latent rows and writes out[slot, r] = weight[slot] * (act[slot] . w2_r) (fp32, one row per slot);
the tokens' top-k slots are then summed in slot order (deterministic), outside this kernel.

Routing metadata, made by torch ops before the launches (static shapes, so the block captures in a CUDA
graph): ``experts`` [T] the distinct selected expert ids then -1 padding (T = tokens x top_k), ``starts``
[T + 1] each distinct expert's range of sorted slots, ``slot_token`` [T] and ``slot_weight`` [T]. A CTA whose
expert entry is padding does nothing.

Inside a CTA the warps stride over K in 16-byte vectors (``ld.global.nc.v4`` for weights); each lane loads
``unroll`` vectors of every row before its FMAs (no branch between a load and its use: the K tail is masked
arithmetically); lanes reduce with shuffles, warps through shared memory. Tokens go in chunks of ``tokens``
(a compile-time count; a chunk's missing tokens are clamped on load and masked on store).

Status: compiled on the CPU for sm_90a and sm_100a (tests/test_kernel_compile.py); numerics checked on a GPU
by tests/test_gpu_moe.py. Not yet offered to GPU sweeps (``backends``) until measured.
"""

import functools
import os
from dataclasses import dataclass

VEC = 8


@dataclass(frozen=True)
class ExpertKernelConfig:
    rows: int = 4  # intermediate (w13) or latent (w2) rows per CTA
    warps: int = 4
    tokens: int = 4  # tokens per chunk (accumulators: 2 x rows x tokens for w13)
    unroll: int = 2


def routing_metadata(top, weights, experts: int):
    """(experts [T], starts [T + 1], slot_token [T], slot_weight [T], order [T]) from top [B, k] and the
    routing weights [B, k]; torch ops only, no data-dependent shapes and no host synchronisation."""
    import torch

    b, k = top.shape
    n = b * k
    dev = top.device
    flat = top.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat.index_select(0, order).to(torch.int32)
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = sorted_e[1:] != sorted_e[:-1]
    rank = torch.cumsum(first.to(torch.int64), 0) - 1  # which distinct expert each sorted slot belongs to
    ids = torch.full((n + 1,), -1, dtype=torch.int32, device=dev)  # [n] is scratch for repeated experts
    ids.scatter_(0, torch.where(first, rank, torch.full_like(rank, n)), sorted_e)
    starts = torch.full((n + 2,), n, dtype=torch.int32, device=dev)  # [n + 1] is scratch
    starts.scatter_(0, torch.where(first, rank, torch.full_like(rank, n + 1)),
                    torch.arange(n, dtype=torch.int32, device=dev))
    slot_token = (order // k).to(torch.int32)
    slot_weight = weights.reshape(-1).float().index_select(0, order)
    return ids[:n].contiguous(), starts[: n + 1].contiguous(), slot_token, slot_weight.contiguous(), order


def current_arch() -> str:
    from k3tune.kernels.gemm_smallm import current_arch as arch

    return arch()


@functools.cache
def compiled(which: str, rows: int, warps: int, tokens: int, unroll: int, beta: float, linear_beta: float,
             arch: str):
    """Compile once per knob set and arch; every count and width is dynamic. Never call inside a capture."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch
    b, t, e, n, k = (cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int(),
                     cute.sym_int(divisibility=VEC))
    x = make_fake_compact_tensor(BFloat16, (b if which == "w13" else t, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (e, n, k), stride_order=(2, 1, 0), assumed_align=16)
    if which == "w13":
        out = make_fake_compact_tensor(BFloat16, (t, cute.sym_int()), stride_order=(1, 0), assumed_align=16)
    else:
        out = make_fake_compact_tensor(Float32, (t, n), stride_order=(1, 0), assumed_align=16)
    ids = make_fake_compact_tensor(Int32, (t,), assumed_align=4)
    starts = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
    tok = make_fake_compact_tensor(Int32, (t,), assumed_align=4)
    wt = make_fake_compact_tensor(Float32, (t,), assumed_align=4)
    kern = _kernel_class()(which, rows, warps, tokens, unroll, beta, linear_beta)
    return cute.compile(kern, x, w, out, ids, starts, tok, wt, make_fake_stream(), options=f"--gpu-arch {arch}")


def run_w13(cfg: ExpertKernelConfig, latent, w13, act, meta, beta: float, linear_beta: float, stream=None):
    """act[slot, :I] = situ(latent[token] . gate rows, latent[token] . up rows) for every routed slot."""
    fn = compiled("w13", cfg.rows, cfg.warps, cfg.tokens, cfg.unroll, beta, linear_beta, current_arch())
    fn(*_args(latent, w13, act, meta), _stream(stream))


def run_w2(cfg: ExpertKernelConfig, act, w2, out, meta, stream=None):
    """out[slot, :L] = weight[slot] * act[slot] . w2 rows (fp32) for every routed slot."""
    fn = compiled("w2", cfg.rows, cfg.warps, cfg.tokens, cfg.unroll, 0.0, 0.0, current_arch())
    fn(*_args(act, w2, out, meta), _stream(stream))


def _stream(stream):
    import torch
    from cuda.bindings import driver as cuda

    return cuda.CUstream((stream or torch.cuda.current_stream()).cuda_stream)


def _args(x, w, out, meta):
    from cutlass.cute.runtime import from_dlpack

    ids, starts, tok, wt = meta[:4]
    return (from_dlpack(x, assumed_align=16).mark_layout_dynamic(leading_dim=1),
            from_dlpack(w, assumed_align=16).mark_layout_dynamic(leading_dim=2),
            from_dlpack(out, assumed_align=16).mark_layout_dynamic(leading_dim=1),
            from_dlpack(ids, assumed_align=4).mark_layout_dynamic(),
            from_dlpack(starts, assumed_align=4).mark_layout_dynamic(),
            from_dlpack(tok, assumed_align=4).mark_layout_dynamic(),
            from_dlpack(wt, assumed_align=4).mark_layout_dynamic())


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32

    class GroupedExpertGemv:
        def __init__(self, which, rows, warps, tokens, unroll, beta, linear_beta):
            self.w13 = which == "w13"
            self.rows, self.warps, self.mt, self.unroll = rows, warps, tokens, unroll
            self.beta, self.lin = beta, linear_beta
            self.nrows = 2 * rows if self.w13 else rows  # weight rows a CTA reads: gate + up for w13

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mIds: cute.Tensor,
                     mStarts: cute.Tensor, mTok: cute.Tensor, mWt: cute.Tensor, stream: cuda.CUstream):
            t = mIds.shape[0]
            out_rows = mW.shape[1] // 2 if cutlass.const_expr(self.w13) else mW.shape[1]
            self.kernel(mX, mW, mOut, mIds, mStarts, mTok, mWt).launch(
                grid=(t, (out_rows + self.rows - 1) // self.rows, 1), block=(self.warps * 32, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mIds: cute.Tensor,
                   mStarts: cute.Tensor, mTok: cute.Tensor, mWt: cute.Tensor):
            R, NR, W, MT, U = self.rows, self.nrows, self.warps, self.mt, self.unroll
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            half = mW.shape[1] // 2
            out_rows = half if cutlass.const_expr(self.w13) else mW.shape[1]
            nvec = mW.shape[2] // VEC
            e = mIds[bidx]
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((W, NR * MT)), 16)
            if e >= 0:
                s0 = mStarts[bidx]
                s1 = mStarts[bidx + 1]
                gW = cute.zipped_divide(mW[e, None, None], (1, VEC))
                gX = cute.zipped_divide(mX, (1, VEC))
                w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                                             invariant=True)
                x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
                wrow = []
                for r in cutlass.range_constexpr(NR):  # gate rows, then (w13) the matching up rows
                    base = cutlass.min(bidy * R + (r % R), out_rows - 1)
                    wrow.append(base + half if cutlass.const_expr(self.w13 and r >= R) else base)
                acc = cute.make_rmem_tensor(cute.make_layout((NR, MT)), Float32)
                rw = cute.make_rmem_tensor(cute.make_layout((VEC, NR, U)), BFloat16)
                rx = cute.make_rmem_tensor(cute.make_layout((VEC, MT, U)), BFloat16)
                for c0 in cutlass.range(s0, s1, MT):
                    acc.fill(0.0)
                    rowx = []
                    for m in cutlass.range_constexpr(MT):
                        slot = cutlass.min(c0 + m, s1 - 1)
                        rowx.append(mTok[slot] if cutlass.const_expr(self.w13) else slot)
                    for v0 in cutlass.range(warp * 32 * U + lane, nvec, W * 32 * U):
                        for u in cutlass.range_constexpr(U):  # every load of the batch first
                            v = cutlass.min(v0 + u * 32, nvec - 1)
                            for r in cutlass.range_constexpr(NR):
                                cute.copy(w_atom, gW[(None, (wrow[r], v))], rw[None, r, u])
                            for m in cutlass.range_constexpr(MT):
                                cute.copy(x_atom, gX[(None, (rowx[m], v))], rx[None, m, u])
                        for u in cutlass.range_constexpr(U):
                            keep = cutlass.max(cutlass.min(nvec - (v0 + u * 32), 1), 0).to(Float32)
                            for m in cutlass.range_constexpr(MT):
                                xv = rx[None, m, u].load().to(Float32)
                                for r in cutlass.range_constexpr(NR):
                                    wv = rw[None, r, u].load().to(Float32)
                                    a = Float32(0.0)
                                    for j in cutlass.range_constexpr(VEC):
                                        a = a + wv[j] * xv[j]
                                    acc[r, m] = acc[r, m] + a * keep
                    for i in cutlass.range_constexpr(NR * MT):
                        val = cute.arch.warp_reduction_sum(acc[i % NR, i // NR])
                        if lane == 0:
                            red[warp, i] = val
                    cute.arch.sync_threads()
                    if tidx < R * MT:
                        r = tidx % R
                        m = tidx // R
                        row = bidy * R + r
                        if c0 + m < s1 and row < out_rows:
                            s = Float32(0.0)
                            for wi in cutlass.range_constexpr(W):
                                s = s + red[wi, m * NR + r]
                            if cutlass.const_expr(self.w13):
                                u = Float32(0.0)
                                for wi in cutlass.range_constexpr(W):
                                    u = u + red[wi, m * NR + R + r]
                                u = cutlass.max(cutlass.min(u, Float32(self.lin)), Float32(-self.lin))
                                gate_sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-Float32(self.beta) * s))
                                mOut[c0 + m, row] = (s * gate_sig * u).to(BFloat16)
                            else:
                                mOut[c0 + m, row] = s * mWt[c0 + m]
                    cute.arch.sync_threads()

    return GroupedExpertGemv
