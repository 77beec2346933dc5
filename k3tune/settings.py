"""Every setting read from the environment, in one typed place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    db: str | None  # K3TUNE_DB: path or SQLAlchemy URL of the tuning database
    debug: bool  # K3TUNE_DEBUG=1: full tracebacks from the CLI
    hardware: str | None  # K3TUNE_HARDWARE: the hardware a bare --simulate assumes when no GPU is detected
    ci: bool  # CI=true: tests that need PostgreSQL fail instead of skipping
    routing: str | None  # K3TUNE_ROUTING: the expert routing the served MoE block is tuned for (uniform, zipf:S, trace:F)
    extra_families: tuple[str, ...] = ()  # K3TUNE_EXTRA_FAMILIES=a,b: staged kernel families to offer and key too
    # K3TUNE_SERVE_DB: the database the runtime selector reads instead of the shipped one for this GPU (a sweep
    # sets it for its workers, so that a measured MoE block runs the dense kernels the sweep chose)
    serve_db: str | None = None
    # K3TUNE_KERNEL_CACHE: the directory of compiled kernels shared by a machine's processes ("off": none; unset:
    # ~/.cache/k3tune/kernels)
    kernel_cache: Path | None = None

    @property
    def default_db(self) -> str:
        return self.db or str(Path.cwd() / "k3tune.sqlite")


def _text(name: str) -> str | None:
    """A path, URL or name from the environment without the spaces or newline around it (a value read from a file or
    a config map keeps its newline: K3TUNE_HARDWARE was then an unknown hardware), or None where unset or blank."""
    return os.environ.get(name, "").strip() or None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def load() -> Settings:
    return Settings(
        db=_text("K3TUNE_DB"),
        debug=_flag("K3TUNE_DEBUG"),
        hardware=_text("K3TUNE_HARDWARE"),
        ci=_flag("CI"),
        routing=_text("K3TUNE_ROUTING"),
        extra_families=tuple(filter(None, (n.strip() for n in os.environ.get("K3TUNE_EXTRA_FAMILIES", "").split(",")))),
        serve_db=_text("K3TUNE_SERVE_DB"),
        kernel_cache=_kernel_cache(_text("K3TUNE_KERNEL_CACHE") or ""),
    )


def _kernel_cache(value: str) -> Path | None:
    if value.strip().lower() == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "k3tune" / "kernels"
