"""Two bench/moe_experts.py runs side by side: per point (tp, batch, routing) and per variant both ran, the new
run's median over the base run's, with both runs' spreads, and the geometric mean per variant. For an A/B of kernel
code that is not a knob (the base run on a `git archive` of the base commit, the new one on this tree, in the same
device call), e.g.

    python bench/experts_ab.py $OUT/new.json $OUT/base.json [--variants x1_mxfp4,x1_bf16] [--worse 1.05]

Exits 1 when a variant is slower than ``--worse`` x the base at some point (beyond both runs' spreads too), or
slower than ``--worse-mean`` in geometric mean (stdout says where), so a device script can stop before a sweep over
code that lost. The defaults allow for the noise between two processes, which a run's own spread understates: in
s21-r1 the same TP8 kernels (no code difference there) came out 0.97-1.04 apart.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def points(path: str) -> dict:
    """(tp, batch, routing, variant) -> {us, iqr} of one moe_experts.py JSON output."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: {path}: not a bench/moe_experts.py output ({type(e).__name__}: {e})") from None
    return {(r["tp"], r["batch"], r["routing"], k): v for r in rows for k, v in r.items()
            if isinstance(v, dict) and "us" in v}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("new")
    ap.add_argument("base")
    ap.add_argument("--variants", default="", help="only these variants (comma-separated); default: all in both")
    ap.add_argument("--worse", type=float, default=1.05, help="the ratio above which a point counts as slower")
    ap.add_argument("--worse-mean", type=float, default=1.01, help="the geometric mean above which a variant lost")
    args = ap.parse_args()
    new, base = points(args.new), points(args.base)
    want = set(args.variants.split(",")) if args.variants else None
    common = sorted(k for k in new.keys() & base.keys() if want is None or k[3] in want)
    if not common:
        raise SystemExit("error: the two runs share no (point, variant); check --variants")
    logs, slower = {}, []
    for tp, batch, routing, var in common:
        a, b = new[(tp, batch, routing, var)], base[(tp, batch, routing, var)]
        ratio = a["us"] / b["us"]
        logs.setdefault(var, []).append(math.log(ratio))
        beyond = a["us"] - a["iqr"] / 2 > b["us"] + b["iqr"] / 2  # slower beyond both runs' spreads
        flag = " SLOWER" if ratio > args.worse and beyond else ""
        print(f"tp{tp:<3} batch {batch:<3} {routing:9} {var:14} new {a['us']:8.1f} (±{a['iqr'] / 2:.1f})  "
              f"base {b['us']:8.1f} (±{b['iqr'] / 2:.1f})  ratio {ratio:.3f}{flag}")
        if flag:
            slower.append((tp, batch, routing, var))
    lost = []
    for var, ls in sorted(logs.items()):
        mean = math.exp(sum(ls) / len(ls))
        print(f"geomean new/base {var}: {mean:.3f} over {len(ls)} points")
        if mean > args.worse_mean:
            lost.append(var)
    if slower or lost:
        print(f"slower: {len(slower)} point(s) beyond {args.worse}x; variants above {args.worse_mean}x in geomean: "
              f"{', '.join(lost) or 'none'}")
        sys.exit(1)


if __name__ == "__main__":
    main()
