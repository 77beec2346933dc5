"""The MXFP4 routed experts' w13 alone, kernel against kernel, side by side in one run: the shipped tensor-core w13
(``moe_experts_tc``, each point's DB winner config and work-item size) against the staged wgmma e4m3 w13
(``moe_experts_wg``, NOTES session 34), on the same imposed routing and the same layers of weights.

    python bench/moe_wg_ab.py --db ../tuning_db/h200.sqlite [--tps 8,16] [--batches 1,2,4,8,16,32,64]
                              [--routings uniform,zipf:1.2] [--wg 4/2/1,4/2/2] [--layers 4] [--out x.json]

Each variant's graph runs, per layer (``--layers`` layers of distinct weights, read from HBM): the groups reset, the
route kernel (imposed ids) and w13 (``wg_S/R/rows``: the activations' quantisation kernel, then the wgmma kernel).
Median and IQR per layer; the roofline floor is the w13 bytes (codes + scales) of the distinct experts selected over
the measured copy bandwidth. Runs from bench/. Prints a table; JSON to --out."""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
from pathlib import Path

import torch
from gemm import copy_bandwidth  # bench/gemm.py
from moe_experts import _bias, timed  # bench/moe_experts.py

from k3tune.kernels import moe_experts, moe_experts_tc, moe_experts_wg, mxfp4
from k3tune.kernels.moe_block import MoeOverlap, MoeOverlapConfig
from k3tune.kernels.moe_experts import Groups
from k3tune.kernels.moe_experts_wg import WgExpertConfig
from k3tune.plan import routing as routings
from k3tune.runtime.moe import BlockShape
from k3tune.shipped import configs_dir


def winner(db: str, tp: int, batch: int, routing: str) -> MoeOverlapConfig:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute("select w.params from winners w join problems p on p.id = w.problem_id where p.key like ?",
                       (f"moe.block[tp={tp},M={batch},%format=mxfp4,routing={routing}]",)).fetchall()
    con.close()
    if len(rows) != 1:
        raise SystemExit(f"error: {db} holds {len(rows)} MXFP4 block winners for tp {tp}, batch {batch}, {routing}")
    return MoeOverlapConfig(**json.loads(rows[0][0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True, help="the tuning DB whose MXFP4 block winners give the shipped w13 config")
    ap.add_argument("--tps", default="8,16")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--routings", default="uniform,zipf:1.2")
    ap.add_argument("--wg", default="4/2/1,4/2/2,4/2/3,3/2/2",
                    help="moe_experts_wg configs: stages/stage_steps/rows, comma-separated")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--out", default="bench-moe-wg-ab.json")
    args = ap.parse_args()
    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, db {args.db}")
    wgs = [WgExpertConfig(*(int(v) for v in c.split("/"))) for c in args.wg.split(",") if c]
    rows = []
    for tp in (int(t) for t in args.tps.split(",")):
        inter, k = sh.inter // tp, sh.latent
        layers = []
        for i in range(args.layers):  # random codes and scales (2^-9 .. 2^-4): the timing does not read the values
            g = torch.Generator(device="cuda").manual_seed(i)
            codes = torch.randint(0, 256, (sh.experts, 2 * inter, k // 2), dtype=torch.uint8, device="cuda",
                                  generator=g)
            scales = torch.randint(118, 124, (sh.experts, 2 * inter, k // 32), dtype=torch.uint8, device="cuda",
                                   generator=g)
            layers.append(dict(codes=codes, dq=moe_experts_tc.pack_codes(codes), scales=scales,
                               wg=moe_experts_wg.pack_w13(codes, scales)))
        for batch in (int(b) for b in args.batches.split(",")):
            for routing in args.routings.split(","):
                ids = routings.sample(routing, sh.experts, sh.top_k, batch, random.Random(batch))
                top = torch.tensor(ids, dtype=torch.int32, device="cuda")
                touched = len({e for r in ids for e in r})
                floor = touched * mxfp4.nbytes(2 * inter, k) / bw * 1e6
                y = torch.randn(batch, sh.experts + k, device="cuda").to(torch.bfloat16)
                x = y[:, sh.experts:].contiguous()
                row = {"tp": tp, "batch": batch, "routing": routing, "touched": touched, "floor_us": floor}
                cfg = winner(args.db, tp, batch, routing)
                c13 = MoeOverlap._tc_cfgs(cfg)[0]
                variants = [("tc_db", c13, cfg.group)]
                variants += [(f"wg_{c.stages}/{c.stage_steps}/{c.rows}", c, moe_experts_wg.TOKENS) for c in wgs]
                for name, c, per in variants:
                    bufs = [dict(groups=Groups.allocate(sh.experts, batch, sh.top_k, per, "cuda"), top=top.clone(),
                                 xq=torch.empty(batch, 2, k, dtype=torch.uint8, device="cuda"),
                                 xs=torch.empty(batch, device="cuda"),
                                 wts=torch.empty(batch, sh.top_k, device="cuda"),
                                 act=torch.empty(batch * sh.top_k, inter, dtype=torch.bfloat16, device="cuda"))
                            for _ in layers]

                    def run(_, name=name, c=c, bufs=bufs, layers=layers):
                        for lay, b in zip(layers, bufs):
                            b["groups"].counts.zero_()
                            moe_experts.route(y, _bias(sh.experts),
                                              b["top"], b["wts"], sh.top_k, 1.0, b["groups"], forced=True)
                            if name == "tc_db":
                                moe_experts_tc.run_w13(c, x, lay["dq" if c.dq else "codes"], b["act"], b["wts"],
                                                       b["groups"], 4.0, 25.0, scales=lay["scales"])
                            else:
                                moe_experts_wg.quantize_into(x, b["xq"], b["xs"])
                                moe_experts_wg.run_w13(c, b["xq"], b["xs"], lay["wg"], b["act"], b["groups"], 4.0,
                                                       25.0)
                    row[name] = timed(name, lambda: run, len(layers), args.samples, floor)
                base = row.get("tc_db", {}).get("us")
                print(f"tp{tp:<3} batch {batch:<3} {routing:9} experts {touched:4} floor {floor:6.1f} | " +
                      " ".join(f"{n} {v['us']:6.1f} ({v['roof']:.2f}" + (f", x{base / v['us']:.2f})" if base else ")")
                               for n, v in row.items() if isinstance(v, dict) and "us" in v), flush=True)
                rows.append(row)
        del layers
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows},
                                         indent=1))


if __name__ == "__main__":
    main()
