"""MXFP4 weights for an ``mma.sync.m16n8k32`` e4m3 path: the code layout, its decode and the activations' rounding,
in torch, as the reference a kernel is checked against, and the rounding ``bench/fp8_act_error.py`` studies.

No kernel on main uses it. The e4m3 kernel path (branch ``s26-e4m3``) matched this reference on the H200 but ran
24-36% slower than the bf16 path: sm_90a has no e4m3 ``mma.sync``, ptxas emulates it with e4m3 -> f16 unpacks and f16
MMAs (SASS, NOTES session 26), so it fits only an e4m3 wgmma or tcgen05 path. The reasoning it was built on: the
bf16 path (``moe_experts_tc``, dq = 1) spends ~14 instructions per 32-bit code word on its K loop's core (9 to decode
4 bf16x2 pairs, 4 bf16x2 FMAs for the scale, one m16n8k16 MMA) and the MXFP4 experts are bound by issue (s22-r5 ncu,
r7 SASS). Here a word decodes to two e4m3x4 registers in 5 (an AND; two shifts, an AND and a LOP3), one m16n8k32
covers one 32-code scale block of a row pair, so the scale moves after the MMA (4 FFMA per block and row pair, 2 a
word), and hi + lo activations cost a second MMA into the same partial sum: ~9 a word (in PTX; not in SASS).

- E2M1 is exact in e4m3: a code ``(s, mag)`` as the byte ``(s << 7) | (mag << 2)`` reads as its value times 2^-6
  (both subnormal codes included: e4m3's subnormal step is 2^-9); the 2^6 goes into the block's scale multiplier
  ``2^(scale - 121)``.
- Layout (``pack``): per row, each 64-byte chunk (128 codes, scale blocks 4j .. 4j + 3) holds lane t's 16 bytes at
  16 t: word b is block 4j + b's codes 8t .. 8t + 7 (one LDG.128 a lane, row and chunk, as today). In a word, code i
  (i < 4) sits at bits 7, 4, 3, 2 of byte i (sign, then magnitude), so ``word & E4_LO`` is codes 0-3 as e4m3x4;
  code 4 + i at bits 5, 6, 1, 0 of byte i, so ``((word << 2) & E4_HI_SHL) | ((word >> 2) & E4_HI_SHR)`` is codes 4-7.
- Fragments: m16n8k32's A holds, for lane t, row g's MMA k 4t .. 4t + 3 and 4t + 16 .. 4t + 19 (and row g + 8's):
  codes 0-3 and 4-7 of its word, i.e. block positions 8t .. 8t + 7. B holds the same k for token g:
  the activations at block positions 8t .. 8t + 7, eight bytes in K order.
- Activations (``round_hilo``): per token, x / s with s = amax / 448, as hi = e4m3(x / s) and lo = e4m3(x / s - hi);
  the MMA sums hi and lo products into one partial. CPU study (``bench/fp8_act_error.py``): routed-sum error 1.2e-3
  against 3.0e-3 for bf16 activations; one e4m3 value alone 4.6e-2.
"""

from __future__ import annotations

from k3tune.kernels.mxfp4 import BLOCK

E4_LO = 0x9C9C9C9C  # codes 0-3 of a word: bits 7, 4, 3, 2 of each byte
E4_HI_SHL = 0x8C8C8C8C  # codes 4-7: sign (bit 5) and the two low magnitude bits (1, 0) shifted left by 2
E4_HI_SHR = 0x10101010  # ... and the magnitude's top bit (6) shifted right by 2
SCALE_BIAS = 121  # block multiplier 2^(scale - 121): e8m0's 127, less the 6 of the e4m3 reading
E4M3_MAX = 448.0
CHUNK = 4 * BLOCK  # codes per 64-byte chunk of a row: 4 scale blocks, each split over the 4 lanes of a quad


def _bit_positions():
    """(code slot 0..7 of a word, code bit 0..3 [m, e0, e1, s]) -> the word's bit."""
    lo = (2, 3, 4, 7)  # m, e0, e1, s of code i < 4, within byte i
    hi = (0, 1, 6, 5)  # ... of code 4 + i
    return [[8 * (k % 4) + (lo if k < 4 else hi)[b] for b in range(4)] for k in range(8)]


def pack(codes):
    """K3's MXFP4 codes (uint8 [..., K/2], even K index in the low nibble; K a multiple of 128) -> the e4m3 layout
    (uint8, same shape). Scales are unchanged."""
    import torch

    from k3tune.errors import ConfigError

    if codes.dtype != torch.uint8 or (codes.shape[-1] * 2) % CHUNK:
        raise ConfigError(f"e4m3 MXFP4 layout: expected uint8 [..., K/2] with K a multiple of {CHUNK}, got "
                          f"{codes.dtype} {tuple(codes.shape)}")
    nib = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).to(torch.int64)  # [..., K] codes in K order
    # [..., chunk, block b, lane t, slot k] in K order -> [..., chunk, lane t, block b, slot k]
    nib = nib.unflatten(-1, (-1, 4, 4, 8)).transpose(-3, -2)
    pos = torch.tensor(_bit_positions(), dtype=torch.int64, device=codes.device)  # [8, 4]
    bits = (nib[..., None] >> torch.arange(4, device=codes.device)) & 1  # [..., 8 slots, 4 bits]
    words = (bits << pos).sum(dim=(-2, -1))  # [..., chunk, lane, block]
    out = torch.stack([(words >> (8 * i)) & 255 for i in range(4)], dim=-1)  # little-endian bytes
    return out.flatten(-4).to(torch.uint8).reshape(codes.shape)


def unpack(packed):
    """The inverse of ``pack``: K3's codes, exactly."""
    import torch

    words = _words(packed)
    pos = torch.tensor(_bit_positions(), dtype=torch.int64, device=packed.device)
    nib = (((words[..., None, None] >> pos) & 1) << torch.arange(4, device=packed.device)).sum(-1)  # [..., 8 slots]
    nib = nib.transpose(-3, -2).flatten(-4)  # [..., K] in K order
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def _words(packed):
    """Packed codes -> int64 [..., chunk, lane t, block b]: the 32-bit words lane t loads for a row and chunk."""
    import torch

    b = packed.to(torch.int64).unflatten(-1, (-1, 4, 4, 4))  # [..., chunk, lane, block, byte]
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _slots(words):
    """The kernel's decode of each word: ``word & E4_LO`` (codes 0-3, the A register of MMA k 4t .. 4t + 3) and
    the shift pair (codes 4-7, MMA k 4t + 16 ..): e4m3 bytes, int64 [..., 8 slots]."""
    import torch

    r0 = words & E4_LO
    r1 = ((words << 2) & E4_HI_SHL) | ((words >> 2) & E4_HI_SHR)
    return torch.stack([(r >> (8 * i)) & 255 for r in (r0, r1) for i in range(4)], dim=-1)


def decode(packed):
    """Packed codes -> the e4m3 bytes the kernel's decode makes (int64 [..., K], K order), each reading as its
    E2M1 value times 2^-6."""
    return _slots(_words(packed)).transpose(-3, -2).flatten(-4)


def round_hilo(x):
    """Activations (fp32/bf16 [T, K]) as the e4m3 path feeds them: (hi, lo) float8_e4m3fn [T, K] and the per-token
    scale (fp32 [T]), x ~ (hi + lo) * scale."""
    import torch

    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(2.0 ** -100) / E4M3_MAX
    a = x / scale[:, None]
    hi = a.to(torch.float8_e4m3fn)
    lo = (a - hi.float()).to(torch.float8_e4m3fn)
    return hi, lo, scale


def emulate(packed, scales, hi, lo, xscale):
    """What the kernel computes, fragment by fragment, in fp32: for each 32-code block of each row, lane t's A
    slots (its word, decoded) against its B slots (the activations at block positions 8t .. 8t + 7, hi and lo: two
    MMAs into one partial), summed over the 4 lanes and 8 slots; the partial times the block's 2^(scale - 121),
    summed over blocks, times the token's scale. [T, N] fp32. It pairs A and B by lane and slot, as the MMA does, so
    a layout that put a code where its activation is not fails the comparison with ``mxfp4.dequantize``."""
    import torch

    a = _slots(_words(packed)).to(torch.uint8).view(torch.float8_e4m3fn).float()  # [N, chunk, lane, block, slot]
    x = (hi.float() + lo.float()).unflatten(-1, (-1, 4, 4, 8))  # [T, chunk, block, lane, slot]: K = 32b + 8t + s
    part = torch.einsum("njlbs,tjbls->tnjb", a, x)  # [T, N, chunk, block]: sum over lanes l and slots s
    mult = torch.exp2(scales.float() - SCALE_BIAS).unflatten(-1, (-1, 4))  # [N, chunk, block]
    return (part * mult[None]).sum(dim=(-2, -1)) * xscale[:, None]
