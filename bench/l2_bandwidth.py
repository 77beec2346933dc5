"""How fast the GPU's L2 serves reads, against its HBM: the ceiling on a decode GEMM's L2-to-SM traffic (weights
once plus the activations once per row tile that reads them), which at M = 16 can exceed the weights' own bytes.

    python bench/l2_bandwidth.py

A Triton read kernel (16-byte ``ld.global.cg`` loads that skip L1, as the GEMMs' cp.async copies do; a sum keeps
them live) is timed as the measurer times kernels (``measure_gpu.time_graph``: a CUDA graph of launches, warm-up,
queued replays); medians and IQRs of the per-launch time, in TB/s of bytes read. (Session 32's numbers came from an
equivalent helper of this script's own: a graph of 20 launches, 3 warm-up calls, 15 replays synchronised one by one.)
- ``own``: 132 x 8 programs each read their own slice of a buffer ``reps`` times (L2-resident when the buffer is
  well under the L2, HBM when it is not);
- ``shared``: every program reads the same small region ``reps`` times, as every row tile of a split-K GEMM
  reads the same slice of the activations;
- ``mixed``: a decode GEMM's traffic without its arithmetic: 768 programs (96 row tiles x split 8) each stream their
  own 28 KB of a 22 MB weight slab (a new slab each launch, so from HBM) and ``ratio`` times as many bytes of the
  activations' K slice that the split's 96 programs share (from L2): ratio 0.5 is 16 rows and 8 tokens a CTA, 1.0 is
  16 rows and 16 tokens. The time against ratio 0 says what the L2-served bytes cost on top of the HBM stream.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from k3tune.search.measure_gpu import time_graph


@triton.jit
def _read(src, out, chunk, stride, reps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = src + pid.to(tl.int64) * stride
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(reps):
        for i in range(0, chunk, BLOCK):
            acc += tl.load(base + i + tl.arange(0, BLOCK), cache_modifier=".cg").to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def _mixed(w, x, out, w_off, w_chunk, x_chunk, splits, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    wb = w + w_off + pid.to(tl.int64) * w_chunk
    xb = x + (pid % splits) * x_chunk
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, w_chunk, BLOCK):  # each step's weight and activation loads are in flight together
        offs = i + tl.arange(0, BLOCK)
        wv = tl.load(wb + offs, cache_modifier=".cg")
        xv = tl.load(xb + offs, mask=offs < x_chunk, other=0.0, cache_modifier=".cg")
        acc += wv.to(tl.float32) + xv.to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def timed(run, sets: list[dict], samples: int = 15) -> tuple[float, float]:
    """Median and IQR in seconds per launch of ``run`` over ``sets`` (the measurer's CUDA-graph timing)."""
    t = time_graph(run, sets, samples)
    q = statistics.quantiles(t, n=4)
    return statistics.median(t) / 1e6, (q[2] - q[0]) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs-per-sm", type=int, default=8)
    ap.add_argument("--block", type=int, default=1024, help="bf16 elements a program loads per step")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    progs = sms * args.programs_per_sm
    out = torch.empty(progs, dtype=torch.float32, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs, L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20}"
          f" MiB, {progs} programs x 4 warps, {args.block * 2} B per program step")
    cases = [("own", mb << 20, 64 if mb <= 64 else 1) for mb in (4, 8, 16, 24, 32, 48)]
    cases += [("own", 2 << 30, 1)]
    cases += [("shared", kb << 10, 256) for kb in (28, 56, 224)]
    for mode, size, reps in cases:
        elems = size // 2
        if mode == "own":
            chunk = elems // progs // args.block * args.block
            src = torch.randn(chunk * progs, dtype=torch.bfloat16, device="cuda")
            stride, read = chunk, chunk * progs * 2 * reps
        else:
            chunk = elems // args.block * args.block
            src = torch.randn(chunk, dtype=torch.bfloat16, device="cuda")
            stride, read = 0, chunk * progs * 2 * reps

        def fn(_, src=src, chunk=chunk, stride=stride, reps=reps):
            _read[(progs,)](src, out, chunk, stride, reps, BLOCK=args.block, num_warps=4)

        med, iqr = timed(fn, [{}])
        print(f"{mode:6} {size / 2**20:9.3f} MiB x{reps:<3} read {read / 2**20:8.1f} MiB  {med * 1e6:8.2f} us "
              f"(±{iqr * 1e6:.2f})  {read / med / 1e12:5.2f} TB/s", flush=True)
        del src
    for block in (2048, 4096):
        mixed(block, out)


def mixed(block: int, out) -> None:
    """``block`` bf16 a program step (4096: 8 KB, four 16-byte loads a thread in flight)."""
    progs, splits, slabs = 768, 8, 24
    w_chunk = (22 << 20) // 2 // progs // block * block
    slab = w_chunk * progs
    w = torch.randn(slab * slabs, dtype=torch.bfloat16, device="cuda")  # 24 slabs: ~530 MB, far past L2
    for ratio in (0.0, 0.25, 0.5, 1.0):
        x_chunk = int(w_chunk * ratio)  # a step's activation loads past it are masked off
        x = torch.randn(w_chunk * splits, dtype=torch.bfloat16, device="cuda")

        def fn(s, x=x, x_chunk=x_chunk):  # launch i reads slab i: a new one each launch, from HBM
            _mixed[(progs,)](w, x, out, s["off"], w_chunk, x_chunk, splits, BLOCK=block, num_warps=4)

        med, iqr = timed(fn, [{"off": k * slab} for k in range(slabs)])
        hbm, l2 = slab * 2, x_chunk * 2 * progs
        print(f"mixed  step {block * 2 >> 10} KB ratio {ratio:4.2f}  HBM {hbm / 2**20:5.1f} MiB + L2 {l2 / 2**20:5.1f} MiB  {med * 1e6:6.2f} us "
              f"(±{iqr * 1e6:.2f})  HBM alone at {hbm / med / 1e12:4.2f} TB/s, all {(hbm + l2) / med / 1e12:4.2f} TB/s",
              flush=True)


if __name__ == "__main__":
    main()
