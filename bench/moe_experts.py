"""The routed-expert part of the MoE block alone, kernel against kernel, side by side in one run: the
CUDA-core grouped GEMVs (k3tune/kernels/moe_experts.py) and the tensor-core grouped kernels
(k3tune/kernels/moe_experts_tc.py) with bf16 experts, and the tensor-core kernels with MXFP4 experts.

    python bench/moe_experts.py [--tps 16,8] [--batches 8,16,32,64] [--routings uniform,zipf:1.2]
                                [--variants cc_p1,tc_a_mxfp4] [--tc 'NAME=mt,wn,wk,nt,u[,early[,rl[,dq[,pf[,ring]]]]]/...;...']
                                [--profile]

--tc adds tensor-core variants (w13 config / w2 config, TcExpertConfig's fields in order), each run with bf16 and
MXFP4 experts as ``NAME_bf16`` and ``NAME_mxfp4``.

Each variant runs route (imposed routing) + w13/SiTU + w2 + slot sum/RMSNorm in a CUDA graph over ``--layers``
layers of distinct expert weights (read from HBM), after a warm-up; median and IQR per layer. The roofline
floor is the bytes of the distinct experts selected (codes + scales for MXFP4) over the measured copy
bandwidth. Runs from bench/ (like bench/moe.py). Prints a table; JSON to --out.

--profile: no timing; each variant's step runs once to warm up, then once eagerly inside NVTX ranges
``profile`` > ``<variant>`` for Nsight Compute, e.g. (from bench/, one configuration):
    ncu --clock-control none --nvtx --nvtx-include "profile/" --print-nvtx-rename kernel --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        python3 moe_experts.py --tps 16 --batches 64 --routings uniform --layers 1 --variants tc_a_mxfp4 --profile
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
from pathlib import Path

import torch
from gemm import copy_bandwidth, profile_once  # bench/gemm.py

from k3tune.kernels import moe_experts, moe_experts_tc, mxfp4
from k3tune.kernels.moe_experts import ExpertKernelConfig, Groups
from k3tune.kernels.moe_experts_tc import TcExpertConfig
from k3tune.plan import routing as routings
from k3tune.runtime.moe import BlockShape
from k3tune.search.measure_gpu import time_graph
from k3tune.shipped import configs_dir

CUDA_CORE = {  # name: (w13 config, w2 config, tokens per item)
    "cc_p1": (ExpertKernelConfig(4, 4, 4), ExpertKernelConfig(4, 4, 1, 8), 1),
    "cc_p2": (ExpertKernelConfig(4, 4, 4), ExpertKernelConfig(4, 4, 1, 8), 2),
}
TENSOR_CORE = {  # name: (w13 config, w2 config)
    "tc_a": (TcExpertConfig(1, 2, 2, 1, 2), TcExpertConfig(1, 4, 1, 1, 2)),
    "tc_b": (TcExpertConfig(1, 4, 1, 1, 4), TcExpertConfig(2, 2, 1, 1, 2)),
    "tc_c": (TcExpertConfig(2, 2, 2, 2, 2), TcExpertConfig(1, 4, 1, 2, 2)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tps", default="16,8")
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--routings", default="uniform,zipf:1.2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--out", default="bench-moe-experts.json")
    ap.add_argument("--variants", default="", help="only these variants (comma-separated names)")
    ap.add_argument("--tc", default="", help="extra tensor-core variants: NAME=w13 knobs/w2 knobs, ';'-separated")
    ap.add_argument("--profile", action="store_true", help="run each step eagerly in an NVTX range, no timing")
    args = ap.parse_args()
    tensor_core = dict(TENSOR_CORE) | dict(_parse_tc(t) for t in args.tc.split(";") if t)
    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for tp in (int(t) for t in args.tps.split(",")):
        inter = sh.inter // tp
        layers = []
        for i in range(args.layers):
            g = torch.Generator(device="cuda").manual_seed(i)
            w13 = (torch.randn(sh.experts, 2 * inter, sh.latent, device="cuda", generator=g) / 60).to(torch.bfloat16)
            w2 = (torch.randn(sh.experts, sh.latent, inter, device="cuda", generator=g) / 20).to(torch.bfloat16)
            layers.append({"bf16": (w13, w2), "mxfp4": (mxfp4.quantize(w13), mxfp4.quantize(w2))})
        norm = torch.ones(sh.latent, dtype=torch.bfloat16, device="cuda")
        for batch in (int(b) for b in args.batches.split(",")):
            for routing in args.routings.split(","):
                ids = routings.sample(routing, sh.experts, sh.top_k, batch, random.Random(batch))
                top = torch.tensor(ids, dtype=torch.int32, device="cuda")
                touched = len({e for r in ids for e in r})
                y = torch.randn(batch, sh.experts + sh.latent, device="cuda").to(torch.bfloat16)
                x = y[:, sh.experts:].contiguous()
                row = {"tp": tp, "batch": batch, "routing": routing, "touched": touched}
                floors = {"bf16": touched * 3 * inter * sh.latent * 2 / bw * 1e6,
                          "mxfp4": touched * (mxfp4.nbytes(2 * inter, sh.latent) + mxfp4.nbytes(sh.latent, inter))
                          / bw * 1e6}
                variants = [(n, "bf16", v) for n, v in CUDA_CORE.items()]
                variants += [(f"{n}_{f}", f, v) for n, v in tensor_core.items() for f in ("bf16", "mxfp4")]
                if args.variants:
                    variants = [x for x in variants if x[0] in args.variants.split(",")]
                for name, fmt, v in variants:
                    if args.profile:
                        step = _step(layers, fmt, v, y, x, top, norm, sh, batch)
                        profile_once(lambda: step(None), name)
                        continue
                    row[name] = timed(name, lambda layers=layers: _step(layers, fmt, v, y, x, top, norm, sh, batch),
                                      len(layers), args.samples, floors[fmt])
                print(f"tp{tp:<3} batch {batch:<3} {routing:9} experts {touched:4} | " +
                      " ".join(f"{k} {v['us']:6.1f} ({v['roof']:.2f})" for k, v in row.items()
                               if isinstance(v, dict) and "us" in v), flush=True)
                rows.append(row)
        del layers
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows},
                                         indent=1))


def timed(name: str, make_step, layers: int, samples: int, floor_us: float) -> dict:
    """One variant's graph (``make_step()``'s step over ``layers`` layers) timed: median and IQR per layer and the
    fraction of ``floor_us``; a variant that cannot be built or run is reported, not fatal."""
    try:
        t = time_graph(make_step(), [{}], samples)
    except Exception as e:
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return {"failed": f"{type(e).__name__}: {str(e)[:200]}"}
    t = [v / layers for v in t]
    q = statistics.quantiles(t, n=4)
    return {"us": statistics.median(t), "iqr": q[2] - q[0], "roof": floor_us / statistics.median(t)}


def _parse_tc(text: str) -> tuple:
    name, cfgs = text.split("=")
    a, b = (TcExpertConfig(*(int(v) for v in c.split(","))) for c in cfgs.split("/"))
    return name, (a, b)


def _step(layers, fmt, v, y, x, top, norm, sh, batch):
    """One graph launch: every layer's route (imposed) + w13 + w2 + slot sum/RMSNorm (which resets the groups)."""
    tc = isinstance(v[0], TcExpertConfig)
    per = min(v[0].tokens, v[1].tokens) if tc else v[2]
    k, inter = sh.top_k, layers[0]["bf16"][1].shape[2]
    bufs = [dict(groups=Groups.allocate(sh.experts, batch, k, per, "cuda"), top=top.clone(),
                 wts=torch.empty(batch, k, device="cuda"),
                 act=torch.empty(batch * k, inter, dtype=torch.bfloat16, device="cuda"),
                 out=torch.empty(batch * k, sh.latent, device="cuda"),
                 normed=torch.empty(batch, sh.latent, dtype=torch.bfloat16, device="cuda")) for _ in layers]
    if tc and fmt == "mxfp4" and (v[0].dq or v[1].dq):  # the codes as dq = 1 kernels decode them: packed once a layer,
        for lay in layers:  # on the first variant that needs them, never inside a capture
            if "mxfp4_dq" not in lay:
                lay["mxfp4_dq"] = tuple((moe_experts_tc.pack_codes(c), s) for c, s in lay["mxfp4"])

    def run(_):
        for lay, b in zip(layers, bufs):
            moe_experts.route(y, _bias(sh.experts), b["top"], b["wts"], k, 1.0, b["groups"], forced=True)
            w13, w2 = lay[fmt]
            if not tc:
                moe_experts.run_w13(v[0], x, w13, b["act"], b["wts"], b["groups"], 4.0, 25.0)
                moe_experts.run_w2(v[1], b["act"], w2, b["out"], b["wts"], b["groups"])
            elif fmt == "bf16":
                moe_experts_tc.run_w13(v[0], x, w13, b["act"], b["wts"], b["groups"], 4.0, 25.0)
                moe_experts_tc.run_w2(v[1], b["act"], w2, b["out"], b["wts"], b["groups"])
            else:
                w13, w2 = lay["mxfp4_dq" if v[0].dq else "mxfp4"][0], lay["mxfp4_dq" if v[1].dq else "mxfp4"][1]
                moe_experts_tc.run_w13(v[0], x, w13[0], b["act"], b["wts"], b["groups"], 4.0, 25.0, scales=w13[1])
                moe_experts_tc.run_w2(v[1], b["act"], w2[0], b["out"], b["wts"], b["groups"], scales=w2[1])
            moe_experts.sum_norm(b["out"], norm, b["normed"], k, 1e-5, b["groups"])
    return run


@functools.cache
def _bias(n: int):
    return torch.zeros(n, device="cuda")  # imposed routing: the bias is never read


if __name__ == "__main__":
    main()
