"""Sweep specs: the deployment matrix to tune and how hard to search, read from TOML.

A spec names tp, decode batch, DCP, draft length and context buckets; the token buckets at which dense and MoE
problems are tuned (tokens per step M = batch x (1 + draft) rounds up to one); and the search budget.
Every value is validated here so that a bad spec fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from k3tune.errors import ConfigError
from k3tune.shipped import configs_dir

MAX_BATCH = 64
MAX_DRAFT = 7
MAX_RANGE_VALUES = 1024  # values a {min, max} range may expand to


@dataclass(frozen=True)
class SearchSettings:
    budget: int = 24  # trials per problem; spaces no larger are searched exhaustively
    patience: int = 10  # stop a problem after this many trials without a 1% gain
    remeasure_top: int = 3  # the best few are measured again before a winner is chosen
    safe_margin_pct: int = 2  # a kernel replaces the safe baseline only when faster by more than this, remeasured
    # (cuBLAS moves 2-4% between runs on some shapes, H200: a 1.2% win over it came out 4% slower in another run)
    samples: int = 15  # timing samples per trial
    seed: int = 0
    polish: int = 8  # at most this many passes after the search, each trying on every problem the winners of its
    # nearest neighbours not yet tried there, until none is left (0: off; simulated H200 dense spec: 5 passes)
    local: int = 0  # 1: the passes also try on each problem its winner with one knob moved one step in the declared
    # space (a hill climb over the passes; H200, session 17: the search's ~20 trials a problem kept a 6-stage ring
    # where the same layout with 4 stages ran 1.26x faster). A climb the pass limit cuts short goes on in the next
    # run of the spec, so such a rerun is not free (simulated H200 dense spec: 8 passes, +33% trials)
    neighbours: int = 4  # the polish passes try the winners of this many nearest problems of the same op, and those
    # of other ops of its shape or token count; 0: only the winner's own moves (``local``, ``whole``), for a re-decide
    # that keeps the kernels' tiles and revisits a few knobs (a change to the block's code re-keys all 56 block winners)
    whole: tuple[str, ...] = ()  # knobs whose every declared value the polish passes try on each problem's winner,
    # the rest of it unchanged (one step is too short for a knob whose values are alternatives, not a scale: the SM
    # split's 0 -> 8 shared SMs says little of 32; H200 s35-r6: a serial MXFP4 block winner's knobs on a 32-SM split
    # ran 1.5% faster). The names must be knobs some family of the sweep declares.


@dataclass(frozen=True)
class SweepSpec:
    name: str
    tp: tuple[int, ...]
    batch: tuple[int, ...]
    dcp: tuple[int, ...]
    draft: tuple[int, ...]
    context: tuple[int, ...]
    token_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    query_buckets: tuple[int, ...]
    ops: tuple[str, ...] | None  # None: every op of the decode layer
    routing: str
    search: SearchSettings
    model_config: str | None
    base_dir: str | None = None  # the folder of the spec's file, against which a relative model_config is read

    def digest(self) -> str:
        d = asdict(self)
        del d["base_dir"]  # where the spec lies is no part of what it tunes
        for knob, unset in (("whole", []), ("neighbours", 4)):  # a spec that leaves it unset keeps the digest its
            if d["search"][knob] == unset:  # runs recorded before the setting existed
                del d["search"][knob]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def model_config_path(self) -> str | None:
        """The spec's model config as a path to load: a relative one read against the spec's folder where it is
        there (it was read against the working directory: from anywhere else the spec found no config, or
        another one of that name), else as written (a bare name may be one of configs/)."""
        if self.model_config and self.base_dir and not Path(self.model_config).is_absolute():
            beside = Path(self.base_dir) / self.model_config
            if beside.exists():
                return str(beside)
        return self.model_config


def _ints(section: dict, key: str, where: str, default=None) -> tuple[int, ...]:
    val = section.get(key, default)
    if val is None:
        raise ConfigError(f"{where}: missing '{key}'")
    if isinstance(val, dict):  # {min = 1, max = 64}
        lo, hi = val.get("min"), val.get("max")  # whole numbers (int() took min = 1.5 as 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise ConfigError(f"{where}: '{key}' range needs integer 'min' and 'max'")
        if hi - lo + 1 > MAX_RANGE_VALUES:  # checked before it is built: max = 10^11 was a MemoryError
            raise ConfigError(f"{where}: '{key}' range {lo}..{hi} has {hi - lo + 1} values; a range may hold at most "
                              f"{MAX_RANGE_VALUES} (list the values instead)")
        val = list(range(lo, hi + 1))
    if isinstance(val, int) and not isinstance(val, bool):
        val = [val]
    if not isinstance(val, list) or not val or not all(isinstance(v, int) and not isinstance(v, bool) for v in val):
        raise ConfigError(f"{where}: '{key}' must be a non-empty list of integers or {{min, max}}")
    return tuple(sorted(set(val)))


def validate_deployment_values(tp: int, batch: int, dcp: int, draft: int) -> None:
    """The checks shared by sweep specs and runtime lookups."""
    if not 1 <= batch <= MAX_BATCH:
        raise ConfigError(f"batch {batch} out of range: decode batch must be 1..{MAX_BATCH}")
    if not 0 <= draft <= MAX_DRAFT:
        raise ConfigError(f"draft length {draft} out of range: must be 0..{MAX_DRAFT}")
    if tp < 1:
        raise ConfigError(f"tp {tp} must be positive")
    if dcp < 1 or dcp > tp or tp % dcp:
        raise ConfigError(f"dcp {dcp} invalid for tp {tp}: dcp must divide tp and be <= tp")


# every key a spec may hold, by table ("" is the top level): a misspelt one is an error, never a silent default
KNOWN_KEYS = {"": {"name", "matrix", "buckets", "search", "model"},
              "matrix": {"tp", "batch", "dcp", "draft", "context", "ops", "routing"},
              "buckets": {"tokens", "batch", "query_len"},
              "model": {"config"}}  # [search]: SearchSettings' fields, checked below


def _known_keys(raw: dict, where: str) -> None:
    for table, known in KNOWN_KEYS.items():
        section = raw if not table else raw.get(table, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: [{table}] must be a table")
        unknown = set(section) - known
        if unknown:
            place = f"[{table}] keys" if table else "top-level keys"
            hint = "" if table else " (the tables are [matrix], [buckets], [search], [model])"
            raise ConfigError(f"{where}: unknown {place} {sorted(unknown)}{hint}")


def from_dict(raw: dict, name: str = "spec") -> SweepSpec:
    where = name
    m = raw.get("matrix")
    if not isinstance(m, dict):
        raise ConfigError(f"{where}: missing [matrix] table")
    b = raw.get("buckets", {})
    s = raw.get("search", {})
    if not isinstance(b, dict) or not isinstance(s, dict):
        raise ConfigError(f"{where}: [buckets] and [search] must be tables")
    _known_keys(raw, where)
    tp = _ints(m, "tp", where)
    batch = _ints(m, "batch", where)
    dcp = _ints(m, "dcp", where, [1])
    draft = _ints(m, "draft", where, [0])
    context = _ints(m, "context", where, [32768])
    if bad := [t for t in tp if t < 1]:  # (before dcp's check, which called tp 0 a bad dcp)
        raise ConfigError(f"{where}: tp {bad[0]} must be positive")
    for d in dcp:
        if not any(d <= t and t % d == 0 for t in tp):
            raise ConfigError(f"dcp {d} invalid for tp {'/'.join(map(str, tp))}: dcp must divide tp and be <= tp")
    for v in batch:
        validate_deployment_values(tp[0], v, 1, draft[0])
    for v in draft:
        validate_deployment_values(tp[0], batch[0], 1, v)
    if any(c < 1 for c in context):
        raise ConfigError(f"{where}: context lengths must be positive")
    tokens = _ints(b, "tokens", where, [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512])
    bb = _ints(b, "batch", where, [1, 2, 4, 8, 16, 32, 64])
    qb = _ints(b, "query_len", where, [1, 2, 4, 8])
    need_m = max(batch) * (1 + max(draft))
    if max(tokens) < need_m:
        raise ConfigError(f"{where}: token buckets end at {max(tokens)} but the matrix reaches M = {need_m}")
    if max(bb) < max(batch):
        raise ConfigError(f"{where}: batch buckets end at {max(bb)} but the matrix reaches batch {max(batch)}")
    if max(qb) < 1 + max(draft):
        raise ConfigError(f"{where}: query_len buckets end at {max(qb)} but draft {max(draft)} needs {1 + max(draft)}")
    known = {f.name for f in SearchSettings.__dataclass_fields__.values()}
    unknown = set(s) - known
    if unknown:
        raise ConfigError(f"{where}: unknown [search] keys {sorted(unknown)}")
    whole = s.get("whole", [])
    if not isinstance(whole, list) or not all(isinstance(k, str) and k for k in whole):
        raise ConfigError(f"{where}: [search] whole must be a list of knob names")
    # whole numbers only: int() took budget = 1.5 as 1 and budget = true as 1 without a word
    if bad := sorted(k for k, v in s.items() if k != "whole" and (isinstance(v, bool) or not isinstance(v, int))):
        raise ConfigError(f"{where}: [search] values must be integers, not {', '.join(f'{k} = {s[k]!r}' for k in bad)}"
                          " (whole: a list of knob names)")
    search = SearchSettings(**{k: v for k, v in s.items() if k != "whole"}, whole=tuple(whole))
    if search.whole and search.polish < 1:
        raise ConfigError(f"{where}: [search] whole is tried by the polish passes: it needs polish >= 1")
    if (search.budget < 1 or search.samples < 3 or search.patience < 1 or search.remeasure_top < 1
            or search.polish < 0 or not 0 <= search.safe_margin_pct <= 50 or search.local not in (0, 1)
            or search.neighbours < 0):
        raise ConfigError(f"{where}: [search] needs budget >= 1, samples >= 3, patience >= 1, remeasure_top >= 1, "
                          f"polish >= 0, 0 <= safe_margin_pct <= 50, local 0 or 1, neighbours >= 0")
    ops = m.get("ops")
    if ops is not None and (not isinstance(ops, list) or not ops or not all(isinstance(o, str) for o in ops)):
        # (an empty list planned 0 problems and `plan` said so with exit 0: leave it out for every op)
        raise ConfigError(f"{where}: 'ops' must be a non-empty list of op names (leave it out for every op)")
    routing = m.get("routing", "uniform")
    if not isinstance(routing, str):  # a list was quoted back as "unknown routing '['zipf:1.2']'"
        raise ConfigError(f"{where}: routing must be one string (uniform, zipf:S or trace:NAME), not {routing!r}; "
                          "one spec per routing")
    model_cfg = raw.get("model", {}).get("config")
    if model_cfg is not None and not isinstance(model_cfg, str):  # (config = 5 was a TypeError traceback)
        raise ConfigError(f"{where}: [model] config must be a path to a config.json, not {model_cfg!r}")
    return SweepSpec(
        name=str(raw.get("name", name)),
        tp=tp,
        batch=batch,
        dcp=dcp,
        draft=draft,
        context=context,
        token_buckets=tokens,
        batch_buckets=bb,
        query_buckets=qb,
        ops=tuple(ops) if ops is not None else None,
        routing=routing,
        search=search,
        model_config=model_cfg,
    )


def load(path: str | Path | None = None) -> SweepSpec:
    """Load a sweep spec; None means configs/sweep_default.toml, a bare name one of configs/sweep_NAME.toml."""
    if path is None:
        p = configs_dir() / "sweep_default.toml"
    else:
        p = Path(path)
        if not p.exists() and not p.suffix and (configs_dir() / f"sweep_{path}.toml").exists():
            p = configs_dir() / f"sweep_{path}.toml"
    if p.is_dir():  # (was an IsADirectoryError traceback)
        raise ConfigError(f"sweep spec {p} is a folder: give a TOML file or a name from configs/")
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"sweep spec not found: {p}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: malformed TOML ({e})") from None
    except OSError as e:  # unreadable (permissions, a device)
        raise ConfigError(f"sweep spec {p}: cannot be read ({e.strerror or e})") from None
    return dataclasses.replace(from_dict(raw, p.stem), base_dir=str(p.resolve().parent))


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket at or above value. A value above every bucket is its own bucket: a sweep's matrix never
    reaches one (``from_dict`` checks), and serving keys such a deployment as untuned, which the safe default serves."""
    for b in buckets:
        if b >= value:
            return b
    return value
