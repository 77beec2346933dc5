"""Staged changes to the block's dependent chain, each a module switch of ``k3tune.kernels.moe_experts``, served
side by side with the shipped knobs in one run (the router's own choices on random weights):

- ``early`` (``W2_EARLY_L2``): the routed w2 kernel asks L2 for its weight tile before its PDL wait. Why (s43-r2's
  profile, bf16 TP16 b1): the routed w2 (22 MB) starts when w13's last CTAs leave and, with the shared w2 beside it,
  moves 27.5 MB in 7.7 us (0.85 of the copy bandwidth); w13's 44 MB take 13.1 us (0.80). w2's weights do not depend
  on w13: a w2 CTA resident while w13 drains can stream its tile before it waits. (s39-r1's separate prefetch
  kernel beside all of w13 competed with it and was 0-8% slower; here only CTAs already resident prefetch.)
- ``redux`` (``ROUTE_REDUX``): the route kernel's k rounds of warp argmax by two ``redux.sync`` each instead of ten
  dependent shuffle steps (the route takes ~2.3 us after the gather stand-in at b1, a chain of ~16 x 15 shuffles).
- ``both``.
- ``fused`` (``GATHER_ROUTE``): the router's all-gather stand-in and the route in one launch (the routing CTAs spin
  beside the gather's, then route from the GEMM's copy of the scores), one dependent launch fewer on the chain.
  It also serves imposed routings (``--imposed``, as the bars measure), where ``redux`` never runs.
- ``all``: the three.

Each variant changes kernels of the CUDA-core expert path (the MXFP4 tensor-core experts never read ``early``); each
point says which switched kernels ran (w2 early, route redux). Outputs must be bit-equal to ``off``'s: neither
change alters a number. The roofline column's floor counts the experts of the point's imposed uniform routing
(the router's own choices touch as many at b1; at larger batches the count may differ a little). The served knobs
on this tree's code, as in sum_norm_ab.py (a temporary copy of the database, never one to ship).

Until the switches land, they are ``bench/results/2026-12-05-s45-chain-staged.patch`` (``git apply`` it first;
it holds s44's patch and GATHER_ROUTE).

    cd bench && python3 chain_ab.py --points bf16:16:1,bf16:8:1,bf16:16:8,mxfp4:16:1 [--variants early,redux,fused,all]
    [--imposed]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from moe import ab_cells, alternate, served_ab_args, served_ab_points  # bench/moe.py (this script runs from bench/)

from k3tune.kernels import moe_experts

SWITCHES = {"early": ("W2_EARLY_L2",), "redux": ("ROUTE_REDUX",), "both": ("W2_EARLY_L2", "ROUTE_REDUX"),
            "fused": ("GATHER_ROUTE",), "all": ("W2_EARLY_L2", "ROUTE_REDUX", "GATHER_ROUTE")}


ALL = ("W2_EARLY_L2", "ROUTE_REDUX", "GATHER_ROUTE")


class Switched:
    """A served block called (captured or not) with exactly ``names`` of moe_experts' staged switches on (the others
    off, whatever the module's defaults), each restored after the call."""

    def __init__(self, blk, names):
        self.blk, self.names = blk, names

    def __call__(self, x):
        was = {n: getattr(moe_experts, n) for n in ALL}
        for n in ALL:
            setattr(moe_experts, n, n in self.names)
        try:
            return self.blk(x)
        finally:
            for n, v in was.items():
                setattr(moe_experts, n, v)


def switched_kernels(blk, x) -> str:
    """Which switched kernels the block compiles or looks up in one call (outside any capture)."""
    seen, real = set(), moe_experts.compiled

    def spy(kind, knobs, arch, pdl=0):
        if kind == "w2" and len(knobs) == 6 and knobs[5] and pdl:
            seen.add("w2 early")
        if kind == "route" and len(knobs) == 6 and knobs[5]:
            seen.add("route redux")
        if kind == "gather_route":
            seen.add("gather+route" + (" redux" if knobs[7] else ""))
        return real(kind, knobs, arch, pdl)

    moe_experts.compiled = spy
    try:
        blk(x)
        torch.cuda.synchronize()
    finally:
        moe_experts.compiled = real
    return ", ".join(sorted(seen)) or "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    served_ab_args(ap, "bf16:16:1,bf16:8:1,bf16:16:8,mxfp4:16:1")
    ap.add_argument("--variants", default="early,redux,fused,all")
    ap.add_argument("--imposed", action="store_true", help="the point's imposed routing (as the bars measure; the "
                    "route kernel's forced branch, which redux leaves alone) instead of the router's own choices")
    ap.add_argument("--json", default=None, help="also write {point: {variant: median us}} here")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(SWITCHES):
        raise SystemExit(f"--variants: {args.variants!r}; known: {', '.join(SWITCHES)}")

    table = {}
    for pt, served in served_ab_points(args, "early = W2_EARLY_L2, redux = ROUTE_REDUX, both = the two, fused = "
                                       "GATHER_ROUTE, all = the three" + (" (imposed routing)" if args.imposed else "")):
        for b in served:  # the router's own choices (random weights: near uniform) unless --imposed: an imposed
            b.force_top = pt.top if args.imposed else None  # routing runs the route's forced branch (no redux)
        blocks = {"off": [Switched(b, ()) for b in served],
                  **{v: [Switched(b, SWITCHES[v]) for b in served] for v in variants}}
        ran = {v: switched_kernels(blocks[v][0], pt.x) for v in variants}
        ref = blocks["off"][0](pt.x).clone()
        for v in variants:
            out = blocks[v][0](pt.x)
            if not torch.equal(out, ref):
                raise SystemExit(f"{pt.label()}: {v} differs from off (max {(out.float() - ref.float()).abs().max()})")
        meds = alternate(blocks, pt.x, args.rounds, args.samples)
        print(pt.label() + " | " + " | ".join(ab_cells(meds, "off", pt.floor_us)) +
              f" | ran: {ran} | bit-equal to off", flush=True)
        table[f"{pt.fmt}:{pt.tp}:{pt.batch}"] = {v: statistics.median(m) for v, m in meds.items()}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(table, f, indent=1)
        del blocks, served, pt


if __name__ == "__main__":
    main()
