"""The staged wgmma e4m3 w13 (k3tune/kernels/moe_experts_wg.py) on the CPU: its weight layout read back through the
kernel's own thread/register/bit mapping equals the format's dequantiser exactly; it compiles for sm_90a over a
sample of its knobs; it refuses what it cannot run (another architecture, K or I it cannot tile, items that are not
8 tokens). GPU numerics: tests/test_gpu_moe_wg.py."""

import warnings

import pytest


def _e4m3(byte: int) -> float:
    import torch

    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


def test_blob_layout_decodes_to_the_mxfp4_values_exactly():
    """Each thread's code words, decoded as the kernel decodes them (the AND for row g, the shift pair for row g + 8),
    read as e4m3 at the A fragment's (row, K) and scaled by the scale word's byte, give dequantize's value."""
    import torch

    from k3tune.kernels import moe_experts_wg as wg
    from k3tune.kernels import mxfp4

    torch.manual_seed(3)
    n, k = 128, 128
    w = torch.randn(n, k) * torch.exp2(torch.randint(-8, 4, (n, 1)).float())
    w[5, :40] = 0.0  # zero blocks and E2M1's subnormal codes
    codes, scales = mxfp4.quantize(w)
    ref = mxfp4.dequantize(codes, scales, dtype=torch.float32)
    blob = wg.pack_blobs(codes, scales).reshape(n // 64, k // 64, wg.BLOB).to(torch.int64) & 0xFFFFFFFF
    got = torch.full((n, k), float("nan"))
    lut = [_e4m3(b) for b in range(256)]
    for c in range(n // 64):
        for s in range(k // 64):
            for tid in range(128):
                w4, g, t = tid // 32, (tid % 32) // 4, tid % 4
                sw = int(blob[c, s, 512 + tid])
                for b in range(2):
                    for h in range(2):
                        word = int(blob[c, s, 4 * tid + 2 * b + h])
                        regs = (word & wg.LO_MASK, ((word << 2) & wg.HI_SHL) | ((word >> 2) & wg.HI_SHR))
                        for r in range(2):
                            e = (sw >> (8 * (2 * b + r))) & 255
                            for i in range(4):
                                got[64 * c + 16 * w4 + g + 8 * r, 64 * s + 32 * b + 16 * h + 4 * t + i] = (
                                    lut[(regs[r] >> (8 * i)) & 255] * 64 * 2.0 ** (e - 127))
    assert not torch.isnan(got).any()
    assert torch.equal(got, ref)


def test_pack_w13_in_chunks_equals_one_pass():
    import torch

    from k3tune.kernels import moe_experts_wg as wg

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (3, 256, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 130, (3, 256, 4), dtype=torch.uint8, generator=g)
    whole = wg.pack_blobs(codes.reshape(-1, 64), scales.reshape(-1, 4))
    packed = wg.pack_w13(codes, scales, chunk_rows=192)
    assert torch.equal(packed.data, whole) and (packed.experts, packed.rows, packed.k) == (3, 256, 128)


def test_quantize_hi_plus_lo_is_close_to_the_activations():
    import torch

    from k3tune.kernels import moe_experts_wg as wg

    x = torch.randn(5, 384) * torch.tensor([1e-3, 1.0, 30.0, 1e2, 7.0])[:, None]
    q, s = wg.quantize(x)
    assert q.dtype == torch.uint8 and tuple(q.shape) == (5, 2, 384)
    hi, lo = (q[:, i].contiguous().view(torch.float8_e4m3fn).float() for i in (0, 1))
    back = (hi + lo) * s[:, None]
    assert ((back - x).norm(dim=1) / x.norm(dim=1)).max() < 3e-3


@pytest.mark.parametrize("stages,steps,rows,k", [(4, 2, 1, 3584), (3, 1, 2, 3584), (2, 4, 3, 3584), (2, 1, 1, 256)])
def test_wgmma_w13_compiles_for_hopper(stages, steps, rows, k):
    from k3tune.kernels import moe_experts_wg as wg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert wg.compiled(stages, steps, rows, k, 4.0, 25.0, "sm_90a") is not None
        assert wg.compiled_quantize(k, "sm_90a") is not None


def test_wgmma_w13_refuses_what_it_cannot_run():
    import torch

    from k3tune.errors import CannotImplement, ConfigError
    from k3tune.kernels import moe_experts_wg as wg
    from k3tune.kernels.moe_experts import Groups

    cfg = wg.WgExpertConfig(4, 2)
    wg.check(cfg, 3584, 384, "sm_90a")
    with pytest.raises(CannotImplement, match="sm_90a only"):
        wg.check(cfg, 3584, 384, "sm_100a")
    with pytest.raises(CannotImplement, match="multiple of 128"):
        wg.check(cfg, 3520, 384, "sm_90a")
    with pytest.raises(CannotImplement, match="multiple of 128"):
        wg.check(cfg, 3584, 96, "sm_90a")
    with pytest.raises(CannotImplement, match="pairs of stages"):
        wg.check(wg.WgExpertConfig(4, 3), 3584, 384, "sm_90a")  # 56 steps are not pairs of 3-step stages
    with pytest.raises(CannotImplement, match="pairs of stages"):
        wg.check(wg.WgExpertConfig(4, 2, 0), 3584, 384, "sm_90a")
    with pytest.raises(CannotImplement, match="shared memory"):
        wg.check(wg.WgExpertConfig(16, 4), 3584, 384, "sm_90a")
    with pytest.raises(ConfigError, match="R and K multiples of 64"):
        wg.pack_blobs(torch.zeros(96, 64, dtype=torch.uint8), torch.zeros(96, 4, dtype=torch.uint8))
    packed = wg.pack_w13(torch.zeros(2, 128, 64, dtype=torch.uint8), torch.zeros(2, 128, 4, dtype=torch.uint8))
    groups = Groups.allocate(2, 4, 2, 4, "cpu")
    with pytest.raises(ConfigError, match="work items of 8 tokens"):
        wg.run_w13(cfg, torch.zeros(4, 2, 128, dtype=torch.uint8), torch.ones(4), packed,
                   torch.empty(8, 64, dtype=torch.bfloat16), groups, 4.0, 25.0)
    groups8 = Groups.allocate(2, 4, 2, 8, "cpu")
    with pytest.raises(ConfigError, match=r"act must be a contiguous bfloat16 \(8, 64\), got bfloat16 \(8, 32\)"):
        wg.run_w13(cfg, torch.zeros(4, 2, 128, dtype=torch.uint8), torch.ones(4), packed,
                   torch.empty(8, 32, dtype=torch.bfloat16), groups8, 4.0, 25.0)
    with pytest.raises(ConfigError, match="xq must be a contiguous uint8"):
        wg.quantize_into(torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 128), torch.ones(4))
    with pytest.raises(CannotImplement, match="multiple of 16"):
        wg.compiled_quantize(120, "sm_90a")
