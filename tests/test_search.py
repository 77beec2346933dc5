"""Sweeps: real worker processes that crash, hang or fail, sweeps that resume without duplicates, polish
passes, and the bench tools that read a sweep's database. The per-problem strategy is in test_strategy.py."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
import time

import pytest
from sqlalchemy import func, select

from k3tune.kernels import families_for, family, params_key
from k3tune.plan import hardware, model, spec
from k3tune.plan.problems import Problem
from k3tune.search import driver
from k3tune.search.driver import SweepOptions, run_sweep
from k3tune.search.method import method_digest
from k3tune.search.outcome import Task
from k3tune.search.simulate import SimulatedBackend
from k3tune.search.workers import WorkerPool
from k3tune.store import db as store_db
from k3tune.store.models import Trial, Winner

GB300 = hardware.spec("gb300")


def _cpu_task(i, block_k):
    p = Problem("kda.o_proj", "gemm", (("M", 2), ("N", 64), ("K", 1024)))
    return Task(i, p, "testing.cpu_gemm", {"block_k": block_k}, 0, 5)


def test_worker_pool_isolates_crash_hang_wrong_and_poison(monkeypatch):
    monkeypatch.setenv("K3TUNE_TEST_FAULTS", "block_k=128:crash,block_k=256:hang,block_k=512:wrong,block_k=64:raise")
    outcomes = {}
    with WorkerPool(2, ("cpu",), trial_timeout_s=8, pin_gpus=False) as pool:
        tasks = [_cpu_task(i, bk) for i, bk in enumerate([128, 256, 512, 64, 1024])]
        deadline = time.monotonic() + 120
        while len(outcomes) < len(tasks) and time.monotonic() < deadline:
            for w in pool.idle():
                pending = [t for t in tasks if t.params["block_k"] not in outcomes and all(
                    s.task is None or s.task.task_id != t.task_id for s in pool.slots)]
                if pending:
                    pool.submit(w, pending[0])
            for task, out in pool.poll(0.2):
                outcomes[task.params["block_k"]] = out
        replaced = pool.replaced
    assert outcomes[128].status == "runtime_failed" and "signal 11" in outcomes[128].error
    assert outcomes[256].status == "timeout"
    assert outcomes[512].status == "wrong_result"
    assert outcomes[64].status == "runtime_failed" and outcomes[64].poisoned
    assert outcomes[1024].status == "ok" and outcomes[1024].median_us > 0
    assert replaced == 3  # crash, hang, poison: one fresh worker each


def _opts(db, sp, backend="simulated", workers=2, **kw):
    return SweepOptions(sp, model.load(), db, backend, workers, hw=GB300 if backend == "simulated" else None, **kw)


def test_cpu_sweep_records_failures_and_still_picks_a_correct_winner(monkeypatch, db_path):
    monkeypatch.setenv("K3TUNE_TEST_FAULTS", "block_k=128:crash,block_k=512:wrong")
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [1, 2], "batch": [1], "query_len": [1]},
                         "search": {"budget": 8, "samples": 5, "remeasure_top": 2}})
    db = store_db.open_db(db_path)
    stats = run_sweep(_opts(db, sp, backend="cpu", trial_timeout_s=30))
    assert stats.problems_done == 1 and not stats.no_winner
    assert 0 < stats.first_result_s <= stats.seconds, "start-up is reported by phase"
    # where the workers' time went: measuring (of which on the CPU), and builds
    assert 0 < stats.worker_busy_s <= stats.seconds * 2 and stats.worker_busy_cpu_s > 0 and stats.worker_build_s > 0
    assert stats.workers_ready_s is None or 0 < stats.workers_ready_s <= stats.seconds
    assert 0 <= stats.pool_started_s <= stats.seconds
    if stats.workers_ready_s is not None:  # each worker's start, and its backend's share of it
        assert [w["slot"] for w in stats.worker_startup] == [0, 1]
        assert all(0 <= w["backend_s"] <= w["ready_s"] for w in stats.worker_startup)
    with db.session() as s:
        status = dict(s.execute(select(Trial.params_key, Trial.status).where(Trial.round == 0)).all())
        w = s.scalar(select(Winner))
    assert status['{"block_k":128}'].value == "runtime_failed"
    assert status['{"block_k":512}'].value == "wrong_result"
    assert w.params.get("block_k") not in (128, 512)


def test_workers_start_before_the_driver_touches_the_gpu(monkeypatch, db_path):
    """The driver's own CUDA start (the farm's arch, the hardware fingerprint) takes seconds on a GPU: the
    workers' start, which takes longer, must not wait behind it (the farm's arch is read after the pool's start,
    and only when there is a farm)."""
    order = []
    start = driver.WorkerPool.start
    monkeypatch.setattr(driver.WorkerPool, "start", lambda self: (order.append("pool"), start(self))[1])
    monkeypatch.setattr(driver, "current_arch", lambda: (order.append("arch"), "sm_90a")[1])
    fingerprint = driver.fingerprint_for
    monkeypatch.setattr(driver, "fingerprint_for", lambda *a: (order.append("fingerprint"), fingerprint(*a))[1])
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [1], "batch": [1], "query_len": [1]}, "search": {"budget": 4}})
    run_sweep(_opts(store_db.open_db(db_path), sp))
    assert order[:2] == ["pool", "fingerprint"]
    assert "arch" not in order, "no compile farm (simulated backend): no arch lookup, no torch import"


def test_a_lost_gpu_costs_its_trial_in_flight_not_the_sweep(monkeypatch, db_path):
    """Slot 1's 'GPU' dies on its first trial and never starts again: it is retired, the other two finish
    the sweep, and the only trial lost is the one that was running there."""
    monkeypatch.setenv("K3TUNE_TEST_FAULTS", "slot=1:dead")
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 2, 4], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [1, 2, 4], "batch": [1, 2, 4], "query_len": [1]},
                         "search": {"budget": 5, "samples": 5, "remeasure_top": 2}})
    db = store_db.open_db(db_path)
    stats = run_sweep(_opts(db, sp, backend="cpu", workers=3, trial_timeout_s=30))
    assert stats.problems_done == stats.problems_total == 3 and not stats.no_winner
    assert len(stats.workers_retired) == 1 and stats.workers_retired[0].startswith("worker 1: cannot start")
    with db.session() as s:
        lost = s.scalars(select(Trial).where(Trial.status == "runtime_failed")).all()
    assert len(lost) == 1 and "signal 9" in lost[0].error


def test_every_worker_lost_stops_the_sweep_with_a_clear_error(monkeypatch):
    import pytest

    from k3tune.errors import WorkerError

    monkeypatch.setenv("K3TUNE_TEST_FAULTS", "slot=0:dead")
    with pytest.raises(WorkerError, match="measurement worker 0 cannot start: RuntimeError: injected fault"):
        with WorkerPool(1, ("cpu",), trial_timeout_s=8, pin_gpus=False) as pool:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for w in pool.idle():
                    pool.submit(w, _cpu_task(1, 256))
                pool.poll(0.2)


def test_one_and_four_workers_choose_the_same_winners(tmp_path):
    """Each search depends only on its problem, its seed and the database as the run found it (warm starts
    come from earlier runs' winners, never from problems finished during this run, whose order depends on
    the worker count), and the simulated measurements only on their task: the winners are identical. On GPUs
    the same check is `k3tune db diff` of a 1-GPU and an N-GPU sweep, equal up to statistical ties."""
    from k3tune.store import inspect

    sp = spec.load("smoke")
    dbs = []
    for n in (1, 4):
        db = store_db.open_db(str(tmp_path / f"w{n}.sqlite"))
        stats = run_sweep(_opts(db, sp, workers=n))
        assert stats.problems_done == stats.problems_total and not stats.no_winner
        dbs.append(db)
    counts = inspect.diff(*dbs)["counts"]
    assert set(counts) == {"same"}, counts


def test_polish_tries_neighbours_winners_and_a_rerun_finds_nothing_left(tmp_path):
    """After the search, every problem is tried with the winners of its nearest neighbours that it has not
    tried (on the H200 a tensor-core config won at M = 8 while M = 4 and 16 kept cuBLAS, 1.4x slower): on the
    simulated smoke spec some winners change and none gets slower beyond its spread; a rerun has nothing
    left to try."""
    import dataclasses

    from k3tune.store import inspect

    sp = spec.load("smoke")
    off = dataclasses.replace(sp, search=dataclasses.replace(sp.search, polish=0))
    db_off, db_on = (store_db.open_db(str(tmp_path / f"{n}.sqlite")) for n in ("off", "on"))
    plain = run_sweep(_opts(db_off, off))
    polished = run_sweep(_opts(db_on, sp))
    assert plain.polish_passes == 0 and plain.polished == 0
    assert polished.problems_done == polished.problems_total and not polished.no_winner
    assert polished.polish_passes >= 1 and polished.polished > 0 and polished.polish_changed > 0
    assert polished.polish_changed <= polished.polished <= polished.problems_total  # distinct problems, not per pass
    assert polished.trials > plain.trials
    counts = inspect.diff(db_off, db_on)["counts"]
    assert counts.get("improvement", 0) > 0 and "regression" not in counts, counts
    again = run_sweep(_opts(db_on, sp))
    assert again.trials == 0 and again.polish_passes == 0


def test_a_polish_pass_left_open_by_another_machine_is_joined(db_path):
    """A machine that finishes its searches later than another joins the polish pass that one planned and has
    not finished (its claims), instead of planning its own from a half-polished database."""
    import dataclasses

    from k3tune.store.models import Claim

    sp = spec.load("smoke")
    db = store_db.open_db(db_path)
    run_sweep(_opts(db, dataclasses.replace(sp, search=dataclasses.replace(sp.search, polish=0))))
    with db.session() as s:
        pid = s.scalar(select(Claim.problem_id).order_by(Claim.problem_id))
        other = s.scalar(select(Claim).where(Claim.problem_id == pid))
        s.add(Claim(hardware_id=other.hardware_id, problem_id=pid, op_digest="polish:planned-elsewhere",
                    backend=other.backend, state="pending"))
    stats = run_sweep(_opts(db, sp))
    assert stats.polish_passes >= 1 and stats.polished >= 1
    with db.session() as s:
        assert s.scalar(select(Claim.state).where(Claim.op_digest == "polish:planned-elsewhere")) == "done"


def test_rerun_does_no_new_work_and_stale_params_are_refused(db_path):
    sp = spec.load("smoke")
    db = store_db.open_db(db_path)
    first = run_sweep(_opts(db, sp))
    assert first.problems_done == first.problems_total and not first.no_winner
    again = run_sweep(_opts(db, sp))
    assert again.problems_done == 0 and again.trials == 0
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Winner)) == first.problems_total
        n_trials = s.scalar(select(func.count()).select_from(Trial))
    assert n_trials == first.trials


O_PROJ_M1 = Problem("kda.o_proj", "gemm", (("M", 1), ("N", 7168), ("K", 768)))
O_PROJ_M1_SPEC = {"matrix": {"tp": [16], "batch": [1], "ops": ["kda.o_proj"]},
                  "buckets": {"tokens": [1], "batch": [1], "query_len": [1]},
                  "search": {"budget": 4, "samples": 3, "remeasure_top": 1}}


def _store_trial(db, fam, params: dict, round_: int, median: float, method: str) -> None:
    """One trial of O_PROJ_M1 recorded as an earlier simulated run would have."""
    from k3tune.store import records
    from k3tune.store.models import Backend, TrialStatus

    with db.session() as s:
        hw = records.hardware_id(s, hardware.simulated_fingerprint(GB300))
        sw = records.software_id(s, records.software_versions())
        pid = records.problem_ids(s, [O_PROJ_M1])[O_PROJ_M1]
        run = records.start_run(s, command="t", backend=Backend.simulated, hw_id=hw, sw_id=sw, spec_digest="x")
        records.record_trials(s, run.id, hw, Backend.simulated, [records.TrialRecord(
            pid, fam.name, fam.digest, params, params_key(params), round_, TrialStatus.ok, median, 0.0, 3,
            method=method)])


def test_stored_trial_outside_space_is_never_launched(db_path):
    """A stored trial whose params fall outside the declared space is refused, not fed to a worker."""
    db = store_db.open_db(db_path)
    bogus = {"rows_per_cta": 3, "warps": 4, "split_k": 1, "unroll": 1, "pdl": 0}
    _store_trial(db, family("gemm.smallm"), bogus, 1, 0.001, method_digest("simulated"))
    stats = run_sweep(_opts(db, spec.from_dict(O_PROJ_M1_SPEC)))
    assert len(stats.refused) == 1 and "outside the declared space" in stats.refused[0]
    with db.session() as s:
        w = s.scalar(select(Winner))
    assert w.params != bogus and w.median_us > 0.01


@pytest.mark.parametrize("same_method", [True, False])
def test_stored_trials_are_reused_only_when_timed_the_same_way(db_path, same_method):
    """A stored trial of an unchanged kernel is reused only if the backend times the way it was timed; one timed
    another way (an older measurer) is neither reused nor overwritten: the sweep times that kernel afresh and
    records it beside the old row."""
    db = store_db.open_db(db_path)
    fam = family("gemm.cublas")
    method = method_digest("simulated") if same_method else "an-older-measurer"
    _store_trial(db, fam, fam.default_config(O_PROJ_M1).params(), 0, 99.0, method)
    stats = run_sweep(_opts(db, spec.from_dict(O_PROJ_M1_SPEC)))
    assert stats.reused == (1 if same_method else 0)
    with db.session() as s:
        rows = s.scalars(select(Trial).where(Trial.family == fam.name, Trial.round == 0)).all()
    assert sorted(r.method for r in rows) == sorted({method, method_digest("simulated")})
    assert any(r.median_us == 99.0 for r in rows)  # the old row is kept as it was
    with db.session() as s:  # the winner records how its trials were timed (schema 0005)
        assert s.scalar(select(Winner.method)) == method_digest("simulated")


def _count(db_path):
    import sqlite3

    try:
        with sqlite3.connect(db_path) as c:
            return c.execute("select count(*) from trials").fetchone()[0]
    except sqlite3.OperationalError:  # the file exists before the sweep has created its schema
        return 0


def test_kill_9_mid_sweep_then_resume(tmp_path):
    """kill -9 of the whole sweep (parent and workers) loses at most the trials in flight; running it again
    completes every problem with no duplicate and keeps every committed trial, and marks the killed run 'died'."""
    db_path = tmp_path / "k.sqlite"
    cmd = [sys.executable, "-m", "k3tune", "sweep", "--gpus", "4", "--simulate", "gb300", "--spec", "default",
           "--db", str(db_path), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if db_path.exists() and _count(db_path) > 1500:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    import sqlite3

    with sqlite3.connect(db_path) as c:
        before = set(c.execute("select id, params_key, median_us from trials").fetchall())
        done_before = c.execute("select count(*) from claims where state='done'").fetchone()[0]
    assert before and done_before < 1124
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    with sqlite3.connect(db_path) as c:
        after = set(c.execute("select id, params_key, median_us from trials").fetchall())
        dups = c.execute("select count(*) from (select 1 from trials group by hardware_id, problem_id, family, "
                         "family_digest, params_key, round having count(*) > 1)").fetchone()[0]
        states = dict(c.execute("select state, count(*) from claims group by state").fetchall())
        searched = c.execute("select count(*) from claims where op_digest not like 'polish:%'").fetchone()[0]
        winners = c.execute("select count(*) from winners").fetchone()[0]
        runs = c.execute("select status from runs order by id").fetchall()
    assert before <= after  # nothing committed was lost or changed
    assert dups == 0
    assert set(states) == {"done"} and searched == winners == 1124  # polish passes have claims of their own
    assert runs == [("died",), ("done",)]  # the killed run was 'running' for ever (db show)


def _live_members(pgid: int) -> list[int]:
    """Processes of a process group that are alive (Linux /proc; zombies left for init to reap are not)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "hangup"])
def test_ctrl_c_mid_sweep_says_so_and_keeps_its_trials(tmp_path, sig):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-sweep: exit 130 with a one-line
    message saying how to resume (typer turned it into a silent 130 before), no traceback, the run marked
    interrupted, the committed trials kept and no worker left behind. SIGTERM to the group (a job scheduler's
    stop, `timeout`) the same way (it killed the sweep where it stood before); and either way the database file
    holds every committed trial when the sweep has exited, none left in SQLite's WAL file (s35-r9 lost a timed-out
    sweep's trials by copying the database file alone)."""
    db_path = tmp_path / "i.sqlite"
    cmd = [sys.executable, "-m", "k3tune", "sweep", "--gpus", "2", "--simulate", "gb300", "--spec", "default",
           "--db", str(db_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not inherited ignored
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (db_path.exists() and _count(db_path) > 200):
        time.sleep(0.2)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: finished trials are saved; run the same command again to resume" in err
    assert "Traceback" not in err
    deadline = time.monotonic() + 10  # a child still in its exit path (alive, cmdline gone) for ~50 ms is not left
    while _live_members(proc.pid) and time.monotonic() < deadline:  # behind; one alive after seconds would be
        time.sleep(0.05)
    assert _live_members(proc.pid) == []  # every worker has exited (a zombie awaiting its reaper is not alive)
    import sqlite3

    wal = db_path.with_name(db_path.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0  # before anything opens the database again
    with sqlite3.connect(db_path) as c:
        assert c.execute("select status from runs").fetchall() == [("interrupted",)]
        assert c.execute("select count(*) from trials").fetchone()[0] > 200
        assert c.execute("select count(*) from winners").fetchone()[0] < 1124
        assert c.execute("select count(*) from claims where state = 'claimed'").fetchone()[0] == 0  # released


def _searched_without_polish(tmp_path, ops: list[str]):
    """Two ops at TP16 and M = 1 and 8, searched without polish passes (4 problems, every one decided): the
    database, the spec, and the problems' ids by key."""
    from k3tune.store.models import ProblemRow

    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": ops},
                         "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                         "search": {"budget": 30, "samples": 5, "remeasure_top": 2, "polish": 0}})
    db = store_db.open_db(str(tmp_path / "polish.sqlite"))
    first = run_sweep(_opts(db, sp))
    assert first.problems_done == first.problems_total == 4 and not first.no_winner
    with db.session() as s:
        return db, sp, {k: i for i, k in s.execute(select(ProblemRow.id, ProblemRow.key)).all()}


def _polished(db, sp):
    import dataclasses

    return run_sweep(_opts(db, dataclasses.replace(sp, search=dataclasses.replace(sp.search, polish=8))))


def _tried(s, *problem_ids) -> set[tuple[str, str]]:
    return {(t.family, t.params_key) for t in s.scalars(select(Trial).where(Trial.problem_id.in_(problem_ids)))}


def test_polish_tries_the_winners_of_other_ops_of_the_same_shape(tmp_path):
    """Two ops with one GEMM shape (TP16 kda.o_proj and mla.o_proj are both 7168 x 768) are each other's nearest
    neighbours (on the H200 a tensor-core config ran kda.o_proj M=8 at 6.7 us while mla.o_proj M=8, searched
    apart, kept one at 8.1): a config that won on one is tried on the other."""
    db, sp, pid = _searched_without_polish(tmp_path, ["kda.o_proj", "mla.o_proj"])
    # another machine's winner for kda.o_proj M=8: a config mla.o_proj M=8's own search did not try
    other = {"m_tiles": 1, "warps_n": 2, "warps_k": 4, "tile_m": 8, "split_k": 1, "bk": 128, "stages": 6,
             "reduce": 0, "pdl": 0}
    twin, kda = pid["mla.o_proj[M=8,N=7168,K=768]"], pid["kda.o_proj[M=8,N=7168,K=768]"]
    with db.session() as s:
        assert ("gemm.splitk_tc", params_key(other)) not in _tried(s, twin)
        w = s.scalar(select(Winner).where(Winner.problem_id == kda))
        w.family, w.params = "gemm.splitk_tc", other
    polished = _polished(db, sp)
    assert polished.polish_passes >= 1 and polished.polished >= 1
    assert 0 < polished.polish_plan_s <= polished.polish_s <= polished.seconds  # the passes' latency, reported
    with db.session() as s:
        assert ("gemm.splitk_tc", params_key(other)) in _tried(s, twin)


def test_polish_tries_the_winners_of_other_ops_at_the_same_token_count(tmp_path):
    """TP16 mla.gate (768 x 7168) and moe.router_latent (280 x 7168) at M=1: a config that won on one is tried on
    the other in a polish pass (two H200 sweeps each missed a config the other found on such neighbours); the
    winners of other token counts of another op are not."""
    db, sp, pid = _searched_without_polish(tmp_path, ["mla.gate", "moe.router_latent"])
    other = {"pdl": 1, "rows_per_cta": 8, "split_k": 16, "unroll": 4, "warps": 8}  # outside the smallm seeds
    gate1 = next(v for k, v in pid.items() if k.startswith("mla.gate[M=1,"))
    router1 = next(v for k, v in pid.items() if k.startswith("moe.router_latent[M=1,"))
    router8 = next(v for k, v in pid.items() if k.startswith("moe.router_latent[M=8,"))
    with db.session() as s:
        assert ("gemm.smallm", params_key(other)) not in _tried(s, router1, router8)
        w = s.scalar(select(Winner).where(Winner.problem_id == gate1))
        w.family, w.params = "gemm.smallm", other
    polished = _polished(db, sp)
    assert polished.polish_passes >= 1
    with db.session() as s:
        assert ("gemm.smallm", params_key(other)) in _tried(s, router1)
        assert ("gemm.smallm", params_key(other)) not in _tried(s, router8)


def test_a_neighbours_winner_is_also_tried_with_this_problems_token_tile():
    """The winner at M=8 kept its problem's default 8-token tile: at M=16 it is tried as it is (two passes over
    the weights) and with M=16's default 16-token tile; the knobs it tuned away from its default stay."""
    from k3tune.search.strategy import known_candidates

    fam = family("gemm.splitk_tc")
    at8 = Problem("kda.o_proj", "gemm", (("M", 8), ("N", 7168), ("K", 1536)))
    at16 = Problem("kda.o_proj", "gemm", (("M", 16), ("N", 7168), ("K", 1536)))
    won = {"m_tiles": 1, "warps_n": 1, "warps_k": 4, "tile_m": 8, "split_k": 1, "bk": 128, "stages": 8, "reduce": 0,
           "pdl": 1}
    assert fam.default_config(at8).params()["tile_m"] == 8 and fam.default_config(at16).params()["tile_m"] == 16
    settings = spec.load("smoke").search
    keys = {c.key for c in known_candidates(at16, [fam], settings, [("gemm.splitk_tc", won, at8)])}
    assert params_key(won) in keys and params_key({**won, "tile_m": 16}) in keys
    plain = {c.key for c in known_candidates(at16, [fam], settings, [("gemm.splitk_tc", won)])}
    assert params_key({**won, "tile_m": 16}) not in plain, "without the source problem: as it is only"


def test_a_family_extending_a_neighbours_winners_family_adopts_the_winner():
    """gemm.wgmma_cktrig extends gemm.wgmma_ck with a trigger point: a wgmma_ck winner nearby is measured in
    it at each of its seeded trigger points, and not at all when it ran without PDL (there is nothing to move)."""
    from k3tune.kernels.pdl_trigger import late_seeds
    from k3tune.search.strategy import known_candidates

    fam = family("gemm.wgmma_cktrig")
    p = Problem("mla.q_a", "gemm", (("M", 16), ("N", 1536), ("K", 7168)))
    won = {"warpgroups": 1, "tile_m": 16, "split_k": 8, "bk": 128, "stages": 4, "pdl": 1}
    settings = spec.load("smoke").search
    keys = {c.key for c in known_candidates(p, [fam], settings, [("gemm.wgmma_ck", won, p)])}
    assert late_seeds(7) == [6, 4, 1024]  # 7 stages a slice: the second, the middle, the first
    assert {params_key({**won, "late": t}) for t in (6, 4, 1024)} <= keys
    assert fam.adopt("gemm.wgmma_ck", {**won, "pdl": 0}, p) == [] and fam.adopt("gemm.wgmma", won, p) == []
    # one name for each kernel: late 0 is wgmma_ck's, and past a slice's 7 stages every trigger point is its first
    assert [t for t in (0, 6, 7, 8, 12, 1024) if fam.valid(fam.config_cls(**won, late=t), p)] == [6, 1024]
    assert fam.valid(fam.config_cls(**{**won, "pdl": 0}, late=0), p)  # the bench's PDL-off twin
    seeds = fam.seeds(p)
    assert seeds and all(c.late < fam.ktiles(p, c.params()) or c.late == 1024 for c in seeds)


def test_winners_agree_counts_every_shared_problem_once(tmp_path):
    """bench/winners_agree.py on two simulated sweeps of one spec with different search seeds: every problem both
    sweeps decided is counted once, as the same winner, a tie, beyond, or not cross-measured."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    spec_path = Path(__file__).resolve().parents[1] / "bench" / "winners_agree.py"
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location("winners_agree", spec_path))
    mod.__spec__.loader.exec_module(mod)
    sp = spec.from_dict({"matrix": {"tp": [8, 16], "batch": [1, 8], "ops": ["kda.o_proj", "mla.q_a"]},
                         "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                         "search": {"budget": 12, "samples": 5, "remeasure_top": 2}})
    paths = []
    for seed in (0, 1):
        path = str(tmp_path / f"s{seed}.sqlite")
        run_sweep(_opts(store_db.open_db(path), dataclasses.replace(sp, search=dataclasses.replace(sp.search, seed=seed))))
        paths.append(path)
    r = mod.agree(*paths)
    assert r["shared_configs"] > 0 and r["band_p5_p95"][0] <= 1.0 <= r["band_p5_p95"][1]
    decided = len(mod.load(paths[0])[1])  # 6: TP8 and TP16 mla.q_a are one problem (1536 x 7168)
    assert decided == 6 and r["same"] + r["tie"] + len(r["beyond"]) + len(r["not_cross_measured"]) == decided
    assert r["same"] < decided, "the seeds gave different winners somewhere"
    assert mod.agree(paths[0], paths[0])["same"] == decided


def test_simulated_blackwell_never_runs_the_hopper_only_kernel():
    """gemm.wgmma has no Blackwell code: a sweep for a (simulated) GB300 is never offered it (one had picked it, and
    spent 842 trials on it as invalid once it was refused), and the simulated backend refuses it there; on a
    simulated H200 it is offered and modelled."""
    from k3tune.plan.hardware import spec as hw_spec
    from k3tune.plan.problems import Problem
    from k3tune.search.outcome import Task

    p = Problem("kda.o_proj", "gemm", (("M", 32), ("N", 7168), ("K", 1536)))
    params = {"warpgroups": 1, "tile_m": 32, "split_k": 1, "bk": 128, "stages": 4, "pdl": 1}
    gb300 = SimulatedBackend(hw_spec("gb300")).measure(Task(1, p, "gemm.wgmma", params, 0, 5))
    h200 = SimulatedBackend(hw_spec("h200")).measure(Task(1, p, "gemm.wgmma", params, 0, 5))
    assert gb300.status == "invalid" and "no code for sm_103a" in gb300.error
    assert h200.status == "ok" and h200.median_us > 0
    offered = {k: [f.name for f in families_for(p, "simulated", hw_spec(k).arch)] for k in ("gb300", "h200")}
    assert "gemm.wgmma" not in offered["gb300"] and "gemm.wgmma" in offered["h200"]


def test_sweep_offers_families_only_where_they_have_code(tmp_path):
    """The driver passes the sweep's arch to the registry: a simulated GB300 sweep times no gemm.wgmma config at
    all, a simulated H200 sweep of the same spec does."""
    import sqlite3

    from k3tune.plan.hardware import spec as hw_spec

    sp = spec.from_dict({"matrix": {"tp": [8], "batch": [32], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [32], "batch": [32], "query_len": [1]},
                         "search": {"budget": 24, "polish": 0}})
    fams = {}
    for key in ("gb300", "h200"):
        path = tmp_path / f"{key}.sqlite"
        run_sweep(SweepOptions(sp, model.load(), store_db.open_db(str(path)), "simulated", 1, hw=hw_spec(key)))
        with sqlite3.connect(path) as c:
            fams[key] = {f for (f,) in c.execute("SELECT DISTINCT family FROM trials")}
    assert "gemm.wgmma" not in fams["gb300"] and "gemm.wgmma" in fams["h200"], fams


def test_redecide_db_applies_the_safe_margin_to_a_stored_sweep(tmp_path):
    """bench/redecide_db.py on a real SQLite sweep decided with no margin: with a margin, every winner within it of
    its cuBLAS baseline's final-round trial becomes that baseline (the old winner heads its ties), nothing else
    changes, and a second run changes nothing (all in one transaction)."""
    import importlib.util
    import sqlite3
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    mod = importlib.util.spec_from_file_location("redecide_db", root / "bench" / "redecide_db.py")
    redecide_db = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(redecide_db)
    path = tmp_path / "sweep.sqlite"
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8, 64], "ops": ["kda.o_proj", "mla.q_a", "moe.router_latent"]},
                         "buckets": {"tokens": [1, 8, 64], "batch": [1, 8, 64], "query_len": [1]},
                         "search": {"budget": 6, "samples": 5, "remeasure_top": 2, "safe_margin_pct": 0}})
    run_sweep(_opts(store_db.open_db(str(path)), sp))
    query = "SELECT p.key, w.family, w.median_us, w.ties FROM winners w JOIN problems p ON p.id = w.problem_id"
    before = {k: (f, m, json.loads(t)) for k, f, m, t in sqlite3.connect(path).execute(query)}
    assert any(f != "gemm.cublas" for f, _, _ in before.values())
    assert redecide_db.redecide(str(path), 0) == []  # margin 0: the sweep's own decisions stand
    changed = redecide_db.redecide(str(path), 50)
    after = {k: (f, m, json.loads(t)) for k, f, m, t in sqlite3.connect(path).execute(query)}
    flipped = [k for k in before if before[k][0] != after[k][0]]
    assert changed and len(changed) == len(flipped) and len(flipped) < len(before)
    con = sqlite3.connect(path)
    for k in flipped:
        fam, median, ties = after[k]
        assert fam == "gemm.cublas" and ties[0]["family"] == before[k][0] and ties[0]["median_us"] == before[k][1]
        base = con.execute("SELECT t.median_us FROM trials t JOIN problems p ON p.id = t.problem_id WHERE p.key = ? "
                           "AND t.family = 'gemm.cublas' AND t.round = 1", (k,)).fetchone()[0]
        assert median == base <= before[k][1] * 1.5
    for k in set(before) - set(flipped):
        assert after[k] == before[k]
    assert redecide_db.redecide(str(path), 50) == []


def test_redecide_db_refuses_bad_input_in_one_line(tmp_path):
    """A missing file, a file that is not a database, a compact (exported) database without trials and a margin out
    of range: each a one-line error and a non-zero exit, nothing written."""
    root = Path(__file__).resolve().parent.parent
    junk = tmp_path / "junk.sqlite"
    junk.write_text("not a database")
    compact = tmp_path / "compact.sqlite"
    compact.write_bytes((root / "tuning_db" / "h200.sqlite").read_bytes())
    cases = [([str(tmp_path / "missing.sqlite")], "database not found"), ([str(junk)], "not a k3tune SQLite"),
             ([str(compact)], "holds no trials"), ([str(junk), "--margin", "80"], "--margin must be within")]
    before = compact.read_bytes()
    for args, message in cases:
        out = subprocess.run([sys.executable, str(root / "bench" / "redecide_db.py"), *args], capture_output=True,
                             text=True)
        assert out.returncode != 0 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out
    assert compact.read_bytes() == before


def test_ops_that_run_others_kernels_are_swept_after_them_against_what_they_stored(tmp_path):
    """A phased sweep (the GPU backend's way: its MoE blocks run the dense kernels the selector picks) decides the
    dense ops a block runs first, in their own run, then the blocks; ``unmet_runs``, the check that refuses a GPU
    block sweep before anything is measured, finds every block's dense lookups missing in an empty database and
    none once the first phase has stored them."""
    from k3tune.store import records
    from k3tune.store.models import Backend, ProblemRow

    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": [
        "moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2", "moe.block"]},
        "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
        "search": {"budget": 4, "samples": 3, "remeasure_top": 1, "polish": 0}})
    db = store_db.open_db(str(tmp_path / "phased.sqlite"))
    blocks = [p for p in driver.plans.build(sp, model.load()).problems if p.op == "moe.block"]
    with db.session() as s:
        hw_id = records.hardware_id(s, hardware.simulated_fingerprint(GB300))
    gaps = driver.unmet_runs(db, hw_id, Backend.simulated, "simulated", blocks)
    assert len(gaps) == 2 * 4 and all(g.startswith("moe.block[") and " -> moe." in g for g in gaps), gaps

    stats = run_sweep(dataclasses.replace(_opts(db, sp, workers=2), phased=True))
    assert stats.problems_done == stats.problems_total == 2 * 5 and not stats.no_winner
    with db.session() as s:
        runs = dict(s.execute(select(ProblemRow.op, func.max(Winner.run_id))
                              .join(Winner, Winner.problem_id == ProblemRow.id).group_by(ProblemRow.op)).all())
        first = dict(s.execute(select(ProblemRow.op, func.min(Trial.run_id))
                               .join(Trial, Trial.problem_id == ProblemRow.id).group_by(ProblemRow.op)).all())
    dense = {op: r for op, r in runs.items() if op != "moe.block"}
    assert len(dense) == 4 and first["moe.block"] > max(dense.values()), (runs, first)  # blocks began after
    assert driver.unmet_runs(db, hw_id, Backend.simulated, "simulated", blocks) == []


def test_dense_problems_a_spec_lacks_but_its_blocks_run_are_tuned_in_the_first_phase(tmp_path):
    """The smoke spec tunes three dense ops beside moe.block, which runs five: its first real-GPU sweep (s66, H100)
    tuned the dense ops for 89 s, then refused the blocks (24 lookups with no winner) and exited 2. A phased sweep of
    a spec with dense ops now adds the dense problems its blocks' lookups ask for to the first phase; a blocks-only
    spec still adds none (it is run against a database that holds them)."""
    from k3tune.store import records
    from k3tune.store.models import Backend

    def sp_of(ops):
        return spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": ops},
                               "buckets": {"tokens": [1, 2, 8, 16], "batch": [1, 8], "query_len": [1]},
                               "search": {"budget": 4, "samples": 3, "remeasure_top": 1, "polish": 0}})
    sp = sp_of(["moe.shared_w13", "moe.block"])
    db = store_db.open_db(str(tmp_path / "mixed.sqlite"))
    blocks = [p for p in driver.plans.build(sp, model.load()).problems if p.op == "moe.block"]
    st = run_sweep(dataclasses.replace(_opts(db, sp, workers=2), phased=True))
    added = sorted(k.split("[")[0] for k in st.added_for_blocks)
    assert added == ["moe.latent_up"] * 2 + ["moe.router_latent"] * 2 + ["moe.shared_w2"] * 2, st.added_for_blocks
    assert st.problems_done == st.problems_total == 2 + 2 + 6 and not st.no_winner
    with db.session() as s:
        hw_id = records.hardware_id(s, hardware.simulated_fingerprint(GB300))
    assert driver.unmet_runs(db, hw_id, Backend.simulated, "simulated", blocks) == []

    st = run_sweep(dataclasses.replace(_opts(store_db.open_db(str(tmp_path / "blocks.sqlite")), sp_of(["moe.block"]),
                                             workers=1),
                                       phased=True))
    assert st.added_for_blocks == [] and st.problems_total == 2

    # a block at up to 512 tokens (batch 64, draft 7) asks for its dense kernels at that many tokens
    drafts = spec.from_dict({"matrix": {"tp": [8], "batch": [64], "draft": [7], "ops": ["moe.block"]}})
    blocks = driver.plans.build(drafts, model.load()).problems
    assert sorted(q.key for q in driver.run_lookups(blocks)) == [
        "moe.latent_up[M=512,N=7168,K=448]", "moe.router_latent[M=512,N=560,K=7168]",
        "moe.shared_w13[M=512,N=1536,K=7168]", "moe.shared_w2[M=512,N=7168,K=768]"]


def _winner_moves_tried(db, moves) -> tuple[int, int]:
    """(untried, tried): how many valid configs ``moves(family, problem, params)`` makes of the final kda.o_proj
    winners in ``db``, by whether the sweep measured them."""
    from k3tune.errors import CannotImplement
    from k3tune.store.models import ProblemRow

    n = [0, 0]
    with db.session() as s:
        won = select(ProblemRow.key, ProblemRow.dims, Winner.family, Winner.params).join(
            Winner, Winner.problem_id == ProblemRow.id)
        for key, dims, fam, params in s.execute(won):
            p = Problem("kda.o_proj", "gemm", tuple(dims.items()))
            f = family(fam)
            tried = set(s.scalars(select(Trial.params_key).join(ProblemRow, ProblemRow.id == Trial.problem_id)
                                  .where(ProblemRow.key == key, Trial.family == fam)))
            for prm in moves(f, p, params):
                try:
                    cfg = f.config_from_params(p, prm)
                except CannotImplement:
                    continue
                if f.valid(cfg, p):
                    n[params_key(cfg.params()) in tried] += 1
    return n[0], n[1]


def test_local_passes_try_the_winners_one_knob_neighbours(tmp_path):
    """With ``[search] local = 1`` the polish passes also try each problem's winner with one knob moved one step in
    its declared space, until a pass finds nothing new: at the end the final winner's valid neighbours are all
    tried (the hill climb stopped at a local optimum), which the same sweep without it leaves untried."""
    from k3tune.search.polish import local_moves

    def sweep(local: int):
        sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": ["kda.o_proj"]},
                             "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                             "search": {"budget": 8, "samples": 5, "remeasure_top": 2, "polish": 8, "local": local}})
        db = store_db.open_db(str(tmp_path / f"local{local}.sqlite"))
        st = run_sweep(_opts(db, sp, workers=2))
        assert st.problems_done == st.problems_total == 2 and not st.no_winner
        return db, st

    untried = {}
    for local in (0, 1):
        db, st = sweep(local)
        untried[local] = _winner_moves_tried(db, local_moves)[0]
        assert local == 0 or st.polish_passes < 8, "the climb must end before the pass limit"
    assert untried[1] == 0 < untried[0], untried


def test_whole_may_name_a_knob_of_a_family_landed_on_some_hardware(cktrig_landed_on_h100):
    """The CLI checks ``[search] whole`` before the sweep's hardware is known: a knob of a family landed on some
    hardware only (``late``: gemm.wgmma_cktrig, on the H100 in sessions 60-66) is no misspelling; a knob no family
    declares still is."""
    from k3tune.errors import ConfigError
    from k3tune.search.driver import check_whole_knobs

    def sp(whole):
        return spec.from_dict({"matrix": {"tp": [8], "batch": [16], "ops": ["mla.q_a"]},
                               "buckets": {"tokens": [16], "batch": [16], "query_len": [1]},
                               "search": {"budget": 4, "samples": 5, "remeasure_top": 2, "polish": 2, "whole": whole}})

    probs = driver.plans.build(sp(["late"]), model.load()).problems
    check_whole_knobs(sp(["late"]), probs, "gpu")
    with pytest.raises(ConfigError, match=r"whole names lat, which no kernel family"):
        check_whole_knobs(sp(["lat"]), probs, "gpu")


def test_whole_knobs_are_tried_at_every_value_on_each_winner(tmp_path):
    """With ``[search] whole = [knob]`` the polish passes try each problem's winner at every value its family declares
    for that knob (the rest of it unchanged), valid ones measured: on a real SQLite sweep none is left untried at the
    end, which the same sweep without it leaves untried. A knob no family of the sweep declares is a one-line error
    before anything runs, and so is ``whole`` without polish passes."""
    from k3tune.errors import ConfigError
    from k3tune.search.polish import whole_moves

    def sp(whole, polish=8):
        return spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": ["kda.o_proj"]},
                               "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                               "search": {"budget": 6, "samples": 5, "remeasure_top": 2, "polish": polish,
                                          "whole": whole}})

    untried = {}
    for whole in ([], ["split_k"]):
        db = store_db.open_db(str(tmp_path / f"whole{len(whole)}.sqlite"))
        st = run_sweep(_opts(db, sp(whole), workers=2))
        assert st.problems_done == st.problems_total == 2 and not st.no_winner
        untried[len(whole)] = _winner_moves_tried(db, lambda f, p, prm: whole_moves(f, p, prm, ("split_k",)))
    assert untried[1][0] == 0 < untried[0][0] and untried[1][1] > 0, untried

    # a winners-only export (what ships in tuning_db/) has no trial to compare a move with: the passes leave its
    # problems alone, and the sweep says how many (s35-r7 tried nothing there, silently)
    from k3tune.store.transfer import export

    export(db, tmp_path / "shipped.sqlite")
    st = run_sweep(_opts(store_db.open_db(str(tmp_path / "shipped.sqlite")), sp(["split_k"]), workers=1))
    assert (st.trials, st.problems_done_before, st.polish_passes, st.polish_untimed) == (0, 2, 0, 2), st

    # a knob only the block's families declare, in a sweep whose first phase is the dense ops the blocks run:
    # checked over the whole plan, not per phase (it failed the dense phase before)
    mixed = spec.from_dict({"matrix": {"tp": [16], "batch": [1], "ops": ["moe.router_latent", "moe.block"]},
                            "buckets": {"tokens": [1], "batch": [1], "query_len": [1]},
                            "search": {"budget": 4, "samples": 5, "remeasure_top": 2, "polish": 2,
                                       "whole": ["shared_sms"]}})
    st = run_sweep(_opts(store_db.open_db(str(tmp_path / "mixed.sqlite")), mixed, workers=1, phased=True))
    assert st.problems_done == st.problems_total == 5 and not st.no_winner  # + the 3 dense ops the block runs

    db = store_db.open_db(str(tmp_path / "typo.sqlite"))
    with pytest.raises(ConfigError, match=r"\[search\] whole names shared_smz, which no kernel family"):
        run_sweep(_opts(db, sp(["shared_smz"]), workers=1))
    with pytest.raises(ConfigError, match="needs polish >= 1"):
        sp(["split_k"], polish=0)
    with pytest.raises(ConfigError, match="whole must be a list of knob names"):
        sp("split_k")


def test_neighbours_zero_keeps_the_passes_to_the_winners_own_moves(tmp_path):
    """``[search] neighbours = 0``: the polish passes try no other problem's winner, only the winner's own ``whole``
    moves (a cheap re-decide of a few knobs): on the simulated smoke spec, where the default passes change winners
    with their neighbours' (see above), they try nothing without ``whole``, and with it leave no whole move untried.
    A negative count is a one-line error; a spec that leaves it unset keeps its digest."""
    import dataclasses

    from k3tune.errors import ConfigError
    from k3tune.search.polish import whole_moves

    sp = spec.load("smoke")
    alone = dataclasses.replace(sp, search=dataclasses.replace(sp.search, neighbours=0))
    st = run_sweep(_opts(store_db.open_db(str(tmp_path / "alone.sqlite")), alone))
    assert st.problems_done == st.problems_total and not st.no_winner
    assert st.polish_passes == 0 and st.polished == 0, st

    def small(**search):
        return spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": ["kda.o_proj"]},
                               "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                               "search": {"budget": 6, "samples": 5, "remeasure_top": 2, "polish": 8, **search}})

    db = store_db.open_db(str(tmp_path / "whole.sqlite"))
    st = run_sweep(_opts(db, small(whole=["split_k"], neighbours=0), workers=2))
    assert st.problems_done == st.problems_total == 2 and st.polish_passes >= 1
    assert _winner_moves_tried(db, lambda f, p, prm: whole_moves(f, p, prm, ("split_k",)))[0] == 0
    assert small().digest() == small(neighbours=4).digest() != small(neighbours=0).digest()
    with pytest.raises(ConfigError, match="neighbours >= 0"):
        small(neighbours=-1)


def test_whole_moves_set_one_knob_to_each_other_declared_value():
    from k3tune.search.polish import whole_moves

    p = Problem("kda.o_proj", "gemm", (("M", 8), ("N", 7168), ("K", 768)))
    f = family("gemm.smallm")
    params = {"rows_per_cta": 2, "warps": 4, "split_k": 4, "unroll": 1, "pdl": 1}
    moves = whole_moves(f, p, params, ("split_k", "not_a_knob"))
    assert [m["split_k"] for m in moves] == [1, 2, 8, 16]
    assert all({k: v for k, v in m.items() if k != "split_k"} == {k: v for k, v in params.items() if k != "split_k"}
               for m in moves)


def test_redo_makes_the_next_sweep_decide_them_again_from_their_winners(tmp_path, monkeypatch):
    """`k3tune db redo` (for a change to how trials are timed, which re-keys no winner): on a real SQLite sweep,
    the matching problems' winners turn stale, and the next sweep decides exactly those again (the rest stay done),
    with each old winner among its warm starts (s28: deleting them lost the warm starts). A second redo before that
    sweep marks nothing twice; a pattern that matches nothing is a ConfigError that changes nothing."""
    import sqlite3

    from k3tune.errors import ConfigError
    from k3tune.search import strategy
    from k3tune.store import redo as redo_problems

    def redo(path, patterns, seeds_from=None):
        return redo_problems.redo(store_db.open_db(str(path), create=False), patterns,
                                  seeds_from and store_db.open_db(str(seeds_from), create=False))

    path = tmp_path / "sweep.sqlite"
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": ["kda.o_proj", "mla.q_a"]},
                         "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                         "search": {"budget": 4, "samples": 3, "remeasure_top": 1}})
    first = run_sweep(_opts(store_db.open_db(str(path)), sp))
    query = "SELECT p.key, w.family, w.params, w.op_digest FROM winners w JOIN problems p ON p.id = w.problem_id"
    won = {k: (f, json.loads(prm)) for k, f, prm, _ in sqlite3.connect(path).execute(query)}
    assert first.problems_done == len(won) == 4
    with pytest.raises(ConfigError, match="no problem .* like nope%"):
        redo(path, ["nope%"])
    assert redo(path, ["mla.q_a[%"]) == 2
    assert redo(path, ["mla.q_a[%"]) == 0
    stale = {k for k, _, _, d in sqlite3.connect(path).execute(query) if d == redo_problems.STALE}
    assert stale == {k for k in won if k.startswith("mla.q_a")}
    warm_of = {}
    real = strategy.known_candidates

    def spy(problem, families, settings, warm=()):
        warm_of.setdefault(problem.key, []).extend((f, prm) for f, prm, *_ in warm)
        return real(problem, families, settings, warm)
    monkeypatch.setattr(strategy, "known_candidates", spy)
    again = run_sweep(_opts(store_db.open_db(str(path)), sp))
    assert again.problems_done_before == 2 and again.problems_done == 2
    assert {k for k, _, _, d in sqlite3.connect(path).execute(query) if d != redo_problems.STALE} == set(won)
    for k in stale:
        assert won[k] in warm_of[k], (k, warm_of.get(k))
    # winners lost altogether (s28's first redo deleted them): --seeds-from brings another database's back as seeds
    old = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as src, sqlite3.connect(old) as dst:
        src.backup(dst)  # (WAL mode: a file copy may miss committed pages)
    with sqlite3.connect(path) as c:
        c.execute("DELETE FROM winners WHERE problem_id IN (SELECT id FROM problems WHERE key LIKE 'mla.q_a[%')")
    assert redo(path, ["mla.q_a[%"], seeds_from=old) == 2
    warm_of.clear()
    third = run_sweep(_opts(store_db.open_db(str(path)), sp))
    assert third.problems_done_before == 2 and third.problems_done == 2
    for k in stale:
        assert won[k] in warm_of[k], (k, warm_of.get(k))


def test_winner_methods_backfills_only_winners_whose_own_trial_is_found(tmp_path):
    """bench/winner_methods.py: a winner stored before schema 0005 (method "") takes the method of the sweep trial it
    was decided from (same problem, kernel, knobs and median), and nothing else is guessed: a winner whose trial is
    not in the sweep database stays unknown."""
    import importlib.util
    import sqlite3

    from k3tune.store import transfer

    root = Path(__file__).resolve().parent.parent
    mod = importlib.util.spec_from_file_location("winner_methods", root / "bench" / "winner_methods.py")
    winner_methods = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(winner_methods)
    sweep = tmp_path / "sweep.sqlite"
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                         "search": {"budget": 4, "samples": 3, "remeasure_top": 1}})
    run_sweep(_opts(store_db.open_db(str(sweep)), sp))
    shipped = tmp_path / "ship.sqlite"
    transfer.export(store_db.open_db(str(sweep)), shipped)
    with sqlite3.connect(shipped) as c:  # as a pre-0005 winner reads after `db upgrade`
        c.execute("UPDATE winners SET method = ''")
        c.execute("UPDATE winners SET median_us = median_us * 2 WHERE problem_id = (SELECT MIN(problem_id) FROM winners)")
    done = winner_methods.backfill(str(shipped), [str(sweep)])
    assert done == {"kda.o_proj": 1, "(unknown) kda.o_proj": 1}
    methods = sorted(m for (m,) in sqlite3.connect(shipped).execute("SELECT method FROM winners"))
    assert methods == ["", method_digest("simulated")]


def test_warm_from_starts_a_new_gpu_kind_from_another_kinds_winners(any_db_url, tmp_path):
    """A sweep of a second GPU kind of one arch (a simulated H100 after a simulated H200 in one database, SQLite or
    PostgreSQL) with ``warm_from`` tries the other kind's winner of each problem it has none of; without it (on a
    copy of the SQLite file), it does not."""
    import shutil

    from k3tune.store.models import Hardware

    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [8], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [8], "batch": [8], "query_len": [1]},
                         "search": {"budget": 6, "samples": 5, "remeasure_top": 2, "polish": 0}})
    h200, h100 = hardware.spec("h200"), hardware.spec("h100")
    db = store_db.open_db(any_db_url)
    run_sweep(SweepOptions(sp, model.load(), db, "simulated", 1, hw=h200))
    other = {"m_tiles": 1, "warps_n": 2, "warps_k": 4, "tile_m": 8, "split_k": 1, "bk": 128, "stages": 6,
             "reduce": 0, "pdl": 0}  # outside the seeds: tried on the H100 only as the H200's winner
    with db.session() as s:
        (w,) = s.scalars(select(Winner)).all()
        w.family, w.params = "gemm.splitk_tc", other
    db.close()
    sqlite = "://" not in any_db_url
    if sqlite:
        shutil.copy(any_db_url, tmp_path / "cold.sqlite")

    def h100_tried(url, warm_from):
        d = store_db.open_db(url)
        try:
            st = run_sweep(SweepOptions(sp, model.load(), d, "simulated", 1, hw=h100, warm_from=warm_from))
            assert st.problems_done == 1
            with d.session() as s:
                hw = s.scalar(select(Hardware.id).where(Hardware.class_key.contains("H100")))
                return {(t.family, t.params_key) for t in s.scalars(select(Trial).where(Trial.hardware_id == hw))}
        finally:
            d.close()

    assert ("gemm.splitk_tc", params_key(other)) in h100_tried(any_db_url, "H200")
    if sqlite:
        assert ("gemm.splitk_tc", params_key(other)) not in h100_tried(str(tmp_path / "cold.sqlite"), None)


@pytest.mark.parametrize("hw_key, name, says", [("h100", "B200", "no other hardware of that name"),
                                                ("gb300", "H200", "not simulated hardware of compute capability")])
def test_warm_from_refuses_a_kind_it_cannot_use_in_one_line(tmp_path, hw_key, name, says):
    from k3tune.errors import ConfigError
    from k3tune.store.models import Run

    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [1], "batch": [1], "query_len": [1]},
                         "search": {"budget": 4, "samples": 5, "remeasure_top": 1, "polish": 0}})
    db = store_db.open_db(str(tmp_path / "w.sqlite"))
    try:
        run_sweep(SweepOptions(sp, model.load(), db, "simulated", 1, hw=hardware.spec("h200")))
        with db.session() as s:
            before = s.scalar(select(func.count()).select_from(Run))
        with pytest.raises(ConfigError, match=says) as e:
            run_sweep(SweepOptions(sp, model.load(), db, "simulated", 1, hw=hardware.spec(hw_key), warm_from=name))
        assert "\n" not in str(e.value)
        with db.session() as s:  # refused before its run was recorded
            assert s.scalar(select(func.count()).select_from(Run)) == before
    finally:
        db.close()


@pytest.mark.parametrize("error, status", [("database", "failed"), ("interrupt", "interrupted")])
def test_a_database_failing_once_the_run_is_recorded_ends_it_as_failed(tmp_path, monkeypatch, error, status):
    """The database fails (or ^C comes) after the sweep recorded its run but before the search began (planning its
    claims): the error is raised, the run is recorded as failed (interrupted), not left 'running', and the workers
    started early are gone."""
    import multiprocessing

    from k3tune.errors import DatabaseError
    from k3tune.store import records
    from k3tune.store.models import Run

    def fail(*a, **k):
        raise DatabaseError("the server went away") if error == "database" else KeyboardInterrupt("went away")

    monkeypatch.setattr(records, "plan_claims", fail)
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1], "ops": ["kda.o_proj"]},
                         "buckets": {"tokens": [1, 2], "batch": [1], "query_len": [1]},
                         "search": {"budget": 4, "samples": 3, "polish": 0}})
    db = store_db.open_db(str(tmp_path / "f.sqlite"))
    before = {c.pid for c in multiprocessing.active_children()}  # another test's, not this sweep's
    try:
        with pytest.raises(DatabaseError if error == "database" else KeyboardInterrupt, match="went away"):
            run_sweep(_opts(db, sp, workers=2))
        with db.session() as s:
            assert s.scalars(select(Run.status)).all() == [status]
        assert not [c for c in multiprocessing.active_children() if c.is_alive() and c.pid not in before]
    finally:
        db.close()
