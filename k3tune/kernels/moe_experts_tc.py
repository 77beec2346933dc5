"""Grouped routed-expert projections on tensor cores (CuTe DSL, warp-level ``mma.sync.m16n8k16``, fp32
accumulation), for bf16 experts and for MXFP4 experts dequantised in registers (Hopper has no FP4 tensor
cores). The CUDA-core kernels of ``moe_experts`` issue one FMA per weight and token; here a work item of up
to 8 x ``n_tiles`` tokens of one expert costs one MMA per 16 rows x 16 K x 8 tokens, so an expert shared
by many tokens (large batches, skewed routing) is read once at the cost of one.

Same contract as ``moe_experts.run_w13`` / ``run_w2``: work items and slot lists come from the route kernel's
``Groups``; ``act[slot] = situ(x_tok . gate, x_tok . up)`` and ``out[slot] = weight[slot] * act[slot] . w2``.

Swap-AB: weight rows fill the MMA's M (16 per tile), the item's tokens its N (8 per tile). A warp owns
``m_tiles`` row tiles (w13: each gate tile with its up tile, so SiTU pairs meet in one lane's accumulators);
``warps_n`` warps own different row tiles, ``warps_k`` warps split K and are reduced through shared memory in
warp order (deterministic).

Operands go straight from global memory to registers in 16-byte vectors, with a K permutation shared by both
operands (the products are unchanged): bf16 — lane ``t`` loads 8 weights at ``32 j + 8 (t % 4)`` of rows
``t // 4`` and ``t // 4 + 8``, and 8 activations of token ``t // 4`` at the same K. MXFP4 — lane ``t`` loads 16
bytes = 32 codes = one scale block (``128 j + 32 (t % 4)``) of each row; a code pair (nibble i, nibble i + 4)
of a 32-bit word becomes a bf16x2 register with two shifts and masks (3 magnitude bits to bf16 bits 6-8,
the sign to bit 15: the value times 2^-126, E2M1's two subnormal codes landing on bf16 subnormals), then one
``fma.rn.bf16x2`` by 2^(scale - 1) restores the value exactly; the activations are paired to match. The K loop
runs whole batches of U chunks only; what K leaves past them (``fp4_remainder``, compiled per K class) runs as one
more batch whose loads all issue first: the chunks left (a chunk of 3 live blocks runs whole, one lane scaled 0) and
half a chunk for 1-2 blocks (lane c: 8 bytes, half c % 2 of block c // 2, 4 k16 steps). At TP16 w2's K = 192 that is
12 k16 steps where the clamped loop ran 16 (2 dead blocks of 4); at TP8's K = 384 (unroll 2), 3 chunks where it ran 4.
Session 21's first half-chunk path (r1) loaded a whole dead chunk before its half and lost 6-7%; a per-chunk branch
instead cost ~45 registers (ptxas), so the batches stay branch-free.
The epilogue's slot ids, slot weights and token count are loaded with the work item's header (``early``, the
default), not after the MMAs: at TP16 w2's K is 192, so a CTA's whole life is one item's chain of dependent loads
(s18-r5: w2 at 0.33 of its byte floor), and this takes one step out of it. ``rl`` row tiles per CTA and item go
further: the CTA computes them one after the other, so the header chain (item, slot ids, token weights) is paid once
for all of them and each further tile's loads depend only on the expert id and the activations already in L1.
``dq`` = 1 decodes codes repacked once at load time (``pack_codes``, see ``DQ_PAIRS``): 9 integer instructions per
32-bit word instead of 15, and the activations need no re-pairing. It pays where issue bounds the kernel: w2 at TP16
b64 (ncu stalls mostly math-pipe throttle) ran 121 -> 103 us; w13 (mostly long-scoreboard stalls: waiting on its
loads, 24-29% occupancy) did not speed up (s20-r2/r3, bench/results/2026-12-02-s20-*). For such a kernel ``pf`` > 0
has each warp pull its rows' weights ``pf`` load batches ahead into L2 (``cp.async.bulk.prefetch``, one per row and
batch, issued before the batch it overlaps): bytes in flight that hold no registers. Measured (s21-r1, experts step):
pf 1 makes bf16 2-24% faster (TP8 b1 129 -> 98 us), pf 2 is slower from b8 on; MXFP4 is 5-13% slower with either,
so the block searches pf for bf16 only. ``ring`` > 1 brings the weights (codes, or bf16) into a lane-private
shared-memory ring by cp.async, ``ring`` - 1 load batches ahead of the one being used: bytes in flight that hold no
registers and, unlike pf, no TMA requests. s21-r8: MXFP4 w13 with 2 stages of 2 chunks made the experts step 2-10%
faster (TP16/TP8 b1-64); bf16 through the ring is compiled and staged, not yet run on a GPU.
``pdl`` (a compile argument, the block's knob): launched as a programmatic dependent, as ``moe_experts``' kernels.
Scales above 2^1 are refused by ``check_scales`` (bf16 cannot hold the 2^(s-1) multiplier; K3's weight
scales are far below).

Status: compiles on the CPU for sm_90a and sm_100a (tests/test_kernel_compile.py); GPU numerics
(tests/test_gpu_moe_tc.py) pass on the H200 for bf16 and MXFP4 at K3's shapes (2026-11-29, session 4; dq 2026-12-02,
session 20; pf session 21).
Speed against the CUDA-core kernels: bench/moe_experts.py (bench/results/2026-11-29-s4-r1-moe-experts.log).
The block executor (runtime/moe.py) runs them when the block's ``experts_kernel`` knob says so, and always
for MXFP4 experts.
"""

import functools
import os
from dataclasses import dataclass

from k3tune.kernels.gemm_smallm import current_arch

VEC = 8  # bf16 per 16-byte vector
FP4_BLOCK = 32  # codes per scale (and per 16-byte vector)
MAX_SCALE_BYTE = 128  # 2^(s - 1) must be a normal bf16

# The decode layout (dq = 1). A bf16x2 pair needs each code's 3 magnitude bits at bf16 bits 6-8 and its sign at
# bit 15 of its half (mask DQ_MASK); in K3's nibble order that costs two shifts, two masks and an OR a pair, and the
# activations must be re-paired (nibbles i and i + 4 share a register). ``pack_codes`` moves the bits of each 32-bit
# word (8 codes, K order) so that pair j = codes (2j, 2j + 1) is the OR over DQ_PAIRS[j] of (rotl(word, r) & mask):
# pairs 0-2 take one rotate and one mask (pair 0 no rotate), pair 3 two of each and an OR (no layout lets all four
# pairs be one rotate: the translates of the 8 target bits do not tile a word), 9 integer instructions a word
# instead of 15; and codes (2j, 2j + 1) meet the activations' bf16 pair j of their 16-byte vector as loaded.
DQ_MASK = 0x81C081C0
DQ_PAIRS = (((0, DQ_MASK),), ((4, DQ_MASK),), ((10, DQ_MASK),), ((6, 0x80C080C0), (14, 0x01000100)))
_BIT_OF = {6: 0, 7: 1, 8: 2, 15: 3}  # bf16 bit (of a half) -> E2M1 code bit


@dataclass(frozen=True)
class PackedCodes:
    """MXFP4 codes in the dq = 1 decode layout (``pack_codes``): what ``run_w13``/``run_w2`` take when ``cfg.dq``."""
    data: object  # uint8 [..., K/2], the shape of the codes it was packed from


@functools.cache
def dq_positions() -> tuple:
    """``pos[i][b]``: the bit of its 32-bit word that bit ``b`` of the word's code ``i`` (K order) moves to."""
    pos = [[-1] * 4 for _ in range(8)]
    for j, terms in enumerate(DQ_PAIRS):
        for r, mask in terms:
            for t in range(32):
                if mask >> t & 1:
                    pos[2 * j + t // 16][_BIT_OF[t % 16]] = (t - r) % 32
    assert sorted(p for row in pos for p in row) == list(range(32)), "DQ_PAIRS must place every bit once"
    return tuple(tuple(row) for row in pos)


def _words(codes):
    """uint8 [..., 4n] -> int64 [..., n]: each run of 4 bytes as one little-endian 32-bit word (8 codes)."""
    import torch

    b = codes.reshape(*codes.shape[:-1], -1, 4).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _bytes(words):
    """The inverse of ``_words``: int64 [..., n] 32-bit words -> uint8 [..., 4n]."""
    import torch

    return torch.stack([(words >> (8 * i)) & 255 for i in range(4)], dim=-1).flatten(-2).to(torch.uint8)


def pack_codes(codes, chunk_words: int = 1 << 22) -> PackedCodes:
    """K3's MXFP4 codes (uint8 [..., K/2], even K index in the low nibble) in the dq = 1 decode layout; any
    device, bounded memory (``chunk_words`` 32-bit words at a time). Scales are unchanged."""
    import torch

    from k3tune.errors import ConfigError

    if codes.dtype != torch.uint8 or codes.shape[-1] % 4:
        raise ConfigError(f"MXFP4 codes: expected uint8 [..., K/2] with K a multiple of 8, got {codes.dtype} "
                          f"{tuple(codes.shape)}")
    pos = torch.tensor(dq_positions(), dtype=torch.int64, device=codes.device)  # [8, 4]
    bits = torch.arange(4, device=codes.device)
    flat = codes.reshape(-1, 4)  # one 32-bit word (8 codes) a row
    out = torch.empty_like(flat)
    for a in range(0, flat.shape[0], chunk_words):
        b = flat[a:a + chunk_words].to(torch.int64)
        nib = torch.stack((b & 15, b >> 4), dim=-1).reshape(-1, 8)  # codes in K order
        word = (((nib[:, :, None] >> bits) & 1) << pos).sum(dim=(1, 2))
        out[a:a + chunk_words] = _bytes(word[:, None])
    return PackedCodes(out.reshape(codes.shape))


def unpack_codes(packed: PackedCodes, chunk_words: int = 1 << 22):
    """The inverse of ``pack_codes``: K3's codes (uint8 [..., K/2], even K index in the low nibble), exactly."""
    import torch

    data = packed.data
    pos = torch.tensor(dq_positions(), dtype=torch.int64, device=data.device)  # [8, 4]
    flat = data.reshape(-1, 4)
    out = torch.empty_like(flat)
    for a in range(0, flat.shape[0], chunk_words):
        word = _words(flat[a:a + chunk_words])[:, 0]
        nib = ((word[:, None, None] >> pos) & 1) << torch.arange(4, device=data.device)  # [words, 8 codes, 4 bits]
        nib = nib.sum(dim=2)  # codes in K order
        out[a:a + chunk_words] = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
    return out.reshape(data.shape)


def in_layout(codes, dq: int):
    """MXFP4 codes in the layout a kernel with this ``dq`` decodes: repacked or unpacked as needed, else as given."""
    if bool(dq) == isinstance(codes, PackedCodes):
        return codes
    return pack_codes(codes) if dq else unpack_codes(codes)


def expert_codes(codes, e: int):
    """Expert ``e``'s codes in K3's order, whichever layout ``codes`` holds (for references and dequantisation)."""
    return unpack_codes(PackedCodes(codes.data[e])) if isinstance(codes, PackedCodes) else codes[e]


def dq_decode_reference(packed):
    """The dq = 1 decode in torch integer arithmetic, as the kernel does it: uint8 [..., K/2] packed codes ->
    int64 [..., K] bf16 bit patterns of each value x 2^-126 (before the scale), in K order. For tests."""
    import torch

    word = _words(packed)
    pairs = []
    for terms in DQ_PAIRS:
        v = 0
        for r, mask in terms:
            rot = ((word << r) | (word >> (32 - r))) & 0xFFFFFFFF if r else word
            v = v | (rot & mask)
        pairs += [v & 0xFFFF, v >> 16]
    return torch.stack(pairs, dim=-1).reshape(*packed.shape[:-1], -1)


@dataclass(frozen=True)
class TcExpertConfig:
    m_tiles: int = 1  # 16-row MMA tiles per warp (w13: gate tiles, each with its up tile)
    warps_n: int = 2  # warps over row tiles
    warps_k: int = 2  # warps over K, reduced through shared memory
    n_tiles: int = 1  # 8-token MMA tiles per work item: items hold up to 8 x n_tiles tokens
    unroll: int = 2  # K chunks whose loads issue before their MMAs
    early: int = 1  # 1: the epilogue's slot ids, slot weights and token count load with the item's header, so
    #                 they are not a dependent step after the MMAs (0: loaded in the epilogue, sessions 4-17)
    rl: int = 1  # row tiles (of 16 x m_tiles x warps_n rows) a CTA computes for each work item, one after the
    #              other: the item's header chain (item, slot ids, token weights) is paid once for all of them
    dq: int = 0  # MXFP4 only. 1: codes repacked by ``pack_codes`` (wrapped in ``PackedCodes``), decoded by one
    #              rotate and one mask per bf16x2 pair, activations paired as loaded; 0: codes as K3 ships them
    pf: int = 0  # load batches ahead whose weight bytes each warp pulls into L2 (cp.async.bulk.prefetch, one per row):
    #              bytes in flight that cost no registers, for a kernel that waits on its loads (0: off)
    ring: int = 0  # stages of a lane-private shared-memory ring the weights (codes or bf16) arrive in by cp.async,
    #                so ring - 1 load batches are in flight while one is used, holding no registers (0: loaded
    #                straight into registers)

    @property
    def tokens(self) -> int:
        return 8 * self.n_tiles


def default_config(tokens: int) -> tuple:
    """(w13 config, w2 config, tokens per item) where no tuned choice gives them."""
    per = min(8, max(1, tokens))
    return TcExpertConfig(1, 2, 2, 1, 2), TcExpertConfig(1, 4, 1, 1, 2), per


SMEM_BUDGET = 48 * 1024  # shared memory a CTA may use without the opt-in for more


def reduction_bytes(cfg: TcExpertConfig, w13: bool) -> int:
    """Shared memory of the K-warp reduction buffer (fp32 accumulators of warps_k - 1 warps per row warp), and of
    the code ring where there is one."""
    mtot = 2 * cfg.m_tiles if w13 else cfg.m_tiles
    return 4 * (4 * mtot * cfg.n_tiles) * 32 * cfg.warps_n * max(cfg.warps_k - 1, 1) + ring_bytes(cfg, w13)


def ring_bytes(cfg: TcExpertConfig, w13: bool) -> int:
    """The weight ring: per stage, each lane's 16 bytes of every row register (2 per MMA row tile) of each chunk."""
    mtot = 2 * cfg.m_tiles if w13 else cfg.m_tiles
    return cfg.ring * cfg.warps_n * cfg.warps_k * 32 * 2 * mtot * cfg.unroll * 16


def check(cfg: TcExpertConfig, groups, k: int, fmt: str, w13: bool = True) -> None:
    from k3tune.errors import ConfigError

    if fmt not in ("bf16", "mxfp4"):
        raise ConfigError(f"tensor-core expert kernel: format {fmt!r}, expected bf16 or mxfp4")
    if groups.per > cfg.tokens:
        raise ConfigError(f"work items of {groups.per} tokens do not fit {cfg.n_tiles} MMA tile(s) of 8 tokens")
    if cfg.ring and (cfg.ring < 2 or reduction_bytes(cfg, w13) > SMEM_BUDGET):
        raise ConfigError(f"weight ring of {cfg.ring} stages: at least 2 stages, within "
                          f"{SMEM_BUDGET // 1024} KB of shared memory with the reduction buffer")
    if k % (VEC * 4 if fmt == "bf16" else FP4_BLOCK):
        raise ConfigError(f"tensor-core expert kernel ({fmt}): K {k} is not a multiple of "
                          f"{VEC * 4 if fmt == 'bf16' else FP4_BLOCK}")


def check_scales(scales) -> None:
    """MXFP4 scales this kernel can apply exactly: E8M0 bytes up to 128 (2^1)."""
    from k3tune.errors import ConfigError

    top = int(scales.max())
    if top > MAX_SCALE_BYTE:
        raise ConfigError(f"MXFP4 scale byte {top} (2^{top - 127}) is above 2^1: not supported by the "
                          "tensor-core expert kernel")


def _fake_args(kind: str, fmt: str, arch: str):
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint8
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    os.environ["CUTE_DSL_ARCH"] = arch
    b, k, t, e, n = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    kk = cute.sym_int(divisibility=FP4_BLOCK)
    x = fake(BFloat16, (cute.sym_int(), kk), stride_order=(1, 0), assumed_align=16)
    if fmt == "bf16":
        w = fake(BFloat16, (e, n, cute.sym_int(divisibility=VEC)), stride_order=(2, 1, 0), assumed_align=16)
        s = fake(Uint8, (1, 1, 1), stride_order=(2, 1, 0), assumed_align=1)
    else:
        w = fake(Uint8, (e, n, cute.sym_int(divisibility=16)), stride_order=(2, 1, 0), assumed_align=16)
        s = fake(Uint8, (e, n, cute.sym_int()), stride_order=(2, 1, 0), assumed_align=1)
    out = (fake(BFloat16, (t, cute.sym_int()), stride_order=(1, 0), assumed_align=2) if kind == "w13"
           else fake(Float32, (t, n), stride_order=(1, 0), assumed_align=4))
    wt = fake(Float32, (b, k), stride_order=(1, 0), assumed_align=4)
    groups = (fake(Int32, (cute.sym_int(),), assumed_align=4), fake(Int32, (cute.sym_int(),), assumed_align=4),
              fake(Int32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=4))
    return x, w, s, out, wt, *groups


@functools.cache
def compiled(kind: str, knobs: tuple, fmt: str, arch: str, pdl: int = 0):
    """One compile per projection, knobs (m_tiles, warps_n, warps_k, n_tiles, unroll, beta, linear_beta, early, rl,
    dq, pf, ring, MXFP4 remainder: see ``kernel_knobs``), format, arch and ``pdl`` (1: launched as a programmatic
    dependent, as ``moe_experts``' kernels: each CTA waits for the grid before it, then lets the next one launch);
    batch, widths and expert counts are dynamic (K within its remainder class). Never call inside a capture."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from k3tune.kernels.compile_cache import cached_compile

    def build():
        kern = _kernel_class()(kind, fmt, *knobs)
        kern.pdl = bool(pdl)
        return cute.compile(kern, *_fake_args(kind, fmt, arch), make_fake_stream(), options=f"--gpu-arch {arch}")

    return cached_compile(f"moe_tc_{kind}", (knobs, fmt, arch, pdl), (__name__, "k3tune.kernels.moe_experts"), build)


def kernel_knobs(kind: str, cfg: TcExpertConfig, fmt: str, k: int, beta: float = 0.0, linear_beta: float = 0.0):
    """``compiled``'s knobs for one projection of reduction width ``k`` (w13 takes the SiTU betas; bf16 ignores dq).
    MXFP4 also compiles K's remainder class (``fp4_remainder``), so every batch of the K loop is whole and branch-free
    and no lane decodes more than one dead block."""
    betas = (float(beta), float(linear_beta)) if kind == "w13" else (0.0, 0.0)
    fp4 = fmt == "mxfp4"
    return (cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.n_tiles, cfg.unroll, *betas, cfg.early, cfg.rl,
            cfg.dq if fp4 else 0, cfg.pf, cfg.ring, *(fp4_remainder(k, cfg.unroll) if fp4 else (0, 0)))


def fp4_remainder(k: int, unroll: int) -> tuple:
    """(rem, half) of an MXFP4 K: its 128-K chunks with at least 3 live blocks (a chunk of 3 runs whole, one lane
    scaled 0) past the last whole batch of ``unroll`` chunks, and whether 1-2 blocks are left past those (run as half
    a chunk: lane c takes 8 bytes, half c % 2 of block c // 2, 4 k16 steps). TP16 w2, K = 192 at unroll 2: (1, 1),
    one chunk and a half, where the loop over whole batches decoded 2 dead blocks of 4; TP8 w2, K = 384: (1, 0), where
    a second batch of 2 decoded a whole dead chunk. K3's w13 (K = 3584, 28 chunks) has none at unroll 1, 2 or 4."""
    blocks = k // FP4_BLOCK
    whole = blocks // 4 + (blocks % 4 == 3)
    return whole % unroll, int(blocks % 4 in (1, 2))


def prebuild(cfg13: TcExpertConfig, cfg2: TcExpertConfig, fmt: str, latent: int, inter: int, beta: float,
             linear_beta: float, pdl: int = 0) -> None:
    """Compile the two kernels a block with these configs runs (w13 over K = ``latent``, w2 over K = ``inter``, the
    rank's share), from the knobs alone (no tensors, no GPU): the sweep's compile farm calls it on CPU cores, and
    the GPU worker then loads them from the disk cache."""
    arch = current_arch()
    compiled("w13", kernel_knobs("w13", cfg13, fmt, latent, beta, linear_beta), fmt, arch, int(pdl))
    compiled("w2", kernel_knobs("w2", cfg2, fmt, inter), fmt, arch, int(pdl))


def run_w13(cfg: TcExpertConfig, latent, w13, act, weights, groups, beta: float, linear_beta: float,
            scales=None, stream=None, pdl: bool = False):
    """act[slot, :I] = situ(latent[tok] . gate rows, latent[tok] . up rows) over ``groups``' work items;
    ``w13`` bf16 [E, 2I, K], or MXFP4 codes uint8 [E, 2I, K/2] with ``scales`` uint8 [E, 2I, K/32]."""
    fmt = "bf16" if scales is None else "mxfp4"
    check(cfg, groups, latent.shape[1], fmt)
    fn = compiled("w13", kernel_knobs("w13", cfg, fmt, latent.shape[1], beta, linear_beta), fmt, current_arch(),
                  int(pdl))
    _launch(fn, latent, _operand(cfg, w13, fmt), scales, act, weights, groups, stream)


def run_w2(cfg: TcExpertConfig, act, w2, out, weights, groups, scales=None, stream=None, pdl: bool = False):
    """out[slot, :L] = weight[slot] * act[slot] . w2 rows (fp32), over ``groups``' work items."""
    fmt = "bf16" if scales is None else "mxfp4"
    check(cfg, groups, act.shape[1], fmt, w13=False)
    fn = compiled("w2", kernel_knobs("w2", cfg, fmt, act.shape[1]), fmt, current_arch(), int(pdl))
    _launch(fn, act, _operand(cfg, w2, fmt), scales, out, weights, groups, stream)


def _operand(cfg: TcExpertConfig, w, fmt: str):
    """The weight tensor for the kernel: MXFP4 codes must come in the layout ``cfg.dq`` decodes (refused, never
    misread, otherwise); bf16 weights ignore dq."""
    from k3tune.errors import ConfigError

    if fmt == "bf16":
        return w
    if isinstance(w, PackedCodes) != bool(cfg.dq):
        raise ConfigError(f"MXFP4 codes for dq={cfg.dq}: expected " +
                          ("PackedCodes (tensor-core pack_codes)" if cfg.dq else "K3's codes, not PackedCodes"))
    return w.data if cfg.dq else w


def _launch(fn, x, w, scales, out, weights, groups, stream):
    import torch

    from k3tune.kernels.moe_experts import _groups, _stream, _t

    s = scales if scales is not None else _dummy_scales(w.device)
    fn(_t(x, 16), _t(w, 16), _t(s, 1), _t(out, 16 if out.dtype == torch.float32 else 2), _t(weights, 4),
       *_groups(groups), _stream(stream))


@functools.cache
def _dummy_scales(device):
    import torch

    return torch.zeros(1, 1, 1, dtype=torch.uint8, device=device)


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32, Uint8
    from cutlass.experimental.primitives import cp_async_bulk_prefetch

    from k3tune.kernels.moe_experts import ITEM_SHIFT

    MAG, SIGN = 0x01C001C0, -0x7FFF8000  # 0x80008000 as a signed 32-bit constant

    def _shift(q, n: int):
        return q << n if n >= 0 else q >> (-n)

    def _s32(v: int) -> int:  # a 32-bit mask as the signed constant Int32 takes
        return v - (1 << 32) if v >= 1 << 31 else v

    def _dq_pair(q, j: int):  # bf16x2 bits of pair j of a dq = 1 word (each value x 2^-126): DQ_PAIRS[j]
        out = None
        for r, mask in DQ_PAIRS[j]:
            v = (q if r == 0 else cute.arch.shf(q, q, r, "l")) & Int32(_s32(mask))
            out = v if out is None else out | v
        return out

    class TcExpertGemm:
        pdl = False  # set by ``compiled``

        def __init__(self, which, fmt, mt, wn, wk, nt, unroll, beta=0.0, linear_beta=0.0, early=1, rl=1, dq=0, pf=0,
                     ring=0, rem=0, half_chunk=0):
            self.w13, self.fp4, self.early, self.rl = which == "w13", fmt == "mxfp4", bool(early), rl
            self.dq, self.pf, self.ring = bool(dq) and self.fp4, pf, ring
            self.rem, self.hc = (rem, bool(half_chunk)) if self.fp4 else (0, False)  # see fp4_remainder
            self.ev = 16 if self.fp4 else VEC  # weight elements in a lane's 16-byte vector
            self.mt, self.wn, self.wk, self.nt, self.unroll = mt, wn, wk, nt, unroll
            self.mtot = 2 * mt if self.w13 else mt  # MMA row tiles a warp computes (gate + up for w13)
            self.beta, self.lin = beta, linear_beta
            self.cta_rows = 16 * mt * wn

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor,
                     mWt: cute.Tensor, mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor,
                     stream: cuda.CUstream):
            out_rows = mW.shape[1] // 2 if cutlass.const_expr(self.w13) else mW.shape[1]
            tiles = (out_rows + self.cta_rows * self.rl - 1) // (self.cta_rows * self.rl)  # groups of rl row tiles
            ctas = cutlass.min(mItems.shape[0], cutlass.max(8, 32768 // tiles))
            self.kernel(mX, mW, mS, mOut, mWt, mCnt, mItems, mSlots).launch(
                grid=(ctas, tiles, 1), block=(self.wn * self.wk * 32, 1, 1), stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor,
                   mWt: cute.Tensor, mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor):
            if cutlass.const_expr(self.pdl):  # the grid before complete (its outputs visible), then the next may launch
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            MTOT, NT, WN, WK = self.mtot, self.nt, self.wn, self.wk
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, _ = cute.arch.block_idx()
            gdx, _, _ = cute.arch.grid_dim()
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4
            c = lane % 4
            wrow = warp % WN
            wkk = warp // WN
            k = mWt.shape[1]
            n_experts = mCnt.shape[0] - 1
            width = mSlots.shape[1]
            half = mW.shape[1] // 2
            out_rows = half if cutlass.const_expr(self.w13) else mW.shape[1]
            ntiles = (out_rows + self.cta_rows - 1) // self.cta_rows
            kdim = mX.shape[1]
            # bf16: 32 K per chunk (4 lanes x 8); MXFP4: 128 K per chunk (4 lanes x one 32-code block)
            chunks = kdim // 32 if cutlass.const_expr(not self.fp4) else (kdim + 127) // 128
            gX = cute.zipped_divide(mX, (1, VEC))
            x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            w_dtype = Uint8 if cutlass.const_expr(self.fp4) else BFloat16
            w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), w_dtype, num_bits_per_copy=128, invariant=True)
            mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
            nacc = 4 * MTOT * NT
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((nacc, 32, WN, max(WK - 1, 1))), 16)
            ring = None  # [warp][stage][chunk u][row register r][lane][16 bytes]: a warp's LDS.128 reads 512 B in a row
            if cutlass.const_expr(self.ring > 0):
                ring = smem.allocate_tensor(
                    w_dtype, cute.make_layout(self.ring * WN * WK * 32 * 2 * MTOT * self.unroll * self.ev), 128)

            for it in cutlass.range(bidx, mCnt[n_experts], gdx):
                code = mItems[it]
                ex = code >> ITEM_SHIFT
                t0 = code & ((1 << ITEM_SHIFT) - 1)
                xrows = []  # this lane's B-operand token per 8-token tile (stale slot ids past the item: dropped)
                for j in cutlass.range_constexpr(NT):
                    sl = mSlots[ex, cutlass.min(t0 + j * 8 + g, width - 1)]
                    xrows.append(sl // k if cutlass.const_expr(self.w13) else sl)
                ntok = mCnt[ex] - t0
                eslots, ewts = [], []  # early: this lane's epilogue tokens 2c, 2c + 1 of each tile (clamped)
                if cutlass.const_expr(self.early):
                    for jt in cutlass.range_constexpr(NT):
                        for h in cutlass.range_constexpr(2):
                            es = mSlots[ex, cutlass.min(t0 + jt * 8 + 2 * c + h, width - 1)]
                            eslots.append(es)
                            if cutlass.const_expr(not self.w13):
                                ewts.append(mWt[es // k, es % k])
                if cutlass.const_expr(self.rl == 1):
                    self._row_tile(mX, mW, mS, mOut, mWt, mSlots, gX, x_atom, w_atom, mma, red, ex, t0, ntok, xrows,
                                   eslots, ewts, bidy, wrow, wkk, lane, g, c, k, chunks, kdim, half, out_rows, ring)
                else:  # rl row tiles for this item, its header loaded once
                    for rt in cutlass.range(bidy * self.rl, cutlass.min(bidy * self.rl + self.rl, ntiles)):
                        self._row_tile(mX, mW, mS, mOut, mWt, mSlots, gX, x_atom, w_atom, mma, red, ex, t0, ntok,
                                       xrows, eslots, ewts, rt, wrow, wkk, lane, g, c, k, chunks, kdim, half,
                                       out_rows, ring)

        @cute.jit
        def _row_tile(self, mX, mW, mS, mOut, mWt, mSlots, gX, x_atom, w_atom, mma, red, ex, t0, ntok, xrows, eslots,
                      ewts, rt, wrow, wkk, lane, g, c, k, chunks, kdim, half, out_rows, ring):
            """Row tile ``rt`` (cta_rows rows) of one work item: the K loop, the K-warp reduction, the epilogue."""
            MT, MTOT, NT, WK, U = self.mt, self.mtot, self.nt, self.wk, self.unroll
            nacc = 4 * MTOT * NT
            row0 = rt * self.cta_rows + wrow * 16 * MT
            wrows = []  # per MMA tile: rows g and g + 8 (clamped; their results are never stored)
            for i in cutlass.range_constexpr(MTOT):
                for h in cutlass.range_constexpr(2):
                    r = cutlass.min(row0 + (i % MT) * 16 + g + 8 * h, out_rows - 1)
                    wrows.append(r + half if cutlass.const_expr(self.w13 and i >= MT) else r)
            acc = cute.make_rmem_tensor(cute.make_layout((4, MTOT, NT)), Float32)
            acc.fill(0.0)
            blocks = kdim // FP4_BLOCK  # MXFP4
            lim = chunks - self.rem - int(self.hc)  # chunks in whole batches (MXFP4: the remainder runs after them)
            if cutlass.const_expr(self.ring > 0):  # the weights through the shared-memory ring
                self._ring_loop(mW, mS, gX, x_atom, mma, ring, ex, wrows, xrows, wrow, wkk, lane, c, lim, blocks, acc)
            else:
                gP = cute.zipped_divide(mW[ex, None, None], (1, 16 if cutlass.const_expr(self.fp4) else VEC))
                if cutlass.const_expr(self.pf > 1):  # batches 1 .. pf - 1 (batch 0 is loaded at once; pf, in the loop)
                    for d in cutlass.range_constexpr(1, self.pf):
                        self._prefetch(gP, mW, row0, half, out_rows, lane, wkk * U + d * WK * U, chunks)
                for kb in cutlass.range(wkk * U, lim, WK * U):
                    if cutlass.const_expr(self.pf > 0):  # pf batches ahead of this one, while this one is decoded
                        self._prefetch(gP, mW, row0, half, out_rows, lane, kb + self.pf * WK * U, chunks)
                    if cutlass.const_expr(self.fp4):
                        self._batch_fp4(mW, mS, gX, w_atom, x_atom, mma, ex, wrows, xrows, kb, blocks, c, acc)
                    else:
                        self._batch_bf16(mW, gX, w_atom, x_atom, mma, ex, wrows, xrows, kb, chunks, c, acc)
            if cutlass.const_expr(self.rem > 0 or self.hc):  # MXFP4's remainder: one batch, loads first, on the warp
                if wkk == (lim // U) % WK:  # next in turn
                    self._batch_fp4(mW, mS, gX, w_atom, x_atom, mma, ex, wrows, xrows, lim, blocks, c, acc,
                                    nch=self.rem, hc=self.hc)
            if cutlass.const_expr(WK > 1):  # K warps reduced in warp order: deterministic
                if wkk > 0:
                    for q in cutlass.range_constexpr(nacc):
                        red[q, lane, wrow, wkk - 1] = acc[q]
                cute.arch.sync_threads()
                if wkk == 0:
                    for w2k in cutlass.range_constexpr(WK - 1):
                        for q in cutlass.range_constexpr(nacc):
                            acc[q] = acc[q] + red[q, lane, wrow, w2k]
            if wkk == 0:
                # accumulator q of tile (i, jt): row g + 8 (q // 2), token 2 c + q % 2 of the tile
                for i in cutlass.range_constexpr(MT):
                    for jt in cutlass.range_constexpr(NT):
                        for q in cutlass.range_constexpr(4):
                            row = row0 + i * 16 + g + 8 * (q // 2)
                            t = jt * 8 + 2 * c + q % 2
                            if t < ntok and row < out_rows:
                                slot = (eslots[2 * jt + q % 2] if cutlass.const_expr(self.early)
                                        else mSlots[ex, t0 + t])
                                s = acc[q, i, jt]
                                if cutlass.const_expr(self.w13):
                                    up = cutlass.max(cutlass.min(acc[q, MT + i, jt], Float32(self.lin)),
                                                     Float32(-self.lin))
                                    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-Float32(self.beta) * s))
                                    mOut[slot, row] = (s * sig * up).to(BFloat16)
                                else:
                                    wt = (ewts[2 * jt + q % 2] if cutlass.const_expr(self.early)
                                          else mWt[slot // k, slot % k])
                                    mOut[slot, row] = s * wt
            if cutlass.const_expr(WK > 1):
                cute.arch.sync_threads()  # red is reused by the next row tile or item

        @cute.jit
        def _prefetch(self, gP, mW, row0, half, out_rows, lane, kb, chunks):
            """L2 prefetch of this warp's rows over the U chunks from chunk ``kb`` (64 bytes a row and chunk in both
            formats): lane l takes row l (and l + 32 ...) of the warp's 16 x MTOT rows, one bulk prefetch each."""
            MT, MTOT, U = self.mt, self.mtot, self.unroll
            if kb < chunks:
                rowbytes = mW.shape[2] if cutlass.const_expr(self.fp4) else mW.shape[2] * 2
                nbytes = cutlass.min(rowbytes - kb * 64, U * 64)  # a multiple of 16: K is one of 32 (check)
                for q in cutlass.range_constexpr((16 * MTOT + 31) // 32):
                    idx = lane + 32 * q
                    if idx < 16 * MTOT:
                        i = idx // 16
                        r = cutlass.min(row0 + (i % MT) * 16 + idx % 16, out_rows - 1)
                        if cutlass.const_expr(self.w13):  # up rows sit half a matrix below their gate rows
                            r = r + cutlass.select_(i >= MT, half, 0)
                        cp_async_bulk_prefetch(gP[(None, (r, kb * 4))].iterator, nbytes)

        @cute.jit
        def _batch_bf16(self, mW, gX, w_atom, x_atom, mma, ex, wrows, xrows, kb, chunks, c, acc, ring=None,
                        slot_off=0):
            """U 32-K chunks from chunk kb, lane c on 8 weights a row; with ``ring``, the weights are read from the
            ring at element ``slot_off`` (where cp.async put them) instead."""
            MTOT, NT, U = self.mtot, self.nt, self.unroll
            gW = cute.zipped_divide(mW[ex, None, None], (1, VEC))
            rw = cute.make_rmem_tensor(cute.make_layout((VEC, 2 * MTOT, U)), BFloat16)
            rx = cute.make_rmem_tensor(cute.make_layout((VEC, NT, U)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, MTOT)), BFloat16)  # PTX a0..a7 per tile
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)
            tmp = cute.make_rmem_tensor(cute.make_layout((4, MTOT, NT)), Float32)
            for u in cutlass.range_constexpr(U):  # every load of the batch before the first MMA
                kv = cutlass.min(kb + u, chunks - 1) * 4 + c
                for r in cutlass.range_constexpr(2 * MTOT):
                    if cutlass.const_expr(ring is None):
                        cute.copy(w_atom, gW[(None, (wrows[r], kv))], rw[None, r, u])
                    else:
                        cute.copy(w_atom, self._vec(ring.iterator + (slot_off + (u * 2 * MTOT + r) * 32 * VEC)),
                                  rw[None, r, u])
            for u in cutlass.range_constexpr(U):
                kv = cutlass.min(kb + u, chunks - 1) * 4 + c
                for j in cutlass.range_constexpr(NT):
                    cute.copy(x_atom, gX[(None, (xrows[j], kv))], rx[None, j, u])
            for u in cutlass.range_constexpr(U):
                tmp.fill(0.0)
                for s in cutlass.range_constexpr(2):  # two k16 steps: vector elements 4s .. 4s + 3
                    for i in cutlass.range_constexpr(MTOT):
                        for h in cutlass.range_constexpr(2):  # a0a1 / a4a5 (row g), a2a3 / a6a7 (row g + 8)
                            fa[4 * h, i] = rw[4 * s + 2 * h, 2 * i, u]
                            fa[4 * h + 1, i] = rw[4 * s + 2 * h + 1, 2 * i, u]
                            fa[4 * h + 2, i] = rw[4 * s + 2 * h, 2 * i + 1, u]
                            fa[4 * h + 3, i] = rw[4 * s + 2 * h + 1, 2 * i + 1, u]
                    for j in cutlass.range_constexpr(NT):
                        for v in cutlass.range_constexpr(4):
                            fb[v, j] = rx[4 * s + v, j, u]
                    cute.gemm(mma, tmp, fa, fb, tmp)
                keep = cutlass.max(cutlass.min(chunks - kb - u, 1), 0).to(Float32)  # 1 inside K, else 0
                for q in cutlass.range_constexpr(4 * MTOT * NT):
                    acc[q] = acc[q] + tmp[q] * keep

        @cute.jit
        def _batch_fp4(self, mW, mS, gX, w_atom, x_atom, mma, ex, wrows, xrows, kb, blocks, c, acc, ring=None,
                       slot_off=0, nch: int = -1, hc: bool = False):
            """``nch`` (default U) 128-K chunks from chunk kb, lane c on block 4 (kb + u) + c, blocks at or past
            ``blocks`` scaled 0; with ``hc``, then half a chunk (lane c: 8 bytes, half c % 2 of block 4 (kb + nch) +
            c // 2), its loads issued with the chunks'. With ``ring``, the chunks' codes are read from the ring at
            byte ``slot_off`` (where cp.async put them) instead."""
            MTOT, NT = self.mtot, self.nt
            U = self.unroll if nch < 0 else nch
            fa = cute.make_rmem_tensor(cute.make_layout((8, MTOT)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, NT)), BFloat16)
            fa32 = cute.recast_tensor(fa, Int32)  # (4, MTOT): a0a1, a2a3, a4a5, a6a7
            if cutlass.const_expr(U > 0):
                gW = cute.zipped_divide(mW[ex, None, None], (1, 16))  # 16 bytes = 32 codes = one scale block
                rq = cute.make_rmem_tensor(cute.make_layout((16, 2 * MTOT, U)), Uint8)
                rx = cute.make_rmem_tensor(cute.make_layout((VEC, 4, NT, U)), BFloat16)
                sc = cute.make_rmem_tensor(cute.make_layout((2 * MTOT, U)), Int32)
                for u in cutlass.range_constexpr(U):  # codes and scales first: they need only the expert
                    blk = (kb + u) * 4 + c
                    blk_c = cutlass.min(blk, blocks - 1)
                    live = Int32(cutlass.select_(blk < blocks, 1, 0))  # a block past K contributes 0
                    for r in cutlass.range_constexpr(2 * MTOT):
                        if cutlass.const_expr(ring is None):
                            cute.copy(w_atom, gW[(None, (wrows[r], blk_c))], rq[None, r, u])
                        else:
                            cute.copy(w_atom, self._vec(ring.iterator + (slot_off + (u * 2 * MTOT + r) * 32 * 16)),
                                      rq[None, r, u])
                        sc[r, u] = mS[ex, wrows[r], blk_c].to(Int32) * live
            if cutlass.const_expr(hc):
                gW8 = cute.zipped_divide(mW[ex, None, None], (1, 8))  # 8 bytes = 16 codes = half a scale block
                w8_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=64, invariant=True)
                rq8 = cute.make_rmem_tensor(cute.make_layout((8, 2 * MTOT, 1)), Uint8)
                rx8 = cute.make_rmem_tensor(cute.make_layout((VEC, 2, NT, 1)), BFloat16)
                sc8 = cute.make_rmem_tensor(cute.make_layout((2 * MTOT, 1)), Int32)
                hblk = (kb + U) * 4 + c // 2
                hblk_c = cutlass.min(hblk, blocks - 1)
                hlive = Int32(cutlass.select_(hblk < blocks, 1, 0))
                hf = c % 2
                for r in cutlass.range_constexpr(2 * MTOT):
                    cute.copy(w8_atom, gW8[(None, (wrows[r], hblk_c * 2 + hf))], rq8[None, r, 0])
                    sc8[r, 0] = mS[ex, wrows[r], hblk_c].to(Int32) * hlive
            if cutlass.const_expr(U > 0):
                for u in cutlass.range_constexpr(U):
                    blk_c = cutlass.min((kb + u) * 4 + c, blocks - 1)
                    for j in cutlass.range_constexpr(NT):
                        for v in cutlass.range_constexpr(4):
                            cute.copy(x_atom, gX[(None, (xrows[j], blk_c * 4 + v))], rx[None, v, j, u])
            if cutlass.const_expr(hc):
                for j in cutlass.range_constexpr(NT):  # the half's two activation vectors (its words' K, as loaded)
                    for v in cutlass.range_constexpr(2):
                        cute.copy(x_atom, gX[(None, (xrows[j], hblk_c * 4 + 2 * hf + v))], rx8[None, v, j, 0])
            if cutlass.const_expr(U > 0):
                q32 = cute.recast_tensor(rq, Int32)  # (4, 2 MTOT, U): the 16 bytes as 4 words
                for u in cutlass.range_constexpr(U):
                    self._mma_codes(mma, acc, fa, fb, fa32, q32, rx, self._scales(sc, u), u, 8)
            if cutlass.const_expr(hc):
                self._mma_codes(mma, acc, fa, fb, fa32, cute.recast_tensor(rq8, Int32), rx8, self._scales(sc8, 0), 0, 4)

        @cute.jit
        def _ring_loop(self, mW, mS, gX, x_atom, mma, ring, ex, wrows, xrows, wrow, wkk, lane, c, chunks, blocks, acc):
            """The K loop through the weight ring: this warp's batches b = 0, 1, ... (chunks wkk U + b WK U ...);
            batch b + ring - 1 is issued (cp.async, 16 bytes a row register and chunk) before batch b is used. Each
            lane reads back only what it copied, so its own cp.async.wait_group orders them; no barrier. Offsets
            count weight elements (``ev`` a 16-byte vector)."""
            S, U, WK, R, E = self.ring, self.unroll, self.wk, 2 * self.mtot, self.ev
            w_dtype = Uint8 if cutlass.const_expr(self.fp4) else BFloat16
            g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                      w_dtype, num_bits_per_copy=128)
            s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), w_dtype, num_bits_per_copy=128)
            gW = cute.zipped_divide(mW[ex, None, None], (1, E))
            stage = U * R * 32 * E  # elements of one stage of one warp
            base = (wkk * self.wn + wrow) * S * stage + lane * E
            nb = cutlass.max(chunks - wkk * U + WK * U - 1, 0) // (WK * U)
            for s in cutlass.range_constexpr(S - 1):
                if s < nb:
                    self._ring_issue(g2s, gW, ring, wrows, wkk * U + s * WK * U, chunks, blocks, c, base + s * stage)
                cute.arch.cp_async_commit_group()
            for b in cutlass.range(nb):
                cute.arch.cp_async_wait_group(S - 2)  # batch b's weights have landed (this lane's)
                if b + S - 1 < nb:  # into the slot batch b - 1 left: this lane read it back before its MMAs
                    self._ring_issue(g2s, gW, ring, wrows, wkk * U + (b + S - 1) * WK * U, chunks, blocks, c,
                                     base + ((b + S - 1) % S) * stage)
                cute.arch.cp_async_commit_group()
                kb = wkk * U + b * WK * U
                if cutlass.const_expr(self.fp4):
                    self._batch_fp4(mW, mS, gX, s2r, x_atom, mma, ex, wrows, xrows, kb, blocks, c, acc, ring,
                                    base + (b % S) * stage)
                else:
                    self._batch_bf16(mW, gX, s2r, x_atom, mma, ex, wrows, xrows, kb, chunks, c, acc, ring,
                                     base + (b % S) * stage)
            cute.arch.cp_async_wait_group(0)

        @cute.jit
        def _ring_issue(self, g2s, gW, ring, wrows, kb, chunks, blocks, c, off):
            """cp.async of one batch's weights (U chunks from chunk kb) into the ring at element ``off``."""
            R = 2 * self.mtot
            for u in cutlass.range_constexpr(self.unroll):
                if cutlass.const_expr(self.fp4):  # lane c's block of the chunk (clamped past K; its scale is 0)
                    v = cutlass.min((kb + u) * 4 + c, blocks - 1)
                else:  # lane c's 8 weights of the chunk (clamped past K; the chunk's products are dropped)
                    v = cutlass.min(kb + u, chunks - 1) * 4 + c
                for r in cutlass.range_constexpr(R):
                    cute.copy(g2s, self._vec(gW[(None, (wrows[r], v))].iterator),
                              self._vec(ring.iterator + (off + (u * R + r) * 32 * self.ev)))

        @cute.jit
        def _vec(self, ptr):
            return cute.make_tensor(ptr.align(16), cute.make_layout(self.ev))

        @cute.jit
        def _scales(self, sc, u):
            """bf16x2 of 2^(s - 1) per row register (0 for s = 0 or a block past K)."""
            mul = []
            for r in cutlass.range_constexpr(2 * self.mtot):
                bits = Int32(cutlass.select_(sc[r, u] > 0, (sc[r, u] + 126) << 7, 0))  # exponent s + 126
                mul.append(bits | (bits << 16))
            return mul

        @cute.jit
        def _mma_codes(self, mma, acc, fa, fb, fa32, q32, rx, mul, u, steps: int):
            """``steps`` k16 steps over a lane's words (8: a block's 4 words; 4: half a block's 2). Pair
            p = 2s + h of the lane (a0a1/a2a3 for h = 0, a4a5/a6a7 for h = 1) is word p // 4's pair p % 4: in K3's
            order nibbles p % 4 and p % 4 + 4, activations re-paired to match; in the dq = 1 layout codes 2p, 2p + 1
            (DQ_PAIRS), whose activations are bf16 pair p % 4 of vector p // 4 as loaded."""
            MTOT, NT = self.mtot, self.nt
            rx32 = cute.recast_tensor(rx, Int32)  # bf16 pairs of each 16-byte activation vector
            fb32 = cute.recast_tensor(fb, Int32)  # (2, NT): b0b1, b2b3
            for s in cutlass.range_constexpr(steps):
                for i in cutlass.range_constexpr(MTOT):
                    for h in cutlass.range_constexpr(2):
                        p = 2 * s + h
                        jw, ni = p // 4, p % 4
                        for rr in cutlass.range_constexpr(2):  # row g, row g + 8
                            qw = q32[jw, 2 * i + rr, u]
                            if cutlass.const_expr(self.dq):
                                dec = _dq_pair(qw, ni)
                            else:
                                dec = (_shift(qw, 6 - 4 * ni) & MAG) | (_shift(qw, 12 - 4 * ni) & SIGN)
                            fa32[2 * h + rr, i] = cute.arch.fma_packed_bf16x2(dec, mul[2 * i + rr], Int32(0))
                for j in cutlass.range_constexpr(NT):
                    for h in cutlass.range_constexpr(2):
                        p = 2 * s + h
                        jw, ni = p // 4, p % 4
                        if cutlass.const_expr(self.dq):
                            fb32[h, j] = rx32[ni, jw, j, u]
                        else:
                            fb[2 * h, j] = rx[ni, jw, j, u]
                            fb[2 * h + 1, j] = rx[ni + 4, jw, j, u]
                cute.gemm(mma, acc, fa, fb, acc)

    return TcExpertGemm
