"""Every CuTe DSL kernel compiles on the CPU for Hopper (sm_90a) and Blackwell (sm_100a), and a sample of each for
GB300's own sm_103a.

The small-M GEMM's space is up to 8 token counts x 4 row counts x 3 warp counts x 5 splits x 3 unrolls per
arch; compiling all of it takes many minutes on the 2-core CI machine, so this covers a stated sample: every
(rows, warps, split) at M = 1 and M = 16 without unrolling, and every unroll at every M bucket up to 16."""

import itertools
import warnings

import pytest


@pytest.fixture(autouse=True)
def _no_kernel_cache(monkeypatch):
    """These tests prove that kernels compile: never let them load a cached object instead."""
    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", "off")


pytest.importorskip("cutlass")

from k3tune.kernels import gemm_splitk_tc  # noqa: E402
from k3tune.kernels.gemm_smallm import MAX_ACC, compiled  # noqa: E402

SAMPLE = sorted({(m, r, w, s, 1) for m in (1, 16) for r, w, s in itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2, 4, 8, 16))
                 if r * m <= MAX_ACC}
                | {(m, 2, 4, 1, u) for m in (1, 2, 3, 4, 6, 8, 12, 16) for u in (1, 2, 4)})


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_smallm_compiles(arch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for m, r, w, s, u in SAMPLE:
            assert compiled(m, r, w, s, u, arch) is not None, (m, r, w, s, u)
        for m, r, w, s, u in [(1, 1, 4, 1, 2), (4, 4, 8, 4, 1), (16, 2, 2, 16, 1)]:  # with PDL
            assert compiled(m, r, w, s, u, arch, 1) is not None, (m, r, w, s, u, "pdl")


# the tensor-core kernel: every value of every knob, one knob at a time from a base, and two corners
BASE_TC = {"m_tiles": 1, "warps_n": 4, "warps_k": 1, "tile_m": 8, "split_k": 4, "bk": 128, "stages": 4, "reduce": 0, "pdl": 0}
TC_VALUES = {"m_tiles": (1, 2, 4), "warps_n": (1, 2, 4), "warps_k": (1, 2, 4), "tile_m": (8, 16, 32, 64),
             "split_k": (1, 2, 4, 8, 16), "bk": (32, 64, 128), "stages": (2, 3, 4, 6, 8), "reduce": (0, 1),
             "pdl": (0, 1)}
TC_SAMPLE = sorted({tuple({**BASE_TC, knob: v}.values()) for knob, vals in TC_VALUES.items() for v in vals}
                   | {(4, 1, 1, 64, 1, 32, 2, 0, 1), (2, 2, 2, 32, 8, 64, 3, 1, 1)})


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_splitk_tc_compiles(arch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for knobs in TC_SAMPLE:
            assert gemm_splitk_tc.compiled(*knobs, arch) is not None, knobs


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_moe_expert_kernels_compile(arch):
    """The routed-expert kernels at the executor's defaults and at the corners the GPU test uses."""
    from k3tune.kernels.moe_experts import compiled as moe_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for kind, knobs in [("w13", (4, 4, 4, 32, 1, 4.0, 25.0)), ("w13", (4, 4, 2, 32, 4, 4.0, 25.0)),
                            ("w13", (1, 2, 1, 16, 2, 4.0, 25.0)), ("w2", (8, 2, 4, 32, 1)), ("w2", (4, 4, 1, 8, 2)),
                            ("w2", (16, 1, 2, 16, 8)), ("route", (896, 16, 1.0, False, 4)),
                            ("route", (40, 4, 1.0, True, 1)), ("sum_norm", (16, 1e-5, 2)),
                            ("sum_norm", (16, 1e-5, 2, 16)), ("sum_norm", (16, 1e-5, 1, 1, 128, 8)),
                            ("sum_norm", (16, 1e-5, 1, 16, 128, 8)), ("sum_norm", (4, 1e-5, 3, 8, 64, 2)),
                            ("situ", (4.0, 25.0)), ("gather", (16,)), ("reduce_add", (8,))]:
            assert moe_kernel(kind, knobs, arch) is not None, (kind, knobs)
        assert moe_kernel("w2", (4, 1, 1, 8, 1, True), arch, 1) is not None  # W2_EARLY_L2: the prefetch before the wait
        for knobs in ((896, 16, 2.5, False, 1, "redux", False), (896, 16, 2.5, False, 1, "select", False),
                      (40, 4, 1.0, False, 2, "select", False), (70, 32, 1.0, False, 1, "select", False),
                      (896, 16, 2.5, True, 1, "select", True), (896, 16, 2.5, True, 1, "shuffle", True)):
            assert moe_kernel("route", knobs, arch, 1) is not None  # ROUTE_REDUX, ROUTE_SELECT, FORCED_TOPK
        for forced, method in ((False, "shuffle"), (False, "redux"), (False, "select"), (True, "shuffle")):
            knobs = (16, 280, 896, 16, 2.5, forced, 1, method, forced)  # GATHER_ROUTE
            assert moe_kernel("gather_route", knobs, arch, 1) is not None
        assert moe_kernel("gather_route", (8, 37, 70, 4, 1.0, False, 2, "select", False), arch) is not None


def test_sum_norm_layout_spreads_k3s_rows_over_clusters_of_8():
    """K3's latent (3584) at every slice count the block uses (1, tp 8, tp 16) is spread over 8 CTAs a token, 128
    threads each, one 16-byte vector a thread; widths no cluster divides into whole vectors of every slice stay on
    one CTA a token."""
    from k3tune.kernels.moe_experts import SUM_NORM_THREADS, sum_norm_layout

    for slices in (1, 8, 16):
        assert sum_norm_layout(3584, slices) == (8, 128, 1)
    assert sum_norm_layout(264, 1) == (2, 64, 1)  # 33 vectors a CTA
    assert sum_norm_layout(240, 1) == (4, 32, 1)
    assert sum_norm_layout(400, 2) == (2, 64, 1)  # 200 wide slices: 8 | 200, 16 does not
    assert sum_norm_layout(1000, 2) == (1, 256, 1)
    assert sum_norm_layout(4100, 1) == (1, SUM_NORM_THREADS, 3)


_PDL_PTX = """
import os, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from k3tune.kernels import moe_experts, moe_experts_tc
for kind, knobs in [("w13", (4, 4, 4, 32, 1, 4.0, 25.0)), ("w2", (4, 4, 1, 8, 2)), ("route", (896, 16, 1.0, True, 4)),
                    ("sum_norm", (16, 1e-5, 1, 16, 128, 8)), ("situ", (4.0, 25.0)), ("gather", (16,)), ("reduce_add", (8,))]:
    moe_experts.compiled(kind, knobs, "sm_90a", int(sys.argv[1]))
for kind, knobs, fmt in [("w13", (1, 2, 2, 1, 2, 4.0, 25.0, 1, 1, 0, 0, 2, 0, 0), "mxfp4"),
                         ("w2", (1, 4, 1, 1, 2, 0.0, 0.0, 1, 4, 1, 0, 0, 1, 1), "mxfp4"),
                         ("w13", (1, 2, 2, 1, 2, 4.0, 25.0, 1, 1, 0, 0, 0, 0, 0), "bf16")]:
    moe_experts_tc.compiled(kind, knobs, fmt, "sm_90a", int(sys.argv[1]))
"""


@pytest.mark.parametrize("pdl", [1, 0])
def test_block_kernels_wait_for_the_grid_before_only_with_pdl(tmp_path, pdl):
    """With pdl = 1 every kernel the MoE block launches itself (route, both expert kernels of each kind, the norm,
    SiTU, the fused stand-ins) waits for the grid before it (griddepcontrol.wait) and then lets the next launch;
    with pdl = 0 neither instruction is emitted. Checked in the PTX of a fresh process (the DSL reads its dump
    settings at start-up; the disk cache off, so nothing is loaded instead of compiled)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path), "K3TUNE_KERNEL_CACHE": "off",
           "CUTE_DSL_ARCH": "sm_90a"}
    out = subprocess.run([sys.executable, "-c", _PDL_PTX, str(pdl)], capture_output=True, text=True, timeout=900,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    ptx = {f.name: f.read_text() for f in tmp_path.glob("*.ptx")}
    kernels = ("ExpertGemv", "Route", "SumNorm", "Situ", "Gather", "ReduceAdd", "TcExpertGemm")
    for k in kernels:
        assert any(k in name for name in ptx), f"no PTX for {k}: {sorted(ptx)}"
    for name, text in ptx.items():
        for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            assert (op in text) == bool(pdl), (name, op, pdl)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_l2_prefetch_compiles(arch):
    from k3tune.kernels.l2_prefetch import compiled as prefetch_kernel

    assert prefetch_kernel(arch) is not None


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_tensor_core_expert_kernels_compile(arch):
    """The tensor-core grouped expert kernels, bf16 and MXFP4, at a stated sample of their knobs."""
    from k3tune.kernels.moe_experts_tc import compiled as tc_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # knobs: m_tiles, warps_n, warps_k, n_tiles, unroll, beta, linear_beta, early, rl (row tiles per item), dq
        # (the MXFP4 decode layout), pf (L2 prefetch batches ahead), ring (weight ring stages), MXFP4 remainder
        # (whole chunks past the last whole batch, half a chunk: fp4_remainder); bf16 ignores dq and the remainder,
        # so those compile for MXFP4 only
        for kind, knobs in [("w13", (1, 2, 2, 1, 2, 4.0, 25.0, 1, 1, 0, 0, 0, 0, 0)),
                            ("w13", (2, 1, 4, 2, 1, 4.0, 25.0, 0, 4, 1, 2, 0, 0, 1)),
                            ("w2", (1, 4, 1, 1, 2, 0.0, 0.0, 1, 1, 0, 1, 0, 0, 0)),
                            ("w2", (2, 2, 2, 2, 1, 0.0, 0.0, 0, 2, 1, 0, 3, 0, 1)),
                            ("w13", (2, 2, 1, 4, 1, 4.0, 25.0, 1, 2, 0, 2, 0, 0, 0)),  # 32-token items
                            ("w13", (1, 2, 2, 4, 2, 4.0, 25.0, 1, 1, 1, 1, 0, 1, 0)),
                            ("w13", (1, 2, 2, 1, 1, 4.0, 25.0, 1, 1, 0, 0, 4, 0, 0)),
                            ("w13", (1, 2, 2, 1, 2, 4.0, 25.0, 1, 1, 0, 0, 2, 1, 1)),
                            ("w2", (1, 2, 2, 4, 1, 0.0, 0.0, 1, 8, 1, 2, 0, 0, 0)),
                            ("w2", (1, 4, 1, 1, 2, 0.0, 0.0, 0, 4, 0, 0, 2, 1, 0)),
                            ("w2", (1, 4, 1, 1, 2, 0.0, 0.0, 1, 4, 1, 0, 0, 1, 1))]:  # TP16 w2's, as the default
            for fmt in ("mxfp4",) if knobs[9] or knobs[12] or knobs[13] else ("bf16", "mxfp4"):
                assert tc_kernel(kind, knobs, fmt, arch) is not None, (kind, knobs, fmt)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_one_shot_allreduce_compiles(arch):
    """The fused one-shot all-reduce + residual (+ RMSNorm) kernel for groups of 2, 4 and 8."""
    from k3tune.kernels.allreduce import compiled as ar_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for group, norm, per in [(2, False, 1), (4, True, 2), (8, True, 2)]:
            assert ar_kernel(group, norm, 1e-6, per, arch) is not None, (group, norm)


# the Hopper wgmma kernel: every value of every knob, one knob at a time from a base, and the largest ring corner
BASE_WGMMA = {"warpgroups": 1, "tile_m": 16, "split_k": 2, "bk": 64, "stages": 4, "pdl": 0}
WGMMA_VALUES = {"warpgroups": (1, 2), "tile_m": (8, 16, 32, 64), "split_k": (1, 2, 4, 8), "bk": (64, 128),
                "stages": (2, 4, 6, 8), "pdl": (0, 1)}
WGMMA_SAMPLE = sorted({tuple({**BASE_WGMMA, knob: v}.values()) for knob, vals in WGMMA_VALUES.items() for v in vals}
                      | {(2, 64, 1, 128, 2, 1), (1, 32, 1, 128, 6, 1), (1, 8, 1, 128, 8, 1)})


def test_wgmma_compiles_for_hopper():
    from k3tune.kernels import gemm_wgmma

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for knobs in WGMMA_SAMPLE:
            assert gemm_wgmma.compiled(*knobs, "sm_90a") is not None, knobs


def test_wgmma_sample_covers_the_space_and_fits():
    from k3tune.kernels.gemm_wgmma import SMEM_BUDGET, WgmmaConfig, WgmmaGemm, smem_bytes
    from k3tune.plan.problems import Problem

    p = Problem("kda.o_proj", "gemm", (("M", 64), ("N", 7168), ("K", 1536)))
    assert {k: tuple(v) for k, v in WgmmaGemm().space(p).items()} == WGMMA_VALUES
    fits = [smem_bytes(WgmmaConfig(*s)) for s in WGMMA_SAMPLE if smem_bytes(WgmmaConfig(*s)) <= SMEM_BUDGET]
    assert max(fits) > 150 * 1024  # a ring near the budget is compiled


def test_wgmma_is_hopper_only():
    """Blackwell has no wgmma: compiling for it is a declared CannotImplement, never a crash or a silent build."""
    from k3tune.errors import CannotImplement
    from k3tune.kernels import gemm_wgmma

    with pytest.raises(CannotImplement, match="sm_90a"):
        gemm_wgmma.compiled(*WGMMA_SAMPLE[0], "sm_100a")


# gemm.wgmma_ck, split-K over a cluster along K (knobs: warpgroups, tile_m, split_k, bk, stages, pdl): every cluster
# size at every token tile, both K steps and PDL, and two warpgroups (the largest staged tile and receive buffer)
WGMMA_CK_SAMPLE = sorted({(1, tm, s, 64 if s % 2 else 128, 4, int(s % 3 == 0)) for tm in (8, 16, 32, 64)
                          for s in (2, 3, 4, 5, 6, 7, 8)}
                         | {(2, 64, 8, 64, 4, 1), (2, 16, 3, 128, 2, 0), (1, 8, 5, 64, 8, 1)})


def test_wgmma_ck_compiles_for_hopper():
    from k3tune.kernels import gemm_wgmma_ck

    assert len(WGMMA_CK_SAMPLE) >= 30
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for knobs in WGMMA_CK_SAMPLE:
            assert gemm_wgmma_ck.compiled(*knobs, "sm_90a") is not None, knobs


def test_wgmma_ck_is_hopper_only_and_served():
    """Blackwell has no wgmma (a declared CannotImplement), a split that is no portable cluster is refused, and
    the family serves the Hopper dense problems it was built for (shipped with the session-15 H200 database)."""
    from k3tune.errors import CannotImplement
    from k3tune.kernels import FAMILIES, families_for, gemm_wgmma_ck
    from k3tune.plan.problems import Problem

    with pytest.raises(CannotImplement, match="sm_90a"):
        gemm_wgmma_ck.compiled(*WGMMA_CK_SAMPLE[0], "sm_100a")
    with pytest.raises(CannotImplement, match="portable"):
        gemm_wgmma_ck.compiled(1, 16, 16, 64, 4, 0, "sm_90a")
    p = Problem("mla.q_a", "gemm", (("M", 64), ("N", 1536), ("K", 7168)))
    assert "gemm.wgmma_ck" in {f.name for f in families_for(p, "gpu")}
    assert FAMILIES["gemm.wgmma_ck"].seeds(p)  # the search starts somewhere on the shapes it was built for


# the whole-slice streaming kernel (one binary per M, K and knob set): every row count at M = 1 and K = 7168,
# every warp count, the largest row count each M admits, the other K values of the K3 shapes, and PDL
STREAM_SAMPLE = sorted({(1, r, 8, 7168, 0, 0) for r in (1, 2, 3, 4, 5, 6, 8, 10, 12)}
                       | {(1, 4, w, 7168, 1, 0) for w in (4, 8, 16)}
                       | {(m, min(12, 48 // m), 8, 7168, 1, 0) for m in (2, 3, 4)}
                       | {(8, 6, 4, k, 0, 1) for k in (256, 768, 1536)} | {(3, 16, 4, 1536, 1, 1)}
                       | {(m, r, 8, 7168, 0, 1) for m, r in [(1, 1), (2, 4), (5, 8), (8, 12), (7, 10), (6, 16)]}
                       | {(8, 4, w, 7168, 1, 1) for w in (4, 16)})


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_stream_compiles(arch):
    from k3tune.kernels import gemm_stream

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for knobs in STREAM_SAMPLE:
            m, rows, warps, k, pdl, mma = knobs
            assert gemm_stream.compiled(m, rows, warps, k, pdl, arch, mma) is not None, knobs


def test_stream_sample_covers_the_space():
    from k3tune.kernels.gemm_stream import StreamConfig, StreamGemm
    from k3tune.plan.problems import Problem

    fam = StreamGemm()
    p = Problem("mla.q_a", "gemm", (("M", 1), ("N", 1536), ("K", 7168)))
    space = fam.space(p)
    sample = set(STREAM_SAMPLE)
    assert {s[1] for s in sample if s[3] == 7168} >= {r for r in space["rows"] if fam.valid(StreamConfig(r, 8), p)}
    assert {s[2] for s in sample} == set(space["warps"]) and {s[5] for s in sample} == set(space["mma"])


# the cluster-summed split-K kernel: every cluster size, warp layout and token tile corner, with and without PDL
CLUSTER_SAMPLE = sorted({(1, wn, wk, tm, s, 128 if wk == 4 else 64, 3, s % 4 == 0)
                         for wn, wk, tm, s in itertools.product((1, 4), (1, 4), (8, 64), (2, 4, 8))}
                        | {(2, 2, 2, 32, 4, 64, 4, 1), (4, 1, 1, 16, 8, 32, 2, 0)})


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_splitk_cluster_compiles(arch):
    from k3tune.kernels import gemm_splitk_cluster

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for knobs in CLUSTER_SAMPLE:
            assert gemm_splitk_cluster.compiled(*knobs[:7], int(knobs[7]), arch) is not None, knobs


def test_wgmma_cktrig_compiles():
    """Staged gemm.wgmma_cktrig (Hopper only): every trigger point at the shipped M = 16 pick's layout and an uneven
    split; the other archs refused as a declared CannotImplement."""
    from k3tune.errors import CannotImplement
    from k3tune.kernels import gemm_wgmma_cktrig, pdl_trigger

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for late in pdl_trigger.LATE:
            for knobs in ((1, 16, 8, 128, 4), (1, 8, 5, 64, 6)):
                assert gemm_wgmma_cktrig.compiled(*knobs, 1, late, "sm_90a") is not None, (knobs, late)
    with pytest.raises(CannotImplement):
        gemm_wgmma_cktrig.compiled(1, 16, 8, 128, 4, 1, 8, "sm_100a")


@pytest.mark.parametrize("late", [0, 3])
def test_trig_kernel_triggers_where_late_says(tmp_path, late):
    """In the PTX of a fresh process (dump settings are read at start-up; the disk cache off): with late = 0 the
    next launch is triggered before ``griddepcontrol.wait``, as the parent kernels do; with late > 0 after it, in
    the K loop (a branch guards it)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path), "K3TUNE_KERNEL_CACHE": "off",
           "CUTE_DSL_ARCH": "sm_90a"}
    code = ("import warnings; warnings.simplefilter('ignore')\nfrom k3tune.kernels import gemm_wgmma_cktrig\n"
            f"gemm_wgmma_cktrig.compiled(1, 16, 8, 128, 4, 1, {late}, 'sm_90a')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    (ptx,) = [f.read_text() for f in tmp_path.glob("*.ptx")]
    trigger, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert (trigger > wait) == (late > 0)


def test_every_cute_kernel_compiles_for_gb300s_own_arch():
    """GB300 (Blackwell Ultra, compute capability 10.3) is the target, and a sweep there compiles for sm_103a (the
    GPU's own arch: k3tune.kernels.gemm_smallm.current_arch), not the sm_100a the tests above use. One sample of every
    CuTe kernel, and of each kind of the block's kernels, compiles for it; the Hopper-only wgmma families refuse it
    as a declared CannotImplement, never a crash."""
    from k3tune.errors import CannotImplement
    from k3tune.kernels import (allreduce, gemm_smallm, gemm_splitk_cluster, gemm_stream, gemm_wgmma, gemm_wgmma_ck,
                                l2_prefetch, moe_experts, moe_experts_tc)

    arch = "sm_103a"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        built = [gemm_smallm.compiled(*SAMPLE[0], arch), gemm_splitk_tc.compiled(*TC_SAMPLE[-1], arch),
                 gemm_splitk_cluster.compiled(*CLUSTER_SAMPLE[-1][:7], int(CLUSTER_SAMPLE[-1][7]), arch),
                 gemm_stream.compiled(1, 4, 8, 7168, 1, arch, 1), l2_prefetch.compiled(arch),
                 allreduce.compiled(8, True, 1e-6, 2, arch)]
        for kind, knobs in [("w13", (4, 4, 4, 32, 1, 4.0, 25.0)), ("w2", (8, 2, 4, 32, 1)),
                            ("route", (896, 16, 1.0, False, 4)), ("sum_norm", (16, 1e-5, 2)), ("situ", (4.0, 25.0)),
                            ("gather", (16,)), ("reduce_add", (8,))]:
            built.append(moe_experts.compiled(kind, knobs, arch, 1))
        for kind, knobs, fmt in [("w13", (1, 2, 2, 1, 2, 4.0, 25.0, 1, 1, 0, 0, 2, 1, 1), "mxfp4"),
                                 ("w2", (1, 4, 1, 1, 2, 0.0, 0.0, 1, 4, 1, 0, 0, 1, 1), "mxfp4"),
                                 ("w13", (1, 2, 2, 1, 2, 4.0, 25.0, 1, 1, 0, 0, 0, 0, 0), "bf16")]:
            built.append(moe_experts_tc.compiled(kind, knobs, fmt, arch, 1))
    assert all(b is not None for b in built)
    for hopper_only in (lambda: gemm_wgmma.compiled(*WGMMA_SAMPLE[0], arch),
                        lambda: gemm_wgmma_ck.compiled(*WGMMA_CK_SAMPLE[0], arch)):
        with pytest.raises(CannotImplement, match="sm_90a"):
            hopper_only()
