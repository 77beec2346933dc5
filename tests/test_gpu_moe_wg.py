"""The staged wgmma e4m3 w13 (k3tune/kernels/moe_experts_wg.py) against torch in fp32 on the MXFP4 format's dequantised
weights and the bf16 activations (quantised to e4m3 hi + lo by ``quantize_into``; that rounding must stay inside the
tolerance, as the block's bf16 path does), outputs poisoned, groups built by the route kernel over skewed routing
(items of 1-8 tokens), random MXFP4 codes and scales, odd sizes: K = 256 (4 steps), I = 64 (one row tile), 5
tokens. Run on the device: pytest -m gpu tests/test_gpu_moe_wg.py"""

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b,k,experts,inter,latent,cfgs", [
    (5, 4, 12, 64, 256, [(2, 1, 1), (3, 2, 2)]), (33, 16, 896, 192, 3584, [(4, 2, 1), (3, 1, 2)]),
    (64, 16, 64, 384, 3584, [(4, 2, 4), (2, 4, 1), (4, 2, 6)])])
def test_wgmma_w13_matches_torch(b, k, experts, inter, latent, cfgs):
    import torch

    from k3tune.kernels import moe_experts, moe_experts_wg, mxfp4
    from k3tune.kernels.moe_experts import Groups
    from k3tune.runtime.moe import situ

    g = torch.Generator(device="cuda").manual_seed(b * 7 + latent)
    y = torch.randn(b, experts + latent, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(experts, device="cuda", generator=g) * 0.1
    bias[: max(k, experts // 8)] += 2.0  # a hot set most tokens share: items of many tokens
    x = (y[:, experts:].float() * torch.exp2(torch.randint(-4, 5, (b, 1), device="cuda").float())).to(torch.bfloat16)
    # random codes and scales around 2^-8 (E2M1 values x 2^-9 .. 2^-7: weights ~ 1/sqrt(K)), so that no copy of all
    # experts in bf16 or fp32 is made: the reference dequantises the experts the routing selects, one at a time
    # (s34-r9: this case's 20 GB of temporaries ran other shards of bench/gpu_suite.sh out of memory)
    codes = torch.randint(0, 256, (experts, 2 * inter, latent // 2), dtype=torch.uint8, device="cuda", generator=g)
    scales = torch.randint(118, 121, (experts, 2 * inter, latent // 32), dtype=torch.uint8, device="cuda",
                           generator=g)
    packed = moe_experts_wg.pack_w13(codes, scales)
    grp = Groups.allocate(experts, b, k, moe_experts_wg.TOKENS, "cuda")
    top = torch.full((b, k), -1, dtype=torch.int32, device="cuda")
    wts = torch.full((b, k), float("nan"), device="cuda")
    moe_experts.route(y, bias, top, wts, k, 1.0, grp)
    torch.cuda.synchronize()
    assert int(grp.counts[:experts].max()) > 1, "the routing shares experts"
    e_ids = top.reshape(-1).long()
    tok = torch.arange(b * k, device="cuda") // k
    h = torch.empty(b * k, 2 * inter, device="cuda")
    for e in e_ids.unique().tolist():
        sel = e_ids == e
        h[sel] = x.float()[tok[sel]] @ mxfp4.dequantize(codes[e], scales[e]).float().T
    act_ref = situ(h[:, :inter], h[:, inter:], 4.0, 25.0)
    for stages, steps, rows in cfgs:  # rows: row tiles a CTA (4 of 6: a last CTA with 2; 2 of 3: one with 1)
        cfg = moe_experts_wg.WgExpertConfig(stages, steps, rows)
        act = torch.full((b * k, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        xq = torch.full((b, 2, latent), 0x7F, dtype=torch.uint8, device="cuda")  # e4m3 NaN
        xs = torch.full((b,), float("nan"), device="cuda")
        moe_experts_wg.quantize_into(x, xq, xs)
        moe_experts_wg.run_w13(cfg, xq, xs, packed, act, grp, 4.0, 25.0)
        torch.cuda.synchronize()
        assert not torch.isnan(act.float()).any(), (cfg, "every slot and row written")
        err = ((act.float() - act_ref).norm() / act_ref.norm()).item()
        assert err < 1e-2, (cfg, err)


@pytest.mark.parametrize("t,k", [(1, 3584), (7, 3584), (3, 2064)])  # 2064: 129 units, one past 128 threads' first
def test_quantize_kernel_matches_torch(t, k):
    import torch

    from k3tune.kernels import moe_experts_wg

    g = torch.Generator(device="cuda").manual_seed(t + k)
    x = torch.randn(t, k, device="cuda", generator=g) * torch.exp2(torch.randint(-20, 20, (t, 1), device="cuda",
                                                                                 generator=g).float())
    x[0, :17] = 0.0
    x = x.to(torch.bfloat16)
    xq = torch.full((t, 2, k), 0x7F, dtype=torch.uint8, device="cuda")
    xs = torch.full((t,), float("nan"), device="cuda")
    moe_experts_wg.quantize_into(x, xq, xs)
    torch.cuda.synchronize()
    ref_q, ref_s = moe_experts_wg.quantize(x)
    assert torch.allclose(xs, ref_s, rtol=1e-6, atol=0)
    hi, lo = (xq[:, i].contiguous().view(torch.float8_e4m3fn).float() for i in (0, 1))
    assert not torch.isnan(hi).any() and not torch.isnan(lo).any()
    back = (hi + lo) * xs[:, None]
    assert (((back - x.float()).norm(dim=1) / x.float().norm(dim=1)) < 3e-3).all()
    assert (hi == ref_q[:, 0].contiguous().view(torch.float8_e4m3fn).float()).float().mean() > 0.99
