"""Drop the winners (and claims) of the problems whose keys match, so the next sweep into this database decides them
again: after a change to how trials are timed (k3tune/search/method.py), which re-keys no winner but makes the old
trials unusable (a trial is reused only by the method that timed it). Trials stay, for the notebook.

    python bench/redo_problems.py /tmp/sweep.sqlite "moe.block[tp=8,%bf16%;moe.block[tp=16,%"
"""

from __future__ import annotations

import sys

from sqlalchemy import delete, select

from k3tune.errors import K3TuneError
from k3tune.store.db import Database
from k3tune.store.models import Claim, ProblemRow, Winner


def redo(path: str, patterns: list[str]) -> int:
    """Winners dropped for problems whose key matches any of ``patterns`` (SQL LIKE); their claims go with them."""
    with Database(path, create=False).session() as s:
        ids = {pid for pat in patterns for (pid,) in s.execute(select(ProblemRow.id).where(ProblemRow.key.like(pat)))}
        if not ids:
            raise SystemExit(f"redo_problems: no problem in {path} has a key like {' or '.join(patterns)}")
        n = s.execute(delete(Winner).where(Winner.problem_id.in_(ids))).rowcount
        s.execute(delete(Claim).where(Claim.problem_id.in_(ids)))
        s.commit()
    return n


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: redo_problems.py DB 'PATTERN[;PATTERN...]'")
    try:
        n = redo(sys.argv[1], [p for p in sys.argv[2].split(";") if p])
    except K3TuneError as e:
        raise SystemExit(f"redo_problems: {e}") from None
    print(f"redo_problems: {n} winners dropped; the next sweep decides those problems again")


if __name__ == "__main__":
    main()
