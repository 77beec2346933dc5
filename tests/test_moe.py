"""The MoE block executor on the CPU at reduced widths (every path, both weight formats, tp 1 and 4), the
MXFP4 format, and the executor's refusals. The same checks at K3's true shapes run on a GPU:
tests/test_gpu_moe.py."""

import importlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3tune.errors import ConfigError
from k3tune.kernels import mxfp4
from k3tune.runtime import Selector
from k3tune.runtime.moe import (BlockShape, EmulatedComm, MoEBlock, random_weights, reference, routing_agrees,
                                virtual_full)

BENCH = Path(__file__).resolve().parent.parent / "bench"  # the bench scripts, which some tests run
SMALL = BlockShape(hidden=256, experts=32, top_k=4, latent=128, inter=128, shared_inter=256)


def _bench_script(monkeypatch, name: str):
    """bench/NAME.py imported afresh, with bench/gemm.py (which the scripts import as ``gemm``): bench/ is not a
    package, and a module another test imported must not stand in for it."""
    monkeypatch.syspath_prepend(str(BENCH))
    for module in (name, "gemm"):
        sys.modules.pop(module, None)
    return importlib.import_module(name)


def test_mxfp4_round_trips_representable_values_exactly():
    vals = torch.tensor(mxfp4.E2M1 + tuple(-v for v in mxfp4.E2M1))
    w = vals.repeat(8).reshape(4, 32) * 2.0 ** torch.arange(-2, 2).unsqueeze(1)  # one scale per row
    codes, scales = mxfp4.quantize(w)
    assert codes.shape == (4, 16) and scales.shape == (4, 1) and codes.dtype == torch.uint8
    assert torch.equal(mxfp4.dequantize(codes, scales, torch.float32), w)


def test_mxfp4_quantisation_error_is_bounded():
    w = torch.randn(64, 256)
    back = mxfp4.dequantize(*mxfp4.quantize(w), torch.float32)
    # E2M1 keeps one mantissa bit: half a step is at most 1/6 of the value above 0.5 x scale, blocks share a scale
    assert ((back - w).norm() / w.norm()).item() < 0.15
    assert torch.all((back == 0) | (back.sign() == w.sign()))
    assert mxfp4.nbytes(64, 256) == 64 * 128 + 64 * 8


def test_mxfp4_decode_layout_gives_every_value_exactly():
    """The tensor-core kernels' dq = 1 layout: packed codes decoded as the kernel does (rotate, mask per pair) are
    each value x 2^-126 as bf16 bits, in K order, for every code in every position of a word."""
    from k3tune.kernels import moe_experts_tc as tc

    codes = torch.randint(0, 256, (3, 7, 64), dtype=torch.uint8)
    codes[0, 0] = torch.arange(16, dtype=torch.uint8).repeat(4) * 17  # each code in each nibble
    packed = tc.pack_codes(codes, chunk_words=5)  # several chunks, a ragged last one
    assert packed.data.shape == codes.shape and not torch.equal(packed.data, codes)
    bits = tc.dq_decode_reference(packed.data).to(torch.int32)
    got = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16).float()
    ones = torch.full((3, 7, 4), 127, dtype=torch.uint8)  # scale 2^0
    assert torch.equal(got * 2.0 ** 126, mxfp4.dequantize(codes, ones, torch.float32))
    assert torch.equal(tc.unpack_codes(packed, chunk_words=3), codes)  # and back, exactly
    assert tc.in_layout(packed, 1) is packed and tc.in_layout(codes, 0) is codes  # no copy where none is needed
    assert torch.equal(tc.in_layout(packed, 0), codes) and torch.equal(tc.in_layout(codes, 1).data, packed.data)
    assert torch.equal(tc.expert_codes(packed, 2), codes[2]) and torch.equal(tc.expert_codes(codes, 1), codes[1])


def test_mxfp4_remainder_classes():
    """K's 128-K chunks past the last whole batch and the half chunk left, as the kernels compile them: K3's w13 has
    none; TP16 w2 (K = 192) one chunk and a half; TP8 w2 (K = 384) one chunk at unroll 2; a chunk of 3 live blocks
    runs whole (K = 96, 224)."""
    from k3tune.kernels.moe_experts_tc import fp4_remainder

    assert all(fp4_remainder(3584, u) == (0, 0) for u in (1, 2, 4))
    assert fp4_remainder(192, 2) == (1, 1) and fp4_remainder(192, 1) == (0, 1)
    assert fp4_remainder(384, 2) == (1, 0) and fp4_remainder(384, 1) == (0, 0)
    assert fp4_remainder(96, 2) == (1, 0) and fp4_remainder(224, 2) == (0, 0) and fp4_remainder(160, 1) == (0, 1)


def test_mxfp4_codes_in_the_other_layout_are_refused():
    from types import SimpleNamespace

    from k3tune.kernels import moe_experts_tc as tc

    codes, scales = mxfp4.quantize(torch.randn(2, 8, 64))
    grp = SimpleNamespace(per=1)
    x, act = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 4, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="dq=1: expected PackedCodes"):
        tc.run_w13(tc.TcExpertConfig(dq=1), x, codes, act, None, grp, 4.0, 25.0, scales=scales)
    with pytest.raises(ConfigError, match="dq=0: expected K3's codes"):
        tc.run_w13(tc.TcExpertConfig(), x, tc.pack_codes(codes), act, None, grp, 4.0, 25.0, scales=scales)


def test_mxfp4_refuses_ragged_k():
    with pytest.raises(ConfigError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(4, 48))


def _check(blk, w, batch, seed=0):
    x = torch.randn(batch, w.shape.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    out = blk(x)
    full = virtual_full(w)
    _, _, biased = reference(x, full, w.shape)
    assert routing_agrees(blk.last_top, biased, w.shape)
    ref, _, _ = reference(x, full, w.shape, top=blk.last_top)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
    return err


@pytest.mark.parametrize("tp", [1, 4])
def test_stock_path_matches_the_reference(tp):
    w = random_weights(SMALL, tp, seed=tp)
    blk = MoEBlock.build(w, "stock", batch=3)
    _check(blk, w, 3)
    assert blk.ran["experts"] == "torch._grouped_mm bf16" and blk.ran["shared"].startswith("serial")
    assert blk.ran["collectives"].startswith("identity" if tp == 1 else "emulated")


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("tp", [1, 4])
def test_tuned_path_runs_the_selectors_kernels_and_matches(tp, fmt):
    sel = Selector.load(None)  # no GPU here: heuristic defaults, and the labels say so
    w = random_weights(SMALL, tp, fmt=fmt, seed=7)
    blk = MoEBlock.build(w, "tuned", batch=2, draft=1, selector=sel)
    assert blk.tokens == 4
    _check(blk, w, 4)
    for op in ("moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2"):
        assert blk.ran[op].startswith("gemm.cublas") and "heuristic default" in blk.ran[op]
    assert blk.ran["experts"].startswith("MXFP4" if fmt == "mxfp4" else "torch._grouped_mm")


def test_the_measured_block_builds_above_64_tokens():
    """A measured block at M tokens is built as batch M, no draft (``kernels/moe_block.py``): at M > 64 (a spec with
    drafts) the selector refused the executor's dense lookups, and every such block trial failed on a GPU."""
    w = random_weights(SMALL, 4, seed=3)
    blk = MoEBlock.build(w, "tuned", batch=96, selector=Selector.load(None))
    assert blk.tokens == 96
    _check(blk, w, 96)
    assert all(blk.ran[op].startswith("gemm.cublas") for op in ("moe.router_latent", "moe.shared_w2"))


def test_a_dense_kernel_that_cannot_run_here_falls_back_to_cublas_and_the_block_says_so():
    """The block's four dense GEMMs are served as DenseProjection serves them: the shipped H200 winners are CuTe
    kernels, which cannot run on CPU tensors, so each falls back to cuBLAS, named in ``ran``, and the block matches."""
    from k3tune.shipped import tuning_db_dir

    shipped = Selector.load(tuning_db_dir() / "h200.sqlite", measured_on="h200")

    class TP16Batch8:  # this small model's ops served the shipped TP16 batch-8 winners
        def lookup(self, op, tp, batch, draft=0):
            return shipped.lookup(op, 16, 8, 0)

    w = random_weights(SMALL, 4, seed=3)
    blk = MoEBlock.build(w, "tuned", batch=2, selector=TP16Batch8())
    for op in ("moe.router_latent", "moe.latent_up", "moe.shared_w13", "moe.shared_w2"):
        tuned = shipped.lookup(op, 16, 8, 0).family
        assert tuned != "gemm.cublas", op  # else this test would not reach the fallback
        assert blk.ran[op].startswith("gemm.cublas") and f"instead of {tuned}" in blk.ran[op], blk.ran[op]
    _check(blk, w, 2)


def test_emulated_collectives_follow_the_identical_shard_convention():
    comm = EmulatedComm(4)
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(comm.all_gather(x), torch.cat([x] * 4, dim=-1))
    assert torch.equal(comm.all_reduce(x), 4 * x)


def test_collective_stand_ins_take_the_targets_link_time():
    from k3tune.plan.hardware import spec

    comm = EmulatedComm.for_target("gb300", 16)
    nbytes = 8 * 7168 * 2  # an all-reduce of 8 tokens of the hidden state, bf16
    expected = 4.0 + 2 * 15 / 16 * nbytes / (spec("gb300").nvlink_gbps * 1e9) * 1e6
    assert comm.stand_in_us(nbytes, 2.0) == pytest.approx(expected)
    assert "emulated (tp=16, stand-in for" in comm.label
    assert EmulatedComm.for_target("gb300", 1).stand_in_us(nbytes, 2.0) == 0.0


def test_refusals_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="does not divide"):
        random_weights(SMALL, 3)
    with pytest.raises(ConfigError, match="stock path runs bf16"):
        MoEBlock.build(random_weights(SMALL, 1, fmt="mxfp4"), "stock", batch=1)
    with pytest.raises(ConfigError, match="expected stock or tuned"):
        MoEBlock.build(random_weights(SMALL, 1), "fast", batch=1)
    with pytest.raises(ConfigError, match="needs a runtime selector"):
        MoEBlock.build(random_weights(SMALL, 1), "tuned", batch=1)
    with pytest.raises(ConfigError, match="expected bf16 or mxfp4"):
        random_weights(SMALL, 1, fmt="fp8")


def test_block_shape_reads_k3s_config():
    from k3tune.shipped import configs_dir

    sh = BlockShape.from_config(configs_dir() / "kimi_k3_config.json")
    assert (sh.hidden, sh.experts, sh.top_k, sh.latent, sh.inter, sh.shared_inter) == (7168, 896, 16, 3584, 3072, 6144)
    assert (sh.situ_beta, sh.situ_linear_beta) == (4.0, 25.0)
    for tp in (8, 16):
        sh.check_tp(tp)


def test_block_sweep_records_the_chosen_knobs(tmp_path):
    """The bf16-expert block spec plans 14 problems and a (simulated) sweep records a winner for each, with
    its shared-expert SM split and prefetch size; on a GPU the same spec is measured through the executor."""
    from k3tune.cli import main

    db = tmp_path / "moe.sqlite"
    assert main(["sweep", "--simulate", "h200", "--spec", "h200_moe_bf16", "--db", str(db), "--gpus", "2"]) == 0
    rows = sqlite3.connect(db).execute("select family, params from winners").fetchall()
    assert len(rows) == 14
    assert all(f == "moe.stock" or ('"shared_sms"' in p and '"prefetch_mib"' in p) for f, p in rows)


def test_sm_partition_refusals():
    from k3tune.errors import HardwareError
    from k3tune.runtime.partition import green_partition

    from k3tune.runtime.partition import green_split

    with pytest.raises(ConfigError, match="multiple of 8"):
        green_partition(12)
    with pytest.raises(ConfigError, match="multiple of 8"):
        green_split(4)
    if not torch.cuda.is_available():
        with pytest.raises(HardwareError, match="need a CUDA GPU"):
            green_partition(16)
        with pytest.raises(HardwareError, match="need a CUDA GPU"):
            green_split(16)


def test_a_routed_stream_needs_the_shared_one():
    import torch

    w = random_weights(SMALL, 1)
    with pytest.raises(ConfigError, match="rest of a split"):
        MoEBlock.build(w, "tuned", batch=2, selector=Selector.load(None), experts="grouped_mm",
                       routed_stream=torch.cuda.current_stream() if torch.cuda.is_available() else object())


def test_prefetch_and_cute_experts_refuse_a_cpu_block():
    w = random_weights(SMALL, 1)
    with pytest.raises(ConfigError, match="L2 prefetch needs a GPU"):
        MoEBlock.build(w, "tuned", batch=1, selector=Selector.load(None), prefetch_mib=8)
    with pytest.raises(ConfigError, match="CuTe expert kernels run on a GPU"):
        MoEBlock.build(w, "tuned", batch=1, selector=Selector.load(None), experts="cute")


def test_serve_takes_the_block_choice_and_its_knobs_from_the_selector(tmp_path):
    """A database whose moe.block winners come from a (simulated) sweep: serve() follows the choice for the
    deployment and says so. Simulated winners are served only when asked for, and labelled; on a CPU the
    knobs that need a GPU fall back to the tuned path's defaults."""
    from k3tune.cli import main
    from k3tune.plan import model as models, spec as specs

    db = tmp_path / "moe.sqlite"
    assert main(["sweep", "--simulate", "h200", "--spec", "h200_moe_bf16", "--db", str(db)]) == 0
    sp = specs.load("h200_moe_bf16")
    sel = Selector.load(str(db), simulated="h200", spec=sp, model=models.load(sp.model_config))
    choice = sel.lookup("moe.block", 16, 8)
    assert choice.source == "simulated"
    small16 = BlockShape(hidden=256, experts=32, top_k=4, latent=128, inter=512, shared_inter=256)  # splits 16 ways
    blk = MoEBlock.serve(random_weights(small16, 16), sel, batch=8)
    assert blk.ran["block"].startswith(choice.family) and blk.ran["block"].endswith("(simulated)")
    assert blk.path == ("stock" if choice.family == "moe.stock" else "tuned")
    mx = Selector.load(str(db), simulated="h200", spec=sp, model=models.load())  # K3 as published: MXFP4 experts
    with pytest.raises(ConfigError, match="selector's model has mxfp4 experts, these weights are bf16"):
        MoEBlock.serve(random_weights(small16, 16), mx, batch=8)  # would run the MXFP4 winners' knobs


def test_tensor_core_expert_kernels_refuse_what_they_cannot_run():
    import torch

    from k3tune.errors import ConfigError
    from k3tune.kernels import moe_experts_tc
    from k3tune.kernels.moe_experts import Groups
    from k3tune.kernels.moe_experts_tc import TcExpertConfig

    grp = Groups.allocate(8, 4, 2, 16, "cpu")
    with pytest.raises(ConfigError, match="do not fit"):
        moe_experts_tc.check(TcExpertConfig(n_tiles=1), grp, 64, "bf16")
    with pytest.raises(ConfigError, match="above 2"):
        moe_experts_tc.check_scales(torch.tensor([127, 130], dtype=torch.uint8))


def test_the_block_search_never_measures_one_kernel_under_two_names():
    """Knobs of the expert kernel that does not run are fixed (CUDA-core knobs under the tensor-core kernel and
    the reverse; routed_on when serial), so two TPE samples differing only there are one candidate."""
    from k3tune.errors import CannotImplement
    from k3tune.kernels import family
    from k3tune.plan.problems import Problem

    fam = family("moe.overlap")
    p = Problem("moe.block", "moe_block", (("tp", 16), ("M", 8), ("experts", 896), ("top_k", 16), ("latent", 3584),
                                           ("inter", 192), ("shared_inter", 384), ("hidden", 7168),
                                           ("format", "bf16"), ("routing", "uniform")))
    a = {**fam.default_config(p).params(), "experts_kernel": "cuda_core", "tc13_wn": 4, "shared_sms": 0}
    b = {**a, "tc13_wn": 1, "tc2_unroll": 1, "routed_on": "rest"}
    assert fam.canonical(a) == fam.canonical(b)
    assert fam.canonical({**a, "w13_rows": 8}) != fam.canonical(a), "a knob of the running kernel matters"
    tc = {**a, "experts_kernel": "tensor_core"}
    assert fam.canonical({**tc, "w13_rows": 8}) == fam.canonical(tc)
    assert fam.valid(fam.config_from_params(p, fam.canonical(b)), p)
    # a plain side stream ("all") leaves no SMs to confine the routed experts to: routed_on is fixed there too
    plain = {**a, "shared_sms": "all"}
    assert fam.canonical({**plain, "routed_on": "rest"}) == fam.canonical(plain)
    with pytest.raises(CannotImplement, match="not valid"):
        fam.config_from_params(p, {**plain, "routed_on": "rest"})
    assert fam.valid(fam.config_from_params(p, fam.canonical(plain)), p)


def test_a_plain_side_stream_is_a_value_of_the_shared_sm_knob():
    """``shared_sms = "all"``: declared beside the partition sizes and serial, simulated as the shared experts
    beside the routed ones on every SM, and on a machine without a GPU a clear hardware error, not a serial run."""
    from k3tune.errors import HardwareError
    from k3tune.kernels import family
    from k3tune.plan.hardware import spec
    from k3tune.plan.problems import Problem
    from k3tune.search.simulate import roofline_us

    fam = family("moe.overlap")
    p = Problem("moe.block", "moe_block", (("tp", 8), ("M", 2), ("experts", 896), ("top_k", 16), ("latent", 3584),
                                           ("inter", 384), ("shared_inter", 768), ("hidden", 7168),
                                           ("format", "mxfp4"), ("routing", "uniform")))
    assert fam.space(p)["shared_sms"][0] == 0 and "all" in fam.space(p)["shared_sms"]
    base = fam.default_config(p)
    plain, serial = (fam.config_from_params(p, fam.canonical({**base.params(), "shared_sms": v})) for v in ("all", 0))
    hw = spec("gb300")
    assert 0 < fam.simulate_us(p, plain, hw, roofline_us) < fam.simulate_us(p, serial, hw, roofline_us)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(HardwareError, match="CUDA GPU"):
            fam.block_knobs(plain)


def test_every_trial_of_a_block_problem_routes_the_same_tokens_to_the_same_experts():
    """Which experts a step selects decides the bytes it reads: trials of one block problem are compared on one
    routing draw (fixed by the problem), with fresh weights each; another problem draws its own."""
    from k3tune.kernels import family
    from k3tune.plan.problems import Problem

    def problem(routing):
        return Problem("moe.block", "moe_block", (("tp", 2), ("M", 8), ("experts", 32), ("top_k", 4), ("latent", 64),
                                                  ("inter", 32), ("shared_inter", 32), ("hidden", 128),
                                                  ("format", "bf16"), ("routing", routing)))

    fam = family("moe.overlap")
    p = problem("zipf:1.2")
    a, b = (fam.make_inputs(p, torch.device("cpu"), torch.Generator().manual_seed(s)) for s in (1, 2))
    assert torch.equal(a["top"], b["top"])
    assert not torch.equal(a["x"], b["x"])
    other = fam.make_inputs(problem("uniform"), torch.device("cpu"), torch.Generator().manual_seed(1))
    assert not torch.equal(a["top"], other["top"])


def test_experts_ab_reads_two_runs_and_says_when_the_new_code_lost(tmp_path):
    """bench/experts_ab.py, run as the device scripts run it: the ratio per point and variant, exit 0 when the new
    run is no slower, 1 when a point is slower beyond the threshold, 1 with a one-line error on a bad file."""
    script = BENCH / "experts_ab.py"

    def run_file(name, us):
        rows = [{"tp": 16, "batch": b, "routing": "uniform", "touched": 16,
                 "x1_mxfp4": {"us": t, "iqr": 0.2, "roof": 0.5}} for b, t in zip((1, 8), us)]
        (tmp_path / name).write_text(json.dumps({"device": "test", "copy_bw": 4e12, "rows": rows}))
        return str(tmp_path / name)

    base = run_file("base.json", (30.0, 80.0))

    def ab(*args):
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)

    same = ab(run_file("same.json", (29.5, 80.5)), base)
    assert same.returncode == 0 and "geomean new/base x1_mxfp4: 0.995" in same.stdout, same.stdout
    lost = ab(run_file("lost.json", (30.0, 88.0)), base)
    assert lost.returncode == 1 and "ratio 1.100 SLOWER" in lost.stdout, lost.stdout
    bad = ab(str(tmp_path / "missing.json"), base)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1


def test_expert_sass_mix_counts_the_innermost_mma_loop(tmp_path):
    """bench/expert_sass.py mix, as run on the dumped SASS: the opcodes of the innermost loop holding HMMAs (not the
    outer item loop, not a loop without MMAs), with the pipe each issues on, per decoded word."""
    script = BENCH / "expert_sass.py"
    sass = "\n".join([
        "        /*0100*/   IMAD.MOV.U32 R1, RZ, RZ, R2 ;",
        "        /*0110*/   LOP3.LUT R3, R1, 0x81c081c0, RZ, 0xc0, !PT ;",  # outer loop start
        "        /*0120*/   SHF.R.U32.HI R4, RZ, 0x3, R1 ;",  # inner K loop start
        "        /*0130*/   IMAD.SHL.U32 R5, R1, 0x8, RZ ;",
        "        /*0140*/   LOP3.LUT R6, R4, 0x1c001c0, RZ, 0xc0, !PT ;",
        "        /*0150*/   HFMA2.BF16_V2 R7, R6, R8, -RZ ;",
        "        /*0160*/   HMMA.16816.F32.BF16 R10, R12, R14, R10 ;",
        "        /*0170*/   @P0 BRA 0x120 ;",
        "        /*0180*/   SEL R9, R1, RZ, P1 ;",
        "        /*0190*/   @P1 BRA 0x110 ;",
        "        /*01a0*/   IADD3 R2, R2, 0x1, RZ ;",
        "        /*01b0*/   @P2 BRA 0x1a0 ;",  # a loop with no HMMA
    ])
    f = tmp_path / "k.sass"
    f.write_text(sass)
    out = subprocess.run([sys.executable, str(script), "mix", str(f), "--words", "2"], capture_output=True,
                         text=True, check=True).stdout
    assert "K loop 6 instructions (ALU 2, FMA 2, other 2)" in out, out
    assert "per word: 3.0 (ALU 1.0, FMA 1.0, other 1.0)" in out, out
    assert "SHF.R.U32.HI 1" in out and "HMMA.16816.F32.BF16 1" in out and "SEL" not in out, out


def test_bench_json_is_rewritten_whole_or_not_at_all(tmp_path, monkeypatch):
    """bench/moe.py rewrites its JSON after every row through ``write_json`` (bench/gemm.py): a run its timeout
    cuts short keeps the rows it finished (s25-r3 lost a whole TP16 run), and a write that fails leaves the last
    whole file, not half of one."""
    write_json = _bench_script(monkeypatch, "gemm").write_json

    out = tmp_path / "bench-moe.json"
    write_json(str(out), {"complete": False, "rows": [{"batch": 1}]})
    with pytest.raises(TypeError):
        write_json(str(out), {"complete": True, "rows": [{"batch": 1}, {"batch": object()}]})
    assert json.loads(out.read_text()) == {"complete": False, "rows": [{"batch": 1}]}
    write_json(str(out), {"complete": True, "rows": []})
    assert json.loads(out.read_text())["complete"] and sorted(p.name for p in tmp_path.iterdir()) == ["bench-moe.json"]


def test_bench_split_bar_counts_a_serial_choice_as_no_split(monkeypatch):
    """bench/moe.py's split bar: a served block whose choice is 0 SMs runs serial itself, so two runs of the same
    knobs must not count as a split beating serial on noise (s26-r4 counted four such rows); the choice still
    holds where it beats the even split and serial does not beat it. A plain side stream splits no SMs: it counts
    as an overlap that wins, apart from the splits."""
    summarize = _bench_script(monkeypatch, "moe").summarize

    def run(us, iqr, shared):
        return {"us": us, "iqr": iqr, "floor_us": 50.0, "ran": {"shared": shared}}

    def row(batch, served, serial, even, shared):
        return {"tp": 16, "batch": batch, "routing": "uniform", "stock_bf16": run(300.0, 1.0, "serial"),
                "served_bf16": run(served, 0.2, shared), "served_serial_bf16": run(serial, 0.2, "serial, after"),
                "served_even_bf16": run(even, 0.2, "green context, 64 SMs")}

    rows = [row(1, 49.8, 54.0, 60.0, "green context, 16 SMs"),       # a split, faster than both
            row(8, 155.0, 155.3, 180.0, "serial, after the routed experts"),  # serial chosen, "faster" on noise
            row(16, 261.0, 259.0, 300.0, "green context, 24 SMs"),    # a split serial beats
            row(2, 47.0, 50.0, 60.0, "side stream (plain, every SM), forked after the router GEMM")]
    out = summarize(rows, [16], [0], "bf16")
    per = {o["batch"]: o for o in out["per_config"]}
    # a plain side stream that beats both is an overlap that wins, not an SM split
    assert [per[b]["served_split_beats_serial_and_even"] for b in (1, 8, 16, 2)] == [True, False, False, False]
    assert [per[b]["served_overlap_beats_serial_and_even"] for b in (1, 8, 16, 2)] == [True, False, False, True]
    assert [per[b]["served_is_serial"] for b in (1, 8, 16, 2)] == [False, True, False, False]
    assert [per[b]["served_is_plain"] for b in (1, 8, 16, 2)] == [False, False, False, True]
    assert [per[b]["served_choice_holds"] for b in (1, 8, 16, 2)] == [True, True, False, True]
    assert out["served_serial_chosen"] == 1 and out["served_split_wins_fraction"] == 1 / 4
    assert out["served_plain_chosen"] == 1 and out["served_overlap_wins_fraction"] == 2 / 4
    assert out["served_choice_holds_fraction"] == 3 / 4


def test_timing_hold_bench_reads_its_problems_and_winners_from_the_database(monkeypatch):
    """bench/timing_hold.py (the timing-method A/B) names its problems by key patterns on a real database: each
    match comes back as the problem the sweep measured (the same key) with its winner's family and params, which
    the family accepts; a pattern that matches nothing is a one-line exit, not an empty run."""
    from k3tune.kernels import family
    from k3tune.shipped import tuning_db_dir

    winners = _bench_script(monkeypatch, "timing_hold").winners

    db = str(tuning_db_dir() / "h200.sqlite")
    got = winners(db, ["mla.q_a[M=16,N=1536,%", "moe.block[tp=8,M=1,%format=bf16,routing=uniform]"])
    with sqlite3.connect(db) as c:
        keys = {k for (k,) in c.execute("select key from problems")}
    assert [p.kind for p, _, _ in got] == ["gemm", "moe_block"] and all(p.key in keys for p, _, _ in got)
    for p, fam, params in got:
        assert family(fam).config_from_params(p, params) is not None
    with pytest.raises(SystemExit, match="no winner .* like 'nope%'"):
        winners(db, ["nope%"])


def test_expert_sass_disassembles_a_kernel_compiled_on_the_cpu(tmp_path):
    """bench/expert_sass.py on the CPU alone (cuobjdump and nvdisasm from the test extra's wheels): the MXFP4
    tensor-core w13 kernel compiled for sm_90a, its registers and spills read back, its SASS dumped and its K loop
    found — the bf16 MMAs the rotate-and-mask decode feeds, and no local memory (s26: the e4m3 path's 212 registers
    and emulated e4m3 MMAs were found this way)."""
    script = BENCH / "expert_sass.py"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")

    def sass(*args):
        r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    sass("compile", str(tmp_path), "mxfp4", "w13=1,2,2,1,2,1,1,1", "--tp", "8")
    regs = sass("regs", str(tmp_path))
    assert regs.startswith("w13.cubin: REG ") and " LOCAL 0 " in regs, regs
    assert 32 <= int(regs.split()[2]) <= 255, regs
    sass("dump", str(tmp_path))
    mix = sass("mix", str(tmp_path / "w13.sass"))
    assert "HMMA.16816.F32.BF16" in mix and "F2FP" not in mix, mix


def test_bench_weights_quantise_a_slice_of_experts_at_a_time_to_the_same_bits(monkeypatch):
    """bench/moe.py builds its MXFP4 layers a slice of experts at a time (an 80 GB card ran out of memory quantising
    a whole TP8 w13, s50-r1): every tensor must equal random_weights' own MXFP4 weights bit for bit, so the bench
    times the weights the sweep measured; bf16 and a bad format go to random_weights unchanged, and so does a rank."""
    moe = _bench_script(monkeypatch, "moe")

    monkeypatch.setattr(moe, "EXPERTS_A_SLICE", 5)  # 32 experts: slices of 5 and a ragged 2
    whole, sliced = random_weights(SMALL, 4, fmt="mxfp4", seed=3), moe.bench_weights(SMALL, 4, "mxfp4", 3, "cpu")
    assert sliced.fmt == "mxfp4"
    for name in ("w_rl", "bias", "norm", "w_up", "shared_w13", "shared_w2"):
        assert torch.equal(getattr(whole, name), getattr(sliced, name)), name
    for name in ("w13", "w2"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(whole, name), getattr(sliced, name), strict=True)), name
    assert torch.equal(moe.bench_weights(SMALL, 4, "bf16", 3, "cpu").w13, random_weights(SMALL, 4, seed=3).w13)
    other = moe.bench_weights(SMALL, 4, "mxfp4", 3, "cpu", rank=1)  # another rank's shards (bench/moe_group.py)
    assert all(torch.equal(a, b) for a, b in zip(other.w13, random_weights(SMALL, 4, 1, fmt="mxfp4", seed=3).w13,
                                                    strict=True))
    with pytest.raises(ConfigError, match="expert weight format 'fp8'"):
        moe.bench_weights(SMALL, 4, "fp8", 3, "cpu")


def test_bench_gemm_ops_filter_refuses_an_unknown_op():
    """bench/gemm.py --ops (s63: re-running the rows a timeout cut) names dense ops; a typo is a one-line error
    before any GPU work, not a run that measures nothing."""
    r = subprocess.run([sys.executable, str(BENCH / "gemm.py"), "--ops", "mla.q_a,mla.qa", "--out", "/dev/null"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--ops: not dense ops: ['mla.qa']" in r.stderr, r.stderr
