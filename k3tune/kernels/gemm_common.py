"""Inputs, torch reference and byte counts shared by the dense decode GEMM families: y[M,N] = x[M,K] @ W[N,K]^T."""

from __future__ import annotations

from k3tune.plan.problems import Problem

BF16 = 2


def gemm_bytes(problem: Problem) -> float:
    m, n, k = problem["M"], problem["N"], problem["K"]
    return (n * k + m * k + m * n) * BF16


def gemm_flops(problem: Problem) -> float:
    return 2.0 * problem["M"] * problem["N"] * problem["K"]


def make_inputs(problem: Problem, device, generator) -> dict:
    import torch

    m, n, k = problem["M"], problem["N"], problem["K"]
    # scaled so that outputs stay O(1): errors are then relative to a meaningful norm
    # generated where they live (the generator's device): rotation sets of hundreds of MB stay cheap
    x = torch.randn(m, k, generator=generator, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=generator, device=device) / k**0.5).to(torch.bfloat16)
    return {"x": x, "w": w}


def reference(problem: Problem, inputs: dict):
    return inputs["x"].float() @ inputs["w"].float().t()
