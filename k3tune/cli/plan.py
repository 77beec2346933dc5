"""`k3tune plan`: the deployment matrix, the problems it reduces to, and what a sweep will cost."""

from __future__ import annotations

from collections import defaultdict

from rich.markup import escape
from rich.table import Table

from k3tune.cli.common import ConfigOption, JsonOption, SpecOption, console, print_json
from k3tune.kernels import count_configs, families_for
from k3tune.plan import model as models, problems as plans, spec as specs
from k3tune.search.phases import added_for_blocks

# rough cost of one trial, for the estimate: simulated trials are bookkeeping; GPU trials compile, check and
# replay a graph of many launches
SECONDS_PER_TRIAL = {"simulated": 0.004, "gpu": 0.35}


def estimate(plan: plans.Plan, backend: str) -> dict:
    """On the GPU backend (phased: the blocks run the dense kernels the sweep tunes first) with the dense problems
    the blocks run that the spec does not list."""
    s = plan.spec.search
    trials = 0
    tunable = 0
    for p in [*plan.problems, *(added_for_blocks(plan, backend) if backend == "gpu" else [])]:
        fams = families_for(p, backend)
        if not fams:
            continue
        tunable += 1
        size = count_configs(p, fams)  # a block's joint space is counted, never listed
        trials += min(size, s.budget) + min(size, s.remeasure_top)
    return {"problems": tunable, "trials": trials, "seconds_one_worker": round(trials * SECONDS_PER_TRIAL[backend], 1)}


def plan(spec: SpecOption = None, config: ConfigOption = None, json: JsonOption = False) -> None:
    """Print the deployment matrix, the unique kernel problems it reduces to, and a trial/time estimate.

    Example: k3tune plan --spec smoke
    """
    sp = specs.load(spec)
    p = plans.build(sp, models.load(config or sp.model_config_path()))
    by_op: dict[str, list[plans.Problem]] = defaultdict(list)
    for prob in p.problems:
        by_op[prob.op].append(prob)
    est = {b: estimate(p, b) for b in ("simulated", "gpu")}
    if json:
        print_json({"spec": sp.name, "deployments": len(p.deployments),
                    "matrix": {"tp": sp.tp, "batch": [sp.batch[0], sp.batch[-1]], "dcp": sp.dcp, "draft": sp.draft,
                               "context": sp.context},
                    "problems": {op: [dict(key=x.key, deployments=p.shared_by[x]) for x in probs] for op, probs in by_op.items()},
                    "estimate": est})
        return
    console.print(f"[bold]spec {escape(sp.name)}[/]: {len(p.deployments)} deployments "
                  f"(tp {list(sp.tp)} x batch {sp.batch[0]}-{sp.batch[-1]} x dcp {list(sp.dcp)} x draft "
                  f"{list(sp.draft)} x context {list(sp.context)}) -> {len(p.problems)} unique problems")
    t = Table("op", "problems", "deployments per problem", "example")
    for op, probs in by_op.items():
        shares = [p.shared_by[x] for x in probs]
        t.add_row(op, str(len(probs)), f"{min(shares)}-{max(shares)}", escape(probs[0].key))
    console.print(t)
    for b, e in est.items():
        console.print(f"{b}: {e['problems']} tunable problems, ~{e['trials']} trials, "
                      f"~{e['seconds_one_worker']:.0f} s on one worker")
