"""Loading one rank's MoE block weights from a checkpoint's tensors (k3tune.runtime.checkpoint): from memory and
from safetensors shards on disk, both expert formats, checked against the model computed from the unsharded
tensors: through the executor at tp 1, and by an explicit tp-rank forward (real gathers and sums over the
ranks' loaded shards) at tp 4."""

import json

import pytest
import torch

from k3tune.errors import ConfigError
from k3tune.kernels import mxfp4
from k3tune.runtime import Selector
from k3tune.runtime.checkpoint import TensorNames, load_rank_weights
from k3tune.runtime.moe import BlockShape, MoEBlock, reference, routing_agrees, situ

SMALL = BlockShape(hidden=256, experts=32, top_k=4, latent=128, inter=128, shared_inter=256)
LAYER = 3
N = TensorNames()


def _checkpoint(shape: BlockShape, fmt: str, seed: int = 0) -> dict:
    """A random unsharded MoE layer under HuggingFace names (experts quantised with compressed-tensors' names
    when ``fmt`` is mxfp4), and a few tensors of other layers that the loader must ignore."""
    g = torch.Generator().manual_seed(seed)
    h, e, lat, i, s = shape.hidden, shape.experts, shape.latent, shape.inter, shape.shared_inter

    def mat(*dims, fan_in):
        return (torch.randn(*dims, generator=g) / fan_in ** 0.5).to(torch.bfloat16)

    t = {N.router.format(layer=LAYER): mat(e, h, fan_in=h),
         N.bias.format(layer=LAYER): torch.randn(e, generator=g) * 0.1,
         N.latent_down.format(layer=LAYER): mat(lat, h, fan_in=h),
         N.latent_norm.format(layer=LAYER): (1 + 0.1 * torch.randn(lat, generator=g)).to(torch.bfloat16),
         N.latent_up.format(layer=LAYER): mat(h, lat, fan_in=lat),
         N.router.format(layer=LAYER + 1): mat(e, h, fan_in=h)}
    for proj, dims, fan_in in (("gate_proj", (s, h), h), ("up_proj", (s, h), h), ("down_proj", (h, s), s)):
        t[N.shared.format(layer=LAYER, proj=proj) + ".weight"] = mat(*dims, fan_in=fan_in)
    for x in range(e):
        for proj, dims, fan_in in (("gate_proj", (i, lat), lat), ("up_proj", (i, lat), lat),
                                   ("down_proj", (lat, i), i)):
            base = N.expert.format(layer=LAYER, expert=x, proj=proj)
            w = mat(*dims, fan_in=fan_in)
            if fmt == "mxfp4":
                t[base + ".weight_packed"], t[base + ".weight_scale"] = mxfp4.quantize(w)
            else:
                t[base + ".weight"] = w
    return t


def _full(ckpt: dict, shape: BlockShape) -> dict:
    """The reference's unsharded weights, straight from the checkpoint's names (fp32; MXFP4 decoded)."""
    def proj(base):
        if base + ".weight" in ckpt:
            return ckpt[base + ".weight"].float()
        return mxfp4.dequantize(ckpt[base + ".weight_packed"], ckpt[base + ".weight_scale"], torch.float32)

    def expert(x):
        p = {q: proj(N.expert.format(layer=LAYER, expert=x, proj=q)) for q in ("gate_proj", "up_proj", "down_proj")}
        return torch.cat([p["gate_proj"], p["up_proj"]]), p["down_proj"]

    sh = {q: proj(N.shared.format(layer=LAYER, proj=q)) for q in ("gate_proj", "up_proj", "down_proj")}
    return {"w_rl": torch.cat([ckpt[N.router.format(layer=LAYER)], ckpt[N.latent_down.format(layer=LAYER)]]).float(),
            "bias": ckpt[N.bias.format(layer=LAYER)].float(), "expert": expert,
            "norm": ckpt[N.latent_norm.format(layer=LAYER)].float(),
            "w_up": ckpt[N.latent_up.format(layer=LAYER)].float(),
            "shared_w13": torch.cat([sh["gate_proj"], sh["up_proj"]]), "shared_w2": sh["down_proj"]}


def _x(shape, batch, seed=1):
    return torch.randn(batch, shape.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_a_loaded_rank_runs_in_the_executor_and_matches_the_checkpoints_model(fmt):
    ckpt = _checkpoint(SMALL, fmt)
    w = load_rank_weights(ckpt, SMALL, tp=1, rank=0, layer=LAYER)
    assert w.fmt == fmt and w.w_rl.dtype == torch.bfloat16 and w.bias.dtype == torch.float32
    blk = MoEBlock.build(w, "tuned", batch=3, selector=Selector.load(None))
    x = _x(SMALL, 3)
    out = blk(x)
    full = _full(ckpt, SMALL)
    _, _, biased = reference(x, full, SMALL)
    assert routing_agrees(blk.last_top, biased, SMALL)
    ref, _, _ = reference(x, full, SMALL, top=blk.last_top)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    assert blk.ran["experts"].startswith("MXFP4" if fmt == "mxfp4" else "torch._grouped_mm")


def _tp_forward(x, ranks: list, shape: BlockShape, top):
    """The block over tp ranks' shards with its collectives done for real: gather = concatenation in rank order,
    all-reduce = sum over ranks (fp32, experts ``top`` imposed)."""
    x = x.float()
    y = torch.cat([x @ r.w_rl.float().t() for r in ranks], dim=-1)
    scores, latent = y[:, :shape.experts], y[:, shape.experts:]
    s = torch.sigmoid(scores)
    wts = s.gather(1, top)
    wts = wts / wts.sum(-1, keepdim=True) * shape.scaling
    routed = torch.zeros_like(latent)
    for r in ranks:
        w13 = r.w13.float() if r.fmt == "bf16" else mxfp4.dequantize(*r.w13, torch.float32)
        w2 = r.w2.float() if r.fmt == "bf16" else mxfp4.dequantize(*r.w2, torch.float32)
        for b in range(x.shape[0]):
            for j, e in enumerate(top[b].tolist()):
                gate, up = (latent[b] @ w13[e].t()).chunk(2)
                routed[b] += wts[b, j] * (situ(gate, up, shape.situ_beta, shape.situ_linear_beta) @ w2[e].t())
    normed = routed * torch.rsqrt(routed.pow(2).mean(-1, keepdim=True) + shape.rms_eps) * ranks[0].norm.float()
    out = torch.zeros(x.shape[0], shape.hidden)
    width = shape.latent // len(ranks)
    for k, r in enumerate(ranks):
        out += normed[:, k * width:(k + 1) * width] @ r.w_up.float().t()
        gate, up = (x @ r.shared_w13.float().t()).chunk(2, dim=-1)
        out += situ(gate, up, shape.situ_beta, shape.situ_linear_beta) @ r.shared_w2.float().t()
    return out


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_the_ranks_shards_compose_to_the_unsharded_layer(fmt):
    """tp = 4: rank r's slices (router/latent rows straddling the router's end, expert gate/up rows, down and
    latent-up columns, MXFP4 codes and scales sliced in place) give, gathered and summed, the unsharded model."""
    ckpt = _checkpoint(SMALL, fmt, seed=5)
    ranks = [load_rank_weights(ckpt, SMALL, tp=4, rank=r, layer=LAYER) for r in range(4)]
    assert ranks[0].w_rl.shape == ((SMALL.experts + SMALL.latent) // 4, SMALL.hidden)
    if fmt == "mxfp4":
        assert ranks[1].w2[0].shape == (SMALL.experts, SMALL.latent, SMALL.inter // 4 // 2)
        assert ranks[1].w2[1].shape == (SMALL.experts, SMALL.latent, SMALL.inter // 4 // mxfp4.BLOCK)
    x = _x(SMALL, 3, seed=2)
    full = _full(ckpt, SMALL)
    ref, top, _ = reference(x, full, SMALL)
    got = _tp_forward(x, ranks, SMALL, top)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4


def _shards(ckpt: dict, folder, index: bool):
    from safetensors.torch import save_file

    names = sorted(ckpt)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, part in halves.items():
        save_file({n: ckpt[n].contiguous() for n in part}, str(folder / f))
    if index:
        wm = {n: f for f, part in halves.items() for n in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


@pytest.mark.parametrize("index", [True, False])
def test_safetensors_shards_load_as_the_tensors_do(tmp_path, index):
    from safetensors.torch import save_file

    ckpt = _checkpoint(SMALL, "mxfp4", seed=3)
    _shards(ckpt, tmp_path, index)
    for rank in (0, 3):
        mem = load_rank_weights(ckpt, SMALL, tp=4, rank=rank, layer=LAYER)
        disk = load_rank_weights(tmp_path, SMALL, tp=4, rank=rank, layer=LAYER)
        for a, b in zip((mem.w_rl, mem.bias, mem.norm, mem.w_up, mem.shared_w13, mem.shared_w2, *mem.w13, *mem.w2),
                        (disk.w_rl, disk.bias, disk.norm, disk.w_up, disk.shared_w13, disk.shared_w2, *disk.w13,
                         *disk.w2)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    one = tmp_path / "one.safetensors"
    save_file({n: t.contiguous() for n, t in ckpt.items()}, str(one))
    assert torch.equal(load_rank_weights(one, SMALL, tp=2, rank=1, layer=LAYER).w13[0],
                       load_rank_weights(ckpt, SMALL, tp=2, rank=1, layer=LAYER).w13[0])


def test_the_expert_format_converts_on_request():
    ckpt = _checkpoint(SMALL, "bf16", seed=4)
    q = load_rank_weights(ckpt, SMALL, tp=2, rank=1, layer=LAYER, fmt="mxfp4")
    b = load_rank_weights(ckpt, SMALL, tp=2, rank=1, layer=LAYER)
    assert q.fmt == "mxfp4" and torch.equal(q.w13[0], mxfp4.quantize(b.w13)[0])
    back = load_rank_weights(_checkpoint(SMALL, "mxfp4", seed=4), SMALL, tp=2, rank=1, layer=LAYER, fmt="bf16")
    assert back.fmt == "bf16" and back.w13.dtype == torch.bfloat16 and back.w13.shape == b.w13.shape


def test_bad_checkpoints_are_one_line_config_errors(tmp_path):
    ckpt = _checkpoint(SMALL, "bf16")
    with pytest.raises(ConfigError, match="no routed expert 0 in layer 7"):
        load_rank_weights(ckpt, SMALL, tp=1, rank=0, layer=7)
    with pytest.raises(ConfigError, match="rank 4 is not in 0..3"):
        load_rank_weights(ckpt, SMALL, tp=4, rank=4, layer=LAYER)
    with pytest.raises(ConfigError, match="does not divide"):
        load_rank_weights(ckpt, SMALL, tp=3, rank=0, layer=LAYER)
    wrong = dict(ckpt)
    wrong[N.latent_up.format(layer=LAYER)] = torch.zeros(SMALL.hidden, SMALL.latent + 1)
    with pytest.raises(ConfigError, match=r"latent_up_proj.weight has shape \[256, 129\], expected \[256, 128\]"):
        load_rank_weights(wrong, SMALL, tp=1, rank=0, layer=LAYER)
    missing = {k: v for k, v in ckpt.items() if ".experts.5.down_proj" not in k}
    with pytest.raises(ConfigError, match="experts.5.down_proj.weight is missing"):
        load_rank_weights(missing, SMALL, tp=1, rank=0, layer=LAYER)
    mixed = dict(ckpt)
    base = N.expert.format(layer=LAYER, expert=2, proj="up_proj")
    mixed[base + ".weight_packed"], mixed[base + ".weight_scale"] = mxfp4.quantize(mixed.pop(base + ".weight"))
    with pytest.raises(ConfigError, match="expert 2 is not stored as bf16"):
        load_rank_weights(mixed, SMALL, tp=1, rank=0, layer=LAYER)
    with pytest.raises(ConfigError, match="no such file"):
        load_rank_weights(tmp_path / "nope", SMALL, tp=1, rank=0, layer=LAYER)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_rank_weights(tmp_path / "bad.safetensors", SMALL, tp=1, rank=0, layer=LAYER)
    shards = tmp_path / "shards"  # an index naming a shard that is missing, or not safetensors
    shards.mkdir()
    _shards(ckpt, shards, index=True)
    (shards / "model-00002-of-00002.safetensors").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors: not a readable safetensors file"):
        load_rank_weights(shards, SMALL, tp=1, rank=0, layer=LAYER)
    (shards / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="shard model-00002-of-00002.safetensors of .* is missing"):
        load_rank_weights(shards, SMALL, tp=1, rank=0, layer=LAYER)
    from safetensors.torch import save_file  # a stale index: the shard it names lacks the tensor (was a traceback)
    save_file({"other": torch.zeros(2)}, str(shards / "model-00002-of-00002.safetensors"))
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors holds no tensor .* that the index puts"):
        load_rank_weights(shards, SMALL, tp=1, rank=0, layer=LAYER)
    codes = dict(ckpt)  # e8m0 scales stored as fp32 (the right shape) were loaded as they were; kernels read bytes
    base = N.expert.format(layer=LAYER, expert=0, proj="gate_proj")
    codes[base + ".weight_packed"], codes[base + ".weight_scale"] = mxfp4.quantize(codes.pop(base + ".weight"))
    codes[base + ".weight_scale"] = codes[base + ".weight_scale"].float()
    with pytest.raises(ConfigError, match=r"experts.0.gate_proj.weight_scale is stored as F32, expected U8"):
        load_rank_weights(codes, SMALL, tp=1, rank=0, layer=LAYER)
    renamed = {k.replace("latent_norm", "post_latent_norm"): v for k, v in ckpt.items()}
    w = load_rank_weights(renamed, SMALL, tp=1, rank=0, layer=LAYER,
                          names=TensorNames(latent_norm="model.layers.{layer}.mlp.post_latent_norm.weight"))
    assert torch.equal(w.norm, ckpt[N.latent_norm.format(layer=LAYER)])


def test_checkpoint_check_command(tmp_path):
    """`k3tune checkpoint check`: OK (exit 0) on a loadable layer, one line per problem and exit 1 otherwise."""
    import io
    from contextlib import redirect_stdout

    from k3tune.cli import main

    cfg = {"text_config": {"hidden_size": SMALL.hidden, "num_experts": SMALL.experts,
                           "num_experts_per_token": SMALL.top_k, "routed_expert_hidden_size": SMALL.latent,
                           "moe_intermediate_size": SMALL.inter, "num_shared_experts": 2,
                           "num_hidden_layers": 5, "first_k_dense_replace": LAYER}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ck = tmp_path / "ckpt"
    ck.mkdir()
    ckpt = _checkpoint(SMALL, "mxfp4", seed=8)
    ckpt[N.latent_up.format(layer=LAYER)] = torch.zeros(SMALL.hidden, SMALL.latent + 2)
    _shards(ckpt, ck, index=True)
    args = ["checkpoint", "check", str(ck), "--config", str(tmp_path / "config.json"), "--json"]

    def run(*extra):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main([*args, *extra])
        return rc, json.loads(buf.getvalue())

    rc, out = run("--layers", "3", "--tp", "4")
    assert rc == 1 and out["expert_formats"] == ["mxfp4"]
    assert out["problems"] == [f"{N.latent_up.format(layer=LAYER)} has shape [256, 130], expected [256, 128]"]
    rc, out = run("--tp", "3")  # every MoE layer of the config: 3 and 4; layer 4 is not in the checkpoint
    assert rc == 1 and any("does not divide" in p for p in out["problems"])
    assert any("no routed expert 0 in layer 4" in p for p in out["problems"])
    ckpt[N.latent_up.format(layer=LAYER)] = torch.zeros(SMALL.hidden, SMALL.latent, dtype=torch.bfloat16)
    for f in ck.iterdir():
        f.unlink()
    _shards(ckpt, ck, index=False)
    assert run("--layers", "3", "--tp", "4", "--tp", "2") == (0, {**out, "layers": 1, "tp": [4, 2], "problems": []})
    assert main(["checkpoint", "check", str(ck), "--config", str(tmp_path / "config.json"), "--layers", "2"]) == 2
    # a backwards range checked no layer and said OK; tp 0 was a ZeroDivisionError traceback, a negative tp passed;
    # a layer named twice was checked and counted twice; a range far past the last layer was a MemoryError
    for extra in (["--layers", "4-3"], ["--tp", "0"], ["--tp", "-4"], ["--layers", "1-1000000000000"]):
        assert main(["checkpoint", "check", str(ck), "--config", str(tmp_path / "config.json"), *extra]) == 2, extra
    assert run("--layers", "3,3", "--tp", "4")[1]["layers"] == 1
    # right shapes in dtypes the block cannot load (e8m0 scales as bf16, an fp8 weight without its scale) passed
    scale = N.expert.format(layer=LAYER, expert=1, proj="up_proj") + ".weight_scale"
    ckpt[scale] = ckpt[scale].to(torch.bfloat16)
    ckpt[N.latent_up.format(layer=LAYER)] = ckpt[N.latent_up.format(layer=LAYER)].to(torch.float8_e4m3fn)
    for f in ck.iterdir():
        f.unlink()
    _shards(ckpt, ck, index=True)
    rc, out = run("--layers", "3", "--tp", "4")
    assert rc == 1 and sorted(out["problems"]) == [
        f"{scale} is stored as BF16, expected U8",
        f"{N.latent_up.format(layer=LAYER)} is stored as F8_E4M3, expected BF16 or F16 or F32"]


def test_checkpoint_check_types_the_config_it_is_given(tmp_path, capsys):
    """A config's MoE widths were taken as written: a string hidden_size or top-k past the experts went on into
    shape checks. They are checked as `plan` checks them, before any checkpoint file is read."""
    from k3tune.cli import main

    for change, msg in (({"hidden_size": "7168"}, "field 'hidden_size' must be an integer"),
                        ({"num_experts_per_token": 9}, "num_experts_per_token 9 exceeds num_experts 8")):
        cfg = {"text_config": {"hidden_size": 64, "num_experts": 8, "num_experts_per_token": 2,
                               "routed_expert_hidden_size": 32, "moe_intermediate_size": 64, "num_shared_experts": 2,
                               "num_hidden_layers": 5, "first_k_dense_replace": 1, **change}}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert main(["checkpoint", "check", str(tmp_path / "none"), "--config", str(tmp_path / "config.json")]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
