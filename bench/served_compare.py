"""Two bench/moe.py --served runs of the same points joined: the served block's median and IQR on each side, their
ratio, and whether one beats the other beyond the run-to-run spread (moe.py's rule, ``_beats``: median +- half the IQR
do not overlap). bench/served_vs.sh prints it after its two runs; it also runs here on fetched JSONs:
python bench/served_compare.py NEW.json OLD.json
"""

import argparse
import json
import sys

from moe import _beats  # bench/moe.py (this script runs from bench/ or as bench/served_compare.py)


def served(row: dict) -> tuple[str, dict]:
    """The row's served variant, ``served_<fmt>`` (not its serial, even-split or PDL twins)."""
    for name in ("served_bf16", "served_mxfp4"):
        if name in row:
            return name, row[name]
    raise KeyError(f"no served variant in tp {row.get('tp')} batch {row.get('batch')}")


def point(row: dict) -> tuple:
    return row["tp"], row["batch"], row["routing"]


def _rows(path: str) -> dict:
    with open(path) as f:
        return {point(r): r for r in json.load(f)["rows"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new")
    ap.add_argument("old")
    a = ap.parse_args(argv)
    try:
        new, old = (_rows(p) for p in (a.new, a.old))
        both = [(k, *served(new[k]), served(old[k])[1]) for k in new if k in old]
    except (OSError, ValueError, KeyError) as e:
        print(f"served_compare: cannot read the runs: {e}", file=sys.stderr)
        return 1
    if not both:
        print("served_compare: the two runs share no point", file=sys.stderr)
        return 1
    print(f"{'tp':>3} {'batch':>5} {'routing':<9} {'variant':<14} {'new us':>14} {'old us':>14} {'old/new':>8}"
          "  verdict")
    for k, name, n, o in both:
        pair = {"new": n, "old": o}
        verdict = "faster" if _beats(pair, "new", "old") else "slower" if _beats(pair, "old", "new") else "tie"
        print(f"{k[0]:>3} {k[1]:>5} {k[2]:<9} {name:<14} {n['us']:>8.1f}±{n['iqr']:<5.1f}"
              f" {o['us']:>8.1f}±{o['iqr']:<5.1f} {o['us'] / n['us']:>8.3f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
