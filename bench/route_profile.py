"""Where the top-k's time goes: the route kernel alone (a quiet GPU, CUDA graph) and inside the served block
(torch.profiler over graph replays: the shared experts run beside it), per top-k variant of chain_ab.py, on the
gathered rows of the point's own router GEMM. Also counts the select route's candidates (its bound admits; over 32
it falls back to the redux rounds) for the router's own scores.

    cd bench && python3 route_profile.py --points bf16:16:1 [--measured-on h200]

``--profile``: each variant's route launched once alone inside an NVTX range ``route-<variant>`` nested in a range
``profile``, nothing timed, for Nsight Compute (as bench/ncu_session.sh runs it), e.g.
    cd bench && ncu --nvtx --nvtx-include profile/ --print-nvtx-rename kernel --section WarpStateStats \
        --section InstructionStats --section SchedulerStats python3 route_profile.py --profile --measured-on h200
"""

from __future__ import annotations

import argparse
import statistics

import torch
from chain_ab import Switched, switches
from moe import served_ab_args, served_ab_points  # bench/moe.py (this script runs from bench/)

from k3tune.kernels import moe_experts
from k3tune.search.measure_gpu import time_graph

VARIANTS = ("off", "topk", "topk+select", "topk+select+late", "select", "select+late")  # off, topk*: imposed


def candidates(y, bias, k):
    s = torch.sigmoid(y[:, :bias.shape[0]].float()) + bias
    e = s.shape[1]
    pad = torch.full((s.shape[0], -(-e // 32) * 32), float("-inf"), device=s.device)
    pad[:, :e] = s
    bound = torch.topk(pad.view(s.shape[0], -1, 32).amax(1), k, dim=-1).values[:, -1:]
    return (s >= bound).sum(-1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    served_ab_args(ap, "bf16:16:1")
    ap.add_argument("--profile", action="store_true", help="one launch a variant in an NVTX range, nothing timed")
    args = ap.parse_args()
    for pt, served in served_ab_points(args, "route kernel alone and in the block"):
        blk = served[0]
        w, shape, c = blk.weights, blk.weights.shape, blk._cache
        y = blk.comm.all_gather(blk._gemms["moe.router_latent"](pt.x)).contiguous()
        print(f"{pt.label()} | select candidates per token: {candidates(y, w.bias, shape.top_k)}", flush=True)
        for v in VARIANTS:
            imposed = v == "off" or v.startswith("topk")  # the others: the router's own routing
            names = () if v == "off" else switches(v)
            top = pt.top.clone() if imposed else torch.zeros_like(c["top"])
            grp = moe_experts.Groups.allocate(shape.experts, y.shape[0], shape.top_k, c["groups"].per, y.device)
            wts = torch.empty_like(c["wts"])

            def run(_):
                grp.counts.zero_()
                moe_experts.route(y, w.bias, top, wts, shape.top_k, shape.scaling, grp, forced=imposed)

            Switched(lambda _x: [run(None) for _ in range(2)], names)(None)  # compile outside the capture
            if args.profile:
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("profile")  # ncu --nvtx-include profile/ takes what runs inside
                torch.cuda.nvtx.range_push(f"route-{v}")
                Switched(run, names)(None)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                torch.cuda.nvtx.range_pop()
                continue
            alone = statistics.median(Switched(lambda _x: time_graph(run, [{}], args.samples), names)(None))
            wrapped = Switched(blk, names)
            blk.force_top = pt.top if imposed else None
            wrapped(pt.x)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                wrapped(pt.x)
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    g.replay()
                torch.cuda.synchronize()
            inside = [e.time_range.elapsed_us() for e in prof.events()
                      if "Route" in e.name and str(e.device_type).endswith("CUDA")]
            print(f"  {v:12s} route alone {alone:6.2f} us (with a counts memset) | in the block "
                  f"{statistics.median(inside) if inside else float('nan'):6.2f} us ({len(inside)} launches)",
                  flush=True)
        del served, pt


if __name__ == "__main__":
    main()
