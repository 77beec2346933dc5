"""The runtime selector: loads a tuning database once into dense in-memory tables, then answers
``lookup(op, tp, batch, draft, dcp, context)`` with a plain index, never a query.

Every op has one table keyed by its problem's coordinates (tp and the tokens bucket for dense and MoE ops;
tp, batch and query buckets for KDA; plus dcp and context for MLA); bucket lists cover every batch 1..64 and
draft length 0..7, so the tables cover every deployment of the spec. Sources, in order:
``measured`` (a winner for this hardware), ``nearest bucket`` (the nearest tuned size at or above; warned
once per op), ``heuristic default`` (the safest family's default). ``simulated`` winners are served only
when asked for explicitly, and labelled so. A missing database, other hardware, a stale kernel digest or
parameters outside the declared space give defaults and a warning, never an exception.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import hashlib
import logging
import os
from dataclasses import dataclass
from operator import index
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from k3tune import settings
from k3tune.errors import CannotImplement, ConfigError, DatabaseError
from k3tune.kernels import family as get_family
from k3tune.kernels import op_digest, safe_default
from k3tune.plan import hardware, model as models, problems as plans, routing as routings, spec as specs
from k3tune.plan.hardware import Fingerprint
from k3tune.plan.spec import MAX_BATCH, MAX_DRAFT
from k3tune.shipped import tuning_db_dir
from k3tune.store.db import open_for_serving
from k3tune.store.models import Backend, Hardware
from k3tune.store.records import read_winners

log = logging.getLogger("k3tune.runtime")

SIZE_DIMS = {"gemm": ("M",), "moe_block": ("M",), "allreduce": ("M",), "kda_decode": ("batch", "qlen"),
             "mla_decode": ("batch", "qlen")}
_GEMM, _KDA, _MLA = 0, 1, 2
_KIND_CODE = {"gemm": _GEMM, "moe_block": _GEMM, "allreduce": _GEMM, "kda_decode": _KDA, "mla_decode": _MLA}


@dataclass(frozen=True)
class Choice:
    op: str
    family: str
    params: tuple  # sorted (name, value) pairs
    source: str  # measured | simulated | nearest bucket (measured|simulated) | heuristic default
    problem: str  # the problem key this entry serves
    tuned_problem: str | None  # the problem whose winner it is (differs for nearest bucket)
    median_us: float | None
    approx: bool = False  # served from the nearest tuned bucket, not its own tuning

    def config(self):
        fam = get_family(self.family)
        return fam.config_cls(**dict(self.params))

    def as_dict(self) -> dict:
        return {"op": self.op, "family": self.family, "params": dict(self.params), "source": self.source,
                "problem": self.problem, "tuned_problem": self.tuned_problem, "median_us": self.median_us}


def shipped_db_for(fp: Fingerprint | None) -> Path | None:
    hw = hardware.spec_for_device_name(fp.name) if fp is not None else None
    return _shipped_db(hw.key) if hw else None


def _shipped_db(key: str) -> Path | None:
    """The database shipped for the hardware of this key (e.g. 'h200'), where there is one."""
    path = tuning_db_dir() / f"{key}.sqlite"
    return path if path.exists() else None


def unusable(e: DatabaseError) -> str:
    """Why a database that cannot be opened or read serves nothing, in the words every such warning uses."""
    return f"cannot use tuning database: {str(e).splitlines()[0]}"


def measured_fingerprint(db, name: str) -> tuple[Fingerprint | None, str]:
    """The fingerprint of the first measured (not simulated) hardware in db whose name contains ``name``; where
    there is none, why. A database that cannot be opened or read raises DatabaseError."""
    d, _ = open_for_serving(db)  # an older schema's note is given when its winners are read
    try:
        with d.session() as s:
            h = s.scalars(select(Hardware).where(Hardware.simulated.is_(False), Hardware.name.contains(name))).first()
    finally:
        d.dispose()
    if h is None:
        return None, f"{d.name}: no measured winners of {name}"
    return Fingerprint(h.name, h.compute_capability, h.sm_count, h.memory_gib, h.driver, h.cuda, False), ""


def _what_it_holds(db) -> str:
    """The end of the no-GPU warning: the hardware whose winners ``db`` (with none, the shipped tables) holds, by the
    names ``measured_on`` / ``--hardware`` and ``simulated`` / ``--simulate`` take."""
    if db is None:
        measured, simulated = {p.stem for p in tuning_db_dir().glob("*.sqlite")}, set()
    else:
        try:
            d, _ = open_for_serving(db)
            try:
                with d.session() as s:
                    rows = s.execute(select(Hardware.name, Hardware.simulated)).all()
            finally:
                d.dispose()
        except (DatabaseError, SQLAlchemyError):
            return ""  # reading its winners would fail the same way, and say so
        key = {n: hw.key if (hw := hardware.spec_for_device_name(n)) else n for n, _ in rows}
        measured = {key[n] for n, sim in rows if not sim}
        simulated = {key[n] for n, sim in rows if sim}
    held = []
    if measured:
        held.append(f"measured {', '.join(sorted(measured))} (measured_on=..., `k3tune lookup --hardware`)")
    if simulated:
        held.append(f"simulated {', '.join(sorted(simulated))} (simulated=..., `k3tune lookup --simulate`)")
    if not held:
        return ""
    return f"; {f'{db} holds' if db is not None else 'the shipped tables hold'} {' and '.join(held)}: name one"


def _same_trace(dims: dict, own: str) -> dict:
    """A block tuned under a routing trace is served under that trace (its content digest) named by another path:
    a trace's key names the path the sweep read it from (``trace:/data/prod.jsonl@d1g3st``), which the serving
    machine need not share (its blocks were served as 'tuned for uniform routing')."""
    r = dims.get("routing")
    if (r != own and isinstance(r, str) and r.startswith("trace:") and own.startswith("trace:")
            and r.rsplit("@", 1)[-1] == own.rsplit("@", 1)[-1]):
        return {**dims, "routing": own}
    return dims


class Selector:
    def __init__(self, spec: specs.SweepSpec, model: models.ModelConfig):
        self.spec = spec
        self.model = model
        self.warnings: list[str] = []
        self.unread: str | None = None  # why the database named or found could not be read (heuristic defaults)
        self._tables: dict[str, dict[tuple, Choice]] = {}
        self._kind: dict[str, int] = {name: _KIND_CODE[o.kind] for name, o in plans.OPS.items()}
        self._tb = [None] + [specs.bucket(m, spec.token_buckets) for m in range(1, MAX_BATCH * (1 + MAX_DRAFT) + 1)]
        self._bb = [None] + [specs.bucket(b, spec.batch_buckets) for b in range(1, MAX_BATCH + 1)]
        self._qb = [None] + [specs.bucket(q, spec.query_buckets) for q in range(1, MAX_DRAFT + 2)]
        self._ctx = list(spec.context)
        self._ctx_exact = frozenset(self._ctx)
        self._ctx_map = {c: c for c in self._ctx} | {None: self._ctx[-1]}
        self._winners: dict[str, dict[str, tuple]] = {}  # op -> problem key -> (family, params, median, label, dims)
        self._warned: set[str] = set()
        self._beyond: set[str] = set()  # untuned problems whose shape has winners at other sizes (``_choose``)
        self._warned_context: set[str] = set()  # ops told of a context above every bucket
        self._ops: dict[str, tuple[int, dict]] = {}  # op -> (kind code, table): one dict hit per lookup
        self.hash = ""

    # ---- loading --------------------------------------------------------------------------------
    @classmethod
    def load(cls, db: str | os.PathLike | None = None, *, fingerprint: Fingerprint | None = None,
             simulated: str | None = None, measured_on: str | None = None, spec: specs.SweepSpec | None = None,
             model: models.ModelConfig | None = None, routing: str | None = None) -> Selector:
        """Load winners for this hardware. ``simulated='gb300'`` serves that simulated hardware's winners
        (labelled simulated); ``measured_on='h200'`` the measured winners of that GPU found in ``db`` (to
        inspect a database elsewhere); otherwise the detected GPU's measured winners (or ``fingerprint``'s), from
        ``db``, else ``$K3TUNE_SERVE_DB`` (what a sweep's workers read), else the database shipped for that GPU.
        ``routing`` (default ``$K3TUNE_ROUTING``, else the spec's): the expert routing the MoE block serves,
        e.g. ``zipf:1.2``; blocks tuned for it are served, else those tuned for uniform routing (labelled so).
        ``model`` defaults to the spec's model config, else K3's published one."""
        if simulated and measured_on:  # one table or the other: both served neither (a warning, heuristic defaults)
            raise ConfigError(f"serve the simulated winners of {simulated} or the measured winners of {measured_on}, "
                              "not both (--simulate or --hardware)")
        # the spec's model, else K3's published config (which keyed a bf16-expert spec's blocks as MXFP4), loaded once
        if model is None:
            model = models.load(spec.model_config_path() if spec is not None else None)
        gc_was_on = gc.isenabled()
        gc.disable()  # thousands of small objects, none cyclic: collections would only cost time
        try:
            unserved = unread = None  # why measured_on's winners cannot be served; why its database cannot be read
            if measured_on:
                hw = hardware.spec(measured_on)
                if db is None:  # the shipped one for that GPU
                    db = settings.load().serve_db or _shipped_db(hw.key)
                try:
                    found, unserved = measured_fingerprint(db, hw.name) if db is not None else \
                        (None, f"no tuning database for {hw.name}")
                except DatabaseError as e:
                    found, unserved = None, (unread := unusable(e))
                fingerprint = found or fingerprint
            if not routing and (routing := settings.load().routing):
                # named as the environment's: "unknown routing 'bogus'" alone left a service's operator guessing
                try:
                    routings.canonical_cached(routing, model.num_experts, model.top_k)
                except ConfigError as e:
                    raise ConfigError(f"K3TUNE_ROUTING={routing}: {e}") from None
            if routing:
                spec = dataclasses.replace(spec or specs.load(), routing=routing)
            return cls._load(db, fingerprint, simulated, spec, model, unserved, unread)
        finally:
            if gc_was_on:
                gc.enable()

    @classmethod
    def _load(cls, db, fingerprint, simulated, spec, model, unserved: str | None = None,
              unread: str | None = None) -> Selector:
        sel = cls(spec or specs.load(), model or models.load())
        sel.unread = unread
        if simulated:
            fp = hardware.simulated_fingerprint(hardware.spec(simulated))
        elif unserved and fingerprint is None:  # the hardware asked for is not in db: never another GPU's winners
            sel._warn(f"{unserved}; serving heuristic defaults")
            sel._build()
            return sel
        else:
            if fingerprint is None:
                found = hardware.detect()
                fingerprint = found[0] if found else None
            fp = fingerprint
        path = db if db is not None else (settings.load().serve_db or shipped_db_for(fp))
        if fp is None:
            sel._warn(f"no GPU detected and no hardware given: serving heuristic defaults{_what_it_holds(path)}")
        elif path is None:
            sel._warn(f"no tuning database for {fp.name}: serving heuristic defaults")
        else:
            sel._read(path, fp)
        sel._build()
        return sel

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        log.warning(msg)

    def _read(self, path, fp: Fingerprint) -> None:
        try:
            db, note = open_for_serving(path)
        except DatabaseError as e:
            self.unread = unusable(e)
            self._warn(f"{self.unread}; serving heuristic defaults")
            return
        if note:
            self._warn(note)
        label = Backend.simulated if fp.simulated else Backend.measured
        try:
            hw_rows, rows, unreadable = read_winners(db, fp.class_key, label)
        except DatabaseError as e:  # a damaged page the opening read did not reach
            self.unread = str(e)
            self._warn(f"{self.unread}; serving heuristic defaults")
            return
        finally:
            db.dispose()
        ids = [r[0] for r in hw_rows if r[1] == fp.class_key]
        if not ids:
            have = sorted({r[1] for r in hw_rows})
            self._warn(f"{path}: tuned for {have or 'no hardware'}, not {fp.class_key}: serving heuristic defaults")
            return
        if not fp.simulated and not any(r[2] == fp.driver and r[3] == fp.cuda for r in hw_rows if r[0] in ids):
            self._warn(f"{path}: tuned under another driver/CUDA than {fp.driver}/{fp.cuda}; serving it anyway")
        backend = "simulated" if fp.simulated else "gpu"
        current = {op: op_digest(op, backend, fp.class_key) for op in plans.OPS}
        stale: set[str] = set()  # problem keys with a winner for another op digest
        refused = 0
        lab = "simulated" if fp.simulated else "measured"
        own = routings.canonical_cached(self.spec.routing, self.model.num_experts, self.model.top_k)
        for op, key, dims, digest, fam, params, median in rows:
            if op not in current or digest != current[op]:
                stale.add(key)
                continue
            try:
                served = _same_trace(dims, own)
                problem = plans.Problem(op, plans.OPS[op].kind, tuple(served.items()))
                key = problem.key if served is not dims else key
                get_family(fam).config_from_params(problem, params)
            except (CannotImplement, ConfigError) as e:
                refused += 1
                log.debug("refusing stored winner %s: %s", key, e)
                continue
            self._winners.setdefault(op, {})[key] = (fam, tuple(sorted(params.items())), median, lab, problem)
        # a stale row beside a current winner of its problem is superseded (a sweep's database keeps the old row, e.g.
        # `k3tune db redo`'s marks after the redo): only problems left with no current winner are worth a word
        stale -= {k for by_key in self._winners.values() for k in by_key}
        if stale:
            self._warn(f"{path}: {len(stale)} problems have only stale winners (kernel sources changed since tuning, or "
                       "marked to be decided again): re-tune; defaults serve them")
        if refused:
            self._warn(f"{path}: refused {refused} winners whose parameters fall outside the declared space")
        if unreadable:
            self._warn(f"{path}: left out {unreadable} winners whose stored problem or parameters cannot be read "
                       f"(`k3tune db verify {path}` lists them); defaults serve them")

    def _choose(self, problem: plans.Problem) -> Choice:
        tuned = self._winners.get(problem.op, {})
        hit = tuned.get(problem.key)
        if hit:
            return Choice(problem.op, hit[0], hit[1], hit[3], problem.key, problem.key, hit[2])
        sizes = SIZE_DIMS[problem.kind]
        fixed = tuple((k, v) for k, v in problem.dims if k not in sizes)
        above, shaped = [], False  # shaped: its shape is tuned at other sizes
        for fam, params, median, lab, p in tuned.values():
            if tuple((k, v) for k, v in p.dims if k not in sizes) != fixed:
                continue
            shaped = True
            if all(p[d] >= problem[d] for d in sizes):
                above.append((sum(p[d] for d in sizes), p.key, fam, params, median, lab, p))
        for _, _, fam, params, median, lab, p in sorted(above):
            try:  # the neighbour's config must fit this problem too; else the next one up
                get_family(fam).config_from_params(problem, dict(params))
            except CannotImplement:
                continue
            return Choice(problem.op, fam, params, f"nearest bucket ({lab})", problem.key, p.key, median, approx=True)
        routed = dict(problem.dims).get("routing")
        if routed not in (None, "uniform"):  # no block tuned for this routing: the one tuned for uniform routing
            alt = self._choose(plans.Problem(problem.op, problem.kind, tuple(
                (k, "uniform" if k == "routing" else v) for k, v in problem.dims)))
            if alt.tuned_problem is not None:
                return Choice(problem.op, alt.family, alt.params, f"tuned for uniform routing ({alt.source})",
                              problem.key, alt.tuned_problem, alt.median_us, approx=True)
            shaped = shaped or alt.problem in self._beyond
        if shaped:  # untuned here, tuned at other sizes: served the default below, with a word (``lookup``)
            self._beyond.add(problem.key)
        fam, cfg = safe_default(problem)
        return Choice(problem.op, fam.name, tuple(sorted(cfg.params().items())), "heuristic default", problem.key, None, None)

    def _key(self, op: str, tp: int, batch: int, draft: int, dcp: int, ctx: int) -> tuple:
        kind = self._kind[op]
        if kind == _GEMM:
            return (tp, self._tb[batch * (1 + draft)])
        if kind == _KDA:
            return (tp, self._bb[batch], self._qb[1 + draft])
        return (tp, dcp, self._bb[batch], self._qb[1 + draft], ctx)

    def _cells(self, kind: int):
        """(table key, representative deployment) for every cell an op of this kind has under the spec."""
        sp, ctx0 = self.spec, self._ctx[0]
        # the spec's buckets only: a deployment above them is untuned, built on its first lookup (`_slow`)
        tokens, batches, qlens = (sorted(set(t[1:]) & set(b)) for t, b in (
            (self._tb, sp.token_buckets), (self._bb, sp.batch_buckets), (self._qb, sp.query_buckets)))
        for tp in sp.tp:
            if kind == _GEMM:
                for m in tokens:
                    yield (tp, m), plans.Deployment(tp, m, 1, 0, ctx0)
            elif kind == _KDA:
                for b in batches:
                    for q in qlens:
                        yield (tp, b, q), plans.Deployment(tp, b, 1, q - 1, ctx0)
            else:
                for dcp in (d for d in sp.dcp if d <= tp and tp % d == 0):
                    for b in batches:
                        for q in qlens:
                            for c in self._ctx:
                                yield (tp, dcp, b, q, c), plans.Deployment(tp, b, dcp, q - 1, c)

    def _build(self) -> None:
        memo: dict[plans.Problem, Choice] = {}
        for op in plans.OPS.values():
            table = self._tables.setdefault(op.name, {})
            self._ops[op.name] = (self._kind[op.name], table)
            for key, dep in self._cells(self._kind[op.name]):
                p = plans.Problem(op.name, op.kind, op.dims(self.model, dep, self.spec))
                table[key] = memo.get(p) or memo.setdefault(p, self._choose(p))
        digest = hashlib.sha256()
        for p in sorted(memo):
            c = memo[p]
            digest.update(repr((p.key, c.family, c.params, c.source)).encode())
        self.hash = digest.hexdigest()[:16]

    # ---- serving --------------------------------------------------------------------------------
    def context_bucket(self, context: int | None) -> int:
        """The context bucket a context length is served from: the smallest at or above it (the largest
        bucket for longer contexts and for None)."""
        if context is None:
            return self._ctx[-1]
        if context in self._ctx_exact:
            return context
        if context < 1:
            raise ConfigError(f"context {context} must be a positive number of tokens")
        i = bisect.bisect_left(self._ctx, context)
        return self._ctx[min(i, len(self._ctx) - 1)]

    def lookup(self, op: str, tp: int, batch: int, draft: int = 0, dcp: int = 1, context: int | None = None) -> Choice:
        """The kernel for one op of one deployment. Bad arguments raise ConfigError; anything else is served.
        A dense op is keyed by tokens per step alone, so it takes any batch x (1 + draft) up to 512 tokens: a
        measured MoE block at M tokens asks for its dense kernels as batch M (M > 64 was refused, failing every
        block trial of a spec with drafts)."""
        try:  # a float or str size raised TypeError or IndexError from the tables below; numpy integers pass
            tp, batch, draft, dcp = index(tp), index(batch), index(draft), index(dcp)
            context = None if context is None else index(context)
        except TypeError:
            raise ConfigError(f"{op}: tp, batch, draft, dcp and context must be integers, not tp={tp!r} "
                              f"batch={batch!r} draft={draft!r} dcp={dcp!r} context={context!r}") from None
        ent = self._ops.get(op)
        if (ent is not None and 0 < batch and 0 <= draft <= MAX_DRAFT and 0 < dcp <= tp and not tp % dcp
                and (batch <= MAX_BATCH or (ent[0] == _GEMM and batch * (1 + draft) < len(self._tb)))):
            kind, table = ent
            if kind == _GEMM:
                c = table.get((tp, self._tb[batch * (1 + draft)]))
            elif kind == _KDA:
                c = table.get((tp, self._bb[batch], self._qb[1 + draft]))
            else:
                ctx = self._ctx_map.get(context) or self._served_context(op, context)
                c = table.get((tp, dcp, self._bb[batch], self._qb[1 + draft], ctx))
            if c is None:
                c = self._slow(op, tp, batch, draft, dcp, context)
            if op not in self._warned and (c.approx or (c.tuned_problem is None and c.problem in self._beyond)):
                # once per op: a nearest bucket, or none at or above where its shape is tuned at other sizes (a block
                # at batch 33 with a draft, above the 64 tokens tuned: the tables built at load served it silently)
                self._warned.add(op)
                self._warn(f"{op}: {c.problem} is untuned; serving the nearest tuned bucket {c.tuned_problem}"
                           if c.approx else
                           f"{op}: {c.problem} has no tuned bucket at or above it; serving the heuristic default")
            return c
        plans.op(op)  # unknown op: ConfigError
        specs.validate_deployment_values(tp, batch, dcp, draft)
        raise AssertionError("unreachable")

    def _served_context(self, op: str, context: int) -> int:
        """A context that is not a bucket: its bucket, with a word (once per op) where it is above them all."""
        ctx = self.context_bucket(context)
        if context > ctx and op not in self._warned_context:
            self._warned_context.add(op)
            self._warn(f"{op}: context {context} is above the spec's largest context bucket {ctx}; serving that "
                       "bucket's choice (add a longer context to the sweep spec's matrix to tune it)")
        return ctx

    def _slow(self, op: str, tp: int, batch: int, draft: int, dcp: int, context: int | None) -> Choice:
        """A deployment outside the spec's tp/dcp values or above its buckets: validated, then built and cached."""
        o = plans.op(op)
        dep = plans.Deployment(tp, batch, dcp, draft, self.context_bucket(context))
        if batch > MAX_BATCH:  # a dense op's tokens (checked by ``lookup``): its tp and dcp checked as a deployment's
            specs.validate_deployment_values(tp, 1, dcp, draft)
            p = plans.problem_at_tokens(o, self.model, tp, batch * (1 + draft), self.spec, dep.context)
        else:
            p = plans.problem_for(o, self.model, dep, self.spec)
        c = self._choose(p)
        self._tables[op][self._key(op, tp, batch, draft, dcp, dep.context if self._kind[op] == _MLA else 0)] = c
        if c.tuned_problem is None and self._winners.get(op):
            self._beyond.add(c.problem)  # outside the spec's buckets (another tp, above them all), tuned elsewhere
        return c

    def layer(self, tp: int, batch: int, draft: int = 0, dcp: int = 1, context: int | None = None) -> dict[str, Choice]:
        return {op: self.lookup(op, tp, batch, draft, dcp, context) for op in plans.OPS}
