"""Do the collective stand-ins last the time the link model says? Two measurements in one run.

1. ``--spin``: the fused all-reduce stand-in (``moe_experts.reduce_add_rows`` on one token), 20 launches a graph
   replay, with 0, 1x and 2x the model's 4 us of spin cycles (``EmulatedComm.cycles`` counts SM clock cycles at
   the H200's 1.98 GHz boost clock): the slope is the spin's real length, so the SM clock it ran at.
2. The served block (the shipped winner's knobs, uniform routing imposed) with the stand-ins' start-up latency at
   0, 4 (``links.LATENCY_US``: what every block winner was measured with) and 8 us, side by side: the block's cost
   of one modelled microsecond a collective (three collectives a block: the router's all-gather, the routed
   all-reduce, the final all-reduce with the residual add). A slope near 3 us per modelled us says the stand-ins
   are exact and sit on the block's critical path; above it, the spin runs on a clock slower than 1.98 GHz.

    cd bench && python3 standin_ab.py --points bf16:16:1,mxfp4:16:1,bf16:8:8 [--lat 0,4,8] [--spin]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from moe import ab_cells, alternate, served_ab_args, served_ab_points  # bench/moe.py (this script runs from bench/)

from k3tune.kernels import moe_experts
from k3tune.plan import links
from k3tune.runtime.moe import EmulatedComm, MoEBlock
from k3tune.search.measure_gpu import time_graph


def spin_check(samples: int) -> None:
    x = torch.randn(1, 7168, device="cuda").to(torch.bfloat16)
    base, out = torch.randn_like(x), torch.empty_like(x)
    per_us = EmulatedComm.for_target("gb300", 16).cycles(0) / links.LATENCY_US  # cycles the model gives 1 us
    n = 20
    meds = {}
    for mult in (0, 1, 2):
        cyc = int(mult * links.LATENCY_US * per_us)
        t = time_graph(lambda _: [moe_experts.reduce_add_rows(x, base, out, 16, cycles=cyc) for _ in range(n)],
                       [{}], samples)
        meds[mult] = statistics.median(t) / n
        print(f"# spin {cyc:6d} cycles ({mult * links.LATENCY_US:.0f} modelled us): {meds[mult]:.3f} us a launch "
              f"(spread {min(t) / n:.3f}-{max(t) / n:.3f})", flush=True)
    us = (meds[2] - meds[0]) / 2  # the real length of the model's 4 us
    print(f"# one modelled {links.LATENCY_US:.0f} us of spin lasts {us:.3f} us: the SM clock ran at "
          f"{per_us * links.LATENCY_US / us / 1e3:.3f} GHz while spinning", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    served_ab_args(ap, "bf16:16:1,mxfp4:16:1,bf16:8:8")
    ap.add_argument("--lat", default="0,4,8", help="stand-in start-up latencies (us) beside each other")
    ap.add_argument("--spin", action="store_true", help="first the spin kernel alone (the SM clock it spins at)")
    args = ap.parse_args()
    lats = [float(v) for v in args.lat.split(",")]
    if links.LATENCY_US not in lats or len(lats) < 2:
        raise SystemExit(f"--lat must hold the model's {links.LATENCY_US} us and at least one other latency")
    if args.spin:
        spin_check(args.samples)

    for pt, served in served_ab_points(args, "latN = the stand-ins' start-up latency N us (the model's: "
                                       f"{links.LATENCY_US:.0f})"):
        blocks = {}
        for lat in lats:
            if lat == links.LATENCY_US:
                blocks[f"lat{lat:g}"] = served  # served with the model's link already
            else:
                comm = EmulatedComm.for_target("gb300", pt.tp, latency_us=lat)
                blocks[f"lat{lat:g}"] = [MoEBlock.serve(w, pt.sel, pt.batch, comm=comm) for w in pt.layers]
            for b in blocks[f"lat{lat:g}"]:
                b.force_top = pt.top
        ref = served[0](pt.x).clone()
        for v, blk in blocks.items():
            out = blk[0](pt.x)
            if not torch.equal(out, ref):  # the stand-ins' spin changes no number
                raise SystemExit(f"{pt.label()}: {v} differs from the served block")
        meds = alternate(blocks, pt.x, args.rounds, args.samples)
        lo, hi = min(lats), max(lats)
        slope = (statistics.median(meds[f"lat{hi:g}"]) - statistics.median(meds[f"lat{lo:g}"])) / (hi - lo)
        print(pt.label() + f" | block us per modelled us: {slope:.2f} | " +
              " | ".join(ab_cells(meds, f"lat{links.LATENCY_US:g}", pt.floor_us)), flush=True)
        del blocks, served, pt


if __name__ == "__main__":
    main()
