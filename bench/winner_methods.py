"""Record, on winners stored before schema 0005, how they were timed: a winner whose problem, kernel, knobs and
median equal an ok trial of a sweep database (the trial it was decided from) takes that trial's method digest
(search/method.py). Winners with no such trial keep "" (unknown); nothing is inferred.

    python bench/winner_methods.py tuning_db/h200.sqlite SWEEP.sqlite [SWEEP2.sqlite ...]

Prints how many winners took a method, per op. The sweep databases are only read.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from sqlalchemy import select

from k3tune.store.db import Database
from k3tune.store.models import ProblemRow, Trial, TrialStatus, Winner


def _key(problem: str, family: str, params: dict, median: float) -> tuple:
    return problem, family, json.dumps(params, sort_keys=True), round(median, 6)


def trial_methods(path: str) -> dict[tuple, set[str]]:
    """(problem key, family, params, median) of every ok trial with a known method -> its methods."""
    out: dict[tuple, set[str]] = {}
    db = Database(path, create=False, readonly=True, check_schema=False)  # any schema with trials.method (0003+)
    with db.session() as s:
        rows = s.execute(select(ProblemRow.key, Trial.family, Trial.params, Trial.median_us, Trial.method)
                         .join(ProblemRow, ProblemRow.id == Trial.problem_id)
                         .where(Trial.status == TrialStatus.ok, Trial.method != ""))
        for key, fam, params, median, method in rows:
            out.setdefault(_key(key, fam, params, median), set()).add(method)
    return out


def backfill(db: str, sweeps: list[str]) -> Counter:
    known: dict[tuple, set[str]] = {}
    for path in sweeps:
        for k, methods in trial_methods(path).items():
            known.setdefault(k, set()).update(methods)
    done: Counter = Counter()
    with Database(db, create=False).session() as s:
        rows = s.execute(select(Winner, ProblemRow.key, ProblemRow.op)
                         .join(ProblemRow, ProblemRow.id == Winner.problem_id).where(Winner.method == "")).all()
        for w, key, op in rows:
            methods = known.get(_key(key, w.family, w.params, w.median_us), set())
            if len(methods) == 1:  # two methods for one number: ambiguous, left unknown
                w.method = methods.pop()
                done[op] += 1
            else:
                done["(unknown) " + op] += 1
        s.commit()
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db")
    ap.add_argument("sweeps", nargs="+")
    a = ap.parse_args()
    for op, n in sorted(backfill(a.db, a.sweeps).items()):
        print(f"{op}: {n}")


if __name__ == "__main__":
    main()
