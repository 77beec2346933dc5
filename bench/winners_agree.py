"""Do two sweeps of the same problems (1 GPU and N GPUs, or two 1-GPU runs) choose the same kernels, up to
statistical ties? Each sweep measured many configs; where both measured a config, the ratio of their medians is
the run-to-run noise (its 5th-95th percentile band is printed). A problem whose winners differ counts as a tie
when each sweep's winner, timed by the other sweep, is within that band of the other's own winner; as beyond
when it is slower by more; as not cross-measured when neither sweep timed the other's winner.

    python bench/winners_agree.py gpus1.sqlite gpus2.sqlite [--json]

(`k3tune db diff` compares the two winners' own medians against their in-run spreads, which leave out the
run-to-run noise: NOTES.md session 11.)"""

from __future__ import annotations

import argparse
import json

from sqlalchemy import select

from k3tune.errors import K3TuneError
from k3tune.kernels import params_key
from k3tune.store.db import Database
from k3tune.store.models import ProblemRow, Trial, TrialStatus, Winner


def load(path: str) -> tuple[dict[str, dict[tuple[str, str], float]], dict[str, tuple[str, str]]]:
    """problem key -> {(family, params key): best median}, and problem key -> winner (family, params key)."""
    db = Database(path, create=False)
    with db.session() as s:
        keys = dict(s.execute(select(ProblemRow.id, ProblemRow.key)).all())
        timed: dict[str, dict[tuple[str, str], float]] = {}
        for pid, fam, pk, us in s.execute(select(Trial.problem_id, Trial.family, Trial.params_key, Trial.median_us)
                                          .where(Trial.status == TrialStatus.ok, Trial.median_us.is_not(None))):
            mine = timed.setdefault(keys[pid], {})
            mine[(fam, pk)] = min(us, mine.get((fam, pk), us))
        won = {keys[pid]: (fam, params_key(params))
               for pid, fam, params in s.execute(select(Winner.problem_id, Winner.family, Winner.params))}
    db.dispose()
    return timed, won


def agree(a: str, b: str) -> dict:
    a_t, a_w = load(a)
    b_t, b_w = load(b)
    ratios = sorted(b_t[k][c] / us for k in a_t.keys() & b_t.keys() for c, us in a_t[k].items() if c in b_t[k])
    if not ratios:
        raise SystemExit("error: the two databases share no timed config")
    lo, hi = ratios[int(0.05 * (len(ratios) - 1))], ratios[int(0.95 * (len(ratios) - 1))]
    band = hi / lo
    out = {"shared_configs": len(ratios), "band_p5_p95": [round(lo, 4), round(hi, 4)], "same": 0, "tie": 0,
           "beyond": [], "not_cross_measured": []}
    for k in sorted(a_w.keys() & b_w.keys()):
        wa, wb = a_w[k], b_w[k]
        if wa == wb:
            out["same"] += 1
            continue
        slower = []  # how much slower the other sweep's winner ran, timed by each sweep that timed both
        if wa in b_t.get(k, {}) and wb in b_t.get(k, {}):
            slower.append(b_t[k][wa] / b_t[k][wb])
        if wa in a_t.get(k, {}) and wb in a_t.get(k, {}):
            slower.append(a_t[k][wb] / a_t[k][wa])
        if not slower:
            out["not_cross_measured"].append(k)
        elif max(slower) <= band:
            out["tie"] += 1
        else:
            out["beyond"].append({"problem": k, "slower": round(max(slower), 3),
                                  "a": f"{wa[0]} {wa[1]}", "b": f"{wb[0]} {wb[1]}"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        r = agree(args.a, args.b)
    except K3TuneError as e:
        raise SystemExit(f"error: {e}") from None
    if args.json:
        print(json.dumps(r, indent=1))
        return
    lo, hi = r["band_p5_p95"]
    print(f"configs timed by both: {r['shared_configs']}, run-to-run ratio p5-p95 {lo:.3f}-{hi:.3f}")
    print(f"winners: same {r['same']}, different but tied (within {hi / lo:.3f}x) {r['tie']}, "
          f"beyond {len(r['beyond'])}, not cross-measured {len(r['not_cross_measured'])}")
    for x in sorted(r["beyond"], key=lambda x: -x["slower"]):
        print(f"  {x['problem']}: {x['slower']}x  a: {x['a']}  b: {x['b']}")


if __name__ == "__main__":
    main()
