"""MLA decode over the latent KV cache (absorbed form), one rank's share under decode context parallelism.

Per rank: ``heads`` query heads (the DCP group's queries gathered), each query of ``kv_lora + rope`` dims
attends over ``ctx`` cached latent vectors of the same width; values are the first ``kv_lora`` dims.
Decode is bound by reading the cache: batch x ctx x (kv_lora + rope) x 2 bytes.

``mla.torch`` is the torch baseline (two batched matmuls and a softmax). ``mla.splitkv`` declares the space
of a split-KV kernel (splits over the context, heads per CTA) for the simulated backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.plan.problems import Problem


def cache_bytes(problem: Problem) -> float:
    return problem["batch"] * problem["ctx"] * (problem["kv_lora"] + problem["rope"]) * 2.0


def flops(problem: Problem) -> float:
    b, q, h, c = problem["batch"], problem["qlen"], problem["heads"], problem["ctx"]
    return 2.0 * b * q * h * c * (2 * problem["kv_lora"] + problem["rope"])


def make_inputs(problem: Problem, device, generator) -> dict:
    import torch

    b, q, h, c = problem["batch"], problem["qlen"], problem["heads"], problem["ctx"]
    w = problem["kv_lora"] + problem["rope"]
    return {
        "q": torch.randn(b, q * h, w, generator=generator, device=device).bfloat16(),
        "kv": torch.randn(b, c, w, generator=generator, device=device).bfloat16(),
    }


def _attend(problem: Problem, inputs: dict, dtype):
    import torch

    w = problem["kv_lora"] + problem["rope"]
    q, kv = inputs["q"].to(dtype), inputs["kv"].to(dtype)
    scores = torch.bmm(q, kv.transpose(1, 2)) * w**-0.5
    return torch.bmm(scores.softmax(-1), kv[..., : problem["kv_lora"]])


@dataclass(frozen=True)
class MlaTorchConfig(KernelConfig):
    pass


class MlaTorch(KernelFamily):
    name = "mla.torch"
    kinds = frozenset({"mla_decode"})
    config_cls = MlaTorchConfig
    backends = frozenset({"gpu", "simulated", "cpu"})
    priority = 10

    def work(self, problem: Problem, cfg: MlaTorchConfig) -> Work:
        scores = problem["batch"] * problem["qlen"] * problem["heads"] * problem["ctx"] * 4.0
        return Work(
            hbm_bytes=2 * cache_bytes(problem) + 4 * scores,
            flops=flops(problem),
            ctas=max(1, problem["batch"] * 8),
            inflight_bytes_per_cta=32 * 1024,
            tensor_cores=True,
            launches=5,
        )

    make_inputs = staticmethod(make_inputs)

    def weight_names(self, problem: Problem) -> tuple[str, ...]:
        return ("kv",)

    def reference(self, problem: Problem, inputs: dict):
        import torch

        return _attend(problem, inputs, torch.float32)

    def build(self, problem: Problem, cfg: MlaTorchConfig):
        import torch

        return lambda inputs: _attend(problem, inputs, torch.bfloat16)


@dataclass(frozen=True)
class MlaSplitKvConfig(KernelConfig):
    num_splits: int = 4
    heads_per_cta: int = 16


class MlaSplitKv(KernelFamily):
    name = "mla.splitkv"
    kinds = frozenset({"mla_decode"})
    config_cls = MlaSplitKvConfig
    backends = frozenset({"simulated"})
    declared_only = True
    priority = 30

    def space(self, problem: Problem) -> dict[str, tuple]:
        rows = problem["heads"] * problem["qlen"]
        return {
            "num_splits": tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if problem["ctx"] // s >= 256),
            "heads_per_cta": tuple(x for x in (16, 32, 64) if x <= max(16, rows)),
        }

    def work(self, problem: Problem, cfg: MlaSplitKvConfig) -> Work:
        rows = problem["heads"] * problem["qlen"]
        head_tiles = math.ceil(rows / cfg.heads_per_cta)
        ctas = problem["batch"] * head_tiles * cfg.num_splits
        combine = problem["batch"] * rows * cfg.num_splits * problem["kv_lora"] * 4.0 * 2
        return Work(
            hbm_bytes=cache_bytes(problem) * head_tiles ** 0.5 + combine,
            flops=flops(problem) * cfg.heads_per_cta * head_tiles / rows,
            ctas=ctas,
            inflight_bytes_per_cta=32 * 1024,
            tensor_cores=True,
            launches=2 if cfg.num_splits > 1 else 1,
            extra_us=0.2,
        )
