"""The per-rank MoE block at decode, as one tunable unit (the spaces the MoE issue makes real).

Phases: router + latent down-projection (split across TP, gathered), sigmoid top-k routing, routed experts
(grouped w13, SiTU, w2) over the experts the tokens selected, RMSNorm + latent up-projection; the 2 shared
experts run beside them on their own SMs; the TP all-reduce closes the block (emulated on one GPU).

``moe.stock`` is what a stock engine runs (everything serial, router replicated). ``moe.overlap`` declares
the tuned block's knobs: grouped-expert variant, N tile and split-K, SMs given to the shared expert (0 =
serial) and the L2 prefetch size (MiB pulled into L2 while routing leaves HBM idle; 0 = off). Both are
``declared_only`` until the MoE block executor lands: they run on the simulated backend alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.plan import routing
from k3tune.plan.problems import Problem

MIB = 1 << 20


def weight_bytes_per_element(fmt: str) -> float:
    return 0.5 + 1 / 32 if fmt == "mxfp4" else 2.0  # MXFP4: 4-bit values, one e8m0 scale per 32


def experts_touched(problem: Problem) -> float:
    """Expected distinct experts selected by M tokens choosing top_k of E under the problem's routing."""
    return routing.expected_touched(str(problem["routing"]), problem["experts"], problem["top_k"], problem["M"])


def expert_bytes(problem: Problem) -> float:
    per = problem["latent"] * problem["inter"] * 3 * weight_bytes_per_element(str(problem["format"]))
    return per * experts_touched(problem)


def _gemm_work(m: int, n: int, k: int, ctas: int, inflight: int, tensor: bool, launches=1, sm_limit=None) -> Work:
    return Work(hbm_bytes=2.0 * (n * k + m * k + m * n), flops=2.0 * m * n * k, ctas=ctas,
                inflight_bytes_per_cta=inflight, tensor_cores=tensor, launches=launches, sm_limit=sm_limit)


def allreduce_us(problem: Problem, hw) -> float:
    tp, m, h = problem["tp"], problem["M"], problem["hidden"]
    return 4.0 + 2 * (tp - 1) / tp * m * h * 2 / (hw.nvlink_gbps * 1e9) * 1e6


@dataclass(frozen=True)
class MoeStockConfig(KernelConfig):
    pass


class MoeStock(KernelFamily):
    name = "moe.stock"
    kinds = frozenset({"moe_block"})
    config_cls = MoeStockConfig
    backends = frozenset({"simulated"})
    declared_only = True
    priority = 10

    def simulate_us(self, problem: Problem, cfg: MoeStockConfig, hw, roofline_us) -> float:
        m, hid, lat, sh = problem["M"], problem["hidden"], problem["latent"], problem["shared_inter"]
        e = problem["experts"]
        t = roofline_us(_gemm_work(m, e + lat, hid, 70, 24576, True), hw)  # replicated router + latent
        t += 3 * hw.graph_launch_us  # top-k, sort, gather
        experts = Work(hbm_bytes=expert_bytes(problem) * 2.0 / weight_bytes_per_element(str(problem["format"])),
                       flops=0, ctas=int(experts_touched(problem) * 4), inflight_bytes_per_cta=16384,
                       tensor_cores=True, launches=3)
        t += roofline_us(experts, hw)
        t += roofline_us(_gemm_work(m, hid, lat, 56, 24576, True, launches=2), hw)  # norm + latent up
        t += roofline_us(_gemm_work(m, 2 * sh, hid, 96, 24576, True, launches=2), hw)
        t += roofline_us(_gemm_work(m, hid, sh, 56, 24576, True), hw)
        return t + allreduce_us(problem, hw)


@dataclass(frozen=True)
class MoeOverlapConfig(KernelConfig):
    variant: str = "grouped_tc"
    tile_n: int = 128
    split_k: int = 1
    shared_sms: int = 0
    prefetch_mib: int = 0


class MoeOverlap(KernelFamily):
    name = "moe.overlap"
    kinds = frozenset({"moe_block"})
    config_cls = MoeOverlapConfig
    backends = frozenset({"simulated"})
    declared_only = True
    priority = 30

    def space(self, problem: Problem) -> dict[str, tuple]:
        return {
            "variant": ("grouped_tc", "grouped_fma") if problem["M"] <= 16 else ("grouped_tc",),
            "tile_n": (64, 128, 256),
            "split_k": (1, 2, 4),
            "shared_sms": (0, 8, 16, 24, 32, 40, 48, 64),
            "prefetch_mib": (0, 2, 4, 8, 16, 32),
        }

    def default(self, problem: Problem) -> MoeOverlapConfig:
        return MoeOverlapConfig(shared_sms=16)

    def simulate_us(self, problem: Problem, cfg: MoeOverlapConfig, hw, roofline_us) -> float:
        m, tp, hid, lat = problem["M"], problem["tp"], problem["hidden"], problem["latent"]
        sh, e = problem["shared_inter"], problem["experts"]
        sms = hw.sm_count
        router = roofline_us(_gemm_work(m, (e + lat) // tp, hid, max(8, (e + lat) // tp // 16), 8192, False), hw)
        gather = 3.0 + m * (e + lat) * 2 / (hw.nvlink_gbps * 1e9) * 1e6
        routing = 2 * hw.graph_launch_us
        touched = experts_touched(problem)
        n_tiles = math.ceil(2 * problem["inter"] / cfg.tile_n)
        routed_sms = sms - cfg.shared_sms
        fma_penalty = 1.0 if cfg.variant == "grouped_tc" else (0.85 if m <= 4 else 1.25)
        experts = Work(hbm_bytes=expert_bytes(problem) * fma_penalty, flops=2.0 * m * problem["top_k"] * lat * problem["inter"] * 3,
                       ctas=int(touched * n_tiles * cfg.split_k), inflight_bytes_per_cta=cfg.tile_n * 256,
                       tensor_cores=cfg.variant == "grouped_tc", launches=2 + (cfg.split_k > 1), sm_limit=routed_sms,
                       ctas_per_sm=4, extra_us=0.3 * cfg.split_k)
        up = _gemm_work(m, hid, lat, 112, 16384, True, launches=2, sm_limit=routed_sms)
        routed = roofline_us(experts, hw) + roofline_us(up, hw)
        shared_w = [_gemm_work(m, 2 * sh // 1, hid, 96, 16384, True, sm_limit=cfg.shared_sms or sms),
                    _gemm_work(m, hid, sh, 56, 16384, True, sm_limit=cfg.shared_sms or sms)]
        shared = sum(roofline_us(w, hw) for w in shared_w)
        if cfg.shared_sms == 0:
            body = routed + shared
        else:
            both = (expert_bytes(problem) + sum(w.hbm_bytes for w in shared_w)) / hw.copy_bw * 1e6
            body = max(routed, shared, both) + 1.0  # + the cross-stream join
        # prefetch: the next op's weights stream into L2 while routing and the gather leave HBM idle
        idle_bytes = (routing + gather) * 1e-6 * hw.copy_bw
        pf = cfg.prefetch_mib * MIB
        useful = min(pf, idle_bytes, hw.l2_bytes * 0.4, 2.0 * hid * lat)
        gain = useful / hw.copy_bw * 1e6
        waste = max(0.0, pf - idle_bytes) / hw.copy_bw * 1e6 * 0.5 + (2.0 if pf > hw.l2_bytes * 0.4 else 0.0)
        launch = hw.graph_launch_us * 0.5 if pf else 0.0
        return router + gather + routing + body - gain + waste + launch + allreduce_us(problem, hw)
