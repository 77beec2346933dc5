"""KDA o_proj + TP all-reduce + residual add (+ the next RMSNorm) on a TP group of this machine's GPUs, side
by side in one run, batch 1..64:

  unfused_nccl    projection, NCCL all-reduce, add (+ torch RMSNorm): what a stock engine runs
  symm_one_shot   projection into symmetric memory, torch's one-shot all-reduce, add (+ norm)
  symm_two_shot   projection into symmetric memory, torch's two-shot all-reduce (in place), add (+ norm)
  fused_one_shot  projection into symmetric memory, barrier, k3tune's one-shot all-reduce + residual (+ norm)
                  kernel (k3tune/kernels/allreduce.py): one launch after the projection

    python bench/allreduce.py [--gpus 2] [--batches 1,2,4,8,16,32,64] [--model-tp 8] [--norm] [--out F]

One process per GPU (spawned), NCCL with NVLS off and no multicast anywhere (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). The projection is the per-rank o_proj of a
``--model-tp`` deployment (K = 12288 / tp, N = 7168) with ``--layers`` distinct weights (read from HBM); the
collective runs on the ``--gpus`` ranks present. Each variant is first checked against an fp32 reference
(all-gathered partial products summed + residual), then timed in a CUDA graph of all layers after a
warm-up, all ranks replaying together; a variant's time per layer is the slowest rank's median. A variant
that fails is reported on every rank and skipped. Rank 0 prints the table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

N_HIDDEN, KDA_VALUE = 7168, 12288
VARIANTS = ("unfused_nccl", "symm_one_shot", "symm_two_shot", "fused_one_shot")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--model-tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--norm", action="store_true", help="also the next RMSNorm (fused: in the same launch)")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--out", default="bench-allreduce.json")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    mp.spawn(_rank_main, args=(args.gpus, args), nprocs=args.gpus, join=True)


def _rank_main(rank: int, world: int, args) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    try:
        rows = [_one_batch(rank, world, args, m, dev) for m in (int(b) for b in args.batches.split(","))]
    finally:
        dist.barrier()
    if rank == 0:
        for r in rows:
            base = r.get("unfused_nccl", {}).get("us")
            print(f"group {world} M {r['M']:<3} " + " ".join(
                f"{v} {r[v]['us']:6.1f}" + (f" x{base / r[v]['us']:.2f}" if base else "") if "us" in r[v]
                else f"{v} FAILED" for v in VARIANTS), flush=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "group": world,
                                              "model_tp": args.model_tp, "norm": args.norm, "rows": rows},
                                             indent=1))
    dist.destroy_process_group()


def _one_batch(rank: int, world: int, args, m: int, dev) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from k3tune.kernels import allreduce
    from k3tune.search.measure_gpu import time_graph

    k = KDA_VALUE // args.model_tp
    group = dist.group.WORLD.group_name
    g = torch.Generator(device=dev).manual_seed(1000 * rank + m)
    ws = [(torch.randn(N_HIDDEN, k, device=dev, generator=g) / k ** 0.5).to(torch.bfloat16) for _ in range(args.layers)]
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    res = torch.randn(m, N_HIDDEN, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).to(torch.bfloat16)
    norm_w = torch.ones(N_HIDDEN, dtype=torch.bfloat16, device=dev)
    buf = symm_mem.empty((2, m, N_HIDDEN), dtype=torch.bfloat16, device=dev)
    hdl = symm_mem.rendezvous(buf, group)
    peers = [[hdl.get_buffer(r, (2, m, N_HIDDEN), torch.bfloat16)[s] for r in range(world)] for s in range(2)]
    out = torch.empty(m, N_HIDDEN, dtype=torch.bfloat16, device=dev)
    normed = torch.empty_like(out)

    def rmsnorm(h):
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * norm_w

    def step(variant: str, layer: int):
        s, w = layer % 2, ws[layer]
        if variant == "unfused_nccl":
            y = torch.mm(x, w.t())
            dist.all_reduce(y)
            h = res + y
            return h, (rmsnorm(h) if args.norm else None)
        torch.mm(x, w.t(), out=buf[s])
        if variant == "symm_one_shot":
            h = res + torch.ops.symm_mem.one_shot_all_reduce(buf[s], "sum", group)
        elif variant == "symm_two_shot":
            torch.ops.symm_mem.two_shot_all_reduce_(buf[s], "sum", group)
            h = res + buf[s]
        else:
            hdl.barrier(channel=0)
            allreduce.one_shot(peers[s], res, out, norm_w if args.norm else None, normed if args.norm else None)
            return out, (normed if args.norm else None)
        return h, (rmsnorm(h) if args.norm else None)

    # the fp32 reference of layer 0: every rank's partial product, all-gathered, summed in rank order
    part = torch.mm(x.float(), ws[0].float().t())
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part)
    ref = res.float() + sum(parts)
    ref_n = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6)
    row = {"M": m, "K": k}
    for variant in VARIANTS:
        try:
            h, n = step(variant, 0)
            torch.cuda.synchronize()
            err = ((h.float() - ref).norm() / ref.norm()).item()
            if n is not None:
                err = max(err, ((n.float() - ref_n).norm() / ref_n.norm()).item())
            ok = err < 2e-2
            failure = None if ok else f"wrong result: relative error {err:.3g}"
        except Exception as e:  # reported on every rank, then skipped
            failure = f"{type(e).__name__}: {str(e)[:200]}"
        failures = [None] * world
        dist.all_gather_object(failures, failure)
        if any(failures):
            row[variant] = {"failed": next(f for f in failures if f)}
            continue
        dist.barrier()
        try:  # capture can fail where eager runs did (a collective that is not graph-safe): same on every rank
            times = time_graph(lambda _, v=variant: [step(v, i) for i in range(args.layers)], [{}], args.samples)
            med = statistics.median(times) / args.layers
        except Exception as e:
            med = f"{type(e).__name__}: {str(e)[:200]}"
        meds = [None] * world
        dist.all_gather_object(meds, med)
        if any(isinstance(v, str) for v in meds):
            row[variant] = {"failed": next(v for v in meds if isinstance(v, str))}
            continue
        row[variant] = {"us": max(meds), "per_rank_us": meds}
    return row


if __name__ == "__main__":
    main()
