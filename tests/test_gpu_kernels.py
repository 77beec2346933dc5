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


def _twice(fam, p, cfg, seed: int, poison=("out",)) -> dict:
    """Build ``cfg``, run it twice on the same buffers with ``poison`` filled with NaN before each run (so state
    left by a launch, such as mbarrier phases, counters or a workspace, cannot pass for a result) and check both
    against the fp32 reference; returns the inputs."""
    import torch

    inputs = fam.make_inputs(p, torch.device("cuda"), torch.Generator(device="cuda").manual_seed(seed))
    run = fam.build(p, cfg)
    ref = fam.reference(p, inputs)
    for _ in range(2):
        for name in poison:
            inputs[name].fill_(float("nan"))
        out = run(inputs)
        torch.cuda.synchronize()
        assert out.data_ptr() == inputs["out"].data_ptr()  # this kernel wrote the poisoned buffer
        err = relative_error(out, ref)
        assert err < fam.tolerance(p), (fam.name, cfg, err)
    return inputs


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("name", ["gemm.cublas", "gemm.smallm", "gemm.splitk_tc", "gemm.wgmma", "gemm.stream",
                                  "gemm.splitk_cluster", "gemm.wgmma_ck"])
def test_gemm_default_numerics(name, m, n, k):
    if _check(name, m, n, k) is None:
        pytest.skip(f"{name} does not implement M={m}, N={n}, K={k}")


@pytest.mark.parametrize("m,n,k", [(3, 280, 7168), (17, 7168, 768), (64, 1000, 1536), (257, 1536, 7168)])
def test_wgmma_space_numerics(farm, m, n, k):
    """Every valid config of the wgmma kernel with PDL off, and every 4th with it on,
    on rows past N (280, 1000 are no multiples of 64), tokens past M (3, 17, 257) and every split; each run twice
    on the same buffers (the mbarrier phases and the workspace must not carry over from one launch to the next)."""
    fam = family("gemm.wgmma")
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    cfgs = list(fam.configs(p))
    on = [c for c in cfgs if c.pdl]
    checked = 0
    for cfg in _built_first(farm, fam.name, p, [c for c in cfgs if not c.pdl] + on[::4]):
        _twice(fam, p, cfg, 1000 + checked, poison=("out", "ws"))
        checked += 1
    assert checked >= 40, checked


@pytest.mark.parametrize("m,n,k", [(3, 280, 7168), (17, 7168, 768), (64, 1000, 1536), (40, 1536, 7168)])
def test_wgmma_ck_space_numerics(farm, m, n, k):
    """The staged wgmma with split-K over a cluster along K: every 5th valid config with PDL off and every 17th with
    it on (odd strides: the split is among the fastest-varying knobs, every cluster size is hit), on rows past N
    (280 and 1000 leave a partial row tile, whose owners must skip the rows past N), tokens past M and every split,
    the uneven ones (3, 5, 6, 7) too; each run twice on the same buffers (the receive mbarrier is set up by every
    launch)."""
    fam = family("gemm.wgmma_ck")
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    cfgs = list(fam.configs(p))
    sample = [c for c in cfgs if not c.pdl][::5] + [c for c in cfgs if c.pdl][::17]
    assert {c.split_k for c in sample} == {c.split_k for c in cfgs}  # every cluster size the shape admits
    checked = 0
    for cfg in _built_first(farm, fam.name, p, sample):
        _twice(fam, p, cfg, 4000 + checked)
        checked += 1
    assert checked >= 10, checked


@pytest.mark.parametrize("m,n,k,every", [(3, 280, 7168, 1), (1, 576, 7168, 1), (8, 1536, 7168, 1),
                                         (8, 1000, 1536, 1), (7, 576, 7168, 2), (5, 1536, 7168, 2), (2, 7, 1536, 1)])
def test_stream_space_numerics(m, n, k, every):
    """Every ``every``-th valid config of the whole-slice streaming kernel (FMA and tensor-core paths) with PDL off
    and every 5th with it on, on rows past N (280, 1000, 576 and 7 leave a partial last CTA for most row counts),
    tokens short of the MMA's 8 (3, 5, 7) and a full tile (8); each run twice on the same buffers (the per-chunk
    mbarriers are initialised by every launch)."""
    fam = family("gemm.stream")
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    cfgs = list(fam.configs(p))
    checked = 0
    for cfg in [c for c in cfgs if not c.pdl][::every] + [c for c in cfgs if c.pdl][::5]:
        _twice(fam, p, cfg, 2000 + checked)
        checked += 1
    assert checked >= 8, checked


_TMA_CONFIGS = [("gemm.stream", (1, 576, 7168), {"rows": 10, "warps": 16, "mma": 0, "pdl": 1}),
                ("gemm.stream", (5, 1536, 7168), {"rows": 12, "warps": 16, "mma": 1, "pdl": 1}),
                ("gemm.wgmma", (40, 1000, 1536), {"warpgroups": 2, "tile_m": 64, "split_k": 2, "bk": 64, "stages": 4,
                                                  "pdl": 1}),
                ("gemm.wgmma", (3, 7168, 768), {"warpgroups": 1, "tile_m": 8, "split_k": 1, "bk": 128, "stages": 6,
                                                "pdl": 0}),
                ("gemm.splitk_cluster", (17, 576, 7168), {"m_tiles": 1, "warps_n": 1, "warps_k": 4, "tile_m": 32,
                                                          "split_k": 8, "bk": 128, "stages": 6, "reduce": 0, "pdl": 1}),
                ("gemm.wgmma_ck", (40, 1000, 1536), {"warpgroups": 1, "tile_m": 64, "split_k": 3, "bk": 64,
                                                     "stages": 4, "pdl": 1})]
_LOADED_MODULES = ("k3tune.kernels.gemm_stream", "k3tune.kernels.gemm_wgmma", "k3tune.kernels.gemm_splitk_cluster",
                   "k3tune.kernels.gemm_wgmma_ck")
_BUILD_INTO_CACHE = """
import json, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from k3tune.kernels import compile_cache, family
from k3tune.plan.problems import Problem
compile_cache.install()
for name, (m, n, k), params in json.loads(sys.argv[1]):
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    fam = family(name)
    fam.build(p, fam.config_from_params(p, params))
print(len(compile_cache.COMPILED))
"""


def test_tma_kernels_loaded_from_the_disk_cache(tmp_path, monkeypatch):
    """The check before the compile farm may build the TMA and cluster GEMMs (gemm.stream, gemm.wgmma and the
    cluster kernels) for the sweep workers:
    kernels compiled in another process and loaded from the disk cache (compiling here is made to fail) give the
    reference's results, twice on the same buffers with poisoned outputs."""
    import json
    import os
    import subprocess
    import sys

    import cutlass.cute as cute
    import importlib

    from k3tune.kernels import compile_cache

    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _BUILD_INTO_CACHE, json.dumps(_TMA_CONFIGS)], check=True,
                         capture_output=True, text=True, env=os.environ.copy())
    assert int(out.stdout.split()[-1]) == len(_TMA_CONFIGS)  # compiled there, into the cache
    for name in _LOADED_MODULES:  # a fresh in-process cache
        mod = importlib.import_module(name)
        monkeypatch.setattr(mod, "compiled", getattr(mod.compiled, "__wrapped__", mod.compiled))
    compile_cache.install({m: compile_cache.KERNEL_MODULES[m] for m in _LOADED_MODULES})

    def no_compile(*a, **k):
        raise AssertionError("compiled again instead of loaded from the cache")

    monkeypatch.setattr(cute, "compile", no_compile)
    for name, (m, n, k), params in _TMA_CONFIGS:
        fam = family(name)
        p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
        _twice(fam, p, fam.config_from_params(p, params), m + n)


@pytest.fixture(scope="module")
def farm():
    """The sweep's compile farm on every core but two, into a private disk cache this process loads from: the
    space tests below build ~1,300 kernels, ~5 minutes one at a time (loaded kernels are what sweep workers run)."""
    import os
    import tempfile

    from k3tune.kernels import compile_cache
    from k3tune.kernels.gemm_smallm import current_arch
    from k3tune.search.compile_farm import CompileFarm

    old = os.environ.get("K3TUNE_KERNEL_CACHE")
    with tempfile.TemporaryDirectory() as d:
        os.environ["K3TUNE_KERNEL_CACHE"] = d
        compile_cache.install()
        try:
            with CompileFarm(max(1, (os.cpu_count() or 3) - 2), current_arch()) as f:
                yield f
        finally:
            if old is None:
                os.environ.pop("K3TUNE_KERNEL_CACHE")
            else:
                os.environ["K3TUNE_KERNEL_CACHE"] = old


def _built_first(farm, name: str, p: Problem, cfgs: list) -> list:
    for cfg in cfgs:
        farm.submit(p, name, cfg.params())
    farm.wait()  # a config the farm failed to build is built (and its failure raised) by the test itself
    return cfgs


def test_smallm_whole_space_numerics(farm):
    """Every config with programmatic dependent launch off, and every 8th with it on (the launch attribute and
    the L2 pull of the CTA's weight slice change no arithmetic; test_pdl_chain runs PDL chains)."""
    fam = family("gemm.smallm")
    for m, (n, k) in itertools.product((1, 3, 16), [(7168, 768), (280, 7168)]):
        p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
        pdl_on = [cfg for cfg in fam.configs(p) if cfg.pdl]
        for cfg in _built_first(farm, fam.name, p, [cfg for cfg in fam.configs(p) if not cfg.pdl] + pdl_on[::8]):
            _check("gemm.smallm", m, n, k, cfg)


# A stated sample of the tensor-core kernel's space (8100 points per problem before validity): every warp layout,
# token tile and split at one stage depth, every m_tiles, bk and stage depth at one layout; on shapes with clamped
# rows (N = 280, 1000) and clamped tokens (M = 3, 17). Every config runs twice, to check that the split-K
# counters were reset.
TC_SAMPLE = sorted({(1, wn, wk, tm, s, 128 if wk == 4 else 64, 3, rd, rd)
                    for wn, wk, tm, s, rd in itertools.product((1, 2, 4), (1, 2, 4), (8, 64), (1, 4, 16), (0, 1))
                    if not (rd and s == 1)}
                   | {(mt, 2, 1, tm, 2, bk, st, 0, 0) for mt, tm, bk, st in itertools.product((1, 2, 4), (8, 32),
                                                                                               (32, 64, 128), (2, 4, 8))})


@pytest.mark.parametrize("m,n,k", [(3, 280, 7168), (17, 7168, 768), (64, 1000, 1536)])
def test_splitk_tc_space_sample_numerics(farm, m, n, k):
    from k3tune.kernels.gemm_splitk_tc import SplitKConfig

    fam = family("gemm.splitk_tc")
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    cfgs = [SplitKConfig(m_tiles=mt, warps_n=wn, warps_k=wk, tile_m=tm, split_k=s, bk=bk, stages=st, reduce=rd, pdl=pdl)
            for mt, wn, wk, tm, s, bk, st, rd, pdl in TC_SAMPLE]
    checked = 0
    for cfg in _built_first(farm, fam.name, p, [c for c in cfgs
                                                 if c.tile_m in fam.space(p)["tile_m"] and fam.valid(c, p)]):
        inputs = _twice(fam, p, cfg, checked)
        assert int(inputs["counters"].abs().sum()) == 0, cfg  # the last CTA of every tile reset its counter
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("m,n,k", [(3, 280, 7168), (17, 7168, 768), (64, 1000, 1536)])
def test_splitk_cluster_sample_numerics(m, n, k):
    """The cluster-summed split-K kernel: every warp layout, token tile
    and cluster size at one ring, PDL on every 3rd; rows past N (280, 1000), tokens past M (3, 17); each run twice on
    the same buffers (the mbarriers and the receive buffers are set up by every launch)."""
    from k3tune.kernels.gemm_splitk_tc import SplitKConfig

    fam = family("gemm.splitk_cluster")
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    cfgs = [SplitKConfig(m_tiles=1, warps_n=wn, warps_k=wk, tile_m=tm, split_k=s, bk=128 if wk == 4 else 64,
                         stages=3, reduce=0, pdl=int(i % 3 == 0))
            for i, (wn, wk, tm, s) in enumerate(itertools.product((1, 2, 4), (1, 2, 4), (8, 32), (2, 4, 8)))]
    cfgs = [c for c in cfgs if c.tile_m in fam.space(p)["tile_m"] and fam.valid(c, p)]
    for i, cfg in enumerate(cfgs):
        _twice(fam, p, cfg, 3000 + i)
    assert len(cfgs) >= 12, len(cfgs)


@pytest.mark.parametrize("m,n,k", [(3, 280, 7168), (17, 7168, 2048), (16, 1536, 7168)])
def test_wgmma_cktrig_numerics(m, n, k):
    """Staged gemm.wgmma_cktrig (wgmma_ck triggering the next launch ``late`` stages before the end of its K loop):
    every valid trigger point at two layouts (an uneven split of 5 among them), each run twice."""
    from k3tune.kernels.pdl_trigger import LATE
    from k3tune.kernels.gemm_wgmma_cktrig import WgmmaTrigConfig

    fam = family("gemm.wgmma_cktrig")
    p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    cfgs = [WgmmaTrigConfig(warpgroups=1, tile_m=tm, split_k=s, bk=128, stages=4, pdl=pdl, late=late)
            for late in LATE for tm, s in ((8, 8), (16, 5)) for pdl in (0, 1)]
    cfgs = [c for c in cfgs if fam.valid(c, p)]  # the trigger points inside each layout's slices, its first, no PDL
    for i, cfg in enumerate(cfgs):
        _twice(fam, p, cfg, 6000 + i)
    assert {(0, 0), (1, 1), (1, LATE[-1])} <= {(c.pdl, c.late) for c in cfgs} and len(cfgs) >= 7, len(cfgs)


@pytest.mark.parametrize("name,knobs", [("gemm.splitk_tc", {"split_k": 1, "reduce": 0}),
                                        ("gemm.splitk_tc", {"split_k": 4, "reduce": 0}),
                                        ("gemm.splitk_tc", {"split_k": 4, "reduce": 1}),
                                        ("gemm.smallm", {"split_k": 1}), ("gemm.smallm", {"split_k": 4}),
                                        ("gemm.wgmma", {"split_k": 1}), ("gemm.wgmma", {"split_k": 4}),
                                        ("gemm.stream", {"rows": 8, "warps": 4, "mma": 1}),
                                        ("gemm.splitk_cluster", {"split_k": 4}),
                                        ("gemm.wgmma_ck", {"split_k": 3, "bk": 128}),
                                        ("gemm.wgmma_ck", {"split_k": 8, "bk": 64}),
                                        ("gemm.wgmma_cktrig", {"split_k": 5, "bk": 64, "late": 2})])
def test_pdl_chain(name, knobs):
    """Programmatic dependent launch: y1 = x W1^T, then y2 = y1 W2^T on the same stream, both launched with PDL (the
    second starts while the first finishes and must wait for y1), eagerly and replayed in a CUDA graph; and the
    same chain twice in a row (each launch rewrites the buffers the previous one read)."""
    import torch

    fam = family(name)
    m, n1, k1, n2 = 5, 1024, 7168, 7168
    p1 = Problem("kda.o_proj", "gemm", (("M", m), ("N", n1), ("K", k1)))
    p2 = Problem("kda.o_proj", "gemm", (("M", m), ("N", n2), ("K", n1)))
    cfg = fam.config_from_params(p1, {**fam.default_config(p1).params(), **knobs, "pdl": 1})
    assert cfg == fam.config_from_params(p2, cfg.params())  # one config serves both shapes
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = fam.make_inputs(p1, torch.device("cuda"), gen)
    b = fam.make_inputs(p2, torch.device("cuda"), gen)
    b["x"] = a["out"]  # the second GEMM reads what the first writes
    r1, r2 = fam.build(p1, cfg), fam.build(p2, fam.config_from_params(p2, cfg.params()))

    def chain():
        r1(a)
        r2(b)

    for replay in ("eager", "graph"):
        a["out"].fill_(float("nan"))
        b["out"].fill_(float("nan"))
        if replay == "eager":
            chain()
            chain()
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
                chain()
            a["out"].fill_(float("nan"))
            b["out"].fill_(float("nan"))
            g.replay()
        torch.cuda.synchronize()
        ref1 = fam.reference(p1, a)
        assert relative_error(a["out"], ref1) < fam.tolerance(p1), replay
        ref2 = a["out"].float() @ b["w"].float().t()  # from the y1 the first kernel wrote
        assert relative_error(b["out"], ref2) < fam.tolerance(p2), replay


@pytest.mark.parametrize("module,problem,name,params", [
    ("gemm_smallm", Problem("kda.o_proj", "gemm", (("M", 5), ("N", 7168), ("K", 1536))), "gemm.smallm",
     {"rows_per_cta": 2, "warps": 8, "split_k": 2, "unroll": 2, "pdl": 1}),
    ("gemm_splitk_tc", Problem("moe.router_latent", "gemm", (("M", 24), ("N", 560), ("K", 7168))), "gemm.splitk_tc",
     {"m_tiles": 2, "warps_n": 1, "warps_k": 4, "tile_m": 32, "split_k": 2, "bk": 128, "stages": 4, "reduce": 1,
      "pdl": 0}),  # not in TC_SAMPLE
    ("gemm_wgmma", Problem("kda.o_proj", "gemm", (("M", 40), ("N", 7168), ("K", 1536))), "gemm.wgmma",
     {"warpgroups": 2, "tile_m": 64, "split_k": 2, "bk": 64, "stages": 6, "pdl": 1}),
    ("gemm_stream", Problem("mla.kv_a", "gemm", (("M", 6), ("N", 576), ("K", 7168))), "gemm.stream",
     {"rows": 5, "warps": 16, "mma": 1, "pdl": 1})])
def test_measurer_runs_the_requested_kernel(module, problem, name, params):
    import importlib

    from k3tune.search.measure_gpu import GpuBackend

    mod = importlib.import_module(f"k3tune.kernels.{module}")
    before = mod.compiled.cache_info().misses
    out = GpuBackend().measure(Task(1, problem, name, params, 0, 5))
    assert out.status == "ok" and out.median_us > 0, f"{out.status}: {out.error}"
    assert mod.compiled.cache_info().misses == before + 1  # compiled (and so launched) this config


def test_measurer_times_each_trial_on_independent_allocations():
    """A dense trial is timed on ALLOC_ROUNDS allocations of its weight copies, each on fresh memory (the
    earlier rounds' buffers are held), ``samples`` replays split among them; a trial records every replay."""
    import torch

    from k3tune.search import measure_gpu
    from k3tune.search.measure_gpu import ALLOC_ROUNDS, GpuBackend, alloc_rounds, time_rounds

    p = Problem("kda.o_proj", "gemm", (("M", 2), ("N", 7168), ("K", 1536)))
    fam = family("gemm.cublas")
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs = fam.make_inputs(p, torch.device("cuda"), gen)
    assert alloc_rounds(fam, p, inputs) == ALLOC_ROUNDS > 1
    seen = []
    real = measure_gpu.rotation_sets

    def spy(f, prob, base):
        sets = real(f, prob, base)
        seen.append({s["w"].data_ptr() for s in sets})
        assert len(seen[-1]) == len(sets) > 1, "every copy's weights at an address of its own (L2 holds addresses)"
        return sets

    measure_gpu.rotation_sets = spy
    try:
        per_round = time_rounds(fam.build(p, fam.default_config(p)), fam, p, inputs, gen, 9, ALLOC_ROUNDS)
    finally:
        measure_gpu.rotation_sets = real
    assert [len(t) for t in per_round] == [3] * ALLOC_ROUNDS and all(x > 0 for t in per_round for x in t)
    assert len(seen) == ALLOC_ROUNDS and len(set().union(*seen)) == sum(map(len, seen)), "rounds share no buffer"
    assert inputs["w"].data_ptr() in seen[0], "round 0 times the inputs' own weights"
    out = GpuBackend().measure(Task(1, p, "gemm.cublas", {}, 0, 9))
    assert out.status == "ok" and out.samples == 9


def test_timed_replays_are_queued_behind_a_spin_not_synchronised_one_by_one(monkeypatch):
    """time_graph queues every timed replay and its events behind one spin on the GPU and synchronises once (s27:
    synchronising after each sample put the host's graph launch, and any stall of a busy host, inside the next
    sample); the old method stays reachable for bench/timing_hold.py. Both return one per-launch time a sample."""
    import torch

    from k3tune.search import measure_gpu

    p = Problem("kda.o_proj", "gemm", (("M", 2), ("N", 7168), ("K", 1536)))
    fam = family("gemm.cublas")
    inputs = fam.make_inputs(p, torch.device("cuda"), torch.Generator(device="cuda").manual_seed(6))
    sets = measure_gpu.rotation_sets(fam, p, inputs)
    run = fam.build(p, fam.default_config(p))
    spins, syncs = [], []
    real_sleep, real_sync = torch.cuda._sleep, torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda, "_sleep", lambda n: (spins.append(n), real_sleep(n))[1])
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda ev: (syncs.append(ev), real_sync(ev))[1])
    queued = measure_gpu.time_graph(run, sets, 7)
    assert spins == [measure_gpu.HOLD_CYCLES] and syncs == [], "queued: one spin, no per-sample synchronisation"
    old = measure_gpu.time_graph(run, sets, 7, queued=False)
    assert spins == [measure_gpu.HOLD_CYCLES] and len(syncs) == 7
    assert len(queued) == len(old) == 7 and all(0 < t < 1e4 for t in queued + old)


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


def test_kline_fits_a_fixed_part_and_a_rate_over_k(tmp_path):
    """bench/kline.py end to end, as it runs on the device: a split-K config and cuBLAS over three K, each point
    checked against the reference and timed, a line fitted per config and written atomically."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "kline.json"
    subprocess.run([sys.executable, "kline.py", "--family", "gemm.splitk_cluster", "--configs", '[{"split_k": 2}]',
                    "--n", "256", "--ks", "1024,2048,4096", "--ms", "8", "--samples", "3", "--rounds", "1",
                    "--out", str(out)], cwd=Path(__file__).resolve().parents[1] / "bench", check=True, timeout=600)
    lines = json.loads(out.read_text())["lines"]
    assert [(ln["family"], ln["M"], ln["params"]) for ln in lines] == [("gemm.splitk_cluster", 8, {"split_k": 2}),
                                                                        ("gemm.cublas", 8, {})]
    for ln in lines:
        assert [q["K"] for q in ln["points"]] == [1024, 2048, 4096]
        assert all(q["err"] < 2e-2 and q["us"] > 0 for q in ln["points"])
        assert ln["rate_tbps"] > 0


def test_timeline_stamps_every_cta_in_order(tmp_path):
    """bench/timeline.py end to end: splitk_cluster with clock stamps in a CUDA graph of launches gives the
    reference's result, and over the steady-state launches (medians) the first CTA starts before the first K loop
    ends, and the last K loop ends before the launch's last exit."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "timeline.json"
    cfg = {"warps_n": 1, "warps_k": 4, "tile_m": 8, "split_k": 4, "bk": 128, "stages": 4, "pdl": 1}
    subprocess.run([sys.executable, "timeline.py", "--configs", json.dumps([[8, cfg]]), "--n", "256", "--k", "4096",
                    "--launches", "8", "--out", str(out)],
                   cwd=Path(__file__).resolve().parents[1] / "bench", check=True, timeout=600)
    (r,) = json.loads(out.read_text())
    u = r["us"]
    assert r["err"] < 2e-2 and r["ctas"] == 16 * 4 and r["sms_used"] >= 1
    assert u["first_start"] <= u["first_done"] <= u["last_done"] <= u["last_exit"]
