"""The k3tune command line: a thin layer over the library. Known errors become one line and an exit code
here, in one place; K3TUNE_DEBUG=1 shows the full traceback."""

from __future__ import annotations

import sys

import typer

from k3tune import settings
from k3tune.cli import checkpoint as checkpoint_cmd
from k3tune.cli import db as db_cmd
from k3tune.cli import lookup as lookup_cmd
from k3tune.cli import plan as plan_cmd
from k3tune.cli import sweep as sweep_cmd
from k3tune.errors import K3TuneError

app = typer.Typer(name="k3tune", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Autotune the Kimi K3 decode path: sweep kernels per deployment, store winners, serve lookups.")
app.command("sweep")(sweep_cmd.sweep)
app.command("plan")(plan_cmd.plan)
app.command("lookup")(lookup_cmd.lookup)
app.add_typer(db_cmd.app, name="db")
app.add_typer(checkpoint_cmd.app, name="checkpoint")


def _bare_simulate(argv: list[str]) -> list[str]:
    """``--simulate`` with no value means the detected or configured hardware ('auto')."""
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a == "--simulate" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("auto")
    return out


INTERRUPTED = 130  # the shell's status for Ctrl-C


def _interrupted(argv: list[str]) -> int:
    what = "finished trials are saved; run the same command again to resume" if argv[:1] == ["sweep"] else \
        "stopped"
    print(f"interrupted: {what}", file=sys.stderr)
    return INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    argv = _bare_simulate(list(sys.argv[1:] if argv is None else argv))
    try:
        rv = app(args=argv, prog_name="k3tune", standalone_mode=False)
        if rv == INTERRUPTED:  # typer turns a KeyboardInterrupt into Exit(130), returned without a word
            return _interrupted(argv)
        return rv if isinstance(rv, int) else 0
    except K3TuneError as e:
        if settings.load().debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except typer.Exit as e:
        return _interrupted(argv) if e.exit_code == INTERRUPTED else e.exit_code
    except typer.TyperException as e:  # usage errors: typer prints them with the command's usage
        e.show()
        return getattr(e, "exit_code", 2)
    except (typer.Abort, KeyboardInterrupt):
        return _interrupted(argv)


def entry() -> None:
    sys.exit(main())
