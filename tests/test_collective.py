"""The TP all-reduce as a tuned op, on the CPU: it is planned only by specs that name it, keyed by its group
size, has no simulated or single-GPU path, and its group measurer turns a group that cannot run into failed
trials (real spawned processes) instead of a hung or crashed sweep. The group run itself is a GPU test
(tests/test_gpu_allreduce.py, two or more GPUs)."""

import pytest

from k3tune.errors import ConfigError
from k3tune.kernels import families_for, family
from k3tune.plan import hardware, model, problems, spec
from k3tune.search.outcome import Outcome
from k3tune.shipped import configs_dir

X2 = configs_dir() / "sweep_h200x2_allreduce.toml"


def test_allreduce_is_planned_only_where_a_spec_names_it_and_keyed_by_group():
    m = model.load()
    assert not [p for p in problems.build(spec.load("default"), m).problems if p.op == "tp.allreduce"]
    got = problems.build(spec.load(X2), m).problems
    assert [p.key for p in got][:2] == ["tp.allreduce[group=2,M=1,N=7168,K=6144]",
                                        "tp.allreduce[group=2,M=2,N=7168,K=6144]"]
    assert len(got) == 7
    fam = family("tp.allreduce")
    assert [c.params()["variant"] for c in fam.configs(got[0])] == ["nccl", "symm_one_shot", "symm_two_shot",
                                                                     "fused_one_shot"]
    assert fam.default_config(got[0]).variant == "nccl"  # what serving runs untuned: the stock collective
    assert families_for(got[0], "simulated") == [] and families_for(got[0], "cpu") == []


def test_a_simulated_sweep_of_collectives_says_there_is_nothing_to_tune(tmp_path):
    from k3tune.search.driver import SweepOptions, run_sweep
    from k3tune.store.db import Database

    with pytest.raises(ConfigError, match="nothing to tune on the simulated backend"):
        run_sweep(SweepOptions(spec.load(X2), model.load(), Database(tmp_path / "x.sqlite"), "simulated", 1,
                               hw=hardware.spec("gb300")))


def test_ties_go_to_the_safer_variant():
    from k3tune.search.measure_collective import fastest

    order = ["nccl", "one", "two", "fused"]
    outs = {"nccl": Outcome("ok", 10.0, 0.5), "fused": Outcome("ok", 9.8, 0.3), "two": Outcome("wrong_result")}
    assert fastest(outs, order) == "nccl"  # within the fastest one's spread
    outs["fused"] = Outcome("ok", 8.0, 0.3)
    assert fastest(outs, order) == "fused"
    assert fastest({"two": Outcome("runtime_failed")}, order) is None


def test_a_group_that_cannot_run_costs_failed_trials_not_the_sweep():
    import torch

    from k3tune.search.measure_collective import measure

    if torch.cuda.is_available():
        pytest.skip("checks the failure path: needs a machine without GPUs")
    p = problems.build(spec.load(X2), model.load()).problems[0]
    res = measure([(p, [{"variant": "nccl"}, {"variant": "fused_one_shot"}])], 2, deadline_s=60)
    assert set(res) == {(p.key, '{"variant":"nccl"}'), (p.key, '{"variant":"fused_one_shot"}')}
    assert all(o.status == "runtime_failed" and "did not start" in o.error for o in res.values()), res
