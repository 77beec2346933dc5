"""The served dense projection on a GPU: the shipped winners bound to random weights run (never a silent
fallback), write their poisoned outputs, match the fp32 reference at odd token counts, and replay from a CUDA graph.
Run on the device: pytest -m gpu tests/test_gpu_dense.py"""

import pytest

from k3tune.kernels import family
from k3tune.runtime import DenseProjection, Selector
from k3tune.search.outcome import relative_error
from k3tune.shipped import tuning_db_dir

pytestmark = pytest.mark.gpu

H200_DB = tuning_db_dir() / "h200.sqlite"
H100_DB = tuning_db_dir() / "h100.sqlite"


def _randn(rows, cols, seed, scale=1.0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(rows, cols, generator=g, device="cuda") * scale).to(torch.bfloat16)


CASES = [("kda.qkvg_proj", 8, 1, 0), ("kda.o_proj", 16, 3, 0), ("kda.o_proj", 16, 3, 2), ("mla.q_b", 8, 17, 0),
         ("moe.latent_up", 16, 64, 0), ("moe.shared_w13", 16, 1, 0), ("moe.router_latent", 8, 5, 1),
         ("mla.o_proj", 16, 32, 1)]


@pytest.mark.parametrize("op,tp,batch,draft", CASES)
def test_the_shipped_h200_kernel_runs_and_matches_eagerly_and_from_a_graph(op, tp, batch, draft):
    """The served kernel is the database's (never a silent fallback), writes the poisoned output, matches the fp32
    reference at odd token counts too (tokens 9 and 17 are served from the bucket above), and replays in a graph."""
    _serve_and_check(Selector.load(H200_DB, measured_on="h200"), op, tp, batch, draft)


# each shipped table's picks of gemm.wgmma_cktrig, at odd token counts too
CKTRIG_CASES = [("mla.q_a", 8, 16, 0), ("kda.o_proj", 8, 9, 0), ("moe.shared_w13", 16, 17, 0),
                ("moe.router_latent", 16, 33, 0), ("mla.q_b", 8, 64, 0)]
CKTRIG_CASES_H200 = [("mla.q_a", 8, 16, 0), ("kda.o_proj", 8, 9, 0), ("moe.shared_w13", 8, 15, 0),
                     ("mla.o_proj", 8, 16, 0)]


@pytest.mark.parametrize("db,hw,op,tp,batch,draft", [(H100_DB, "h100", *c) for c in CKTRIG_CASES]
                         + [(H200_DB, "h200", *c) for c in CKTRIG_CASES_H200])
def test_the_shipped_late_trigger_picks_run_and_match(db, hw, op, tp, batch, draft):
    """Each shipped table serves gemm.wgmma_cktrig where its re-sweep picked it: the kernel that runs is that one,
    and it matches the reference eagerly and from a graph."""
    sel = Selector.load(db, measured_on=hw)
    assert sel.lookup(op, tp, batch, draft).family == "gemm.wgmma_cktrig"
    _serve_and_check(sel, op, tp, batch, draft)


def _serve_and_check(sel, op: str, tp: int, batch: int, draft: int) -> None:
    import torch

    from k3tune.plan import problems as plans

    choice = sel.lookup(op, tp, batch, draft)
    assert choice.source in ("measured", "nearest bucket (measured)"), choice
    p = plans.problem_for(plans.op(op), sel.model, plans.Deployment(tp, batch, 1, draft, 0), sel.spec)
    w = _randn(p["N"], p["K"], seed=batch, scale=p["K"] ** -0.5)
    proj = DenseProjection.serve(sel, op, w, tp=tp, batch=batch, draft=draft)
    assert proj.family == choice.family and "instead of" not in proj.ran, proj.ran
    tokens = batch * (1 + draft)
    for seed in (1, 2):
        x = _randn(tokens, p["K"], seed)
        if proj.out is not None:
            proj.out.fill_(float("nan"))
        y = proj(x)
        torch.cuda.synchronize()
        assert proj.out is None or y.data_ptr() == proj.out.data_ptr()  # the kernel wrote the poisoned buffer
        assert y.shape == (tokens, p["N"])
        assert relative_error(y, x.float() @ w.float().t()) < family(proj.family).tolerance(p), (proj.ran, seed)
    x = _randn(tokens, p["K"], 3)
    proj(x)  # warm: lazy initialisation outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = proj(x)
    x.copy_(_randn(tokens, p["K"], 4))
    if proj.out is not None:
        proj.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(y, x.float() @ w.float().t()) < family(proj.family).tolerance(p), proj.ran
