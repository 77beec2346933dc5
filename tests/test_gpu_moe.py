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


@pytest.mark.parametrize("tp,batch,fmt", [(16, 1, "bf16"), (16, 8, "mxfp4"), (8, 4, "bf16"), (8, 64, "bf16")])
def test_tuned_block_runs_measured_kernels_and_matches(tp, batch, fmt):
    from k3tune.runtime import Selector

    sel = Selector.load()  # the detected H200: the shipped measured database
    w = random_weights(K3, tp, fmt=fmt, device="cuda", seed=batch)
    blk = MoEBlock.build(w, "tuned", batch=batch, selector=sel)
    for op in ("moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2"):
        assert "(measured" in blk.ran[op], blk.ran[op]
    _check(blk, w, batch)


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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        blk(x)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = blk(x)
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
        assert blk.ran["shared"] == "side stream (green context, 16 SMs)"
        _check(blk, w, 8)
    finally:
        part.close()
