"""The dense problems behind a phased sweep's blocks. An op that runs other ops' tuned kernels (``OpDef.runs``: on a
GPU the MoE block runs the dense projections the runtime selector picks) is swept after them (``driver.run_sweep``);
here: which dense problems its lookups ask for, and which of those join the first phase because the spec lacks them.
Light on imports: `k3tune plan` uses it for its estimate."""

from __future__ import annotations

from k3tune.kernels import families_for
from k3tune.plan import model as models, problems as plans, spec as specs


def run_lookups(problems: list[plans.Problem]) -> dict[plans.Problem, list[plans.Problem]]:
    """For the problems of ops that run other ops' tuned kernels (``OpDef.runs``): each dense problem their lookups
    ask for, and the problems that ask for it. The lookups are mapped as the workers' ``Selector.load()`` maps them
    (the default spec's token buckets, the default model's shapes): the block at M tokens asks for each dense op at
    M tokens (``problems.problem_at_tokens``: M is up to 512, past any batch a deployment has)."""
    model, spec = models.load(), specs.load()
    need: dict[plans.Problem, list[plans.Problem]] = {}
    for p in problems:
        for name in plans.OPS[p.op].runs:
            q = plans.problem_at_tokens(plans.OPS[name], model, p["tp"], p["M"], spec, spec.context[0])
            need.setdefault(q, []).append(p)
    return need


def added_for_blocks(plan: plans.Plan, backend: str) -> list[plans.Problem]:
    """The dense problems a phased sweep of ``plan`` tunes in its first phase beside the spec's own: those its
    blocks' lookups ask for (``run_lookups``) that the spec does not list, where the spec tunes dense ops beside the
    blocks (the smoke spec lacked three of the block's five ops: its first GPU sweep was refused after its first
    phase). A blocks-only spec adds none: it is run against a database that holds them, or refused before anything
    is measured."""
    ops = {p.op for p in plan.problems if families_for(p, backend)}
    later = {op for op in ops if plans.OPS[op].runs}
    if not later or not ops - later:
        return []
    asked = run_lookups([p for p in plan.problems if p.op in later])
    return sorted(q for q in set(asked) - set(plan.problems) if families_for(q, backend))
