"""`k3tune lookup`: what the runtime selector serves for every op of one deployment, and why."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from k3tune import settings
from k3tune.cli.common import ConfigOption, JsonOption, SpecOption, console, print_json, require_db
from k3tune.errors import DatabaseError
from k3tune.plan import hardware as hw, model as models, spec as specs
from k3tune.runtime import Selector
from k3tune.runtime.selector import measured_fingerprint, unusable
from k3tune.store.db import open_for_serving, shown_url

LOCAL_DB = Path("k3tune.sqlite")  # relative: the working directory's, as `k3tune sweep` writes it


def _local_db(simulate: str | None, hardware: str | None) -> tuple[str | None, str | None]:
    """./k3tune.sqlite where it holds winners of the hardware served, else None (the shipped table) and why: a
    simulated sweep's file left in the working directory had an H200's lookups served heuristic defaults instead of
    the shipped H200 table. Simulated winners are in no shipped table: for --simulate the file is always used."""
    if simulate:
        return str(LOCAL_DB), None
    if hardware:
        name = hw.spec(hardware).name
    else:
        found = hw.detect()
        if not found:  # no GPU and no --hardware: nothing is served from a shipped table either
            return str(LOCAL_DB), None
        name = found[0].name
    try:
        found, why = measured_fingerprint(str(LOCAL_DB), name)
    except DatabaseError as e:
        found, why = None, unusable(e)
    if found is not None:
        return str(LOCAL_DB), None
    return None, f"./{LOCAL_DB} not used ({why}); --db {LOCAL_DB} uses it"


def lookup(
    tp: Annotated[int, typer.Option(help="Tensor parallel size.")],
    batch: Annotated[int, typer.Option(help="Decode batch, 1-64.")],
    draft: Annotated[int, typer.Option(help="Speculative draft length, 0-7.")] = 0,
    dcp: Annotated[int, typer.Option(help="Decode context parallel size (divides tp).")] = 1,
    context: Annotated[int | None, typer.Option(help="Context length for attention (default: the largest bucket).")] = None,
    db: Annotated[str | None, typer.Option("--db", help="Tuning database (default: $K3TUNE_DB, else ./k3tune.sqlite where "
                                                         "it holds the served hardware's winners, else the shipped one "
                                                         "for the GPU).")] = None,
    simulate: Annotated[str | None, typer.Option("--simulate", help="Serve the simulated winners of this hardware (e.g. gb300; "
                                                 "bare --simulate: the detected or configured hardware).")] = None,
    hardware: Annotated[str | None, typer.Option("--hardware", help="Serve the measured winners of this GPU (e.g. h200) from --db, "
                                                 "else from the database shipped for it: to inspect one on another machine.")] = None,
    spec: SpecOption = None,
    config: ConfigOption = None,
    json: JsonOption = False,
) -> None:
    """Print the chosen kernel and knobs for every op of the decode layer, with where each came from.

    Examples:
      k3tune lookup --tp 16 --batch 8 --draft 6 --dcp 1 --simulate gb300   (after k3tune sweep --simulate gb300)
      k3tune lookup --tp 16 --batch 1 --db tuning_db/h200.sqlite --hardware h200
    """
    specs.validate_deployment_values(tp, batch, dcp, draft)
    if simulate is not None:  # a bare --simulate ('auto') is the detected or configured hardware, as for the sweep
        simulate = hw.resolve_simulated(simulate, settings.load().hardware).key
    sp = specs.load(spec)
    db = db or settings.load().db  # named (--db or $K3TUNE_DB): a typo, or a file that is no tuning database,
    if db is not None:  # must not serve heuristic defaults behind a warning; an older schema is served (with a note)
        handle, _ = open_for_serving(require_db(db))
        handle.dispose()
    skipped = None
    if db is None and LOCAL_DB.is_file():  # what `k3tune sweep` wrote, where it holds the hardware's winners
        db, skipped = _local_db(simulate, hardware)
    # the selector also logs its warnings (for a server's log): here they are printed below the table, once
    quiet = logging.NullHandler()
    log = logging.getLogger("k3tune.runtime")
    log.addHandler(quiet)
    try:
        sel = Selector.load(db, simulated=simulate, measured_on=hardware, spec=sp,
                            model=models.load(config or sp.model_config_path()))
        if db is not None and sel.unread:  # opened, then a damaged page: an error too, as an unopenable file is
            raise DatabaseError(sel.unread)
        choices = sel.layer(tp, batch, draft, dcp, context)
        if skipped:
            sel.warnings.insert(0, skipped)
    finally:
        log.removeHandler(quiet)
    bucket = sel.context_bucket(context)  # the one MLA's choices are served from
    shown = shown_url(db) if db and "://" in db else db or "shipped"  # a URL's password stays out of the output
    if json:
        print_json({"deployment": dict(tp=tp, batch=batch, draft=draft, dcp=dcp, context=context or bucket,
                                       context_bucket=bucket),
                    "db": shown, "table_hash": sel.hash, "warnings": sel.warnings, "ops": [c.as_dict() for c in choices.values()]})
        return
    t = Table(title=f"tp {tp} batch {batch} draft {draft} dcp {dcp} "
              f"context {context or bucket}{'' if context in (None, bucket) else f' (bucket {bucket})'} "
              f"(db {escape(shown)}, table {sel.hash})")
    for name in ("op", "kernel"):  # names whole on a narrow terminal: the knobs wrap instead
        t.add_column(name, no_wrap=True)
    t.add_column("knobs")
    t.add_column("source")
    t.add_column("time us", no_wrap=True)
    for c in choices.values():
        knobs = " ".join(f"{k}={v}" for k, v in c.params) or "-"
        t.add_row(c.op, c.family, escape(knobs), escape(c.source), f"{c.median_us:.2f}" if c.median_us else "-")
    console.print(t)
    for w in sel.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
