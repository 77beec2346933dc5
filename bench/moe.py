"""The per-rank MoE block on the local GPU: the stock path against the tuned path, side by side in one run.

    python bench/moe.py [--tps 8,16] [--batches 1,2,4,8,16,32,64] [--routings uniform,zipf:1.2] [--fmts bf16]
                        [--shared-sms 0,16,64] [--prefetch-mib 0,16]

Tuned variants: every (shared-expert SMs, prefetch MiB) pair, and with --pdl 0,1 each also with the block's own
kernels launched as programmatic dependents (``_pdl1``); shared SMs 0 runs the shared experts serially
after the routed experts, a multiple of 8 gives them a green-context partition of that many SMs and the
routed experts the rest (64 of the H200's 132 is the even split); prefetch 0 is off. With --served: the
database's choice (whose ``routed_on`` may also leave the routed experts every SM), and the same knobs
serial (served_serial) and on the even split (served_even); with --served-pdl, the same knobs with PDL forced
off and on (served_pdl0, served_pdl1). The summary counts the SM split bar two ways: a served split that beats
both (a served choice of 0 SMs is serial itself and counts as no split, and so does a plain side stream, ``shared_sms
= "all"``, which splits no SMs), and the served choice, split or serial, beating the even split without serial
beating it; ``served_overlap_wins_fraction`` counts a plain stream that beats both as well.

Each path runs in a CUDA graph over ``--layers`` layers with distinct weights (decode reads them from HBM),
after a warm-up; medians and IQRs of the per-layer time over ``--samples`` replays. Routing is imposed
(``block.force_top``) from k3tune's routing model, so both paths read the same experts. The roofline floor
is the bytes each path reads (dense weights + the distinct experts actually selected + activations) over the
measured copy bandwidth. Collectives are emulated (identical shards, no NVLink time): the comparison is of
the rank's own work. Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass, replace

import torch
from gemm import copy_bandwidth, write_json  # bench/gemm.py (this script runs from bench/)

from k3tune.errors import ConfigError
from k3tune.kernels import mxfp4
from k3tune.plan import model as models
from k3tune.plan import routing as routings
from k3tune.runtime import Selector
from k3tune.runtime.moe import BlockShape, EmulatedComm, MoEBlock, random_weights
from k3tune.search.measure_gpu import time_graph
from k3tune.shipped import configs_dir, tuning_db_dir


def block_bytes(sh: BlockShape, tp: int, path: str, fmt: str, touched: int, tokens: int) -> int:
    split = 1 if path == "stock" else tp  # the tuned path splits router + latent and the up-projection
    rl = (sh.experts + sh.latent) * sh.hidden * 2 // split
    n13, n2 = 2 * sh.inter // tp, sh.inter // tp
    expert = (mxfp4.nbytes(n13, sh.latent) + mxfp4.nbytes(sh.latent, n2)) if fmt == "mxfp4" else \
        (n13 * sh.latent + sh.latent * n2) * 2
    shared = 3 * sh.shared_inter // tp * sh.hidden * 2
    return rl + touched * expert + sh.hidden * sh.latent * 2 // split + shared + tokens * sh.hidden * 4


def time_blocks(blocks, x, samples: int) -> list[float]:
    """Per-layer times (us): the measurer's CUDA-graph timing of a step through every layer's block."""
    return [t / len(blocks) for t in time_graph(lambda _: [b(x) for b in blocks], [{}], samples)]


EXPERTS_A_SLICE = 64  # MXFP4 experts quantised at once by bench_weights


def bench_weights(sh: BlockShape, tp: int, fmt: str, seed: int, device: str = "cuda", rank: int = 0):
    """``random_weights(sh, tp, rank, fmt=fmt, device=device, seed=seed)``, bit for bit, with the MXFP4 experts quantised
    EXPERTS_A_SLICE experts at a time. Quantising a whole TP8 w13 at once takes ~40 GB of fp32 and int64
    temporaries: beside the other layers an 80 GB card runs out of memory (s50-r1, H100). The bench's code, not the
    served code's: the weights' values are the same, so no result's key changes."""
    if fmt != "mxfp4":
        return random_weights(sh, tp, rank, fmt=fmt, device=device, seed=seed)
    w = random_weights(sh, tp, rank, fmt="bf16", device=device, seed=seed)  # the same draws: quantising draws nothing

    def quantize(t):
        codes, scales = zip(*(mxfp4.quantize(part) for part in t.split(EXPERTS_A_SLICE)))
        return torch.cat(codes), torch.cat(scales)

    return replace(w, fmt=fmt, w13=quantize(w.w13), w2=quantize(w.w2))


@dataclass
class ServedPoint:
    """One format:tp:batch point of the served-block A/B scripts (bench/*_ab.py): uniform routing
    imposed, the selector of the model with that expert format, ``layers`` distinct weights, the roofline floor."""
    fmt: str
    tp: int
    batch: int
    sel: object
    layers: list
    top: object  # int32 [batch, top_k]: the imposed experts
    x: object
    touched: int
    floor_us: float
    comm: EmulatedComm

    @classmethod
    def make(cls, point: str, sh: BlockShape, bw: float, db: str | None, layers: int,
             measured_on: str | None = None) -> ServedPoint:
        """``measured_on`` (e.g. 'h200'): serve that GPU's winners from ``db`` on whatever GPU this runs on (an A/B
        of a code change on another card, labelled by the header's device name; never a tuning result)."""
        fmt, tp, batch = point.split(":")
        tp, batch = int(tp), int(batch)
        model = "kimi_k3_config.json" if fmt == "mxfp4" else "kimi_k3_bf16_experts.json"
        sel = Selector.load(db, model=models.load(configs_dir() / model), routing="uniform", measured_on=measured_on)
        weights = [bench_weights(sh, tp, fmt, seed=i) for i in range(layers)]
        ids = routings.sample("uniform", sh.experts, sh.top_k, batch, random.Random(batch))
        top = torch.tensor(ids, device="cuda", dtype=torch.int32)
        x = torch.randn(batch, sh.hidden, device="cuda").to(torch.bfloat16)
        touched = len({e for r in ids for e in r})
        floor = block_bytes(sh, tp, "tuned", fmt, touched, batch) / bw * 1e6
        return cls(fmt, tp, batch, sel, weights, top, x, touched, floor, EmulatedComm.for_target("gb300", tp))

    def label(self) -> str:
        return f"{self.fmt:5s} tp{self.tp:<2d} b{self.batch:<3d} experts {self.touched:3d} floor {self.floor_us:6.1f}"


def alternate(blocks: dict, x, rounds: int, samples: int) -> dict:
    """label -> each round's median per-layer time (us) of that label's blocks; the labels take turns, ``rounds``
    times, so drift falls on all of them."""
    meds = {v: [] for v in blocks}
    for _ in range(rounds):
        for v in blocks:
            meds[v].append(statistics.median(time_blocks(blocks[v], x, samples)))
    return meds


def ab_cells(meds: dict, base, floor_us: float, name=str) -> list[str]:
    """One table cell per label: the median of its rounds' medians, its roofline fraction, its ratio to ``base``'s
    and the rounds themselves."""
    ref = statistics.median(meds[base])
    cells = []
    for v, m in meds.items():
        us = statistics.median(m)
        cells.append(f"{name(v)} {us:6.1f} (roof {floor_us / us:.3f}, x{ref / us:.3f}, rounds "
                     f"{'/'.join(f'{t:.1f}' for t in m)})")
    return cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tps", default="8,16")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--routings", default="uniform,zipf:1.2")
    ap.add_argument("--fmts", default="bf16", help="tuned-path expert formats (the stock path is bf16)")
    ap.add_argument("--shared-sms", default="0,16,64")
    ap.add_argument("--prefetch-mib", default="0,16")
    ap.add_argument("--pdl", default="0", help="tuned variants with the block's own kernels launched as programmatic "
                    "dependents (1), without (0), or both (0,1: a _pdl1 variant beside each)")
    ap.add_argument("--link", default="gb300", help="collective stand-ins timed by this hardware's NVLink "
                    "(a name from k3tune.plan.hardware), or 'none' for no link time")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--out", default="bench-moe.json")
    ap.add_argument("--db", default=None, help="tuning database (default: the shipped one for this GPU)")
    ap.add_argument("--model", default="kimi_k3_bf16_experts.json", help="the model whose winners are served (a "
                    "file name in configs/; the moe.block winners are keyed by its expert format: bf16 experts by "
                    "default, like the comparison)")
    ap.add_argument("--served-routing", choices=("uniform", "row"), default="uniform",
                    help="served blocks tuned for uniform routing, or for each row's routing (K3TUNE_ROUTING: "
                         "blocks tuned for it where the database has them, else uniform's, labelled so)")
    ap.add_argument("--served", action="store_true", help="also run the block as served: every knob from the "
                    "database's moe.block winner (MoEBlock.serve)")
    ap.add_argument("--served-pdl", action="store_true", help="with --served, also the served knobs with the block's "
                    "own kernels launched as programmatic dependents (pdl 1) and without (pdl 0), side by side")
    args = ap.parse_args()
    from k3tune.runtime.partition import shared_partition

    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    model = models.load(configs_dir() / args.model)
    if args.served and {model.expert_weight_format} != set(args.fmts.split(",")):
        # the moe.block winners are keyed by the model's expert format: other weights would run that format's knobs
        raise SystemExit(f"error: --served looks winners up under {args.model}, whose experts are "
                         f"{model.expert_weight_format}, but --fmts is {args.fmts}: pass --fmts "
                         f"{model.expert_weight_format} or a --model with {args.fmts} experts")
    sel = Selector.load(args.db, model=model, routing="uniform")
    served_sel = {r: Selector.load(args.db, model=model, routing=r)
                  if args.served_routing == "row" else sel for r in args.routings.split(",")}
    sms_list = [int(v) for v in args.shared_sms.split(",")]
    pf_list = [int(v) for v in args.prefetch_mib.split(",")]
    pdl_list = [int(v) for v in args.pdl.split(",")]
    splits = {n: shared_partition(n) for n in sms_list if n}  # shared experts on n SMs, routed on the rest
    even_sms = torch.cuda.get_device_properties(0).multi_processor_count // 2 // 8 * 8  # 64 of an H200's 132
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, table {sel.hash}, served blocks tuned for {args.served_routing} routing, collectives: "
          f"{'emulated, no link time' if args.link == 'none' else 'emulated, stand-ins timed by ' + args.link + ' NVLink'}")
    rows = []

    def save(complete: bool) -> dict:
        """The JSON so far, rewritten after every row: a run cut short by its timeout keeps the rows it finished."""
        summary = summarize(rows, sms_list, pf_list, args.fmts.split(",")[0])
        write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bw": bw, "complete": complete,
                              "summary": summary, "rows": rows})
        return summary

    for tp in (int(t) for t in args.tps.split(",")):
        layers = {fmt: [bench_weights(sh, tp, fmt, seed=i) for i in range(args.layers)]
                  for fmt in {"bf16", *args.fmts.split(",")}}
        for batch in (int(b) for b in args.batches.split(",")):
            for routing in args.routings.split(","):
                ids = routings.sample(routing, sh.experts, sh.top_k, batch, random.Random(batch))
                top = torch.tensor(ids, device="cuda", dtype=torch.int32)  # the kernels read it in place
                touched = len({e for r in ids for e in r})
                x = torch.randn(batch, sh.hidden, device="cuda").to(torch.bfloat16)
                row = {"tp": tp, "batch": batch, "routing": routing, "touched": touched}
                variants = [("stock", "bf16", None, 0, 0)] + [("tuned", f, n, p, d) for f in args.fmts.split(",")
                                                             for n in sms_list for p in pf_list for d in pdl_list]
                # served: the database's block choice; served_serial / served_even: the same knobs with the
                # shared experts serial (0 SMs) or on an even split (the SM-split bar compares against both)
                variants += [(v, f, None, 0, 0) for f in args.fmts.split(",") if args.served
                             for v in ("served", "served_serial", "served_even")]
                variants += [(v, f, None, 0, 0) for f in args.fmts.split(",") if args.served and args.served_pdl
                             for v in ("served_pdl0", "served_pdl1")]
                if args.served and args.served_routing == "row" and routing != "uniform":  # both ways, one run
                    variants += [("uniformtuned", f, None, 0, 0) for f in args.fmts.split(",")]
                for path, fmt, sms, pf, pdl in variants:
                    name = f"{path}_{fmt}" + ("" if sms is None else f"_sms{sms}_pf{pf}") + ("_pdl1" if pdl else "")
                    comm = EmulatedComm(tp) if args.link == "none" else EmulatedComm.for_target(args.link, tp)
                    try:
                        if path == "uniformtuned":  # the blocks tuned for uniform routing, served on this row's
                            blocks = [MoEBlock.serve(w, sel, batch, comm=comm) for w in layers[fmt]]
                        elif path.startswith("served_"):
                            ssel = served_sel[routing]
                            knobs = (served_knobs(ssel, tp, batch, pdl=int(path[-1])) if path.startswith("served_pdl")
                                     else served_knobs(ssel, tp, batch, 0 if path == "served_serial" else even_sms))
                            blocks = [MoEBlock.build(w, "tuned", batch=batch, selector=ssel, comm=comm, **knobs)
                                      for w in layers[fmt]]
                        else:
                            blocks = [MoEBlock.serve(w, served_sel[routing], batch, comm=comm) if path == "served" else
                                      MoEBlock.build(w, path, batch=batch, selector=sel, prefetch_mib=pf,
                                                     shared_stream=splits[sms].shared.stream if sms else None,
                                                     routed_stream=splits[sms].rest.stream if sms else None,
                                                     comm=comm, pdl=pdl)
                                      for w in layers[fmt]]
                        for b in blocks:
                            b.force_top = top
                        t = time_blocks(blocks, x, args.samples)
                    except Exception as e:  # one variant failing (e.g. capture across a green context) is reported
                        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                        row[name] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
                        continue
                    q = statistics.quantiles(t, n=4)
                    floor = block_bytes(sh, tp, path, fmt, touched, batch) / bw * 1e6
                    # the samples in replay order show what an IQR hides (s25-r4: 30-164 us at TP8 b32/b64)
                    row[name] = {"us": statistics.median(t), "iqr": q[2] - q[0], "floor_us": floor,
                                 "samples_us": [round(v, 2) for v in t], "ran": blocks[0].ran}
                    del blocks
                if "us" not in row.get("stock_bf16", {}):
                    rows.append(row)
                    save(False)
                    continue
                stock = row["stock_bf16"]["us"]
                tuned = {k: v for k, v in row.items() if k.startswith(("tuned", "served", "uniformtuned")) and "us" in v}
                if not tuned:
                    continue
                best = min(tuned, key=lambda k: tuned[k]["us"])
                row["best"] = best
                print(f"tp{tp:<3} batch {batch:<3} {routing:10} experts {touched:4} stock {stock:7.1f} "
                      f"(roof {row['stock_bf16']['floor_us'] / stock:.2f}) | " +
                      " ".join(f"{k.removeprefix('tuned_')} {v['us']:7.1f} x{stock / v['us']:.2f}"
                               for k, v in tuned.items()) +
                      f" | best {best.removeprefix('tuned_')} roof {tuned[best]['floor_us'] / tuned[best]['us']:.2f}",
                      flush=True)
                rows.append(row)
                save(False)
        del layers
        torch.cuda.empty_cache()
    print(json.dumps(save(True), indent=1))


def served_knobs(sel, tp: int, batch: int, shared_sms: int | None = None, pdl: int | None = None,
                 routed_on: str = "rest", prefetch_mib: int | None = None) -> dict:
    """The served moe.overlap choice's executor knobs with the SM split replaced (``shared_sms``: 0 = serial, else
    the shared experts on that many SMs and the routed experts on ``routed_on``: the rest, as an even split at half
    the SMs is, or all), ``pdl`` or ``prefetch_mib`` replaced; None keeps the choice's own."""
    import dataclasses

    from k3tune.errors import ConfigError
    from k3tune.kernels import family

    choice = sel.lookup("moe.block", tp, batch)
    if choice.family != "moe.overlap":
        raise ConfigError(f"the served block is {choice.family} ({choice.source}), not moe.overlap")
    cfg = choice.config()
    if shared_sms is not None:
        cfg = dataclasses.replace(cfg, shared_sms=shared_sms, routed_on=routed_on if shared_sms else "all")
    if pdl is not None:
        cfg = dataclasses.replace(cfg, pdl=pdl)
    if prefetch_mib is not None:
        cfg = dataclasses.replace(cfg, prefetch_mib=prefetch_mib)
    return family("moe.overlap").block_knobs(cfg)


def served_ab_args(ap: argparse.ArgumentParser, points: str) -> None:
    """The served-block A/B scripts' shared options (``served_ab_points`` reads them)."""
    ap.add_argument("--points", default=points, help="format:tp:batch, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--db", default=str(tuning_db_dir() / "h200.sqlite"))
    ap.add_argument("--measured-on", default=None, help="serve this GPU's winners (e.g. h200) on the card at hand")


def served_ab_points(args: argparse.Namespace, legend: str):
    """The served-block A/B scripts' loop: yields (ServedPoint, its served blocks, one a layer) per format:tp:batch of
    ``args.points`` (options from ``served_ab_args``), the winners of ``args.db`` served on this tree's code
    (``current_block_keys``: the temporary copy is deleted at the end), after a header line that ends with ``legend``;
    a point not served as the measured winner on the CuTe expert kernels stops the run."""
    points, src_db, layers, measured_on = args.points, args.db, args.layers, args.measured_on
    import os

    db = current_block_keys(src_db)
    try:
        sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
        bw = copy_bandwidth()
        knobs = f"{measured_on}'s served knobs" if measured_on else "served knobs"
        print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; {knobs}, uniform routing, "
              f"stand-ins timed by gb300 NVLink; {legend}")
        for point in points.split(","):
            pt = ServedPoint.make(point, sh, bw, db, layers, measured_on)
            served = [MoEBlock.serve(w, pt.sel, pt.batch, comm=pt.comm) for w in pt.layers]
            if "(measured)" not in served[0].ran["block"] or served[0]._cache.get("experts") != "cute":
                raise SystemExit(f"{point}: not the measured winner on the CuTe kernels: {served[0].ran['block']}")
            yield pt, served
            del served, pt
            torch.cuda.empty_cache()
    finally:
        os.unlink(db)


def current_block_keys(src: str) -> str:
    """A temporary copy of ``src`` whose moe.block winners carry this tree's op digest: the A/B scripts serve the
    shipped knobs on kernel code changed since they were measured (a bench, never a database to ship; the caller
    deletes the copy)."""
    import os
    import shutil
    import sqlite3
    import tempfile

    from k3tune.kernels import op_digest

    fd, path = tempfile.mkstemp(suffix=".sqlite")
    os.close(fd)
    shutil.copyfile(src, path)
    con = sqlite3.connect(path)
    with con:  # each hardware's digest: a family landed on one hardware keys its winners only (kernels.LANDED_ON)
        n = sum(con.execute("UPDATE winners SET op_digest = ? WHERE hardware_id = ? AND problem_id IN "
                            "(SELECT id FROM problems WHERE op = 'moe.block')",
                            (op_digest("moe.block", "gpu", key), hw)).rowcount
                for hw, key in con.execute("SELECT id, class_key FROM hardware").fetchall())
    con.close()
    print(f"# {src}: {n} moe.block winners served on this tree's kernels (temporary copy)")
    return path


def summarize(rows: list[dict], sms_list: list[int], pf_list: list[int], fmt: str) -> dict:
    """Per configuration: speedup of the best tuned variant over stock; whether the best SM split (other
    than 0 = serial and 64 = even) beats both; the prefetch gain (best prefetch > 0 vs off, same split)."""
    def us(row, sms, pf, pdl=0):
        v = row.get(f"tuned_{fmt}_sms{sms}_pf{pf}" + ("_pdl1" if pdl else ""), {})
        return v.get("us")

    out = []
    for r in rows:
        if "us" not in r.get("stock_bf16", {}):
            continue
        best_at = {n: min((t for p in pf_list if (t := us(r, n, p)) is not None), default=None) for n in sms_list}
        split = [t for n, t in best_at.items() if n not in (0, 64) and t is not None]
        serial, even = best_at.get(0), best_at.get(64)
        tuned = [t for t in best_at.values() if t is not None]
        served, s_serial, s_even = f"served_{fmt}", f"served_serial_{fmt}", f"served_even_{fmt}"
        shared_ran = r.get(served, {}).get("ran", {}).get("shared", "") if "us" in r.get(served, {}) else ""
        serial_served = shared_ran.startswith("serial")
        plain_served = "(plain" in shared_ran  # shared_sms "all": beside the routed experts with no SM partition
        # the tuned choice, split or serial, beats the even split and is not beaten by serial
        over_even = _beats(r, served, s_even)
        holds = None if over_even is None else over_even and (serial_served or not _beats(r, s_serial, served))
        gains = {n: (us(r, n, 0) / min(t for p in pf_list if p and (t := us(r, n, p)) is not None) - 1)
                 for n in sms_list if us(r, n, 0) and any(p and us(r, n, p) for p in pf_list)}
        out.append({"tp": r["tp"], "batch": r["batch"], "routing": r["routing"],
                    "speedup": r["stock_bf16"]["us"] / min(tuned) if tuned else None,
                    "served_speedup": r["stock_bf16"]["us"] / r[served]["us"] if "us" in r.get(served, {}) else None,
                    "uniformtuned_speedup": (r["stock_bf16"]["us"] / r[f"uniformtuned_{fmt}"]["us"]
                                             if "us" in r.get(f"uniformtuned_{fmt}", {}) else None),
                    "served_roof": r[served]["floor_us"] / r[served]["us"] if "us" in r.get(served, {}) else None,
                    # a served choice of 0 SMs is serial itself: no split to beat serial with (s26-r4 counted
                    # 4 such rows as wins on noise between two runs of identical knobs)
                    "served_is_serial": serial_served,
                    "served_is_plain": plain_served,
                    # the bar's SM split: a green-context partition (a plain stream splits no SMs)
                    "served_split_beats_serial_and_even": (False if serial_served or plain_served
                                                           else _beats(r, served, s_serial, s_even)),
                    # the served overlap, partition or plain stream
                    "served_overlap_beats_serial_and_even": (False if serial_served
                                                             else _beats(r, served, s_serial, s_even)),
                    "served_choice_holds": holds,
                    "split_beats_serial_and_even": (bool(split) and serial is not None and even is not None
                                                    and min(split) < min(serial, even)),
                    # the served knobs with the block's kernels as programmatic dependents against without
                    "pdl_gain": (r[f"served_pdl0_{fmt}"]["us"] / r[f"served_pdl1_{fmt}"]["us"] - 1
                                 if "us" in r.get(f"served_pdl0_{fmt}", {}) and "us" in r.get(f"served_pdl1_{fmt}", {})
                                 else None),
                    "pdl_beats_off": _beats(r, f"served_pdl1_{fmt}", f"served_pdl0_{fmt}"),
                    "tuned_pdl_gain": {f"sms{n}_pf{p}": us(r, n, p) / us(r, n, p, 1) - 1 for n in sms_list
                                       for p in pf_list if us(r, n, p) and us(r, n, p, 1)},
                    "prefetch_gain": gains})
    n = len(out)
    served = [o["served_split_beats_serial_and_even"] for o in out if o["served_split_beats_serial_and_even"] is not None]
    overlap = [o["served_overlap_beats_serial_and_even"] for o in out
               if o["served_overlap_beats_serial_and_even"] is not None]
    held = [o["served_choice_holds"] for o in out if o["served_choice_holds"] is not None]
    return {"configs": n, "split_wins_fraction": sum(o["split_beats_serial_and_even"] for o in out) / n if n else None,
            "served_split_wins_fraction": sum(served) / len(served) if served else None,
            "served_overlap_wins_fraction": sum(overlap) / len(overlap) if overlap else None,
            "served_serial_chosen": sum(bool(o["served_is_serial"]) for o in out),
            "served_plain_chosen": sum(bool(o["served_is_plain"]) for o in out),
            "served_choice_holds_fraction": sum(held) / len(held) if held else None,
            "per_config": out}


def _beats(row: dict, a: str, *others: str) -> bool | None:
    """a faster than every other beyond the run-to-run spread (half IQRs), None where one did not run."""
    if "us" not in row.get(a, {}) or any("us" not in row.get(o, {}) for o in others):
        return None
    return all(row[a]["us"] + row[a]["iqr"] / 2 < row[o]["us"] - row[o]["iqr"] / 2 for o in others)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # bad input (a model or database that is not there): one line, not a traceback
        raise SystemExit(f"error: {e}") from None
