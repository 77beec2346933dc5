"""Per-rank kernel problems of the K3 decode layer, and the reduction of deployments to them.

A deployment is one serving configuration (tp, batch, dcp, draft length, context). Each op of the decode
layer becomes, on one rank, a *problem*: the op plus the shapes its kernel sees. Many deployments share a
problem: dense and MoE problems depend on tokens per step M = batch x (1 + draft), rounded up to a token
bucket, and on tp; only attention depends on DCP and context. Each problem is tuned once.

Op kinds: ``gemm`` (y[M,N] = x[M,K] W[N,K]^T, bf16), ``kda_decode`` (recurrent KDA state update),
``mla_decode`` (latent attention over the KV cache, split by DCP), ``moe_block`` (the routed-expert block
with its shared-expert overlap and prefetch knobs), ``allreduce`` (a TP collective fused with what follows
it; tuned only by specs that name it, on a group of that many GPUs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import product

from k3tune.errors import ConfigError
from k3tune.plan import routing
from k3tune.plan.model import ModelConfig
from k3tune.plan.spec import SweepSpec, bucket, validate_deployment_values


@dataclass(frozen=True, order=True)
class Deployment:
    tp: int
    batch: int
    dcp: int
    draft: int
    context: int

    @property
    def tokens(self) -> int:
        return self.batch * (1 + self.draft)


@dataclass(frozen=True, order=True)
class Problem:
    op: str
    kind: str
    dims: tuple[tuple[str, int | str], ...]

    @cached_property
    def key(self) -> str:
        return f"{self.op}[{','.join(f'{k}={v}' for k, v in self.dims)}]"

    def __getitem__(self, name: str):
        return self.shape[name]

    def get(self, name: str, default=None):
        return self.shape.get(name, default)

    @cached_property
    def shape(self) -> dict:
        return dict(self.dims)


def _per_rank(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ConfigError(f"tp {tp} does not divide {what} ({total})")
    return total // tp


def _gemm(m: int, n: int, k: int) -> tuple:
    return (("M", m), ("N", n), ("K", k))


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: str
    layer: str  # "kda", "mla" or "moe": which layers run it
    dims: Callable[[ModelConfig, Deployment, SweepSpec], tuple]
    opt_in: bool = False  # tuned only by specs that name it (a collective needs a TP group of GPUs)
    # other ops whose tuned kernels this op runs when it is measured on a GPU (the MoE block runs the dense
    # projections the selector picks): their keys are part of this op's key (k3tune.kernels.op_digest)
    runs: tuple[str, ...] = ()


def _m(dep: Deployment, spec: SweepSpec) -> int:
    return bucket(dep.tokens, spec.token_buckets)


def _kda_proj(c: ModelConfig, d: Deployment, s: SweepSpec):
    width = c.kda_heads * c.kda_head_dim
    n = (3 + (1 if c.kda_full_rank_gate else 0)) * width  # q, k, v and the full-rank gate
    return _gemm(_m(d, s), _per_rank(n, d.tp, "the KDA q/k/v/gate width"), c.hidden)


def _mla_heads(c: ModelConfig, d: Deployment) -> int:
    return _per_rank(c.mla_heads, d.tp, "the MLA attention heads")


OPS: dict[str, OpDef] = {
    o.name: o
    for o in [
        OpDef("kda.qkvg_proj", "gemm", "kda", _kda_proj),
        OpDef("kda.o_proj", "gemm", "kda", lambda c, d, s: _gemm(
            _m(d, s), c.hidden, _per_rank(c.kda_heads * c.kda_head_dim, d.tp, "the KDA heads width"))),
        OpDef("kda.decode", "kda_decode", "kda", lambda c, d, s: (
            ("heads", _per_rank(c.kda_heads, d.tp, "the KDA heads")), ("head_dim", c.kda_head_dim),
            ("batch", bucket(d.batch, s.batch_buckets)), ("qlen", bucket(1 + d.draft, s.query_buckets)))),
        OpDef("mla.q_a", "gemm", "mla", lambda c, d, s: _gemm(_m(d, s), c.q_lora_rank, c.hidden)),
        OpDef("mla.kv_a", "gemm", "mla", lambda c, d, s: _gemm(_m(d, s), c.kv_lora_rank + c.qk_rope_dim, c.hidden)),
        OpDef("mla.q_b", "gemm", "mla", lambda c, d, s: _gemm(
            _m(d, s), _mla_heads(c, d) * (c.qk_nope_dim + c.qk_rope_dim), c.q_lora_rank)),
        OpDef("mla.gate", "gemm", "mla", lambda c, d, s: _gemm(_m(d, s), _mla_heads(c, d) * c.v_head_dim, c.hidden)),
        OpDef("mla.decode", "mla_decode", "mla", lambda c, d, s: (
            # DCP: a DCP group all-gathers its queries, so each rank runs heads x dcp over 1/dcp of the context
            ("heads", _mla_heads(c, d) * d.dcp), ("kv_lora", c.kv_lora_rank), ("rope", c.qk_rope_dim),
            ("batch", bucket(d.batch, s.batch_buckets)), ("qlen", bucket(1 + d.draft, s.query_buckets)),
            ("ctx", -(-d.context // d.dcp)))),
        OpDef("mla.o_proj", "gemm", "mla", lambda c, d, s: _gemm(
            _m(d, s), c.hidden, _mla_heads(c, d) * c.v_head_dim)),
        OpDef("moe.router_latent", "gemm", "moe", lambda c, d, s: _gemm(
            _m(d, s), _per_rank(c.num_experts + c.latent, d.tp, "router + latent width"), c.hidden)),
        OpDef("moe.shared_w13", "gemm", "moe", lambda c, d, s: _gemm(
            _m(d, s), _per_rank(2 * c.shared_intermediate, d.tp, "the shared-expert width"), c.hidden)),
        OpDef("moe.shared_w2", "gemm", "moe", lambda c, d, s: _gemm(
            _m(d, s), c.hidden, _per_rank(c.shared_intermediate, d.tp, "the shared-expert width"))),
        # row-parallel: each rank multiplies its slice of the normed latent; the partial sums join the shared
        # experts' in the block's final all-reduce
        OpDef("moe.latent_up", "gemm", "moe", lambda c, d, s: _gemm(
            _m(d, s), c.hidden, _per_rank(c.latent, d.tp, "the latent width"))),
        OpDef("moe.block", "moe_block", "moe", lambda c, d, s: (
            ("tp", d.tp), ("M", _m(d, s)), ("experts", c.num_experts), ("top_k", c.top_k),
            ("latent", c.latent), ("inter", _per_rank(c.moe_intermediate, d.tp, "the expert width")),
            ("shared_inter", _per_rank(c.shared_intermediate, d.tp, "the shared-expert width")),
            ("hidden", c.hidden), ("format", c.expert_weight_format),
            ("routing", routing.canonical_cached(s.routing, c.num_experts, c.top_k))),
              runs=("moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2")),
        # the KDA o_proj's partial sums all-reduced over the TP group of ``group`` GPUs, the residual added
        # and the next RMSNorm applied (the MoE block's input): measured on a real group of that size
        OpDef("tp.allreduce", "allreduce", "kda", lambda c, d, s: (
            ("group", d.tp), ("M", _m(d, s)), ("N", c.hidden),
            ("K", _per_rank(c.kda_heads * c.kda_head_dim, d.tp, "the KDA heads width"))), opt_in=True),
    ]
}


def op(name: str) -> OpDef:
    if name not in OPS:
        raise ConfigError(f"unknown op '{name}' (known: {', '.join(OPS)})")
    return OPS[name]


def selected_ops(spec: SweepSpec) -> list[OpDef]:
    return [op(n) for n in spec.ops] if spec.ops is not None else [o for o in OPS.values() if not o.opt_in]


def deployments(spec: SweepSpec) -> Iterator[Deployment]:
    for tp, batch, dcp, draft, ctx in product(spec.tp, spec.batch, spec.dcp, spec.draft, spec.context):
        if dcp <= tp and tp % dcp == 0:
            yield Deployment(tp, batch, dcp, draft, ctx)


def problem_at_tokens(o: OpDef, model: ModelConfig, tp: int, tokens: int, spec: SweepSpec, context: int) -> Problem:
    """A dense op's problem at ``tokens`` per step, made from its dims (a deployment of batch ``tokens``, no draft):
    what a MoE block of that many tokens asks for, up to 512, past any batch ``problem_for`` admits."""
    return Problem(o.name, o.kind, o.dims(model, Deployment(tp, tokens, 1, 0, context), spec))


def problem_for(o: OpDef, model: ModelConfig, dep: Deployment, spec: SweepSpec) -> Problem:
    validate_deployment_values(dep.tp, dep.batch, dep.dcp, dep.draft)
    for other in o.runs:  # the block runs these at its deployment: a tp they cannot shard (router + latent 4480 at
        OPS[other].dims(model, dep, spec)  # tp 3) is refused here, not by every block trial on the GPU
    return Problem(o.name, o.kind, o.dims(model, dep, spec))


@dataclass
class Plan:
    spec: SweepSpec
    model: ModelConfig
    deployments: list[Deployment]
    problems: list[Problem]  # unique, in tuning order
    shared_by: dict[Problem, int]  # problem -> how many deployments use it


def build(spec: SweepSpec, model: ModelConfig) -> Plan:
    ops = selected_ops(spec)
    deps = list(deployments(spec))
    if not deps:
        raise ConfigError(f"{spec.name}: the matrix has no valid deployment (dcp must divide tp)")
    shared: dict[Problem, int] = {}
    for dep in deps:
        for o in ops:
            p = problem_for(o, model, dep, spec)
            shared[p] = shared.get(p, 0) + 1
    problems = sorted(shared)  # by op, then shapes: neighbours are tuned close together (warm starts)
    return Plan(spec, model, deps, problems, shared)
