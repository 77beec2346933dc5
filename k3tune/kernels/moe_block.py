"""The per-rank MoE block at decode, as one tunable unit (the spaces the MoE issue makes real).

Phases: router + latent down-projection (split across TP, gathered), sigmoid top-k routing, routed experts
(grouped w13, SiTU, w2) over the experts the tokens selected, RMSNorm + latent up-projection; the 2 shared
experts run beside them on their own SMs; the TP all-reduce closes the block (emulated on one GPU).

``moe.stock`` is what a stock engine runs (everything serial, router replicated). ``moe.overlap`` is the
tuned block: the routed-expert kernels' tiles (w13 rows/warps/unroll, w2 rows/warps), the SMs given to the
shared experts (0 = serial after the routed experts; else a green-context partition of that many SMs, or "all": a
plain side stream, every SM, s37-r1) and
the L2 prefetch size (MiB of the latent up-projection pulled into L2 while routing leaves HBM idle; 0 = off).

On a GPU both run through the MoE block executor (k3tune/runtime/moe.py), with bf16 or MXFP4 experts (MXFP4
only on the tensor-core expert kernels, which dequantise in registers). A trial builds fresh random weights of
the problem's true per-rank shapes, imposes a routing sampled from the problem's routing model (so every variant reads
the same experts), checks the block against the fp32 reference, then times it. The block's weights exceed
L2 several times, so no weight rotation is needed. The TP collectives are emulated: stand-ins that occupy
the GPU for the time this GPU's NVLink (its hardware spec) would take, without touching HBM.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from k3tune.kernels.base import KernelConfig, KernelFamily, Work
from k3tune.plan import links, routing
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
    return links.LATENCY_US + 2 * (tp - 1) / tp * m * h * 2 / (hw.nvlink_gbps * 1e9) * 1e6


class _BlockOnGpu:
    """The measurer's interface for a block family, through the runtime executor (bf16 experts on a GPU).

    A deliberate exception to 'kernels know nothing of databases': a block's measured time must include
    the dense kernels it will be served with, and those come from the tuning database through the runtime
    selector; so measuring a block builds the runtime's executor (imported lazily, at measurement time)."""
    depends_on = ("k3tune.kernels.moe_experts", "k3tune.kernels.moe_experts_tc", "k3tune.kernels.l2_prefetch",
                  "k3tune.runtime.moe", "k3tune.runtime.dense", "k3tune.runtime.partition", "k3tune.kernels.mxfp4",
                  "k3tune.plan.links")

    def runs_on(self, problem: Problem, backend: str) -> bool:
        # MXFP4 on a GPU: the tuned path's tensor-core kernels; the stock path runs bf16 only
        return backend != "gpu" or problem["format"] == "bf16" or self.path == "tuned"

    def weight_names(self, problem: Problem) -> tuple[str, ...]:
        return ()

    def make_inputs(self, problem: Problem, device, generator) -> dict:
        import random

        import torch

        from k3tune.runtime.moe import random_weights

        shape = block_shape(problem)
        seed = int(torch.randint(0, 1 << 30, (1,), generator=generator, device=generator.device).item())
        w = random_weights(shape, problem["tp"], fmt=str(problem["format"]), device=device, seed=seed)
        # one routing draw per problem, the same for every trial: which experts (how many, how many tokens each)
        # decides the bytes read, so trials on different draws were not comparable (skewed routing at batch 8
        # touches 60-90 experts draw to draw); the weights stay fresh per trial
        ids = routing.sample(str(problem["routing"]), shape.experts, shape.top_k, problem["M"],
                             random.Random(problem.key))
        x = torch.randn(problem["M"], shape.hidden, device=device, generator=generator).to(torch.bfloat16)
        return {"x": x, "weights": w, "top": torch.tensor(ids, device=device, dtype=torch.int32)}

    def reference(self, problem: Problem, inputs: dict):
        from k3tune.runtime.moe import reference, virtual_full

        out, _, _ = reference(inputs["x"], virtual_full(inputs["weights"]), block_shape(problem), top=inputs["top"])
        return out

    def build(self, problem: Problem, cfg):
        from k3tune.plan.hardware import detect
        from k3tune.runtime.moe import EmulatedComm, MoEBlock

        found = detect()
        hw = found[1] if found else None  # collectives: stand-ins timed by this GPU's own NVLink (plan.links)
        comm = EmulatedComm.for_target(hw.key, problem["tp"]) if hw else EmulatedComm(problem["tp"])
        blocks: dict = {}

        def run(inputs: dict):
            key = id(inputs["weights"])
            if key not in blocks:
                blocks.clear()
                blk = MoEBlock.build(inputs["weights"], self.path, batch=problem["M"], selector=_selector(),
                                     comm=comm, **self.block_knobs(cfg))
                blk.force_top = inputs["top"]
                blocks[key] = blk
            return blocks[key](inputs["x"])

        return run

    def block_knobs(self, cfg) -> dict:
        return {}


def block_shape(problem: Problem):
    from k3tune.runtime.moe import BlockShape

    tp = problem["tp"]
    return BlockShape(hidden=problem["hidden"], experts=problem["experts"], top_k=problem["top_k"],
                      latent=problem["latent"], inter=problem["inter"] * tp, shared_inter=problem["shared_inter"] * tp)


@functools.cache
def _selector():
    """This GPU's measured dense kernels (the shipped database), loaded once per worker process."""
    from k3tune.runtime import Selector

    return Selector.load()


def _partition(sms: int, rest: bool):
    """(shared experts' stream, routed experts' stream or None): the current device's SMs split ``sms`` / the rest,
    the rest on its own green context only when the routed experts are confined to it."""
    from k3tune.runtime.partition import shared_partition

    split = shared_partition(sms, rest=rest)
    return split.shared.stream, (split.rest.stream if rest else None)


@dataclass(frozen=True)
class MoeStockConfig(KernelConfig):
    pass


class MoeStock(_BlockOnGpu, KernelFamily):
    name = "moe.stock"
    kinds = frozenset({"moe_block"})
    config_cls = MoeStockConfig
    backends = frozenset({"simulated", "gpu"})
    priority = 10
    path = "stock"

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
    w13_rows: int = 4
    w13_warps: int = 4
    w13_unroll: int = 4
    w2_rows: int = 4
    w2_warps: int = 4
    w2_unroll: int = 1
    w2_lanes: int = 8  # lanes sharing a w2 row (its K is 192-384: 24-48 vectors)
    group: int = 1  # tokens of one expert per work item (its weight tile read once for them)
    shared_sms: int | str = 0  # 0: serial; SMs of a green-context partition; "all": a plain side stream (every SM)
    routed_on: str = "all"  # with shared_sms > 0: "all" SMs (only the shared experts are confined) or the "rest"
    prefetch_mib: int = 0
    experts_kernel: str = "cuda_core"  # or "tensor_core" (moe_experts_tc: mma.sync; MXFP4 needs it)
    tc13_mt: int = 1  # tensor-core w13: row tiles per warp, warps over rows / over K, load batch
    tc13_wn: int = 2
    tc13_wk: int = 2
    tc13_unroll: int = 2
    tc2_mt: int = 1  # tensor-core w2
    tc2_wn: int = 4
    tc2_wk: int = 1
    tc2_unroll: int = 2
    tc13_rl: int = 1  # row tiles a CTA computes per work item (the item's header loaded once for them)
    tc2_rl: int = 1
    tc_early: int = 0  # the epilogue's slot ids/weights loaded with the item header (s19-r1: MXFP4 faster, bf16 slower)
    tc13_dq: int = 0  # MXFP4 decode layout per kernel: 1 = codes repacked for a rotate-and-mask decode
    tc2_dq: int = 0  # (moe_experts_tc.pack_codes; s20: w2 steps 4-6% faster; s27: w13 3-8% through its ring); not bf16
    tc13_pf: int = 0  # load batches ahead whose weights each warp pulls into L2 (bf16 only: s21-r1)
    tc2_pf: int = 0
    tc13_ring: int = 0  # stages of the shared-memory weight ring (s21-r8, MXFP4 w13 with 2: experts step 2-10% faster)
    tc2_ring: int = 0
    # 1: the block's own kernels (route, experts, SiTU, norm, the collectives' stand-ins) launch as programmatic
    # dependents, each launch overlapping the kernel before it on its stream (the dense GEMMs have their own pdl)
    pdl: int = 0


class MoeOverlap(_BlockOnGpu, KernelFamily):
    name = "moe.overlap"
    kinds = frozenset({"moe_block"})
    config_cls = MoeOverlapConfig
    backends = frozenset({"simulated", "gpu"})
    priority = 30
    path = "tuned"
    # a prefetch size, PDL or an SM split is recorded only where it pays beyond the noise: the leader is remeasured
    # with each off, and a tie goes to off (0 shared SMs: the shared experts run serially, on every SM)
    off = {"prefetch_mib": 0, "pdl": 0, "shared_sms": 0}

    def space(self, problem: Problem) -> dict[str, tuple]:
        tc = {"experts_kernel": ("cuda_core", "tensor_core") if problem["format"] == "bf16" else ("tensor_core",),
              "tc13_mt": (1, 2), "tc13_wn": (1, 2, 4), "tc13_wk": (1, 2, 4), "tc13_unroll": (1, 2, 4),
              "tc2_mt": (1, 2), "tc2_wn": (1, 2, 4), "tc2_wk": (1, 2), "tc2_unroll": (1, 2),
              "tc13_rl": (1, 2, 4), "tc2_rl": (1, 2, 4, 8), "tc_early": (0, 1),
              **{k: (0, 1) if problem["format"] != "bf16" else (0,) for k in ("tc13_dq", "tc2_dq")},
              # s21-r1: pf 1 made the bf16 experts step 2-24% faster (pf 2 slower from b8 on), MXFP4's 5-13% slower
              **{k: (0, 1) if problem["format"] == "bf16" else (0,) for k in ("tc13_pf", "tc2_pf")},
              # s22-r2/r3: all 35 tensor-core blocks (MXFP4 and bf16 Zipf) chose w2 without a ring
              "tc13_ring": (0, 2, 3), "tc2_ring": (0,)}
        return tc | {
            "w13_rows": (2, 4, 8),
            "w13_warps": (2, 4, 8),
            "w13_unroll": (1, 2, 4),
            "w2_rows": (2, 4, 8, 16),
            "w2_warps": (1, 2, 4),
            "w2_unroll": (1, 2),
            "w2_lanes": (4, 8, 16, 32),
            "group": (1, 2, 4, 8, 16, 32),  # tokens per work item (16, 32: the tensor-core kernels' hot experts)
            # 64 of an H200's 132 is the even split; "all": a plain side stream, no partition (s37-r1: at MXFP4 TP8
            # b1/b4/b64 and TP16 b2 1-6% faster than the served block, at TP16 b4 and bf16 TP16 b8 5-8% slower)
            "shared_sms": (0, 8, 16, 24, 32, 40, 48, 64, "all"),
            # the routed experts on every SM beside the confined shared experts, or on the SMs they leave
            "routed_on": ("all", "rest"),
            "prefetch_mib": (0, 4, 8, 16, 32),
            "pdl": (0, 1),
        }

    _TC_KNOBS = ("tc13_mt", "tc13_wn", "tc13_wk", "tc13_unroll", "tc2_mt", "tc2_wn", "tc2_wk", "tc2_unroll",
                 "tc13_rl", "tc2_rl", "tc_early", "tc13_dq", "tc2_dq", "tc13_pf", "tc2_pf",
                 "tc13_ring", "tc2_ring")
    _CC_KNOBS = ("w13_rows", "w13_warps", "w13_unroll", "w2_rows", "w2_warps", "w2_unroll", "w2_lanes")

    def canonical(self, params: dict) -> dict:
        """The expert kernel that does not run ignores its knobs; serial (0 shared SMs) has nothing to split."""
        base = MoeOverlapConfig()
        ignored = self._TC_KNOBS if params.get("experts_kernel") == "cuda_core" else self._CC_KNOBS
        out = {**params, **{k: getattr(base, k) for k in ignored if k in params}}
        if out.get("shared_sms") in (0, "all"):  # nothing to split, or no partition to leave
            out["routed_on"] = "all"
        return out

    def valid(self, cfg: MoeOverlapConfig, problem: Problem) -> bool:
        # registers of a lane's load batch (16-byte vectors = 4 registers: weight rows and the item's tokens)
        # and its accumulators (rows x tokens): keep clear of spills; an item never holds more than M tokens
        p = cfg.group
        if cfg.shared_sms in (0, "all") and cfg.routed_on != "all":
            return False  # serial, or a plain stream: nothing to split
        if problem["format"] != "bf16" and cfg.experts_kernel != "tensor_core":
            return False  # MXFP4 experts: only the tensor-core kernels dequantise in registers
        if cfg.experts_kernel == "tensor_core":  # items of up to 8, 16 or 32 tokens (1, 2 or 4 MMA N tiles)
            from k3tune.kernels.moe_experts_tc import SMEM_BUDGET, reduction_bytes

            c13, c2 = self._tc_cfgs(cfg)
            return (p <= max(1, problem["M"]) and p <= 32 and c13.tokens >= p  # and the K reduction fits
                    and reduction_bytes(c13, True) <= SMEM_BUDGET and reduction_bytes(c2, False) <= SMEM_BUDGET)
        return (p <= max(1, problem["M"]) and 4 * (2 * cfg.w13_rows + p) * cfg.w13_unroll <= 160
                and 2 * cfg.w13_rows * p <= 64 and 4 * (cfg.w2_rows + p) * cfg.w2_unroll <= 160
                and cfg.w2_rows * p <= 64)

    @staticmethod
    def _tc_cfgs(cfg: MoeOverlapConfig):
        from k3tune.kernels.moe_experts_tc import TcExpertConfig

        nt = -(-cfg.group // 8)  # 8-token MMA tiles per work item: a hot expert's tokens read its weights once
        return (TcExpertConfig(cfg.tc13_mt, cfg.tc13_wn, cfg.tc13_wk, nt, cfg.tc13_unroll, cfg.tc_early, cfg.tc13_rl,
                               cfg.tc13_dq, cfg.tc13_pf, cfg.tc13_ring),
                TcExpertConfig(cfg.tc2_mt, cfg.tc2_wn, cfg.tc2_wk, nt, cfg.tc2_unroll, cfg.tc_early, cfg.tc2_rl,
                               cfg.tc2_dq, cfg.tc2_pf, cfg.tc2_ring))

    def default(self, problem: Problem) -> MoeOverlapConfig:
        from k3tune.kernels.moe_experts import default_config

        c13, c2, per = default_config(problem["M"])
        if problem["format"] != "bf16":  # MXFP4: the tensor-core kernels, items of up to 8 tokens; early epilogue
            # loads and 4 w2 row tiles per item (s19-r1: TP16 b64 337 -> 311 -> 294 us, TP8 595 -> 574 -> 562); w2 on
            # repacked codes (s20-r3: experts step 4-6% faster at TP16/TP8 b1-64); w13's codes through a 2-stage
            # shared-memory ring (s21-r8: 2-10% faster at TP16/TP8 b1-64), repacked too (s27-r1: through the ring
            # they are 3-8% faster at TP16/TP8 b8-64; without it, s20-r3, they were not)
            return MoeOverlapConfig(group=min(8, max(1, problem["M"])), shared_sms=16, experts_kernel="tensor_core",
                                    tc_early=1, tc2_rl=4, tc2_dq=1, tc13_dq=1, tc13_ring=2)
        return MoeOverlapConfig(c13.rows, c13.warps, c13.unroll, c2.rows, c2.warps, c2.unroll, c2.lanes, per,
                                shared_sms=16)

    def prebuild(self, problem: Problem, cfg: MoeOverlapConfig) -> None:
        """The tensor-core expert kernels this config runs, compiled from its knobs alone: the sweep's compile farm
        builds them on CPU cores ahead of the GPU worker (s19: MXFP4 block sweeps spent ~0.85 s a trial, mostly
        compiling, against ~0.27 s for bf16). The rest of the block's kernels are few and shared by every trial."""
        if cfg.experts_kernel == "tensor_core":
            from k3tune.kernels import moe_experts_tc

            shape = block_shape(problem)
            moe_experts_tc.prebuild(*self._tc_cfgs(cfg), str(problem["format"]), problem["latent"], problem["inter"],
                                    shape.situ_beta, shape.situ_linear_beta, cfg.pdl)

    def block_knobs(self, cfg: MoeOverlapConfig) -> dict:
        from k3tune.kernels.moe_experts import ExpertKernelConfig

        experts = ((*self._tc_cfgs(cfg), cfg.group) if cfg.experts_kernel == "tensor_core" else
                   (ExpertKernelConfig(cfg.w13_rows, cfg.w13_warps, cfg.w13_unroll),
                    ExpertKernelConfig(cfg.w2_rows, cfg.w2_warps, cfg.w2_unroll, cfg.w2_lanes), cfg.group))
        if cfg.shared_sms == "all":
            from k3tune.runtime.partition import plain_stream

            shared, routed = plain_stream(), None
        else:
            shared, routed = _partition(cfg.shared_sms, cfg.routed_on == "rest") if cfg.shared_sms else (None, None)
        return {"experts_cfg": experts, "shared_stream": shared, "routed_stream": routed,
                "prefetch_mib": cfg.prefetch_mib, "pdl": cfg.pdl}

    def simulate_us(self, problem: Problem, cfg: MoeOverlapConfig, hw, roofline_us) -> float:
        m, tp, hid, lat = problem["M"], problem["tp"], problem["hidden"], problem["latent"]
        sh, e = problem["shared_inter"], problem["experts"]
        sms = hw.sm_count
        router = roofline_us(_gemm_work(m, (e + lat) // tp, hid, max(8, (e + lat) // tp // 16), 8192, False), hw)
        gather = 3.0 + m * (e + lat) * 2 / (hw.nvlink_gbps * 1e9) * 1e6
        routing = 2 * hw.graph_launch_us
        n_tiles = math.ceil(problem["inter"] / cfg.w13_rows)
        shared_sms = sms if cfg.shared_sms == "all" else cfg.shared_sms
        routed_sms = sms - shared_sms if cfg.routed_on == "rest" else sms
        experts = Work(hbm_bytes=expert_bytes(problem), flops=2.0 * m * problem["top_k"] * lat * problem["inter"] * 3,
                       ctas=int(m * problem["top_k"] * n_tiles), inflight_bytes_per_cta=cfg.w13_warps * 32 * 16 * 2 *
                       cfg.w13_rows * cfg.w13_unroll, tensor_cores=False, launches=4, sm_limit=routed_sms,
                       ctas_per_sm=max(1, 16 // cfg.w13_warps), extra_us=0.02 * cfg.w2_rows / cfg.w2_warps)
        up = _gemm_work(m, hid, lat // tp, 112, 16384, True, launches=2, sm_limit=routed_sms)
        routed = roofline_us(experts, hw) + roofline_us(up, hw)
        shared_w = [_gemm_work(m, 2 * sh // 1, hid, 96, 16384, True, sm_limit=shared_sms or sms),
                    _gemm_work(m, hid, sh, 56, 16384, True, sm_limit=shared_sms or sms)]
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
