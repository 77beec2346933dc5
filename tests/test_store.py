"""The tuning database: schema creation and checks, refusal of bad files, migrations, idempotent and
concurrent writes (SQLite and PostgreSQL), export/merge/diff."""

import contextlib
import multiprocessing as mp
import shutil
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import func, select

from k3tune.errors import DatabaseError, SchemaError
from k3tune.plan import hardware
from k3tune.plan.problems import Problem
from k3tune.store import db as store_db, inspect, records, transfer
from k3tune.store.models import Backend, ProblemRow, Trial, TrialStatus, Winner

DATA = Path(__file__).parent / "data"
FP = hardware.simulated_fingerprint(hardware.spec("gb300"))
PROBLEM = Problem("kda.o_proj", "gemm", (("M", 1), ("N", 7168), ("K", 768)))


def _setup(url):
    db = store_db.open_db(url)
    with db.session() as s:
        hw = records.hardware_id(s, FP)
        sw = records.software_id(s, records.software_versions())
        pid = records.problem_ids(s, [PROBLEM])[PROBLEM]
        run = records.start_run(s, command="test", backend=Backend.simulated, hw_id=hw, sw_id=sw, spec_digest="x")
        run_id = run.id
    return db, hw, pid, run_id


def _rec(pid, i, round_=0, median=1.0):
    return records.TrialRecord(pid, "gemm.smallm", "d", {"i": i}, f'{{"i":{i}}}', round_, TrialStatus.ok, median, 0.1, 5)


def test_create_and_reopen(db_path):
    db = store_db.open_db(db_path)
    assert db.revision() == store_db.head_revision()
    assert db.quick_check() == ["ok"]
    db.dispose()
    assert store_db.open_db(db_path, readonly=True).revision() == store_db.head_revision()


def test_not_sqlite_file_refused(tmp_path):
    p = tmp_path / "notes.sqlite"
    p.write_text("this is not a database\n" * 10)
    with pytest.raises(DatabaseError, match="is not a SQLite database"):
        store_db.open_db(p)
    assert p.read_text().startswith("this is not")  # untouched


def test_truncated_database(tmp_path):
    db, *_ = _setup(tmp_path / "a.sqlite")
    with db.session() as s:
        records.record_trials(s, 1, 1, Backend.simulated, [_rec(1, i) for i in range(3000)])
    db.dispose()
    with sqlite3.connect(tmp_path / "a.sqlite") as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = (tmp_path / "a.sqlite").read_bytes()
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(DatabaseError):
        d = store_db.open_db(bad, create=False)
        with d.session() as s:
            s.scalar(select(func.count()).select_from(Trial))
    with pytest.raises(DatabaseError, match="malformed"):
        store_db.open_db(bad, create=False, check_schema=False)


def test_newer_schema_refused(db_path):
    store_db.open_db(db_path).dispose()
    with sqlite3.connect(db_path) as c:
        c.execute("UPDATE alembic_version SET version_num='0099'")
    with pytest.raises(SchemaError, match="newer than this k3tune"):
        store_db.open_db(db_path)
    with pytest.raises(SchemaError, match="newer"):
        store_db.upgrade(db_path)


def test_upgrade_from_schema_0001(tmp_path):
    old = tmp_path / "old.sqlite"
    shutil.copy(DATA / "schema_0001.sqlite", old)
    old.chmod(0o644)
    with pytest.raises(SchemaError, match="k3tune db upgrade"):
        store_db.open_db(old)
    assert store_db.upgrade(old) == ("0001", store_db.head_revision())
    db = store_db.open_db(old)
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Trial)) == 1
        assert s.scalar(select(func.count()).select_from(Winner)) == 1
    assert (tmp_path / "old.sqlite.bak").exists()
    assert old.stat().st_mode & 0o777 == 0o644  # the upgraded copy took the original's permissions


def test_upgrade_never_overwrites_a_backup_and_leaves_a_current_database_alone(tmp_path):
    """A second upgrade once overwrote the .bak (the pre-upgrade original) with a copy of the upgraded file, even
    when there was nothing to migrate."""
    old = tmp_path / "old.sqlite"
    shutil.copy(DATA / "schema_0001.sqlite", old)
    store_db.upgrade(old)

    def revision(path):
        with contextlib.closing(sqlite3.connect(path)) as c:
            return c.execute("SELECT version_num FROM alembic_version").fetchone()[0]

    assert revision(tmp_path / "old.sqlite.bak") == "0001"
    upgraded = old.read_bytes()
    head = store_db.head_revision()
    assert store_db.upgrade(old) == (head, head)
    assert old.read_bytes() == upgraded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.sqlite", "old.sqlite.bak"]
    assert revision(tmp_path / "old.sqlite.bak") == "0001"
    shutil.copy(DATA / "schema_0001.sqlite", old)  # another old database at the same path
    store_db.upgrade(old)
    assert revision(old) == head
    assert revision(tmp_path / "old.sqlite.bak") == revision(tmp_path / "old.sqlite.bak.1") == "0001"


def test_upgrade_keeps_the_journal_mode_and_backs_up_what_the_wal_holds(tmp_path):
    """An upgrade opened the original, and migrated its copy, read-write through SQLAlchemy, which sets WAL mode:
    an upgraded export (rollback mode) came back a WAL file that a server unable to write its directory cannot
    open, and an upgrade of a file already current switched it to WAL too (s61). The original is no longer opened
    for writing; a transaction still in its -wal must then reach both the .bak and the new file, and no -wal be
    left beside the new file."""
    import subprocess
    import sys

    exported = tmp_path / "export.sqlite"
    shutil.copy(DATA / "schema_0001.sqlite", exported)
    assert store_db.journal_mode(exported) == "delete"
    store_db.upgrade(exported)
    assert store_db.journal_mode(exported) == "delete"
    store_db.upgrade(exported)  # already current: not opened for writing
    assert store_db.journal_mode(exported) == "delete"

    swept = tmp_path / "sweep.sqlite"  # a sweep's WAL-mode file whose last transaction is still in its -wal
    shutil.copy(DATA / "schema_0001.sqlite", swept)
    subprocess.run([sys.executable, "-c", (
        "import os, sqlite3\n"
        f"c = sqlite3.connect({str(swept)!r}, isolation_level=None)\n"
        "c.execute('PRAGMA journal_mode=WAL'); c.execute('PRAGMA wal_autocheckpoint=0')\n"
        "c.execute('CREATE TABLE note (x)'); c.execute('INSERT INTO note VALUES (42)')\n"
        "os._exit(0)  # no close: the transaction stays in the -wal\n")], check=True)
    assert Path(f"{swept}-wal").stat().st_size > 0
    assert store_db.upgrade(swept) == ("0001", store_db.head_revision())
    assert not Path(f"{swept}-wal").exists()  # (before any read-only look, which leaves an empty one)
    assert store_db.journal_mode(swept) == "wal"
    for f in (swept, tmp_path / "sweep.sqlite.bak"):
        with contextlib.closing(sqlite3.connect(f"file:{f}?mode=ro", uri=True)) as c:
            assert c.execute("SELECT x FROM note").fetchall() == [(42,)]
            assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_params_key_of_a_whole_block_knob_set_is_stored(any_db_url):
    """Keys up to the column's 2000 characters (schema 0004): PostgreSQL enforces the width, SQLite does not."""
    from k3tune.store.models import PARAMS_KEY_CHARS

    db, hw, pid, run = _setup(any_db_url)
    key = "{" + ",".join(f'"knob_{i:03d}":{i}' for i in range(100)) + "}"
    assert 400 < len(key) <= PARAMS_KEY_CHARS
    rec = records.TrialRecord(pid, "moe.overlap", "d", {"k": 1}, key, 0, TrialStatus.ok, 1.0, 0.1, 5)
    with db.session() as s:
        records.record_trials(s, run, hw, Backend.simulated, [rec])
    with db.session() as s:
        assert s.scalar(select(Trial.params_key)) == key


def test_trials_are_idempotent(any_db_url):
    db, hw, pid, run = _setup(any_db_url)
    for _ in range(2):
        with db.session() as s:
            records.record_trials(s, run, hw, Backend.simulated, [_rec(pid, i) for i in range(5)])
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Trial)) == 5


def test_a_claim_whose_commit_answer_was_lost_is_taken_again_by_its_owner(any_db_url):
    """A retried claim (``Database.transact`` after the server went away) may follow a commit that landed: those
    problems are the owner's, unknown to it, renewed with its other claims and so never taken by anyone. Told what
    it holds, the owner takes them back; other owners still cannot."""
    db, hw, _, _ = _setup(any_db_url)
    probs = [Problem("kda.o_proj", "gemm", (("M", m), ("N", 7168), ("K", 768))) for m in (1, 2, 4, 8)]
    with db.session() as s:
        pids = records.problem_ids(s, probs)
        wanted = {pids[p]: "d" for p in probs}
        records.plan_claims(s, hw, Backend.simulated, wanted)
    claim = lambda s, owner, n, held: records.claim(s, hw, Backend.simulated, owner, wanted, n, 60, held=held)
    with db.session() as s:
        lost = claim(s, "a:1:1", 2, None)  # committed; the answer never came back
    with db.session() as s:
        assert claim(s, "b:1:2", 4, set()) == [pid for pid in wanted if pid not in lost]  # another owner: the rest
    with db.session() as s:
        assert claim(s, "a:1:1", 4, {lost[0]}) == [lost[1]]  # the one it does not hold
        assert claim(s, "a:1:1", 4, set(lost)) == []


def _writer(url, worker, n):
    db = store_db.open_db(url)
    with db.session() as s:
        hw = records.hardware_id(s, FP)
        pid = records.problem_ids(s, [PROBLEM])[PROBLEM]
    for i in range(n):
        with db.session() as s:  # one transaction per trial, as the sweep commits them
            records.record_trials(s, 1, hw, Backend.simulated, [_rec(pid, worker * 1000 + i)])
    db.dispose()


def test_sixteen_concurrent_writers_lose_nothing(any_db_url):
    _setup(any_db_url)[0].dispose()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(any_db_url, w, 40)) for w in range(16)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 16
    db = store_db.open_db(any_db_url)
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Trial)) == 16 * 40


def _open_at_once(url, barrier):
    barrier.wait()
    store_db.open_db(url).dispose()


def test_processes_starting_on_one_new_database_at_once_all_open_it(any_db_url, tmp_path):
    """Sweeps started together on one new database (two shells, two machines) each found it without a schema and
    made it: one failed on the other's tables ("has tables ... but no k3tune schema version", or "already exists",
    exit 4). The schema is now made under the database's write lock and looked for again inside it."""
    sqlite = "://" not in any_db_url
    urls = [str(tmp_path / f"new{i}.sqlite") for i in range(6)] if sqlite else [any_db_url]
    ctx = mp.get_context("spawn")
    for url in urls:
        barrier = ctx.Barrier(6)
        procs = [ctx.Process(target=_open_at_once, args=(url, barrier)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * 6, url
        db = store_db.open_db(url, create=False)
        assert db.revision() == store_db.head_revision()
        db.dispose()


def _winner(db, hw, pid, median, family="gemm.cublas", method=""):
    with db.session() as s:
        records.save_winner(s, hardware_id=hw, problem_id=pid, op_digest="od", backend=Backend.simulated, family=family,
                            family_digest="fd", params={}, median_us=median, spread_us=0.01, default_us=None, ties=[],
                            trials=3, run_id=None, origin="", method=method)


def test_export_merge_diff(tmp_path):
    a, hw, pid, run = _setup(tmp_path / "a.sqlite")
    with a.session() as s:
        records.record_trials(s, run, hw, Backend.simulated, [_rec(pid, i) for i in range(4)])
    _winner(a, hw, pid, 5.0)
    b, hw_b, pid_b, run_b = _setup(tmp_path / "b.sqlite")
    with b.session() as s:
        records.record_trials(s, run_b, hw_b, Backend.simulated, [_rec(pid_b, i) for i in range(2, 7)])
    _winner(b, hw_b, pid_b, 4.0, family="gemm.smallm")

    st = transfer.export(a, tmp_path / "ship.sqlite")
    assert st.winners_added == 1
    ship = store_db.open_db(tmp_path / "ship.sqlite")
    with ship.session() as s:
        assert s.scalar(select(func.count()).select_from(Trial)) == 0
        assert s.scalar(select(Winner.median_us)) == 5.0
    assert not list(tmp_path.glob(".ship*"))  # no temp file left behind

    st = transfer.merge(tmp_path / "all.sqlite", [a, b])
    assert st.winners_added == 1 and st.winners_replaced == 1
    assert (st.trials, st.trials_present) == (7, 2)  # added, not attempted: the overlap (2, 3) is counted once
    merged = store_db.open_db(tmp_path / "all.sqlite")
    with merged.session() as s:
        assert s.scalar(select(func.count()).select_from(Trial)) == 7  # 0..6, the overlap once
        w = s.scalar(select(Winner))
        assert (w.family, w.median_us) == ("gemm.smallm", 4.0) and "b.sqlite" in w.origin
    merged.dispose()
    st = transfer.merge(tmp_path / "all.sqlite", [a])  # merged again: nothing new
    assert (st.trials, st.trials_present, st.winners_added, st.winners_kept) == (0, 4, 0, 1)
    d = inspect.diff(b, a)
    assert d["counts"] == {"regression": 1}


def test_merge_newer_joins_re_decisions_made_on_copies_of_one_database(tmp_path):
    """s36: two problems re-decided on two copies of the shipped DB (one each). Merging by the faster median kept an
    old winner wherever the re-decision's median (another day's run) was higher; --newer keeps the later decision and
    leaves a winner both copies hold unchanged alone. A winner decided again in place is dated again."""
    import time

    other = Problem("kda.o_proj", "gemm", (("M", 2), ("N", 7168), ("K", 768)))
    base, hw, pid, _ = _setup(tmp_path / "base.sqlite")
    with base.session() as s:
        pid2 = records.problem_ids(s, [other])[other]
    _winner(base, hw, pid, 5.0)
    _winner(base, hw, pid2, 7.0)
    for name in ("a", "b"):
        transfer.export(base, tmp_path / f"{name}.sqlite")
    a, b = (store_db.open_db(tmp_path / f"{n}.sqlite") for n in ("a", "b"))
    time.sleep(0.01)
    _winner(a, hw, pid, 5.2, family="gemm.smallm")  # re-decided on copy a: slower this run, the newer decision
    _winner(b, hw, pid2, 6.9, family="gemm.smallm")  # and the other problem on copy b
    with a.session() as s:
        assert s.scalar(select(Winner.created_at).where(Winner.problem_id == pid)) > \
            s.scalar(select(Winner.created_at).where(Winner.problem_id == pid2))

    def families(path):
        with store_db.open_db(path).session() as s:
            return {p: f for p, f in s.execute(select(ProblemRow.key, Winner.family).join(
                Winner, Winner.problem_id == ProblemRow.id)).all()}

    st = transfer.merge(tmp_path / "faster.sqlite", [a, b])
    assert families(tmp_path / "faster.sqlite") == {PROBLEM.key: "gemm.cublas", other.key: "gemm.smallm"}
    st = transfer.merge(tmp_path / "newer.sqlite", [a, b], newer=True)
    assert families(tmp_path / "newer.sqlite") == {PROBLEM.key: "gemm.smallm", other.key: "gemm.smallm"}
    assert (st.winners_added, st.winners_replaced, st.winners_kept) == (2, 1, 1)


def test_winners_keep_their_timing_method_and_diff_says_where_it_differs(tmp_path):
    """s29: re-deciding the dense table with the queued timing made `db diff` report 87 "improvements" that were the
    measurer's 2-5%, not faster kernels. A winner records its trials' method; export and merge keep it; diff marks the
    problems whose winners were timed differently (unknown, "", is never "different")."""
    a, hw, pid, _ = _setup(tmp_path / "a.sqlite")
    _winner(a, hw, pid, 5.0, method="m-old")
    b, hw_b, pid_b, _ = _setup(tmp_path / "b.sqlite")
    _winner(b, hw_b, pid_b, 4.0, method="m-new")
    transfer.export(b, tmp_path / "ship.sqlite")
    ship = store_db.open_db(tmp_path / "ship.sqlite")
    with ship.session() as s:
        assert s.scalar(select(Winner.method)) == "m-new"
    transfer.merge(tmp_path / "all.sqlite", [a, b])
    with store_db.open_db(tmp_path / "all.sqlite").session() as s:
        assert s.execute(select(Winner.median_us, Winner.method)).one() == (4.0, "m-new")
    d = inspect.diff(a, ship)
    assert d["counts"] == {"improvement": 1} and d["timed_differently"] == 1
    assert d["rows"][0]["timing"] == "differs"
    c, hw_c, pid_c, _ = _setup(tmp_path / "c.sqlite")
    _winner(c, hw_c, pid_c, 5.0)  # a winner from before schema 0005: method unknown
    d = inspect.diff(c, ship)
    assert d["timed_differently"] == 0 and d["rows"][0]["timing"] == "same"


def test_export_over_a_database_left_with_its_wal_folds_it_first(tmp_path):
    """A WAL-mode database whose writer died leaves -wal and -shm beside it. Replacing only the main file let SQLite
    read that old WAL into the new file ("database disk image is malformed", s29); the WAL is folded and the file
    leaves WAL mode before it is replaced."""
    import contextlib

    a, hw, pid, _ = _setup(tmp_path / "a.sqlite")
    _winner(a, hw, pid, 5.0)
    live = tmp_path / "live.sqlite"
    writer = sqlite3.connect(live)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE junk (x)")
    writer.executemany("INSERT INTO junk VALUES (?)", [(i,) for i in range(2000)])
    writer.commit()
    crashed = tmp_path / "crashed.sqlite"  # what a killed writer leaves: the file and its unfolded WAL
    for suffix in ("", "-wal"):
        shutil.copy(f"{live}{suffix}", f"{crashed}{suffix}")
    writer.close()
    assert Path(f"{crashed}-wal").stat().st_size > 0
    transfer.export(a, crashed, force=True)
    assert not Path(f"{crashed}-wal").exists()
    with contextlib.closing(sqlite3.connect(crashed)) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert c.execute("SELECT median_us FROM winners").fetchone()[0] == 5.0


def test_failed_merge_leaves_target_untouched(tmp_path):
    a, *_ = _setup(tmp_path / "a.sqlite")
    target = tmp_path / "target.sqlite"
    target.write_text("not a database")
    with pytest.raises(DatabaseError):
        transfer.merge(target, [a])
    assert target.read_text() == "not a database"


def test_schema_head_constant_matches_migrations():
    assert store_db.SCHEMA_HEAD == store_db.script_head_revision()


def test_reopening_in_one_process_keeps_committed_trials(tmp_path):
    """Opening the same SQLite file again in a process that already has it open must not drop the first
    connections' locks (a plain open()/close() of the file would): nothing committed may be lost."""
    path = tmp_path / "twice.sqlite"
    db1, hw, pid, run = _setup(path)
    with db1.session() as s:
        records.record_trials(s, run, hw, Backend.simulated, [_rec(pid, i) for i in range(200)])
    for _ in range(3):
        db2 = store_db.open_db(path)
        with db2.session() as s:
            s.scalar(select(func.count()).select_from(Trial))
        db2.dispose()
        with db1.session() as s:
            n = s.scalar(select(func.count()).select_from(Trial))
            records.record_trials(s, run, hw, Backend.simulated, [_rec(pid, n + i) for i in range(100)])
    db1.dispose()
    with sqlite3.connect(path) as c:
        assert c.execute("select count(*) from trials").fetchone()[0] == 500
        assert c.execute("pragma integrity_check").fetchone()[0] == "ok"


def test_export_names_its_hardware_in_any_case_on_either_database(any_db_url, tmp_path):
    """`--hardware gb300` exported the GB300 winners from SQLite (its LIKE ignores case) and none from PostgreSQL,
    over the earlier export; now both match in any case, and a name matching nothing is refused, DEST untouched."""
    from k3tune.errors import DatabaseError

    db, hw, pid, _ = _setup(any_db_url)
    _winner(db, hw, pid, 5.0)
    for name in ("gb300", "GB300", "Gb3"):
        assert transfer.export(db, tmp_path / "ship.sqlite", hardware=name).winners_added == 1
    shipped = (tmp_path / "ship.sqlite").read_bytes()
    with pytest.raises(DatabaseError, match="matches no hardware with winners"):
        transfer.export(db, tmp_path / "ship.sqlite", hardware="H200")
    assert (tmp_path / "ship.sqlite").read_bytes() == shipped


def test_unwritable_database_named_as_such(db_path):
    """A sweep into a database it may not write (its file or folder read-only) said "cannot read database": the
    error now says it cannot write it. Root ignores file modes, so SQLite's own read-only guard stands in for them."""
    from sqlalchemy import event

    db = store_db.open_db(db_path, check_schema=False)
    event.listen(db.engine, "connect", lambda conn, _rec: conn.execute("PRAGMA query_only=1"))
    with pytest.raises(DatabaseError, match=r"cannot write database .*: the file or its folder is read-only"):
        db.ensure_schema(create=True)
