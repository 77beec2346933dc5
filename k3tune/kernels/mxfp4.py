"""MXFP4 weights (OCP Microscaling v1.0), the format K3 ships its routed experts in.

Each row is cut along K into blocks of 32 values; a block stores one E8M0 scale byte (2^(s - 127)) and 32
E2M1 codes (sign bit + 3 magnitude bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes per byte, the even index in
the low nibble. A [N, K] matrix is a uint8 [N, K / 2] code tensor and a uint8 [N, K / 32] scale tensor.

This module is the format's reference in torch (any device): the quantiser used to make test and benchmark
weights from bf16, and the dequantiser that every MXFP4 kernel is checked against.
"""

from __future__ import annotations

BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # round to nearest magnitude
_EMAX = 2  # 6 = 1.5 x 2^2: a block's largest value lands in [4, 8) before rounding


def quantize(w):
    """bf16/fp32 [..., K] -> (codes uint8 [..., K/2], scales uint8 [..., K/32]). K must be a multiple of 32."""
    import torch

    from k3tune.errors import ConfigError

    if w.shape[-1] % BLOCK:
        raise ConfigError(f"MXFP4 needs K to be a multiple of {BLOCK}, got {w.shape[-1]}")
    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - _EMAX,
                      torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp)
    mids = torch.tensor(_MIDPOINTS, device=w.device)
    mag = torch.bucketize(scaled.abs().clamp_max(6.0), mids).to(torch.uint8)
    codes = (mag | ((scaled < 0).to(torch.uint8) << 3)).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8).contiguous()


def dequantize(codes, scales, dtype=None):
    """(codes uint8 [..., K/2], scales uint8 [..., K/32]) -> [..., K] in ``dtype`` (default bf16)."""
    import torch

    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=codes.device)
    k = codes.shape[-1] * 2
    vals = torch.stack((lut[(codes & 0xF).long()], lut[(codes >> 4).long()]), dim=-1).reshape(*codes.shape[:-1], k)
    scale = torch.exp2(scales.float() - 127.0).repeat_interleave(BLOCK, dim=-1)
    return (vals * scale).to(dtype or torch.bfloat16)


def nbytes(n: int, k: int) -> int:
    """Bytes an [n, k] MXFP4 matrix occupies (codes + scales)."""
    return n * k // 2 + n * k // BLOCK
