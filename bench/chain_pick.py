"""Which staged route switches land, from chain_ab.py's --json tables: prints their names (space-separated;
nothing when none does). The rule (NOTES s45): ``ROUTE_SELECT`` when the router's own routing (``natural``: variants
off, select, ...) is at least ``--gain`` faster at ``--key`` (bf16 TP16 b1) and no point more than ``--slack`` slower;
``FORCED_TOPK`` with it (a measurement's imposed routing then pays the top-k a served step pays: a fidelity fix, not
a speed-up, so it lands with the top-k that serving would run); ``GATHER_ROUTE`` when, under the imposed routing
(``imposed``: variants topk+select and topk+select+fused), it is ``--gain`` / 2 faster at the key and nowhere slower
than the slack.

    python3 bench/chain_pick.py natural.json imposed.json
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
    ap.add_argument("natural")
    ap.add_argument("imposed", nargs="?")
    ap.add_argument("--key", default="bf16:16:1")
    ap.add_argument("--gain", type=float, default=0.01)
    ap.add_argument("--slack", type=float, default=0.005)
    args = ap.parse_args()
    tables = {}
    for name in ("natural", "imposed"):
        if getattr(args, name):
            with open(getattr(args, name)) as f:
                tables[name] = json.load(f)
    on = []
    if pays(ratios(tables["natural"], "off", "select"), args.key, args.gain, args.slack):
        on += ["ROUTE_SELECT", "FORCED_TOPK"]
        imposed = tables.get("imposed", {})
        if pays(ratios(imposed, "topk+select", "topk+select+fused"), args.key, args.gain / 2, args.slack):
            on.append("GATHER_ROUTE")
    for name, table in tables.items():
        for pt, row in table.items():
            print(f"# {name} {pt}: " + ", ".join(f"{v} {us:.2f} us" for v, us in row.items()), file=sys.stderr)
    print(" ".join(on))


if __name__ == "__main__":
    main()
