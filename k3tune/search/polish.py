"""Polish passes: after every problem of a sweep is decided, try on each problem the winners of its nearest
neighbours (other ops of the same shape; the same op at other M, other TP) that it has not tried, then
remeasure and decide again.

A search of a few dozen trials over a space of thousands can miss a config that won next door (H200 dense sweep,
session 9: a tensor-core config at 3.9 us for M = 8 while M = 4 and 16 kept cuBLAS at 5.6). Searches take warm
starts only from earlier runs' winners, so that the worker count cannot change a result; a pass, planned from the
stored winners once every problem is decided, is the same for any worker count and on every machine sharing the
sweep. The driver runs the passes (``[search] polish`` at most) until nothing is left untried. With ``[search]
local = 1`` a pass also tries each problem's winner with one knob moved one step (``local_moves``): over the passes, a
hill climb from what the search found. With ``[search] whole = [knobs]`` it also tries the winner at every declared
value of those knobs (``whole_moves``): for a knob whose values are alternatives rather than a scale (the SM split).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from sqlalchemy import select

from k3tune.kernels import KernelFamily, params_key
from k3tune.plan.problems import Problem
from k3tune.plan.spec import SearchSettings
from k3tune.search.strategy import known_candidates
from k3tune.store import records
from k3tune.store.db import Database
from k3tune.store.models import Backend, Winner

CROSS_OP = 2  # a pass tries the winners of this many other ops nearest in shape at the same token count too (beside
# ``[search] neighbours`` nearest problems of the same op and every same-shape op; none of them with neighbours = 0)
CLAIM_PREFIX = "polish:"  # a pass's claims are keyed CLAIM_PREFIX + the digest of what it will try


def local_moves(fam: KernelFamily, problem: Problem, params: dict) -> list[dict]:
    """``params`` with one knob moved to a neighbouring value of the family's declared space for ``problem`` (in the
    order the space lists them), each knob both ways; whether a move is valid is the search's to check."""
    space = fam.cached_space(problem)
    out = []
    for knob, values in space.items():
        if params.get(knob) not in values:
            continue
        i = values.index(params[knob])
        out += [{**params, knob: values[j]} for j in (i - 1, i + 1) if 0 <= j < len(values)]
    return out


def whole_moves(fam: KernelFamily, problem: Problem, params: dict, knobs: tuple[str, ...]) -> list[dict]:
    """``params`` with one of ``knobs`` set to each other value the family's space for ``problem`` declares (knobs it
    does not declare are left out); whether a move is valid is the search's to check."""
    space = fam.cached_space(problem)
    return [{**params, knob: v} for knob in knobs if knob in space and knob in params
            for v in space[knob] if v != params[knob]]


def declared_knobs(fams, problems) -> set[str]:
    """Every knob the families declare for any of the problems (``fams(problem)``: its families)."""
    return {k for p in problems for f in fams(p) for k in f.cached_space(p)}


def current_winners(db: Database, hw_id: int, backend: Backend, digests: dict[int, str],
                    on_retry: Callable[[str], None] | None = None) -> dict[int, tuple[str, dict]]:
    """Problem id -> (family, params) of its winner for the op digest given, where there is one."""
    rows = db.transact(lambda s: s.execute(select(Winner.problem_id, Winner.op_digest, Winner.family, Winner.params)
                                           .where(Winner.hardware_id == hw_id, Winner.backend == backend,
                                                  Winner.problem_id.in_(set(digests)))).all(), on_retry)
    return {pid: (fam, params) for pid, d, fam, params in rows if digests.get(pid) == d}


class Planner:
    """Plans passes for one sweep: ``families(problem)`` its kernel families, ``near(problem)`` the stored winners
    to try on it as (family, params, problem it won on), ``fam_digests`` and ``method`` which stored trials count."""

    def __init__(self, db: Database, hw_id: int, backend: Backend, settings: SearchSettings,
                 families: Callable[[Problem], list[KernelFamily]], fam_digests: dict[str, str], method: str,
                 near: Callable[[Problem], list[tuple[str, dict, Problem]]],
                 on_retry: Callable[[str], None] | None = None):
        self.db, self.hw_id, self.backend, self.settings = db, hw_id, backend, settings
        self.on_retry = on_retry  # told of each transaction run again after its database server went away
        self.families, self.fam_digests, self.method, self.near = families, fam_digests, method, near
        self._base: dict[int, set] = {}  # per problem, what its search knew itself (defaults, seeds)
        self.untimed: set[int] = set()  # problems left alone: their winner is not among their trials

    def plan(self, problems: dict[int, Problem], digests: dict[int, str]) -> dict[int, str]:
        """The problems on which a neighbour's winner has not been tried, each with the pass's claim key (the
        digest of what it will try: machines of one sweep that plan a pass at once plan the same; one that
        comes later joins the pass still open instead, see ``open_pass``). A problem whose winner was timed
        another way (an older method, so not among its trials) is left alone: the new candidates could not be
        compared with it."""
        untried: dict[int, list] = {}
        won = current_winners(self.db, self.hw_id, self.backend, digests, self.on_retry)
        tried_by = self.db.transact(lambda s: records.tried_keys(s, self.hw_id, set(problems), self.fam_digests,
                                                                 self.method), self.on_retry)
        for pid in sorted(problems):
            p, fams = problems[pid], self.families(problems[pid])
            names = {f.name for f in fams}
            tried = {t for t in tried_by[pid] if t[0] in names}
            if pid not in won:
                continue
            if (won[pid][0], params_key(won[pid][1])) not in tried:
                self.untimed.add(pid)
                continue
            self.untimed.discard(pid)
            if pid not in self._base:
                self._base[pid] = {(c.family, c.key) for c in known_candidates(p, fams, self.settings)}
            new = sorted({(c.family, c.key) for c in known_candidates(p, fams, self.settings, self.near(p))}
                         - self._base[pid] - tried)
            if new:
                untried[pid] = new
        key = CLAIM_PREFIX + hashlib.sha256(repr(sorted(untried.items())).encode()).hexdigest()[:16]
        return {pid: key for pid in untried}

    def open_pass(self, problems: set[int]) -> dict[int, str]:
        """A pass another machine of this sweep planned and has not finished (its claims not done)."""
        return self.db.transact(lambda s: records.open_claims(s, self.hw_id, self.backend, CLAIM_PREFIX, problems),
                                self.on_retry)
