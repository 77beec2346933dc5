"""`k3tune sweep`: tune the deployment matrix on this machine's GPUs (or a simulated GPU)."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from k3tune import settings
from k3tune.cli.common import (ConfigOption, DbOption, JsonOption, SpecOption, console, db_target, err_console,
                               print_json, refuse_shipped)
from k3tune.errors import ConfigError, HardwareError
from k3tune.plan import hardware, model as models, problems, spec as specs
from k3tune.search.compile_farm import usable_cores
from k3tune.search.driver import SweepOptions, SweepStats, check_before_database, run_sweep
from k3tune.store.db import interrupts_between_sessions, open_db


def _visible_gpus() -> int:
    found = hardware.detect()
    if found is None:
        return 0
    import torch

    return torch.cuda.device_count()


MIN_LEASE_S = 10.0
MAX_WAIT_S = 7 * 86400.0  # a week: the longest trial timeout or claim lease a sweep takes
MAX_SIMULATED_WORKERS = 72  # one GB300 NVL72 domain; each worker is a process, so a typo (1600) would start 1600
LOG_EVERY_S = 60.0  # piped or redirected output: seconds between progress lines


def sweep(
    gpus: Annotated[int | None, typer.Option("--gpus", help="Worker processes, one per GPU (default: all visible GPUs).")] = None,
    simulate: Annotated[str | None, typer.Option("--simulate",
                                                  help="Use the analytic roofline backend for this hardware "
                                                       "(gb300, b200, h200, h100); bare --simulate: the detected "
                                                       "or configured hardware. Records say 'simulated'.")] = None,
    db: DbOption = None,
    spec: SpecOption = None,
    config: ConfigOption = None,
    trial_timeout: Annotated[float, typer.Option(help="Seconds before a hung candidate is killed (costs one trial).")] = 120.0,
    lease: Annotated[float, typer.Option(help="Seconds a claimed problem stays ours without renewal (scale-out).")] = 300.0,
    wait: Annotated[bool, typer.Option(help="Wait for problems other machines have claimed, taking over expired ones.")] = True,
    compile_procs: Annotated[int | None, typer.Option(help="CPU processes compiling queued candidates ahead into the "
                                                           "shared kernel cache (GPU sweeps; 0: each worker compiles "
                                                           "its own; default: the free cores, at most 8 per GPU).")] = None,
    warm_from: Annotated[str | None, typer.Option(help="Start each problem from the winner another GPU kind of this "
                                                       "arch has in the database (a name, e.g. 'H200'; its "
                                                       "`k3tune db merge`d table), where this GPU has none yet.")] = None,
    json: JsonOption = False,
) -> None:
    """Tune every problem of the deployment matrix and store every trial and the winners.

    Interrupt it at any time; running the same command again resumes where it stopped.

    Examples:
      k3tune sweep --gpus 16
      k3tune sweep --gpus 16 --simulate gb300
      k3tune sweep --db postgresql://tuner@db-host/k3tune   # several machines, one sweep
      k3tune sweep --db h100.sqlite --warm-from H200        # h100.sqlite: a copy of tuning_db/h200.sqlite
    """
    sp = specs.load(spec)
    model = models.load(config or sp.model_config_path())
    plan = problems.build(sp, model)  # an unknown op or a tp the widths do not divide: before any database or worker
    hw = None
    if simulate is not None:
        backend = "simulated"
        hw = hardware.resolve_simulated(simulate, settings.load().hardware)
        workers = 1 if gpus is None else gpus
        if workers > MAX_SIMULATED_WORKERS:
            raise ConfigError(f"--gpus {workers} with --simulate starts that many worker processes; "
                              f"at most {MAX_SIMULATED_WORKERS} (one NVL72 domain)")
    else:
        backend = "gpu"
        visible = _visible_gpus()
        if visible == 0:
            raise HardwareError("no CUDA GPU found: run on a GPU node, or add --simulate gb300")
        workers = visible if gpus is None else gpus
        if workers > visible:
            raise HardwareError(f"--gpus {workers} asked for, but only {visible} GPU(s) are visible")
    if workers < 1:
        raise ConfigError("--gpus must be at least 1")
    if compile_procs is not None and compile_procs < 0:
        raise ConfigError("--compile-procs must be 0 or more")
    if compile_procs is not None and compile_procs > usable_cores():  # each holds a compiler: 10^5 of them were
        # started as asked, and the machine ran out of memory long before any compile ended
        raise ConfigError(f"--compile-procs {compile_procs} is more than the {usable_cores()} CPU cores this process "
                          "may use")
    # (not: NaN too) a zero timeout would kill every candidate as hung; an endless one lets a hung kernel stop the sweep
    if not 0 < trial_timeout <= MAX_WAIT_S:
        raise ConfigError(f"--trial-timeout must be more than 0 and at most {MAX_WAIT_S:.0f} seconds, "
                          f"not {trial_timeout}")
    # claims renew every lease / 3: shorter, another machine takes live problems over; an endless one (inf crashed)
    # would keep a dead machine's problems from every other
    if not MIN_LEASE_S <= lease <= MAX_WAIT_S:
        raise ConfigError(f"--lease must be at least {MIN_LEASE_S:.0f} and at most {MAX_WAIT_S:.0f} seconds, "
                          f"not {lease}")
    check_before_database(sp, plan.problems, backend)
    target = db_target(db)
    refuse_shipped(target, "sweep into another database and `k3tune db export` it there")
    if warm_from and "://" not in target and not Path(target).exists():  # else an empty file is left behind
        raise ConfigError(f"--warm-from {warm_from}: {target} does not exist; it seeds from another GPU's winners in "
                          "the database swept into (e.g. a copy of tuning_db/h200.sqlite)")
    database = open_db(target)
    # the run's record is copied into exports: a URL's password stays out of it
    argv = [a.replace(target, database.name) for a in sys.argv[1:]] if database.path is None else sys.argv[1:]
    command = "k3tune " + " ".join(shlex.quote(a) for a in argv)
    label = f"simulated {hw.key}" if hw else "measured"
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=console, disable=json, transient=False) as progress:
        task = progress.add_task(f"sweep ({label}, {workers} workers)", total=None, info="starting workers")

        retries_shown = [0]
        # piped or redirected (a batch job's log), rich draws no bar until the end: a line every LOG_EVERY_S instead
        log_lines = not json and not progress.console.is_terminal
        next_line = [time.monotonic() + LOG_EVERY_S]

        def on_progress(st: SweepStats) -> None:
            for msg in st.db_retries[retries_shown[0]:]:  # the sweep waits on its database server: say so
                (err_console if json else progress.console).print(f"[yellow]warning:[/] {escape(msg)}")
            retries_shown[0] = len(st.db_retries)
            best = f" best {st.best_speedup:.2f}x vs default" if st.best_speedup else ""
            done = st.problems_done_before + st.problems_done
            progress.update(task, total=st.problems_total, completed=done,
                            info=f"problems, {st.trials} trials, {st.failed} failed{best}")
            if log_lines and time.monotonic() >= next_line[0]:
                next_line[0] = time.monotonic() + LOG_EVERY_S
                progress.console.print(f"progress: {done}/{st.problems_total} problems, {st.trials} trials, "
                                       f"{st.failed} failed{best}, {st.seconds:.0f} s", highlight=False)

        try:
            with interrupts_between_sessions():  # Ctrl-C or a scheduler's SIGTERM: a clean stop
                stats = run_sweep(SweepOptions(sp, model, database, backend, workers, hw=hw,
                                               trial_timeout_s=trial_timeout, lease_s=lease, wait_for_others=wait,
                                               command=command, progress=on_progress, compile_procs=compile_procs,
                                               plan=plan, warm_from=warm_from))
        finally:
            database.close()  # SQLite's WAL file folded into the database file
    summary = {"database": database.name, "backend": label, "run_id": stats.run_id,
               "problems": stats.problems_total, "already_done": stats.problems_done_before,
               "tuned_now": stats.problems_done, "trials": stats.trials, "failed_trials": stats.failed,
               "reused_trials": stats.reused, "polished": stats.polished, "polish_changed": stats.polish_changed,
               "polish_passes": stats.polish_passes, "polish_s": round(stats.polish_s, 1),
               "polish_plan_s": round(stats.polish_plan_s, 1), "polish_build_s": round(stats.polish_build_s, 1),
               "polish_untimed": stats.polish_untimed,
               "workers_replaced": stats.workers_replaced, "database_retries": len(stats.db_retries),
               "workers_retired": stats.workers_retired,
               "added_for_blocks": stats.added_for_blocks, "no_winner": stats.no_winner,
               "refused_stored_trials": stats.refused, "skipped_ops": stats.skipped_ops,
               "seconds": round(stats.seconds, 1)}
    if json:
        print_json(summary)
        return
    console.print(f"{stats.problems_done} problems tuned now, {stats.problems_done_before} already done, "
                  f"{stats.trials} trials ({stats.failed} failed, {stats.workers_replaced} workers replaced) "
                  f"in {stats.seconds:.1f} s -> {escape(str(summary['database']))}")
    if stats.polish_passes:
        console.print(f"polish: {stats.polish_passes} passes tried neighbours' winners on {stats.polished} problems; "
                      f"{stats.polish_changed} chose another kernel ({stats.polish_s:.1f} s, planning "
                      f"{stats.polish_plan_s:.1f} s)")
    if stats.polish_untimed:
        console.print(f"[yellow]polish: {stats.polish_untimed} problems left alone[/]: their winners have no trial in "
                      "this database (a winners-only export, or timed another way), so nothing can be compared with "
                      "them; `k3tune db redo DB PATTERN` has the next sweep decide them again")
    for r in stats.refused[:10]:
        console.print(f"[yellow]refused stored trial outside the declared space:[/] {escape(str(r))}")
    if stats.added_for_blocks:
        console.print(f"also tuned: {len(stats.added_for_blocks)} dense problems the spec does not list, which its MoE "
                      f"blocks run (first: {escape(stats.added_for_blocks[0])})", highlight=False)
    for op, why in stats.skipped_ops.items():
        console.print(f"[yellow]skipped[/] {escape(op)}: {escape(str(why))}")
    for why in stats.workers_retired:
        console.print(f"[yellow]retired {escape(str(why))}[/]: its GPU was given up, the sweep went on without it")
    if stats.no_winner:
        console.print(f"[red]{len(stats.no_winner)} problems had no correct candidate[/] (heuristic defaults serve them)")
    if stats.problems_done:
        console.print(f"what it bought: k3tune db report {escape(shlex.quote(str(summary['database'])))}")
