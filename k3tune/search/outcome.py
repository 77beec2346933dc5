"""What a measurement backend returns for one candidate, and how samples are summarised."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    task_id: int
    problem: object  # k3tune.plan.problems.Problem (pickled to the worker)
    family: str
    params: dict
    round: int
    samples: int


@dataclass(frozen=True)
class Outcome:
    status: str  # a TrialStatus value
    median_us: float | None = None
    spread_us: float | None = None  # interquartile range
    samples: int = 0
    compile_s: float | None = None
    error: str | None = None
    poisoned: bool = False  # the worker's context can no longer be trusted: replace the worker


def summarize(times_us: list[float], **kw) -> Outcome:
    q = statistics.quantiles(times_us, n=4, method="inclusive") if len(times_us) > 1 else [times_us[0]] * 3
    return Outcome("ok", median_us=statistics.median(times_us), spread_us=q[2] - q[0], samples=len(times_us), **kw)


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp32; NaN anywhere (an unwritten, poisoned output) gives inf."""
    import torch

    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.float().norm().item() or 1.0
    return (out - ref.float()).norm().item() / denom
