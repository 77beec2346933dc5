"""One rank's MoE block weights (``RankWeights``) from a checkpoint's tensors, sharded as the executor runs them.

A source is either a mapping of tensor names to tensors (the checkpoint already in memory) or a safetensors
checkpoint on disk: one ``.safetensors`` file, or a directory with a ``model.safetensors.index.json`` (its
``weight_map`` names each tensor's shard) or with ``*.safetensors`` files. From disk only the rank's slice of each
tensor is read (safetensors slices lazily), so a rank never reads another rank's expert bytes; shapes are checked
from the header before anything is read.

Tensor names (``TensorNames``; every field a ``str.format`` pattern over ``layer``, ``expert`` and ``proj``):
the router, its correction bias, the experts and the shared experts follow the DeepSeek-V3 / Kimi layout of
HuggingFace checkpoints (``model.layers.{layer}.mlp.gate.weight``, ``….mlp.experts.{expert}.gate_proj``,
``….mlp.shared_experts.up_proj``, …). K3's latent projections and latent norm have no published names; the
defaults (``latent_down_proj``, ``latent_up_proj``, ``latent_norm``) are assumptions: pass ``TensorNames(...)``
with a checkpoint's own names. A projection stored in bf16 (or fp16/fp32) is ``<name>.weight``; one stored in
MXFP4 is compressed-tensors' ``mxfp4-pack-quantized`` (K3's ``quantization_config``): ``<name>.weight_packed``
(uint8 [N, K / 2], the even index in the low nibble) and ``<name>.weight_scale`` (uint8 E8M0 [N, K / 32]),
which is ``k3tune.kernels.mxfp4``'s layout, so the codes are sliced, never decoded.

Sharding (the executor's, see ``k3tune.runtime.moe``): the fused [router; latent-down] matrix ((E + L) x H) by
rows into tp contiguous parts; each expert's gate and up projections by rows (rank r: rows r I/tp … (r+1) I/tp
of each, gate then up) and its down projection by columns; the shared experts likewise; the latent
up-projection (H x L) by columns; the bias and the latent norm whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from k3tune.errors import ConfigError
from k3tune.kernels import mxfp4
from k3tune.runtime.moe import BlockShape, RankWeights

INDEX = "model.safetensors.index.json"
FLOATS = ("BF16", "F16", "F32")  # converted on load; anything else (F8_E4M3 without its scale, ints) would load wrong


def _dtype_problem(src, name: str) -> str | None:
    """One line if ``name`` is stored in a dtype the block cannot load it from (MXFP4 codes and e8m0 scales are
    bytes, the rest floats), else None."""
    got, ok = src.dtype(name), ("U8",) if name.endswith((".weight_packed", ".weight_scale")) else FLOATS
    return None if got in ok else f"{name} is stored as {got}, expected {' or '.join(ok)}"


@dataclass(frozen=True)
class TensorNames:
    router: str = "model.layers.{layer}.mlp.gate.weight"
    bias: str = "model.layers.{layer}.mlp.gate.e_score_correction_bias"
    latent_down: str = "model.layers.{layer}.mlp.latent_down_proj.weight"
    latent_norm: str = "model.layers.{layer}.mlp.latent_norm.weight"
    latent_up: str = "model.layers.{layer}.mlp.latent_up_proj.weight"
    expert: str = "model.layers.{layer}.mlp.experts.{expert}.{proj}"  # + .weight or .weight_packed/.weight_scale
    shared: str = "model.layers.{layer}.mlp.shared_experts.{proj}"


class MappingSource:
    """Tensors already in memory, by name."""

    def __init__(self, tensors: Mapping, label: str = "the given tensors"):
        self.tensors, self.label = tensors, label

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> str:
        """As safetensors names it (U8, BF16, F32, ...)."""
        import torch

        d = self.tensors[name].dtype
        return {torch.uint8: "U8", torch.int8: "I8", torch.bfloat16: "BF16", torch.float16: "F16",
                torch.float32: "F32"}.get(d, str(d).removeprefix("torch.").upper())

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None):
        t = self.tensors[name]
        return t[rows or slice(None)] if cols is None else t[rows or slice(None), cols]


class SafetensorsSource:
    """A safetensors checkpoint: a file, or a directory (with an index, or every ``*.safetensors`` in it)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            index = path / INDEX
            if index.exists():
                try:
                    where = {n: path / f for n, f in json.loads(index.read_text())["weight_map"].items()}
                except (ValueError, KeyError, AttributeError) as e:
                    raise ConfigError(f"{index}: not a safetensors index (weight_map): {e}") from None
            else:
                where = {}
                for f in sorted(path.glob("*.safetensors")):
                    where.update(dict.fromkeys(self._keys(f), f))
            if not where:
                raise ConfigError(f"{path}: no safetensors files (nor {INDEX})")
        elif path.is_file():
            where = dict.fromkeys(self._keys(path), path)
        else:
            raise ConfigError(f"checkpoint {path}: no such file or directory")
        self.where, self.label, self._files = where, str(path), {}

    @staticmethod
    def _handle(f: Path):
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(f, framework="pt")
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f}: not a readable safetensors file ({e})") from None

    @classmethod
    def _keys(cls, f: Path) -> list[str]:
        return list(cls._handle(f).keys())

    def _slice(self, name: str):
        f = self.where[name]
        if f not in self._files:
            if not f.exists():
                raise ConfigError(f"{self.label}: shard {f.name} of {name} is missing")
            handle = self._handle(f)
            self._files[f] = handle, set(handle.keys())
        handle, names = self._files[f]
        if name not in names:  # a stale index, e.g. after the shards were re-cut
            raise ConfigError(f"{self.label}: {f.name} holds no tensor {name} that the index puts there")
        return handle.get_slice(name)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None):
        s = self._slice(name)
        return s[rows or slice(None)] if cols is None else s[rows or slice(None), cols]


def open_source(checkpoint) -> MappingSource | SafetensorsSource:
    """A mapping of tensors, or the path of a safetensors checkpoint."""
    if isinstance(checkpoint, Mapping):
        return MappingSource(checkpoint)
    if isinstance(checkpoint, (MappingSource, SafetensorsSource)):
        return checkpoint
    return SafetensorsSource(checkpoint)


def stored_format(source, layer: int, names: TensorNames = TensorNames()) -> str:
    """'mxfp4' or 'bf16': how the layer's routed experts are stored (expert 0's gate projection decides)."""
    source = open_source(source)
    base = names.expert.format(layer=layer, expert=0, proj="gate_proj")
    if base + ".weight_packed" in source:
        return "mxfp4"
    if base + ".weight" in source:
        return "bf16"
    raise ConfigError(f"{source.label}: no routed expert 0 in layer {layer} ({base}.weight or .weight_packed); "
                      "pass TensorNames for this checkpoint's names")


def layer_tensors(checkpoint, shape: BlockShape, layer: int, names: TensorNames = TensorNames()) -> dict[str, tuple]:
    """Every tensor MoE layer ``layer`` needs, by name, with its unsharded shape. A projection is listed as the
    checkpoint stores it: ``<name>.weight``, or ``<name>.weight_packed`` and ``<name>.weight_scale`` (MXFP4)."""
    src = open_source(checkpoint)
    h, e, lat, inter, s = shape.hidden, shape.experts, shape.latent, shape.inter, shape.shared_inter
    want = {names.router.format(layer=layer): (e, h), names.bias.format(layer=layer): (e,),
            names.latent_down.format(layer=layer): (lat, h), names.latent_norm.format(layer=layer): (lat,),
            names.latent_up.format(layer=layer): (h, lat)}

    def proj(base: str, n: int, k: int):
        if base + ".weight_packed" in src:
            want[base + ".weight_packed"], want[base + ".weight_scale"] = (n, k // 2), (n, k // mxfp4.BLOCK)
        else:
            want[base + ".weight"] = (n, k)

    for x in range(e):
        for q, n, k in (("gate_proj", inter, lat), ("up_proj", inter, lat), ("down_proj", lat, inter)):
            proj(names.expert.format(layer=layer, expert=x, proj=q), n, k)
    for q, n, k in (("gate_proj", s, h), ("up_proj", s, h), ("down_proj", h, s)):
        proj(names.shared.format(layer=layer, proj=q), n, k)
    return want


def moe_layers(raw: dict) -> list[int]:
    """The MoE layers of a HuggingFace config (K3's: ``text_config`` nested): layer i is MoE from
    ``first_k_dense_replace`` on, every ``moe_layer_freq``-th (DeepSeek-V3's rule)."""
    c = raw.get("text_config", raw)
    try:
        n, first, freq = int(c["num_hidden_layers"]), int(c.get("first_k_dense_replace", 0)), int(c.get("moe_layer_freq", 1))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"config: cannot tell the MoE layers ({e})") from None
    return [i for i in range(first, n) if i % max(freq, 1) == 0]


def check_checkpoint(checkpoint, shape: BlockShape, layers, tps=(),
                     names: TensorNames = TensorNames()) -> tuple[list[str], list[str]]:
    """(problems, expert formats): what keeps the MoE layers ``layers`` from loading, one line each (empty: they all
    load) — missing tensors, wrong shapes, experts stored in another format than expert 0, a tp in ``tps`` the shape
    does not allow — and the formats their routed experts are stored in. Reads tensor headers only."""
    src = open_source(checkpoint)
    problems, formats = [], set()
    for tp in tps:
        try:
            shape.check_tp(tp)
        except ConfigError as e:
            problems.append(str(e))
    for layer in layers:
        try:
            stored = stored_format(src, layer, names)
        except ConfigError as e:
            problems.append(str(e))
            continue
        formats.add(stored)
        for n, expect in layer_tensors(src, shape, layer, names).items():
            if n not in src:
                problems.append(f"{n} is missing")
            elif (got := src.shape(n)) != expect:
                problems.append(f"{n} has shape {list(got)}, expected {list(expect)}")
            elif bad := _dtype_problem(src, n):
                problems.append(bad)
            elif ".experts." in n and n.endswith(".weight") != (stored == "bf16"):
                problems.append(f"{n}: stored as {'bf16' if stored == 'mxfp4' else 'mxfp4'}, expert 0 as {stored}")
    return problems, sorted(formats)


def load_rank_weights(checkpoint, shape: BlockShape, tp: int, rank: int, layer: int, fmt: str | None = None,
                      names: TensorNames = TensorNames(), device="cpu") -> RankWeights:
    """Rank ``rank`` of ``tp``'s weights of MoE layer ``layer``. ``fmt``: the routed experts' format in the result
    (None: as stored; 'mxfp4' from bf16 quantises, 'bf16' from MXFP4 dequantises). Raises ConfigError, one line,
    for a missing tensor, a wrong shape, or a tp/rank the shape does not allow."""
    import torch

    shape.check_tp(tp)
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} is not in 0..{tp - 1}")
    if fmt not in (None, "bf16", "mxfp4"):
        raise ConfigError(f"expert weight format {fmt!r}: expected bf16 or mxfp4")
    src = open_source(checkpoint)
    stored = stored_format(src, layer, names)
    fmt = fmt or stored
    e, lat = shape.experts, shape.latent
    i, sr = shape.inter // tp, shape.shared_inter // tp

    def name(pattern: str, **kw) -> str:
        return pattern.format(layer=layer, **kw)

    want = layer_tensors(src, shape, layer, names)

    def get(n: str, rows=None, cols=None):
        if n not in src:
            raise ConfigError(f"{src.label}: tensor {n} is missing")
        got = src.shape(n)
        if got != want[n]:
            raise ConfigError(f"{src.label}: {n} has shape {list(got)}, expected {list(want[n])}")
        if bad := _dtype_problem(src, n):
            raise ConfigError(f"{src.label}: {bad}")
        return src.read(n, rows, cols)

    def bf16(t):
        return t.to(device=device, dtype=torch.bfloat16)

    def mine(n: int) -> slice:  # this rank's n rows (or columns): rank n … (rank + 1) n
        return slice(rank * n, (rank + 1) * n)

    # the fused [router; latent-down] rows this rank computes
    per = (e + lat) // tp
    lo, hi = rank * per, (rank + 1) * per
    parts = []
    if lo < e:
        parts.append(get(name(names.router), rows=slice(lo, min(hi, e))))
    if hi > e:
        parts.append(get(name(names.latent_down), rows=slice(max(lo, e) - e, hi - e)))
    w_rl = bf16(torch.cat(parts, dim=0))
    bias = get(name(names.bias)).to(device=device, dtype=torch.float32)
    norm = bf16(get(name(names.latent_norm)))
    w_up = bf16(get(name(names.latent_up), cols=mine(lat // tp)))

    def proj(pattern: str, rows=None, cols=None, to_bf16=False, **kw):
        """One projection's slice for this rank, as stored (bf16, or MXFP4 codes and scales; ``to_bf16``:
        MXFP4 dequantised)."""
        base = pattern.format(layer=layer, **kw)
        if base + ".weight_packed" not in src:
            return bf16(get(base + ".weight", rows, cols))
        pc = None if cols is None else slice(cols.start // 2, cols.stop // 2)
        sc = None if cols is None else slice(cols.start // mxfp4.BLOCK, cols.stop // mxfp4.BLOCK)
        pair = (get(base + ".weight_packed", rows, pc).to(device), get(base + ".weight_scale", rows, sc).to(device))
        return mxfp4.dequantize(*pair) if to_bf16 else pair

    if stored == "mxfp4" and lat % mxfp4.BLOCK:
        raise ConfigError(f"MXFP4 experts need the latent width ({lat}) to be a multiple of {mxfp4.BLOCK}")
    w13 = w2 = None
    for x in range(e):  # one expert at a time into preallocated stacks: no second copy of the layer
        gate = proj(names.expert, rows=mine(i), expert=x, proj="gate_proj")
        up = proj(names.expert, rows=mine(i), expert=x, proj="up_proj")
        down = proj(names.expert, cols=mine(i), expert=x, proj="down_proj")
        if {isinstance(t, tuple) for t in (gate, up, down)} != {stored == "mxfp4"}:
            raise ConfigError(f"{src.label}: layer {layer} expert {x} is not stored as {stored} like expert 0")
        if stored == "bf16":
            one13, one2 = torch.cat([gate, up], dim=0), down
            if w13 is None:
                w13 = torch.empty(e, *one13.shape, dtype=one13.dtype, device=device)
                w2 = torch.empty(e, *one2.shape, dtype=one2.dtype, device=device)
            w13[x], w2[x] = one13, one2
        else:
            one13 = tuple(torch.cat([g, u], dim=0) for g, u in zip(gate, up))
            if w13 is None:
                w13 = tuple(torch.empty(e, *t.shape, dtype=t.dtype, device=device) for t in one13)
                w2 = tuple(torch.empty(e, *t.shape, dtype=t.dtype, device=device) for t in down)
            for dst, t in zip(w13 + w2, one13 + down):
                dst[x] = t
    if fmt != stored:
        w13, w2 = ((mxfp4.quantize(w13), mxfp4.quantize(w2)) if fmt == "mxfp4"
                   else (mxfp4.dequantize(*w13), mxfp4.dequantize(*w2)))
    # the shared experts run in bf16 (K3's quantization_config leaves them out; quantised ones are dequantised)
    sgate = proj(names.shared, rows=mine(sr), to_bf16=True, proj="gate_proj")
    sup = proj(names.shared, rows=mine(sr), to_bf16=True, proj="up_proj")
    sdown = proj(names.shared, cols=mine(sr), to_bf16=True, proj="down_proj")
    return RankWeights(shape, tp, rank, fmt, w_rl=w_rl, bias=bias, w13=w13, w2=w2, norm=norm, w_up=w_up,
                       shared_w13=torch.cat([sgate, sup], dim=0), shared_w2=sdown)
