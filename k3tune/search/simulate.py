"""The simulated backend: an analytic roofline model of each kernel family on a published hardware spec,
with seeded measurement noise so that a simulated sweep exercises the search's noise handling.

Its results are labelled ``simulated`` and never served as measurements.

Model of one launch: launch cost inside a CUDA graph, plus the larger of memory time and compute time.
Memory time uses Little's law: bandwidth = min(copy bandwidth, bytes in flight / HBM latency), where bytes in
flight come from the CTAs resident at once; a grid that does not fill whole waves pays for its tail.
"""

from __future__ import annotations

import hashlib
import math
import random

from k3tune.errors import CannotImplement
from k3tune.kernels import family as get_family
from k3tune.kernels.base import Work
from k3tune.plan.hardware import HardwareSpec
from k3tune.search.outcome import Outcome, Task, summarize

HBM_LATENCY_S = 0.8e-6
NOISE_SIGMA = 0.02  # per-sample jitter
RUN_SIGMA = 0.008  # per-trial offset: re-measuring a config moves it a little
OUTLIER_P, OUTLIER_X = 0.05, 1.35


def roofline_us(work: Work, hw: HardwareSpec) -> float:
    sms = min(hw.sm_count, work.sm_limit or hw.sm_count)
    slots = max(1, sms * work.ctas_per_sm)
    resident = min(work.ctas, slots)
    bw = min(hw.copy_bw, resident * work.inflight_bytes_per_cta / HBM_LATENCY_S)
    waves = work.ctas / slots
    tail = math.ceil(waves) / waves if waves > 1 else 1.0
    mem_s = work.hbm_bytes / bw * tail
    rate = hw.bf16_tflops if work.tensor_cores else hw.fp32_tflops
    compute_s = work.flops / (rate * 1e12 * sms / hw.sm_count)
    return work.launches * hw.graph_launch_us + max(mem_s, compute_s) * 1e6 + work.extra_us


def model_us(task: Task, hw: HardwareSpec) -> float:
    fam = get_family(task.family)
    cfg = fam.config_from_params(task.problem, task.params)
    if hasattr(fam, "simulate_us"):
        return fam.simulate_us(task.problem, cfg, hw, roofline_us)
    return roofline_us(fam.work(task.problem, cfg), hw)


class SimulatedBackend:
    kind = "simulated"

    def __init__(self, hw: HardwareSpec, seed: int = 0):
        self.hw = hw
        self.seed = seed

    def measure(self, task: Task) -> Outcome:
        if not get_family(task.family).supports(self.hw.arch):  # the driver never asks: a guard
            return Outcome("invalid", error=f"{task.family} has no code for {self.hw.arch}")
        try:
            base = model_us(task, self.hw)
        except CannotImplement as e:
            return Outcome("invalid", error=str(e))
        h = hashlib.sha256(f"{self.seed}|{task.problem.key}|{task.family}|{sorted(task.params.items())}|{task.round}"
                           .encode()).digest()
        rng = random.Random(int.from_bytes(h[:8], "little"))
        offset = math.exp(rng.gauss(0.0, RUN_SIGMA))
        times = []
        for _ in range(task.samples):
            t = base * offset * math.exp(rng.gauss(0.0, NOISE_SIGMA))
            if rng.random() < OUTLIER_P:
                t *= OUTLIER_X
            times.append(t)
        return summarize(times, compile_s=0.0)
