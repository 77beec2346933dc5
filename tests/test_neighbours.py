"""The warm starts a sweep offers a problem from the stored winners (k3tune/search/neighbours.py), read from a real
SQLite database that a simulated sweep filled."""

import pytest

from k3tune.kernels import families_for
from k3tune.plan import hardware, model, problems as plans, spec
from k3tune.search.driver import BACKEND_LABEL, SweepOptions, fingerprint_for, run_sweep
from k3tune.search.neighbours import Neighbours, distance
from k3tune.store import db as store_db, records

GB300 = hardware.spec("gb300")


def _swept(db_path):
    sp = spec.from_dict({"matrix": {"tp": [8, 16], "batch": [1, 2, 4], "ops": ["kda.o_proj", "mla.o_proj"]},
                         "buckets": {"tokens": [1, 2, 4], "batch": [1, 2, 4], "query_len": [1]},
                         "search": {"budget": 4, "samples": 3, "polish": 0}})
    db = store_db.open_db(db_path)
    run_sweep(SweepOptions(sp, model.load(), db, "simulated", 1, hw=GB300))
    problems = sorted(p for p in plans.build(sp, model.load()).problems if families_for(p, "simulated"))
    with db.session() as s:
        hw_id = records.hardware_id(s, fingerprint_for("simulated", GB300))
        pids = records.problem_ids(s, problems)
    return db, sp, hw_id, {pid: p for p, pid in pids.items()}


def test_a_problem_is_offered_its_own_winner_then_its_shape_twins_then_its_nearest_op_neighbours(db_path):
    db, sp, hw_id, by_id = _swept(db_path)
    near = Neighbours(db, hw_id, BACKEND_LABEL["simulated"], [], by_id, sp.search,
                      lambda p: families_for(p, "simulated"), lambda msg: None)
    near.load()
    p = next(q for q in by_id.values() if q.op == "kda.o_proj" and q["K"] == 1536 and q["M"] == 2)
    got = near.near(p)
    assert got[0][0] == p, "the problem's own stored winner comes first"
    twin = next(i for i, n in enumerate(got) if n[0].op == "mla.o_proj")
    assert got[twin][0].dims == p.dims, "then the other op of its very shape"
    others = [n[0] for n in got[twin + 1:]]
    assert len(others) == 2 and all(q.op == p.op and q != p for q in others), "then two of its own op, no more"
    ranked = sorted((q for q in by_id.values() if q.op == p.op and q != p), key=lambda q: (distance(q, p), q.key))
    assert {distance(q, p) for q in others} == {distance(q, p) for q in ranked[:2]}, "the nearest ones"
    assert [w[2] for w in near.warm(p)] == [n[0] for n in got], "warm starts name the problem each won on"

    near.polishing = True  # a polish pass offers more of its op's neighbours (the spec's default: 4)
    assert len([n for n in near.near(p) if n[0].op == p.op and n[0] != p]) == min(4, len(ranked))


def test_distance_is_zero_for_a_shape_and_grows_with_the_log_of_each_size():
    a = plans.Problem("kda.o_proj", "gemm", (("M", 2), ("N", 7168), ("K", 1536)))
    b = plans.Problem("mla.o_proj", "gemm", (("M", 2), ("N", 7168), ("K", 1536)))
    c = plans.Problem("kda.o_proj", "gemm", (("M", 4), ("N", 7168), ("K", 1536)))
    d = plans.Problem("kda.o_proj", "gemm", (("M", 8), ("N", 7168), ("K", 768)))
    assert distance(a, b) == 0
    assert 0 < distance(a, c) < distance(a, d)
    assert distance(a, d) == distance(d, a)


def test_a_database_failing_as_the_winners_are_read_ends_the_run_and_frees_its_claims(db_path, monkeypatch):
    """The first read of the search (the stored winners) fails: the sweep raises, its run is recorded as failed,
    no claim stays held for another sweep to wait out, and no worker process is left behind."""
    import multiprocessing

    from sqlalchemy import select

    from k3tune.errors import DatabaseError
    from k3tune.search import neighbours
    from k3tune.store.models import Claim, Run

    def fail(self):
        raise DatabaseError("the server went away")

    monkeypatch.setattr(neighbours.Neighbours, "load", fail)
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [1, 2], "batch": [1], "query_len": [1]},
                         "search": {"budget": 4, "samples": 3, "polish": 0}})
    db = store_db.open_db(db_path)
    before = {c.pid for c in multiprocessing.active_children()}  # another test's, not this sweep's
    with pytest.raises(DatabaseError, match="went away"):
        run_sweep(SweepOptions(sp, model.load(), db, "simulated", 2, hw=GB300))
    with db.session() as s:
        assert s.scalars(select(Run.status)).all() == ["failed"]
        assert s.scalars(select(Claim.state)).all() and "claimed" not in s.scalars(select(Claim.state)).all()
    assert not [c for c in multiprocessing.active_children() if c.is_alive() and c.pid not in before]
