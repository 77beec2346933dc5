"""Apply the search's safe-baseline margin (``SearchSettings.safe_margin_pct``) to the winners of a stored sweep that
was decided without it (before session 13) or with another margin:

    python bench/redecide_db.py SWEEP.sqlite [--margin 2]

A winner that is not the safe baseline of its problem (the registry's safest family for it, at its default config:
cuBLAS for a GEMM) is replaced by that baseline where the baseline's own final-round trial (remeasured beside the
finalists, same family digest, same backend) is within the margin of the winner's median; the replaced winner heads
the new winner's ties. It needs the sweep's trials (a compact, exported database has none: re-decide the sweep's
database, then export it). One SQLite transaction: all or nothing. Prints each replaced problem.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3tune.kernels import families_for, params_key  # noqa: E402
from k3tune.plan.problems import Problem  # noqa: E402
from k3tune.search.strategy import within_safe_margin  # noqa: E402

BACKEND_OF = {"measured": "gpu", "simulated": "simulated", "cpu": "cpu"}  # store value -> registry backend


def redecide(path: str, margin_pct: float) -> list[str]:
    """Replace the winners the margin rules out, in one transaction; returns their problem keys."""
    con = sqlite3.connect(path)
    changed = []
    try:
        if con.execute("SELECT COUNT(*) FROM trials").fetchone()[0] == 0:
            raise ValueError(f"{path} holds no trials (an exported database keeps winners only): re-decide the "
                             "sweep's database, then export it")
        with con:
            rows = con.execute("SELECT w.id, w.hardware_id, w.problem_id, w.backend, w.family, w.params, w.median_us,"
                               " w.ties, p.key, p.op, p.kind, p.dims FROM winners w JOIN problems p"
                               " ON p.id = w.problem_id").fetchall()
            for wid, hw, pid, backend, fam, params, median, ties, key, op, kind, dims in rows:
                problem = Problem(op, kind, tuple(json.loads(dims).items()))
                fams = families_for(problem, BACKEND_OF[backend])
                if not fams or fams[0].name == fam:
                    continue
                safe = fams[0]
                safe_params = safe.default_config(problem).params()
                base = con.execute("SELECT median_us, spread_us FROM trials WHERE hardware_id = ? AND problem_id = ?"
                                   " AND family = ? AND family_digest = ? AND params_key = ? AND round = 1"
                                   " AND status = 'ok' AND backend = ? ORDER BY id DESC LIMIT 1",
                                   (hw, pid, safe.name, safe.digest, params_key(safe_params), backend)).fetchone()
                if base is None or not within_safe_margin(base[0], median, margin_pct):
                    continue
                new_ties = [{"family": fam, "params": json.loads(params), "median_us": median}, *json.loads(ties)]
                con.execute("UPDATE winners SET family = ?, family_digest = ?, params = ?, median_us = ?,"
                            " spread_us = ?, ties = ? WHERE id = ?",
                            (safe.name, safe.digest, json.dumps(safe_params), base[0], base[1],
                             json.dumps(new_ties), wid))
                changed.append(f"{key}: {fam} {median:.2f} us -> {safe.name} {base[0]:.2f} us")
    finally:
        con.close()
    return changed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("db")
    ap.add_argument("--margin", type=float, default=2.0, help="percent (SearchSettings.safe_margin_pct)")
    args = ap.parse_args()
    if not Path(args.db).is_file():
        sys.exit(f"error: database not found: {args.db}")
    if not 0 <= args.margin <= 50:
        sys.exit(f"error: --margin must be within 0..50 (percent), not {args.margin:g}")
    try:
        changed = redecide(args.db, args.margin)
    except sqlite3.DatabaseError as e:
        sys.exit(f"error: {args.db} is not a k3tune SQLite database ({e}); nothing was changed")
    except ValueError as e:
        sys.exit(f"error: {e}")
    for line in changed:
        print(line)
    print(f"{len(changed)} winners replaced by their safe baseline (margin {args.margin:g}%)")


if __name__ == "__main__":
    main()
