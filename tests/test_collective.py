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


def test_a_collective_sweep_that_cannot_run_records_failed_trials_and_no_winner(tmp_path):
    """The driver's collective step on a machine without GPUs, with a real SQLite file and the real group
    measurer (its ranks fail to start): every variant is recorded as a failed trial, no winner is written,
    the claim is finished, and the sweep statistics say so."""
    import torch

    from k3tune.kernels import op_digest
    from k3tune.plan.hardware import Fingerprint
    from k3tune.search.driver import SweepOptions, SweepStats, _tune_collectives
    from k3tune.store import records
    from k3tune.store.db import Database
    from k3tune.store.models import Backend, Claim, Trial, Winner

    if torch.cuda.is_available():
        pytest.skip("checks the failure path: needs a machine without GPUs")
    sp = spec.load(X2)
    p = problems.build(sp, model.load()).problems[0]
    db = Database(tmp_path / "coll.sqlite")
    fp = Fingerprint("test box", "9.0", 132, 141, "none", "none", False)
    digests = {p.op: op_digest(p.op, "gpu")}
    with db.session() as s:
        hw = records.hardware_id(s, fp)
        sw = records.software_id(s, records.software_versions())
        pids = records.problem_ids(s, [p])
        run = records.start_run(s, command="test", backend=Backend.measured, hw_id=hw, sw_id=sw,
                                spec_digest=sp.digest())
        run_id, owner = run.id, run.owner
        records.plan_claims(s, hw, Backend.measured, {pids[p]: digests[p.op]})
    with db.session() as s:
        assert records.claim(s, hw, Backend.measured, owner, {pids[p]: digests[p.op]}, 1, 60) == [pids[p]]
    stats = SweepStats()
    opt = SweepOptions(sp, model.load(), db, "gpu", 2, trial_timeout_s=60)
    _tune_collectives([p], pids, opt, hw, run_id, Backend.measured, digests, stats, lambda msg="": None)
    with db.session() as s:
        trials = s.query(Trial).all()
        assert len(trials) == 4 and {t.status.value for t in trials} == {"runtime_failed"}
        assert {t.params["variant"] for t in trials} == {"nccl", "symm_one_shot", "symm_two_shot", "fused_one_shot"}
        assert s.query(Winner).count() == 0
        assert s.query(Claim).one().state == "done"
    assert stats.trials == 4 and stats.failed == 4 and stats.no_winner == [p.key] and stats.problems_done == 1
