"""Several machines sharing one sweep through a real PostgreSQL server: problems are claimed without
overlap, and a crashed machine's expired claims are taken over."""

import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from k3tune.plan import hardware, model, spec
from k3tune.search.driver import SweepOptions, run_sweep
from k3tune.store import db as store_db
from k3tune.store.models import Claim, Trial, Winner, utcnow

pytestmark = pytest.mark.postgres


def _sweep_cmd(url):
    return [sys.executable, "-m", "k3tune", "sweep", "--gpus", "2", "--simulate", "gb300", "--spec", "smoke",
            "--db", url, "--json"]


def test_two_machines_share_one_sweep_without_overlap(pg_url):
    # both start on the new, empty database: one makes its schema while the other waits on the lock
    procs = [subprocess.Popen(_sweep_cmd(pg_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    measured = sum(json.loads(o[0])["trials"] for o in outs)
    db = store_db.open_db(pg_url)
    with db.session() as s:
        rows = s.scalar(select(func.count()).select_from(Trial))
        runs_used = s.scalar(select(func.count(func.distinct(Trial.run_id))))
        winners = s.scalar(select(func.count()).select_from(Winner))
        states = dict(s.execute(select(Claim.state, func.count()).group_by(Claim.state)).all())
        searched = s.scalar(select(func.count()).select_from(Claim).where(Claim.op_digest.not_like("polish:%")))
    # no trial was measured by both machines (a second copy of a trial is not stored), in the searches and in the
    # polish passes that follow them
    assert measured == rows
    assert runs_used == 2  # both did work
    assert winners == 48 and searched == 48 and set(states) == {"done"}


def test_expired_claims_of_a_crashed_machine_are_taken_over(pg_url):
    sp = spec.load("smoke")
    db = store_db.open_db(pg_url)
    gb300 = hardware.spec("gb300")
    opts = SweepOptions(sp, model.load(), db, "simulated", 2, hw=gb300, lease_s=60)
    first = run_sweep(opts)
    assert first.problems_done == 48
    # pretend a machine on another host claimed 5 problems, then crashed: its lease has run out
    with db.session() as s:
        ids = s.scalars(select(Claim.id).order_by(Claim.id).limit(5)).all()
        s.execute(update(Claim).where(Claim.id.in_(ids)).values(state="claimed", owner="deadhost:1:999",
                                                                expires_at=utcnow() - timedelta(seconds=1)))
        s.execute(Winner.__table__.delete().where(Winner.problem_id.in_(
            select(Claim.problem_id).where(Claim.id.in_(ids)))))
    again = run_sweep(opts)
    assert again.problems_done == 5
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Winner)) == 48
        assert s.scalar(select(func.count()).select_from(Claim).where(Claim.state != "done")) == 0


def test_leases_run_on_the_server_clock_not_each_machine_clock(pg_url, monkeypatch):
    """A machine whose clock runs an hour ahead judged another's live claims expired by its own clock and took them
    over (and renewed its own to look endless to the rest): leases are set and read by PostgreSQL's clock now."""
    from datetime import datetime, timezone

    from sqlalchemy import text

    from k3tune.store import records

    db = store_db.open_db(pg_url)
    run_sweep(SweepOptions(spec.load("smoke"), model.load(), db, "simulated", 2, hw=hardware.spec("gb300")))
    with db.session() as s:  # another machine holds 5 problems, its lease live for 5 more minutes
        rows = s.execute(select(Claim.id, Claim.hardware_id, Claim.backend, Claim.problem_id, Claim.op_digest)
                         .order_by(Claim.id).limit(5)).all()
        server_now = s.scalar(text("SELECT CAST(now() AT TIME ZONE 'UTC' AS timestamp)"))
        s.execute(update(Claim).where(Claim.id.in_([r.id for r in rows])).values(
            state="claimed", owner="otherhost:1:7", expires_at=server_now + timedelta(seconds=300)))
    ahead = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(hours=1)
    monkeypatch.setattr(records, "utcnow", lambda: ahead)
    hw_id, backend = rows[0].hardware_id, rows[0].backend
    with db.session() as s:
        got = records.claim(s, hw_id, backend, "fasthost:2:8", {r.problem_id: r.op_digest for r in rows}, 5, 300)
    assert got == []  # was all 5
    with db.session() as s:  # its own renewal: 5 minutes from the server's now, not an hour on
        s.execute(update(Claim).where(Claim.id == rows[0].id).values(owner="fasthost:2:8"))
        records.renew_claims(s, "fasthost:2:8", 300)
    with db.session() as s:
        expires = s.scalar(select(Claim.expires_at).where(Claim.id == rows[0].id))
    assert timedelta(seconds=250) < expires - server_now < timedelta(seconds=400)


def test_selector_serves_from_postgres(pg_url):
    from k3tune.runtime import Selector

    db = store_db.open_db(pg_url)
    run_sweep(SweepOptions(spec.load("smoke"), model.load(), db, "simulated", 2, hw=hardware.spec("gb300")))
    sel = Selector.load(pg_url, simulated="gb300")
    c = sel.lookup("kda.qkvg_proj", tp=16, batch=8, draft=1)
    assert c.source == "simulated" and c.median_us > 0 and not sel.warnings


def test_json_cells_of_the_wrong_type_on_postgres_are_listed_and_left_out(pg_url):
    """PostgreSQL checks that a JSON cell is JSON, not that it is the object a winner's params or a problem's dims
    must be: verify lists such rows (it read none: the check was SQLite's alone), serving leaves them out."""
    from sqlalchemy import text

    from k3tune.runtime import Selector
    from k3tune.store.inspect import verify

    db = store_db.open_db(pg_url)
    run_sweep(SweepOptions(spec.load("smoke"), model.load(), db, "simulated", 2, hw=hardware.spec("gb300")))
    with db.session() as s:
        w1, w2 = s.scalars(select(Winner.id).order_by(Winner.id).limit(2)).all()
        p2 = s.scalar(select(Winner.problem_id).where(Winner.id == w2))
        total = s.scalar(select(func.count()).select_from(Winner))
        s.execute(text("UPDATE winners SET params = '[1, 2]' WHERE id = :i"), {"i": w1})
        s.execute(text("UPDATE problems SET dims = '\"x\"' WHERE id = :i"), {"i": p2})
    v = verify(db)
    assert v.unreadable == {"winners.params": [w1], "problems.dims": [p2]} and not v.ok
    assert v.winners == total - 2
    sel = Selector.load(pg_url, simulated="gb300")
    assert any("left out 2 winners" in w for w in sel.warnings), sel.warnings
    assert sum(len(t) for t in sel._winners.values()) == total - 2


def test_a_postgres_password_is_never_recorded_or_shown(pg_url, tmp_path):
    """A shared sweep's URL may carry a password: the sweep records its command line in the run, an export or merge
    records the source in every copied winner's origin and copies the runs, and `db show` names the database. None
    may hold the password (a shipped database would carry it)."""
    from k3tune.store import inspect, transfer
    from k3tune.store.models import Run

    secret = "s3cr3t-pw"
    url = pg_url.replace("postgres@", f"postgres:{secret}@")  # the test server trusts any password
    r = subprocess.run(_sweep_cmd(url), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    assert secret not in r.stdout + r.stderr
    db = store_db.open_db(url)
    assert secret not in db.name and db.name.startswith("postgresql://postgres:***@")
    transfer.export(db, tmp_path / "ship.sqlite")
    transfer.merge(tmp_path / "all.sqlite", [db])
    for got in (db, *(store_db.open_db(tmp_path / f, readonly=True) for f in ("ship.sqlite", "all.sqlite"))):
        with got.session() as s:
            recorded = [*s.scalars(select(Winner.origin)), *s.scalars(select(Run.command))]
        got.close()
        assert recorded and not any(secret in v for v in recorded), recorded
    assert secret not in json.dumps(inspect.show(store_db.open_db(url, readonly=True)), default=str)


def test_redo_and_merge_newer_on_postgres(pg_url, tmp_path):
    """`k3tune db redo` and `db merge --newer` on a PostgreSQL sweep database (a shared sweep's): the redo marks the
    matching winners, the next sweep decides exactly those again; merging the re-decided database into a SQLite copy
    taken before the redo keeps the newer winners."""
    from k3tune.store import redo, transfer

    db = store_db.open_db(pg_url)
    opts = SweepOptions(spec.load("smoke"), model.load(), db, "simulated", 1, hw=hardware.spec("gb300"))
    run_sweep(opts)
    before = tmp_path / "before.sqlite"
    transfer.export(db, before)
    seeds = store_db.open_db(before, readonly=True)  # as `k3tune db redo --seeds-from` opens it
    try:
        n = redo.redo(db, ["kda.o_proj[%"], seeds_from=seeds)
    finally:  # an open handle would keep the merge below from replacing the file (CI, s37: "database is locked")
        seeds.close()
    with db.session() as s:
        origins = s.scalars(select(Winner.origin).where(Winner.op_digest == redo.SEED)).all()
    assert n > 0 and origins and all(str(before) in o for o in origins)
    again = run_sweep(opts)
    assert again.problems_done == n // 2  # each problem's winner and its seed
    after = tmp_path / "after.sqlite"
    transfer.export(db, after)
    source = store_db.open_db(after, readonly=True)
    try:
        st = transfer.merge(before, [source], newer=True)
    finally:
        source.close()
    assert st.winners_replaced == n // 2


def test_a_sweep_outlives_its_servers_restart(own_pg_server):
    """The server stopped mid-sweep (its sessions cut, then refusals while it is down: a restart, a failover) ended
    the sweep with "server closed the connection unexpectedly", exit 4, its hours of trials stored but the machine
    idle. Each transaction is now run again after a pause, and the sweep ends as an uninterrupted one would."""
    url = own_pg_server.create_database()
    store_db.open_db(url).dispose()
    proc = subprocess.Popen(_sweep_cmd(url), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    db = store_db.open_db(url)
    try:
        for _ in range(600):  # until the sweep has stored its first winner: mid-sweep
            with db.session() as s:
                if s.scalar(select(func.count()).select_from(Winner)):
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the sweep stored no winner in 30 s")
    finally:
        db.dispose()
    own_pg_server.stop("immediate")  # connections cut without a goodbye
    time.sleep(3)  # refused meanwhile
    own_pg_server.start()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-1500:]
    summary = json.loads(out)
    assert summary["database_retries"] >= 1 and "retrying in" in err
    db = store_db.open_db(url)
    with db.session() as s:
        winners = s.scalar(select(func.count()).select_from(Winner))
        states = dict(s.execute(select(Claim.state, func.count()).group_by(Claim.state)).all())
    db.dispose()
    assert summary["problems"] == winners == 48 and set(states) == {"done"}
