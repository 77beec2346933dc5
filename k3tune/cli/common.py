"""Options and output helpers shared by the command groups."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from k3tune import settings
from k3tune.errors import ConfigError, DatabaseError
from k3tune.shipped import tuning_db_dir
from k3tune.store import db as store_db


def _console(stderr: bool = False) -> Console:
    """Rich's console; piped or redirected (a report kept beside a release, a CI log) it is 200 columns wide, not
    rich's 80, which cut every column of `db report`'s table to an ellipsis. COLUMNS still wins."""
    c = Console(stderr=stderr)
    return c if c.is_terminal or "COLUMNS" in os.environ else Console(stderr=stderr, width=200)


console = _console()
err_console = _console(stderr=True)

DbOption = Annotated[str | None, typer.Option("--db", help="Tuning database: a SQLite path or SQLAlchemy URL "
                                              "(default: $K3TUNE_DB, else ./k3tune.sqlite).")]
SpecOption = Annotated[str | None, typer.Option("--spec", help="Sweep spec TOML, or a name from configs/ "
                                                "(e.g. 'smoke'); default configs/sweep_default.toml.")]
ConfigOption = Annotated[str | None, typer.Option("--config", help="Model config.json, or a model's folder holding one "
                                                    "(default: K3's published config).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def db_target(db: str | None) -> str:
    return db or settings.load().default_db


def require_db(db: str) -> str:
    """``db`` if it is a URL or an existing SQLite file; a missing file is bad input (one line, exit 4)."""
    _, path = store_db.to_url(db)
    if path is not None and not path.exists():
        raise DatabaseError(f"database not found: {path}")
    return db


def refuse_shipped(target: str, instead: str) -> None:
    """A command that writes a database in place refuses the shipped tables: what a server on this install reads."""
    if "://" not in target and Path(target).resolve().parent == tuning_db_dir().resolve():
        raise ConfigError(f"{target}: tuning_db/ is read-only shipped data; {instead}")


def print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))
