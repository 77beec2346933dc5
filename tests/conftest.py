"""Shared fixtures: temp SQLite databases, a real PostgreSQL server started from the installed binaries,
and the named skip for GPU tests."""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from k3tune import settings

ROOT = Path(__file__).resolve().parents[1]
_counter = itertools.count()


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / "k3tune.sqlite"


# ---- PostgreSQL -------------------------------------------------------------------------------------
def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return cands[-1] if cands else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    """A TCP port on localhost that nothing listens on (a process group's rendezvous, a server's)."""
    return _free_port()


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    """A PostgreSQL server on loopback for this test session. Skipped without the binaries, except under
    CI=true, where their absence fails the run."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        msg = "PostgreSQL server binaries (initdb, pg_ctl) not found: install postgresql to run these tests"
        if settings.load().ci:
            pytest.fail(msg + " (required under CI=true)")
        pytest.skip(msg)
    base = Path(tempfile.mkdtemp(prefix="k3tune-pg-"))  # pytest's tmp dirs are private to root
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        user = "postgres"
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            pytest.fail("running as root needs a 'postgres' user to start PostgreSQL")
        for p in (base, sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        os.chmod(base, 0o755)
        prefix = ["runuser", "-u", user, "--"]
    port = _free_port()
    init = subprocess.run(prefix + [initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
                          capture_output=True, text=True)
    if init.returncode:
        pytest.fail(f"initdb failed: {init.stderr.strip()[-500:]}")
    log = base / "log"
    subprocess.run(prefix + [pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o",
                             f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off",
                             "start"], capture_output=True)
    if not (data / "postmaster.pid").exists():
        pytest.fail(f"PostgreSQL did not start: {log.read_text()[-800:] if log.exists() else ''}")
    url = f"postgresql://postgres@127.0.0.1:{port}"
    yield url
    subprocess.run(prefix + [pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty database on the session's server."""
    from sqlalchemy import create_engine, text

    name = f"k3t_{os.getpid()}_{next(_counter)}"
    eng = create_engine(f"{pg_server}/postgres", isolation_level="AUTOCOMMIT")
    for _ in range(50):
        try:
            with eng.connect() as c:
                c.execute(text(f'CREATE DATABASE "{name}"'))
            break
        except Exception:
            time.sleep(0.2)
    eng.dispose()
    return f"{pg_server}/{name}"


@pytest.fixture(params=["sqlite", "postgres"])
def any_db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "k3tune.sqlite")
    return request.getfixturevalue("pg_url")
