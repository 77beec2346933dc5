"""The measured sweep, called through the library (the GPU machine has no typer/rich; `k3tune sweep` is the
same call behind the CLI).

    python bench/device_sweep.py --spec configs/sweep_h200_dense.toml --db .device/h200-sweep.sqlite --gpus 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from k3tune.plan import model as models, spec as specs
from k3tune.search.driver import SweepOptions, run_sweep
from k3tune.store.db import interrupts_between_sessions, open_db


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--db", required=True)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--trial-timeout", type=float, default=60.0)
    ap.add_argument("--compile-procs", type=int, default=None,
                    help="CPU processes compiling candidates ahead (default: k3tune sweep's)")
    ap.add_argument("--warm-from", default=None, help="another GPU kind's winners in --db as first candidates")
    args = ap.parse_args()
    sp = specs.load(args.spec)
    last = [0.0]

    def progress(st) -> None:
        if time.monotonic() - last[0] > 15:
            last[0] = time.monotonic()
            print(f"[{st.seconds:6.0f}s] problems {st.problems_done_before + st.problems_done}/{st.problems_total} "
                  f"trials {st.trials} failed {st.failed} replaced {st.workers_replaced}", flush=True)

    db = open_db(args.db)
    try:
        with interrupts_between_sessions():  # `timeout N python3 bench/device_sweep.py ...`: a clean stop
            st = run_sweep(SweepOptions(sp, models.load(sp.model_config), db, "gpu", args.gpus,
                                        trial_timeout_s=args.trial_timeout,
                                        command=" ".join(["bench/device_sweep.py", *sys.argv[1:]]),
                                        progress=progress, compile_procs=args.compile_procs,
                                        warm_from=args.warm_from))
    except KeyboardInterrupt:
        print("interrupted: finished trials are saved; run the same command again to resume", flush=True)
        sys.exit(130)
    finally:
        db.close()  # SQLite's WAL file folded into the database file: a copy of it alone is whole
    print(json.dumps({k: v for k, v in vars(st).items() if k != "last"}, default=str, indent=1))


if __name__ == "__main__":
    main()
