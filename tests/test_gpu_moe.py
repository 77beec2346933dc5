"""The MoE block executor at K3's true per-rank shapes on a GPU: the tuned path runs the measured kernels of
the shipped database (asserted from the block's own report), matches the fp32 reference for bf16 and MXFP4
experts, captures into a CUDA graph, and runs the shared experts in a green-context SM partition.
Run on the device: pytest -m gpu tests/test_gpu_moe.py"""

import pytest

from k3tune.runtime.moe import BlockShape, MoEBlock, random_weights, reference, routing_agrees, virtual_full
from k3tune.shipped import configs_dir

pytestmark = pytest.mark.gpu

K3 = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")


def _check(blk, w, tokens, seed=0):
    import torch

    x = torch.randn(tokens, K3.hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    x = x.to(torch.bfloat16)
    out = blk(x)
    full = virtual_full(w)
    _, _, biased = reference(x, full, K3)
    assert routing_agrees(blk.last_top, biased, K3)
    ref, _, _ = reference(x, full, K3, top=blk.last_top)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
    return x, out


def _replays_to(blk, x, want):
    """The block captured in a CUDA graph replays, twice, to ``want`` bit for bit (its output poisoned first)."""
    import torch

    graph, out = _captured(blk, x)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def _captured(blk, x):
    """(graph, output) of the block captured in a CUDA graph, after a warm-up on the capture stream."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        blk(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = blk(x)
    return graph, out


@pytest.mark.parametrize("tp,batch,fmt", [(16, 1, "bf16"), (16, 8, "mxfp4"), (8, 4, "bf16"), (8, 64, "bf16")])
def test_tuned_block_runs_measured_kernels_and_matches(tp, batch, fmt):
    from k3tune.runtime import Selector

    sel = Selector.load()  # the detected H200: the shipped measured database
    w = random_weights(K3, tp, fmt=fmt, device="cuda", seed=batch)
    blk = MoEBlock.build(w, "tuned", batch=batch, selector=sel)
    for op in ("moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2"):
        assert "(measured" in blk.ran[op] and "instead of" not in blk.ran[op], blk.ran[op]  # no cuBLAS fallback
    _check(blk, w, batch)


def test_mxfp4_block_on_repacked_codes_matches():
    """Expert kernels that decode the dq = 1 layout: the block repacks the codes once and matches the reference."""
    from dataclasses import replace

    from k3tune.kernels import moe_experts_tc
    from k3tune.runtime import Selector

    c13, c2, per = moe_experts_tc.default_config(8)
    w = random_weights(K3, 16, fmt="mxfp4", device="cuda", seed=11)
    blk = MoEBlock.build(w, "tuned", batch=8, selector=Selector.load(),
                         experts_cfg=(replace(c13, dq=1), replace(c2, dq=1), per))
    assert "dq=1" in blk.ran["experts"], blk.ran["experts"]
    # the block holds the codes in the kernels' layout only, not K3's order beside them
    assert isinstance(blk.weights.w13[0], moe_experts_tc.PackedCodes)
    assert isinstance(blk.weights.w2[0], moe_experts_tc.PackedCodes)
    assert not any(v is w.w13[0] or v is w.w2[0] for v in blk._cache.values())
    _check(blk, w, 8)
    # built again from the repacked weights with K3-order kernels: unpacked, and still right
    blk0 = MoEBlock.build(blk.weights, "tuned", batch=8, selector=Selector.load(), experts_cfg=(c13, c2, per))
    assert not isinstance(blk0.weights.w13[0], moe_experts_tc.PackedCodes)
    _check(blk0, w, 8)


@pytest.mark.parametrize("tp", [8, 16])
def test_stock_block_matches(tp):
    w = random_weights(K3, tp, device="cuda", seed=tp)
    _check(MoEBlock.build(w, "stock", batch=2), w, 2)


def test_tuned_block_captures_in_a_cuda_graph():
    import torch

    from k3tune.runtime import Selector

    w = random_weights(K3, 16, device="cuda", seed=3)
    blk = MoEBlock.build(w, "tuned", batch=4, selector=Selector.load())
    x, eager = _check(blk, w, 4)
    graph, out = _captured(blk, x)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), eager.float(), rtol=1e-2, atol=1e-2)


def test_shared_experts_in_a_green_context_partition():
    from k3tune.runtime import Selector
    from k3tune.runtime.partition import green_partition

    part = green_partition(16)
    try:
        assert part.sms == 16
        w = random_weights(K3, 16, device="cuda", seed=5)
        blk = MoEBlock.build(w, "tuned", batch=8, selector=Selector.load(), shared_stream=part.stream)
        assert blk.ran["shared"] == "side stream (green context, 16 SMs), forked after the router GEMM"
        _check(blk, w, 8)
    finally:
        part.close()


def test_partitions_and_side_streams_are_made_on_the_current_device():
    """A TP rank sets its own device (bench/moe_group.py: torch.cuda.set_device(rank)); the block's green contexts
    and plain side stream must be made there, not on device 0, or its shared experts would run on another GPU."""
    import torch

    from k3tune.runtime.partition import plain_stream, shared_partition

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (a multi-GPU device kind)")
    with torch.cuda.device(1):
        x = torch.ones(1024, device="cuda:1")  # as a rank's weights are, before its blocks are built
        split, plain = shared_partition(16), plain_stream()
        assert split.shared.stream.device == torch.device("cuda", 1) == split.rest.stream.device == plain.device
        for s in (split.shared.stream, plain):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                y = x * 2
            torch.cuda.current_stream().wait_stream(s)
            assert torch.equal(y, torch.full_like(x, 2.0))
    assert shared_partition(16).shared.stream.device == torch.device("cuda", 0)


def test_shared_experts_on_a_plain_stream_fork_after_the_router_gemm_match_and_capture():
    """``shared_sms = "all"`` (a plain side stream, every SM) as a sweep builds it: the shared experts are started
    by the routed chain right after the router GEMM (the order of the calls that queue them), and the block matches
    the reference eagerly and replayed from a CUDA graph."""
    import torch

    from k3tune.kernels import family
    from k3tune.plan.problems import Problem
    from k3tune.runtime import Selector

    p = Problem("moe.block", "moe_block", (("tp", 16), ("M", 8), ("experts", 896), ("top_k", 16), ("latent", 3584),
                                           ("inter", 192), ("shared_inter", 384), ("hidden", 7168),
                                           ("format", "bf16"), ("routing", "uniform")))
    fam = family("moe.overlap")
    cfg = fam.config_from_params(p, {**fam.default_config(p).params(), "shared_sms": "all"})
    assert fam.valid(cfg, p)
    w = random_weights(K3, 16, device="cuda", seed=7)
    blk = MoEBlock.build(w, "tuned", batch=8, selector=Selector.load(), **fam.block_knobs(cfg))
    assert blk.ran["shared"] == "side stream (plain, every SM), forked after the router GEMM"
    assert blk.ran["routed"] == "the current stream (every SM)"
    calls = []
    router, shared = blk._gemms["moe.router_latent"], blk._shared
    blk._gemms["moe.router_latent"] = lambda x: (calls.append("router"), router(x))[1]
    blk._shared = lambda x: (calls.append("shared"), shared(x))[1]
    x, eager = _check(blk, w, 8)
    assert calls == ["router", "shared"]
    graph, out = _captured(blk, x)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), eager.float(), rtol=1e-2, atol=1e-2)


def test_a_real_split_shared_on_16_sms_routed_on_the_rest_matches_and_captures():
    """The SMs split in two green contexts: the shared experts on 16, the routed experts on the other 116;
    the block matches the reference eagerly and replayed from a CUDA graph."""
    import torch

    from k3tune.runtime import Selector
    from k3tune.runtime.partition import green_split

    split = green_split(16)
    try:
        total = torch.cuda.get_device_properties(0).multi_processor_count
        assert split.shared.sms == 16 and split.rest.sms == total - 16
        w = random_weights(K3, 16, device="cuda", seed=6)
        blk = MoEBlock.build(w, "tuned", batch=8, selector=Selector.load(), shared_stream=split.shared.stream,
                             routed_stream=split.rest.stream)
        assert blk.ran["routed"] == f"stream (green context, {total - 16} SMs)"
        x, eager = _check(blk, w, 8)
        graph, out = _captured(blk, x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    finally:
        split.close()


@pytest.mark.parametrize("b,k,experts,inter,latent", [(3, 4, 16, 96, 264), (9, 4, 40, 64, 128), (1, 16, 896, 384, 3584),
                                                      (64, 16, 896, 192, 3584), (33, 16, 896, 384, 3584)])
def test_routed_expert_kernels_match_torch(b, k, experts, inter, latent):
    """Route (with the grouping by expert), w13+SiTU, w2 and the slot sum + RMSNorm kernels against torch in
    fp32, outputs poisoned, over odd widths and expert counts (40: a partial last warp chunk), several knob
    sets (lanes per row 4-32) and tokens per work item (1, 2, 4, 8: partial items); b=9: every token picks expert 0, so items
    hold several tokens of one expert; b=33 with Zipf-like bias: shared and unshared experts mixed."""
    import itertools

    import torch

    from k3tune.kernels import moe_experts
    from k3tune.kernels.moe_experts import ExpertKernelConfig, Groups
    from k3tune.runtime.moe import situ

    g = torch.Generator(device="cuda").manual_seed(b * 131 + experts)
    y = torch.randn(b, experts + latent, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(experts, device="cuda", generator=g) * 0.1
    if b == 9:
        bias[0] = 10.0
    if b == 33:
        bias[:24] += 1.5  # a hot set most tokens share
    x = y[:, experts:].contiguous()
    w13 = (torch.randn(experts, 2 * inter, latent, device="cuda", generator=g) / latent ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, latent, inter, device="cuda", generator=g) / inter ** 0.5).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(latent, device="cuda", generator=g)).to(torch.bfloat16)
    s = torch.sigmoid(y[:, :experts].float())
    kth = torch.topk(s + bias, k, dim=-1).values[:, -1:]
    knobs = zip(itertools.product((1, 4), (2, 4), (1, 4), (32, 16)), itertools.product((4, 8), (1, 4), (1, 2)),
                itertools.cycle((8, 32, 4, 16)), itertools.cycle((1, 2, 4, 8)))
    for (r13, w13w, u13, l13), (r2, w2w, u2), l2, per in knobs:
        grp = Groups.allocate(experts, b, k, per, "cuda")
        top = torch.full((b, k), -1, dtype=torch.int32, device="cuda")
        wts = torch.full((b, k), float("nan"), device="cuda")
        moe_experts.route(y, bias, top, wts, k, 1.0, grp)
        chosen = (s + bias).gather(1, top.long())
        assert bool((chosen >= kth - 1e-3).all()) and all(len(set(r.tolist())) == k for r in top)
        ref_w = s.gather(1, top.long())
        assert torch.allclose(wts, ref_w / ref_w.sum(-1, keepdim=True), rtol=1e-3, atol=1e-5)
        counts = torch.bincount(top.reshape(-1).long(), minlength=experts)
        assert torch.equal(grp.counts[:experts].long(), counts)
        assert int(grp.counts[experts]) == int(((counts + per - 1) // per).sum())
        for e in counts.nonzero().flatten().tolist():  # each expert's slot list: exactly its slots
            listed = sorted(grp.slots[e, :counts[e]].tolist())
            assert listed == (top.reshape(-1) == e).nonzero().flatten().tolist()

        e_ids = top.reshape(-1).long()
        tok = torch.arange(b * k, device="cuda") // k
        h = torch.einsum("tk,tnk->tn", x.float()[tok], w13.float()[e_ids])
        act_ref = situ(h[:, :inter], h[:, inter:], 4.0, 25.0)
        act = torch.full((b * k, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_experts.run_w13(ExpertKernelConfig(r13, w13w, u13, l13), x, w13, act, wts, grp, 4.0, 25.0)
        out = torch.full((b * k, latent), float("nan"), device="cuda")
        moe_experts.run_w2(ExpertKernelConfig(r2, w2w, u2, l2), act, w2, out, wts, grp)
        normed = torch.full((b, latent), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_experts.sum_norm(out, norm_w, normed, k, 1e-5, grp)
        torch.cuda.synchronize()
        knob = (r13, w13w, u13, l13, r2, w2w, u2, l2, per)
        assert ((act.float() - act_ref).norm() / act_ref.norm()).item() < 1e-2, knob
        out_ref = wts.reshape(-1, 1) * torch.einsum("tn,tkn->tk", act.float(), w2.float()[e_ids])
        assert ((out - out_ref).norm() / out_ref.norm()).item() < 1e-3, knob
        summed = out.view(b, k, latent).sum(1)
        norm_ref = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()
        assert ((normed.float() - norm_ref).norm() / norm_ref.norm()).item() < 1e-2, knob
        assert int(grp.counts.abs().sum()) == 0, "sum_norm resets the groups for the next step"
        if latent % 32 == 0:  # the slice sum a row-parallel up-projection's emulated ranks multiply
            sl = torch.full((b, latent // 8), float("nan"), dtype=torch.bfloat16, device="cuda")
            moe_experts.sum_norm(out, norm_w, sl, k, 1e-5, grp, slices=8)
            sl_ref = norm_ref.view(b, 8, latent // 8).sum(1)
            assert ((sl.float() - sl_ref).norm() / sl_ref.norm()).item() < 1e-2, knob

    grp = Groups.allocate(experts, b, k, 2, "cuda")
    forced = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:k] for _ in range(b)]).int()
    top_f, wts_f = forced.clone(), torch.full((b, k), float("nan"), device="cuda")
    moe_experts.route(y, bias, top_f, wts_f, k, 1.0, grp, forced=True)
    ref_f = s.gather(1, forced.long())
    assert torch.equal(top_f, forced) and torch.allclose(wts_f, ref_f / ref_f.sum(-1, keepdim=True), rtol=1e-3)
    assert torch.equal(grp.counts[:experts].long(), torch.bincount(forced.reshape(-1).long(), minlength=experts))

    hs = torch.randn(b, 2 * inter, device="cuda", generator=g).to(torch.bfloat16) * 3
    sa = torch.full((b, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_experts.situ_rows(hs, sa, 4.0, 25.0)
    ref_sa = situ(hs[:, :inter].float(), hs[:, inter:].float(), 4.0, 25.0)
    assert ((sa.float() - ref_sa).norm() / ref_sa.norm()).item() < 1e-2


@pytest.mark.parametrize("method", ["redux", "select"])
@pytest.mark.parametrize("b,k,experts,spread,bias_at", [(64, 16, 896, 0.0, 0.0), (64, 16, 896, 2.0, 0.0),
                                                         (7, 4, 40, 1.0, -5.0), (33, 32, 896, 0.5, 0.3),
                                                         (5, 1, 70, 0.0, 0.0), (9, 16, 896, 1.0, 0.0)])
def test_the_fast_routes_choose_and_weigh_as_the_shuffle_route(method, b, k, experts, spread, bias_at, monkeypatch):
    """``ROUTE_REDUX`` (off) / ``ROUTE_SELECT`` (on since session 46): the same experts, in the same order, the same
    weights bit for bit and the same groups as the shuffle route; the kernel that ran is the named one. ``spread`` 0:
    the scores rounded to halves, so many experts tie (ties go to the lowest id; for select, more than 32 candidates:
    its redux fallback); negative scores + bias; a partial last warp chunk (40, 70 experts); k = 1 and 32. Which of
    select's two branches each token takes is counted on the host (both are taken over the cases: see the next test)."""
    import torch

    from k3tune.kernels import moe_experts
    from k3tune.kernels.moe_experts import Groups

    y, bias = _route_inputs(b, k, experts, spread, bias_at)
    seen, real = [], moe_experts.compiled

    def spy(kind, knobs, arch, pdl=0):
        if kind == "route":
            seen.append(knobs)
        return real(kind, knobs, arch, pdl)

    monkeypatch.setattr(moe_experts, "compiled", spy)
    got = {}
    for name in ("shuffle", method):
        monkeypatch.setattr(moe_experts, "ROUTE_REDUX", name == "redux")
        monkeypatch.setattr(moe_experts, "ROUTE_SELECT", name == "select")
        grp = Groups.allocate(experts, b, k, 2, "cuda")
        top = torch.full((b, k), -1, dtype=torch.int32, device="cuda")
        wts = torch.full((b, k), float("nan"), device="cuda")
        moe_experts.route(y, bias, top, wts, k, 2.5, grp)
        torch.cuda.synchronize()
        got[name] = (top, wts, grp.counts.clone())
    assert [len(kn) for kn in seen] == [5, 7] and seen[1][5] == method and seen[1][6] is False, seen
    for a, c in zip(got[method], got["shuffle"]):
        assert torch.equal(a, c)
    s = torch.sigmoid(y[:, :experts].float()) + bias
    kth = torch.topk(s, k, dim=-1).values[:, -1:]
    assert bool((s.gather(1, got[method][0].long()) >= kth - 1e-3).all())


def _route_inputs(b, k, experts, spread, bias_at):
    import torch

    g = torch.Generator(device="cuda").manual_seed(b * 7 + k)
    y = torch.randn(b, experts + 64, device="cuda", generator=g)
    if spread == 0.0:
        y = (y * 2).round() / 2
    y = y.to(torch.bfloat16)
    return y, torch.randn(experts, device="cuda", generator=g) * spread * 0.1 + bias_at


def _select_candidates(y, bias, k, experts):
    """Per token, how many keys the select route's bound admits (its redux fallback past 32), on the host."""
    import torch

    s = torch.sigmoid(y[:, :experts].float()) + bias
    pad = torch.full((s.shape[0], -(-experts // 32) * 32), float("-inf"), device=s.device)
    pad[:, :experts] = s
    lane_max = pad.view(s.shape[0], -1, 32).amax(1)  # expert e sits in lane e % 32
    bound = torch.topk(lane_max, k, dim=-1).values[:, -1:]
    return (s >= bound).sum(-1)


def test_the_select_routes_cases_take_both_of_its_branches():
    """The cases above give the select route tokens under its 32-candidate bound (the sort) and over it (the
    redux rounds): each branch is compared with the shuffle route there, not left to a silent fallback."""
    counts = []
    for b, k, experts, spread, bias_at in [(64, 16, 896, 0.0, 0.0), (64, 16, 896, 2.0, 0.0), (7, 4, 40, 1.0, -5.0),
                                           (33, 32, 896, 0.5, 0.3), (5, 1, 70, 0.0, 0.0), (9, 16, 896, 1.0, 0.0)]:
        y, bias = _route_inputs(b, k, experts, spread, bias_at)
        counts.append(_select_candidates(y, bias, k, experts))
    import torch

    c = torch.cat(counts)
    assert int((c <= 32).sum()) > 0 and int((c > 32).sum()) > 0, c.tolist()


@pytest.mark.parametrize("b,k,latent,slices,cluster", [(1, 16, 3584, 16, 8), (5, 16, 3584, 8, 8), (64, 16, 3584, 1, 8),
                                                        (3, 4, 264, 1, 2), (2, 3, 240, 1, 4), (2, 3, 400, 2, 2),
                                                        (7, 5, 1000, 2, 1), (2, 3, 4100, 1, 1), (2, 16, 3584, 16, 8)])
def test_sum_norm_spreads_a_token_over_a_cluster_and_matches(b, k, latent, slices, cluster):
    """The slot sum + RMSNorm (+ slice sum) kernel against fp32 torch at the cluster layout ``sum_norm_layout`` picks
    (asserted: the case covers the path it names), poisoned output, fresh random slots; the groups are reset; with a
    stand-in's spin (the last case) the numbers are the same; two calls agree bit for bit (the partial sums of squares
    are added in rank order in every CTA)."""
    import torch

    from k3tune.kernels import moe_experts
    from k3tune.kernels.moe_experts import Groups

    assert moe_experts.sum_norm_layout(latent, slices)[0] == cluster
    g = torch.Generator(device="cuda").manual_seed(b * 1000 + latent)
    per_slot = torch.randn(b * k, latent, device="cuda", generator=g)
    norm_w = (torch.rand(latent, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    grp = Groups.allocate(40, b, k, 1, "cuda")
    grp.counts.fill_(7)
    out = torch.full((b, latent // slices), float("nan"), dtype=torch.bfloat16, device="cuda")
    cycles = 20000 if b == 2 and latent == 3584 else 0
    moe_experts.sum_norm(per_slot, norm_w, out, k, 1e-5, grp, slices=slices, cycles=cycles)
    summed = per_slot.view(b, k, latent).sum(1)
    ref = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()
    ref = ref.view(b, slices, latent // slices).sum(1)
    assert not out.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert int(grp.counts.abs().sum()) == 0, "sum_norm resets the groups for the next step"
    again = torch.full_like(out, float("nan"))
    moe_experts.sum_norm(per_slot, norm_w, again, k, 1e-5, grp, slices=slices)
    assert torch.equal(again, out)


def test_tuned_bf16_block_runs_the_cute_expert_kernels():
    from k3tune.runtime import Selector

    w = random_weights(K3, 16, device="cuda", seed=11)
    blk = MoEBlock.build(w, "tuned", batch=8, selector=Selector.load())
    assert blk.ran["experts"].startswith("k3tune expert-grouped GEMVs (CuTe DSL)")
    assert blk.ran["routing"].startswith("k3tune route kernel")
    _check(blk, w, 8)


def test_prefetch_does_not_change_the_result():
    from k3tune.runtime import Selector

    w = random_weights(K3, 16, device="cuda", seed=13)
    blk = MoEBlock.build(w, "tuned", batch=4, selector=Selector.load(), prefetch_mib=16)
    assert blk.ran["prefetch"].startswith("16 MiB")
    _check(blk, w, 4)


def test_measurer_times_the_block_families():
    """The sweep's GPU measurer runs both block families through the executor: correctness first against
    the fp32 reference, then timing (what `k3tune sweep --spec configs/sweep_h200_moe_bf16.toml` does)."""
    from k3tune.kernels import family
    from k3tune.plan.problems import Problem
    from k3tune.search.measure_gpu import GpuBackend
    from k3tune.search.outcome import Task

    p = Problem("moe.block", "moe_block", (("tp", 16), ("M", 4), ("experts", 896), ("top_k", 16), ("latent", 3584),
                                           ("inter", 192), ("shared_inter", 384), ("hidden", 7168),
                                           ("format", "bf16"), ("routing", "uniform")))
    be = GpuBackend()
    overlap = family("moe.overlap")  # every knob, the CUDA-core experts' tiles and the overlap knobs set here
    tuned = {**overlap.default_config(p).params(), "experts_kernel": "cuda_core", "w13_rows": 4, "w13_warps": 4,
             "w13_unroll": 2, "w2_rows": 8, "w2_warps": 2, "w2_unroll": 1, "w2_lanes": 16, "group": 2,
             "shared_sms": 16, "prefetch_mib": 8}
    assert overlap.valid(overlap.config_from_params(p, tuned), p)
    for fam, params in [("moe.stock", {}), ("moe.overlap", tuned)]:
        out = be.measure(Task(0, p, fam, params, 0, 5))
        assert out.status == "ok" and out.median_us > 0, f"{fam}: {out.status}: {out.error}"


@pytest.mark.parametrize("path", ["tuned", "stock"])
def test_the_routed_all_reduce_stand_in_is_charged_the_summed_latent_rows(path, monkeypatch):
    """The routed all-reduce moves the tokens' latent rows (a rank sums its slots first), not per-slot rows: fp32
    on the tuned path (its slot sum is fp32), bf16 on the stock path (what it all-reduces)."""
    from k3tune.runtime import Selector
    from k3tune.runtime.moe import EmulatedComm

    charged = []
    real = EmulatedComm.cycles

    def spy(self, nbytes, ring_factor=2.0):
        charged.append(nbytes)
        return real(self, nbytes, ring_factor)

    monkeypatch.setattr(EmulatedComm, "cycles", spy)
    w = random_weights(K3, 16, device="cuda", seed=17)
    batch = 8
    blk = MoEBlock.build(w, path, batch=batch, selector=Selector.load() if path == "tuned" else None,
                         comm=EmulatedComm.for_target("gb300", 16))
    if path == "tuned":
        assert blk._cache["experts"] == "cute"
    _check(blk, w, batch)
    # tuned: the router's all-gather, the routed latent's all-reduce, the final one; stock: the last two
    assert len(charged) == (3 if path == "tuned" else 2), charged
    routed = charged[-2]
    assert routed == batch * K3.latent * (4 if path == "tuned" else 2), charged


def test_the_fused_stand_ins_write_what_the_collectives_would():
    """gather_rows and reduce_add_rows (the emulated collectives' one-launch stand-ins) against torch, outputs
    poisoned, odd widths, with and without spin."""
    import torch

    from k3tune.kernels import moe_experts

    g = torch.Generator(device="cuda").manual_seed(5)
    for b, w, tp, cycles in ((1, 280, 16, 2000), (3, 561, 8, 0), (64, 7168, 2, 100), (5, 33, 3, 0)):
        x = torch.randn(b, w, device="cuda", generator=g).to(torch.bfloat16)
        out = torch.full((b, tp * w), float("nan"), device="cuda", dtype=torch.bfloat16)
        moe_experts.gather_rows(x, out, tp, cycles)
        assert torch.equal(out, torch.cat([x] * tp, dim=-1))
        base = torch.randn(b, w, device="cuda", generator=g).to(torch.bfloat16)
        got = torch.full_like(base, float("nan"))
        moe_experts.reduce_add_rows(x, base, got, tp, cycles)
        ref = base.float() + tp * x.float()
        assert torch.allclose(got.float(), ref, rtol=8e-3, atol=1e-2), (got.float() - ref).abs().max()


def test_the_tuned_blocks_collectives_run_as_fused_stand_ins(monkeypatch):
    """A tuned TP16 block on a GPU runs its gather and final all-reduce + add as the fused stand-in kernels (and
    the routed all-reduce's spin inside sum_norm), and still matches the reference."""
    from k3tune.kernels import moe_experts
    from k3tune.runtime import Selector
    from k3tune.runtime.moe import EmulatedComm

    ran = []
    for name in ("gather_rows", "reduce_add_rows", "sum_norm"):
        real = getattr(moe_experts, name)

        def spy(*a, _real=real, _name=name, **k):
            ran.append((_name, k.get("cycles")))
            return _real(*a, **k)

        monkeypatch.setattr(moe_experts, name, spy)
    w = random_weights(K3, 16, device="cuda", seed=19)
    blk = MoEBlock.build(w, "tuned", batch=2, selector=Selector.load(), comm=EmulatedComm.for_target("gb300", 16))
    _check(blk, w, 2)
    names = [n for n, _ in ran]
    assert names == ["gather_rows", "sum_norm", "reduce_add_rows"], ran
    assert all(c and c > 0 for _, c in ran), ran  # every stand-in spins (the target link has time)


@pytest.mark.parametrize("fmt,kernels,batch", [("bf16", "cuda_core", 1), ("bf16", "tensor_core", 8),
                                               ("mxfp4", "tensor_core", 4)])
def test_a_block_with_pdl_launches_its_kernels_as_dependents_matches_and_captures(fmt, kernels, batch, monkeypatch):
    """pdl = 1: every kernel the block launches itself gets pdl=True (route, both expert kernels, the norm with the
    routed all-reduce's spin, the shared SiTU, both fused stand-ins), on a real split with stand-ins timed by a
    link; it matches the reference eagerly, and a CUDA graph of it replays to the same output (poisoned first)."""
    from k3tune.kernels import moe_experts, moe_experts_tc
    from k3tune.runtime import Selector
    from k3tune.runtime.moe import EmulatedComm
    from k3tune.runtime.partition import green_split

    calls = []
    for mod, names in ((moe_experts, ("route", "run_w13", "run_w2", "sum_norm", "situ_rows", "gather_rows",
                                      "reduce_add_rows")), (moe_experts_tc, ("run_w13", "run_w2"))):
        for name in names:
            real = getattr(mod, name)

            def spy(*a, _real=real, _name=f"{mod.__name__.rsplit('.', 1)[-1]}.{name}", **k):
                calls.append((_name, k.get("pdl")))
                return _real(*a, **k)

            monkeypatch.setattr(mod, name, spy)
    cfg = (moe_experts_tc.default_config(batch) if kernels == "tensor_core" else moe_experts.default_config(batch))
    split = green_split(16)
    try:
        w = random_weights(K3, 16, fmt=fmt, device="cuda", seed=23 + batch)
        blk = MoEBlock.build(w, "tuned", batch=batch, selector=Selector.load(), experts_cfg=cfg,
                             shared_stream=split.shared.stream, routed_stream=split.rest.stream,
                             comm=EmulatedComm.for_target("gb300", 16), pdl=1)
        assert blk.ran["pdl"] != "off", blk.ran
        x, eager = _check(blk, w, batch)
        experts = "moe_experts_tc" if kernels == "tensor_core" else "moe_experts"
        want = {"moe_experts.route", f"{experts}.run_w13", f"{experts}.run_w2", "moe_experts.sum_norm",
                "moe_experts.situ_rows", "moe_experts.gather_rows", "moe_experts.reduce_add_rows"}
        assert {n for n, _ in calls} == want, calls
        assert all(p is True for _, p in calls), calls
        _replays_to(blk, x, eager)
    finally:
        split.close()


@pytest.mark.parametrize("batch", [1, 5])
def test_w2_asking_l2_for_its_tile_before_the_pdl_wait_matches_and_captures(batch, monkeypatch):
    """``W2_EARLY_L2`` (off: refuted, session 45): the w2 kernel that ran is the early one (its knobs say so, with
    pdl); the block matches the reference eagerly and replays a graph of it to the same output (poisoned first)."""
    from k3tune.kernels import moe_experts
    from k3tune.runtime import Selector
    from k3tune.runtime.moe import EmulatedComm

    seen, real = [], moe_experts.compiled

    def spy(kind, knobs, arch, pdl=0):
        if kind == "w2":
            seen.append((knobs, pdl))
        return real(kind, knobs, arch, pdl)

    monkeypatch.setattr(moe_experts, "compiled", spy)
    monkeypatch.setattr(moe_experts, "W2_EARLY_L2", True)
    w = random_weights(K3, 16, fmt="bf16", device="cuda", seed=41 + batch)
    blk = MoEBlock.build(w, "tuned", batch=batch, selector=Selector.load(),
                         experts_cfg=moe_experts.default_config(batch), comm=EmulatedComm.for_target("gb300", 16),
                         pdl=1)
    x, eager = _check(blk, w, batch)
    assert seen and all(len(k) == 6 and k[5] is True and p == 1 for k, p in seen), seen
    _replays_to(blk, x, eager)


@pytest.mark.parametrize("batch,imposed,method,pdl", [(1, False, "shuffle", 1), (5, False, "select", 1),
                                                      (3, True, "select", 1), (2, False, "redux", 0)])
def test_the_gather_with_the_route_in_its_launch_matches_the_two_launches(batch, imposed, method, pdl, monkeypatch):
    """``GATHER_ROUTE`` (off: slower at MXFP4 b1, session 45): the fused gather + route kernel ran and no separate route
    did; the block's output, experts and weights equal the unfused block's bit for bit (the router's own choices with
    each top-k method, or an imposed routing that runs the top-k too), it matches the reference, and a graph of it
    replays the same."""
    import torch

    from k3tune.kernels import moe_experts
    from k3tune.runtime import Selector
    from k3tune.runtime.moe import EmulatedComm

    monkeypatch.setattr(moe_experts, "ROUTE_REDUX", method == "redux")
    monkeypatch.setattr(moe_experts, "ROUTE_SELECT", method == "select")
    monkeypatch.setattr(moe_experts, "FORCED_TOPK", imposed)
    w = random_weights(K3, 16, fmt="bf16", device="cuda", seed=61 + batch)
    blocks = [MoEBlock.build(w, "tuned", batch=batch, selector=Selector.load(),
                             experts_cfg=moe_experts.default_config(batch), comm=EmulatedComm.for_target("gb300", 16),
                             pdl=pdl) for _ in range(2)]
    x = torch.randn(batch, K3.hidden, device="cuda").to(torch.bfloat16)
    if imposed:
        top = torch.stack([torch.randperm(K3.experts, device="cuda")[:K3.top_k] for _ in range(batch)]).int()
        for b in blocks:
            b.force_top = top
    want = blocks[0](x).clone()
    want_top, want_wts = blocks[0].last_top.clone(), blocks[0]._cache["wts"].clone()
    seen, real = [], moe_experts.compiled

    def spy(kind, knobs, arch, p=0):
        seen.append((kind, knobs, p))
        return real(kind, knobs, arch, p)

    monkeypatch.setattr(moe_experts, "compiled", spy)
    monkeypatch.setattr(moe_experts, "GATHER_ROUTE", True)
    blk = blocks[1]
    blk._cache["wts"].fill_(float("nan"))
    got = blk(x)
    kinds = [k for k, _, _ in seen]
    assert "gather_route" in kinds and "route" not in kinds and "gather" not in kinds, kinds
    fused = next(kn for k, kn, _ in seen if k == "gather_route")
    assert fused[5] is imposed and fused[7] == method and fused[8] is imposed, fused
    assert all(p == pdl for k, _, p in seen if k == "gather_route"), seen
    assert torch.equal(got, want)
    assert torch.equal(blk.last_top, want_top) and torch.equal(blk._cache["wts"], want_wts)
    if not imposed:
        _check(blk, w, batch)
    _replays_to(blk, x, want)


@pytest.mark.parametrize("method", ["shuffle", "select"])
def test_an_imposed_routing_that_runs_the_top_k_gives_the_imposed_blocks_numbers(method, monkeypatch):
    """``FORCED_TOPK`` (on since session 46): under an imposed routing the route kernel still runs the top-k (its
    knobs say so), and the block's output, experts and weights are those of the imposed routing without it, bit for
    bit."""
    import torch

    from k3tune.kernels import moe_experts
    from k3tune.runtime import Selector
    from k3tune.runtime.moe import EmulatedComm

    monkeypatch.setattr(moe_experts, "ROUTE_SELECT", method == "select")
    w = random_weights(K3, 16, fmt="bf16", device="cuda", seed=71)
    blocks = [MoEBlock.build(w, "tuned", batch=4, selector=Selector.load(), experts_cfg=moe_experts.default_config(4),
                             comm=EmulatedComm.for_target("gb300", 16), pdl=1) for _ in range(2)]
    x = torch.randn(4, K3.hidden, device="cuda").to(torch.bfloat16)
    top = torch.stack([torch.randperm(K3.experts, device="cuda")[:K3.top_k] for _ in range(4)]).int()
    outs, seen, real = [], [], moe_experts.compiled

    def spy(kind, knobs, arch, p=0):
        seen.append((kind, knobs))
        return real(kind, knobs, arch, p)

    monkeypatch.setattr(moe_experts, "compiled", spy)
    for blk, on in zip(blocks, (False, True)):
        monkeypatch.setattr(moe_experts, "FORCED_TOPK", on)
        blk.force_top = top
        blk._cache["wts"].fill_(float("nan"))
        outs.append((blk(x).clone(), blk._cache["wts"].clone()))
    routes = [kn for k, kn in seen if k == "route"]
    assert routes[0][3] is True and (len(routes[0]) == 5 or routes[0][6] is False), routes
    assert routes[-1][3] is True and routes[-1][5] == method and routes[-1][6] is True, routes
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(blocks[1].last_top, top)
