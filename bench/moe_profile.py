"""Where the MoE block's time goes: one CUDA-graph replay of a layer's block under the torch profiler, each
kernel with its start (relative to the first) and duration, in start order, so the critical path and the
side stream's overlap can be read off.

    python bench/moe_profile.py [--tp 16] [--batches 1] [--paths tuned] [--shared-sms 0] [--prefetch-mib 0]
                                [--fmt bf16|mxfp4] [--served]

--served profiles the block as serving builds it from the database's ``moe.block`` winner (every knob, the SM
split included; --paths, --cfgs, --shared-sms and --prefetch-mib are then ignored); --served-pdl 0|1 the same knobs
with PDL forced off or on, --served-prefetch MIB with that L2 prefetch size; --current-keys serves the shipped winners
on this tree's code where it changed since they were measured.

Runs from bench/ like bench/moe.py (uniform routing imposed, GB300 collective stand-ins).
"""

from __future__ import annotations

import argparse
import os
import random

import torch

from moe import bench_weights, current_block_keys, served_knobs  # bench/moe.py (this script runs from bench/)

from k3tune.kernels.moe_experts import ExpertKernelConfig
from k3tune.plan import model as models
from k3tune.plan import routing as routings
from k3tune.runtime import Selector
from k3tune.runtime.moe import BlockShape, EmulatedComm, MoEBlock
from k3tune.shipped import configs_dir, tuning_db_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--paths", default="tuned")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--shared-sms", type=int, default=0)
    ap.add_argument("--prefetch-mib", type=int, default=0)
    ap.add_argument("--link", default="gb300")
    ap.add_argument("--fmt", default="bf16", help="routed-expert weight format: bf16 or mxfp4")
    ap.add_argument("--served", action="store_true", help="the served block (MoEBlock.serve) instead of --paths")
    ap.add_argument("--cfgs", default="", help="expert-kernel knob sets to compare, ';'-separated, each "
                    "'rows,warps,unroll/rows,warps,unroll/per' (w13/w2/tokens per item); empty: the default")
    ap.add_argument("--model", default="", help="the model whose winners --served looks up (default: the bf16-expert "
                    "config for --fmt bf16, K3's config for mxfp4, as the sweep specs key them)")
    ap.add_argument("--grep", default="", help="print only kernels whose name contains one of these (',')")
    ap.add_argument("--served-pdl", type=int, default=None, help="with --served: the winner's knobs with PDL forced "
                    "off (0) or on (1) instead of its own")
    ap.add_argument("--served-prefetch", type=int, default=None, help="with --served: the winner's knobs with this "
                    "L2 prefetch size (MiB) instead of its own")
    ap.add_argument("--current-keys", action="store_true", help="serve the shipped winners on this tree's code even "
                    "where it changed since they were measured (a temporary copy: moe.current_block_keys)")
    args = ap.parse_args()
    db = current_block_keys(str(tuning_db_dir() / "h200.sqlite")) if args.current_keys else None
    try:
        profile(args, db)
    finally:
        if db:
            os.unlink(db)


def profile(args, db) -> None:
    from k3tune.runtime.partition import shared_partition

    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    model = args.model or ("kimi_k3_bf16_experts.json" if args.fmt == "bf16" else "kimi_k3_config.json")
    sel = Selector.load(db, model=models.load(configs_dir() / model), routing=args.routing)
    # shared on n SMs, routed on the rest (--served takes the split from the winner instead)
    split = shared_partition(args.shared_sms) if args.shared_sms and not args.served else None
    layers = [bench_weights(sh, args.tp, args.fmt, seed=i) for i in range(4)]
    for batch in (int(b) for b in args.batches.split(",")):
        ids = routings.sample(args.routing, sh.experts, sh.top_k, batch, random.Random(batch))
        top = torch.tensor(ids, device="cuda", dtype=torch.int32)  # the kernels read it in place
        x = torch.randn(batch, sh.hidden, device="cuda").to(torch.bfloat16)
        cfgs = [None] + [parse_cfg(c) for c in args.cfgs.split(";") if c]
        runs = ([("served", None)] if args.served else
                [(p, c) for p in args.paths.split(",") for c in (cfgs if p == "tuned" else [None])])
        for path, cfg in runs:
            comm = EmulatedComm(args.tp) if args.link == "none" else EmulatedComm.for_target(args.link, args.tp)
            if path == "served":
                if args.served_pdl is None and args.served_prefetch is None:
                    blocks = [MoEBlock.serve(w, sel, batch, comm=comm) for w in layers]
                    label = blocks[0].ran["block"]
                else:
                    knobs = served_knobs(sel, args.tp, batch, pdl=args.served_pdl, prefetch_mib=args.served_prefetch)
                    blocks = [MoEBlock.build(w, "tuned", batch=batch, selector=sel, comm=comm, **knobs)
                              for w in layers]
                    label = (f"the served knobs, PDL {args.served_pdl}, prefetch {args.served_prefetch} MiB "
                             f"(None: the winner's own): {knobs}")
                print(f"\n# served: {label}; shared {blocks[0].ran['shared']}")
            else:
                blocks = [MoEBlock.build(w, path, batch=batch, selector=sel, prefetch_mib=args.prefetch_mib,
                                         shared_stream=split.shared.stream if split else None,
                                         routed_stream=split.rest.stream if split else None,
                                         comm=comm, experts_cfg=cfg) for w in layers]
            for b in blocks:
                b.force_top = top
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for b in blocks:
                    b(x)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for b in blocks:
                    b(x)
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                         and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
            t0 = ev[0].time_range.start
            per = len(ev) // len(blocks)
            last = ev[-1].time_range.end - t0
            print(f"\n## tp{args.tp} batch {batch} {path} {blocks[0].ran.get('experts', '')[:150]}: {len(ev)} "
                  f"kernels in 4 layers, {last / 4:.1f} us/layer; layer 3 of 4:")
            layer = ev[2 * per: 3 * per]
            base = layer[0].time_range.start
            print(f"  (the layer before ends at {max(e.time_range.end for e in ev[per: 2 * per]) - base:.1f})")
            for e in layer:
                if args.grep and not any(g in e.name for g in args.grep.split(",")):
                    continue
                print(f"  {e.time_range.start - base:8.1f} +{e.time_range.elapsed_us():7.1f}  {e.name[:90]}")
            del blocks, graph


def parse_cfg(text: str) -> tuple:
    a, b, per = text.split("/")
    return (ExpertKernelConfig(*(int(v) for v in a.split(","))), ExpertKernelConfig(*(int(v) for v in b.split(","))),
            int(per))


if __name__ == "__main__":
    main()
