"""KDA (Kimi Delta Attention) recurrent decode: per head, an fp32 state S[Dk, Dv] updated once per token.

Per token t (q, k, v, gate g per key channel, beta scalar):
    S <- diag(exp(g)) S;   S <- S + beta * k (v - S^T k)^T;   o = S^T q
Decode is bound by reading and writing the state (batch x heads x Dk x Dv x 4 bytes, twice).

``kda.torch`` is the torch baseline (a loop over the draft tokens). ``kda.fused`` declares the space of a
fused kernel (heads per CTA, Dv split) for the simulated backend; its GPU code has not landed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.plan.problems import Problem


def state_bytes(problem: Problem) -> float:
    d = problem["head_dim"]
    return problem["batch"] * problem["heads"] * d * d * 4.0


def io_bytes(problem: Problem) -> float:
    b, h, q, d = problem["batch"], problem["heads"], problem["qlen"], problem["head_dim"]
    return b * q * h * (5 * d + 1) * 2.0  # q, k, v, g, out in bf16, beta


def make_inputs(problem: Problem, device, generator) -> dict:
    import torch

    b, h, q, d = problem["batch"], problem["heads"], problem["qlen"], problem["head_dim"]

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device=device) * scale

    k = torch.nn.functional.normalize(rnd(b, q, h, d), dim=-1)
    return {
        "q": rnd(b, q, h, d, scale=d**-0.5).bfloat16(),
        "k": k.bfloat16(),
        "v": rnd(b, q, h, d).bfloat16(),
        "g": (-torch.rand(b, q, h, d, generator=generator, device=device) * 0.5).bfloat16(),
        "beta": torch.rand(b, q, h, generator=generator, device=device).bfloat16(),
        "state": rnd(b, h, d, d, scale=0.1),
    }


def recurrence(inputs: dict, dtype):
    """The KDA decode recurrence; returns (out[b,q,h,d], new state). Shared by the reference and the baseline."""
    s = inputs["state"].to(dtype).clone()
    outs = []
    for t in range(inputs["q"].shape[1]):
        q, k, v = (inputs[n][:, t].to(dtype) for n in ("q", "k", "v"))
        g, beta = inputs["g"][:, t].to(dtype), inputs["beta"][:, t].to(dtype)
        s = s * g.exp().unsqueeze(-1)
        pred = (s * k.unsqueeze(-1)).sum(-2)  # S^T k: [b,h,Dv]
        s = s + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - pred).unsqueeze(-2)
        outs.append((s * q.unsqueeze(-1)).sum(-2))
    return outs, s


@dataclass(frozen=True)
class KdaTorchConfig(KernelConfig):
    pass


class KdaTorch(KernelFamily):
    name = "kda.torch"
    kinds = frozenset({"kda_decode"})
    config_cls = KdaTorchConfig
    backends = frozenset({"gpu", "simulated", "cpu"})
    priority = 10

    def work(self, problem: Problem, cfg: KdaTorchConfig) -> Work:
        q = problem["qlen"]
        # each elementwise step re-reads and re-writes the state: about 6 passes per token
        return Work(
            hbm_bytes=6 * q * 2 * state_bytes(problem) + io_bytes(problem),
            flops=8.0 * q * state_bytes(problem) / 4,
            ctas=max(1, int(state_bytes(problem) // 65536)),
            inflight_bytes_per_cta=16 * 1024,
            launches=8 * q,
        )

    make_inputs = staticmethod(make_inputs)

    def weight_names(self, problem: Problem) -> tuple[str, ...]:
        return ("state",)

    def reference(self, problem: Problem, inputs: dict):
        import torch

        outs, _ = recurrence(inputs, torch.float32)
        return torch.stack(outs, dim=1)

    def build(self, problem: Problem, cfg: KdaTorchConfig):
        import torch

        def run(inputs: dict):
            outs, _ = recurrence(inputs, torch.float32)
            return torch.stack(outs, dim=1).bfloat16()

        return run


@dataclass(frozen=True)
class KdaFusedConfig(KernelConfig):
    heads_per_cta: int = 1
    v_split: int = 4


class KdaFused(KernelFamily):
    name = "kda.fused"
    kinds = frozenset({"kda_decode"})
    config_cls = KdaFusedConfig
    backends = frozenset({"simulated"})
    declared_only = True
    priority = 30

    def space(self, problem: Problem) -> dict[str, tuple]:
        h, d = problem["heads"], problem["head_dim"]
        return {
            "heads_per_cta": tuple(x for x in (1, 2, 4) if h % x == 0),
            "v_split": tuple(x for x in (1, 2, 4, 8) if d % (x * 16) == 0),
        }

    def work(self, problem: Problem, cfg: KdaFusedConfig) -> Work:
        ctas = problem["batch"] * problem["heads"] // cfg.heads_per_cta * cfg.v_split
        per_cta = state_bytes(problem) / ctas
        return Work(
            hbm_bytes=2 * state_bytes(problem) + io_bytes(problem) * cfg.v_split ** 0.5,
            flops=8.0 * problem["qlen"] * state_bytes(problem) / 4,
            ctas=ctas,
            inflight_bytes_per_cta=min(per_cta, 32 * 1024),
            ctas_per_sm=4,
            extra_us=0.4 * problem["qlen"] / cfg.v_split ** 0.5 + 0.1 * math.log2(cfg.heads_per_cta),
        )
