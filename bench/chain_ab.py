"""Staged changes to the block's dependent chain, each a module switch of ``k3tune.kernels.moe_experts``, served
side by side with the shipped knobs in one run (the router's own routing on random weights, or ``--imposed``: the
point's imposed routing, as the bars measure). A variant is atoms joined by '+':

- ``early`` (``W2_EARLY_L2``): the routed w2's CTAs ask L2 for their weight tile before the PDL wait (s45-r1: 0.4 µs
  slower at bf16 TP16 b1, 2.7 at b8: refuted).
- ``redux`` (``ROUTE_REDUX``): the route's k rounds of warp argmax by two ``redux.sync`` each instead of shuffles
  (s45-r1, the router's own routing, bf16 TP16 b1: 77.9 -> 65.4 µs).
- ``select`` (``ROUTE_SELECT``, on since s46): the top-k as a bound (the k-th largest lane maximum), the candidates
  above it compacted and sorted once by a bitonic network: no k dependent rounds (s46-r4, H200, the router's own
  routing: bf16 TP16 b1 67.0 -> 49.6 µs).
- ``fused`` (``GATHER_ROUTE``): the router's all-gather stand-in and the route in one launch (s45-r1, imposed: 0.4 µs
  faster at bf16 b1, 1.2 slower at MXFP4 b1, with the forced branch that skips the top-k).
- ``late`` (``k3tune.runtime.moe.FORK_AFTER_ROUTE``): the shared experts forked after the route, not after the
  router GEMM, so the route's one warp a token does not share its SMs with their GEMM.
- ``topk`` (``FORCED_TOPK``, on since s46): an imposed routing still runs the top-k, as a served step does, then
  imposes its experts (without it the forced branch skips the top-k, and the measured block leaves out what serving
  pays).

Each point says which switched kernels ran. Outputs must be bit-equal to ``off``'s: no switch alters a number.
The roofline column's floor counts the experts of the point's imposed uniform routing. The served knobs on this
tree's code, as in sum_norm_ab.py (a temporary copy of the database, never one to ship).

``off`` is every switch off (the route before s46: shuffle rounds, an imposed routing skipping them), whatever the
modules' defaults.

    cd bench && python3 chain_ab.py --points bf16:16:1,mxfp4:16:1 --variants redux,select,select+fused
    cd bench && python3 chain_ab.py --imposed --points bf16:16:1 --variants topk,topk+select,topk+select+fused
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from moe import ab_cells, alternate, served_ab_args, served_ab_points  # bench/moe.py (this script runs from bench/)

from k3tune.kernels import moe_experts
from k3tune.runtime import moe as runtime_moe

ATOMS = {"early": "W2_EARLY_L2", "redux": "ROUTE_REDUX", "select": "ROUTE_SELECT", "fused": "GATHER_ROUTE",
         "topk": "FORCED_TOPK", "late": "FORK_AFTER_ROUTE"}
ALL = tuple(ATOMS.values())


def switches(variant: str) -> tuple:
    """A variant's module switches: atoms joined by '+' (e.g. topk+select+fused)."""
    return tuple(ATOMS[a] for a in variant.split("+"))


def _module(name: str):
    """Where a switch lives: the runtime's fork point in k3tune.runtime.moe, the kernels' in moe_experts."""
    return runtime_moe if name == "FORK_AFTER_ROUTE" else moe_experts


class Switched:
    """A served block called (captured or not) with exactly ``names`` of the staged switches on (the others off,
    whatever the modules' defaults), each restored after the call."""

    def __init__(self, blk, names):
        self.blk, self.names = blk, names

    def __call__(self, x):
        was = {n: getattr(_module(n), n) for n in ALL}
        for n in ALL:
            setattr(_module(n), n, n in self.names)
        try:
            return self.blk(x)
        finally:
            for n, v in was.items():
                setattr(_module(n), n, v)


def switched_kernels(blk, x) -> str:
    """Which switched kernels the block compiles or looks up in one call (outside any capture)."""
    seen, real = set(), moe_experts.compiled

    def spy(kind, knobs, arch, pdl=0):
        if kind == "w2" and len(knobs) == 6 and knobs[5] and pdl:
            seen.add("w2 early")
        if kind == "route" and len(knobs) == 7:
            seen.add(f"route {knobs[5]}" + (" forced top-k" if knobs[6] else ""))
        if kind == "gather_route":
            seen.add(f"gather+route {knobs[7]}" + (" forced top-k" if knobs[8] else ""))
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
    ap.add_argument("--variants", default="redux,select,select+fused", help="comma-separated; each atoms joined "
                    f"by '+' ({', '.join(f'{a} = {n}' for a, n in ATOMS.items())})")
    ap.add_argument("--imposed", action="store_true", help="the point's imposed routing (as the bars measure; the "
                    "route kernel's forced branch, which redux leaves alone) instead of the router's own choices")
    ap.add_argument("--json", default=None, help="also write {point: {variant: median us}} here")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if not {a for v in variants for a in v.split("+")} <= set(ATOMS):
        raise SystemExit(f"--variants: {args.variants!r}; atoms: {', '.join(ATOMS)}")

    table = {}
    for pt, served in served_ab_points(args, ", ".join(f"{a} = {n}" for a, n in ATOMS.items()) +
                                       (" (imposed routing)" if args.imposed else " (the router's own routing)")):
        for b in served:  # the router's own choices (random weights: near uniform) unless --imposed: an imposed
            b.force_top = pt.top if args.imposed else None  # routing runs the route's forced branch (no redux)
        blocks = {"off": [Switched(b, ()) for b in served],
                  **{v: [Switched(b, switches(v)) for b in served] for v in variants}}
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
