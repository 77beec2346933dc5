"""Grouped routed-expert w13 for MXFP4 experts on Hopper's ``wgmma`` (CuTe DSL, sm_90a only): the codes decoded in
registers to e4m3 and fed to ``wgmma m64n8k32`` e4m3 with A from registers, the activations as e4m3 hi + lo.

Staged, not yet a block knob: the block executor (runtime/moe.py) does not call it; ``bench/moe_wg_ab.py`` times it
beside ``moe_experts_tc.run_w13`` on the same routing. Why it exists: the dense prototype of this decode
(``bench/wgmma_e4m3_proto.py``, NOTES session 34) reached 0.77 of the HBM roofline where the shipped MXFP4 w13
(bf16 ``mma.sync`` after an integer decode) reached 0.60 on the same bytes.

Same contract as ``moe_experts_tc.run_w13``: ``act[slot, :I] = situ(x_tok . gate rows, x_tok . up rows)`` over the
route kernel's ``Groups``, work items of at most 8 slots of one expert (``Groups.per`` = 8).

- An E2M1 nibble ``s e1 e0 m`` as the e4m3 byte ``s 0 0 e1 e0 m 0 0`` reads as its value x 2^-6 (exact, subnormals
  included); the 2^6 and the token's activation scale are applied in the epilogue.
- Weights (``pack_w13``): per expert, 64-row tiles (gate tiles, then up tiles) x 64-K steps, each a 2560-byte blob
  (``bench/wgmma_e4m3_proto.pack``: thread ``tid``'s 4 code words at words 4 tid .., its scale word at 512 + tid, laid
  out for the m64k32 8-bit A fragment). ``stage_steps`` consecutive blobs of the gate tile and of its up tile make one
  stage of a TMA ring of ``stages`` stages, refilled by warp 0 one stage behind the consumers.
- Activations (``quantize_into``, a kernel: one CTA a token; ``quantize`` is its torch reference): per token,
  x / s with s = amax / 448 as e4m3 hi and e4m3 lo = x / s - hi, then gathered per item into the wgmma B layout in
  shared memory by cp.async (the 128-byte swizzle of that layout computed by hand and checked against it on the
  CPU). s34-r6 quantised in the w13 kernel itself instead (each CTA its item's rows, two passes): 10-20% slower.
- A CTA is one work item and ``rows`` 64-row tiles of gate, each with its up tile (4 warps: rows 16 w + g and
  16 w + g + 8 of a tile), one after the other, the ring running on across them. Per 32-K block: 4 wgmmas (gate and
  up, x hi then lo accumulated into the same temporary), then ``acc += 2^(e - 127) x tmp``; two sets of
  ``stage_steps`` steps an iteration, so one set's wgmmas overlap the other's decode and scaled adds.

Status: compiles on the CPU for sm_90a (tests/test_moe_wg.py); refuses other architectures (no wgmma e4m3 with A from
registers on sm_100a: tcgen05 is Blackwell's path). GPU numerics pass on the H200 (tests/test_gpu_moe_wg.py, s34-r7).
Speed against the shipped w13 (bench/moe_wg_ab.py, s34-r7, quantize kernel included): 0.94x in geometric mean over
TP8/TP16 b1-64, uniform and Zipf; 1.06-1.10x at TP8 b32/b64 and TP16 b16 uniform, 0.65-0.77x at b1 (few CTAs: 6 an
expert at TP8). Not wired into the block: see NOTES session 34 for what would make it pay.
"""

import functools
import os
from dataclasses import dataclass

from k3tune.kernels.gemm_smallm import current_arch

TOKENS = 8  # tokens a work item: wgmma N
BLOB = 640  # 32-bit words per (64-row tile, 64-K step): 512 code words + 128 scale words
LO_MASK, HI_SHL, HI_SHR = 0x9C9C9C9C, 0x8C8C8C8C, 0x10101010
LO_BITS, HI_BITS = (2, 3, 4, 7), (0, 1, 6, 5)  # byte bit of nibble bit m, e0, e1, s: row g's code, row g + 8's
E4M3_MAX = 448.0


@dataclass(frozen=True)
class WgExpertConfig:
    stages: int = 4  # TMA ring stages
    stage_steps: int = 2  # 64-K steps a stage (and a set of wgmmas)
    rows: int = 1  # 64-row tiles (each gate tile with its up tile) a CTA computes one after the other: the item's
    #                tokens gathered and quantised once for them, the ring running on across them


@dataclass(frozen=True)
class WgPacked:
    """MXFP4 w13 in the blob layout (``pack_w13``): int32 [E x 2I/64 x K/64 x 10, 64]."""
    data: object
    experts: int
    rows: int  # 2I
    k: int


def check(cfg: WgExpertConfig, k: int, inter: int, arch: str) -> None:
    from k3tune.errors import CannotImplement

    if arch != "sm_90a":
        raise CannotImplement(f"moe_experts_wg: wgmma e4m3 with A from registers is sm_90a only, not {arch}")
    steps = k // 64
    if k % 128 or inter % 64:
        raise CannotImplement(f"moe_experts_wg: K = {k} must be a multiple of 128 and I = {inter} of 64")
    if cfg.stages < 2 or cfg.stage_steps < 1 or cfg.rows < 1 or steps % (2 * cfg.stage_steps):
        raise CannotImplement(f"moe_experts_wg: {cfg} does not divide K = {k} into pairs of stages")
    if smem_bytes(cfg, k) > 227 * 1024:
        raise CannotImplement(f"moe_experts_wg: {cfg} at K = {k} needs {smem_bytes(cfg, k)} B of shared memory")


def smem_bytes(cfg: WgExpertConfig, k: int) -> int:
    return 2 * TOKENS * k + cfg.stages * 2 * cfg.stage_steps * BLOB * 4 + 2048


def pack_blobs(codes, scales):
    """K3's MXFP4 (codes uint8 [R, K/2], even K in the low nibble; scales uint8 [R, K/32]), R % 64 == K % 64 == 0
    -> int32 [R/64 x K/64 x 10, 64]: the blobs, tile-major then step (any device; torch)."""
    import torch

    from k3tune.errors import ConfigError

    n, k = codes.shape[0], codes.shape[1] * 2
    if n % 64 or k % 64 or tuple(scales.shape) != (n, k // 32):
        raise ConfigError(f"wgmma MXFP4 blobs: expected codes [R, K/2] and scales [R, K/32] with R and K multiples "
                          f"of 64, got {tuple(codes.shape)} and {tuple(scales.shape)}")
    nib = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(n, k).to(torch.int64)
    # rows n = 64 c + 16 w + 8 r + g; K = 64 s + 32 b + 16 h + 4 t + i
    nib = nib.reshape(n // 64, 4, 2, 8, k // 64, 2, 2, 4, 4).permute(0, 1, 3, 4, 5, 6, 7, 2, 8)
    words = 0  # [c, w, g, s, b, h, t]
    for q in range(4):  # nibble bit q of each code to its byte bit
        pos = torch.tensor([[8 * i + (LO_BITS if r == 0 else HI_BITS)[q] for i in range(4)] for r in range(2)],
                           device=codes.device)  # [r, i]
        words = words + (((nib >> q) & 1) << pos).sum(dim=(-2, -1))
    words = words.permute(0, 3, 1, 2, 6, 4, 5).reshape(n // 64, k // 64, 512)  # [c, s, tid x (2 b + h)]
    sc = scales.reshape(n // 64, 4, 2, 8, k // 64, 2).to(torch.int64)  # [c, w, r, g, s, b]
    sc = sc.permute(0, 4, 1, 3, 5, 2)[:, :, :, :, None].expand(-1, -1, -1, -1, 4, -1, -1)  # [c, s, w, g, t, b, r]
    sw = (sc.reshape(n // 64, k // 64, 128, 4) << (8 * torch.arange(4, device=codes.device))).sum(-1)
    blob = torch.cat((words, sw), dim=-1)  # [c, s, 640] in [0, 2^32)
    return torch.where(blob >= 1 << 31, blob - (1 << 32), blob).to(torch.int32).reshape(-1, 64)


def pack_w13(codes, scales, chunk_rows: int = 1 << 13) -> WgPacked:
    """MXFP4 w13 (codes uint8 [E, 2I, K/2], scales uint8 [E, 2I, K/32]) in the kernel's layout; ``chunk_rows`` rows
    at a time (the packing's int64 temporaries are ~40 bytes a code)."""
    import torch

    e, rows, half_k = codes.shape
    c, s = codes.reshape(e * rows, half_k), scales.reshape(e * rows, -1)
    step = max(64, chunk_rows // 64 * 64)
    data = torch.cat([pack_blobs(c[i:i + step], s[i:i + step]) for i in range(0, e * rows, step)])
    return WgPacked(data, e, rows, 2 * half_k)


def quantize(x):
    """Activations bf16/fp32 [T, K] -> (e4m3 hi and lo as uint8 [T, 2, K], fp32 scale [T]), x ~ (hi + lo) x scale."""
    import torch

    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(2.0 ** -100) / E4M3_MAX
    a = x / scale[:, None]
    hi = a.to(torch.float8_e4m3fn)
    lo = (a - hi.float()).to(torch.float8_e4m3fn)
    return torch.stack((hi, lo), dim=1).view(torch.uint8), scale


def quantize_into(latent, xq, xs, stream=None):
    """``quantize`` as a kernel, into the caller's buffers: ``latent`` bf16 [T, K] -> ``xq`` uint8 [T, 2, K] (e4m3 hi,
    lo), ``xs`` fp32 [T]."""
    from cutlass.cute.runtime import from_dlpack

    from k3tune.kernels.moe_experts import _stream, _t

    _expect(latent, "latent", (latent.shape[0], latent.shape[1]), "bfloat16")
    _expect(xq, "xq", (latent.shape[0], 2, latent.shape[1]), "uint8")
    _expect(xs, "xs", (latent.shape[0],), "float32")
    fn = compiled_quantize(latent.shape[1], current_arch())
    fn(from_dlpack(latent, assumed_align=16).mark_compact_shape_dynamic(mode=0), _xq(xq), _t(xs, 4), _stream(stream))


def run_w13(cfg: WgExpertConfig, xq, xs, w13: WgPacked, act, groups, beta: float, linear_beta: float,
            stream=None):
    """act[slot, :I] = situ(x_tok . gate rows, x_tok . up rows) over ``groups``' work items (``groups.per`` = 8);
    ``xq``/``xs``: the activations as ``quantize_into`` leaves them; ``w13`` from ``pack_w13``."""
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    from k3tune.errors import ConfigError
    from k3tune.kernels.moe_experts import _groups, _stream, _t

    if groups.per != TOKENS:
        raise ConfigError(f"moe_experts_wg: work items of {TOKENS} tokens, got groups of {groups.per}")
    t, inter = xq.shape[0], w13.rows // 2
    _expect(xq, "xq", (t, 2, w13.k), "uint8")
    _expect(xs, "xs", (t,), "float32")
    _expect(act, "act", (groups.items.shape[0], inter), "bfloat16")
    check(cfg, w13.k, inter, current_arch())
    fn = compiled(cfg.stages, cfg.stage_steps, cfg.rows, w13.k, float(beta), float(linear_beta), current_arch())
    top_k = groups.items.shape[0] // xq.shape[0]
    fn(_xq(xq), _t(xs, 4), from_dlpack(w13.data, assumed_align=16).mark_compact_shape_dynamic(mode=0, divisibility=10),
       _t(act, 2), *_groups(groups), Int32(top_k), Int32(w13.rows // 2), _stream(stream))


def _expect(x, name: str, shape: tuple, dtype: str) -> None:
    """A contiguous tensor of this shape and dtype, or a one-line ConfigError (never a misread)."""
    from k3tune.errors import ConfigError

    if tuple(x.shape) != tuple(shape) or str(x.dtype) != f"torch.{dtype}" or not x.is_contiguous():
        raise ConfigError(f"moe_experts_wg: {name} must be a contiguous {dtype} {tuple(shape)}, got "
                          f"{str(x.dtype).removeprefix('torch.')} {tuple(x.shape)}")


def _xq(xq):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(xq, assumed_align=16).mark_compact_shape_dynamic(mode=0)


def _fake_xq(k: int):
    import cutlass.cute as cute
    from cutlass import Uint8
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    return fake(Uint8, (cute.sym_int(), 2, k), stride_order=(2, 1, 0), assumed_align=16)


@functools.cache
def compiled(stages: int, stage_steps: int, rows: int, k: int, beta: float, linear_beta: float, arch: str):
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor as fake
    from cutlass.cute.runtime import make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch
    args = (_fake_xq(k), fake(Float32, (cute.sym_int(),), assumed_align=4),
            fake(Int32, (cute.sym_int(divisibility=10), 64), stride_order=(1, 0), assumed_align=16),
            fake(BFloat16, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=2),
            fake(Int32, (cute.sym_int(),), assumed_align=4), fake(Int32, (cute.sym_int(),), assumed_align=4),
            fake(Int32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=4),
            Int32(16), Int32(384), make_fake_stream())
    return cute.compile(_kernel_class()[0](stages, stage_steps, rows, k, beta, linear_beta), *args,
                        options=f"--gpu-arch {arch}")


@functools.cache
def compiled_quantize(k: int, arch: str):
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from cutlass.cute.runtime import make_fake_compact_tensor as fake
    from cutlass.cute.runtime import make_fake_stream

    from k3tune.errors import CannotImplement

    if k % 16:
        raise CannotImplement(f"moe_experts_wg.quantize_into: K = {k} must be a multiple of 16")
    os.environ["CUTE_DSL_ARCH"] = arch
    t = cute.sym_int()
    args = (fake(BFloat16, (t, k), stride_order=(1, 0), assumed_align=16), _fake_xq(k),
            fake(Float32, (t,), assumed_align=4), make_fake_stream())
    return cute.compile(_kernel_class()[1](k), *args, options=f"--gpu-arch {arch}")


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Float8E4M3FN, Int32, Uint8, Uint32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    from k3tune.kernels.moe_experts import ITEM_SHIFT

    T = TOKENS

    class WgW13:
        def __init__(self, stages, stage_steps, rows, k, beta, linear_beta):
            self.S, self.R, self.rows, self.k = stages, stage_steps, rows, k
            self.ks, self.xst = k // 64, k // 128
            self.beta, self.lin = beta, linear_beta

        @cute.jit
        def __call__(self, mXq: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mAct: cute.Tensor,
                     mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor, top_k: Int32, inter: Int32,
                     stream: cuda.CUstream):
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                Float8E4M3FN, Float8E4M3FN, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
                (1, 1, 1), tiler_mn=(64, T), a_source=warpgroup.OperandSource.RMEM)
            x_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, T, 128), Float8E4M3FN, self.xst)
            w_one = cute.make_layout((10 * self.R, 64), stride=(64, 1))
            tma_w, tW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW, w_one, (10 * self.R, 64))

            @cute.struct
            class Storage:
                wbars: cute.struct.MemRange[cutlass.Int64, self.S * 2]
                sXh: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(x_staged)], 1024]
                sXl: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(x_staged)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[Int32, 2 * BLOB * self.R * self.S], 128]

            self.storage = Storage
            groups_y = (inter // 64 + self.rows - 1) // self.rows
            self.kernel(mXq, mXs, tma_w, tW, mAct, mCnt, mItems, mSlots, top_k, inter, tiled_mma, x_staged).launch(
                grid=(mItems.shape[0], groups_y, 1), block=[128, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mXq: cute.Tensor, mXs: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor, mAct: cute.Tensor,
                   mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor, top_k: Int32, inter: Int32,
                   tiled_mma: cute.TiledMma, x_staged: cute.ComposedLayout):
            S, R, KS = self.S, self.R, self.ks
            NST = KS // R  # ring stages a row tile runs through
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            n_experts = mCnt.shape[0] - 1
            width = mSlots.shape[1]
            if bidx < mCnt[n_experts]:  # one work item a CTA; CTAs past the items exit
                code = mItems[bidx]
                ex = code >> ITEM_SHIFT
                t0 = code & ((1 << ITEM_SHIFT) - 1)
                ntok = mCnt[ex] - t0
                tiles_h = inter // 64  # gate tiles an expert (as many up tiles follow them)
                rt0 = bidy * self.rows
                ntiles = cutlass.min(self.rows, tiles_h - rt0)  # this CTA's row tiles, one after the other
                total = ntiles * NST  # ring stages of this CTA
                if warp == 0:
                    cpasync.prefetch_descriptor(tma_w)
                smem = cutlass.memory.SmemAllocator()
                st = smem.allocate(self.storage)
                wpipe = pipeline.PipelineTmaAsync.create(
                    barrier_storage=st.wbars.data_ptr(), num_stages=S,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
                    tx_count=2 * BLOB * 4 * R, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
                # the ring: per stage R gate blobs, then R up blobs
                sWt = st.sW.get_tensor(cute.make_layout((10 * R, 64, 2, S), stride=(64, 1, BLOB * R, 2 * BLOB * R)))
                sQ = st.sW.get_tensor(cute.make_layout((4, R * BLOB // 4, 2, S),
                                                       stride=(1, 4, BLOB * R, 2 * BLOB * R)))
                gW = cute.local_tile(mW, (10 * R, 64), (None, 0))
                tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sWt, 0, 2),
                                                 cute.group_modes(gW, 0, 2))
                wbase = ex * 2 * tiles_h * NST  # the expert's first blob stage

                if warp == 0:  # the ring's first S - 1 stages
                    for j in cutlass.range_constexpr(S - 1):
                        if j < total:
                            self._load(tma_w, tWg, tWs, wpipe, j, wbase, rt0, tiles_h)

                self._gather(mXq, mSlots, st, ex, t0, ntok, width, top_k, tidx)

                sXh = st.sXh.get_tensor(x_staged.outer, swizzle=x_staged.inner)
                sXl = st.sXl.get_tensor(x_staged.outer, swizzle=x_staged.inner)
                thr_mma = tiled_mma.get_slice(tidx)
                tBh = tiled_mma.make_fragment_B(thr_mma.partition_B(sXh))  # (mma, n, k blocks of 32, x stage)
                tBl = tiled_mma.make_fragment_B(thr_mma.partition_B(sXl))
                tCcA = thr_mma.partition_A(cute.make_identity_tensor((64, 32)))
                tCcC = thr_mma.partition_C(cute.make_identity_tensor((64, T)))
                nacc = cute.size(tCcC.shape)
                acc = [cute.make_rmem_tensor(tCcC.shape, Float32) for _ in range(2)]  # gate, up
                # per set, step r, block b and gate/up m: the A registers and the temporary of one wgmma pair
                a_regs = [[[[cute.make_rmem_tensor(tCcA.shape, Float8E4M3FN) for m in range(2)] for b in range(2)]
                           for r in range(R)] for _ in range(2)]
                tmps = [[[[cute.make_rmem_tensor(tCcC.shape, Float32) for m in range(2)] for b in range(2)]
                         for r in range(R)] for _ in range(2)]
                scw = cute.make_rmem_tensor((2, R, 2), Uint32)
                bits = cute.make_rmem_tensor((2,), Uint32)
                fbits = cute.recast_tensor(bits, Float32)
                cw = cute.make_rmem_tensor(cute.make_layout((4, R, 2)), Int32)  # a stage's code words
                cwu = cute.recast_tensor(cw, Uint32)

                for q in cutlass.range(ntiles, unroll=1):
                    acc[0].fill(0.0)
                    acc[1].fill(0.0)
                    for it in cutlass.range(0, NST, 2, unroll=1):  # two ring stages (sets) an iteration
                        for half in cutlass.range_constexpr(2):
                            gs = q * NST + it + half
                            if warp == 0:  # refill the slot stage gs - 1 freed with stage gs + S - 1
                                if gs + S - 1 < total:
                                    self._load(tma_w, tWg, tWs, wpipe, gs + S - 1, wbase, rt0, tiles_h)
                            cs = pipeline.PipelineState(S, gs, gs % S, (gs // S) % 2)
                            wpipe.consumer_wait(cs)
                            for m in cutlass.range_constexpr(2):
                                for r in cutlass.range_constexpr(R):
                                    cute.autovec_copy(sQ[None, r * (BLOB // 4) + tidx, m, gs % S], cw[None, r, m])
                                    scw[half, r, m] = Uint32(
                                        sQ[tidx % 4, r * (BLOB // 4) + 128 + tidx // 4, m, gs % S])
                            wpipe.consumer_release(cs)
                            for r in cutlass.range_constexpr(R):
                                for b in cutlass.range_constexpr(2):
                                    for m in cutlass.range_constexpr(2):
                                        aw = cute.recast_tensor(a_regs[half][r][b][m], Uint32)
                                        for h in cutlass.range_constexpr(2):
                                            w = cwu[2 * b + h, r, m]
                                            aw[2 * h] = w & Uint32(LO_MASK)
                                            aw[2 * h + 1] = (((w << Uint32(2)) & Uint32(HI_SHL)) |
                                                             ((w >> Uint32(2)) & Uint32(HI_SHR)))
                            warpgroup.fence()
                            for r in cutlass.range_constexpr(R):
                                step = (it + half) * R + r  # the 64-K step within the row tile
                                for b in cutlass.range_constexpr(2):
                                    kb = ((half * R + r) % 2) * 2 + b  # the 32-K block within the 128-K x stage
                                    for m in cutlass.range_constexpr(2):
                                        a = a_regs[half][r][b][m][None, None, 0]
                                        tmp = tmps[half][r][b][m]
                                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                                        cute.gemm(tiled_mma, tmp, a, tBh[None, None, kb, step // 2], tmp)
                                        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                                        cute.gemm(tiled_mma, tmp, a, tBl[None, None, kb, step // 2], tmp)
                            warpgroup.commit_group()
                        for half in cutlass.range_constexpr(2):
                            warpgroup.wait_group(1 - half)  # set 0 done while set 1 runs; then set 1
                            for r in cutlass.range_constexpr(R):
                                for m in cutlass.range_constexpr(2):
                                    sc = scw[half, r, m]
                                    for b in cutlass.range_constexpr(2):
                                        for row in cutlass.range_constexpr(2):
                                            jb = 2 * b + row  # e8m0 byte jb as an fp32 exponent field
                                            if cutlass.const_expr(jb == 3):
                                                bits[row] = (sc >> Uint32(1)) & Uint32(0x7F800000)
                                            else:
                                                bits[row] = (sc << Uint32(23 - 8 * jb)) & Uint32(0x7F800000)
                                        tmp = tmps[half][r][b][m]
                                        for i in cutlass.range_constexpr(nacc):
                                            acc[m][i] = acc[m][i] + fbits[(i // 2) % 2] * tmp[i]

                    for i in cutlass.range_constexpr(nacc):  # (row, token) of accumulator i
                        rc = tCcC[i]
                        if rc[1] < ntok:
                            sl = mSlots[ex, t0 + rc[1]]
                            s = mXs[sl // top_k] * Float32(64.0)  # the token's scale and the decode's 2^-6
                            gate = acc[0][i] * s
                            up = cutlass.max(cutlass.min(acc[1][i] * s, Float32(self.lin)), Float32(-self.lin))
                            sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-Float32(self.beta) * gate))
                            mAct[sl, (rt0 + q) * 64 + rc[0]] = (gate * sig * up).to(BFloat16)

        @cute.jit
        def _load(self, tma_w, tWg, tWs, wpipe, gs, wbase, rt0, tiles_h):
            """Ring stage ``gs`` of this CTA (row tile rt0 + gs // NST, its stage gs % NST): the gate blobs, then the
            up blobs, on one barrier."""
            S, NST = self.S, self.ks // self.R
            ps = pipeline.PipelineState(S, gs, gs % S, (gs // S + 1) % 2)
            wpipe.producer_acquire(ps)
            at = wbase + (rt0 + gs // NST) * NST + gs % NST
            cute.copy(tma_w, tWg[(None, at)], tWs[(None, 0, gs % S)], tma_bar_ptr=wpipe.producer_get_barrier(ps))
            cute.copy(tma_w, tWg[(None, at + tiles_h * NST)], tWs[(None, 1, gs % S)],
                      tma_bar_ptr=wpipe.producer_get_barrier(ps))

        @cute.jit
        def _gather(self, mXq, mSlots, st, ex, t0, ntok, width, top_k, tidx):
            """The item's tokens (``quantize_into``'s e4m3 hi and lo rows) into the wgmma B layout by cp.async: 16
            threads a token row (rows past the item repeat its last token), 16 bytes a unit; the 128-byte swizzle: unit
            u of row j of a 128-K stage at 16 (u ^ (j % 8))."""
            j = tidx // 16
            slot = mSlots[ex, cutlass.min(t0 + cutlass.min(j, ntok - 1), width - 1)]
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Uint8,
                                      num_bits_per_copy=128)
            bases = [st.sXh.data_ptr(), st.sXl.data_ptr()]
            units = self.k // 16
            for xh in cutlass.range_constexpr(2):
                xrow = mXq[slot // top_k, xh, None]
                for xi in cutlass.range_constexpr((units + 15) // 16):
                    u = tidx % 16 + 16 * xi
                    if cutlass.const_expr((xi + 1) * 16 <= units) or u < units:
                        off = (u // 8) * (T * 128) + j * 128 + (((u % 8) ^ (j % 8)) * 16)
                        cute.copy(g2s, cute.make_tensor((xrow.iterator + u * 16).align(16), cute.make_layout(16)),
                                  cute.make_tensor(cute.recast_ptr(bases[xh] + off, dtype=Uint8).align(16),
                                                   cute.make_layout(16)))
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy writes, read by the wgmmas
            cute.arch.sync_threads()

    class Quantize:
        """``quantize`` as a kernel: one CTA of 128 threads a token, 16 values a unit, the row's amax by shuffles and
        shared memory, then hi and lo (16-byte stores) and the token's scale."""

        def __init__(self, k):
            self.k = k

        @cute.jit
        def __call__(self, mX: cute.Tensor, mXq: cute.Tensor, mXs: cute.Tensor, stream: cuda.CUstream):
            self.kernel(mX, mXq, mXs).launch(grid=(mX.shape[0], 1, 1), block=[128, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mXq: cute.Tensor, mXs: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            t, _, _ = cute.arch.block_idx()
            units = self.k // 16
            per = (units + 127) // 128
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(4), 16)
            v = [cute.make_rmem_tensor((16,), BFloat16) for _ in range(per)]
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(per):
                u = tidx + 128 * i
                if cutlass.const_expr((i + 1) * 128 <= units) or u < units:
                    cute.autovec_copy(cute.make_tensor((mX[t, None].iterator + u * 16).align(16),
                                                       cute.make_layout(16)), v[i])
                    for e in cutlass.range_constexpr(16):
                        f = v[i][e].to(Float32)
                        amax = cutlass.max(amax, cutlass.max(f, -f))
            for sh in (16, 8, 4, 2, 1):
                amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=sh))
            if tidx % 32 == 0:
                red[tidx // 32] = amax
            cute.arch.sync_threads()
            amax = cutlass.max(cutlass.max(red[0], red[1]), cutlass.max(red[2], red[3]))
            amax = cutlass.max(amax, Float32(2.0 ** -100))
            inv = Float32(E4M3_MAX) / amax
            if tidx == 0:
                mXs[t] = amax / Float32(E4M3_MAX)
            hi = cute.make_rmem_tensor((16,), Float8E4M3FN)
            lo = cute.make_rmem_tensor((16,), Float8E4M3FN)
            for i in cutlass.range_constexpr(per):
                u = tidx + 128 * i
                if cutlass.const_expr((i + 1) * 128 <= units) or u < units:
                    a = v[i].load().to(Float32) * inv
                    h8 = a.to(Float8E4M3FN)
                    hi.store(h8)
                    lo.store((a - h8.to(Float32)).to(Float8E4M3FN))
                    for xh, r in ((0, hi), (1, lo)):
                        cute.autovec_copy(cute.recast_tensor(r, Uint8), cute.make_tensor(
                            (mXq[t, xh, None].iterator + u * 16).align(16), cute.make_layout(16)))

    return WgW13, Quantize
