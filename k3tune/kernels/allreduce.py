"""One-shot TP all-reduce fused with the residual add (and optionally the next RMSNorm), in CuTe DSL.

Every rank's projection output sits in a symmetric-memory buffer (torch.distributed._symmetric_memory); once
a barrier says all ranks have written, each rank reads the ``group`` peer buffers directly over NVLink
(16-byte loads), sums them in rank order — the same order on every rank, so every rank holds bit-identical
results — adds the residual and writes the new residual stream; with ``norm``, the same launch also writes
RMSNorm(residual) x weight for the next layer. One launch instead of NCCL all-reduce + add (+ norm).

    out[m] = residual[m] + sum_r peer_r[m]           normed[m] = out[m] * rsqrt(mean(out[m]^2) + eps) * w

No NVLink multicast anywhere (the buffers are plain peer mappings). The caller double-buffers across steps
(a step writes buffer s % 2; the barrier before step s + 1's reads proves every rank finished reading step
s - 1's buffer), see bench/allreduce.py.

Status: compiles on the CPU for sm_90a and sm_100a (tests/test_kernel_compile.py); numerics pass on a
2-GPU H200 group (tests/test_gpu_allreduce.py) and bench/allreduce.py measures it there
(bench/results/2026-11-29-s4-r2-x2-bench-allreduce*.log).
"""

import functools
import os
from dataclasses import dataclass

from k3tune.kernels.base import KernelConfig, KernelFamily
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.plan.problems import Problem

VEC = 8  # bf16 per 16-byte vector
MAX_GROUP = 8
THREADS = 256
NORM_THREADS = 512
EPS = 1e-6

# how one rank runs the o_proj + all-reduce + residual add + RMSNorm step, safest first:
#   nccl            projection, NCCL all-reduce, add, torch RMSNorm: what a stock engine runs
#   symm_one_shot   projection into symmetric memory, torch's one-shot all-reduce, add, norm
#   symm_two_shot   projection into symmetric memory, torch's two-shot all-reduce (in place), add, norm
#   fused_one_shot  projection into symmetric memory, barrier, this module's kernel: all-reduce + add + norm
VARIANTS = ("nccl", "symm_one_shot", "symm_two_shot", "fused_one_shot")


@dataclass(frozen=True)
class AllReduceConfig(KernelConfig):
    variant: str = "nccl"


class TpAllReduce(KernelFamily):
    """The ``tp.allreduce`` op on a TP group of ``group`` GPUs. Measured only by a sweep with that many GPUs
    (search/measure_collective.py: one process per GPU); a one-GPU worker cannot run it. The problem's
    ``group`` is part of its key, so a winner measured on 2 GPUs is never served to a group of 8."""
    name = "tp.allreduce"
    kinds = frozenset({"allreduce"})
    config_cls = AllReduceConfig
    backends = frozenset({"gpu"})
    priority = 10

    def space(self, problem: Problem) -> dict[str, tuple]:
        fused = problem["group"] <= MAX_GROUP and problem["N"] % VEC == 0
        return {"variant": VARIANTS if fused else VARIANTS[:3]}

    def tolerance(self, problem: Problem) -> float:
        return 2e-2


def rank_inputs(problem: Problem, rank: int, layers: int, dev) -> dict:
    """This rank's inputs for ``layers`` steps of distinct o_proj weights (read from HBM, like decode):
    x [M, K], weights [N, K], the residual [M, N], the norm weight, and a double-buffered symmetric-memory
    buffer [2, M, N] rendezvoused over the default process group, with its peers' views."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    m, n, k = problem["M"], problem["N"], problem["K"]
    g = torch.Generator(device=dev).manual_seed(1000 * rank + m)
    ws = [(torch.randn(n, k, device=dev, generator=g) / k ** 0.5).to(torch.bfloat16) for _ in range(layers)]
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    # the residual stream is the same on every rank (it was all-reduced by the step before)
    res = torch.randn(m, n, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(n))).to(
        torch.bfloat16)
    group = dist.group.WORLD.group_name
    buf = symm_mem.empty((2, m, n), dtype=torch.bfloat16, device=dev)
    hdl = symm_mem.rendezvous(buf, group)
    world = dist.get_world_size()
    peers = [[hdl.get_buffer(r, (2, m, n), torch.bfloat16)[s] for r in range(world)] for s in range(2)]
    return {"ws": ws, "x": x, "res": res, "norm_w": norm_w, "group": group, "buf": buf, "hdl": hdl,
            "peers": peers, "out": torch.empty(m, n, dtype=torch.bfloat16, device=dev),
            "normed": torch.empty(m, n, dtype=torch.bfloat16, device=dev)}


def rank_reference(inputs: dict):
    """fp32 (new residual, its RMSNorm x weight) of layer 0: every rank's partial product all-gathered and
    summed in rank order, plus the residual. A collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    part = torch.mm(inputs["x"].float(), inputs["ws"][0].float().t())
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part)
    h = inputs["res"].float() + sum(parts)
    return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * inputs["norm_w"].float()


def rank_step(cfg: AllReduceConfig, inputs: dict):
    """step(layer) -> (new residual, normed): this rank's part of one decode step under ``cfg``; every rank
    of the group runs it together. Layer l writes symmetric buffer l % 2: the barrier before step l + 1's
    reads proves every rank is done reading step l - 1's."""
    import torch
    import torch.distributed as dist

    x, res, norm_w, group, buf = inputs["x"], inputs["res"], inputs["norm_w"], inputs["group"], inputs["buf"]

    def rmsnorm(h):  # torch's own RMSNorm, as a stock engine calls it
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), norm_w, EPS)

    def step(layer: int):
        s, w = layer % 2, inputs["ws"][layer]
        if cfg.variant == "nccl":
            y = torch.mm(x, w.t())
            dist.all_reduce(y)
            h = res + y
            return h, rmsnorm(h)
        torch.mm(x, w.t(), out=buf[s])
        if cfg.variant == "symm_one_shot":
            h = res + torch.ops.symm_mem.one_shot_all_reduce(buf[s], "sum", group)
        elif cfg.variant == "symm_two_shot":
            torch.ops.symm_mem.two_shot_all_reduce_(buf[s], "sum", group)
            h = res + buf[s]
        elif cfg.variant == "fused_one_shot":
            inputs["hdl"].barrier(channel=0)
            one_shot(inputs["peers"][s], res, inputs["out"], norm_w, inputs["normed"], EPS)
            return inputs["out"], inputs["normed"]
        else:
            from k3tune.errors import ConfigError

            raise ConfigError(f"all-reduce variant {cfg.variant!r}: expected one of {', '.join(VARIANTS)}")
        return h, rmsnorm(h)

    return step


def _fake_args(group: int, norm: bool, arch: str):
    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    os.environ["CUTE_DSL_ARCH"] = arch
    m, n = cute.sym_int(), cute.sym_int(divisibility=VEC)

    def mat():
        return fake(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)

    peers = [mat() for _ in range(group)]
    peers += [peers[0]] * (MAX_GROUP - group)
    return (*peers, mat(), mat(), fake(BFloat16, (n,), assumed_align=16), mat())


@functools.cache
def compiled(group: int, norm: bool, eps: float, per: int, arch: str):
    """One compile per group size, norm or not, eps, vectors per thread (norm) and arch; M and N dynamic."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from k3tune.kernels.compile_cache import cached_compile

    def build():
        kern = _kernel_class()(group, norm, eps, per)
        return cute.compile(kern, *_fake_args(group, norm, arch), make_fake_stream(), options=f"--gpu-arch {arch}")

    return cached_compile("allreduce", (group, norm, eps, per, arch), (__name__,), build)


def one_shot(peers: list, residual, out, norm_weight=None, normed=None, eps: float = 1e-6, stream=None):
    """out = residual + sum(peers) (and normed = RMSNorm(out) x norm_weight when given); every tensor
    [M, N] bf16 with N a multiple of 8, ``peers`` in rank order (this rank's own buffer among them)."""
    import torch

    from k3tune.errors import ConfigError
    from k3tune.kernels.moe_experts import _stream, _t

    if not 1 <= len(peers) <= MAX_GROUP:
        raise ConfigError(f"one-shot all-reduce: group of {len(peers)}, expected 1..{MAX_GROUP}")
    m, n = residual.shape
    if n % VEC or any(p.shape != residual.shape or p.dtype != torch.bfloat16 for p in peers):
        raise ConfigError(f"one-shot all-reduce: bf16 [M, N] buffers with N a multiple of {VEC}, got {n}")
    norm = norm_weight is not None
    per = -(-n // (VEC * NORM_THREADS)) if norm else 1
    fn = compiled(len(peers), norm, float(eps), per, current_arch())
    ps = [_t(p, 16) for p in peers]
    ps += [ps[0]] * (MAX_GROUP - len(ps))
    w = norm_weight if norm else residual[0]
    nd = normed if norm else out
    fn(*ps, _t(residual, 16), _t(out, 16), _t(w, 16), _t(nd, 16), _stream(stream))


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32

    class OneShotAllReduce:
        def __init__(self, group, norm, eps, per):
            self.group, self.norm, self.eps, self.per = group, norm, eps, per

        @cute.jit
        def __call__(self, p0: cute.Tensor, p1: cute.Tensor, p2: cute.Tensor, p3: cute.Tensor, p4: cute.Tensor,
                     p5: cute.Tensor, p6: cute.Tensor, p7: cute.Tensor, mRes: cute.Tensor, mOut: cute.Tensor,
                     mW: cute.Tensor, mNormed: cute.Tensor, stream: cuda.CUstream):
            m, n = mRes.shape
            if cutlass.const_expr(self.norm):  # a CTA per row: the norm needs the whole row
                self.kernel(p0, p1, p2, p3, p4, p5, p6, p7, mRes, mOut, mW, mNormed).launch(
                    grid=(m, 1, 1), block=(NORM_THREADS, 1, 1), stream=stream)
            else:
                self.kernel(p0, p1, p2, p3, p4, p5, p6, p7, mRes, mOut, mW, mNormed).launch(
                    grid=(m, (n // VEC + THREADS - 1) // THREADS, 1), block=(THREADS, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, p0: cute.Tensor, p1: cute.Tensor, p2: cute.Tensor, p3: cute.Tensor, p4: cute.Tensor,
                   p5: cute.Tensor, p6: cute.Tensor, p7: cute.Tensor, mRes: cute.Tensor, mOut: cute.Tensor,
                   mW: cute.Tensor, mNormed: cute.Tensor):
            G, PER = self.group, self.per
            T = NORM_THREADS if cutlass.const_expr(self.norm) else THREADS
            tidx, _, _ = cute.arch.thread_idx()
            row, col, _ = cute.arch.block_idx()
            nv = mRes.shape[1] // VEC
            peers = [p0, p1, p2, p3, p4, p5, p6, p7]
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            gp = [cute.zipped_divide(peers[r], (1, VEC)) for r in range(G)]
            gres = cute.zipped_divide(mRes, (1, VEC))
            gout = cute.zipped_divide(mOut, (1, VEC))
            acc = cute.make_rmem_tensor(cute.make_layout((VEC, PER)), Float32)
            rv = cute.make_rmem_tensor(cute.make_layout((VEC, G + 1)), BFloat16)
            ov = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
            sq = Float32(0.0)
            for i in cutlass.range_constexpr(PER):
                v_raw = (tidx + i * T) if cutlass.const_expr(self.norm) else (col * T + tidx)
                v = cutlass.min(v_raw, nv - 1)
                for r in cutlass.range_constexpr(G):  # every peer's vector in flight at once
                    cute.copy(atom, gp[r][(None, (row, v))], rv[None, r])
                cute.copy(atom, gres[(None, (row, v))], rv[None, G])
                keep = cutlass.max(cutlass.min(nv - v_raw, 1), 0).to(Float32)
                for j in cutlass.range_constexpr(VEC):
                    s = rv[j, G].to(Float32)  # the residual, then the ranks in order: identical on all ranks
                    for r in cutlass.range_constexpr(G):
                        s = s + rv[j, r].to(Float32)
                    acc[j, i] = s
                    sq = sq + s * s * keep
                if cutlass.const_expr(not self.norm):
                    if v_raw < nv:
                        for j in cutlass.range_constexpr(VEC):
                            ov[j] = acc[j, i].to(BFloat16)
                        cute.copy(atom, ov, gout[(None, (row, v))])
            if cutlass.const_expr(self.norm):
                smem = cutlass.utils.SmemAllocator()
                red = smem.allocate_tensor(Float32, cute.make_layout(T // 32), 16)
                sq = cute.arch.warp_reduction_sum(sq)
                if tidx % 32 == 0:
                    red[tidx // 32] = sq
                cute.arch.sync_threads()
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(T // 32):
                    tot = tot + red[w]
                inv = cute.math.rsqrt(tot / mRes.shape[1].to(Float32) + Float32(self.eps))
                gw = cute.zipped_divide(cute.make_tensor(mW.iterator, cute.make_layout((1, mW.shape[0]),
                                                                                       stride=(0, 1))), (1, VEC))
                gn = cute.zipped_divide(mNormed, (1, VEC))
                wv = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
                for i in cutlass.range_constexpr(PER):
                    v_raw = tidx + i * T
                    if v_raw < nv:
                        cute.copy(atom, gw[(None, (0, v_raw))], wv)
                        for j in cutlass.range_constexpr(VEC):
                            ov[j] = acc[j, i].to(BFloat16)
                        cute.copy(atom, ov, gout[(None, (row, v_raw))])
                        for j in cutlass.range_constexpr(VEC):
                            ov[j] = (acc[j, i] * inv * wv[j].to(Float32)).to(BFloat16)
                        cute.copy(atom, ov, gn[(None, (row, v_raw))])

    return OneShotAllReduce
