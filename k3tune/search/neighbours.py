"""The stored winners a sweep offers a problem as warm starts: its own (of older kernel versions), those of other
ops of its shape, those of the nearest problems of its op, and in a polish pass more of them, the winner's one-knob
moves and the winners of other ops nearest in shape at its token count.

Only winners stored before the pass began are offered (``Neighbours.load`` at the start and before each polish
pass): which neighbours finish first depends on the number of workers, and the winners must not (a 1-GPU and an
N-GPU sweep choose the same kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from k3tune.kernels.base import KernelFamily
from k3tune.plan import problems as plans
from k3tune.plan.spec import SearchSettings
from k3tune.search import polish
from k3tune.store.db import Database
from k3tune.store.models import Backend, Winner

Entry = tuple[plans.Problem, str, dict]  # (the problem it won on, family, params)


def distance(a: plans.Problem, b: plans.Problem) -> float:
    """How far apart two problems' shapes are: log-distance of the sizes, plus one a differing non-size dim."""
    pairs = list(zip(a.dims, b.dims))
    return (sum(abs(math.log(max(1, x[1])) - math.log(max(1, y[1]))) for x, y in pairs
                if isinstance(x[1], int) and isinstance(y[1], int))
            + sum(1 for x, y in pairs if x != y and not isinstance(x[1], int)))


class Neighbours:
    """Every stored winner of one hardware and backend among a sweep's problems, indexed for warm starts.

    ``polishing`` is set by the sweep when its polish passes begin: from then on ``warm`` offers the wider set.
    """

    def __init__(self, db: Database, hw_id: int, label: Backend, seed_hw: list[int],
                 by_id: dict[int, plans.Problem], search: SearchSettings,
                 families: Callable[[plans.Problem], list[KernelFamily]], retry: Callable[[str], None]):
        self.db, self.hw_id, self.label, self.seed_hw = db, hw_id, label, seed_hw
        self.by_id, self.search, self.families, self.retry = by_id, search, families, retry
        self.polishing = False  # a polish pass: more neighbours' winners, no TPE
        self.by_op: dict[str, list[Entry]] = {}
        # winners by kind and dims: another op of the same shape (H200 dense: TP8 kda.o_proj and mla.o_proj are both
        # 7168 x 1536; moe.shared_w2 TP8 and both o_proj TP16 are 7168 x 768) is the nearest neighbour there is
        self.twins: dict[tuple, list[Entry]] = {}
        # winners by kind and token count: in a polish pass a problem also tries the winners of the other ops
        # nearest in shape at its M (two H200 dense sweeps, 1 and 2 GPUs, each missed a config the other found,
        # e.g. TP16 mla.gate M=1 at 5.45 us where the M=1 small-M layout that wins the 1536-row shapes ran 4.57)
        self.same_m: dict[tuple, list[Entry]] = {}
        # by problem keys: every pass ranks the same pairs again (a default GB300 sweep spent 200 of its 275 s of
        # pass planning, with the workers idle, recomputing them)
        self._distances: dict[tuple[str, str], float] = {}

    def load(self) -> None:
        """Every stored winner of this hardware and backend (stale ones too: a suggestion, re-measured), and with
        ``seed_hw`` (the sweep's ``warm_from``) the other kind's where this one has none."""
        def read(s: Session) -> list:
            won = s.execute(select(Winner.problem_id, Winner.family, Winner.params)
                            .where(Winner.hardware_id == self.hw_id, Winner.backend == self.label)).all()
            if self.seed_hw:  # the other kind's winner where this one has none yet (one a problem)
                have = {w[0] for w in won}
                for w in s.execute(select(Winner.problem_id, Winner.family, Winner.params)
                                   .where(Winner.hardware_id.in_(self.seed_hw), Winner.backend == self.label)
                                   .order_by(Winner.hardware_id.desc())).all():
                    if w[0] not in have:
                        have.add(w[0])
                        won.append(w)
            return won

        won = self.db.transact(read, self.retry)
        self.by_op.clear()
        self.twins.clear()
        self.same_m.clear()
        for pid, fam, params in won:
            if pid in self.by_id:
                q = self.by_id[pid]
                self.by_op.setdefault(q.op, []).append((q, fam, params))
                self.twins.setdefault((q.kind, q.dims), []).append((q, fam, params))
                if q.get("M") is not None:
                    self.same_m.setdefault((q.kind, q["M"]), []).append((q, fam, params))

    def _distance(self, q: plans.Problem, p: plans.Problem) -> float:
        k = (q.key, p.key)
        d = self._distances.get(k)
        if d is None:
            d = self._distances[k] = distance(q, p)
        return d

    def near(self, p: plans.Problem) -> list[Entry]:
        """The problem's own stored winners (of older kernel versions), those of other ops of its shape and those
        of the nearest problems of its op; in a polish pass also the winner's moves and other ops' at its M."""
        mine = [n for n in self.by_op.get(p.op, []) if n[0] == p]
        same_shape = sorted((n for n in self.twins.get((p.kind, p.dims), []) if n[0] != p), key=lambda n: n[0].op)
        others = sorted((n for n in self.by_op.get(p.op, []) if n[0] != p), key=lambda n: self._distance(n[0], p))
        if not self.polishing:
            return mine + same_shape + others[:2]
        at_m = sorted((n for n in self.same_m.get((p.kind, p.get("M")), []) if n[0].op != p.op and n[0].dims != p.dims),
                      key=lambda n: (self._distance(n[0], p), n[0].op))
        moved = []
        search = self.search
        if search.local or search.whole:  # the winner's one-knob neighbours (a hill climb over the passes), and
            # every value of the ``whole`` knobs
            fams = {f.name: f for f in self.families(p)}
            moved = [(p, fam, prm) for q, fam, params in mine if fam in fams
                     for prm in ((polish.local_moves(fams[fam], p, params) if search.local else [])
                                 + polish.whole_moves(fams[fam], p, params, search.whole))]
        if not search.neighbours:  # only the winner's own moves
            return mine + moved
        return mine + moved + same_shape + others[:search.neighbours] + at_m[:polish.CROSS_OP]

    def warm(self, p: plans.Problem) -> list[tuple[str, dict, plans.Problem]]:
        """``near`` as warm starts: (family, params, the problem it won on)."""
        return [(f, prm, q) for q, f, prm in self.near(p)]
