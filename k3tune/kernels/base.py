"""What every kernel family declares: configs, a pruned search space, validity, a heuristic default, the work
it does (for the simulated backend), inputs and a torch reference (for the measurer), and how to build it.

Kernel families know nothing of databases or search.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from k3tune.errors import CannotImplement
from k3tune.plan.problems import Problem

BACKENDS = ("gpu", "simulated", "cpu")
ENUMERATE_LIMIT = 50_000  # declared configs beyond which a space is sampled or counted, never listed


@dataclass(frozen=True)
class KernelConfig:
    """Base of every family's frozen config; fields are the tunable knobs."""

    def params(self) -> dict[str, Any]:
        # knobs are scalars: a shallow dict (dataclasses.asdict deep-copies, and was 13% of a simulated sweep's
        # driver time: 160 k calls)
        return {name: getattr(self, name) for name in _field_names(type(self))}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Work:
    """What one launch of a config does, in the terms the roofline model needs."""

    hbm_bytes: float  # bytes moved to and from HBM
    flops: float
    ctas: int  # CTAs in the grid
    inflight_bytes_per_cta: float  # bytes a CTA keeps in flight (memory-level parallelism)
    tensor_cores: bool = False
    launches: int = 1  # kernel launches (a split-K reduction adds one)
    sm_limit: int | None = None  # persistent or partitioned grids run on at most this many SMs
    ctas_per_sm: int = 1
    extra_us: float = 0.0  # fixed costs outside the roofline (atomics, dependent steps)


class KernelFamily:
    """One family per file. Subclasses set the class attributes and override what they support."""

    name: ClassVar[str]
    kinds: ClassVar[frozenset[str]]  # problem kinds it implements
    ops: ClassVar[frozenset[str] | None] = None  # restrict to these ops (None: every op of its kinds)
    config_cls: ClassVar[type[KernelConfig]]
    backends: ClassVar[frozenset[str]]  # which measurement backends may run it
    priority: ClassVar[int] = 50  # statistical ties go to the lower number (simpler, safer kernels)
    declared_only: ClassVar[bool] = False  # space declared for simulation; GPU code not landed yet
    archs: ClassVar[tuple[str, ...] | None] = None  # arch prefixes it has code for ("sm_90"); None: every arch

    # ---- the search space -------------------------------------------------------------------
    def space(self, problem: Problem) -> dict[str, tuple]:
        """Choices per config field, pruned against the problem."""
        return {}

    def cached_space(self, problem: Problem) -> dict[str, tuple]:
        cache = self.__dict__.setdefault("_space_cache", {})
        if problem not in cache:
            cache[problem] = self.space(problem)
        return cache[problem]

    def valid(self, cfg: KernelConfig, problem: Problem) -> bool:
        """Whether a combination of choices is legal for the problem."""
        return True

    def can_implement(self, problem: Problem) -> bool:
        return problem.kind in self.kinds and (self.ops is None or problem.op in self.ops)

    def default(self, problem: Problem) -> KernelConfig:
        """Heuristic default used when the database has no entry."""
        return self.config_cls()

    def default_config(self, problem: Problem) -> KernelConfig:
        """The heuristic default, checked against the declared space; the first valid config otherwise.
        Remembered per problem (a sweep's driver asks ~36 k times: every candidate list starts from it)."""
        cache = self.__dict__.setdefault("_default_cache", {})
        if problem not in cache:
            try:
                cache[problem] = self._default_config(problem)
            except CannotImplement as e:
                cache[problem] = str(e)  # raised afresh each time (a re-raised instance grows its traceback)
        got = cache[problem]
        if isinstance(got, str):
            raise CannotImplement(got)
        return got

    def _default_config(self, problem: Problem) -> KernelConfig:
        cfg = self.default(problem)
        try:
            return self.config_from_params(problem, cfg.params())
        except CannotImplement:
            for c in self.configs(problem):
                return c
            raise CannotImplement(f"{self.name} has no valid config for {problem.key}") from None

    def supports(self, arch: str | None) -> bool:
        """Whether the family has code for this arch (``sm_90a``, ``sm_103a``; None: not known, every family)."""
        return arch is None or self.archs is None or any(arch.startswith(a) for a in self.archs)

    def runs_on(self, problem: Problem, backend: str) -> bool:
        """Whether this backend can measure the problem with this family (some formats are GPU-pending)."""
        return True

    def seeds(self, problem: Problem) -> list[KernelConfig]:
        """Hand-picked starting points the search measures first (after the default); none unless declared."""
        return []

    def adopt(self, family: str, params: dict[str, Any], problem: Problem) -> list[dict[str, Any]]:
        """Params of this family worth measuring, derived from another family's winner near ``problem`` (a
        family that extends another with a knob takes that family's winners with the knob set); none unless
        declared."""
        return []

    def configs(self, problem: Problem) -> Iterator[KernelConfig]:
        space = self.space(problem)
        names = list(space)
        for values in itertools.product(*(space[n] for n in names)):
            cfg = self.config_cls(**dict(zip(names, values)))
            if self.valid(cfg, problem):
                yield cfg

    def config_count(self, problem: Problem, limit: int | None = None) -> int:
        """How many valid configs the problem has (enumerated once per problem and family, then remembered).
        With ``limit``, enumeration stops at the first config past it: the answer is then only "more than
        ``limit``" (not remembered) — a sweep asks whether a space fits its budget for every problem at its
        start, and listing a tensor-core space took ~50 ms per problem."""
        cache = self.__dict__.setdefault("_count_cache", {})
        if problem in cache:
            return cache[problem]
        n = 0
        for _ in self.configs(problem):
            n += 1
            if limit is not None and n > limit:
                return n
        cache[problem] = n
        return n

    def space_size(self, problem: Problem) -> int:
        return math.prod(len(v) for v in self.cached_space(problem).values())

    def canonical(self, params: dict[str, Any]) -> dict[str, Any]:
        """The same kernel's params with the knobs it ignores set to fixed values, so that a search never
        measures one kernel twice under two names (e.g. a tensor-core knob when the CUDA-core kernel runs).
        Default: every knob matters."""
        return params

    def config_from_params(self, problem: Problem, params: dict[str, Any]) -> KernelConfig:
        """Rebuild a config from stored params, refusing anything outside the declared space."""
        if not self.can_implement(problem):
            raise CannotImplement(f"{self.name} cannot implement {problem.key}")
        space = self.cached_space(problem)
        if set(params) != set(space):
            raise CannotImplement(f"{self.name}: params {sorted(params)} do not match the space {sorted(space)}")
        for k, v in params.items():
            if v not in space[k]:
                raise CannotImplement(f"{self.name}: {k}={v!r} is outside the declared space {space[k]} for {problem.key}")
        cfg = self.config_cls(**params)
        if not self.valid(cfg, problem):
            raise CannotImplement(f"{self.name}: {params_key(params)} is not valid for {problem.key}")
        return cfg

    # ---- what the measurement backends use ---------------------------------------------------
    def work(self, problem: Problem, cfg: KernelConfig) -> Work:
        raise NotImplementedError

    def make_inputs(self, problem: Problem, device, generator) -> dict:
        raise NotImplementedError

    def weight_names(self, problem: Problem) -> tuple[str, ...]:
        """Inputs that decode reads from HBM each step: rotated past L2 when timing."""
        return ()

    def reference(self, problem: Problem, inputs: dict):
        """fp32 torch reference of the op."""
        raise NotImplementedError

    def build(self, problem: Problem, cfg: KernelConfig):
        """A callable(inputs) -> output that launches on the current stream (capturable)."""
        raise NotImplementedError

    def tolerance(self, problem: Problem) -> float:
        """Relative error bound (||out - ref|| / ||ref||) for bf16 outputs."""
        return 2e-2

    depends_on: ClassVar[tuple[str, ...]] = ()  # other modules whose source decides this family's results
    # knobs whose value switches an optional feature off (e.g. an L2 prefetch size of 0): the search also
    # remeasures the leading config with them off, and a statistical tie goes to the config with more off
    off: ClassVar[dict] = {}

    @cached_property
    def digest(self) -> str:
        """The source of the family's module and of ``depends_on``: editing any of them invalidates results."""
        import importlib

        src = inspect.getsource(inspect.getmodule(type(self)))
        src += "".join(inspect.getsource(importlib.import_module(m)) for m in self.depends_on)
        return hashlib.sha256(src.encode()).hexdigest()[:16]


def count_configs(problem: Problem, families: list[KernelFamily], limit: int | None = None) -> int:
    """Valid configs over the families, enumerated only where the declared spaces are small enough to list; a
    larger declared space is counted, never listed (a block's joint space runs to billions of points). With
    ``limit``, any answer above it only means "more than ``limit``" (the enumeration stops there)."""
    declared = sum(f.space_size(problem) for f in families)
    if declared > ENUMERATE_LIMIT:
        return declared
    total = 0
    for f in families:
        total += f.config_count(problem, None if limit is None else limit - total)
        if limit is not None and total > limit:
            break
    return total
