"""Kernel registry: declared spaces, defaults, refusal of out-of-space params, digests, and the torch
baselines' numerics against their fp32 references on the CPU."""

import pytest
import torch

from k3tune.errors import CannotImplement
from k3tune.kernels import FAMILIES, families_for, family, op_digest, safe_default
from k3tune.plan import model, problems, spec
from k3tune.search.outcome import relative_error


@pytest.fixture(scope="module")
def plan():
    return problems.build(spec.load(), model.load())


def test_every_problem_has_a_safe_gpu_default_or_is_declared(plan):
    for p in plan.problems:
        fam, cfg = safe_default(p)
        assert fam.can_implement(p)
        fam.config_from_params(p, cfg.params())  # inside the declared space
        if p.kind != "moe_block":
            assert "gpu" in fam.backends, p.key


def test_defaults_and_spaces_are_consistent(plan):
    from itertools import islice

    from k3tune.kernels.base import ENUMERATE_LIMIT

    from k3tune.kernels import STAGED

    for p in plan.problems[::7]:
        staged = [f for f in STAGED.values() if f.can_implement(p)]
        for f in families_for(p, "simulated") + staged:
            default = f.default_config(p)
            f.config_from_params(p, default.params())  # inside the declared space, valid
            if f.space_size(p) > ENUMERATE_LIMIT:  # a block's joint space (billions): never listed
                assert next(iter(f.configs(p)), None) is not None, (f.name, p.key)
                continue
            cfgs = list(islice(f.configs(p), ENUMERATE_LIMIT))
            assert cfgs, (f.name, p.key)
            assert default in cfgs or f.space_size(p) == 1


def test_every_familys_longest_params_key_fits_the_trials_column():
    """The longest value of every knob at once, over the problems of every shipped spec a family implements, keys
    within trials.params_key's width (PostgreSQL enforces it; s24: the block's 30 knobs took 406 of 400)."""
    import dataclasses

    from k3tune.errors import CannotImplement
    from k3tune.kernels import params_key
    from k3tune.shipped import configs_dir
    from k3tune.store.models import PARAMS_KEY_CHARS

    longest = {}
    for path in sorted(configs_dir().glob("sweep_*.toml")):
        sp = spec.load(str(path))
        for p in problems.build(sp, model.load(sp.model_config)).problems[::5]:
            for f in FAMILIES.values():
                if f.can_implement(p):
                    try:
                        base = dataclasses.asdict(f.default_config(p))
                    except CannotImplement:  # no valid config for this shape: nothing of it is ever keyed
                        continue
                    wide = {k: max(vals, key=lambda v: len(str(v))) for k, vals in f.space(p).items()}
                    key = params_key({**base, **wide})
                    longest[f.name] = max(longest.get(f.name, 0), len(key))
    assert "moe.overlap" in longest and "gemm.stream" in longest, sorted(longest)
    assert max(longest.values()) <= PARAMS_KEY_CHARS, longest


def test_declared_families_never_offered_to_gpu(plan):
    for p in plan.problems[::11]:
        assert all(not f.declared_only for f in families_for(p, "gpu"))


def test_params_outside_space_refused():
    p = problems.Problem("kda.o_proj", "gemm", (("M", 4), ("N", 7168), ("K", 1536)))
    f = family("gemm.smallm")
    f.config_from_params(p, {"rows_per_cta": 4, "warps": 4, "split_k": 2, "unroll": 1, "pdl": 0})
    with pytest.raises(CannotImplement, match="outside the declared space"):
        f.config_from_params(p, {"rows_per_cta": 3, "warps": 4, "split_k": 2, "unroll": 1, "pdl": 0})
    with pytest.raises(CannotImplement, match="do not match"):
        f.config_from_params(p, {"rows_per_cta": 4})
    big = problems.Problem("kda.o_proj", "gemm", (("M", 64), ("N", 7168), ("K", 1536)))
    with pytest.raises(CannotImplement, match="cannot implement"):
        f.config_from_params(big, {"rows_per_cta": 4, "warps": 4, "split_k": 2, "unroll": 1, "pdl": 0})


def test_counting_configs_stops_past_a_limit():
    """A sweep asks, for every problem at its start, whether a space fits the search budget: the count stops
    at the first valid config past the limit (an answer above the limit only means "more"), and equals the full
    count when the limit is not reached; a partial count is never remembered as the full one."""
    from k3tune.kernels import count_configs

    p = problems.Problem("mla.q_a", "gemm", (("M", 16), ("N", 768), ("K", 7168)))
    fams = [family("gemm.splitk_tc"), family("gemm.smallm")]
    assert count_configs(p, fams, limit=20) == 21
    full = count_configs(p, fams)
    assert full == sum(1 for f in fams for _ in f.configs(p)) > 21
    assert count_configs(p, fams, limit=full) == full
    assert count_configs(p, fams, limit=20) > 20, "once known, the full count answers (it is more than 20)"


def test_op_digest_depends_on_backend_and_is_stable():
    assert op_digest("kda.o_proj", "gpu") == op_digest("kda.o_proj", "gpu")
    assert op_digest("kda.o_proj", "gpu") != op_digest("kda.o_proj", "simulated")
    assert len({f.digest for f in FAMILIES.values()}) >= 5


GEMM_SHAPES = [(1, 96, 256), (3, 80, 136), (17, 64, 264)]


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
@pytest.mark.parametrize("name", ["gemm.cublas", "testing.cpu_gemm"])
def test_gemm_families_match_reference_cpu(name, m, n, k):
    p = problems.Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
    f = family(name)
    for cfg in f.configs(p):
        inputs = f.make_inputs(p, "cpu", torch.Generator().manual_seed(m * n + k))
        out = f.build(p, cfg)(inputs)
        assert out.shape == (m, n)
        assert relative_error(out, f.reference(p, inputs)) < f.tolerance(p)


def test_kda_baseline_matches_reference_cpu():
    p = problems.Problem("kda.decode", "kda_decode", (("heads", 3), ("head_dim", 16), ("batch", 2), ("qlen", 3)))
    f = family("kda.torch")
    inputs = f.make_inputs(p, "cpu", torch.Generator().manual_seed(1))
    out = f.build(p, f.default_config(p))(inputs)
    assert out.shape == (2, 3, 3, 16)
    assert relative_error(out, f.reference(p, inputs)) < f.tolerance(p)


def test_mla_baseline_matches_reference_cpu():
    p = problems.Problem("mla.decode", "mla_decode", (("heads", 5), ("kv_lora", 32), ("rope", 8), ("batch", 2),
                                                      ("qlen", 2), ("ctx", 77)))
    f = family("mla.torch")
    inputs = f.make_inputs(p, "cpu", torch.Generator().manual_seed(2))
    out = f.build(p, f.default_config(p))(inputs)
    assert out.shape == (2, 10, 32)
    assert relative_error(out, f.reference(p, inputs)) < f.tolerance(p)


def test_relative_error_rejects_nan():
    ref = torch.ones(4, 4)
    out = ref.clone()
    out[1, 1] = float("nan")
    assert relative_error(out, ref) == float("inf")


def test_params_and_remembered_defaults_match_the_plain_ones():
    """params() is a shallow dataclasses.asdict (every knob is a scalar); default_config is remembered per problem
    and a problem a family cannot implement raises afresh every time."""
    import dataclasses

    from k3tune.plan.problems import Problem

    p = Problem("kda.o_proj", "gemm", (("M", 5), ("N", 7168), ("K", 1536)))
    gemms = [f for f in FAMILIES.values() if f.can_implement(p)]
    assert len(gemms) >= 4
    for f in gemms:
        cfg = f.default_config(p)
        assert cfg.params() == dataclasses.asdict(cfg) and f.default_config(p) == f._default_config(p)
    tc, odd = family("gemm.splitk_tc"), Problem("kda.o_proj", "gemm", (("M", 5), ("N", 64), ("K", 100)))
    errors = []
    for _ in range(2):
        with pytest.raises(CannotImplement) as e:
            tc.default_config(odd)
        errors.append(e.value)
    assert errors[0] is not errors[1] and str(errors[0]) == str(errors[1])


@pytest.fixture()
def staged_registry(monkeypatch):
    """A fake staged dense family in a private copy of the registry (and the registry's caches cleared around)."""
    import k3tune.kernels as kernels
    from k3tune.kernels.gemm_cublas import CublasGemm

    class Staged(CublasGemm):
        name = "gemm.staged_test"
        digest = "0123456789abcdef"

    for f in (kernels.op_digest, kernels._candidates):
        f.cache_clear()
    monkeypatch.setattr(kernels, "FAMILIES", dict(kernels.FAMILIES))
    monkeypatch.setattr(kernels, "STAGED", {Staged.name: Staged()})
    monkeypatch.setattr(kernels, "LANDED_ON", {})
    monkeypatch.delenv("K3TUNE_EXTRA_FAMILIES", raising=False)
    yield kernels
    for f in (kernels.op_digest, kernels._candidates):
        f.cache_clear()


def test_staged_family_is_buildable_by_name_but_keys_nothing_until_named(staged_registry, monkeypatch):
    """A staged family has GPU code but the shipped winners of its ops were tuned without it: it must not re-key
    them (op_digest) nor be offered to a sweep unless K3TUNE_EXTRA_FAMILIES names it. Named, it keys them as it
    will once moved to FAMILIES, so a table re-swept under the variable is current when the family lands."""
    k = staged_registry
    p = problems.Problem("kda.o_proj", "gemm", (("M", 32), ("N", 7168), ("K", 1536)))
    shipped = dict(k.FAMILIES)
    plain = k.op_digest("kda.o_proj", "gpu")
    assert k.family("gemm.staged_test") is k.STAGED["gemm.staged_test"]
    assert "gemm.staged_test" not in [f.name for f in k.families_for(p, "gpu")]
    monkeypatch.setenv("K3TUNE_EXTRA_FAMILIES", "gemm.staged_test")
    k._extra_families()
    for f in (k.op_digest, k._candidates):
        f.cache_clear()
    assert "gemm.staged_test" in [f.name for f in k.families_for(p, "gpu")]
    named = k.op_digest("kda.o_proj", "gpu")
    assert named != plain
    monkeypatch.delenv("K3TUNE_EXTRA_FAMILIES")
    monkeypatch.setattr(k, "FAMILIES", {**shipped, "gemm.staged_test": k.STAGED["gemm.staged_test"]})  # landed
    for f in (k.op_digest, k._candidates):
        f.cache_clear()
    assert k.op_digest("kda.o_proj", "gpu") == named


def test_a_family_landed_on_one_hardware_is_offered_and_keyed_there_only(staged_registry, monkeypatch):
    """LANDED_ON: a staged family whose re-sweep shipped for one hardware (by class key) keys and is offered there as
    if landed, its ops' blocks too, and nowhere else: another table, tuned without it, stays current. It keys there
    as under K3TUNE_EXTRA_FAMILIES (the re-sweep's variable), so the table swept under the variable is current."""
    k = staged_registry
    a, b = "GPU-A|cc9.0|132sm|79GiB", "GPU-B|cc9.0|132sm|132GiB"
    p = problems.Problem("kda.o_proj", "gemm", (("M", 32), ("N", 7168), ("K", 1536)))
    ops = ("kda.o_proj", "moe.block", "kda.decode")
    plain = {op: k.op_digest(op, "gpu") for op in ops}
    monkeypatch.setattr(k, "LANDED_ON", {"gemm.staged_test": frozenset({a})})
    for f in (k.op_digest, k._candidates):
        f.cache_clear()
    on_a = {op: k.op_digest(op, "gpu", a) for op in ops}
    assert {op: k.op_digest(op, "gpu", b) for op in ops} == plain == {op: k.op_digest(op, "gpu") for op in ops}
    assert on_a["kda.o_proj"] != plain["kda.o_proj"] and on_a["moe.block"] != plain["moe.block"]
    assert on_a["kda.decode"] == plain["kda.decode"]  # an op the family cannot serve
    assert k.op_digest("kda.o_proj", "simulated", "sim:" + a) == k.op_digest("kda.o_proj", "simulated")
    named = lambda hw: [f.name for f in k.families_for(p, "gpu", "sm_90a", hw)]  # noqa: E731
    assert "gemm.staged_test" in named(a) and "gemm.staged_test" not in named(b) + named(None)
    monkeypatch.setenv("K3TUNE_EXTRA_FAMILIES", "gemm.staged_test")
    k._extra_families()
    for f in (k.op_digest, k._candidates):
        f.cache_clear()
    assert k.op_digest("kda.o_proj", "gpu") == on_a["kda.o_proj"] == k.op_digest("kda.o_proj", "gpu", a)
    assert k.op_digest("moe.block", "gpu", b) == on_a["moe.block"]


def test_landed_on_names_staged_families_by_measured_class_keys():
    """Every LANDED_ON entry is a staged family (one moved to FAMILIES leaves it) and names measured
    hardware by the form of ``Fingerprint.class_key`` (a simulated key would never match a measured table)."""
    import k3tune.kernels as kernels

    for name, keys in kernels.LANDED_ON.items():
        assert name in kernels.STAGED, name
        assert keys and all(not key.startswith("sim:") and key.count("|") == 3 for key in keys), keys


def test_block_key_covers_the_dense_kernels_it_runs(staged_registry):
    """A measured MoE block runs the selector's dense projections: a change to a dense family that may serve them
    re-keys the block's GPU winners, but not an op that runs none (KDA decode), nor the simulated block (which
    models its dense phases itself)."""
    k = staged_registry
    from k3tune.kernels.gemm_stream import StreamGemm

    class Edited(StreamGemm):
        digest = "fedcba9876543210"

    ops = ("moe.block", "kda.decode", "moe.shared_w13", "kda.o_proj")
    before = {(op, b): k.op_digest(op, b) for op in ops for b in ("gpu", "simulated")}
    k.FAMILIES["gemm.stream"] = Edited()
    for f in (k.op_digest, k._candidates):
        f.cache_clear()
    after = {(op, b): k.op_digest(op, b) for op in ops for b in ("gpu", "simulated")}
    changed = {key for key in before if before[key] != after[key]}
    assert ("moe.block", "gpu") in changed and ("moe.shared_w13", "gpu") in changed
    assert ("kda.decode", "gpu") not in changed and ("moe.block", "simulated") not in changed
    assert problems.OPS["moe.block"].runs == ("moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2")


def test_unknown_extra_family_is_a_clear_error(staged_registry, monkeypatch):
    from k3tune.errors import ConfigError

    monkeypatch.setenv("K3TUNE_EXTRA_FAMILIES", "gemm.nosuch")
    staged_registry._extra_families()  # at import: no traceback there; the first use says it
    try:
        p = problems.Problem("kda.o_proj", "gemm", (("M", 32), ("N", 7168), ("K", 1536)))
        for use in (lambda: staged_registry.family("gemm.cublas"), lambda: staged_registry.families_for(p, "gpu")):
            with pytest.raises(ConfigError, match="K3TUNE_EXTRA_FAMILIES names 'gemm.nosuch'"):
                use()
    finally:
        monkeypatch.delenv("K3TUNE_EXTRA_FAMILIES")
        staged_registry._extra_families()


def test_unknown_extra_family_on_the_command_line_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from k3tune.kernels import STAGED

    env = {**os.environ, "K3TUNE_EXTRA_FAMILIES": "gemm.nosuch"}
    for argv in (["plan"], ["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", "s.sqlite"]):
        out = subprocess.run([sys.executable, "-m", "k3tune", *argv], env=env, capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert out.returncode != 0
        assert out.stderr.strip().splitlines() == [
            f"error: K3TUNE_EXTRA_FAMILIES names 'gemm.nosuch', which is no staged family (staged: {', '.join(STAGED) or 'none'})"]
    assert not list(tmp_path.iterdir())  # the sweep refused before it made a database (it had left an empty one)
