"""Does pulling the selected experts' w2 weights into L2 while w13 runs make the served block faster?

Why (s35-r2 profile, MXFP4 TP8 b1): w13 reads 23 MB in ~15 us and w2 12 MB in ~13 us, with the shared experts
beside them: ~2.2 TB/s of the 4.2 together, so HBM has room during w13; w2's short K (192-384) makes each of its
CTAs a chain of dependent loads (moe_experts_tc's doc, s18-r5), which L2 hits would shorten. Which experts w2 reads
is known once the route kernel has run, so a side-stream kernel launched after it can issue
``cp.async.bulk.prefetch.L2`` for exactly those experts' w2 rows (codes and scales for MXFP4), beside w13.

Bench only: the library is not edited (runtime/moe.py and the expert kernels are in every block winner's key). The
``w2pf`` variant is the served block whose ``_cute_routed`` has the route call followed by that side-stream launch
(joined back after the routed chain, so the step stays graph-capturable). Only where the selected experts' w2 bytes
fit the L2 can it pay (b1-b4); ``--caps`` caps the bytes asked for per expert (its first rows).
Measured (s39-r1, NOTES session 39): 0-8% slower at every point tried, with ``--up`` slower again: refuted; kept as
the record of the test.

    cd bench && python3 w2_prefetch_ab.py --points mxfp4:8:1,mxfp4:8:4,bf16:16:1 [--rounds 3] [--samples 15]

A point is format:tp:batch (uniform routing). The variants alternate, ``--rounds`` times, so drift falls on both; the
table gives each variant's median of its rounds' medians, its ratio to the served block and its roofline fraction
(bench/moe.py's bytes).
"""

import argparse
import functools

import torch
from gemm import copy_bandwidth  # bench/gemm.py (this script runs from bench/)
from moe import ServedPoint, ab_cells, alternate

import k3tune.runtime.moe as rmoe
from k3tune.kernels import l2_prefetch, moe_experts_tc
from k3tune.runtime.moe import BlockShape, MoEBlock
from k3tune.shipped import configs_dir

CHUNK = 64 << 10  # bytes per CTA: one bulk prefetch
LAUNCHES = [0]  # prefetch launches issued (eager and captured): the variant's path is shown to run


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import Int32, Int64
    from cutlass.experimental.primitives import cp_async_bulk_prefetch

    class ExpertPrefetch:
        """CTA (i, c): work item i of the route kernel's groups, if it exists and is its expert's first, prefetches
        bytes [c x CHUNK, (c + 1) x CHUNK) of that expert's ``stride`` bytes (capped at ``limit`` from its start)."""

        @cute.jit
        def __call__(self, mW: cute.Tensor, mCounts: cute.Tensor, mItems: cute.Tensor, stride: Int64,
                     limit: Int32, experts: Int32, items: Int32, chunks: Int32, stream: cuda.CUstream):
            self.kernel(mW, mCounts, mItems, stride, limit, experts).launch(
                grid=(items, chunks, 1), block=(32, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mW: cute.Tensor, mCounts: cute.Tensor, mItems: cute.Tensor, stride: Int64, limit: Int32,
                   experts: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            i, c, _ = cute.arch.block_idx()
            if tidx == 0:
                if i < mCounts[experts]:
                    item = mItems[i]
                    if (item & 0xFFFF) == 0:  # the expert's first item: one prefetch per expert
                        start = c * CHUNK
                        size = cutlass.min(Int64(limit) - Int64(start), Int64(CHUNK))
                        size = cutlass.min(size, stride - Int64(start))
                        if size > 0:
                            off = Int64(item >> 16) * stride + Int64(start)
                            cp_async_bulk_prefetch(mW.iterator + off, Int32(size))

    return ExpertPrefetch


@functools.cache
def _compiled(arch: str):
    import cutlass.cute as cute
    from cutlass import Int32, Uint8
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    w = make_fake_compact_tensor(Uint8, (cute.sym_int(divisibility=16),), assumed_align=16)
    i32 = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
    return cute.compile(_kernel_class()(), w, i32, i32, 0, 0, 0, 0, 0, make_fake_stream(),
                        options=f"--gpu-arch {arch}")


def prefetch_experts(w: torch.Tensor, groups, limit: int, stream) -> None:
    """Into L2: the first ``limit`` bytes of each selected expert's slice of ``w`` ([E, ...], contiguous)."""
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import from_dlpack

    from k3tune.kernels.gemm_smallm import current_arch

    LAUNCHES[0] += 1
    experts = w.shape[0]
    flat = w.reshape(-1).view(torch.uint8)
    stride = flat.numel() // experts
    limit = min(limit, stride)
    t = lambda x, a: from_dlpack(x, assumed_align=a).mark_layout_dynamic()  # noqa: E731
    _compiled(current_arch())(t(flat, 16), t(groups.counts, 4), t(groups.items, 4), stride, limit, experts,
                              groups.items.numel(), (limit + CHUNK - 1) // CHUNK, cuda.CUstream(stream.cuda_stream))


class _RouteThenPrefetch:
    """Stands for ``k3tune.runtime.moe.moe_experts`` inside one block's ``_cute_routed``: ``route`` also forks the
    w2 prefetch onto the block's side stream; everything else is the module's."""

    def __init__(self, mod, blk, cap: int, up: bool):
        self._mod, self._blk, self._cap, self._up = mod, blk, cap, up

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def route(self, *args, **kw):
        self._mod.route(*args, **kw)
        blk, g = self._blk, args[6]
        side = blk._w2pf_stream
        side.wait_stream(torch.cuda.current_stream())
        w2 = blk.weights.w2
        if blk.weights.fmt == "mxfp4":  # codes (as K3 ships them, or repacked), then scales
            parts = [w2[0].data if isinstance(w2[0], moe_experts_tc.PackedCodes) else w2[0], w2[1]]
        else:
            parts = [w2]
        sizes = [p[0].numel() * p.element_size() for p in parts]  # one expert's bytes of each
        for p, size in zip(parts, sizes):  # the cap shared in proportion
            lim = size if self._cap <= 0 else max(16, self._cap * size // sum(sizes) // 16 * 16)
            prefetch_experts(p, g, lim, side)

    def sum_norm(self, *args, **kw):
        if self._up:  # the up-projection's weights, after w2, beside the norm's all-reduce stand-in
            side = self._blk._w2pf_stream
            side.wait_stream(torch.cuda.current_stream())
            w_up = self._blk.weights.w_up
            l2_prefetch.prefetch(w_up, w_up.numel() * w_up.element_size(), stream=side)
        self._mod.sum_norm(*args, **kw)


def with_w2_prefetch(blk: MoEBlock, cap_bytes: int, up: bool = False) -> MoEBlock:
    blk._w2pf_stream = torch.cuda.Stream()

    def cute_routed(y, latent):
        saved = rmoe.moe_experts
        rmoe.moe_experts = _RouteThenPrefetch(saved, blk, cap_bytes, up)
        try:
            out = MoEBlock._cute_routed(blk, y, latent)
        finally:
            rmoe.moe_experts = saved
        torch.cuda.current_stream().wait_stream(blk._w2pf_stream)  # joined: graph-capturable
        return out

    blk._cute_routed = cute_routed
    blk.ran["w2_prefetch"] = f"selected experts' w2 into L2 after route (cap {cap_bytes} B/expert, 0 = whole)"
    return blk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="mxfp4:8:1,mxfp4:8:2,mxfp4:8:4,mxfp4:16:1,bf16:16:1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--db", default=None)
    ap.add_argument("--caps", default="0", help="bytes per expert asked for, one variant each (KiB; 0 = all of it)")
    ap.add_argument("--up", action="store_true", help="also a variant that, beside w2pf (whole), pulls the latent "
                    "up-projection's weights into L2 after w2, beside the norm's all-reduce stand-in")
    args = ap.parse_args()

    from k3tune.kernels.gemm_smallm import current_arch

    _compiled(current_arch())  # outside any capture
    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; served blocks, uniform routing, "
          f"stand-ins timed by gb300 NVLink; w2pf = the selected experts' w2 pulled into L2 beside w13")
    for point in args.points.split(","):
        pt = ServedPoint.make(point, sh, bw, args.db, args.layers)
        variants = ["served"] + [f"w2pf{c}" for c in args.caps.split(",")] + (["w2pf0+up"] if args.up else [])
        blocks = {}
        for name in variants:
            blocks[name] = [MoEBlock.serve(w, pt.sel, pt.batch, comm=pt.comm) for w in pt.layers]
            for b in blocks[name]:
                b.force_top = pt.top
                if name != "served":
                    if b._cache.get("experts") != "cute":
                        raise SystemExit(f"{point}: the served block does not run the CuTe expert kernels")
                    with_w2_prefetch(b, int(name[4:].removesuffix("+up")) << 10, up=name.endswith("+up"))
        ref = blocks["served"][0](pt.x).clone()
        exact = torch.equal(blocks["served"][0](pt.x), ref)  # the served block repeats itself bit for bit?
        for name in variants[1:]:  # a hint: the same numbers (bit for bit where the block repeats itself)
            n0 = LAUNCHES[0]
            out = blocks[name][0](pt.x)
            same = torch.equal(out, ref) if exact else torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=1e-3)
            if not same or LAUNCHES[0] == n0:
                raise SystemExit(f"{point} {name}: output differs from the served block's or no prefetch ran")
        meds = alternate(blocks, pt.x, args.rounds, args.samples)
        print(pt.label() + " | " + " | ".join(ab_cells(meds, "served", pt.floor_us)) +
              f" | served: {blocks['served'][0].ran.get('shared')} | prefetch launches {LAUNCHES[0]}", flush=True)
        del blocks, pt
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
