"""Debug one gemm.splitk_tc config on the GPU: run it once (for compute-sanitizer) and dump its SASS.

    python bench/tc_debug.py M N K m_tiles,warps_n,warps_k,tile_m,split_k,bk,stages[,...] [sass_out]

The knobs are SplitKConfig's fields in order (trailing ones may be left at their defaults).
"""
import sys

import torch
from expert_sass import device_cubins, disassemble

from k3tune.kernels import family, gemm_splitk_tc
from k3tune.kernels.gemm_splitk_tc import SplitKConfig
from k3tune.plan.problems import Problem

m, n, k = (int(a) for a in sys.argv[1:4])
knobs = [int(a) for a in sys.argv[4].split(",")]
fam = family("gemm.splitk_tc")
p = Problem("kda.o_proj", "gemm", (("M", m), ("N", n), ("K", k)))
cfg = SplitKConfig(*knobs)
if len(sys.argv) > 5:
    fn = gemm_splitk_tc.compiled(*cfg.params().values(), gemm_splitk_tc.current_arch())
    for j, cubin in enumerate(device_cubins(fn, "dbg")):
        open(f"/tmp/tc{j}.cubin", "wb").write(cubin)
        open(sys.argv[5], "a").write(disassemble(f"/tmp/tc{j}.cubin"))
gen = torch.Generator(device="cuda").manual_seed(0)
inputs = fam.make_inputs(p, torch.device("cuda"), gen)
inputs["out"].fill_(float("nan"))
out = fam.build(p, cfg)(inputs)
torch.cuda.synchronize()
ref = fam.reference(p, inputs)
print("err", ((out.float() - ref).norm() / ref.norm()).item())
