"""How far the MoE block's output moves if the routed experts' activations are fed to the tensor cores as e4m3
(CPU only, no kernel: the question an e4m3 MXFP4 path must answer before it is written).

E2M1 weights are exact in e4m3 (``(s << 7) | (mag << 2)``, times 2^6), so an ``mma.sync`` m16n8k32 e4m3 path is
exact on the weights; its error is the activations' rounding. Three ways:
- ``bf16``: the activations rounded to bf16, as today's kernels take them;
- ``e4m3``: one e4m3 value per activation (3 mantissa bits), per-token scale amax -> 448;
- ``hi+lo``: x = hi + lo, both e4m3, the same scale (``k3tune.kernels.mxfp4_e4m3.round_hilo``): two MMAs into one
  partial sum.
Both GEMMs of every selected expert take the rounded activations (w13 the latent, w2 the SiTU output). Reported: the
relative error (||y - ref|| / ||ref||) of the routed sum before its RMSNorm and of the block output, against the
block's fp32 reference (``k3tune.runtime.moe.reference``); the block's GPU tests hold the output to 2e-2. K3's
shapes with ``--experts`` routed experts (default 64, top-16 of them: the rounding does not depend on how many
experts exist, and all 896 in fp32 take more memory than a CI machine has).

    python bench/fp8_act_error.py [--tps 16,8] [--tokens 1,8,64] [--seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from k3tune.kernels import mxfp4_e4m3
from k3tune.runtime.moe import BlockShape, random_weights, reference, situ, virtual_full
from k3tune.shipped import configs_dir


def rounded(x, how: str):
    """``x`` (fp32 [T, K]) as the tensor cores would see it, back in fp32 ("fp32": unrounded)."""
    if how == "fp32":
        return x
    if how == "bf16":
        return x.to(torch.bfloat16).float()
    hi, lo, s = mxfp4_e4m3.round_hilo(x)
    if how == "e4m3":
        return hi.float() * s[:, None]
    return (hi.float() + lo.float()) * s[:, None]  # "hi+lo"


def routed_sum(x, full: dict, shape: BlockShape, top, how: str):
    """The block's routed sum (before its RMSNorm) with both expert GEMMs' activations ``rounded``."""
    x = x.float()
    y = x @ full["w_rl"].t()
    s = torch.sigmoid(y[:, :shape.experts])
    latent = y[:, shape.experts:]
    weights = s.gather(1, top)
    weights = weights / weights.sum(-1, keepdim=True) * shape.scaling
    out = torch.zeros_like(latent)
    lat_q = rounded(latent, how)
    for e in sorted(set(top.reshape(-1).tolist())):
        w13, w2 = full["expert"](e)
        for b, j in (top == e).nonzero().tolist():
            gate, up = (lat_q[b:b + 1] @ w13.t()).chunk(2, dim=-1)
            act = rounded(situ(gate, up, shape.situ_beta, shape.situ_linear_beta), how)
            out[b] += weights[b, j] * (act @ w2.t())[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tps", default="16,8")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--experts", type=int, default=64)
    args = ap.parse_args()
    shape = dataclasses.replace(BlockShape.from_config(configs_dir() / "kimi_k3_config.json"), experts=args.experts)
    print("tp tokens seed | routed-sum rel. error: bf16 e4m3 hi+lo | block-output rel. error: bf16 e4m3 hi+lo")
    for tp in (int(t) for t in args.tps.split(",")):
        for seed in range(args.seeds):
            full = virtual_full(random_weights(shape, tp, fmt="mxfp4", seed=seed))
            for t in (int(n) for n in args.tokens.split(",")):
                x = torch.randn(t, shape.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
                ref, top, _ = reference(x, full, shape)
                exact = routed_sum(x, full, shape, top, "fp32")
                gate, up = (x.float() @ full["shared_w13"].t()).chunk(2, dim=-1)  # the shared experts: unrounded
                shared = situ(gate, up, shape.situ_beta, shape.situ_linear_beta) @ full["shared_w2"].t()
                errs, outs = [], []
                for how in ("bf16", "e4m3", "hi+lo"):
                    r = routed_sum(x, full, shape, top, how)
                    errs.append(((r - exact).norm() / exact.norm()).item())
                    normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + shape.rms_eps) * full["norm"]
                    out = normed @ full["w_up"].t() + shared
                    outs.append(((out - ref).norm() / ref.norm()).item())
                print(f"{tp:2} {t:6} {seed:4} | " + " ".join(f"{e:.1e}" for e in errs) + " | "
                      + " ".join(f"{e:.1e}" for e in outs), flush=True)


if __name__ == "__main__":
    main()
