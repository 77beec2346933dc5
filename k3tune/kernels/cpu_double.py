"""CPU test double for the dense GEMM op: a real K-chunked matmul that the CPU backend times in real worker
processes, so the sweep's failure handling is exercised without a GPU.

Faults are injected only here, and only when K3TUNE_TEST_FAULTS names configs, e.g.
``block_k=128:crash,block_k=256:hang,block_k=512:wrong,block_k=64:raise``:
crash kills the worker process (SIGSEGV), hang never returns, wrong returns a wrong result, raise fails at
run time the way a poisoned CUDA context does. ``slot=N:dead`` plays a GPU lost mid-sweep: the worker of
pool slot N is killed on its first trial and every restart of it fails to start.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from k3tune.kernels import gemm_common
from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.plan.problems import Problem


@dataclass(frozen=True)
class CpuGemmConfig(KernelConfig):
    block_k: int = 256


def _faults() -> dict[int, str]:
    spec = os.environ.get("K3TUNE_TEST_FAULTS", "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        cond, _, fault = item.partition(":")
        if cond.startswith("block_k="):
            out[int(cond.split("=")[1])] = fault
    return out


def dead_slot() -> bool:
    """True in the worker of a pool slot that K3TUNE_TEST_FAULTS marks ``slot=N:dead``."""
    me = os.environ.get("K3TUNE_WORKER_SLOT")
    return me is not None and f"slot={me}:dead" in os.environ.get("K3TUNE_TEST_FAULTS", "").replace(" ", "")


def check_device() -> None:
    """Start-up check of the CPU backend's 'device': fails in restarts of a dead slot's worker."""
    if dead_slot() and os.environ.get("K3TUNE_WORKER_RESTARTS", "0") != "0":
        raise RuntimeError("injected fault: device lost")


class CpuGemm(KernelFamily):
    name = "testing.cpu_gemm"
    kinds = frozenset({"gemm"})
    config_cls = CpuGemmConfig
    backends = frozenset({"cpu"})
    priority = 90
    depends_on = ("k3tune.kernels.gemm_common",)  # inputs, the fp32 reference and the split-K reduce kernel

    def space(self, problem: Problem) -> dict[str, tuple]:
        return {"block_k": tuple(b for b in (64, 128, 256, 512, 1024) if b <= problem["K"])}

    def work(self, problem: Problem, cfg: CpuGemmConfig) -> Work:
        return Work(gemm_common.gemm_bytes(problem), gemm_common.gemm_flops(problem), 1, 4096)

    make_inputs = staticmethod(lambda problem, device, generator: gemm_common.make_inputs(problem, device, generator))

    def weight_names(self, problem: Problem) -> tuple[str, ...]:
        return ("w",)

    def reference(self, problem: Problem, inputs: dict):
        return gemm_common.reference(problem, inputs)

    def build(self, problem: Problem, cfg: CpuGemmConfig):
        import torch

        fault = _faults().get(cfg.block_k)

        def run(inputs: dict):
            if dead_slot():
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            if fault == "hang":
                time.sleep(3600)
            if fault == "raise":
                raise RuntimeError("injected fault: illegal memory access")
            x, w = inputs["x"].float(), inputs["w"].float()
            acc = torch.zeros(x.shape[0], w.shape[0])
            for k0 in range(0, x.shape[1], cfg.block_k):
                acc += x[:, k0 : k0 + cfg.block_k] @ w[:, k0 : k0 + cfg.block_k].t()
            if fault == "wrong":
                acc[:, ::2] = 0.5
            return acc.bfloat16()

        return run
