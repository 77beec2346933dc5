"""The tensor-core grouped expert kernels (k3tune/kernels/moe_experts_tc.py) against torch in fp32, bf16 and
MXFP4 weights (MXFP4 checked against the format's reference dequantiser), outputs poisoned, groups built by
the route kernel over skewed routing (items of up to 8 and 16 tokens of one expert), odd widths: K = 96
(MXFP4: three 32-code blocks, a partial 128-wide chunk), K = 3584, rows not a multiple of the CTA's.
Run on the device: pytest -m gpu tests/test_gpu_moe_tc.py"""

import itertools

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b,k,experts,inter,latent,fmt", [
    (5, 4, 12, 160, 224, "bf16"), (5, 4, 12, 160, 224, "mxfp4"), (33, 16, 896, 192, 3584, "bf16"),
    (33, 16, 896, 192, 3584, "mxfp4"), (64, 16, 64, 96, 512, "mxfp4")])
def test_tensor_core_expert_kernels_match_torch(b, k, experts, inter, latent, fmt):
    import torch

    from k3tune.kernels import moe_experts, moe_experts_tc, mxfp4
    from k3tune.kernels.moe_experts import Groups
    from k3tune.kernels.moe_experts_tc import TcExpertConfig
    from k3tune.runtime.moe import situ

    g = torch.Generator(device="cuda").manual_seed(b * 7 + latent)
    y = torch.randn(b, experts + latent, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(experts, device="cuda", generator=g) * 0.1
    bias[: max(k, experts // 8)] += 2.0  # a hot set most tokens share: items of many tokens
    x = y[:, experts:].contiguous()
    w13 = (torch.randn(experts, 2 * inter, latent, device="cuda", generator=g) / latent ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, latent, inter, device="cuda", generator=g) / inter ** 0.5).to(torch.bfloat16)
    if fmt == "mxfp4":
        (c13, s13), (c2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        moe_experts_tc.check_scales(s13)
        moe_experts_tc.check_scales(s2)
        w13_ref, w2_ref = mxfp4.dequantize(c13, s13).float(), mxfp4.dequantize(c2, s2).float()
        packed13, packed2 = moe_experts_tc.pack_codes(c13), moe_experts_tc.pack_codes(c2)  # the dq = 1 layout
    else:
        w13_ref, w2_ref = w13.float(), w2.float()
    knobs = [TcExpertConfig(1, 2, 2, 1, 2, pf=1), TcExpertConfig(2, 1, 4, 2, 1, early=0, rl=2, dq=1, pf=2),
             TcExpertConfig(1, 4, 1, 2, 2, dq=1), TcExpertConfig(2, 2, 2, 1, 1, early=0, rl=4, pf=2),
             TcExpertConfig(2, 2, 1, 4, 1, rl=3, dq=1, pf=1), TcExpertConfig(1, 2, 2, 4, 1, rl=8, dq=1)]
    # both epilogues (early loads on and off), both MXFP4 decode layouts (dq) and L2 prefetch on and off (pf; the
    # last rows of the last expert: a prefetch past its end would fault) on each side, one row tile or several per
    # item (rl; groups that run past the last row tile: 5 w13 tiles in groups of 2 at inter 160); the last pair:
    # 32-token items
    pairs = [*itertools.product(knobs[:2], knobs[2:4]), (knobs[4], knobs[5])]
    # the weight ring: 2-4 stages, 1-2 chunks a batch, both MXFP4 layouts, both epilogues
    pairs += [(TcExpertConfig(1, 2, 2, 1, 1, ring=3), TcExpertConfig(1, 4, 1, 1, 2, rl=4, dq=1, ring=2)),
              (TcExpertConfig(2, 2, 1, 2, 1, rl=2, dq=1, ring=4), TcExpertConfig(2, 2, 2, 1, 1, early=0, ring=3)),
              (TcExpertConfig(1, 2, 2, 1, 2, ring=2), TcExpertConfig(1, 4, 1, 1, 2, rl=4))]
    for cfg13, cfg2 in pairs:
        if fmt == "mxfp4":
            args13 = (packed13 if cfg13.dq else c13, dict(scales=s13))
            args2 = (packed2 if cfg2.dq else c2, dict(scales=s2))
        else:
            args13, args2 = (w13, {}), (w2, {})
        per = min(cfg13.tokens, cfg2.tokens)
        grp = Groups.allocate(experts, b, k, per, "cuda")
        top = torch.full((b, k), -1, dtype=torch.int32, device="cuda")
        wts = torch.full((b, k), float("nan"), device="cuda")
        moe_experts.route(y, bias, top, wts, k, 1.0, grp)
        e_ids = top.reshape(-1).long()
        tok = torch.arange(b * k, device="cuda") // k
        h = torch.einsum("tk,tnk->tn", x.float()[tok], w13_ref[e_ids])
        act_ref = situ(h[:, :inter], h[:, inter:], 4.0, 25.0)
        act = torch.full((b * k, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_experts_tc.run_w13(cfg13, x, args13[0], act, wts, grp, 4.0, 25.0, **args13[1])
        out = torch.full((b * k, latent), float("nan"), device="cuda")
        moe_experts_tc.run_w2(cfg2, act, args2[0], out, wts, grp, **args2[1])
        torch.cuda.synchronize()
        assert int(grp.counts[:experts].max()) > 1, "the routing shares experts"
        knob = (fmt, cfg13, cfg2)
        assert ((act.float() - act_ref).norm() / act_ref.norm()).item() < 1e-2, knob
        out_ref = wts.reshape(-1, 1) * torch.einsum("tn,tkn->tk", act.float(), w2_ref[e_ids])
        assert ((out - out_ref).norm() / out_ref.norm()).item() < 1e-2, knob



def test_a_kernel_loaded_from_the_disk_cache_runs_like_the_compiled_one(tmp_path, monkeypatch):
    """The cache's loaded object launches on the GPU and gives bit-identical results (and captures)."""
    import torch

    from k3tune.kernels import moe_experts, moe_experts_tc
    from k3tune.kernels.moe_experts import Groups
    from k3tune.kernels.moe_experts_tc import TcExpertConfig

    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", str(tmp_path))
    g = torch.Generator(device="cuda").manual_seed(0)
    b, k, experts, inter, latent = 8, 4, 16, 64, 256
    y = torch.randn(b, experts + latent, device="cuda", generator=g).to(torch.bfloat16)
    x = y[:, experts:].contiguous()
    w13 = (torch.randn(experts, 2 * inter, latent, device="cuda", generator=g) / 16).to(torch.bfloat16)
    cfg = TcExpertConfig(1, 2, 2, 1, 2)
    outs = []
    for _ in range(2):  # compiled (and written), then loaded from the file
        moe_experts_tc.compiled.cache_clear()
        grp = Groups.allocate(experts, b, k, cfg.tokens, "cuda")
        top = torch.full((b, k), -1, dtype=torch.int32, device="cuda")
        wts = torch.empty(b, k, device="cuda")
        moe_experts.route(y, torch.zeros(experts, device="cuda"), top, wts, k, 1.0, grp)
        act = torch.full((b * k, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_experts_tc.run_w13(cfg, x, w13, act, wts, grp, 4.0, 25.0)
        torch.cuda.synchronize()
        outs.append(act.clone())
    assert list(tmp_path.glob("moe_tc_w13-*.o"))
    assert not torch.isnan(outs[1]).any() and torch.equal(outs[0], outs[1])
