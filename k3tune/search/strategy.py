"""The search over one problem's space: optuna's TPE (seeded) over the families and their knobs, or every
valid config when the space fits the budget; then the best few, the safe baseline and the problem's own earlier
winner are measured again and the winner chosen with noise in mind.

Every family's heuristic default is tried first (so the safe baseline is always measured), then configs
that won on neighbouring problems in earlier runs (warm start; never from this run, so the worker count
cannot change a result). Results already in the database are fed back in, never
measured twice. Early stopping: no 1% gain over ``patience`` measured trials.

TPE measures one candidate at a time and samples the next one step ahead (``ahead``: it misses only the
result in flight), so that a compile farm can build its kernel while the current one is measured; when the
samples are drawn depends only on the order of results, never on the number of workers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from k3tune.errors import CannotImplement
from k3tune.kernels import KernelFamily, count_configs, params_key
from k3tune.plan.problems import Problem
from k3tune.plan.spec import SearchSettings

optuna.logging.set_verbosity(optuna.logging.WARNING)

INVALID_US = 1e9  # what TPE is told for a sampled config its family declares invalid
GAIN = 0.01  # an improvement smaller than this does not reset early stopping
REPAIR_TRIES = 96  # random nearby configs tried after an invalid or repeated TPE proposal (1, 2, then 3 knobs)
REPAIR_RANDOM = 512  # then random configs of the whole space
REMEASURE_SAMPLE_FACTOR = 2
TIE_CAP = 0.02  # a remeasured result more than 2% slower than the best is never a tie, however wide the spreads


@dataclass(frozen=True)
class Candidate:
    family: str
    params: dict
    key: str  # params_key
    round: int


@dataclass
class Result:
    candidate: Candidate
    status: str
    median_us: float | None
    spread_us: float | None


@dataclass
class Decision:
    family: str
    params: dict
    median_us: float
    spread_us: float
    ties: list[dict]
    default_us: float | None
    trials: int


def within_safe_margin(safe_us: float, win_us: float, margin_pct: float) -> bool:
    """Whether a kernel's win over the safe baseline is too small to count (both remeasured in the final round): the
    baseline is then served (bench/redecide_db.py applies the same rule to a stored sweep)."""
    return safe_us <= win_us * (1 + margin_pct / 100)


def known_candidates(problem: Problem, families: list[KernelFamily], settings: SearchSettings,
                     warm: list[tuple] = ()) -> list[Candidate]:
    """What a search measures before TPE, in order, known before anything is measured: every family's default,
    its seeds, the winners of neighbouring problems (adapted; given the problem each won on, also with the
    shape-dependent knobs it left at that problem's default moved to this one's), and the whole space when it
    fits the budget."""
    seeds = [(f, f.default_config(problem)) for f in families]
    seeds += [(f, c) for f in families for c in f.seeds(problem)]
    for fam_name, params, *source in warm:
        seeds += _warm_configs(problem, families, fam_name, params, source[0] if source else None)
    # listed only when the search will measure them all
    if count_configs(problem, families, limit=settings.budget) <= settings.budget:
        seeds += [(f, c) for f in families for c in f.configs(problem)]
    queue, seen = [], set()
    for f, c in seeds:
        cand = Candidate(f.name, c.params(), params_key(c.params()), 0)
        if (cand.family, cand.key) not in seen and f.valid(c, problem):
            seen.add((cand.family, cand.key))
            queue.append(cand)
    return queue


def _warm_configs(problem: Problem, families: list[KernelFamily], fam_name: str, params: dict,
                  source: Problem | None) -> list[tuple[KernelFamily, object]]:
    """The configs a winner (of ``fam_name``, on ``source``) suggests for ``problem``: adopted by the families that
    extend its own, and its own family's config adapted to the declared space (``_own_configs``)."""
    out = []
    for f in families:  # a family extending the winner's with a knob: the winner with that knob set
        for prm in f.adopt(fam_name, params, problem):
            try:
                out.append((f, f.config_from_params(problem, prm)))
            except CannotImplement:
                pass
    return out + _own_configs(problem, families, fam_name, params, source)


def _own_configs(problem: Problem, families: list[KernelFamily], fam_name: str, params: dict,
                 source: Problem | None) -> list[tuple[KernelFamily, object]]:
    """A winner of ``fam_name`` as configs of its own family for ``problem``: adapted to the declared space (and
    moved to this problem's shape-dependent defaults where it kept its own problem's); none where that family is
    not offered."""
    f = next((f for f in families if f.name == fam_name), None)
    if f is None:
        return []
    space, base = f.cached_space(problem), f.default_config(problem).params()
    # a winner of an older kernel version may lack knobs added since (they take the default's
    # value) or hold a value no longer declared (likewise): it is a suggestion, re-measured
    adapted = {k: params[k] if params.get(k) in space[k] else base[k] for k in space}
    tries = [adapted]
    added = [k for k in space if k not in params]
    if added:  # and as it ran: a knob is added with the older kernel's behaviour first in its space (0:
        # off), and the default's value may not fit the rest (H200 s22: the MXFP4 default's 2-stage weight
        # ring did not fit the shared memory of s21's TP16 Zipf b1 winner, so that winner was never
        # re-measured and the re-sweep kept a config 3.8% slower)
        tries.append({**adapted, **{k: space[k][0] for k in added}})
    if source is not None and source != problem:
        tries.append(_follow_defaults(f, source, adapted, base))
    out = []
    for prm in tries:
        try:
            out.append((f, f.config_from_params(problem, prm)))
        except CannotImplement:
            pass  # a neighbour's winner may not fit this problem
    return out


def _follow_defaults(f, source: Problem, params: dict, base: dict) -> dict:
    """A neighbour's winner moved to this problem: where it kept its own problem's default for a knob that
    depends on the shape (the token tile of a tensor-core kernel: 8 at M = 8, 16 at M = 16), this problem's
    default instead. H200: a config that ran TP8 kda.o_proj M=8 at 6.6 us was tried at M=16 only with its
    8-token tile (two passes over the weights), never with a 16-token one."""
    try:
        theirs = f.default_config(source).params()
    except CannotImplement:
        return params
    return {k: base[k] if k in theirs and v == theirs[k] and base[k] != theirs[k] else v for k, v in params.items()}


@dataclass
class ProblemSearch:
    problem: Problem
    families: list[KernelFamily]
    settings: SearchSettings
    seed: int
    warm: list[tuple] = field(default_factory=list)  # (family, params, problem it won on) nearby
    stored: list = field(default_factory=list)  # stored Trial rows with current digests
    tpe: bool = True  # False: only the known candidates (a polish pass: the neighbours' winners), then remeasure

    def __post_init__(self):
        self.refused: list[str] = []
        self.fams = {f.name: f for f in self.families}
        self.results: dict[tuple[str, str, int], Result] = {}
        self.in_flight: set[tuple[str, str, int]] = set()
        self._dispatched: list[tuple[str, str, int]] = []  # handed out, not yet absorbed, in order
        self._arrived: dict[tuple[str, str, int], tuple] = {}  # results waiting for an earlier one
        self.space = {f.name: f.cached_space(self.problem) for f in self.families}
        # whether the known queue lists the whole space (counting stops past the budget: see count_configs)
        self.exhaustive = count_configs(self.problem, self.families, limit=self.settings.budget) <= self.settings.budget
        self.asks = 0
        self._rng = random.Random(self.seed)
        self.best = math.inf
        self.since_gain = 0
        self.phase = "search"
        self.decision: Decision | None = None
        self._pending: dict[tuple[str, str], optuna.trial.Trial] = {}
        self.ahead: Candidate | None = None  # the next TPE candidate, sampled while the current one is measured
        # a polish pass (tpe False) never asks TPE: no study to build or to feed the stored trials
        self.study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(
            seed=self.seed, n_startup_trials=max(4, min(10, self.settings.budget // 3)))) if self.tpe else None
        self.dists = {"family": CategoricalDistribution([f.name for f in self.families])}
        for f in self.families:
            for k, choices in self.space[f.name].items():
                self.dists[f"{f.name}:{k}"] = CategoricalDistribution(list(choices))
        for t in self.stored:
            try:  # a stored trial outside the declared space is refused: never reused, never launched
                self.fams[t.family].config_from_params(self.problem, t.params)
            except (CannotImplement, KeyError) as e:
                self.refused.append(f"{self.problem.key} {t.family} {t.params_key}: {e}")
                continue
            self._absorb(Candidate(t.family, t.params, t.params_key, t.round), t.status.value, t.median_us, t.spread_us)
        self.queue = known_candidates(self.problem, self.families, self.settings, self.warm)
        # the problem's own earlier winners (what a re-sweep or a polish pass starts from): remeasured beside the
        # finalists whatever their first time, so that one slow outlier cannot unseat them (H200 s67-r2: a block's
        # shipped knobs timed once at 127.1 us, then 109.1-111.2 every time after; a 40-SM split at 114.1 won)
        # (the winner itself, as adapted to its family's space; not the configs other families adopt from it)
        self.incumbents = [(f.name, params_key(c.params())) for fam_name, params, *source in self.warm
                           if source and source[0] == self.problem
                           for f, c in _own_configs(self.problem, self.families, fam_name, params, None)]

    # ---- bookkeeping --------------------------------------------------------------------------
    @property
    def measured(self) -> int:
        return sum(1 for k in self.results if k[2] == 0)

    def _absorb(self, cand: Candidate, status: str, median, spread) -> None:
        key = (cand.family, cand.key, cand.round)
        self.results[key] = Result(cand, status, median, spread)
        if cand.round != 0:
            return
        flat = {"family": cand.family, **{f"{cand.family}:{k}": v for k, v in cand.params.items()}}
        trial = self._pending.pop((cand.family, cand.key), None)
        ok = status == "ok" and median is not None
        if trial is not None:
            self.study.tell(trial, median if ok else None, state=TrialState.COMPLETE if ok else TrialState.FAIL)
        elif self.tpe and all(k in self.dists for k in flat) and all(v in self.dists[k].choices for k, v in flat.items()):
            self.study.add_trial(create_trial(params=flat, distributions={k: self.dists[k] for k in flat},
                                              value=median if ok else None,
                                              state=TrialState.COMPLETE if ok else TrialState.FAIL))
        if ok and median < self.best * (1 - GAIN):
            self.best, self.since_gain = median, 0
        else:
            self.since_gain += 1

    def _ask_tpe(self) -> Candidate | None:
        while self.asks < 4 * self.settings.budget:
            self.asks += 1
            trial = self.study.ask()
            fam = self.fams[trial.suggest_categorical("family", list(self.dists["family"].choices))]
            params = fam.canonical({k: trial.suggest_categorical(f"{fam.name}:{k}", list(v))
                                    for k, v in self.space[fam.name].items()})
            cfg = fam.config_cls(**params)
            key = params_key(params)
            if not fam.valid(cfg, self.problem):
                # told as a very slow result, not a failure: TPE ignores failed trials, so a region of coupled knobs
                # that no config satisfies (e.g. bk = 32 with two K warps) would be sampled again and again
                self.study.tell(trial, INVALID_US, state=TrialState.COMPLETE)
                self._explore(fam, params)
                continue
            done = self.results.get((fam.name, key, 0))
            if done is not None or (fam.name, key, 0) in self.in_flight:
                ok = done is not None and done.status == "ok"
                self.study.tell(trial, done.median_us if ok else None, state=TrialState.COMPLETE if ok else TrialState.FAIL)
                self._explore(fam, params)
                continue
            self._pending[(fam.name, key)] = trial
            return Candidate(fam.name, params, key, 0)
        return None

    def _explore(self, fam: KernelFamily, params: dict) -> None:
        """After TPE proposed an invalid config or one already measured: enqueue, as its next ask, a valid
        untried config near it, or else near the best measured config of another family. Seen on the H200 (the
        sweeps of session 8): for a K = 224 problem, 176 of 8100 declared tensor-core configs are valid (bk must
        divide K), cuBLAS (one config) led after the seeds, and TPE spent its asks re-proposing cuBLAS and
        sampling invalid configs: 3 configs measured, while a tensor-core config measured later was 1.5x faster."""
        best: dict[str, dict] = {}  # each family's fastest measured params, fastest family first
        measured = [r for k, r in self.results.items() if k[2] == 0 and r.status == "ok" and r.median_us is not None]
        for r in sorted(measured, key=lambda r: r.median_us):
            best.setdefault(r.candidate.family, r.candidate.params)
        bases = [(fam, params)] + [(self.fams[n], p) for n, p in best.items() if n != fam.name]
        bases += [(f, f.default_config(self.problem).params()) for f in self.families
                  if f is not fam and f.name not in best]
        for f, base in bases:
            near = self._repair(f, base)
            if near is not None:
                self.study.enqueue_trial({"family": f.name, **{f"{f.name}:{k}": v for k, v in near.items()}})
                return

    def _repair(self, fam: KernelFamily, params: dict) -> dict | None:
        """A valid config not yet tried that differs from ``params`` in a few knobs (seeded random changes of 1,
        then 2, then 3 knobs), else a random valid untried one (rejection sampling), or None."""
        space = self.space[fam.name]
        names = list(space)
        if not names:
            return None
        for i in range(REPAIR_TRIES + REPAIR_RANDOM):
            near = dict(params)
            changed = (names if i >= REPAIR_TRIES
                       else self._rng.sample(names, min(len(names), 1 + 3 * i // REPAIR_TRIES)))
            for k in changed:
                near[k] = self._rng.choice(list(space[k]))
            near = fam.canonical(near)
            key = params_key(near)
            if ((fam.name, key, 0) in self.results or (fam.name, key, 0) in self.in_flight
                    or (fam.name, key) in self._pending):
                continue
            if fam.valid(fam.config_cls(**near), self.problem):
                return near
        return None

    # ---- the driver's interface ---------------------------------------------------------------
    @property
    def _search_over(self) -> bool:
        return (not self.tpe or self.measured >= self.settings.budget or self.since_gain >= self.settings.patience
                or self.exhaustive or self._space_measured())

    def _space_measured(self) -> bool:
        """Every valid config has a result (possible only past the budget, with stored trials reused)."""
        n = len(self.results)
        return n > self.settings.budget and count_configs(self.problem, self.families, limit=n) <= n

    def upcoming(self) -> Candidate | None:
        """The candidate ``next()`` would hand out now, without handing it out (None where ``next()`` would
        wait, or would move to its next phase first). Lets the driver hand out first the candidates whose
        kernels are already compiled. A TPE sample drawn here is the one ``next()`` would draw: it becomes
        ``ahead``, which ``next()`` takes."""
        if self.decision is not None:
            return None
        rnd = 0 if self.phase == "search" else 1
        for cand in self.queue:
            if (cand.family, cand.key, rnd) not in self.results:
                return cand
        if self.phase != "search" or self._search_over or self.in_flight:
            return None
        if self.ahead is None:
            self.ahead = self._ask_tpe()
        return self.ahead

    def next(self) -> Candidate | None:
        """The next candidate to measure, or None while waiting on results or when finished."""
        if self.decision is not None:
            return None
        if self.phase == "search":
            while self.queue:
                cand = self.queue.pop(0)
                if (cand.family, cand.key, 0) not in self.results:
                    self._dispatch((cand.family, cand.key, 0))
                    return cand
            if not self._search_over:
                if self.in_flight:
                    return None  # TPE learns from each result: one candidate at a time
                cand, self.ahead = self.ahead or self._ask_tpe(), None
                if cand is not None:
                    self._dispatch((cand.family, cand.key, 0))
                    if self.measured + 1 < self.settings.budget:  # sampled one step ahead (it misses only the
                        self.ahead = self._ask_tpe()  # result now in flight), so its kernel can compile meanwhile
                    return cand
            if self.in_flight:
                return None
            self.phase, self.ahead = "remeasure", None
            # the top few, always the safe baseline (the winner is chosen against it on remeasured numbers) and the
            # problem's own earlier winners (``incumbents``)
            finalists = self._ranked()
            safe = self.results.get((self.families[0].name,
                                     params_key(self.families[0].default_config(self.problem).params()), 0))
            if safe is not None and safe.status == "ok" and safe not in finalists:
                finalists.append(safe)
            for fam_name, key in self.incumbents:
                mine = self.results.get((fam_name, key, 0))
                if mine is not None and mine.status == "ok" and mine not in finalists:
                    finalists.append(mine)
            self.queue = [Candidate(r.candidate.family, r.candidate.params, r.candidate.key, 1) for r in finalists]
            if finalists:  # the leader with its optional features off: does each pay beyond noise? And
                # with its on/off features on: a feature TPE left off at the leader may pay there (ties keep it off)
                lead = finalists[0].candidate
                for twin in (*self._switched_off(lead), self._switched_on(lead)):
                    if twin is not None and (twin.family, twin.key) not in {(c.family, c.key) for c in self.queue}:
                        self.queue.append(twin)
        if self.phase == "remeasure":
            while self.queue:
                cand = self.queue.pop(0)
                if (cand.family, cand.key, 1) not in self.results:
                    self._dispatch((cand.family, cand.key, 1))
                    return cand
            if not self.in_flight:
                # the remeasured best may be a twin, or another finalist, whose own features were never switched
                # off: remeasure those twins too before deciding (each round has fewer features on, so it ends)
                won = self._winner()
                self.queue = [t for t in self._switched_off(won[0].candidate) if t is not None
                              and (t.family, t.key, 1) not in self.results] if won else []
                if self.queue:
                    return self.next()
                self.decision = self._decide(won)
        return None

    def _switched_off(self, cand: Candidate) -> list[Candidate | None]:
        """``cand`` with each knob of its family's ``off`` that is on set to off alone, and with all of them off
        where several are on (round 1, the valid ones): a feature is kept only where it pays beyond the noise
        with the leader's other knobs as they are (s25: a block's leader with PDL on and 24 shared SMs, whose
        serial twin was never measured, lost 2-4 us to it in the bench)."""
        on = {k: v for k, v in self.fams[cand.family].off.items() if k in cand.params and cand.params[k] != v}
        alone = [self._twin(cand, {k: v}) for k, v in on.items()]
        return alone + [self._twin(cand, on)] if len(on) > 1 else alone

    def _switched_on(self, cand: Candidate) -> Candidate | None:
        """``cand`` with every two-valued ``off`` knob that is off switched on (round 1), if that is valid. Knobs
        with several on values (a prefetch size) are left to the search."""
        space = self.space[cand.family]
        return self._twin(cand, {k: next(v for v in space[k] if v != off)
                                 for k, off in self.fams[cand.family].off.items()
                                 if cand.params.get(k) == off and len(space.get(k, ())) == 2})

    def _twin(self, cand: Candidate, changed: dict) -> Candidate | None:
        """``cand`` with the ``changed`` knobs, to remeasure (round 1); None if nothing changes or it is invalid."""
        if not changed:
            return None
        fam = self.fams[cand.family]
        params = fam.canonical({**cand.params, **changed})
        try:
            cfg = fam.config_from_params(self.problem, params)
        except CannotImplement:
            return None
        return Candidate(fam.name, params, params_key(params), 1) if fam.valid(cfg, self.problem) else None

    def _n_off(self, cand: Candidate) -> int:
        return sum(1 for k, v in self.fams[cand.family].off.items() if cand.params.get(k) == v)

    def samples_for(self, cand: Candidate) -> int:
        return self.settings.samples * (REMEASURE_SAMPLE_FACTOR if cand.round else 1)

    def _dispatch(self, key: tuple) -> None:
        self.in_flight.add(key)
        self._dispatched.append(key)

    def tell(self, cand: Candidate, status: str, median, spread) -> None:
        """Results are absorbed in the order their candidates were handed out, whatever order they arrive
        in (a result waiting for an earlier one still counts as in flight): the search's state (TPE history,
        early-stopping counters) then does not depend on how many workers measured it."""
        self._arrived[(cand.family, cand.key, cand.round)] = (cand, status, median, spread)
        while self._dispatched and self._dispatched[0] in self._arrived:
            key = self._dispatched.pop(0)
            self.in_flight.discard(key)
            self._absorb(*self._arrived.pop(key))

    @property
    def finished(self) -> bool:
        return self.decision is not None

    def _ranked(self) -> list[Result]:
        ok = [r for k, r in self.results.items() if k[2] == 0 and r.status == "ok"]
        return sorted(ok, key=lambda r: r.median_us)[: self.settings.remeasure_top]

    def _decide(self, chosen: tuple[Result, list[Result], Result | None] | None) -> Decision:
        """The decision from ``_winner()``'s answer."""
        if chosen is None:
            return Decision("", {}, math.inf, 0.0, [], None, len(self.results))  # nothing ran correctly
        win, ties, d = chosen
        return Decision(win.candidate.family, win.candidate.params, win.median_us, win.spread_us,
                        [{"family": r.candidate.family, "params": r.candidate.params, "median_us": r.median_us}
                         for r in ties[1:]],
                        d.median_us if d and d.status == "ok" else None, len(self.results))

    def _winner(self) -> tuple[Result, list[Result], Result | None] | None:
        """(the winner, its ties with the winner first, the safe baseline's result) on the remeasured numbers;
        None when nothing remeasured ran correctly."""
        final = [r for k, r in self.results.items() if k[2] == 1 and r.status == "ok"]
        if not final:
            return None
        best = min(final, key=lambda r: r.median_us)

        def tied(r: Result) -> bool:
            # overlapping interquartile ranges, or within half a percent: the order is noise. A noisy remeasure
            # widens the window to at most TIE_CAP of the best (s37: a 7 us spread made a config 5% slower, with PDL
            # off, a tie that the preference for features off then chose)
            half = min((best.spread_us + r.spread_us) / 2, TIE_CAP * best.median_us)
            return r.median_us - best.median_us <= max(half, 0.005 * best.median_us)

        ties = sorted((r for r in final if tied(r)),
                      key=lambda r: (self.fams[r.candidate.family].priority, -self._n_off(r.candidate),
                                     r.candidate.family, r.candidate.key))
        win = ties[0]
        safe = self.families[0]
        safe_key = params_key(safe.default_config(self.problem).params())
        base = self.results.get((safe.name, safe_key, 1))  # the baseline, remeasured beside the finalists
        d = base or self.results.get((safe.name, safe_key, 0))
        if (win.candidate.family != safe.name and base is not None and base.status == "ok"
                and within_safe_margin(base.median_us, win.median_us, self.settings.safe_margin_pct)):
            # a win within the margin is not one: serve the safe baseline, the faster kernels its ties
            ties = [base] + [r for r in ties if r is not base]
            win = base
        return win, [win] + [r for r in ties if r is not win], d
