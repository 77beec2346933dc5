"""The MoE block in a real TP group, one GPU a rank, against the same block with the one-GPU emulation's collectives:
how well the stand-ins' link model (k3tune.plan.links: a latency plus bytes over the NVLink bandwidth) stands for this
machine's collectives, and the served block's time with real ones (issue 5: the emulated all-reduce gives way to the
measured one).

    python bench/moe_group.py --gpus 8 [--batches 1,8,64] [--fmt bf16] [--routing uniform] [--out bench-moe-group.json]

Rank r runs on GPU r (NCCL, NVLink multicast off) with its own shards of ``--layers`` random layers (distinct weights:
decode reads them from HBM), each served as the database's moe.block choice for tp = N (``MoEBlock.serve`` with
``GroupComm``), the routing imposed and the same on every rank. A step through every layer is timed in a CUDA graph
(the NCCL collectives captured in it, as the measurer times blocks); the block's time is the slowest rank's median.
Then rank 0 alone times the same blocks with ``EmulatedComm.for_target(<this GPU>, N)`` (its own shards standing for
every rank's, the stand-ins spinning the modelled link time) while the others wait. ``--device cpu``: gloo ranks on
the CPU, one eager step each, no timing: the script checked end to end (tests/test_tp_group.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe import bench_weights  # bench/moe.py (this script runs from bench/)

from k3tune.plan import model as models
from k3tune.plan import routing as routings
from k3tune.runtime import Selector
from k3tune.runtime.moe import BlockShape, EmulatedComm, MoEBlock
from k3tune.runtime.tp_group import GroupComm
from k3tune.shipped import configs_dir


def _rank(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    gpu = args.device == "cuda"
    if gpu:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=args.gpus, device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=args.gpus)
    try:
        rows = run(rank, args, gpu)
        if rank == 0:
            Path(out).write_text(json.dumps({"ranks": args.gpus, "device": args.device, "rows": rows}, indent=1))
    finally:
        dist.destroy_process_group()


def run(rank: int, args, gpu: bool) -> list[dict]:
    from k3tune.plan.hardware import detect

    tp, dev = args.gpus, ("cuda" if gpu else "cpu")
    sh = BlockShape.from_config(args.config or configs_dir() / "kimi_k3_config.json")
    model = models.load(configs_dir() / args.model)
    sel = Selector.load(args.db, model=model, routing=args.routing)
    layers = [bench_weights(sh, tp, args.fmt, seed=i, device=dev, rank=rank) for i in range(args.layers)]
    comm = GroupComm()
    found = detect() if gpu else None
    link = found[1].key if found and found[1] else None  # this GPU's NVLink figure for the stand-ins
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ids = routings.sample(args.routing, sh.experts, sh.top_k, batch, random.Random(batch))
        top = torch.tensor(ids, device=dev, dtype=torch.int32)
        x = torch.randn(batch, sh.hidden, generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16).to(dev)
        blocks = [MoEBlock.serve(w, sel, batch, comm=comm) for w in layers]
        for b in blocks:
            b.force_top = top
        row = {"tp": tp, "batch": batch, "routing": args.routing, "fmt": args.fmt, "ran": blocks[0].ran}
        if not gpu:  # the smoke run: one eager step, every rank's output the same
            y = blocks[0](x)
            every = comm.gather(y)
            row["ranks_agree"] = all(torch.equal(every[0], o) for o in every)
            rows.append(row)
            continue
        from k3tune.search.measure_gpu import time_graph

        t = [v / len(blocks) for v in time_graph(lambda _: [b(x) for b in blocks], [{}], args.samples)]
        medians = [None] * tp
        dist.all_gather_object(medians, statistics.median(t))
        row["real_us"], row["real_us_by_rank"] = max(medians), medians
        blocks = []  # this batch's blocks freed before the emulation (a del confuses pyflakes in this loop)
        if rank == 0 and link:  # the emulation of the same layers on this GPU alone, its stand-ins timed by the model
            emu = EmulatedComm.for_target(link, tp)
            eblocks = [MoEBlock.serve(w, sel, batch, comm=emu) for w in layers]
            for b in eblocks:
                b.force_top = top
            et = [v / len(eblocks) for v in time_graph(lambda _: [b(x) for b in eblocks], [{}], args.samples)]
            row["emulated_us"], row["emulated_label"] = statistics.median(et), emu.label
            row["real_over_emulated"] = row["real_us"] / row["emulated_us"]
            del eblocks
        dist.barrier()
        if rank == 0:
            print(f"tp{tp} batch {batch:<3} {args.routing:10} {args.fmt}: real {row['real_us']:7.1f} us (ranks "
                  f"{min(medians):.1f}-{max(medians):.1f})" + (f", emulated {row['emulated_us']:7.1f} us, real/emulated "
                  f"{row['real_over_emulated']:.3f}" if "emulated_us" in row else ""), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=None, help="ranks, one GPU each (default: every visible GPU)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--fmt", default="bf16", choices=("bf16", "mxfp4"))
    ap.add_argument("--model", default=None, help="the model whose moe.block winners are served (configs/; default: "
                    "kimi_k3_bf16_experts.json for --fmt bf16, kimi_k3_config.json for mxfp4)")
    ap.add_argument("--config", default=None, help="the block's shapes from this config.json (default: K3's)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--db", default=None, help="tuning database (default: the shipped one for this GPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default="bench-moe-group.json")
    args = ap.parse_args()
    args.model = args.model or ("kimi_k3_bf16_experts.json" if args.fmt == "bf16" else "kimi_k3_config.json")
    if args.gpus is None:
        args.gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.gpus < 2 or (args.device == "cuda" and args.gpus > torch.cuda.device_count()):
        raise SystemExit(f"error: --gpus {args.gpus}: a TP group needs 2 or more ranks"
                         + (f", one GPU each ({torch.cuda.device_count()} visible)" if args.device == "cuda" else ""))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port, args.out), nprocs=args.gpus, join=True)
    print(Path(args.out).read_text() if args.device == "cpu" else f"wrote {args.out}")


if __name__ == "__main__":
    main()
