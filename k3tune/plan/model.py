"""The model's shape, read from K3's published config or any HF ``config.json`` of the Kimi linear family.

Reads K3's nested layout (``text_config`` holding a ``kimi_linear`` config) and flat ``kimi_linear`` configs.
Only the fields the decode problems depend on are kept; a missing or mistyped one is a ConfigError.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from k3tune.errors import ConfigError
from k3tune.shipped import configs_dir


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    num_layers: int
    kda_layers: int
    mla_layers: int
    # KDA (linear attention)
    kda_heads: int
    kda_head_dim: int
    kda_full_rank_gate: bool
    # MLA
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    mla_output_gate: bool
    # MoE
    num_experts: int
    top_k: int
    num_shared_experts: int
    moe_intermediate: int
    latent: int  # routed experts run in this width (0: no latent space)
    expert_weight_format: str  # "mxfp4" or "bf16"

    @property
    def shared_intermediate(self) -> int:
        # K3's shared experts together are one MLP of num_shared * moe_intermediate
        return self.num_shared_experts * self.moe_intermediate

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _get(cfg: dict, key: str, typ: type, source: str):
    if key not in cfg:
        raise ConfigError(f"{source}: missing field '{key}'")
    val = cfg[key]
    if typ is int and (isinstance(val, bool) or not isinstance(val, int)):
        raise ConfigError(f"{source}: field '{key}' must be an integer, got {val!r}")
    if typ is bool and not isinstance(val, bool):
        raise ConfigError(f"{source}: field '{key}' must be true/false, got {val!r}")
    if typ is int and val <= 0:
        raise ConfigError(f"{source}: field '{key}' must be positive, got {val}")
    return val


def _expert_format(quant, source: str) -> str:
    """The routed experts' weight format: "mxfp4" (compressed-tensors' mxfp4-pack-quantized: 4-bit codes, a scale
    per 32) or "bf16" (no quantization_config). Any other quantization was tuned as bf16 before; now it is named."""
    if not quant:
        return "bf16"
    if not isinstance(quant, dict):
        raise ConfigError(f"{source}: 'quantization_config' must be an object")
    groups = quant.get("config_groups") or {}
    groups = [g for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    # a group's own format, else the config's; each group's must be mxfp4
    formats = {str(g.get("format") or quant.get("format")) for g in groups} if groups else {str(quant.get("format"))}
    if not all("mxfp4" in f for f in formats):
        what = ", ".join(sorted(f for f in formats if "mxfp4" not in f and f != "None"))
        raise ConfigError(f"{source}: quantization {what or 'quant_method ' + repr(quant.get('quant_method'))} is "
                          "not one k3tune tunes (mxfp4-pack-quantized experts, or no quantization_config for bf16)")
    for g in groups:
        w = g.get("weights")
        if isinstance(w, dict) and (w.get("num_bits", 4), w.get("group_size", 32)) != (4, 32):
            raise ConfigError(f"{source}: mxfp4 weights are 4 bits in groups of 32, the config says "
                              f"num_bits {w.get('num_bits', 4)}, group_size {w.get('group_size', 32)}")
    return "mxfp4"


def _check_layer_indices(kda: list, full: list, layers: int, source: str) -> None:
    """Each layer is KDA or MLA, once: the two lists hold distinct integer indices in 1..layers (0..layers-1 for a
    0-based config). Counts that add up can still hide a layer listed twice and one never listed."""
    for name, idx in (("kda_layers", kda), ("full_attn_layers", full)):
        bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise ConfigError(f"{source}: {name} must hold integer layer indices, got {bad[0]!r}")
    both = sorted(kda + full)
    if both and (both[0] not in (0, 1) or both != list(range(both[0], both[0] + layers))):
        dup = sorted({i for i in both if both.count(i) > 1})
        what = f"layer {dup[0]} is listed twice" if dup else f"indices run {both[0]}..{both[-1]}"
        raise ConfigError(f"{source}: kda_layers and full_attn_layers must cover layers 1..{layers} once each: "
                          f"{what}")


def check_moe_fields(raw: dict, source: str) -> None:
    """The MoE block's fields alone (a checkpoint check's config may hold no more): whole and positive, top-k
    within the experts. K3's nested layout (``text_config``) or a flat one."""
    cfg = raw.get("text_config", raw) if isinstance(raw, dict) else raw
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    for key in ("hidden_size", "num_experts", "num_experts_per_token", "moe_intermediate_size", "num_shared_experts"):
        _get(cfg, key, int, source)
    if "routed_expert_hidden_size" in cfg:
        _get(cfg, "routed_expert_hidden_size", int, source)
    if cfg["num_experts_per_token"] > cfg["num_experts"]:
        raise ConfigError(f"{source}: num_experts_per_token {cfg['num_experts_per_token']} exceeds num_experts "
                          f"{cfg['num_experts']}")


def from_dict(raw: dict, source: str = "config") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    name = raw.get("model_type", "unknown")
    cfg = raw.get("text_config", raw)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: 'text_config' must be an object")
    if cfg.get("model_type") not in {"kimi_linear", "kimi_k3"}:
        raise ConfigError(f"{source}: unsupported model_type {cfg.get('model_type')!r} (expected kimi_linear)")
    lin = cfg.get("linear_attn_config")
    if not isinstance(lin, dict):
        raise ConfigError(f"{source}: missing object 'linear_attn_config'")
    layers = _get(cfg, "num_hidden_layers", int, source)
    kda = lin.get("kda_layers", [])
    full = lin.get("full_attn_layers", [])
    if not isinstance(kda, list) or not isinstance(full, list):
        raise ConfigError(f"{source}: kda_layers and full_attn_layers must be lists")
    if len(kda) + len(full) != layers:
        raise ConfigError(f"{source}: {len(kda)} KDA + {len(full)} MLA layers != num_hidden_layers {layers}")
    _check_layer_indices(kda, full, layers, source)
    fmt = _expert_format(cfg.get("quantization_config"), source)
    hidden = _get(cfg, "hidden_size", int, source)
    check_moe_fields(cfg, source)
    num_experts, top_k = cfg["num_experts"], cfg["num_experts_per_token"]
    # absent: the routed experts run at the hidden width (no latent space)
    latent = cfg.get("routed_expert_hidden_size", hidden)
    return ModelConfig(
        name=str(name),
        hidden=hidden,
        num_layers=layers,
        kda_layers=len(kda),
        mla_layers=len(full),
        kda_heads=_get(lin, "num_heads", int, source),
        kda_head_dim=_get(lin, "head_dim", int, source),
        kda_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
        mla_heads=_get(cfg, "num_attention_heads", int, source),
        q_lora_rank=_get(cfg, "q_lora_rank", int, source),
        kv_lora_rank=_get(cfg, "kv_lora_rank", int, source),
        qk_nope_dim=_get(cfg, "qk_nope_head_dim", int, source),
        qk_rope_dim=_get(cfg, "qk_rope_head_dim", int, source),
        v_head_dim=_get(cfg, "v_head_dim", int, source),
        mla_output_gate=bool(cfg.get("mla_use_output_gate", False)),
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=_get(cfg, "num_shared_experts", int, source),
        moe_intermediate=_get(cfg, "moe_intermediate_size", int, source),
        latent=latent,
        expert_weight_format=fmt,
    )


def read_raw(path: str | Path | None = None) -> tuple[dict, Path]:
    """A config.json's JSON and where it was found; None means K3's published config shipped in configs/. A bare
    file name that is not in the working directory is looked up among the shipped configs."""
    p = Path(path) if path else configs_dir() / "kimi_k3_config.json"
    if path and not p.exists() and len(p.parts) == 1 and (configs_dir() / p).exists():
        p = configs_dir() / p
    if p.is_dir():  # a model's folder (a checkpoint's): its config.json (was an IsADirectoryError traceback)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model config: {p} is a folder without a config.json")
        p = p / "config.json"
    try:
        return json.loads(p.read_text()), p
    except FileNotFoundError:
        raise ConfigError(f"model config not found: {p}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    except OSError as e:  # unreadable (permissions, a device)
        raise ConfigError(f"model config {p}: cannot be read ({e.strerror or e})") from None


def load(path: str | Path | None = None) -> ModelConfig:
    """Load a config.json (found as ``read_raw`` finds it)."""
    raw, p = read_raw(path)
    return from_dict(raw, str(p))
