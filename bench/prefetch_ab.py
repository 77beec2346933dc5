"""The served block with its L2 prefetch off against the same knobs with the latent up-projection's weights pulled into
L2 while the routed all-reduce leaves HBM idle (``MoEBlock._prefetch_up``), side by side in one run.

Why (s39-r4's profile, bf16 TP16 b1): the up-projection (3.2 MB at TP16, 6.4 MB at TP8) runs after the norm kernel,
whose first ~4 us spin the routed all-reduce's stand-in while HBM idles; the dense table gives it 2.07 us at TP16
M = 1 (0.37 of its 0.76 us floor). Read from L2 it should take ~1 us less. Until session 43 the prefetch was issued
during routing, where the routed experts' reads evicted it (0 MiB chosen at all 56 block winners).

Refuted (s43-r2, H200): 0.98-1.00x at bf16 TP16 b1/b64, TP8 b1, MXFP4 TP16 b1, TP8 b8; the up-projection still ends
~1.9 us after the norm with its weights in L2 (it is latency-bound at 3-6 MB, not HBM-bound). The change was never
merged: it is ``bench/results/2026-12-05-s43-prefetch-at-allreduce.patch`` (``git apply`` it to measure it again;
without it this script measures the placement during routing). The shipped database's block winners were measured
before the change, so on the patched tree they read as stale; as in
``sum_norm_ab.py`` a temporary copy with this tree's digests serves the same knobs (never a database to ship). The
variants differ in ``prefetch_mib`` only (``pf0`` is the served knobs with the prefetch off); a prefetch changes no
number, so their outputs are checked against pf0's (and said whether bit-equal).

    cd bench && python3 prefetch_ab.py --points bf16:16:1,mxfp4:16:1,bf16:8:1 [--mib 4,8] [--rounds 3] [--samples 15]
"""

from __future__ import annotations

import argparse

import torch
from moe import (ab_cells, alternate, served_ab_args, served_ab_points,  # bench/moe.py (run from bench/)
                 served_knobs)

from k3tune.runtime.moe import MoEBlock


def main() -> None:
    ap = argparse.ArgumentParser()
    served_ab_args(ap, "bf16:16:1,mxfp4:16:1,bf16:8:1,mxfp4:8:1,bf16:16:8,mxfp4:8:64")
    ap.add_argument("--mib", default="4,8", help="prefetch sizes beside off (MiB; TP16's w_up is 3.06 MiB, TP8's 6.1)")
    args = ap.parse_args()
    sizes = [0] + [int(v) for v in args.mib.split(",")]

    for pt, served in served_ab_points(args, "pfN = N MiB of w_up prefetched during the routed all-reduce"):
        blocks = {}
        for mib in sizes:
            if mib == 0 and served[0].ran["prefetch"] == "off":
                blocks["pf0"] = served  # the winner's knobs already have the prefetch off: no second build
            else:
                knobs = served_knobs(pt.sel, pt.tp, pt.batch, prefetch_mib=mib)
                blocks[f"pf{mib}"] = [MoEBlock.build(w, "tuned", pt.batch, selector=pt.sel, comm=pt.comm, **knobs)
                                      for w in pt.layers]
            for b in blocks[f"pf{mib}"]:
                b.force_top = pt.top
            if mib and not blocks[f"pf{mib}"][0].ran["prefetch"].startswith(f"{mib} MiB"):
                raise SystemExit(f"{pt.label()}: pf{mib} did not prefetch: {blocks[f'pf{mib}'][0].ran['prefetch']}")
        ref = blocks["pf0"][0](pt.x).clone()
        same = []
        for v, blk in blocks.items():
            out = blk[0](pt.x)
            if not torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2):
                raise SystemExit(f"{pt.label()}: {v} differs from pf0 (max {(out.float() - ref.float()).abs().max()})")
            same.append(torch.equal(out, ref))
        meds = alternate(blocks, pt.x, args.rounds, args.samples)
        print(pt.label() + " | " + " | ".join(ab_cells(meds, "pf0", pt.floor_us)) +
              f" | bit-equal to pf0: {all(same)} | shared: {served[0].ran.get('shared')}", flush=True)
        del blocks, served, pt  # before the next point's weights are made


if __name__ == "__main__":
    main()
