"""The shared experts beside the routed ones, measured three ways against the served block (the database's pick):

- ``high``: the same block whose shared-expert green-context stream was made at the device's greatest stream
  priority. Why (s35-r2 profiles): with ``routed_on = all`` the routed kernels may run on every SM, the shared
  partition's included; a shared kernel (SiTU, w2) waits for SM room there until routed CTAs (PDL dependents
  resident early among them) leave, e.g. 12 us between the shared w13's end and its SiTU's start at bf16 TP16 b1.
  torch instantiates graphs with ``cudaGraphInstantiateFlagUseNodePriority``, so a kernel node keeps the priority
  of the stream it was captured on, and the block scheduler gives freed SM room to the higher priority first.
  The library is not edited for this (runtime/partition.py is part of every block winner's key): the variant
  patches ``cuGreenCtxStreamCreate``'s priority argument while its split is made, into a split cache of its own.
  s35-r3: neutral to 3% slower.
- ``split``: where the served block is serial, its knobs with the shared experts on ``--split`` SMs, the routed
  ones on all SMs as every split winner has them (bench/moe.py's ``served_knobs``), at default priority (and at the
  greatest too, with ``high``): can a split beat serial where the tuner found none that did?
- ``noshared``: the served block with its shared experts replaced by a zero tensor made once (no kernel): a bound,
  not a block — what the block would take if the shared experts cost nothing, so the most a better shared-expert
  schedule or kernel could win.

s37-r1 measured where the shared experts' stream forks (with the block, after the router GEMM, before the slot sum)
and a plain side stream with variants of this script at 9ae47d4; the library now forks after the router GEMM and
offers the plain stream as ``shared_sms = "all"``.

    cd bench && python3 shared_ab.py --points mxfp4:8:1,mxfp4:8:8,bf16:16:1 [--variants high,split,noshared]
                                     [--rounds 3] [--samples 15]

A point is format:tp:batch (uniform routing; the model is K3's for mxfp4, the bf16-expert config for bf16). The
variants alternate, ``--rounds`` times each, so drift falls on all; the table gives each variant's median of its
rounds' medians, its ratio to the served block and its fraction of the block's roofline (bench/moe.py's bytes).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from gemm import copy_bandwidth  # bench/gemm.py (this script runs from bench/)
from moe import ServedPoint, ab_cells, alternate, served_knobs

from k3tune.runtime import partition
from k3tune.runtime.moe import BlockShape, MoEBlock
from k3tune.shipped import configs_dir

_CACHES: dict[str, dict] = {"default": partition._CACHE, "high": {}}


@contextlib.contextmanager
def stream_priority(variant: str):
    """Splits made inside come from ``variant``'s cache; in ``high``, their streams at the greatest priority."""
    from cuda.bindings import driver

    saved_cache, create = partition._CACHE, driver.cuGreenCtxStreamCreate
    partition._CACHE = _CACHES[variant]
    if variant == "high":
        err, _least, greatest = driver.cuCtxGetStreamPriorityRange()
        assert err == driver.CUresult.CUDA_SUCCESS, err
        driver.cuGreenCtxStreamCreate = lambda ctx, flags, _priority: create(ctx, flags, greatest)
    try:
        yield
    finally:
        partition._CACHE, driver.cuGreenCtxStreamCreate = saved_cache, create


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="mxfp4:8:1,mxfp4:8:8,bf16:16:1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--db", default=None)
    ap.add_argument("--split", type=int, default=32, help="SMs for the forced split of a serial served block")
    ap.add_argument("--variants", default="high,split,noshared", help="beside the served block: any of high, split, "
                    "noshared (see the module doc)")
    args = ap.parse_args()

    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; served blocks, uniform routing, "
          f"stand-ins timed by gb300 NVLink; shared-expert stream at default vs greatest priority")
    for point in args.points.split(","):
        pt = ServedPoint.make(point, sh, bw, args.db, args.layers)
        served = MoEBlock.serve(pt.layers[0], pt.sel, pt.batch, comm=pt.comm)
        want = set(args.variants.split(",")) - {""}
        if want - {"high", "split", "noshared"}:
            raise SystemExit(f"error: --variants: unknown {sorted(want - {'high', 'split', 'noshared'})}")
        prios = ["default"] + (["high"] if "high" in want else [])
        variants = [("served", None, p) for p in prios]
        if served.ran["shared"].startswith("serial") and "split" in want:
            variants += [(f"split{args.split}", args.split, p) for p in prios]
        if "noshared" in want:
            variants.append(("noshared", None, "default"))
        zeros = torch.zeros(pt.batch, sh.hidden, device="cuda", dtype=torch.bfloat16)
        del served
        blocks = {}
        for name, sms, prio in variants:
            with stream_priority(prio):
                knobs = None if sms is None else served_knobs(pt.sel, pt.tp, pt.batch, sms, routed_on="all")
                blocks[name, prio] = [MoEBlock.serve(w, pt.sel, pt.batch, comm=pt.comm) if knobs is None else
                                      MoEBlock.build(w, "tuned", batch=pt.batch, selector=pt.sel, comm=pt.comm,
                                                     **knobs)
                                      for w in pt.layers]
            for b in blocks[name, prio]:
                b.force_top = pt.top
                if name == "noshared":
                    b._shared = lambda _x: zeros  # the shared experts' output, made once: no kernel
        meds = alternate(blocks, pt.x, args.rounds, args.samples)
        cells = ab_cells(meds, ("served", "default"), pt.floor_us, name=lambda v: f"{v[0]}/{v[1]}")
        first = blocks["served", "default"][0].ran
        print(pt.label() + " | " + " | ".join(cells) + f" | served shared: {first['shared']}", flush=True)
        del blocks, pt
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
