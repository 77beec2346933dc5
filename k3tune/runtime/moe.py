"""The per-rank MoE block of K3's decode step, as a serving engine runs it, with two paths:

``stock``: what a stock engine runs (F.linear for the full router + latent projection on every rank,
torch.topk, torch._grouped_mm for the routed experts, the shared experts serially after them).
``tuned``: every dense GEMM is the kernel the runtime selector picks for this deployment (the router +
latent projection split across the TP ranks and gathered), the shared experts on a side stream (an SM
partition from a green context when the selector gives the block ``shared_sms > 0``, a plain stream free to use every
SM for ``shared_sms = "all"``) forked from the routed chain after the router GEMM, so that they read HBM while the
gather and routing leave it idle rather than beside the router GEMM (s37-r1: 1-2% faster blocks than forking with the
block at 9 of 10 points), MXFP4 or bf16 experts.
``block.ran`` says, per step of the block, which implementation ran and why: tests assert it.

Dataflow per rank (tp ranks; weights of rank ``rank``):
  x [B, H] -> y = x W_rl[rank]^T   ((E + L) / tp rows of the fused [router; latent-down] matrix)
           -> all-gather -> scores [B, E], latent [B, L]
  routing: s = sigmoid(scores); top-k of s + correction bias; weights s[top] / sum(s[top]) * scaling
  routed experts (TP-sharded: w13 [2 I / tp, L] per expert, gate rows then up rows; w2 [L, I / tp]):
           partial latent = sum_k weight_k * situ(latent w13_e^T) w2_e^T -> all-reduce (it feeds a norm)
  out = all-reduce(RMSNorm(latent)[:, slice] W_up[rank]^T + shared partial)   (W_up row-parallel: [H, L / tp]
        per rank, its partial joining the shared experts' all-reduce; the stock path replicates W_up. The
        shared experts are TP-sharded like the routed ones: w13 [2 S / tp, H], w2 [H, S / tp])

On one GPU the collectives are emulated (``EmulatedComm``): the other ranks are taken to hold the same
shards as this one (all-gather repeats this rank's part, all-reduce multiplies by tp), and each collective
can occupy the GPU for the time the target's NVLink would take without touching HBM. On a GPU that spin and the
collective's output are one launch, as a fused collective kernel writes its own output: the gathered rows, the
final residual add, and (tuned path) the routed slot sum + RMSNorm; no separate concatenation or add is charged
on top of the modelled link time. ``virtual_full``
builds the unsharded weights that this convention implies, so a TP-free torch reference can check any tp.
For the row-parallel up-projection the convention makes the ranks' partials sum to (sum of the latent's
tp slices) @ W_up[rank]^T, so the rank computes that: its own weight bytes, the all-reduced value exactly.

In a real TP group (``k3tune.runtime.tp_group.GroupComm``: one process a rank, torch.distributed) every rank holds
its own shards and the collectives are real: the routed latent's all-reduce is its own step (the slot sum, the
all-reduce, then the norm), the up-projection takes this rank's slice of the normed latent, and the final all-reduce
sums the up-projection's partial with the shared experts'. ``assemble_full`` builds the unsharded weights from every
rank's shards for the reference. The comm decides each of those steps (``real``, ``replicate``, ``latent_slice``,
``all_reduce_add``), so one block serves both.

SiTU (``hidden_act: situ``, beta 4, linear beta 25 in K3's config) is not defined in any source available
here; this module assumes the gated form of gpt-oss's clamped SwiGLU: situ(g, u) = g * sigmoid(beta g) *
clamp(u, -linear_beta, linear_beta). It is one function (``situ``): the block's cost does not depend on it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from k3tune.errors import ConfigError
from k3tune.kernels import moe_experts, moe_experts_tc, mxfp4
from k3tune.kernels.l2_prefetch import prefetch
from k3tune.runtime.dense import DenseProjection


@dataclass(frozen=True)
class BlockShape:
    hidden: int = 7168
    experts: int = 896
    top_k: int = 16
    latent: int = 3584
    inter: int = 3072  # one routed expert's intermediate width
    shared_inter: int = 6144  # the shared experts' intermediate widths, fused
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_eps: float = 1e-5
    scaling: float = 1.0

    @classmethod
    def from_config(cls, path: str | Path) -> BlockShape:
        """From a HuggingFace-style config (K3's: ``text_config`` nested)."""
        raw = json.loads(Path(path).read_text())
        c = raw.get("text_config", raw)
        try:
            return cls(hidden=c["hidden_size"], experts=c["num_experts"], top_k=c["num_experts_per_token"],
                       latent=c["routed_expert_hidden_size"], inter=c["moe_intermediate_size"],
                       shared_inter=c["num_shared_experts"] * c["moe_intermediate_size"],
                       situ_beta=c.get("activation_situ_beta", 4.0),
                       situ_linear_beta=c.get("activation_situ_linear_beta", 25.0),
                       rms_eps=c.get("rms_norm_eps", 1e-5), scaling=c.get("routed_scaling_factor", 1.0))
        except KeyError as e:
            raise ConfigError(f"{path}: MoE config key {e} missing") from None

    def check_tp(self, tp: int) -> None:
        for what, n in (("router + latent width", self.experts + self.latent), ("expert width", self.inter),
                        ("shared-expert width", self.shared_inter)):
            if n % tp:
                raise ConfigError(f"tp={tp} does not divide the {what} ({n})")
        if (self.inter // tp) % mxfp4.BLOCK:
            raise ConfigError(f"tp={tp}: expert width per rank {self.inter // tp} is not a multiple of "
                              f"{mxfp4.BLOCK} (MXFP4 blocks)")


def situ(gate, up, beta: float, linear_beta: float):
    import torch

    return gate * torch.sigmoid(beta * gate) * up.clamp(-linear_beta, linear_beta)


@dataclass
class RankWeights:
    """One rank's weights. Expert weights are bf16 tensors, or (codes, scales) pairs when ``fmt == 'mxfp4'``."""
    shape: BlockShape
    tp: int
    rank: int
    fmt: str  # "bf16" | "mxfp4"
    w_rl: object  # [(E + L) / tp, H]
    bias: object  # [E] fp32 correction bias
    w13: object  # [E, 2 I / tp, L] (MXFP4: codes in K3's order or moe_experts_tc.PackedCodes, and scales)
    w2: object  # [E, L, I / tp]
    norm: object  # [L]
    w_up: object  # [H, L / tp]: row-parallel (this rank's slice of the latent)
    shared_w13: object  # [2 S / tp, H]
    shared_w2: object  # [H, S / tp]

    def expert_w13_bf16(self):
        return self.w13 if self.fmt == "bf16" else _dequantize(self.w13)

    def expert_w2_bf16(self):
        return self.w2 if self.fmt == "bf16" else _dequantize(self.w2)


def _dequantize(pair):
    """MXFP4 (codes in either layout, scales) -> bf16."""
    return mxfp4.dequantize(moe_experts_tc.in_layout(pair[0], 0), pair[1])


def random_weights(shape: BlockShape, tp: int, rank: int = 0, fmt: str = "bf16", device="cpu",
                   seed: int = 0) -> RankWeights:
    """Random weights of the true per-rank shapes, scaled so that activations stay O(1): each rank's shards its own,
    the replicated parameters (the routing bias, the latent norm) the same on every rank, as a TP group holds them."""
    import torch

    shape.check_tp(tp)
    if fmt not in ("bf16", "mxfp4"):
        raise ConfigError(f"expert weight format {fmt!r}: expected bf16 or mxfp4")
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} of tp={tp}")
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    same = torch.Generator(device=device).manual_seed(seed * 1000 + 999)  # every rank's replicated parameters
    h, e, lat, i, s = shape.hidden, shape.experts, shape.latent, shape.inter // tp, shape.shared_inter // tp

    def mat(*dims, fan_in):
        return (torch.randn(*dims, generator=g, device=device) / fan_in ** 0.5).to(torch.bfloat16)

    w13, w2 = mat(e, 2 * i, lat, fan_in=lat), mat(e, lat, i, fan_in=shape.inter)
    if fmt == "mxfp4":
        w13, w2 = mxfp4.quantize(w13), mxfp4.quantize(w2)
    return RankWeights(shape, tp, rank, fmt,
                       w_rl=mat((e + shape.latent) // tp, h, fan_in=h),
                       bias=(torch.randn(e, generator=same, device=device) * 0.1).float(),
                       w13=w13, w2=w2,
                       norm=(1 + 0.1 * torch.randn(lat, generator=same, device=device)).to(torch.bfloat16),
                       w_up=mat(h, lat // tp, fan_in=lat),
                       shared_w13=mat(2 * s, h, fan_in=h), shared_w2=mat(h, s, fan_in=shape.shared_inter))


def virtual_full(w: RankWeights) -> dict:
    """The unsharded weights implied by 'every rank holds this rank's shards' (the emulated collectives'
    convention), in fp32, for references."""
    return assemble_full([w] * w.tp)


def assemble_full(ranks: list[RankWeights]) -> dict:
    """The unsharded weights, in fp32, of a TP group whose rank r holds ``ranks[r]``'s shards (the replicated bias
    and norm from rank 0). Experts come one at a time (``full["expert"](e) -> (w13, w2)``): all of them in fp32
    would not fit."""
    import torch

    w = ranks[0]
    if len(ranks) != w.tp:
        raise ConfigError(f"{len(ranks)} ranks' weights for tp={w.tp}")

    def cat(ts, dim):
        return torch.cat([t.float() for t in ts], dim=dim)

    def rows(ts):  # gate rows then up rows, per rank: the full matrix has all gates, then all ups
        halves = [t.float().chunk(2, dim=-2) for t in ts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=-2)

    def shard(r: RankWeights, which: str, e: int):
        pair = getattr(r, which)
        return pair[e] if r.fmt == "bf16" else mxfp4.dequantize(moe_experts_tc.expert_codes(pair[0], e), pair[1][e])

    def expert(e: int):
        got: dict[int, tuple] = {}  # each distinct rank's shards once (virtual_full repeats one rank tp times)
        for r in ranks:
            if id(r) not in got:
                got[id(r)] = (shard(r, "w13", e), shard(r, "w2", e))
        pairs = [got[id(r)] for r in ranks]
        return rows([p[0] for p in pairs]), cat([p[1] for p in pairs], -1)

    return {"w_rl": cat([r.w_rl for r in ranks], 0), "bias": w.bias.float(), "expert": expert,
            "norm": w.norm.float(), "w_up": cat([r.w_up for r in ranks], -1),
            "shared_w13": rows([r.shared_w13 for r in ranks]), "shared_w2": cat([r.shared_w2 for r in ranks], -1)}


def reference(x, full: dict, shape: BlockShape, top=None):
    """The block in plain fp32 torch on unsharded weights: a loop over tokens and their experts, no TP.

    Returns (output, the experts used, the biased routing scores). ``top`` imposes the experts (to compare
    against an executor whose bf16 scores broke a near-tie the other way; see ``routing_agrees``)."""
    import torch

    x = x.float()
    y = x @ full["w_rl"].t()
    scores, latent = y[:, :shape.experts], y[:, shape.experts:]
    s = torch.sigmoid(scores)
    biased = s + full["bias"]
    if top is None:
        top = torch.topk(biased, shape.top_k, dim=-1).indices
    weights = s.gather(1, top)
    weights = weights / weights.sum(-1, keepdim=True) * shape.scaling
    routed = torch.zeros_like(latent)
    for e in sorted(set(top.reshape(-1).tolist())):
        w13, w2 = full["expert"](e)
        for b, j in (top == e).nonzero().tolist():
            gate, up = (latent[b] @ w13.t()).chunk(2)
            routed[b] += weights[b, j] * (situ(gate, up, shape.situ_beta, shape.situ_linear_beta) @ w2.t())
    normed = routed * torch.rsqrt(routed.pow(2).mean(-1, keepdim=True) + shape.rms_eps) * full["norm"]
    gate, up = (x @ full["shared_w13"].t()).chunk(2, dim=-1)
    shared = situ(gate, up, shape.situ_beta, shape.situ_linear_beta) @ full["shared_w2"].t()
    return normed @ full["w_up"].t() + shared, top, biased


def routing_agrees(top, biased, shape: BlockShape, tol: float = 1e-2) -> bool:
    """True when the experts ``top`` chose differ from the fp32 top-k only where scores are within ``tol``."""
    import torch

    k = shape.top_k
    ref_sorted = torch.sort(biased, dim=-1, descending=True).values
    kth = ref_sorted[:, k - 1:k]  # the k-th best score per token
    chosen = biased.gather(1, top.long())
    return bool((chosen >= kth - tol).all()) and all(len(set(r.tolist())) == k for r in top)


class EmulatedComm:
    """Collectives of a TP group on one GPU: the other ranks hold this rank's shards (see module doc).

    With a target link (``link_gbps`` > 0, e.g. from ``for_target('gb300', tp)``), each collective also
    occupies the GPU for the time that link would take — ``latency_us`` plus the ring's bytes over the link —
    with a spin kernel that reads no memory (a stand-in: HBM stays free, as it would be). The label says
    emulated, with the target."""

    real = False  # the other ranks' shards are taken to be this rank's (see the module doc)

    def __init__(self, tp: int, link_gbps: float = 0.0, latency_us: float = 0.0, target: str = ""):
        self.tp, self.link_gbps, self.latency_us = tp, link_gbps, latency_us
        self.pdl = False  # the fused stand-ins launch as programmatic dependents (set by a block built with pdl)
        if tp == 1:
            self.label = "identity (tp=1)"
        elif link_gbps > 0:
            self.label = f"emulated (tp={tp}, stand-in for {target or 'the target'}'s link: {latency_us:.1f} us + bytes / {link_gbps:.0f} GB/s)"
        else:
            self.label = f"emulated (tp={tp}, no link time)"

    @classmethod
    def for_target(cls, hardware: str, tp: int, latency_us: float | None = None) -> EmulatedComm:
        """Stand-ins timed by a hardware model's NVLink (k3tune.plan.links; ``latency_us`` defaults to its)."""
        from k3tune.plan import links
        from k3tune.plan.hardware import spec

        hw = spec(hardware)
        return cls(tp, links.nvlink_gbps(hw.key), links.LATENCY_US if latency_us is None else latency_us, hw.name)

    def stand_in_us(self, nbytes: int, ring_factor: float) -> float:
        if self.tp == 1 or self.link_gbps <= 0:
            return 0.0
        return self.latency_us + ring_factor * (self.tp - 1) / self.tp * nbytes / (self.link_gbps * 1e9) * 1e6

    def cycles(self, nbytes: int, ring_factor: float = 2.0) -> int:
        """The stand-in's SM clock cycles for a collective moving ``nbytes`` (0: none)."""
        return int(self.stand_in_us(nbytes, ring_factor) * _SPIN_CYCLES_PER_US)

    def _occupy(self, x, ring_factor: float = 2.0, nbytes: int | None = None):
        """The stand-in for a collective over ``x`` (or over ``nbytes`` where x's own size is not what moves)."""
        import torch

        n = self.cycles(x.numel() * x.element_size() if nbytes is None else nbytes, ring_factor)
        if n > 0 and x.is_cuda:
            torch.cuda._sleep(n)

    @staticmethod
    def _fused(*ts) -> bool:
        """On a GPU, bf16 rows: the stand-in and the collective's output are one k3tune kernel (a fused collective
        writes its own output), not a spin and a torch op after it."""
        import torch

        return all(t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1 for t in ts)

    def all_gather(self, x):
        import torch

        if self.tp == 1:
            return x
        # a ring all-gather moves (tp - 1) parts of x's size
        if self._fused(x):
            out = torch.empty(x.shape[0], self.tp * x.shape[1], dtype=x.dtype, device=x.device)
            moe_experts.gather_rows(x, out, self.tp, cycles=self.cycles(x.numel() * x.element_size(), self.tp),
                                    pdl=self.pdl)
            return out
        self._occupy(x, ring_factor=self.tp)
        return torch.cat([x] * self.tp, dim=-1)

    def all_reduce(self, x):
        self._occupy(x)
        return x if self.tp == 1 else x * self.tp

    def all_reduce_add(self, x, base, partial: bool = False):
        """base + all_reduce(x), one launch (with the stand-in, on a GPU). ``partial`` (the tuned path's row-parallel
        up-projection) changes nothing here: under the identical-shard convention that partial already is the
        all-reduced value."""
        import torch

        if self.tp > 1 and x.shape == base.shape and self._fused(x, base):
            out = torch.empty_like(base)
            moe_experts.reduce_add_rows(x, base, out, self.tp, cycles=self.cycles(x.numel() * x.element_size()),
                                        pdl=self.pdl)
            return out
        self._occupy(x)
        return torch.add(base, x, alpha=self.tp)


    def replicate(self, t, dim: int):
        """The unsharded weight of which every rank holds shard ``t`` along ``dim`` (ranks in order)."""
        import torch

        return torch.cat([t] * self.tp, dim=dim)

    def latent_slice(self, normed):
        """What this rank's row-parallel up-projection multiplies: the sum of the latent's tp slices (module doc)."""
        return _slice_sum(normed, self.tp)


FORK_AFTER_ROUTE = False  # off (s45-r4: 1.6-1.9 µs slower, H100): the CuTe path forks the shared experts after the
# route, not after the router GEMM (the route's one warp a token then runs without their GEMM beside it)
_SPIN_CYCLES_PER_US = 1980  # torch.cuda._sleep spins in SM clock cycles; H200 boost clock 1.98 GHz


@dataclass
class MoEBlock:
    """A per-rank MoE block for ``tokens`` tokens per step. Build with ``MoEBlock.build``."""
    weights: RankWeights
    path: str
    tokens: int
    comm: EmulatedComm
    ran: dict = field(default_factory=dict)
    _gemms: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict)
    _side: object = None
    _routed: object = None  # the routed experts' stream on the rest of an SM split (None: every SM)
    _fork: object = None  # during a step with a side stream: [the block's input, the shared experts' output]
    last_top: object = None  # the experts the last step chose [tokens, top_k]
    force_top: object = None  # measurement only: impose the experts (a recorded or synthetic routing)

    @classmethod
    def build(cls, weights: RankWeights, path: str, batch: int, draft: int = 0, selector=None,
              comm: EmulatedComm | None = None, shared_stream=None, experts: str | None = None,
              prefetch_mib: int = 0, experts_cfg: tuple | None = None, routed_stream=None, pdl: int = 0) -> MoEBlock:
        """``experts``: 'cute' (k3tune's grouped GEMV kernels, bf16 weights, GPU), 'grouped_mm'
        (torch._grouped_mm; MXFP4 dequantised first), or None: 'cute' on the tuned path where it can run.
        ``pdl`` (tuned path, CuTe kernels): the block's own kernels and the fused stand-ins launch as programmatic
        dependents of the kernel before them (each waits for it before reading anything)."""
        import torch

        if path not in ("stock", "tuned"):
            raise ConfigError(f"MoE block path {path!r}: expected stock or tuned")
        tokens = batch * (1 + draft)
        if comm is not None and comm.tp != weights.tp:
            raise ConfigError(f"the collectives are for tp={comm.tp}, the weights are one rank's of tp={weights.tp}")
        blk = cls(weights, path, tokens, comm or EmulatedComm(weights.tp))
        w = weights
        dev = w.w_rl.device
        blk.ran["collectives"] = blk.comm.label
        if path == "stock":
            if w.fmt != "bf16":
                raise ConfigError("the stock path runs bf16 experts (what a stock engine runs); got mxfp4")
            blk._cache["w_rl_full"] = blk.comm.replicate(w.w_rl, 0)  # computed in full on every rank
            blk._cache["w_up_full"] = blk.comm.replicate(w.w_up, -1)  # replicated on every rank
            blk.ran["router_latent"] = "F.linear (full width on every rank)"
            blk.ran["dense"] = "F.linear"
            blk.ran["shared"] = "serial, after the routed experts"
        else:
            if selector is None:
                raise ConfigError("the tuned path needs a runtime selector")
            for op, weight in (("moe.router_latent", w.w_rl), ("moe.latent_up", w.w_up),
                               ("moe.shared_w13", w.shared_w13), ("moe.shared_w2", w.shared_w2)):
                blk._gemms[op] = DenseProjection.bind(selector.lookup(op, w.tp, batch, draft), op, weight, tokens)
                blk.ran[op] = blk._gemms[op].ran
            blk.ran["router_latent"] = blk._gemms["moe.router_latent"].ran + ", split across ranks + all-gather"
            if prefetch_mib > 0:
                if not w.w_rl.is_cuda:
                    raise ConfigError("L2 prefetch needs a GPU")
                blk._cache["prefetch"] = (torch.cuda.Stream(), prefetch_mib << 20)
                blk.ran["prefetch"] = (f"{prefetch_mib} MiB of the latent up-projection into L2 during routing "
                                       "(cp.async.bulk.prefetch.L2, side stream)")
            else:
                blk.ran["prefetch"] = "off"
            if shared_stream is not None:
                blk._side = shared_stream
                blk.ran["shared"] = (f"side stream {getattr(shared_stream, 'k3tune_label', '')}".strip() +
                                     ", forked after the router GEMM")
            else:
                blk.ran["shared"] = "serial, after the routed experts"
            if routed_stream is not None:  # the SMs the shared experts leave: the split is a real split
                if shared_stream is None:
                    raise ConfigError("a routed-expert stream is the rest of a split: give the shared stream too")
                blk._routed = routed_stream
                blk.ran["routed"] = f"stream {getattr(routed_stream, 'k3tune_label', '')}".strip()
            else:
                blk.ran["routed"] = "the current stream (every SM)"
        cfg = experts_cfg or (moe_experts_tc.default_config(tokens) if w.fmt == "mxfp4"
                              else moe_experts.default_config(tokens))
        tensor_core = isinstance(cfg[0], moe_experts_tc.TcExpertConfig)
        can_cute = path == "tuned" and w.w_rl.is_cuda and (w.fmt == "bf16" or tensor_core)
        experts = experts or ("cute" if can_cute else "grouped_mm")
        if experts == "cute" and not can_cute:
            raise ConfigError("the CuTe expert kernels run on a GPU on the tuned path; MXFP4 experts need the "
                              "tensor-core kernels")
        if experts not in ("cute", "grouped_mm"):
            raise ConfigError(f"expert implementation {experts!r}: expected cute or grouped_mm")
        blk._cache["experts"] = experts
        blk._cache["pdl"] = bool(pdl) and experts == "cute"
        if blk._cache["pdl"]:  # this block's copy: the caller's comm may serve blocks built without PDL
            blk.comm = copy.copy(blk.comm)
            blk.comm.pdl = True
        blk.ran["pdl"] = ("the block's kernels launch as programmatic dependents" if blk._cache["pdl"] else "off")
        blk._cache["w13_t"] = None if w.fmt == "mxfp4" else w.w13.transpose(1, 2)
        blk._cache["w2_t"] = None if w.fmt == "mxfp4" else w.w2.transpose(1, 2)
        if experts == "cute":
            k = weights.shape.top_k
            blk._cache["cfg13"], blk._cache["cfg2"], per = cfg
            blk._cache["groups"] = moe_experts.Groups.allocate(weights.shape.experts, tokens, k, per, dev)
            if w.fmt == "mxfp4":
                moe_experts_tc.check_scales(w.w13[1])
                moe_experts_tc.check_scales(w.w2[1])
                # the codes in the layout each kernel decodes (dq = 1: repacked once here, as a loader would). The
                # block keeps that layout only: the caller's copy in the other layout may be dropped, so the expert
                # codes are not held twice
                blk.weights = w = replace(w, w13=(moe_experts_tc.in_layout(w.w13[0], cfg[0].dq), w.w13[1]),
                                          w2=(moe_experts_tc.in_layout(w.w2[0], cfg[1].dq), w.w2[1]))
            blk._cache["top"] = torch.empty(tokens, k, dtype=torch.int32, device=dev)
            blk._cache["wts"] = torch.empty(tokens, k, dtype=torch.float32, device=dev)
            blk._cache["act"] = torch.empty(tokens * k, weights.shape.inter // w.tp, dtype=torch.bfloat16, device=dev)
            blk._cache["per_slot"] = torch.empty(tokens * k, weights.shape.latent, dtype=torch.float32, device=dev)
            blk._cache["normed"] = torch.empty(tokens, weights.shape.latent // w.tp, dtype=torch.bfloat16, device=dev)
            blk._cache["shared_act"] = torch.empty(tokens, weights.shape.shared_inter // w.tp, dtype=torch.bfloat16,
                                                   device=dev)
            blk.ran["routing"] = "k3tune route kernel (CuTe DSL): sigmoid + bias top-k, renormalised"
            kind = ("tensor-core grouped GEMMs (CuTe DSL, mma.sync" +
                    (", MXFP4 dequantised in registers)" if w.fmt == "mxfp4" else ") bf16") if tensor_core
                    else "expert-grouped GEMVs (CuTe DSL) bf16")
            blk.ran["experts"] = (f"k3tune {kind}, up to {per} tokens per expert read: w13+SiTU "
                                  f"{blk._cache['cfg13']}, w2 {blk._cache['cfg2']}; slot sum + RMSNorm kernel; "
                                  "shared SiTU kernel")
        else:
            blk.ran["experts"] = ("torch._grouped_mm bf16" if w.fmt == "bf16"
                                  else "MXFP4 dequantised (torch reference) + torch._grouped_mm")
        return blk

    @classmethod
    def serve(cls, weights: RankWeights, selector, batch: int, draft: int = 0,
              comm: EmulatedComm | None = None) -> MoEBlock:
        """The block as serving runs it: the selector's ``moe.block`` choice decides the path and every knob
        (expert-kernel tiles, shared-expert SM partition, L2 prefetch); its dense GEMMs are the selector's
        too. ``ran['block']`` says which choice was served and from where. The selector's model must have these
        weights' expert format: its moe.block winners are keyed by it (another format's knobs would run silently)."""
        tuned_for = getattr(getattr(selector, "model", None), "expert_weight_format", weights.fmt)
        if tuned_for != weights.fmt:
            raise ConfigError(f"the selector's model has {tuned_for} experts, these weights are {weights.fmt}: its "
                              f"moe.block winners were tuned for {tuned_for}; load it with a {weights.fmt}-expert model")
        choice = selector.lookup("moe.block", weights.tp, batch, draft)
        p = dict(choice.params)
        tc_ok = weights.fmt == "bf16" or dict(choice.params).get("experts_kernel") == "tensor_core"
        if choice.family == "moe.overlap" and weights.w_rl.is_cuda and tc_ok:
            from k3tune.kernels import family

            knobs = family(choice.family).block_knobs(choice.config())  # the same mapping the sweep measured
            blk = cls.build(weights, "tuned", batch, draft, selector=selector, comm=comm, **knobs)
        elif weights.fmt == "bf16" and choice.family == "moe.stock":
            blk = cls.build(weights, "stock", batch, draft, comm=comm)
        else:  # a CPU, or a choice that cannot run these weights: the tuned path with its defaults, labelled
            blk = cls.build(weights, "tuned", batch, draft, selector=selector, comm=comm)
        blk.ran["block"] = f"{choice.family} {json.dumps(p, sort_keys=True)} ({choice.source})"
        return blk

    # ---- the step --------------------------------------------------------------------------------
    def __call__(self, x):
        import torch

        side = self._side
        self._fork = None if side is None else [x, None]  # the routed chain starts the shared experts (_fork_shared)
        routed = self._routed
        if routed is None:
            up = self._routed_part(x)
        else:  # on the SMs the shared experts' partition leaves, joined back before the final all-reduce
            main = torch.cuda.current_stream()
            routed.wait_stream(main)
            with torch.cuda.stream(routed):
                up = self._routed_part(x)
            main.wait_stream(routed)
        if side is None:
            shared = self._shared(x)
        else:
            torch.cuda.current_stream().wait_stream(side)
            shared, self._fork = self._fork[1], None
            if shared is None:
                raise RuntimeError("the routed chain never started the shared experts")
        if self._cache.get("prefetch") is not None:
            torch.cuda.current_stream().wait_stream(self._cache["prefetch"][0])  # joined: graph-capturable
        return self.comm.all_reduce_add(shared, up, partial=self.path == "tuned")

    def _routed_part(self, x):
        """Router + latent GEMM, gather, routing, the routed experts, norm, up-projection: this rank's partial
        of the up-projected routed output."""
        import torch

        w, shape = self.weights, self.weights.shape
        gathered_routed = None  # the gathered rows where the route ran in the gather's launch
        if self.path == "stock":
            y = torch.nn.functional.linear(x, self._cache["w_rl_full"])
        else:
            y = self._gemms["moe.router_latent"](x)
            late = FORK_AFTER_ROUTE and self._cache["experts"] == "cute"
            if not late:
                self._fork_shared()
            pf = self._cache.get("prefetch")
            if pf is not None:  # HBM idles through routing and the gather: pull the next weights into L2
                pf[0].wait_stream(torch.cuda.current_stream())
                prefetch(w.w_up, pf[1], stream=pf[0])
            gathered_routed = self._gather_route(y)
            y = self.comm.all_gather(y) if gathered_routed is None else gathered_routed
            if late and gathered_routed is not None:
                self._fork_shared()
        scores, latent = y[:, :shape.experts], y[:, shape.experts:]
        if self._cache["experts"] == "cute":
            # the kernels take the latent as a strided view of the gathered rows (no copy)
            normed = self._cute_routed(y.contiguous(), latent, routed=gathered_routed is not None)
        else:
            top, weights = self._route(scores, w.bias, shape, self.force_top)
            self.last_top = top
            routed = self.comm.all_reduce(self._experts(latent, top, weights))
            normed = _rmsnorm(routed, w.norm, shape.rms_eps)
            if self.path == "tuned":
                normed = self.comm.latent_slice(normed)
        # stock: the up-projection replicated (full width on every rank); tuned: row-parallel, its partial sum
        # joins the shared experts' in the final all-reduce. On one GPU, with every rank holding this rank's
        # slice of w_up, the ranks' partials sum to (sum of the latent's slices) @ slice^T: one GEMM of the
        # rank's own bytes gives the all-reduced product exactly (see the module doc)
        up = (torch.nn.functional.linear(normed, self._cache["w_up_full"]) if self.path == "stock"
              else self._gemms["moe.latent_up"](normed))
        return up

    def _route_target(self):
        """(the routing's [tokens, k] experts tensor, whether they are imposed): the route kernel writes the one or
        reads the other."""
        import torch

        top = self._cache["top"]
        forced = self.force_top is not None
        if forced:  # the imposed experts, read in place where they can be (the copy is a measurement artefact)
            ft = self.force_top
            if ft.dtype == torch.int32 and ft.shape == top.shape and ft.is_contiguous() and ft.device == top.device:
                top = ft
            else:
                top.copy_(ft)
        return top, forced

    def _gather_route(self, y):
        """With ``moe_experts.GATHER_ROUTE`` (off since s45-r1) on the CuTe path with a fused stand-in: the
        all-gather of ``y`` and the route in one launch; its gathered rows. None: the two stay apart."""
        import torch

        comm, c = self.comm, self._cache
        if not (moe_experts.GATHER_ROUTE and c["experts"] == "cute" and not comm.real and comm.tp > 1
                and comm._fused(y)):
            return None
        w, shape = self.weights, self.weights.shape
        top, forced = self._route_target()
        out = torch.empty(y.shape[0], comm.tp * y.shape[1], dtype=y.dtype, device=y.device)
        moe_experts.gather_route(y, out, comm.tp, w.bias, top, c["wts"], shape.top_k, shape.scaling, c["groups"],
                                 forced=forced, cycles=comm.cycles(y.numel() * y.element_size(), comm.tp),
                                 pdl=comm.pdl)
        self.last_top = top
        return out

    def _cute_routed(self, y, latent, routed: bool = False):
        """Routing (unless ``routed``: done with the gather), both expert projections, the slot sum and the
        RMSNorm: five launches. The emulated all-reduce of the routed latent (x tp) is folded into the norm's eps
        (RMSNorm(c x) = x / sqrt(mean x^2 + eps / c^2)); its stand-in time, if any, is spun by the norm kernel
        before it reads."""
        import torch

        w, shape, c = self.weights, self.weights.shape, self._cache
        g = c["groups"]
        pdl = c["pdl"]
        if not routed:
            top, forced = self._route_target()
            moe_experts.route(y, w.bias, top, c["wts"], shape.top_k, shape.scaling, g, forced=forced, pdl=pdl)
            self.last_top = top
            if FORK_AFTER_ROUTE:
                self._fork_shared()
        if isinstance(c["cfg13"], moe_experts_tc.TcExpertConfig):
            fp4 = w.fmt == "mxfp4"
            moe_experts_tc.run_w13(c["cfg13"], latent, w.w13[0] if fp4 else w.w13, c["act"], c["wts"], g,
                                   shape.situ_beta, shape.situ_linear_beta, scales=w.w13[1] if fp4 else None, pdl=pdl)
            moe_experts_tc.run_w2(c["cfg2"], c["act"], w.w2[0] if fp4 else w.w2, c["per_slot"], c["wts"], g,
                                  scales=w.w2[1] if fp4 else None, pdl=pdl)
        else:
            moe_experts.run_w13(c["cfg13"], latent, w.w13, c["act"], c["wts"], g, shape.situ_beta,
                                shape.situ_linear_beta, pdl=pdl)
            moe_experts.run_w2(c["cfg2"], c["act"], w.w2, c["per_slot"], c["wts"], g, pdl=pdl)
        # a rank sums its slots before the all-reduce (the sum is linear), so what crosses the link is the
        # tokens' fp32 latent rows, not the per-slot partials; here the sum runs fused with the norm, after the
        # stand-in's spin in the same launch (an all-reduce fused with the norm)
        tokens = c["normed"].shape[0]
        if self.comm.real:  # the slot sum, the group's all-reduce, the norm, this rank's slice; groups reset
            routed = self.comm.all_reduce(c["per_slot"].view(tokens, shape.top_k, -1).sum(1))
            g.counts.zero_()
            return self.comm.latent_slice(_rmsnorm(routed, w.norm, shape.rms_eps)).to(torch.bfloat16)
        moe_experts.sum_norm(c["per_slot"], w.norm, c["normed"], shape.top_k, shape.rms_eps / self.comm.tp ** 2, g,
                             slices=self.comm.tp, cycles=self.comm.cycles(tokens * shape.latent * 4), pdl=pdl)
        return c["normed"]

    def _fork_shared(self) -> None:
        """The shared experts on their side stream, after what the routed chain's stream has queued (the router
        GEMM): beside the gather, routing and the routed experts."""
        import torch

        if self._fork is None or self._fork[1] is not None:  # no side stream, or forked already this step
            return
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._fork[1] = self._shared(self._fork[0])

    def _shared(self, x):
        import torch

        w, shape = self.weights, self.weights.shape
        f = torch.nn.functional.linear
        h = f(x, w.shared_w13) if self.path == "stock" else self._gemms["moe.shared_w13"](x)
        if self._cache["experts"] == "cute":
            a = self._cache["shared_act"]
            moe_experts.situ_rows(h, a, shape.situ_beta, shape.situ_linear_beta, pdl=self._cache["pdl"])
        else:
            gate, up = h.chunk(2, dim=-1)
            a = situ(gate.float(), up.float(), shape.situ_beta, shape.situ_linear_beta).to(x.dtype)
        return f(a, w.shared_w2) if self.path == "stock" else self._gemms["moe.shared_w2"](a)

    @staticmethod
    def _route(scores, bias, shape: BlockShape, forced=None):
        import torch

        s = torch.sigmoid(scores.float())
        top = forced.long() if forced is not None else None
        if top is None or moe_experts.FORCED_TOPK:  # an imposed routing runs the top-k too (FORCED_TOPK)
            chosen = torch.topk(s + bias, shape.top_k, dim=-1).indices
            top = chosen if top is None else top
        weights = s.gather(1, top)
        return top, weights / weights.sum(-1, keepdim=True) * shape.scaling

    def _experts(self, latent, top, weights):
        """Tokens gathered per expert, one grouped GEMM per projection over all experts (empty groups cost
        nothing), SiTU between, weighted scatter-add back to tokens. Static shapes: graph-capturable."""
        import torch

        w, shape = self.weights, self.weights.shape
        b, k = top.shape
        flat = top.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        token = order // k
        # per-expert counts by scatter-add (bincount reads its max back to the host: not capturable)
        counts = torch.zeros(shape.experts, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        a = latent.index_select(0, token).contiguous()
        w13_t = self._cache["w13_t"] if self._cache["w13_t"] is not None else w.expert_w13_bf16().transpose(1, 2)
        w2_t = self._cache["w2_t"] if self._cache["w2_t"] is not None else w.expert_w2_bf16().transpose(1, 2)
        h = torch._grouped_mm(a, w13_t, offs=offs)
        gate, up = h.chunk(2, dim=-1)
        act = situ(gate.float(), up.float(), shape.situ_beta, shape.situ_linear_beta).to(latent.dtype)
        out = torch._grouped_mm(act.contiguous(), w2_t, offs=offs).float()
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros(b, shape.latent, device=latent.device).index_add_(0, token, out).to(latent.dtype)


def _slice_sum(x, tp: int):
    """sum_r x[:, r-th of tp slices] (fp32 sum, bf16 out): the latent as the row-parallel up-projection's
    emulated ranks see it."""
    b, n = x.shape
    return x.float().view(b, tp, n // tp).sum(1).to(x.dtype)


def _rmsnorm(x, weight, eps: float):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
