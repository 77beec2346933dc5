"""`k3tune db ...`: inspect, verify, export, merge, diff, redo and upgrade tuning databases."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Column, Table

from k3tune.cli.common import (ConfigOption, JsonOption, SpecOption, console, db_target, print_json, refuse_shipped,
                               require_db)
from k3tune.errors import ConfigError, DatabaseError
from k3tune.plan import model as models, problems as plans, spec as specs
from k3tune.store import db as store_db
from k3tune.store import inspect, redo as redos, report as reports, transfer

app = typer.Typer(no_args_is_help=True, help="Inspect and maintain tuning databases.")
DbArg = Annotated[str | None, typer.Argument(help="SQLite path or SQLAlchemy URL (default: $K3TUNE_DB or ./k3tune.sqlite).")]


def _open(target: str | None, **kw) -> store_db.Database:
    return store_db.open_db(db_target(target), create=False, **kw)


@app.command()
def show(db: DbArg = None, json: JsonOption = False) -> None:
    """Summarise a database: hardware, runs, trials by status, winners by op and by timing method.

    Example: k3tune db show tuning_db/h200.sqlite
    """
    info = inspect.show(_open(db, readonly=True))
    if json:
        print_json(info)
        return
    console.print(f"[bold]{escape(str(info['database']))}[/] schema {info['schema']}: {info['problems']} problems")
    for h in info["hardware"]:
        console.print(f"  hardware: {escape(h['name'])} cc {h['cc']} {h['sms']} SMs{' (simulated)' if h['simulated'] else ''}")
    trials = info["trials"]
    console.print("  trials: " + (", ".join(f"{n} {status}" for status, n in sorted(trials.items()))
                                  or "none (a winners-only export)"))
    by_method = sorted(info["winners_by_method"].items(), key=lambda kv: -kv[1])
    console.print("  winners by timing method: " + (", ".join(f"{n} {m}" for m, n in by_method) or "none"))
    t = Table("op", "winners")
    for op, n in sorted(info["winners_by_op"].items()):
        t.add_row(op, str(n))
    console.print(t)
    for r in info["runs"][-5:]:
        status = escape(f"[{r['status']}]")  # unescaped, '[done]' was read as a style tag and vanished
        console.print(f"  run {r['id']} {status} {r['backend']} on {escape(r['host'])}: {escape(r['command'])}")


@app.command()
def report(db: DbArg = None,
           plot: Annotated[str | None, typer.Option(help="Also draw the speedups to this image file (PNG, SVG, PDF; "
                                                         "needs the 'report' extra: matplotlib).")] = None,
           json: JsonOption = False) -> None:
    """What tuning bought: each current winner's speedup over the safe baseline (cuBLAS, the stock MoE block) timed
    in the same sweep, by op and token count, per hardware (measured or simulated). Stale winners are left out.

    Example: k3tune db report tuning_db/h200.sqlite --plot h200.png
    """
    data = reports.report(_open(db, readonly=True))
    if plot:
        data["plot"] = str(reports.plot(data, plot))
    if json:
        print_json(data)
        return
    if not data["hardware"]:
        console.print("no current winners")
    for hw in data["hardware"]:
        label = hw["backend"]  # measured or simulated
        stale = f", {hw['stale_left_out']} stale left out" if hw["stale_left_out"] else ""
        console.print(f"[bold]{escape(hw['hardware'])}[/] ({label}): {hw['winners']} current winners{stale}")
        sizes = sorted({m for op in hw["ops"] for r in op["rows"] for m in r["cells"]})
        # narrow text columns fold rather than cut (rows differ in the problem's tail: mla.decode's ctx=…); the
        # numbers are what the table is for and keep their width
        t = Table(*(Column(h, overflow="fold") for h in ("op", "problem", "baseline")),
                  *(Column(h, no_wrap=True, min_width=4) for h in (*map(str, sizes), "geomean")),
                  title="speedup over the safe baseline, by tokens per step")
        for op in hw["ops"]:
            for r in op["rows"]:
                cells = [r["cells"].get(m) for m in sizes]
                t.add_row(op["op"], escape(r["label"] or "-"), r["baseline"],
                          *("" if c is None else "-" if not c["speedup"] else f"{c['speedup']:.2f}" for c in cells),
                          f"{r['geomean']:.2f}" if r["geomean"] else "-")
        console.print(t)
        for op in hw["ops"]:
            kernels = ", ".join(f"{k} {n}" for k, n in op["kernels"].items())
            mean = f"{op['geomean']:.2f}x" if op["geomean"] else "-"
            console.print(f"  {op['op']}: {mean} geomean; won by {escape(kernels)}")
    if data["stale_left_out_elsewhere"]:
        console.print(f"{data['stale_left_out_elsewhere']} stale winners of hardware with no current one left out")
    if plot:
        console.print(f"plot: {escape(data['plot'])}")


@app.command()
def verify(db: DbArg = None, spec: SpecOption = None, config: ConfigOption = None, json: JsonOption = False) -> None:
    """Check integrity, schema version, staleness against the current kernels and coverage of a sweep spec.
    Exits non-zero when anything is wrong.

    Example: k3tune db verify k3tune.sqlite --spec smoke
    """
    sp = specs.load(spec)
    plan = plans.build(sp, models.load(config or sp.model_config_path()))
    require_db(db_target(db))  # a missing file is bad input, not a verdict on a database
    try:
        v = inspect.verify(store_db.open_db(db_target(db), create=False, readonly=True, check_schema=False), plan)
    except DatabaseError as e:  # unreadable (corrupt, truncated): that is the verdict
        v = inspect.Verification([str(e)], None, False)
    if json:
        print_json(v.as_dict())
    else:
        schema = (f"schema {v.schema} ({'current' if v.schema_ok else 'needs k3tune db upgrade'})" if v.readable
                  else "schema not read")  # an unreadable file is no case for an upgrade
        console.print(f"integrity: {escape(', '.join(v.integrity)) or 'n/a'}; {schema}; {v.winners} winners")
        by_op = ", ".join(f"{op} {n}" for op, n in sorted(v.stale_by_op.items()))
        console.print(f"stale winners: {len(v.stale)}{f' ({by_op})' if by_op else ''}; "
                      f"parameters outside the space: {len(v.out_of_space)}")
        for cell, ids in v.unreadable.items():  # not JSON, or not the JSON type the column holds
            shown = ", ".join(map(str, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
            console.print(f"unreadable {cell} in {len(ids)} row{'s' if len(ids) > 1 else ''}: id {shown}")
        for hw, c in v.coverage.items():
            console.print(f"coverage of spec {escape(sp.name)} on {escape(hw)}: {c['covered']}/{c['total']}")
        partial = any(c["covered"] < c["total"] for c in v.coverage.values())
        swept = _spec_names(v.swept_specs, v.swept_spec_args)
        if partial and swept and sp.digest() not in v.swept_specs:  # checked against a spec it was not swept with
            console.print(f"note: this database was swept with spec{'s' if len(swept) > 1 else ''} "
                          f"{escape(', '.join(swept))}: `--spec NAME` checks the coverage of one of them")
        console.print("[green]OK[/]" if v.ok else "[red]NOT OK[/]")
    if not v.ok:
        raise typer.Exit(1)


def _spec_names(digests: list[str], args: dict[str, str]) -> list[str]:
    """The configs/ specs (by name) whose digests a database's runs carry; others as the --spec their run named
    (a spec file edited since, or a temporary one) with the digest, else as their digest alone."""
    known = {}
    for f in sorted(specs.configs_dir().glob("sweep_*.toml")):
        try:
            known[specs.load(f).digest()] = f.stem.removeprefix("sweep_")
        except ConfigError:
            continue
    named = (known.get(d) or (f"{args[d]} (digest {d})" if d in args else f"(digest {d})")
             for d in digests if d)
    return sorted(named, key=lambda n: (n.startswith("("), n))


@app.command()
def export(src: Annotated[str, typer.Argument(help="Database to export from.")],
           dest: Annotated[str, typer.Argument(help="SQLite file to write (replaced atomically).")],
           hardware: Annotated[str | None, typer.Option(help="Only hardware whose class key contains this (in any case), e.g. 'H200'.")] = None,
           stale: Annotated[bool, typer.Option(help="Also export winners whose kernels changed since tuning.")] = False,
           force: Annotated[bool, typer.Option(help="Replace DEST even if it holds trials (a sweep's database).")] = False,
           json: JsonOption = False) -> None:
    """Write a compact, winners-only database to ship (temp file, then rename). Stale winners are left out.
    An existing DEST is replaced only if it is an earlier export (no trials), unless --force.

    Example: k3tune db export k3tune.sqlite tuning_db/h200.sqlite --hardware H200
    """
    st = transfer.export(_open(src, readonly=True), dest, hardware=hardware, keep=None if stale else inspect.is_current,
                         force=force)
    if json:
        print_json(vars(st))
    else:
        console.print(f"exported {st.winners_added} winners to {escape(dest)} ({st.winners_dropped} stale left out)")


@app.command()
def merge(dest: Annotated[str, typer.Argument(help="SQLite file to merge into (created if missing; replaced atomically).")],
          sources: Annotated[list[str], typer.Argument(help="Databases to merge in.")],
          newer: Annotated[bool, typer.Option(help="A conflict keeps the winner decided last, not the faster "
                                                   "measured: to join re-decisions of different problems, each "
                                                   "made on a copy of one database.")] = False,
          json: JsonOption = False) -> None:
    """Merge databases tuned on several machines; a conflict keeps the faster measured winner, with provenance.

    Example: k3tune db merge all.sqlite node1.sqlite node2.sqlite
    """
    srcs = [_open(s, readonly=True) for s in sources]
    st = transfer.merge(dest, srcs, newer=newer)
    if json:
        print_json(vars(st))
    else:
        present = f" ({st.trials_present} already there)" if st.trials_present else ""
        console.print(f"merged {len(srcs)} databases into {escape(dest)}: {st.trials} trials added{present}, "
                      f"{st.winners_added} winners added, {st.winners_replaced} replaced by "
                      f"{'newer' if newer else 'faster'} ones, "
                      f"{st.winners_kept} kept")


@app.command()
def redo(db: Annotated[str, typer.Argument(help="Database whose problems to decide again (a sweep's, or a copy of a shipped one).")],
         patterns: Annotated[list[str], typer.Argument(help="SQL LIKE patterns on problem keys, e.g. 'moe.block[tp=8,%'.")],
         seeds_from: Annotated[str | None, typer.Option(help="Another database whose current winners of those problems "
                                                             "join as warm starts.")] = None,
         json: JsonOption = False) -> None:
    """Have the next sweep into DB decide the matching problems again, starting from their winners: after a change to
    how trials are timed (which re-keys no winner), or before a polish spec on a winners-only database.

    Example: k3tune db redo k3tune.sqlite 'moe.block[tp=16,%format=mxfp4%'
    """
    # in place, the shipped table's marked winners went stale: a server on this install served defaults for them
    refuse_shipped(db, f"redo on a copy of it (cp {db} /tmp/), which a sweep then decides and `k3tune db export`s")
    n = redos.redo(_open(db), patterns, _open(seeds_from, readonly=True) if seeds_from else None)
    if json:
        print_json({"stale_winners": n})
    else:
        console.print(f"{n} winners marked to decide again: the next sweep into this database decides those "
                      "problems, starting from them")


@app.command()
def diff(a: Annotated[str, typer.Argument(help="Baseline database.")],
         b: Annotated[str, typer.Argument(help="Database to compare.")],
         json: JsonOption = False) -> None:
    """Compare two databases problem by problem; regressions (slower beyond the spread) are flagged and
    make the exit code 1. Problems whose winners were timed by different methods, or are the same kernel in both
    (its time moved, the choice did not), are marked.

    Example: k3tune db diff tuning_db/h200.sqlite k3tune.sqlite
    """
    d = inspect.diff(_open(a, readonly=True), _open(b, readonly=True))
    if json:
        print_json(d)
    else:
        counts = d["counts"]
        console.print(f"{sum(counts.values())} problems: " + (", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
                                                             or "none in either database"))
        if d["timed_differently"]:
            console.print(f"note: the winners of {d['timed_differently']} problems were timed by different methods "
                          "(a changed measurer or the libraries it times through): their times differ by the "
                          "measurer too (rows marked 'timed differently')")
        if d["rows"]:  # every problem that is not the same (the first 200; --json has them all)
            # regressions first; the hardware is named where the databases hold more than one
            several = len({(r["hardware"], r["backend"]) for r in d["rows"]}) > 1
            t = Table("change", *(["hardware"] if several else []), "problem", "a us", "b us", "ratio", "note")
            for r in d["rows"][:200]:
                style = "red" if r["change"] == "regression" else None
                hw = [escape(f"{r['hardware']} [{r['backend']}]")] if several else []
                t.add_row(r["change"], *hw, escape(r["problem"]), f"{r['a']:.2f}" if r.get("a") else "-",
                          f"{r['b']:.2f}" if r.get("b") else "-", str(r.get("ratio", "-")),
                          ", ".join(n for n, on in (("same kernel", r.get("same_kernel")),
                                                    ("timed differently", r.get("timing") == "differs")) if on),
                          style=style)
            console.print(t)
            if len(d["rows"]) > 200:
                console.print(f"... and {len(d['rows']) - 200} more (--json lists every one)")
    if d["counts"].get("regression"):
        raise typer.Exit(1)


@app.command()
def upgrade(db: DbArg = None) -> None:
    """Migrate a database to the current schema (SQLite: on a copy that replaces it; the original kept as .bak).

    Example: k3tune db upgrade old.sqlite
    """
    before, after = store_db.upgrade(db_target(db))
    if before == after:
        console.print(f"already at schema {after}")
    else:
        console.print(f"upgraded schema {before or '(none)'} -> {after}")


__all__ = ["app", "DatabaseError"]
