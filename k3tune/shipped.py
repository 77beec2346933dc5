"""Where the data shipped with k3tune lives (configs/ and tuning_db/), installed or in a checkout."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _root(name: str) -> Path:
    installed = _PKG / "_shipped" / name
    if installed.is_dir():
        return installed
    return _PKG.parent / name  # editable install / source checkout


def configs_dir() -> Path:
    return _root("configs")


def tuning_db_dir() -> Path:
    return _root("tuning_db")
