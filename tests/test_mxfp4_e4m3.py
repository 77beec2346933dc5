"""The e4m3 layout of MXFP4 codes (``k3tune.kernels.mxfp4_e4m3``): exact round trip, an exact decode of every code,
and the fragment-by-fragment emulation of the kernel it is for against the format's dequantiser. CPU only."""

import pytest
import torch

from k3tune.errors import ConfigError
from k3tune.kernels import mxfp4
from k3tune.kernels import mxfp4_e4m3 as e4


def _codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(torch.uint8)


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 128), (7, 1792)])  # K = 128, 256, 3584
def test_pack_round_trips_exactly(shape):
    codes = _codes(*shape)
    packed = e4.pack(codes)
    assert packed.shape == codes.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed, codes)
    assert torch.equal(e4.unpack(packed), codes)


def test_every_code_decodes_to_its_value_times_2_to_the_minus_6():
    codes = torch.arange(256, dtype=torch.int64).repeat(4).to(torch.uint8)[None, :]  # all pairs, K = 2048
    got = e4.decode(e4.pack(codes)).to(torch.uint8).view(torch.float8_e4m3fn).float() * 64
    want = mxfp4.dequantize(codes, torch.full((1, 2048 // 32), 127, dtype=torch.uint8), torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0


def test_emulated_kernel_matches_the_dequantised_weights():
    n, k, t = 5, 384, 3
    codes = _codes(n, k // 2, seed=1)
    scales = torch.randint(110, 135, (n, k // 32), generator=torch.Generator().manual_seed(2)).to(torch.uint8)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(3))
    hi, lo, xs = e4.round_hilo(x)
    got = e4.emulate(e4.pack(codes), scales, hi, lo, xs)
    want = ((hi.float() + lo.float()) * xs[:, None]) @ mxfp4.dequantize(codes, scales, torch.float32).t()
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    # the emulation pairs A and B by lane: codes moved to another lane's slots no longer meet their activations
    swapped = e4.pack(codes).unflatten(-1, (-1, 4, 16))[..., [1, 0, 2, 3], :].flatten(-3)
    wrong = e4.emulate(swapped, scales, hi, lo, xs)
    assert ((wrong - want).norm() / want.norm()).item() > 1e-2


def test_hi_lo_activations_hold_bf16_precision():
    x = torch.randn(4, 3584, generator=torch.Generator().manual_seed(4))
    x[:, :8] *= 30  # outlier channels
    hi, lo, xs = e4.round_hilo(x)
    assert hi.dtype == lo.dtype == torch.float8_e4m3fn
    assert torch.equal(hi.float().abs().amax(-1), torch.full((4,), e4.E4M3_MAX))
    err = ((hi.float() + lo.float()) * xs[:, None] - x).norm() / x.norm()
    one = (hi.float() * xs[:, None] - x).norm() / x.norm()
    bf16 = (x.bfloat16().float() - x).norm() / x.norm()
    assert err < bf16 < one
    zero = e4.round_hilo(torch.zeros(1, 128))
    assert not zero[0].float().any() and torch.isfinite(zero[2]).all()


def test_pack_refuses_a_k_that_is_not_whole_chunks():
    with pytest.raises(ConfigError, match="multiple of 128"):
        e4.pack(_codes(2, 96))  # K = 192: TP16's w2
