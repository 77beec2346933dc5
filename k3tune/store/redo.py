"""Re-deciding problems whose winners are current: their winners are marked stale (and their claims dropped), so the
next sweep into the database decides them again — after a change to how trials are timed (k3tune/search/method.py),
which re-keys no winner but makes the old trials unusable (a trial is reused only by the method that timed it), or to
run a polish spec (``[search] whole``) on a winners-only database, whose winners have no trials to compare with. A
marked winner stays as a kernel change leaves a winner: the sweep re-measures it first as a warm start, and the export
leaves it out. (s28: deleting them instead cost the bf16 block sweeps every warm start, and TPE alone ended up to 43%
slower.) ``seeds_from`` adds, as further stale winners, those that another database (of the same hardware) holds for
the matching problems: a redo that ran without its warm starts then resumes from its own trials and the old winners.

    k3tune db redo /tmp/sweep.sqlite "moe.block[tp=8,%bf16%" "moe.block[tp=16,%" [--seeds-from OLD.sqlite]
"""

from __future__ import annotations

from sqlalchemy import delete, or_, select

from k3tune.errors import ConfigError
from k3tune.store.db import Database
from k3tune.store.inspect import is_current
from k3tune.store.models import Claim, Hardware, ProblemRow, Winner


STALE = "redo"  # the op-digest mark of a winner to decide again (a real digest is 32 hex characters)
SEED = "redo-seed"  # the mark of a winner copied from another database as a warm start


def redo(db: Database, patterns: list[str], seeds_from: Database | None = None) -> int:
    """Current winners made stale for problems whose key matches any of ``patterns`` (SQL LIKE); their claims go.
    With ``seeds_from``, that database's current winners of those problems join them (stale, marked SEED). Returns
    how many stale winners the next sweep starts from; no matching problem is a ConfigError, and nothing changes."""
    seeds = _current_winners(seeds_from, patterns) if seeds_from else []
    with db.session() as s:
        ids = {pid for pat in patterns for (pid,) in s.execute(select(ProblemRow.id).where(ProblemRow.key.like(pat)))}
        if not ids:
            hint = " (SQL LIKE: % for any run of characters, _ for one; not * or ?)" if any(
                c in p for p in patterns for c in "*?") else ""
            raise ConfigError(f"no problem in {db.path or 'the database'} has a key like {' or '.join(patterns)}{hint}")
        rows = s.execute(select(Winner, ProblemRow.op, Hardware.class_key)
                         .join(ProblemRow, ProblemRow.id == Winner.problem_id)
                         .join(Hardware, Hardware.id == Winner.hardware_id)
                         .where(Winner.problem_id.in_(ids))).all()
        current = [w for w, op, hw in rows if is_current(op, w.op_digest, w.backend, hw)]
        for w in current:  # one stale mark a problem and backend: the newest winner's
            s.execute(delete(Winner).where(Winner.hardware_id == w.hardware_id, Winner.problem_id == w.problem_id,
                                           Winner.backend == w.backend, Winner.op_digest == STALE))
            w.op_digest = STALE
        n = len(current)
        hw_of = {h.digest: h.id for h in s.scalars(select(Hardware))}
        pid_of = dict(s.execute(select(ProblemRow.key, ProblemRow.id).where(ProblemRow.id.in_(ids))).all())
        origin = f"seed from {seeds_from.name}"[:300] if seeds_from else ""
        for hw_digest, key, values in seeds:
            if hw_digest in hw_of and key in pid_of:
                where = dict(hardware_id=hw_of[hw_digest], problem_id=pid_of[key], backend=values["backend"])
                s.execute(delete(Winner).filter_by(**where, op_digest=SEED))
                s.add(Winner(**{**values, **where}, op_digest=SEED, origin=origin))
                n += 1
        s.execute(delete(Claim).where(Claim.problem_id.in_(ids)))
    return n


def _current_winners(db: Database, patterns: list[str]) -> list[tuple[str, str, dict]]:
    """(hardware digest, problem key, the winner's values) of the current winners whose key matches."""
    keep = ("backend", "family", "family_digest", "params", "median_us", "spread_us", "default_us", "ties", "trials",
            "method")
    with db.session() as s:
        rows = s.execute(select(Winner, ProblemRow.key, ProblemRow.op, Hardware.digest, Hardware.class_key)
                         .join(ProblemRow, ProblemRow.id == Winner.problem_id)
                         .join(Hardware, Hardware.id == Winner.hardware_id)
                         .where(or_(*(ProblemRow.key.like(p) for p in patterns)))).all()
        return [(hw, key, {k: getattr(w, k) for k in keep}) for w, key, op, hw, class_key in rows
                if is_current(op, w.op_digest, w.backend, class_key)]
