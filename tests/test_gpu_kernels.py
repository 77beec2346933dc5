"""GPU numerics of every variant that runs on a GPU, against the fp32 torch reference, on fresh random
inputs with the output poisoned first, over odd shapes too; and the measurer's path end to end.
Run on the device: pytest -m gpu tests/test_gpu_kernels.py"""

import itertools

import pytest

from k3tune.kernels import family
from k3tune.plan.problems import Problem
from k3tune.search.outcome import Task, relative_error

pytestmark = pytest.mark.gpu

MS = [1, 3, 8, 17, 64, 257, 512]
SHAPES = [(6144, 7168), (7168, 768), (280, 7168), (1000, 1544)]  # (N, K): K3 shapes and an odd one


def _check(name, m, n, k, cfg=None):
    import torch

    fam = family(name)
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    if not fam.can_implement(p):
        return None
    cfg = cfg or fam.default_config(p)
    gen = torch.Generator(device="cuda").manual_seed(m * 7919 + n + k)
    inputs = fam.make_inputs(p, torch.device("cuda"), gen)
    if "out" in inputs:
        inputs["out"].fill_(float("nan"))
    out = fam.build(p, cfg)(inputs)
    torch.cuda.synchronize()
    if "out" in inputs:
        assert out.data_ptr() == inputs["out"].data_ptr()  # this kernel wrote the poisoned buffer
    err = relative_error(out, fam.reference(p, inputs))
    assert err < fam.tolerance(p), (name, m, n, k, cfg, err)
    return err


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("name", ["gemm.cublas", "gemm.smallm"])
def test_gemm_default_numerics(name, m, n, k):
    _check(name, m, n, k)


def test_smallm_whole_space_numerics():
    fam = family("gemm.smallm")
    for m, (n, k) in itertools.product((1, 3, 16), [(7168, 768), (280, 7168)]):
        p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
        for cfg in fam.configs(p):
            _check("gemm.smallm", m, n, k, cfg)


def test_measurer_runs_the_requested_kernel():
    from k3tune.kernels import gemm_smallm
    from k3tune.search.measure_gpu import GpuBackend

    p = Problem("kda.o_proj", "gemm", (("M", 5), ("N", 7168), ("K", 1536)))
    before = gemm_smallm.compiled.cache_info().misses
    out = GpuBackend().measure(Task(1, p, "gemm.smallm", {"rows_per_cta": 2, "warps": 8, "split_k": 2, "unroll": 2}, 0, 5))
    assert out.status == "ok" and out.median_us > 0, out
    assert gemm_smallm.compiled.cache_info().misses == before + 1  # compiled (and so launched) this config


def test_attention_baselines_on_gpu():
    import torch

    for name, p in [("kda.torch", Problem("kda.decode", "kda_decode", (("heads", 6), ("head_dim", 128), ("batch", 3),
                                                                        ("qlen", 2)))),
                    ("mla.torch", Problem("mla.decode", "mla_decode", (("heads", 12), ("kv_lora", 512), ("rope", 64),
                                                                        ("batch", 3), ("qlen", 2), ("ctx", 1000))))]:
        fam = family(name)
        inputs = fam.make_inputs(p, torch.device("cuda"), torch.Generator(device="cuda").manual_seed(3))
        out = fam.build(p, fam.default_config(p))(inputs)
        assert relative_error(out, fam.reference(p, inputs)) < fam.tolerance(p)
