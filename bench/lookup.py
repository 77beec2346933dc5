"""Runtime selector benchmark: database load time and lookup latency for a database of ~100k trials.

    python bench/lookup.py [--db PATH] [--lookups 1000000]

It first makes sure the database holds --trials trials (default 100k), with real simulated sweeps of the
default matrix (16 workers, a larger search budget) for gb300, then b200, h200, h100, then the same for a
second matrix (other contexts, skewed routing) as needed: a database shared by several GPU kinds. Lookups are served from the gb300 winners.
Load is timed in fresh processes (imports done before the clock starts) and again warm; lookups are timed
one by one over random deployments of the whole matrix (every op, batch 1-64, draft 0-7, tp, dcp,
context), and reported as percentiles with the timer's own overhead shown alongside.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

LOAD_SNIPPET = """
import time, sys
from k3tune.runtime import Selector
import k3tune.store.db, sqlalchemy  # imports are not part of the load
t = time.perf_counter(); Selector.load(sys.argv[1], simulated="gb300"); print(time.perf_counter() - t)
"""


def build(path: Path, target: int) -> None:
    """Real simulated sweeps of the default matrix (16 workers, a larger budget) for one hardware after
    another until the database holds ``target`` trials: a database shared by several GPU kinds."""
    import sqlite3

    from k3tune.plan import hardware, model, spec
    from k3tune.search.driver import SweepOptions, run_sweep
    from k3tune.store.db import open_db

    base = spec.load()
    search = spec.SearchSettings(budget=48, patience=48, remeasure_top=3, samples=5, seed=0)
    variants = [spec.SweepSpec(**{**base.__dict__, "search": search}),
                # a second deployment family (other context buckets, skewed routing): more, distinct problems
                spec.SweepSpec(**{**base.__dict__, "search": search, "context": (4096, 16384, 65536),
                                  "routing": "zipf:1.2"})]
    for sp in variants:
        for hw in ("gb300", "b200", "h200", "h100"):
            with contextlib.closing(sqlite3.connect(path)) as c:
                have = c.execute("select count(*) from trials").fetchone()[0] if c.execute(
                    "select name from sqlite_master where name='trials'").fetchone() else 0
            if have >= target:
                return
            t = time.perf_counter()
            st = run_sweep(SweepOptions(sp, model.load(), open_db(path), "simulated", 16, hw=hardware.spec(hw)))
            print(f"{hw}: {st.trials} trials over {st.problems_total} problems in {time.perf_counter() - t:.0f} s")


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", type=Path, default=Path("bench/results/lookup-bench.sqlite"))
    ap.add_argument("--lookups", type=int, default=1_000_000)
    ap.add_argument("--loads", type=int, default=7)
    ap.add_argument("--trials", type=int, default=100_000, help="build the database up to this many trials")
    args = ap.parse_args()
    args.db.parent.mkdir(parents=True, exist_ok=True)
    build(args.db, args.trials)
    import sqlite3

    with contextlib.closing(sqlite3.connect(args.db)) as c:
        trials = c.execute("select count(*) from trials").fetchone()[0]
        winners = c.execute("select count(*) from winners").fetchone()[0]

    cold = sorted(float(subprocess.run([sys.executable, "-c", LOAD_SNIPPET, str(args.db)], capture_output=True,
                                       text=True, check=True).stdout) * 1e3 for _ in range(args.loads))
    from k3tune.plan import problems
    from k3tune.runtime import Selector

    warm = []
    for _ in range(args.loads):
        t = time.perf_counter()
        sel = Selector.load(args.db, simulated="gb300")
        warm.append((time.perf_counter() - t) * 1e3)
    warm.sort()

    rng = random.Random(0)
    ops = list(problems.OPS)
    queries = []
    for _ in range(args.lookups):
        tp = rng.choice((8, 16))
        queries.append((rng.choice(ops), tp, rng.randint(1, 64), rng.randint(0, 7), rng.choice((1, 2, 4, 8)),
                        rng.choice((4096, 8192, 20000, 32768, 100000, 131072))))
    lookup = sel.lookup
    now = time.perf_counter_ns
    for q in queries[:10000]:  # warm-up
        lookup(*q)
    lat, empty = [], []
    for q in queries:
        t0 = now()
        lookup(*q)
        lat.append(now() - t0)
    for _ in range(len(queries) // 10):
        t0 = now()
        empty.append(now() - t0)
    lat.sort()
    empty.sort()
    res = {
        "database": str(args.db), "trials": trials, "winners": winners,
        "load_cold_ms": {"median": round(statistics.median(cold), 1), "max": round(cold[-1], 1)},
        "load_warm_ms": {"median": round(statistics.median(warm), 1), "max": round(warm[-1], 1)},
        "lookup_ns": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "p999": pct(lat, 0.999), "max": lat[-1]},
        "timer_overhead_ns": {"p50": pct(empty, 0.5), "p99": pct(empty, 0.99)},
        "lookups": len(lat),
    }
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
