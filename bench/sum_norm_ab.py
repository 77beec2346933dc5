"""The served block with the slot sum + norm spread over a cluster of CTAs a token (``sum_norm_layout``) against the
same block with one CTA a token (the layout before session 39), side by side in one run.

Why (s39-r3's profile, bf16 TP16 b1): the norm kernel ends ~8 us after w2, of which ~4 us is its stand-in's spin and
~4 us one SM reading the token's k x latent fp32 slots (229 KB at top-16) alone. Spread over 8 SMs that part should
take well under 1 us, at every batch (each token's row is still one CTA's work today).

The shipped database's block winners were measured on the kernels before this change, so on this tree they read as
stale. To serve the same knobs on both sides, ``--db`` is copied to a temporary file whose ``moe.block`` winners get
this tree's op digest: a bench of the shipped knobs on new kernel code, never a database to ship (the copy is deleted).
The ``c1`` variant is the same blocks with ``sum_norm_layout`` forced to one CTA a token while it runs.

    cd bench && python3 sum_norm_ab.py --points mxfp4:8:1,bf16:16:1,mxfp4:8:64 [--rounds 3] [--samples 15]
"""

import argparse

import torch
from moe import ab_cells, alternate, served_ab_args, served_ab_points  # bench/moe.py (this script runs from bench/)

from k3tune.kernels import moe_experts
from k3tune.runtime.moe import MoEBlock


def one_cta_a_token(n: int, slices: int) -> tuple[int, int, int]:
    nv = n // 4
    return 1, moe_experts.SUM_NORM_THREADS, -(-nv // moe_experts.SUM_NORM_THREADS)


class OneCtaAToken:
    """A served block whose norm kernel runs one CTA a token (the layout before session 39) while it is called."""

    def __init__(self, blk: MoEBlock):
        self.blk = blk

    def __call__(self, x):
        saved = moe_experts.sum_norm_layout
        moe_experts.sum_norm_layout = one_cta_a_token
        try:
            return self.blk(x)
        finally:
            moe_experts.sum_norm_layout = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    served_ab_args(ap, "mxfp4:8:1,bf16:16:1,mxfp4:16:4,bf16:8:8,mxfp4:8:64")
    args = ap.parse_args()

    for pt, served in served_ab_points(args, "c1 = the norm kernel on one CTA a token"):
        old = [MoEBlock.serve(w, pt.sel, pt.batch, comm=pt.comm) for w in pt.layers]
        for b in served + old:
            b.force_top = pt.top
        blocks = {"cluster": served, "c1": [OneCtaAToken(b) for b in old]}
        ref, out = blocks["cluster"][0](pt.x).clone(), blocks["c1"][0](pt.x)
        if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
            raise SystemExit(f"{pt.label()}: the two layouts disagree (max {(out.float() - ref.float()).abs().max()})")
        meds = alternate(blocks, pt.x, args.rounds, args.samples)
        layout = moe_experts.sum_norm_layout(pt.layers[0].shape.latent, pt.tp)
        print(pt.label() + " | " + " | ".join(ab_cells(meds, "c1", pt.floor_us)) +
              f" | cluster layout {layout} | shared: {served[0].ran.get('shared')}", flush=True)
        del blocks, old, served, pt  # before the next point's weights are made


if __name__ == "__main__":
    main()
