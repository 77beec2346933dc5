"""Which staged chain switches pay, from chain_ab.py's --json tables: prints their names (space-separated; nothing
when none pays). The rule (NOTES s44/s45): a switch lands when it makes bf16 TP16 b1 (the one bf16 roofline miss)
at least ``--gain`` faster and no measured point more than ``--slack`` slower. ``fused`` (GATHER_ROUTE) and ``early``
(W2_EARLY_L2) are read from the imposed-routing table (the bars' routing); early on top of fused from ``all`` against
``fused`` where fused lands. ``redux`` (ROUTE_REDUX, serving's own routing only) from the natural-routing table, where
it must not be slower.

    python3 bench/chain_pick.py imposed.json natural.json
"""

from __future__ import annotations

import argparse
import json
import sys


def ratios(table: dict, base: str, v: str) -> dict:
    return {pt: row[base] / row[v] for pt, row in table.items() if base in row and v in row}


def pays(r: dict, key: str, gain: float, slack: float) -> bool:
    return bool(r) and r.get(key, 0.0) >= 1 + gain and min(r.values()) >= 1 - slack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("imposed")
    ap.add_argument("natural", nargs="?")
    ap.add_argument("--key", default="bf16:16:1")
    ap.add_argument("--gain", type=float, default=0.01)
    ap.add_argument("--slack", type=float, default=0.005)
    args = ap.parse_args()
    with open(args.imposed) as f:
        imposed = json.load(f)
    on = []
    fused = pays(ratios(imposed, "off", "fused"), args.key, args.gain, args.slack)
    if fused:
        on.append("GATHER_ROUTE")
        early = pays(ratios(imposed, "fused", "all"), args.key, args.gain / 2, args.slack)
    else:
        early = pays(ratios(imposed, "off", "early"), args.key, args.gain / 2, args.slack)
    if early:
        on.append("W2_EARLY_L2")
    if args.natural:
        with open(args.natural) as f:
            natural = json.load(f)
        r = ratios(natural, "off", "redux")
        if r and min(r.values()) >= 1.0:
            on.append("ROUTE_REDUX")
    for name, table in (("imposed", imposed),) + ((("natural", natural),) if args.natural else ()):
        for pt, row in table.items():
            print(f"# {name} {pt}: " + ", ".join(f"{v} {us:.2f} us" for v, us in row.items()), file=sys.stderr)
    print(" ".join(on))


if __name__ == "__main__":
    main()
