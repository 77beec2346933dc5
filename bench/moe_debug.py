"""Which part of the tuned MoE block disagrees with the fp32 reference: the block built with torch experts and
with the CuTe kernels, each op's label, the relative error. Run from the repo root on the device."""
import torch

from k3tune.runtime import Selector
from k3tune.runtime.moe import BlockShape, MoEBlock, random_weights, reference, virtual_full
from k3tune.shipped import configs_dir

K3 = BlockShape.from_config(configs_dir() / "kimi_k3_bf16_experts.json")
sel = Selector.load()
for tp, batch in [(16, 1), (16, 8)]:
    w = random_weights(K3, tp, device="cuda", seed=batch)
    x = torch.randn(batch, K3.hidden, device="cuda").to(torch.bfloat16)
    full = virtual_full(w)
    for path, experts in [("stock", None), ("tuned", "grouped_mm"), ("tuned", "cute")]:
        try:
            blk = MoEBlock.build(w, path, batch=batch, selector=sel, experts=experts)
            out = blk(x)
            ref, _, _ = reference(x, full, K3, top=blk.last_top)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"tp{tp} b{batch} {path} {experts}: err {err:.4g}")
            for k, v in blk.ran.items():
                print(f"    {k}: {v}")
        except Exception as e:
            print(f"tp{tp} b{batch} {path} {experts}: {type(e).__name__}: {e}")
