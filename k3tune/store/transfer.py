"""Moving records between databases: export a compact winners-only database to ship, and merge databases
tuned on several machines. Outputs are written to a temporary file beside the target and renamed into
place, so a failure leaves no half-written database.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from k3tune.errors import DatabaseError
from k3tune.store.db import Database, leave_wal_mode, make_parent, shown_url
from k3tune.store.models import Hardware, ProblemRow, Run, Software, Trial, Winner
from k3tune.store.records import insert_ignore


def _refuse_url(dest: str | os.PathLike) -> None:
    """Before any resolving: a path collapses a URL's "//" (export had made ./postgresql:/u@h/db, and merge did)."""
    if "://" in str(dest):
        raise DatabaseError(f"export and merge write SQLite files; give a path, not {shown_url(str(dest))}")


@contextlib.contextmanager
def atomic_sqlite(dest: str | os.PathLike, start_from: Path | None = None) -> Iterator[Database]:
    """A fresh (or copied) SQLite database at a temp path that replaces ``dest`` only on success."""
    _refuse_url(dest)
    dest = Path(dest).resolve()
    make_parent(dest)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as e:  # a folder this user may not write
        raise DatabaseError(f"cannot write {dest}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)
    db = None
    try:
        if start_from is not None:
            src = sqlite3.connect(start_from)
            dst = sqlite3.connect(tmp)
            with dst:
                src.backup(dst)
            src.close()
            dst.close()
        db = Database(tmp)
        yield db
        db.dispose()
        with sqlite3.connect(tmp) as conn:  # fold the WAL in and drop free pages before shipping
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")
        conn.close()
        with sqlite3.connect(tmp, isolation_level=None) as conn:
            conn.execute("VACUUM")
        conn.close()
        leave_wal_mode(dest)
        os.replace(tmp, dest)
    finally:
        if db is not None:
            db.dispose()
        for p in (tmp, tmp + "-wal", tmp + "-shm"):
            if os.path.exists(p):
                os.unlink(p)


@dataclass
class CopyStats:
    trials: int = 0  # trials added to the destination
    trials_present: int = 0  # trials of the sources the destination already held (the same trial, merged twice)
    winners_added: int = 0
    winners_replaced: int = 0
    winners_kept: int = 0
    winners_dropped: int = 0  # refused by the caller's filter (stale)


class _IdMap:
    """Maps a source database's row ids to the destination's, by natural key."""

    def __init__(self, src: Session, dst: Session, origin: str):
        self.src, self.dst, self.origin = src, dst, origin
        self.hw: dict[int, int] = {}
        self.sw: dict[int, int] = {}
        self.run: dict[int, int] = {}
        self.prob: dict[int, int] = {}

    def hardware(self, hid: int) -> int:
        if hid not in self.hw:
            h = self.src.get(Hardware, hid)
            cols = {c: getattr(h, c) for c in ("digest", "class_key", "name", "compute_capability", "sm_count",
                                               "memory_gib", "driver", "cuda", "simulated")}
            insert_ignore(self.dst, Hardware, [cols], ["digest"])
            self.hw[hid] = self.dst.scalar(select(Hardware.id).where(Hardware.digest == h.digest))
        return self.hw[hid]

    def software(self, sid: int) -> int:
        if sid not in self.sw:
            s = self.src.get(Software, sid)
            insert_ignore(self.dst, Software, [{c: getattr(s, c) for c in ("digest", "torch", "cutlass_dsl", "k3tune", "git_rev")}],
                          ["digest"])
            self.sw[sid] = self.dst.scalar(select(Software.id).where(Software.digest == s.digest))
        return self.sw[sid]

    def run_id(self, rid: int | None) -> int | None:
        if rid is None:
            return None
        if rid not in self.run:
            r = self.src.get(Run, rid)
            found = self.dst.scalar(select(Run.id).where(Run.owner == r.owner, Run.started_at == r.started_at))
            if found is None:
                new = Run(command=r.command, backend=r.backend, host=r.host, owner=r.owner, spec_digest=r.spec_digest,
                          hardware_id=self.hardware(r.hardware_id), software_id=self.software(r.software_id),
                          started_at=r.started_at, ended_at=r.ended_at, status=r.status)
                self.dst.add(new)
                self.dst.flush()
                found = new.id
            self.run[rid] = found
        return self.run[rid]

    def problem(self, pid: int) -> int:
        if pid not in self.prob:
            p = self.src.get(ProblemRow, pid)
            insert_ignore(self.dst, ProblemRow, [dict(key=p.key, op=p.op, kind=p.kind, dims=p.dims)], ["key"])
            self.prob[pid] = self.dst.scalar(select(ProblemRow.id).where(ProblemRow.key == p.key))
        return self.prob[pid]


WINNER_COLS = ("family", "family_digest", "params", "median_us", "spread_us", "default_us",
               "ties", "trials", "method", "created_at")
TRIAL_COLS = ("family", "family_digest", "variant", "params", "params_key", "round", "status", "backend", "median_us",
              "spread_us", "samples", "compile_s", "error", "routing", "method", "created_at")


def copy_records(src: Database, dst: Database, *, origin: str, trials: bool, hardware: str | None = None,
                 keep: Callable[[str, str, str, str], bool] | None = None, newer: bool = False) -> CopyStats:
    """Copy winners (and optionally every trial) from src into dst. A winner conflicting with one already
    in dst (same hardware, problem, op digest, backend) is resolved by measured time, or with ``newer`` by when it
    was decided (the later decision replaces, the same one is kept); provenance is kept."""
    stats = CopyStats()
    with src.session() as s, dst.session() as d:
        ids = _IdMap(s, d, origin)
        hw_filter = [Winner.hardware_id.in_(select(Hardware.id).where(Hardware.class_key.icontains(hardware)))] if hardware else []
        for w in s.scalars(select(Winner).where(*hw_filter)):
            if keep is not None and not keep(s.get(ProblemRow, w.problem_id).op, w.op_digest, w.backend.value,
                                             s.get(Hardware, w.hardware_id).class_key):
                stats.winners_dropped += 1
                continue
            key = dict(hardware_id=ids.hardware(w.hardware_id), problem_id=ids.problem(w.problem_id),
                       op_digest=w.op_digest, backend=w.backend)
            cur = d.scalar(select(Winner).where(*(getattr(Winner, k) == v for k, v in key.items())))
            values = {c: getattr(w, c) for c in WINNER_COLS}
            values.update(run_id=ids.run_id(w.run_id), origin=w.origin or f"{origin}#run{w.run_id}")
            if cur is None:
                d.add(Winner(**key, **values))
                stats.winners_added += 1
            elif (w.created_at > cur.created_at) if newer else (w.median_us < cur.median_us):
                for k, v in values.items():
                    setattr(cur, k, v)
                stats.winners_replaced += 1
            else:
                stats.winners_kept += 1
        if trials:
            q = select(Trial)
            if hardware:
                q = q.where(Trial.hardware_id.in_(select(Hardware.id).where(Hardware.class_key.icontains(hardware))))
            count = select(func.count()).select_from(Trial)
            before, seen, batch = d.scalar(count), 0, []
            for t in s.scalars(q.execution_options(yield_per=2000)):
                batch.append(dict(run_id=ids.run_id(t.run_id), hardware_id=ids.hardware(t.hardware_id),
                                  problem_id=ids.problem(t.problem_id), **{c: getattr(t, c) for c in TRIAL_COLS}))
                if len(batch) >= 2000:
                    insert_ignore(d, Trial, batch)
                    seen += len(batch)
                    batch = []
            insert_ignore(d, Trial, batch)
            seen += len(batch)
            # counted, not summed from the batches: a trial the destination holds already (uq_trial) is skipped
            stats.trials = d.scalar(count) - before
            stats.trials_present = seen - stats.trials
    return stats


def _refuse_onto(dest: str | os.PathLike, sources: list[Database]) -> None:
    """A destination that is one of the sources is bad input."""
    _refuse_url(dest)
    target = Path(dest).resolve()
    for src in sources:
        if src.path is not None and (src.path.resolve() == target or (target.exists() and src.path.exists()
                                                                      and os.path.samefile(src.path, target))):
            raise DatabaseError(f"{dest} is also a source: write to another file")


def _refuse_to_replace(dest: str | os.PathLike) -> None:
    """An export replaces ``dest``: fine for an earlier export (winners only, re-shipped), bad input for a file that
    is no tuning database or one holding trials (a sweep's record, which the export would lose)."""
    if "://" in str(dest) or not Path(dest).exists():
        return  # atomic_sqlite refuses a URL; a new file replaces nothing
    try:
        db = Database(dest, create=False, readonly=True, check_schema=False)
        try:
            with db.session() as s:
                trials = s.scalar(select(func.count()).select_from(Trial))
        finally:
            db.dispose()
    except (DatabaseError, SQLAlchemyError):
        raise DatabaseError(f"{dest} exists and is not a tuning database: refusing to replace it") from None
    if trials:
        raise DatabaseError(f"{dest} holds {trials} trials (a sweep's database), which the export would replace: "
                            "write to another file, or pass --force")


def export(src: Database, dest: str | os.PathLike, *, hardware: str | None = None,
           keep: Callable[[str, str, str, str], bool] | None = None, force: bool = False) -> CopyStats:
    """A compact database holding winners with their provenance (hardware, software, runs, problems);
    ``keep(op, op_digest, backend, class_key)`` drops winners the caller knows to be stale. An existing ``dest`` is
    replaced only if it is a database without trials (an earlier export), or with ``force``."""
    _refuse_onto(dest, [src])  # the export would replace the source with its winners: every trial lost
    if not force:
        _refuse_to_replace(dest)
    if hardware:  # a misspelt name exported nothing, over an earlier export
        with src.session() as s:
            keys = sorted(s.scalars(select(Hardware.class_key).where(Hardware.id.in_(select(Winner.hardware_id)))))
        if not [k for k in keys if hardware.lower() in k.lower()]:  # as copy_records matches: in any case
            raise DatabaseError(f"--hardware {hardware!r} matches no hardware with winners in {src.name} (has: "
                                f"{', '.join(keys) or 'none'})")
    with atomic_sqlite(dest) as out:
        st = copy_records(src, out, origin=src.name, trials=False, hardware=hardware, keep=keep)
        if not st.winners_added:  # raised inside: the temp file is dropped, dest left as it was
            raise DatabaseError(f"nothing to export from {src.name}: no current winners"
                                + (f" ({st.winners_dropped} stale left out; --stale exports them)"
                                   if st.winners_dropped else ""))
        return st


def merge(dest: str | os.PathLike, sources: list[Database], newer: bool = False) -> CopyStats:
    """Merge every trial and winner of the sources into dest (created if missing), atomically. A winner conflict
    keeps the faster measured one, or with ``newer`` the one decided last: for re-decisions of disjoint problems,
    each made on its own copy of one database (the faster rule would compare a re-decision's median with an older
    run's, on another machine or day, and could keep the old winner)."""
    _refuse_onto(dest, sources)
    dest = Path(dest).resolve()
    total = CopyStats()
    start = dest if dest.exists() else None
    if start is not None:
        Database(start, create=False, readonly=True).dispose()  # refuses a non-SQLite or wrong-schema target up front
    with atomic_sqlite(dest, start_from=start) as out:
        for src in sources:
            st = copy_records(src, out, origin=src.name, trials=True, newer=newer)
            for f in ("trials", "trials_present", "winners_added", "winners_replaced", "winners_kept"):
                setattr(total, f, getattr(total, f) + getattr(st, f))
    return total
