"""Reading and writing sweep records: provenance rows, trials (idempotent), winners, and claims.

Inserts of natural keys are ``ON CONFLICT DO NOTHING``: a resumed or concurrent sweep that re-sends a trial
leaves one row, never two. Claims use ``FOR UPDATE SKIP LOCKED`` on PostgreSQL (SQLite serialises writers).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from sqlalchemy import and_, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from k3tune.errors import DatabaseError
from k3tune.plan.hardware import Fingerprint
from k3tune.plan.problems import Problem
from k3tune.store.db import _short
from k3tune.store.models import Backend, Claim, Hardware, ProblemRow, Run, Software, Trial, TrialStatus, Winner, utcnow


def insert_ignore(session: Session, model, rows: list[dict], conflict: list[str] | None = None) -> None:
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    ins = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(model)
    session.execute(ins.on_conflict_do_nothing(index_elements=conflict), rows)


def _pkg_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def software_versions() -> dict[str, str]:
    from k3tune import __version__

    return {"torch": _pkg_version("torch"), "cutlass_dsl": _pkg_version("nvidia-cutlass-dsl"),
            "k3tune": __version__, "git_rev": git_revision()}


def hardware_id(session: Session, fp: Fingerprint) -> int:
    insert_ignore(session, Hardware, [dict(
        digest=fp.digest, class_key=fp.class_key, name=fp.name, compute_capability=fp.compute_capability,
        sm_count=fp.sm_count, memory_gib=fp.memory_gib, driver=fp.driver, cuda=fp.cuda, simulated=fp.simulated)],
        ["digest"])
    return session.scalar(select(Hardware.id).where(Hardware.digest == fp.digest))


def software_id(session: Session, versions: dict[str, str]) -> int:
    digest = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]
    insert_ignore(session, Software, [dict(digest=digest, **versions)], ["digest"])
    return session.scalar(select(Software.id).where(Software.digest == digest))


def problem_ids(session: Session, problems: list[Problem]) -> dict[Problem, int]:
    insert_ignore(session, ProblemRow, [dict(key=p.key, op=p.op, kind=p.kind, dims=dict(p.dims)) for p in problems],
                  ["key"])
    ids: dict[str, int] = {}
    keys = [p.key for p in problems]
    for i in range(0, len(keys), 500):
        ids.update(dict(session.execute(select(ProblemRow.key, ProblemRow.id).where(ProblemRow.key.in_(keys[i:i + 500]))).all()))
    return {p: ids[p.key] for p in problems}


def owner_tag(run_id: int) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{run_id}"


def start_run(session: Session, *, command: str, backend: Backend, hw_id: int, sw_id: int, spec_digest: str) -> Run:
    run = Run(command=command, backend=backend, host=socket.gethostname(), owner="", spec_digest=spec_digest,
              hardware_id=hw_id, software_id=sw_id, status="running")
    session.add(run)
    session.flush()
    run.owner = owner_tag(run.id)
    return run


def end_run(session: Session, run_id: int, status: str) -> None:
    session.execute(update(Run).where(Run.id == run_id).values(status=status, ended_at=utcnow()))


@dataclass(frozen=True)
class TrialRecord:
    problem_id: int
    family: str
    family_digest: str
    params: dict
    params_key: str
    round: int
    status: TrialStatus
    median_us: float | None = None
    spread_us: float | None = None
    samples: int = 0
    compile_s: float | None = None
    error: str | None = None
    routing: str | None = None
    method: str = ""  # search/method.py: how the trial was timed


def record_trials(session: Session, run_id: int, hw_id: int, backend: Backend, records: list[TrialRecord]) -> None:
    now = utcnow()
    insert_ignore(session, Trial, [dict(
        run_id=run_id, hardware_id=hw_id, problem_id=r.problem_id, family=r.family, family_digest=r.family_digest,
        variant=r.family, params=r.params, params_key=r.params_key, round=r.round, status=r.status.value,
        backend=backend.value, median_us=r.median_us, spread_us=r.spread_us, samples=r.samples,
        compile_s=r.compile_s, error=(r.error or None) and r.error[:2000], routing=r.routing, method=r.method,
        created_at=now)
        for r in records])


def stored_trials(session: Session, hw_id: int, problem_id: int, digests: dict[str, str], method: str) -> list[Trial]:
    """Trials of the problem whose family digest is still current and that were timed by ``method`` (the
    others are stale: a number timed another way is not comparable with the ones this sweep takes)."""
    rows = session.scalars(select(Trial).where(Trial.hardware_id == hw_id, Trial.problem_id == problem_id,
                                               Trial.method == method))
    return [t for t in rows if digests.get(t.family) == t.family_digest]


def tried_keys(session: Session, hw_id: int, problem_ids: set[int], digests: dict[str, str],
               method: str) -> dict[int, set[tuple[str, str]]]:
    """Per problem, the (family, params key) of ``stored_trials`` (current family digest, this method), for many
    problems in one query: a polish pass plans over every problem of the sweep (one query each was a third of a
    simulated dense sweep's planning time)."""
    out: dict[int, set[tuple[str, str]]] = {pid: set() for pid in problem_ids}
    rows = session.execute(select(Trial.problem_id, Trial.family, Trial.family_digest, Trial.params_key)
                           .where(Trial.hardware_id == hw_id, Trial.method == method))
    for pid, fam, digest, key in rows:
        if pid in out and digests.get(fam) == digest:
            out[pid].add((fam, key))
    return out


def save_winner(session: Session, **values) -> None:
    """Insert or replace the winner of (hardware, problem, op digest, backend); ``created_at`` is when it was decided,
    so a winner decided again (a polish pass, a resumed sweep) is dated again (`db merge --newer` goes by it)."""
    key = {k: values[k] for k in ("hardware_id", "problem_id", "op_digest", "backend")}
    existing = session.scalar(select(Winner).where(*(getattr(Winner, k) == v for k, v in key.items())))
    if existing is None:
        session.add(Winner(**values))
    else:
        for k, v in {"created_at": utcnow(), **values}.items():
            setattr(existing, k, v)


# ---- claims ---------------------------------------------------------------------------------------
def plan_claims(session: Session, hw_id: int, backend: Backend, wanted: dict[int, str]) -> None:
    """Make sure every (problem, op digest) of a sweep has a claim row; done where a winner exists."""
    insert_ignore(session, Claim, [dict(hardware_id=hw_id, problem_id=pid, op_digest=d, backend=backend.value,
                                        state="pending") for pid, d in wanted.items()],
                  ["hardware_id", "problem_id", "op_digest", "backend"])
    won = set(session.execute(select(Winner.problem_id, Winner.op_digest).where(
        Winner.hardware_id == hw_id, Winner.backend == backend)).all())
    done = {pid: d for pid, d in wanted.items() if (pid, d) in won}
    for digest, chunk in _by_digest(done):
        session.execute(update(Claim).where(Claim.hardware_id == hw_id, Claim.backend == backend,
                                            Claim.op_digest == digest, Claim.problem_id.in_(chunk))
                        .values(state="done"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead(rows) -> list[int]:
    """The ids of (id, owner) rows whose owner, ``host:pid:run`` of this host, is a process that no longer exists."""
    return [i for i, owner in rows if not _pid_alive(int(owner.split(":")[1]))]


def release_dead_local_claims(session: Session, hw_id: int, backend: Backend) -> int:
    """Claims held by processes of this host that no longer exist go back to pending at once."""
    host = socket.gethostname()
    rows = session.execute(select(Claim.id, Claim.owner).where(
        Claim.hardware_id == hw_id, Claim.backend == backend, Claim.state == "claimed",
        Claim.owner.like(f"{host}:%"))).all()
    dead = _dead(rows)
    if dead:
        session.execute(update(Claim).where(Claim.id.in_(dead)).values(state="pending", owner=None, expires_at=None))
    return len(dead)


def end_dead_local_runs(session: Session) -> int:
    """Runs of this host still 'running' whose process no longer exists (killed -9, or ended by a full disk before it
    could record its end) are marked 'died': `db show` listed them as running for ever."""
    host = socket.gethostname()
    rows = session.execute(select(Run.id, Run.owner).where(Run.status == "running", Run.host == host,
                                                           Run.owner.like(f"{host}:%"))).all()
    dead = _dead(rows)
    if dead:
        session.execute(update(Run).where(Run.id.in_(dead)).values(status="died"))
    return len(dead)


def _by_digest(wanted: dict[int, str]) -> list[tuple[str, list[int]]]:
    groups: dict[str, list[int]] = {}
    for pid, d in wanted.items():
        groups.setdefault(d, []).append(pid)
    return [(d, pids[i:i + 500]) for d, pids in groups.items() for i in range(0, len(pids), 500)]


def lease_clock(session: Session) -> datetime:
    """Now (naive UTC) by the clock every machine sharing the database reads: PostgreSQL's. Each machine's own clock
    decided when another's claim had expired, so one running a lease ahead of the rest took their live problems over
    (and set leases that looked endless to them). SQLite is one machine's: its clock."""
    if session.get_bind().dialect.name == "postgresql":
        return session.scalar(text("SELECT CAST(now() AT TIME ZONE 'UTC' AS timestamp)"))
    return utcnow()


def claim(session: Session, hw_id: int, backend: Backend, owner: str, wanted: dict[int, str], n: int,
          lease_s: float, held: set[int] | None = None) -> list[int]:
    """Claim up to n pending (or expired) problems of ``wanted`` (problem id -> op digest), in its order. With
    ``held`` (the problems the owner has open), the owner's claims on any other problem are taken too: a claim
    whose commit landed while its answer was lost (the server went away) is the owner's, unknown to it, and
    renewed with the rest; taken by no one otherwise."""
    now = lease_clock(session)
    got: list[tuple[int, int]] = []
    mine = [] if held is None else [and_(Claim.state == "claimed", Claim.owner == owner,
                                         Claim.problem_id.not_in(held))]
    for digest, chunk in _by_digest(wanted):
        if len(got) >= n:
            break
        q = (select(Claim.id, Claim.problem_id)
             .where(Claim.hardware_id == hw_id, Claim.backend == backend, Claim.op_digest == digest,
                    Claim.problem_id.in_(chunk),
                    or_(Claim.state == "pending", and_(Claim.state == "claimed", Claim.expires_at < now), *mine))
             .order_by(Claim.problem_id).limit(n - len(got)).with_for_update(skip_locked=True))
        got.extend(session.execute(q).all())
    if got:
        session.execute(update(Claim).where(Claim.id.in_([c for c, _ in got])).values(
            state="claimed", owner=owner, expires_at=now + timedelta(seconds=lease_s)))
    order = {pid: k for k, pid in enumerate(wanted)}
    return sorted((pid for _, pid in got), key=order.get)


def renew_claims(session: Session, owner: str, lease_s: float) -> None:
    session.execute(update(Claim).where(Claim.owner == owner, Claim.state == "claimed").values(
        expires_at=lease_clock(session) + timedelta(seconds=lease_s)))


def finish_claim(session: Session, hw_id: int, backend: Backend, problem_id: int, op_digest: str) -> None:
    session.execute(update(Claim).where(Claim.hardware_id == hw_id, Claim.backend == backend,
                                        Claim.problem_id == problem_id, Claim.op_digest == op_digest)
                    .values(state="done", expires_at=None))


def release_claims(session: Session, owner: str) -> None:
    session.execute(update(Claim).where(Claim.owner == owner, Claim.state == "claimed").values(
        state="pending", owner=None, expires_at=None))


def open_claims(session: Session, hw_id: int, backend: Backend, prefix: str, problem_ids: set[int]) -> dict[int, str]:
    """Claims not yet done whose key starts with ``prefix``, of the given problems: problem id -> key."""
    rows = session.execute(select(Claim.problem_id, Claim.op_digest).where(
        Claim.hardware_id == hw_id, Claim.backend == backend, Claim.op_digest.like(f"{prefix}%"),
        Claim.state != "done")).all()
    return {pid: key for pid, key in rows if pid in problem_ids}


def remaining(session: Session, hw_id: int, backend: Backend, wanted: dict[int, str]) -> int:
    n = 0
    for digest, chunk in _by_digest(wanted):
        n += len(session.execute(select(Claim.id).where(
            Claim.hardware_id == hw_id, Claim.backend == backend, Claim.op_digest == digest,
            Claim.problem_id.in_(chunk), Claim.state != "done")).all())
    return n


def read_winners(db, class_key: str, backend: Backend) -> tuple[list, list, int]:
    """Serving-path read of one hardware class's winners: (hardware rows, winner rows, rows left out).

    Raw driver SQL, no statement compilation or ORM result processing: this runs at every server start.
    Winner rows are (op, problem key, dims, op digest, family, params, median us); JSON columns come back
    as text on SQLite and decoded on PostgreSQL, and are returned decoded. A row whose dims or params are not a
    JSON object (a hand edit, a damaged page) is left out and counted: it raised out of the server's start."""
    try:
        with db.engine.connect() as conn:
            hw = conn.exec_driver_sql("SELECT id, class_key, driver, cuda FROM hardware").all()
            ids = [int(r[0]) for r in hw if r[1] == class_key]
            if not ids:
                return hw, [], 0
            rows = conn.exec_driver_sql(
                "SELECT p.op, p.key, p.dims, w.op_digest, w.family, w.params, w.median_us FROM winners w "
                "JOIN problems p ON p.id = w.problem_id "
                f"WHERE w.backend = '{Backend(backend).value}' AND w.hardware_id IN ({', '.join(map(str, ids))})").all()
    except SQLAlchemyError as e:  # a damaged page the opening read did not reach: a DatabaseError, as the store's are
        raise DatabaseError(f"cannot read tuning database {db.name}: {_short(e)}") from None
    out = []
    for op, key, dims, dg, fam, params, med in rows:
        try:
            dims, params = (json.loads(v) if isinstance(v, str) else v for v in (dims, params))
        except ValueError:
            continue
        if isinstance(dims, dict) and isinstance(params, dict):
            out.append((op, key, dims, dg, fam, params, med))
    return hw, out, len(rows) - len(out)
