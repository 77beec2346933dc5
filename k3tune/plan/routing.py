"""Expert routing used to measure the MoE block: which experts the tokens of a decode step select decides
which weights are read.

Routing specs (the sweep spec's ``routing``, recorded with every trial):
- ``uniform``: each token picks top_k distinct experts uniformly at random;
- ``zipf:S``: expert popularity falls as 1 / rank^S (S > 0);
- ``trace:NAME``: a recorded trace; NAME is a file in configs/routing/ (``NAME.jsonl``) or a path.

Trace format (JSON lines, UTF-8): a header line
``{"format": "k3tune-routing-trace", "version": 1, "experts": 896, "top_k": 16}``, then one line per token
in decode order, ``{"experts": [e0, ..., e15]}`` with top_k distinct ids in [0, experts); an optional
``"layer"`` field is kept as a comment. A decode step of M tokens is a window of M consecutive lines.
The problem key names a trace as ``trace:STEM@SHA8`` (its content digest): a changed trace is a new problem.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from k3tune.errors import ConfigError
from k3tune.shipped import configs_dir

TRACE_FORMAT = "k3tune-routing-trace"


@dataclass(frozen=True)
class Trace:
    name: str
    digest: str
    experts: int
    top_k: int
    tokens: tuple[tuple[int, ...], ...]


def _trace_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".jsonl" and p.exists():
        return p
    shipped = configs_dir() / "routing" / f"{name}.jsonl"
    if shipped.exists():
        return shipped
    raise ConfigError(f"routing trace '{name}' not found (a path to a .jsonl file or a name in configs/routing/)")


@cache
def load_trace(name: str) -> Trace:
    path = _trace_path(name)
    raw = path.read_bytes()
    lines = raw.decode("utf-8", errors="replace").splitlines()
    try:
        head = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != TRACE_FORMAT or head.get("version") != 1:
        raise ConfigError(f"{path}: not a k3tune routing trace (first line must be the {TRACE_FORMAT} v1 header)")
    experts, top_k = head.get("experts"), head.get("top_k")
    if not (isinstance(experts, int) and isinstance(top_k, int) and 0 < top_k <= experts):
        raise ConfigError(f"{path}: header needs integer experts and top_k with 0 < top_k <= experts")
    tokens = []
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["experts"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{path}:{i}: expected {{\"experts\": [...]}}") from None
        if (not isinstance(ids, list) or len(ids) != top_k or len(set(ids)) != top_k
                or not all(isinstance(e, int) and 0 <= e < experts for e in ids)):
            raise ConfigError(f"{path}:{i}: needs {top_k} distinct expert ids in [0, {experts})")
        tokens.append(tuple(ids))
    if not tokens:
        raise ConfigError(f"{path}: the trace has no tokens")
    return Trace(path.stem, hashlib.sha256(raw).hexdigest()[:8], experts, top_k, tuple(tokens))


def canonical(spec: str, experts: int, top_k: int) -> str:
    """Validate a routing spec and return the form that goes into problem keys."""
    s = spec.strip()
    if s == "uniform":
        return s
    if s.startswith("zipf:"):
        try:
            a = float(s[5:])
        except ValueError:
            a = -1.0
        if not (a > 0 and math.isfinite(a)):
            raise ConfigError(f"routing '{spec}': zipf needs a positive, finite exponent, e.g. zipf:1.2")
        return f"zipf:{a:g}"
    if s.startswith("trace:"):
        t = load_trace(s[6:])
        if (t.experts, t.top_k) != (experts, top_k):
            raise ConfigError(f"routing trace {t.name}: recorded for {t.experts} experts top-{t.top_k}, "
                              f"the model has {experts} top-{top_k}")
        return f"trace:{s[6:]}@{t.digest}"
    raise ConfigError(f"unknown routing '{spec}' (uniform, zipf:S or trace:NAME)")


def _zipf_weights(experts: int, a: float) -> list[float]:
    w = [math.exp(-a * math.log(i + 1)) for i in range(experts)]  # a steep skew underflows to 0, never overflows
    tot = sum(w)
    return [x / tot for x in w]


def _distinct_by_weight(w: list[float], a: float, top_k: int, rng: random.Random, rounds: int = 64) -> set[int]:
    """top_k distinct experts, each next one drawn in proportion to its weight among those not yet chosen.

    Draws with replacement, repeats discarded, while that is cheap; a steep skew leaves the tail so unlikely
    that this would run for minutes (zipf:5, 8 tokens: 39 s) or forever (the weights underflow), so the rest are
    then drawn by the Gumbel top-k trick on log-weights, which gives the same distribution: what is left of a
    draw without replacement is a draw without replacement from the experts not yet chosen."""
    chosen: set[int] = set()
    experts = range(len(w))
    for _ in range(rounds):
        chosen.update(rng.choices(experts, weights=w, k=top_k - len(chosen)))
        if len(chosen) == top_k:
            return chosen
    rest = (e for e in experts if e not in chosen)  # log w_e = -a log(e + 1) - log(sum): the sum is common
    chosen.update(heapq.nlargest(top_k - len(chosen), rest,
                                 key=lambda e: -a * math.log(e + 1) - math.log(rng.expovariate(1.0) or 1e-300)))
    return chosen


@cache
def canonical_cached(spec: str, experts: int, top_k: int) -> str:
    return canonical(spec, experts, top_k)


@cache
def expected_touched(routing: str, experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts selected by a decode step of ``tokens`` tokens."""
    if routing == "uniform":
        return experts * (1 - (1 - top_k / experts) ** tokens)
    if routing.startswith("zipf:"):
        w = _zipf_weights(experts, float(routing[5:]))
        return max(float(top_k), sum(1 - (1 - min(1.0, top_k * x)) ** tokens for x in w))
    if routing.startswith("trace:"):
        t = load_trace(routing[6:].split("@")[0])
        n = len(t.tokens)
        windows = [t.tokens[(i + j) % n] for i in range(0, n, max(1, tokens)) for j in range(tokens)]
        counts = [len(set().union(*windows[k:k + tokens])) for k in range(0, len(windows), tokens)]
        return sum(counts) / len(counts)
    raise ConfigError(f"unknown routing '{routing}'")


def sample(routing: str, experts: int, top_k: int, tokens: int, rng: random.Random) -> list[list[int]]:
    """Expert ids for one decode step (tokens x top_k), for measuring a block under this routing."""
    if routing == "uniform":
        return [rng.sample(range(experts), top_k) for _ in range(tokens)]
    if routing.startswith("zipf:"):
        a = float(routing[5:])
        w = _zipf_weights(experts, a)
        perm = list(range(experts))
        rng.shuffle(perm)  # which experts are popular is itself random
        return [[perm[e] for e in _distinct_by_weight(w, a, top_k, rng)] for _ in range(tokens)]
    if routing.startswith("trace:"):
        t = load_trace(routing[6:].split("@")[0])
        start = rng.randrange(len(t.tokens))
        return [list(t.tokens[(start + j) % len(t.tokens)]) for j in range(tokens)]
    raise ConfigError(f"unknown routing '{routing}'")
