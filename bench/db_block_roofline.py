"""Roofline fractions of a tuning database's MoE block winners, estimated from the sweep's own medians (no GPU):
floor = bench/moe.py's block_bytes for the experts that bench/moe.py's routing sample selects / --bw. An estimate
between served benches (the sweep samples its own routing), never a substitute for bench/moe.py --served.

    python bench/db_block_roofline.py [--db tuning_db/h200.sqlite] [--base OLD.sqlite] [--bw 4.19e12]
"""

from __future__ import annotations

import argparse
import random

from moe import block_bytes
from sqlalchemy import select

from k3tune.errors import K3TuneError
from k3tune.plan import routing as routings
from k3tune.runtime.moe import BlockShape
from k3tune.shipped import configs_dir, tuning_db_dir
from k3tune.store.db import Database
from k3tune.store.models import ProblemRow, Winner


def block_medians(path: str) -> dict:
    """(format, routing, tp, tokens) -> the MoE block winner's median (us), read through the store."""
    with Database(path, create=False, readonly=True).session() as s:
        rows = s.execute(select(ProblemRow.dims, Winner.median_us).join(ProblemRow, ProblemRow.id == Winner.problem_id)
                         .where(ProblemRow.kind == "moe_block")).all()
    return {(d["format"], d.get("routing", "uniform"), d["tp"], d["M"]): us for d, us in rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default=str(tuning_db_dir() / "h200.sqlite"))
    ap.add_argument("--base", default=None, help="an older database: print its fraction first (old -> new)")
    ap.add_argument("--bw", type=float, default=4.19e12, help="measured copy bandwidth, bytes/s")
    args = ap.parse_args()
    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    try:
        new = block_medians(args.db)
        old = block_medians(args.base) if args.base else {}
    except K3TuneError as e:
        raise SystemExit(f"db_block_roofline: {e}") from None
    for fmt, rt, tp in sorted({k[:3] for k in new}):
        cells = []
        for m in sorted(k[3] for k in new if k[:3] == (fmt, rt, tp)):
            ids = routings.sample(rt, sh.experts, sh.top_k, m, random.Random(m))
            floor = block_bytes(sh, tp, "tuned", fmt, len({e for r in ids for e in r}), m) / args.bw * 1e6
            was = f"{floor / old[fmt, rt, tp, m]:.2f}->" if (fmt, rt, tp, m) in old else ""
            cells.append(f"b{m} {was}{floor / new[fmt, rt, tp, m]:.2f}")
        print(f"{fmt:5} {rt:9} tp{tp:<3} " + " ".join(cells))


if __name__ == "__main__":
    main()
