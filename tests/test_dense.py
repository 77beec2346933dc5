"""The served dense projection (k3tune/runtime/dense.py): the selector's kernel bound to a rank's weight, its checks,
and its fallbacks, each asserted by the kernel that actually ran. On a GPU: tests/test_gpu_dense.py."""

import pytest

from k3tune.errors import ConfigError
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


def test_a_transposed_weight_and_a_wrong_x_are_refused():
    sel = Selector.load(H200_DB, measured_on="h200")
    with pytest.raises(ConfigError, match="must be contiguous"):
        DenseProjection.serve(sel, "kda.o_proj", _weight(768, 7168).t(), tp=16, batch=1)
    proj = DenseProjection.serve(sel, "kda.o_proj", _weight(7168, 768), tp=16, batch=2)
    with pytest.raises(ConfigError, match=r"built for x of shape \[2, 768\], got \[3, 768\]"):
        proj(_x(3, 768))


def test_an_fp32_weight_is_refused():
    sel = Selector.load(H200_DB, measured_on="h200")
    with pytest.raises(ConfigError, match="bf16 weight, got .* torch.float32"):
        DenseProjection.serve(sel, "kda.o_proj", _weight(7168, 768).float(), tp=16, batch=1)


def test_bind_takes_the_problem_from_the_weight_and_checks_only_its_kind():
    """``bind`` serves a caller whose weights follow its own model (the MoE block's small test models): a choice bound
    to any [N, K] bf16 weight runs and matches; a non-2-D or fp32 weight is still refused."""
    sel = Selector.load(H200_DB.parent / "none.sqlite", measured_on="h200")
    choice = sel.lookup("moe.router_latent", tp=1, batch=3)
    w = _weight(160, 256)
    proj = DenseProjection.bind(choice, "moe.router_latent", w, tokens=3)
    assert proj.family == "gemm.cublas" and proj.x_shape == (3, 256), proj
    x = _x(3, 256)
    assert relative_error(proj(x), _ref(x, w)) < 2e-2
    for bad, msg in ((w.float(), "2-D bf16 weight, got .* torch.float32"), (w[None], "2-D bf16 weight, got \\[1, 160")):
        with pytest.raises(ConfigError, match=msg):
            DenseProjection.bind(choice, "moe.router_latent", bad, tokens=3)
