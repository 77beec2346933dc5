"""The sweep driver: plan -> claim problems -> search each over the worker pool -> store trials and winners.

The parent process owns the searches and the database; workers only measure. Every finished trial is
committed at once, so ``kill -9`` of the sweep loses only the trials in flight, and running it again resumes
from the stored trials without measuring anything twice. Problems are claimed through the database, so
several machines can share one sweep (PostgreSQL) without overlap; a dead owner's claims are taken over.

Once every problem is decided, polish passes (k3tune.search.polish) try on each problem the winners of its
nearest neighbours that it has not tried, without TPE, then remeasure and decide again.

An op measured with other ops' tuned kernels inside it (``OpDef.runs``: on a GPU the MoE block runs the dense
projections the runtime selector picks) is swept after them, in a second phase, and its workers' selector reads
this sweep's database (``K3TUNE_SERVE_DB``): a block is timed with the dense kernels it will be served with. The
first phase also tunes the dense problems the blocks' lookups ask for that the spec does not list. A blocks-only
spec's block whose dense lookups have no current winner in the database is refused before anything is measured,
never timed on the selector's heuristic defaults.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from k3tune.errors import ConfigError, HardwareError
from k3tune.kernels import FAMILIES, LANDED_ON, STAGED, check_backend, families_for, op_digest
from k3tune.kernels.gemm_smallm import current_arch
from k3tune.plan import hardware, problems as plans
from k3tune.plan.hardware import Fingerprint, HardwareSpec
from k3tune.plan.model import ModelConfig
from k3tune.plan.spec import SweepSpec
from k3tune.search.compile_farm import CompileFarm, default_procs
from k3tune.search.method import method_digest
from k3tune.search.neighbours import Neighbours
from k3tune.search.outcome import Task
from k3tune.search import polish
from k3tune.search.phases import added_for_blocks, run_lookups
from k3tune.search.strategy import Candidate, ProblemSearch
from k3tune.search.workers import WorkerPool
from k3tune.store import records
from k3tune.store.db import Database
from k3tune.store.models import Backend, Hardware, ProblemRow, TrialStatus, Winner

BACKEND_LABEL = {"gpu": Backend.measured, "simulated": Backend.simulated, "cpu": Backend.cpu}


@dataclass
class SweepOptions:
    spec: SweepSpec
    model: ModelConfig
    db: Database
    backend: str  # gpu | simulated | cpu
    workers: int
    hw: HardwareSpec | None = None  # simulated: the modelled hardware
    trial_timeout_s: float = 120.0
    lease_s: float = 300.0
    wait_for_others: bool = True
    command: str = "k3tune sweep"
    progress: Callable[[SweepStats], None] | None = None
    compile_procs: int | None = None  # gpu: CPU processes compiling candidates ahead (None: compile_farm.default_procs)
    # ops that run other ops' tuned kernels (OpDef.runs) after those, in a second phase (None: on the GPU backend,
    # the only one whose blocks run them); internal: ``only_ops`` limits a phase to its ops
    phased: bool | None = None
    only_ops: frozenset[str] | None = None
    plan: plans.Plan | None = None  # spec x model, when the caller has built it already (None: built here)
    # another GPU kind's winners in the same database (a class-key substring, e.g. 'H200') as the first candidates
    # of every problem this hardware has no winner of yet: a new kind of one arch starts from a tuned one's table
    warm_from: str | None = None


@dataclass
class SweepStats:
    problems_total: int = 0
    problems_done_before: int = 0
    problems_done: int = 0
    trials: int = 0
    failed: int = 0
    reused: int = 0
    workers_replaced: int = 0
    workers_retired: list[str] = field(default_factory=list)  # lost GPUs: the sweep went on without them
    no_winner: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # stored trials outside the declared space
    skipped_ops: dict[str, str] = field(default_factory=dict)
    best_speedup: float | None = None  # best winner-vs-default ratio so far
    db_retries: list[str] = field(default_factory=list)  # transactions run again after the database server went away
    added_for_blocks: list[str] = field(default_factory=list)  # dense problems tuned because the spec's blocks run them
    last: str = ""
    seconds: float = 0.0
    workers_ready_s: float | None = None  # from the sweep's start until every worker first reported ready
    first_result_s: float | None = None  # until the first measured trial came back
    pool_started_s: float | None = None  # until the workers' processes were started (planning, database)
    worker_startup: list[dict] = field(default_factory=list)  # per worker: spawn to ready, of which backend
    worker_busy_s: float = 0.0  # summed over workers: wall seconds measuring (build, check, time) ...
    worker_busy_cpu_s: float = 0.0  # ... of which the workers had the CPU (less: blocked on the GPU or descheduled)
    worker_build_s: float = 0.0  # ... and seconds inside builds (a compile, or a wait on the farm's)
    opened_early: int = 0  # problems opened beyond the usual number because every open one waited on a build
    polished: int = 0  # distinct problems searched again because a neighbour's winner had not been tried on them
    polish_changed: int = 0  # of those, how many chose another kernel
    polish_passes: int = 0
    polish_s: float = 0.0  # wall time from the first pass's planning to the sweep's end (the passes' tail latency)
    polish_plan_s: float = 0.0  # of which planning passes in the driver (the workers idle meanwhile)
    polish_build_s: float = 0.0  # worker time spent building (or loading) kernels during the passes
    polish_untimed: int = 0  # problems the passes left alone: their winner has no trial in the database (a
    # winners-only export; s35-r7 ran a polish spec on the shipped database and tried nothing)
    run_id: int = 0


def _retry_reporter(stats: SweepStats, report: Callable[[str], None]) -> Callable[[str], None]:
    """What a sweep's database transactions tell when one is run again after its server went away: counted in the
    stats and shown through the progress callback (a sweep's hours outlive a server's restart)."""
    def told(msg: str) -> None:
        stats.db_retries.append(msg)
        report(msg)
    return told


def fingerprint_for(backend: str, hw: HardwareSpec | None) -> Fingerprint:
    if backend == "simulated":
        if hw is None:
            raise HardwareError("the simulated backend needs a hardware spec")
        return hardware.simulated_fingerprint(hw)
    if backend == "cpu":
        return Fingerprint(f"CPU {platform.machine()}", "cpu", 0, 0, "none", "none", False)
    found = hardware.detect()
    if found is None:
        raise HardwareError("no CUDA GPU found: run on a GPU node, or use --simulate gb300")
    return found[0]


def arch_of(backend: str, hw: HardwareSpec | None, fp: Fingerprint) -> str | None:
    """The arch the sweep's kernels run on: the modelled one, the detected GPU's (compute capability 9.0 ->
    sm_90a), or none (the CPU test double)."""
    if backend == "simulated":
        return hw.arch
    if backend == "gpu":
        return "sm_" + fp.compute_capability.replace(".", "") + "a"
    return None


def blocked_on_builds(active: dict[int, ProblemSearch], built: Callable[[int, Candidate], bool]) -> bool:
    """No open search has a candidate to hand out now whose kernel is built (each waits on a result, or its next
    kernel is still compiling): an idle worker would wait on a build."""
    return not any(u is not None and built(pid, u) for pid, u in ((p, s.upcoming()) for p, s in active.items()))


def hand_out(active: dict[int, ProblemSearch], n_idle: int,
             built: Callable[[int, Candidate], bool] | None = None) -> list[tuple[int, Candidate]]:
    """Up to ``n_idle`` (problem id, candidate) pairs for idle workers, in claim order; where ``built`` says
    whether a candidate's kernel is compiled yet, a first pass hands out only those that are, so that a worker
    waits on a compile only when nothing compiled is left to measure. Each search still sees its own candidates
    handed out in its own order: only the interleaving across problems changes, never a problem's result."""
    out: list[tuple[int, Candidate]] = []
    for built_only in ((True, False) if built else (False,)):
        for pid, search in active.items():
            while len(out) < n_idle:
                if built_only:
                    up = search.upcoming()
                    if up is None or not built(pid, up):
                        break
                cand = search.next()
                if cand is None:
                    break
                out.append((pid, cand))
    return out


def warm_hardware(s: Session, db_name: str, name: str, fp: Fingerprint, hw_id: int) -> list[int]:
    """The hardware whose winners seed this sweep (``warm_from``): class key containing ``name``, not this sweep's
    own record, measured or simulated as it is, and of its compute capability (their kernels build and run here)."""
    rows = s.execute(select(Hardware.id, Hardware.class_key, Hardware.compute_capability, Hardware.simulated)
                     .where(Hardware.class_key.contains(name), Hardware.id != hw_id)).all()
    if not rows:
        raise ConfigError(f"--warm-from {name}: no other hardware of that name in {db_name}")
    ids = [r.id for r in rows if r.compute_capability == fp.compute_capability and r.simulated == fp.simulated]
    if not ids:
        kind = "simulated" if fp.simulated else "measured"
        raise ConfigError(f"--warm-from {name}: {rows[0].class_key} is not {kind} hardware of compute capability "
                          f"{fp.compute_capability}, as this sweep's {fp.name} is")
    return ids


def unmet_runs(db: Database, hw_id: int, label: Backend, backend: str, problems: list[plans.Problem],
               hardware: str | None = None) -> list[str]:
    """For the problems of ops that run other ops' tuned kernels (``OpDef.runs``), each lookup of those kernels
    (``run_lookups``) that has no current winner in ``db`` for this hardware (``hw_id``; its class key ``hardware``)
    and backend, as 'block problem -> dense problem'."""
    need = run_lookups(problems)
    digests = {op: op_digest(op, backend, hardware) for op in {q.op for q in need}}
    with db.session() as s:
        won = {key for key, op, digest in s.execute(
            select(ProblemRow.key, ProblemRow.op, Winner.op_digest).join(Winner, Winner.problem_id == ProblemRow.id)
            .where(Winner.hardware_id == hw_id, Winner.backend == label,
                   ProblemRow.key.in_([q.key for q in need]))) if digests.get(op) == digest}
    return [f"{p.key} -> {q.key}" for q, ps in need.items() if q.key not in won for p in ps]


def _merged(a: SweepStats, b: SweepStats) -> SweepStats:
    """Two phases' stats as one sweep's: counts and times added, lists joined, the first phase's start-up times and
    the second's run and last message kept."""
    out = SweepStats()
    for f in dataclasses.fields(SweepStats):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("workers_ready_s", "first_result_s", "pool_started_s"):
            v = x if x is not None else y
        elif f.name == "best_speedup":
            v = max((z for z in (x, y) if z is not None), default=None)
        elif f.name in ("run_id", "last"):
            v = y
        elif isinstance(x, dict):
            v = {**x, **y}
        else:
            v = x + y
        setattr(out, f.name, v)
    return out


def check_before_database(spec: SweepSpec, problems: list[plans.Problem], backend: str) -> None:
    """What a sweep can refuse before it makes a database (a bad K3TUNE_EXTRA_FAMILIES had left an empty one)."""
    check_backend(backend)
    check_whole_knobs(spec, problems, backend)


def check_whole_knobs(spec: SweepSpec, problems: list[plans.Problem], backend: str) -> None:
    """``[search] whole`` must name knobs that a kernel family of the problems declares: a misspelt one would try
    nothing, silently. The CLI calls this before it opens a database (the hardware not known yet: a family landed on
    any hardware counts); ``run_sweep`` again, once for all its phases."""
    if spec.search.whole:
        one_each = list({p.op: p for p in problems}.values())
        hws = [None, *sorted({key for keys in LANDED_ON.values() for key in keys})]
        declared = set().union(*(polish.declared_knobs(lambda p, hw=hw: families_for(p, backend, hardware=hw), one_each)
                                 for hw in hws))
        unknown = sorted(set(spec.search.whole) - declared)
        if unknown:
            raise ConfigError(f"spec {spec.name}: [search] whole names {', '.join(unknown)}, which no kernel family "
                              f"of its ops declares")


def run_sweep(opt: SweepOptions) -> SweepStats:
    t_start = time.monotonic()
    plan = opt.plan or plans.build(opt.spec, opt.model)  # once: the phases share it
    # over every phase's problems: a knob only the second phase's families declare is no misspelling in the first
    check_whole_knobs(opt.spec, [p for p in plan.problems if opt.only_ops is None or p.op in opt.only_ops],
                      opt.backend)
    phased = opt.phased if opt.phased is not None else opt.backend == "gpu"
    if opt.only_ops is None and phased:
        ops = {p.op for p in plan.problems if families_for(p, opt.backend)}
        later = frozenset(op for op in ops if plans.OPS[op].runs)
        if later and ops - later:  # the ops they run first, then them, against what the first phase stored
            added = added_for_blocks(plan, opt.backend)
            if added:
                plan = dataclasses.replace(plan, problems=sorted([*plan.problems, *added]))
                ops |= {q.op for q in added}
            first = _run_phase(dataclasses.replace(opt, only_ops=frozenset(ops - later)), plan, t_start)
            first.added_for_blocks = [q.key for q in added]
            progress = opt.progress and (lambda st: opt.progress(_merged(first, st)))
            second = _run_phase(dataclasses.replace(opt, only_ops=later, progress=progress), plan, time.monotonic())
            return _merged(first, second)
    return _run_phase(opt, plan, t_start)


def _run_phase(opt: SweepOptions, plan: plans.Plan, t_start: float) -> SweepStats:
    label = BACKEND_LABEL[opt.backend]
    stats = SweepStats()
    tunable: list[plans.Problem] = []
    for p in plan.problems:
        if not families_for(p, opt.backend):  # every phase reports them (the phases' stats merge)
            stats.skipped_ops[p.op] = f"no kernel family of {p.op} runs on the {opt.backend} backend yet"
        elif opt.only_ops is None or p.op in opt.only_ops:
            tunable.append(p)
    too_big = sorted({p["group"] for p in tunable if p.kind == "allreduce" and p["group"] > opt.workers})
    if too_big:  # a collective is measured on a group of its own size
        stats.skipped_ops["tp.allreduce"] = (f"groups of {', '.join(map(str, too_big))} GPUs need that many; "
                                             f"this sweep has {opt.workers}")
        tunable = [p for p in tunable if p.kind != "allreduce" or p["group"] <= opt.workers]
    if not tunable:
        raise ConfigError(f"nothing to tune on the {opt.backend} backend for spec {opt.spec.name}")
    backend_spec = ("simulated", opt.hw.key, opt.spec.search.seed) if opt.backend == "simulated" else (opt.backend,)
    procs = default_procs(opt.workers) if opt.compile_procs is None else opt.compile_procs
    procs = procs if opt.backend == "gpu" else 0
    worker_env = {"K3TUNE_WORKER_KERNEL_CACHE": "1"} if procs else {}  # workers load what the farm built
    runs_others = opt.backend == "gpu" and any(plans.OPS[p.op].runs for p in tunable)
    if runs_others:  # a measured block runs the dense kernels this sweep's database holds (its first phase's)
        worker_env["K3TUNE_SERVE_DB"] = opt.db.url
    pool = WorkerPool(opt.workers, backend_spec, opt.trial_timeout_s, pin_gpus=opt.backend == "gpu", env=worker_env)
    if not any(p.kind == "allreduce" for p in tunable):  # collectives come first, on these GPUs: not beside workers
        pool.start()  # now, while the database is set up: a worker's imports and CUDA start take seconds
        stats.pool_started_s = time.monotonic() - t_start
    # the farm's arch only after the workers' start (on a GPU current_arch starts CUDA in the driver: the pool
    # started 2.6-3.3 s late in the s11 H200 sweeps), and only for a farm (it imports torch: ~1.7 s)
    farm = CompileFarm(procs, current_arch() if procs else "")  # spawns on its first submit
    run_id = None
    try:
        fp = fingerprint_for(opt.backend, opt.hw)  # after the workers' start: on a GPU it starts CUDA here too
        arch = arch_of(opt.backend, opt.hw, fp)  # families with no code for it are never offered (gemm.wgmma on GB300)
        digests = {op: op_digest(op, opt.backend, fp.class_key) for op in {p.op for p in tunable}}
        fam_digests = {f.name: f.digest for f in [*FAMILIES.values(), *STAGED.values()]}  # by name: landed ones too
        method = method_digest(opt.backend)  # trials timed another way are neither reused nor overwritten

        with opt.db.session() as s:
            hw_id = records.hardware_id(s, fp)
            # before the run's record: a name it cannot use leaves nothing behind
            seed_hw = warm_hardware(s, opt.db.name, opt.warm_from, fp, hw_id) if opt.warm_from else []
            sw_id = records.software_id(s, records.software_versions())
            pids = records.problem_ids(s, tunable)
        if runs_others:  # before the run's record too: a refused sweep leaves no run behind
            gaps = unmet_runs(opt.db, hw_id, label, opt.backend, [p for p in tunable if plans.OPS[p.op].runs],
                              fp.class_key)
            if gaps:
                raise ConfigError(f"{len(gaps)} lookups of the dense kernels the MoE block runs have no current "
                                  f"winner in {opt.db.path or 'the database'} (first: {gaps[0]}): sweep those ops "
                                  "into it first (on an H200: --spec configs/sweep_h200_dense.toml, the same --db)")
        with opt.db.session() as s:
            run = records.start_run(s, command=opt.command, backend=label, hw_id=hw_id, sw_id=sw_id,
                                    spec_digest=opt.spec.digest())
            run_id, owner = run.id, run.owner
        wanted = {pids[p]: digests[p.op] for p in tunable}
        by_id = {pids[p]: p for p in tunable}
        with opt.db.session() as s:
            records.plan_claims(s, hw_id, label, wanted)
            records.release_dead_local_claims(s, hw_id, label)
            records.end_dead_local_runs(s)
            stats.problems_total = len(wanted)
            stats.problems_done_before = len(wanted) - records.remaining(s, hw_id, label, wanted)
    except BaseException as e:
        pool.close()
        farm.close()
        if run_id is not None:  # recorded, then the database failed (or ^C): the run is not left 'running'
            _end_run(opt.db, run_id, None, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        raise
    stats.run_id = run_id

    def report(msg: str = "") -> None:
        stats.last = msg or stats.last
        stats.seconds = time.monotonic() - t_start
        if opt.progress:
            opt.progress(stats)

    db_retry = _retry_reporter(stats, report)
    near = Neighbours(opt.db, hw_id, label, seed_hw, by_id, opt.spec.search,
                      lambda p: families_for(p, opt.backend, arch, fp.class_key), db_retry)

    active: dict[int, ProblemSearch] = {}
    incumbent: dict[int, tuple[str, dict]] = {}  # polished problems: the search's choice before polishing
    polished_ids: set[int] = set()
    task_of: dict[int, tuple[int, Candidate]] = {}
    next_task = 0
    status = "failed"
    # problems searched at once: each has at most one candidate the farm builds ahead (its next TPE sample), so
    # with fewer open problems than farm processes the farm idles while workers wait on builds (a 2-GPU dense
    # sweep: a third of each worker's time inside builds, with 29 farm processes and 4 open problems)
    target_active = max(4, 2 * opt.workers, farm.procs)
    last_renew = time.monotonic()

    def built(pid: int, cand: Candidate) -> bool:
        farm.submit(by_id[pid], cand.family, cand.params)  # a fresh TPE sample: its build starts now
        return farm.ready(by_id[pid], cand.family, cand.params)

    def open_search(pid: int) -> ProblemSearch:
        p = by_id[pid]
        fams = near.families(p)
        stored = opt.db.transact(lambda s: records.stored_trials(
            s, hw_id, pid, {f.name: fam_digests[f.name] for f in fams}, method), db_retry)
        search = ProblemSearch(p, fams, opt.spec.search, seed=opt.spec.search.seed + pid, stored=stored,
                               warm=near.warm(p), tpe=not near.polishing)
        if not near.polishing:  # a polish pass re-reads the trials its search just stored
            stats.reused += len(stored) - len(search.refused)
        stats.refused.extend(search.refused)
        return search

    def finish(pid: int, search: ProblemSearch) -> None:
        d = search.decision
        p = by_id[pid]

        def store(s: Session) -> None:
            if d.family:
                records.save_winner(s, hardware_id=hw_id, problem_id=pid, op_digest=digests[p.op], backend=label,
                                    family=d.family, family_digest=fam_digests[d.family], params=d.params,
                                    median_us=d.median_us, spread_us=d.spread_us, default_us=d.default_us,
                                    ties=d.ties, trials=d.trials, run_id=run_id, origin="", method=method)
            records.finish_claim(s, hw_id, label, pid, wanted[pid])

        opt.db.transact(store, db_retry)
        if not d.family:
            stats.no_winner.append(p.key)
        elif d.default_us:
            sp = d.default_us / d.median_us
            stats.best_speedup = max(stats.best_speedup or 0.0, sp)
        # no warm start from winners found during this run: which neighbours finish first depends on the
        # number of workers, and the winners must not (a 1-GPU and an N-GPU sweep choose the same kernels)
        stats.problems_done += not near.polishing
        report(f"{p.key}: {d.family or 'no correct candidate'} {d.median_us:.2f} us")

    try:
        near.load()  # inside: a database that fails here still closes the pool and ends the run
        coll = {pid: d for pid, d in wanted.items() if by_id[pid].kind == "allreduce"}
        if coll:  # collectives first, on a group of this sweep's GPUs (no one-GPU worker can run them)
            got = opt.db.transact(lambda s: records.claim(s, hw_id, label, owner, coll, len(coll), opt.lease_s,
                                                          held=set()), db_retry)
            if got:
                _tune_collectives([by_id[pid] for pid in got], pids, opt, hw_id, run_id, label, digests, stats, report)
            wanted = {pid: d for pid, d in wanted.items() if pid not in coll}
        wanted_all, passes = dict(wanted), opt.spec.search.polish
        polish_start = 0.0  # monotonic time the first polish pass was planned
        planner = polish.Planner(opt.db, hw_id, label, opt.spec.search, near.families, fam_digests, method,
                                 near.warm, db_retry)
        if not wanted:
            pool.close()  # nothing left to measure (the workers were started early, in vain)
        with pool:
            if stats.pool_started_s is None:
                stats.pool_started_s = time.monotonic() - t_start
            while True:  # the search, then polish passes until no neighbour's winner is left untried
                # while the workers start: every problem's known candidates to the farm, in claim order
                farm.submit_known([by_id[pid] for pid in wanted], opt.backend, opt.spec.search, near.warm, fp.class_key)
                while True:
                    if len(active) < target_active:
                        got = opt.db.transact(lambda s: records.claim(
                            s, hw_id, label, owner, wanted, target_active - len(active), opt.lease_s, held=set(active)),
                            db_retry)
                        for pid in got:
                            active[pid] = open_search(pid)
                            if active[pid].finished:
                                finish(pid, active.pop(pid))
                    if not active:
                        left = opt.db.transact(lambda s: records.remaining(s, hw_id, label, wanted), db_retry)
                        if left == 0 or not opt.wait_for_others:
                            break
                        report(f"waiting: {left} problems claimed by other sweeps")
                        time.sleep(min(5.0, opt.lease_s / 4))
                        continue
                    idle = pool.idle()
                    room = target_active + farm.procs - len(active)
                    if idle and farm.procs and room > 0 and blocked_on_builds(active, built):
                        # every open problem waits on a build (the start of a sweep, session 9: a third of the
                        # 2-GPU workers' first 40 s): open more, whose first candidate (cuBLAS) needs none
                        got = opt.db.transact(lambda s: records.claim(
                            s, hw_id, label, owner, wanted, min(room, len(idle)), opt.lease_s, held=set(active)),
                            db_retry)
                        for pid in got:
                            active[pid] = open_search(pid)
                        stats.opened_early += len(got)
                    if idle:
                        for pid, cand in hand_out(active, len(idle), built if farm.procs else None):
                            next_task += 1
                            task_of[next_task] = (pid, cand)
                            pool.submit(idle.pop(), Task(next_task, by_id[pid], cand.family, cand.params, cand.round,
                                                         active[pid].samples_for(cand)))
                        for pid, search in list(active.items()):
                            if search.ahead is not None:  # compiled on spare cores while the current one is measured
                                farm.submit(by_id[pid], search.ahead.family, search.ahead.params)
                            if search.finished:
                                finish(pid, active.pop(pid))
                    farm.top_up()  # known candidates of later problems, as builds finish
                    results = pool.poll(timeout=0.5)
                    if stats.workers_ready_s is None and pool.all_ready():
                        stats.workers_ready_s = time.monotonic() - t_start
                        stats.worker_startup = pool.startup()
                    if results and stats.first_result_s is None:
                        stats.first_result_s = time.monotonic() - t_start
                    stats.workers_replaced = pool.replaced
                    stats.worker_busy_s, stats.worker_busy_cpu_s = pool.busy_s, pool.busy_cpu_s
                    stats.workers_retired = list(pool.retired)
                    batch: list[records.TrialRecord] = []
                    for task, outcome in results:
                        pid, cand = task_of.pop(task.task_id)
                        batch.append(records.TrialRecord(
                            problem_id=pid, family=cand.family, family_digest=fam_digests[cand.family],
                            params=cand.params, params_key=cand.key, round=cand.round, status=TrialStatus(outcome.status),
                            median_us=outcome.median_us, spread_us=outcome.spread_us, samples=outcome.samples,
                            compile_s=outcome.compile_s, error=outcome.error,
                            routing=str(by_id[pid].get("routing")) if by_id[pid].get("routing") else None,
                            method=method))
                        stats.trials += 1
                        stats.failed += outcome.status != "ok"
                        stats.worker_build_s += outcome.compile_s or 0.0
                        if near.polishing:
                            stats.polish_build_s += outcome.compile_s or 0.0
                    if batch:
                        opt.db.transact(lambda s: records.record_trials(s, run_id, hw_id, label, batch), db_retry)
                        for (_, outcome), rec in zip(results, batch, strict=True):
                            active[rec.problem_id].tell(Candidate(rec.family, rec.params, rec.params_key, rec.round),
                                                        outcome.status, outcome.median_us, outcome.spread_us)
                        report()
                    if time.monotonic() - last_renew > opt.lease_s / 3:
                        opt.db.transact(lambda s: records.renew_claims(s, owner, opt.lease_s), db_retry)
                        last_renew = time.monotonic()
                if passes <= 0:
                    break
                passes -= 1
                t_plan = time.monotonic()
                polish_start = polish_start or t_plan
                near.load()  # now with every winner of this run
                near.polishing = True
                wanted = (planner.open_pass(set(wanted_all))
                          or planner.plan({pid: by_id[pid] for pid in wanted_all}, wanted_all))
                stats.polish_plan_s += time.monotonic() - t_plan
                if not wanted:
                    break
                for pid, w in polish.current_winners(opt.db, hw_id, label, {
                        pid: wanted_all[pid] for pid in set(wanted) - set(incumbent)}, db_retry).items():
                    incumbent[pid] = w  # what the search chose, before any polish pass
                opt.db.transact(lambda s: records.plan_claims(s, hw_id, label, wanted), db_retry)
                polished_ids.update(wanted)
                stats.polished = len(polished_ids)  # distinct problems: a later pass may take one up again
                stats.polish_passes += 1
            stats.polish_untimed = len(planner.untimed)
            stats.polish_changed = sum(1 for pid, w in polish.current_winners(opt.db, hw_id, label, {
                pid: wanted_all[pid] for pid in incumbent}, db_retry).items() if incumbent[pid] != w)
            if polish_start:
                stats.polish_s = time.monotonic() - polish_start
        status = "done"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        farm.close()
        pool.close()
        _end_run(opt.db, run_id, None if status == "done" else owner, status)
    report("done")
    return stats


def _end_run(db: Database, run_id: int, release_owner: str | None, status: str) -> None:
    """Record how the run ended, and give back the claims ``release_owner`` holds (a run that did not finish). The
    database itself may be what failed: then nothing is recorded, and the error that ended the run is the one
    raised."""
    try:
        with db.session() as s:
            if release_owner:
                records.release_claims(s, release_owner)
            records.end_run(s, run_id, status)
    except Exception:
        pass


def _tune_collectives(problems: list[plans.Problem], pids: dict, opt: SweepOptions, hw_id: int, run_id: int,
                      label: Backend, digests: dict, stats: SweepStats, report) -> None:
    """Every variant of every collective problem, measured on a group of ``group`` GPUs (the space is a
    handful of variants: measured exhaustively); trials and winners recorded like any other problem's."""
    from k3tune.kernels import params_key
    from k3tune.search import measure_collective

    for group in sorted({p["group"] for p in problems}):
        items = [(p, families_for(p, opt.backend)[0]) for p in problems if p["group"] == group]
        params = {p: {params_key(c.params()): c.params() for c in fam.configs(p)} for p, fam in items}
        report(f"measuring {len(items)} collective problems on a group of {group} GPUs")
        results = measure_collective.measure([(p, list(params[p].values())) for p, _ in items], group,
                                             samples=opt.spec.search.samples, deadline_s=opt.trial_timeout_s)
        for p, fam in items:
            pid = pids[p]
            outs = {key: results[(p.key, key)] for key in params[p]}
            default = params_key(fam.default_config(p).params())
            win = measure_collective.fastest(outs, list(outs))

            def store(s: Session) -> None:
                records.record_trials(s, run_id, hw_id, label, [records.TrialRecord(
                    problem_id=pid, family=fam.name, family_digest=fam.digest, params=params[p][key], params_key=key,
                    round=0, status=TrialStatus(o.status), median_us=o.median_us, spread_us=o.spread_us,
                    samples=o.samples, error=o.error, method=method_digest("collective")) for key, o in outs.items()])
                if win is not None:
                    records.save_winner(s, hardware_id=hw_id, problem_id=pid, op_digest=digests[p.op], backend=label,
                                        family=fam.name, family_digest=fam.digest, params=params[p][win],
                                        median_us=outs[win].median_us, spread_us=outs[win].spread_us,
                                        default_us=outs[default].median_us if outs[default].status == "ok" else None,
                                        ties=[], trials=len(outs), run_id=run_id, origin="",
                                        method=method_digest("collective"))
                records.finish_claim(s, hw_id, label, pid, digests[p.op])

            opt.db.transact(store, _retry_reporter(stats, report))
            stats.trials += len(outs)
            stats.failed += sum(o.status != "ok" for o in outs.values())
            stats.problems_done += 1
            if win is None:
                stats.no_winner.append(p.key)
            report(f"{p.key}: {params[p][win]['variant'] if win else 'no correct variant'}")
