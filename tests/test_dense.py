"""The served dense projection (k3tune/runtime/dense.py): the selector's kernel bound to a rank's weight, its checks,
and its fallbacks, each asserted by the kernel that actually ran. The GPU half runs the shipped H200 winners."""

import pytest

from k3tune.errors import ConfigError
from k3tune.kernels import family
from k3tune.runtime import DenseProjection, Selector
from k3tune.search.outcome import relative_error
from k3tune.shipped import tuning_db_dir

H200_DB = tuning_db_dir() / "h200.sqlite"


def _weight(n, k, device="cpu", seed=0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(n, k, generator=g, device=device) / k**0.5).to(torch.bfloat16)


def _x(m, k, device="cpu", seed=1):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)


def _ref(x, w):
    return x.float() @ w.float().t()


def test_a_heuristic_default_runs_on_the_cpu_and_matches():
    sel = Selector.load(H200_DB.parent / "none.sqlite", measured_on="h200")  # no such database: defaults
    w = _weight(7168, 768)
    proj = DenseProjection.serve(sel, "kda.o_proj", w, tp=16, batch=3, draft=1)
    assert proj.family == "gemm.cublas" and "heuristic default" in proj.ran and "instead of" not in proj.ran
    x = _x(6, 768)
    assert relative_error(proj(x), _ref(x, w)) < 2e-2


def test_a_tuned_cute_kernel_on_a_cpu_tensor_falls_back_to_cublas_and_says_why():
    sel = Selector.load(H200_DB, measured_on="h200")
    choice = sel.lookup("kda.o_proj", tp=16, batch=8)
    assert choice.source == "measured" and choice.family != "gemm.cublas", choice  # the shipped winner is a CuTe one
    w = _weight(7168, 768)
    proj = DenseProjection.serve(sel, "kda.o_proj", w, tp=16, batch=8)
    assert proj.family == "gemm.cublas"
    assert f"instead of {choice.family}" in proj.ran and "needs a CUDA GPU" in proj.ran, proj.ran
    x = _x(8, 768)
    assert relative_error(proj(x), _ref(x, w)) < 2e-2


@pytest.mark.parametrize("op,shape,tp,msg", [
    ("kda.o_proj", (7168, 1536), 16, r"kda.o_proj at tp 16 takes a \[7168, 768\] bf16 weight, got \[7168, 1536\]"),
    ("kda.decode", (8, 8), 16, "kda.decode is not a dense projection"),
    ("kda.nope", (8, 8), 16, "unknown op 'kda.nope'"),
])
def test_bad_arguments_are_one_clear_error(op, shape, tp, msg):
    sel = Selector.load(H200_DB, measured_on="h200")
    with pytest.raises(ConfigError, match=msg):
        DenseProjection.serve(sel, op, _weight(*shape), tp=tp, batch=1)


def test_an_fp32_weight_is_refused():
    sel = Selector.load(H200_DB, measured_on="h200")
    with pytest.raises(ConfigError, match="bf16 weight, got .* torch.float32"):
        DenseProjection.serve(sel, "kda.o_proj", _weight(7168, 768).float(), tp=16, batch=1)


CASES = [("kda.qkvg_proj", 8, 1, 0), ("kda.o_proj", 16, 3, 0), ("kda.o_proj", 16, 3, 2), ("mla.q_b", 8, 17, 0),
         ("moe.latent_up", 16, 64, 0), ("moe.shared_w13", 16, 1, 0), ("moe.router_latent", 8, 5, 1),
         ("mla.o_proj", 16, 32, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("op,tp,batch,draft", CASES)
def test_the_shipped_h200_kernel_runs_and_matches_eagerly_and_from_a_graph(op, tp, batch, draft):
    """The served kernel is the database's (never a silent fallback), writes the poisoned output, matches the fp32
    reference at odd token counts too (tokens 9 and 17 are served from the bucket above), and replays in a graph."""
    import torch

    from k3tune.plan import problems as plans

    sel = Selector.load(H200_DB, measured_on="h200")
    choice = sel.lookup(op, tp, batch, draft)
    assert choice.source in ("measured", "nearest bucket (measured)"), choice
    p = plans.problem_for(plans.op(op), sel.model, plans.Deployment(tp, batch, 1, draft, 0), sel.spec)
    w = _weight(p["N"], p["K"], "cuda", seed=batch)
    proj = DenseProjection.serve(sel, op, w, tp=tp, batch=batch, draft=draft)
    assert proj.family == choice.family and "instead of" not in proj.ran, proj.ran
    tokens = batch * (1 + draft)
    for seed in (1, 2):
        x = _x(tokens, p["K"], "cuda", seed=seed)
        if "out" in proj._inputs:
            proj._inputs["out"].fill_(float("nan"))
        y = proj(x)
        torch.cuda.synchronize()
        assert y.shape == (tokens, p["N"])
        assert relative_error(y, _ref(x, w)) < family(proj.family).tolerance(p), (proj.ran, seed)
    x = _x(tokens, p["K"], "cuda", seed=3)
    proj(x)  # warm: lazy initialisation outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = proj(x)
    x.copy_(_x(tokens, p["K"], "cuda", seed=4))
    if "out" in proj._inputs:
        proj._inputs["out"].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(y, _ref(x, w)) < family(proj.family).tolerance(p), proj.ran
