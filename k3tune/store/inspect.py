"""Reading a database for people: summary, verification against the current kernels and a sweep spec,
and a problem-by-problem diff of two databases with regressions flagged."""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import func, select, text

from k3tune.errors import CannotImplement, ConfigError
from k3tune.kernels import families_for, family, op_digest
from k3tune.plan import problems as plans
from k3tune.store.db import Database, head_revision
from k3tune.store.models import Hardware, ProblemRow, Run, Trial, Winner

BACKEND_OF = {"measured": "gpu", "simulated": "simulated", "cpu": "cpu"}
# the JSON cells (table, column, the JSON types it may hold; None: any, it is only copied): a SQLite file does not
# check them on write, so a hand edit or a damaged page can leave one that no command can read. (The shipped H200
# table's collective winners hold ties 0, not [], as the driver wrote them before session 70: readable, kept.)
JSON_CELLS = (("problems", "dims", ("object",)), ("winners", "params", ("object",)), ("winners", "ties", None),
              ("trials", "params", ("object",)))
REGRESSION_FLOOR = 0.03  # slower by more than this fraction (and the spreads) counts as a regression


def is_current(op: str, digest: str, backend: str, hardware: str) -> bool:
    """Whether a winner recorded with this op digest and backend ('measured', ...) on this hardware (its class key)
    still matches the kernels' sources (the ``keep`` of ``transfer.export`` that leaves stale winners out)."""
    return op in plans.OPS and digest == op_digest(op, BACKEND_OF[backend], hardware)


def show(db: Database) -> dict:
    with db.session() as s:
        hw = [dict(name=h.name, cc=h.compute_capability, sms=h.sm_count, memory_gib=h.memory_gib, driver=h.driver,
                   cuda=h.cuda, simulated=h.simulated) for h in s.scalars(select(Hardware))]
        runs = [dict(id=r.id, command=r.command, backend=r.backend.value, host=r.host, status=r.status,
                     started=str(r.started_at), ended=str(r.ended_at) if r.ended_at else None)
                for r in s.scalars(select(Run).order_by(Run.id))]
        status = dict(s.execute(select(Trial.status, func.count()).group_by(Trial.status)).all())
        winners = dict(s.execute(select(ProblemRow.op, func.count()).join(Winner, Winner.problem_id == ProblemRow.id)
                                 .group_by(ProblemRow.op)).all())
        methods = dict(s.execute(select(Winner.method, func.count()).group_by(Winner.method)).all())
        problems = s.scalar(select(func.count()).select_from(ProblemRow))
    return {"database": db.name, "schema": db.revision(), "hardware": hw, "runs": runs,
            "problems": problems, "trials": {k.value: v for k, v in status.items()},
            "winners_by_op": winners, "winners_by_method": {m or "unknown": n for m, n in methods.items()}}


@dataclass
class Verification:
    integrity: list[str]
    schema: str | None
    schema_ok: bool
    winners: int = 0
    stale: list[str] = field(default_factory=list)
    stale_by_op: Counter = field(default_factory=Counter)  # which ops' keys moved (a block's: its dense ops too)
    out_of_space: list[str] = field(default_factory=list)
    coverage: dict[str, dict] = field(default_factory=dict)  # hardware class -> {covered, total, missing}
    swept_specs: list[str] = field(default_factory=list)  # the spec digests the database's runs were swept with
    # digest -> the --spec its first run named (from the run's command): names a spec whose digest no file has now
    swept_spec_args: dict[str, str] = field(default_factory=dict)
    unreadable: dict[str, list[int]] = field(default_factory=dict)  # "table.column" -> ids of its unreadable cells

    @property
    def readable(self) -> bool:
        """SQLite's integrity check passed (or had nothing to say): the schema and winners could be read."""
        return self.integrity in (["ok"], [])

    @property
    def ok(self) -> bool:
        full = all(c["covered"] == c["total"] for c in self.coverage.values())
        return (self.readable and self.schema_ok and not self.stale and not self.out_of_space and full
                and not self.unreadable)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "integrity": self.integrity, "schema": self.schema, "schema_ok": self.schema_ok,
                "winners": self.winners, "stale": self.stale, "stale_by_op": self.stale_by_op,
                "out_of_space": self.out_of_space,
                "coverage": self.coverage, "swept_specs": self.swept_specs, "swept_spec_args": self.swept_spec_args,
                "unreadable": self.unreadable}


def _spec_arg(command: str | None) -> str | None:
    """The ``--spec`` a run's recorded command named (``--spec X`` or ``--spec=X``), if any."""
    try:
        argv = shlex.split(command or "")
    except ValueError:  # a command cut or quoted oddly: no name, only the digest
        return None
    for i, a in enumerate(argv):
        if a == "--spec" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--spec="):
            return a.split("=", 1)[1]
    return None


def verify(db: Database, plan: plans.Plan | None = None) -> Verification:
    integrity = db.quick_check()
    unread = Verification(integrity, None, False)
    if not unread.readable:
        return unread
    rev = db.revision()
    v = Verification(integrity, rev, rev == head_revision())
    if not v.schema_ok:
        return v
    v.unreadable = unreadable_json(db)
    bad_problems, bad_winners = v.unreadable.get("problems.dims", []), []
    for cell in ("winners.params", "winners.ties"):
        bad_winners += v.unreadable.get(cell, [])
    with db.session() as s:  # the rest is verified as usual
        rows = s.execute(select(Winner, ProblemRow, Hardware).join(ProblemRow, ProblemRow.id == Winner.problem_id)
                         .join(Hardware, Hardware.id == Winner.hardware_id)
                         .where(Winner.id.not_in(bad_winners), ProblemRow.id.not_in(bad_problems))).all()
        runs = s.execute(select(Run.spec_digest, Run.command).order_by(Run.id)).all()
    v.swept_specs = sorted({d for d, _ in runs})
    for digest, command in runs:
        if digest and digest not in v.swept_spec_args and (arg := _spec_arg(command)):
            v.swept_spec_args[digest] = arg
    have: dict[str, set[str]] = {}
    for w, p, h in rows:
        v.winners += 1
        if not is_current(p.op, w.op_digest, w.backend.value, h.class_key):
            v.stale.append(f"{h.class_key} {p.key}")
            v.stale_by_op[p.op] += 1
            continue
        problem = plans.Problem(p.op, p.kind, tuple(p.dims.items()))
        try:
            family(w.family).config_from_params(problem, w.params)
        except (CannotImplement, ConfigError) as e:
            v.out_of_space.append(f"{p.key}: {e}")
            continue
        have.setdefault(f"{h.class_key} [{w.backend.value}]", set()).add(p.key)
    if plan is not None:
        for hw_key, keys in have.items():
            backend = BACKEND_OF[hw_key.rsplit("[", 1)[1].rstrip("]")]
            wanted = [p.key for p in plan.problems if families_for(p, backend)]
            missing = [k for k in wanted if k not in keys]
            v.coverage[hw_key] = {"covered": len(wanted) - len(missing), "total": len(wanted), "missing": missing[:20]}
        if not have:
            v.coverage["(none)"] = {"covered": 0, "total": len(plan.problems), "missing": [p.key for p in plan.problems[:20]]}
    return v


def unreadable_json(db: Database) -> dict[str, list[int]]:
    """The rows whose JSON cells no command can read, by "table.column": not JSON (SQLite checks no JSON on write),
    or not the JSON type the column holds (on PostgreSQL too, which checks only that it is JSON)."""
    found = {}
    with db.session() as conn:  # an error here (a damaged page) is a DatabaseError: verify's verdict
        for table, col, kinds in JSON_CELLS:
            allowed = f"({', '.join(repr(k) for k in kinds or ())})"
            if kinds is None:  # any JSON: only a SQLite file can hold text that is not
                if not db.is_sqlite:
                    continue
                bad = f"NOT json_valid({col})"
            elif db.is_sqlite:  # json_type of text that is not JSON is an error: asked only of valid cells
                bad = f"CASE WHEN json_valid({col}) THEN json_type({col}) ELSE 'invalid' END NOT IN {allowed}"
            else:
                bad = f"json_typeof({col}) NOT IN {allowed}"
            ids = conn.execute(text(f"SELECT id FROM {table} WHERE {col} IS NOT NULL AND {bad} ORDER BY id")
                               ).scalars().all()
            if ids:
                found[f"{table}.{col}"] = list(ids)
    return found


def _winner_map(db: Database) -> dict[tuple, dict]:
    with db.session() as s:
        rows = s.execute(select(Winner, ProblemRow.key, Hardware.class_key).join(ProblemRow, ProblemRow.id == Winner.problem_id)
                         .join(Hardware, Hardware.id == Winner.hardware_id)).all()
    return {(hw, key, w.backend.value): dict(family=w.family, params=w.params, median_us=w.median_us,
                                             spread_us=w.spread_us, op_digest=w.op_digest, method=w.method)
            for w, key, hw in rows}


def diff(a: Database, b: Database) -> dict:
    """Problem by problem: a winner whose time in b exceeds a's by more than both spreads and 3% regresses.
    ``timed_differently`` counts the compared problems whose winners were timed by different methods (both known):
    their times differ by the measurer too, and their rows say so (``timing``)."""
    wa, wb = _winner_map(a), _winner_map(b)
    rows, counts, timed_differently = [], Counter(), 0
    for k in sorted(set(wa) | set(wb)):
        x, y = wa.get(k), wb.get(k)
        if x is None or y is None:
            change = "added" if x is None else "removed"
            rows.append(dict(hardware=k[0], problem=k[1], backend=k[2], change=change,
                             a=x and x["median_us"], b=y and y["median_us"]))
            counts[change] += 1
            continue
        ratio = y["median_us"] / x["median_us"]
        margin = max(REGRESSION_FLOOR, (x["spread_us"] + y["spread_us"]) / x["median_us"])
        change = "regression" if ratio > 1 + margin else "improvement" if ratio < 1 - margin else \
            ("changed" if (x["family"], x["params"]) != (y["family"], y["params"]) else "same")
        counts[change] += 1
        differs = bool(x["method"] and y["method"] and x["method"] != y["method"])
        timed_differently += differs
        if change != "same":
            rows.append(dict(hardware=k[0], problem=k[1], backend=k[2], change=change, a=x["median_us"],
                             b=y["median_us"], ratio=round(ratio, 4), a_kernel=f"{x['family']} {x['params']}",
                             b_kernel=f"{y['family']} {y['params']}", timing="differs" if differs else "same",
                             # a regression or gain of the same kernel is its time moving (another machine or day,
                             # noise), not a better or worse choice: said so, and still counted
                             same_kernel=(x["family"], x["params"]) == (y["family"], y["params"])))
    rows.sort(key=lambda r: _CHANGE_ORDER[r["change"]])  # regressions first: a long list of additions must not hide them
    return {"counts": dict(counts), "timed_differently": timed_differently, "rows": rows}


_CHANGE_ORDER = {"regression": 0, "improvement": 1, "changed": 2, "removed": 3, "added": 4}
