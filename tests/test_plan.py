"""Plan: model configs, sweep specs, hardware specs and the reduction of deployments to problems."""

import json
import shutil

import pytest

from k3tune.errors import ConfigError, HardwareError
from k3tune.plan import hardware, model, problems, spec


def test_k3_published_config():
    m = model.load()
    assert (m.hidden, m.num_layers, m.kda_layers, m.mla_layers) == (7168, 93, 69, 24)
    assert (m.num_experts, m.top_k, m.latent, m.num_shared_experts) == (896, 16, 3584, 2)
    assert m.expert_weight_format == "mxfp4"


def test_flat_kimi_linear_config(tmp_path):
    raw = json.loads(model.configs_dir().joinpath("kimi_k3_config.json").read_text())["text_config"]
    raw.pop("quantization_config")
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    m = model.load(p)
    assert m.hidden == 7168 and m.expert_weight_format == "bf16"


@pytest.mark.parametrize("content, msg", [
    ("{not json", "not valid JSON"),
    (json.dumps({"model_type": "llama"}), "unsupported model_type"),
    (json.dumps({"model_type": "kimi_linear", "linear_attn_config": {}}), "missing field"),
])
def test_bad_config_json(tmp_path, content, msg):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(ConfigError, match=msg):
        model.load(p)


def test_config_field_type_checked(tmp_path):
    raw = json.loads(model.configs_dir().joinpath("kimi_k3_config.json").read_text())
    raw["text_config"]["hidden_size"] = "7168"
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="hidden_size"):
        model.load(p)


def _k3_with(tmp_path, change):
    raw = json.loads(model.configs_dir().joinpath("kimi_k3_config.json").read_text())
    change(raw["text_config"])
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    return p


@pytest.mark.parametrize("change, msg", [
    # counts that add up to 93 with a layer listed twice (in one list, then in both) and layer 2 in neither
    (lambda t: t["linear_attn_config"]["kda_layers"].__setitem__(1, 1), "layer 1 is listed twice"),
    (lambda t: t["linear_attn_config"]["kda_layers"].__setitem__(1, 4), "layer 4 is listed twice"),
    (lambda t: t["linear_attn_config"]["full_attn_layers"].__setitem__(-1, 200), r"indices run 1\.\.200"),
    (lambda t: t["linear_attn_config"]["kda_layers"].__setitem__(0, "1"), "integer layer indices, got '1'"),
    (lambda t: t.__setitem__("num_experts_per_token", 897), "num_experts_per_token 897 exceeds num_experts 896"),
    (lambda t: t.__setitem__("routed_expert_hidden_size", "3584"), "'routed_expert_hidden_size' must be an integer"),
    (lambda t: t.__setitem__("routed_expert_hidden_size", -5), "'routed_expert_hidden_size' must be positive"),
    # an NVFP4 or fp8 checkpoint was tuned as bf16 experts; mxfp4 with other bits or groups as K3's mxfp4
    (lambda t: t["quantization_config"]["config_groups"]["group_0"].__setitem__("format", "nvfp4-pack-quantized"),
     "quantization nvfp4-pack-quantized is not one"),
    (lambda t: t.__setitem__("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "quantization quant_method 'fp8' is not one k3tune tunes"),
    (lambda t: t["quantization_config"]["config_groups"]["group_0"]["weights"].__setitem__("group_size", 16),
     "num_bits 4, group_size 16"),
])
def test_config_inconsistencies_named(tmp_path, change, msg):
    # each was accepted (a layer counted twice, top-k past the experts) or a ValueError traceback (a string latent)
    with pytest.raises(ConfigError, match=msg):
        model.load(_k3_with(tmp_path, change))


def test_zero_based_layer_indices_accepted(tmp_path):
    def shift(t):
        lin = t["linear_attn_config"]
        lin["kda_layers"] = [i - 1 for i in lin["kda_layers"]]
        lin["full_attn_layers"] = [i - 1 for i in lin["full_attn_layers"]]
    assert model.load(_k3_with(tmp_path, shift)).kda_layers == 69


def _spec(**matrix):
    base = {"tp": [8], "batch": [1], "dcp": [1], "draft": [0], "context": [8192]}
    base.update(matrix)
    return {"matrix": base}


@pytest.mark.parametrize("matrix, msg", [
    ({"batch": [0]}, "batch 0 out of range"),
    ({"batch": [65]}, "batch 65 out of range"),
    ({"draft": [8]}, "draft length 8"),
    ({"tp": [4], "dcp": [8]}, "dcp 8 invalid for tp 4"),
    ({"batch": "many"}, "list of integers"),
    ({"tp": [0]}, "tp 0 must be positive"),  # was "dcp 1 invalid for tp 0"
    ({"batch": {"min": 1.5, "max": 8}}, "range needs integer 'min' and 'max'"),  # was batch 1-8
    ({"context": {"min": 1, "max": 10**11}}, "range 1..100000000000 has 100000000000 values"),  # a MemoryError
    ({"ops": []}, "'ops' must be a non-empty list"),  # planned 0 problems, exit 0
    ({"ops": "kda.o_proj"}, "'ops' must be a non-empty list"),
    ({"routing": ["zipf:1.2"]}, "routing must be one string"),  # was "unknown routing '['zipf:1.2']'"
])
def test_bad_spec_values(matrix, msg):
    with pytest.raises(ConfigError, match=msg):
        spec.from_dict(_spec(**matrix))


def test_polish_passes_must_not_be_negative():
    with pytest.raises(ConfigError, match="polish >= 0"):
        spec.from_dict({**_spec(), "search": {"polish": -1}})
    assert spec.from_dict({**_spec(), "search": {"polish": 0}}).search.polish == 0


def test_a_folder_is_no_spec_and_a_model_folder_gives_its_config(tmp_path):
    """`--spec DIR` and `--config DIR` were IsADirectoryError tracebacks; a model's folder (a checkpoint's, as
    people pass them) now gives its config.json, and a folder without one is a one-line error."""
    with pytest.raises(ConfigError, match="is a folder: give a TOML file"):
        spec.load(tmp_path)
    with pytest.raises(ConfigError, match="is a folder without a config.json"):
        model.load(tmp_path)
    shutil.copy(model.configs_dir() / "kimi_k3_config.json", tmp_path / "config.json")
    assert model.load(tmp_path) == model.load()


def test_malformed_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[matrix\ntp = [8")
    with pytest.raises(ConfigError, match="malformed TOML"):
        spec.load(p)


@pytest.mark.parametrize("value", [1.5, True, "3"])
def test_search_values_are_whole_numbers(value):
    """budget = 1.5 (or true) swept with a budget of 1 without a word: int() took them."""
    with pytest.raises(ConfigError, match="values must be integers, not budget = "):
        spec.from_dict({**_spec(), "search": {"budget": value}})


def test_unknown_search_key():
    raw = _spec()
    raw["search"] = {"budgett": 3}
    with pytest.raises(ConfigError, match="unknown \\[search\\] keys"):
        spec.from_dict(raw)


@pytest.mark.parametrize("edit,msg", [
    (lambda r: r.update(serch={"budget": 3}), r"unknown top-level keys \['serch'\]"),
    (lambda r: r["matrix"].update(drafts=[0, 1]), r"unknown \[matrix\] keys \['drafts'\]"),
    (lambda r: r.update(buckets={"token": [1, 8]}), r"unknown \[buckets\] keys \['token'\]"),
    (lambda r: r.update(model={"path": "x.json"}), r"unknown \[model\] keys \['path'\]"),
    (lambda r: r.update(model="x.json"), r"\[model\] must be a table"),
    (lambda r: r.update(model={"config": 5}), r"\[model\] config must be a path"),  # was a TypeError traceback
])
def test_misspelt_spec_keys_are_errors_not_defaults(edit, msg):
    """A spec with `[serch]` (or `drafts = [0, 1]`) swept with the default search settings (or draft 0) without a
    word; only [search] keys were checked."""
    raw = _spec()
    edit(raw)
    with pytest.raises(ConfigError, match=msg):
        spec.from_dict(raw)


def test_tp_must_divide_heads():
    sp = spec.from_dict(_spec(tp=[5], dcp=[1]))
    with pytest.raises(ConfigError, match="tp 5 does not divide"):
        problems.build(sp, model.load())


def test_a_block_is_refused_at_a_tp_the_ops_it_runs_cannot_shard():
    """moe.block at tp 3 planned (its own widths divide) though the router + latent GEMM it runs (4480 wide) cannot
    be sharded 3 ways: every block trial would have failed on the GPU."""
    sp = spec.from_dict({"matrix": {**_spec(tp=[3])["matrix"], "ops": ["moe.block"]}})
    with pytest.raises(ConfigError, match=r"tp 3 does not divide router \+ latent width \(4480\)"):
        problems.build(sp, model.load())


def test_default_matrix_reduces_to_shared_problems():
    sp = spec.load()
    plan = problems.build(sp, model.load())
    assert len(plan.deployments) == 2 * 64 * 4 * 8 * 3  # dcp in {1,2,4,8} divides tp in {8,16}
    ops = {p.op for p in plan.problems}
    assert ops == {n for n, o in problems.OPS.items() if not o.opt_in}  # collectives only where a spec names them
    assert len(plan.problems) < len(plan.deployments) * len(ops) / 50
    # a dense problem is shared by every deployment with the same tp and tokens bucket, whatever DCP/context
    qkv = [p for p in plan.problems if p.op == "kda.qkvg_proj"]
    assert len(qkv) == 2 * len(sp.token_buckets)
    assert sum(plan.shared_by[p] for p in qkv) == len(plan.deployments)


def test_tokens_per_step_and_dcp():
    sp = spec.load()
    m = model.load()
    d = problems.Deployment(tp=16, batch=8, dcp=2, draft=6, context=131072)
    assert d.tokens == 56
    qkv = problems.problem_for(problems.OPS["kda.qkvg_proj"], m, d, sp)
    assert qkv.shape == {"M": 64, "N": 49152 // 16, "K": 7168}
    mla = problems.problem_for(problems.OPS["mla.decode"], m, d, sp)
    assert mla["heads"] == 96 // 16 * 2 and mla["ctx"] == 65536 and mla["qlen"] == 8
    d1 = problems.Deployment(tp=16, batch=8, dcp=1, draft=6, context=131072)
    assert problems.problem_for(problems.OPS["kda.qkvg_proj"], m, d1, sp) == qkv


def test_issue_shapes():
    m, sp = model.load(), spec.load()
    for tp in (8, 16):
        d = problems.Deployment(tp, 1, 1, 0, 8192)
        shape = lambda op: problems.problem_for(problems.OPS[op], m, d, sp).shape  # noqa: E731
        assert shape("kda.o_proj") == {"M": 1, "N": 7168, "K": 12288 // tp}
        assert shape("moe.router_latent") == {"M": 1, "N": 4480 // tp, "K": 7168}
        assert shape("moe.shared_w13") == {"M": 1, "N": 12288 // tp, "K": 7168}
        assert shape("moe.shared_w2") == {"M": 1, "N": 7168, "K": 6144 // tp}


def test_unknown_op_and_hardware():
    with pytest.raises(ConfigError, match="unknown op"):
        problems.op("kda.nope")
    with pytest.raises(HardwareError, match="unknown hardware"):
        hardware.spec("rtx4090")
    assert hardware.spec("GB300").sm_count == 160


def test_simulated_fingerprint_is_labelled():
    fp = hardware.simulated_fingerprint(hardware.spec("gb300"))
    assert fp.simulated and fp.class_key.startswith("sim:")
    assert fp.digest != hardware.simulated_fingerprint(hardware.spec("b200")).digest
