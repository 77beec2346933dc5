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


class PgServer:
    """A PostgreSQL server of its own (data directory, socket, loopback port) started from the installed binaries;
    ``stop`` and ``start`` again keep its data and port (a server's restart under a running client)."""

    def __init__(self):
        initdb, self.pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not (initdb and self.pg_ctl):
            msg = "PostgreSQL server binaries (initdb, pg_ctl) not found: install postgresql to run these tests"
            if settings.load().ci:
                pytest.fail(msg + " (required under CI=true)")
            pytest.skip(msg)
        self.base = Path(tempfile.mkdtemp(prefix="k3tune-pg-"))  # pytest's tmp dirs are private to root
        self.data, self.sock, self.log = self.base / "data", self.base / "sock", self.base / "log"
        self.sock.mkdir()
        self.prefix: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            user = "postgres"
            try:
                pw = pwd.getpwnam(user)
            except KeyError:
                pytest.fail("running as root needs a 'postgres' user to start PostgreSQL")
            for p in (self.base, self.sock):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            os.chmod(self.base, 0o755)
            self.prefix = ["runuser", "-u", user, "--"]
        self.port = _free_port()
        init = subprocess.run(self.prefix + [initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres",
                                             "--no-sync"], capture_output=True, text=True)
        if init.returncode:
            pytest.fail(f"initdb failed: {init.stderr.strip()[-500:]}")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}"

    def start(self) -> None:
        subprocess.run(self.prefix + [self.pg_ctl, "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o",
                                      f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 "
                                      "-c max_connections=200 -c fsync=off", "start"], capture_output=True)
        if not (self.data / "postmaster.pid").exists():
            pytest.fail(f"PostgreSQL did not start: {self.log.read_text()[-800:] if self.log.exists() else ''}")

    def stop(self, mode: str = "immediate") -> None:
        subprocess.run(self.prefix + [self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"],
                       capture_output=True)

    def create_database(self) -> str:
        """A fresh, empty database on this server: its URL."""
        from sqlalchemy import create_engine, text

        name = f"k3t_{os.getpid()}_{next(_counter)}"
        eng = create_engine(f"{self.url}/postgres", isolation_level="AUTOCOMMIT")
        for _ in range(50):
            try:
                with eng.connect() as c:
                    c.execute(text(f'CREATE DATABASE "{name}"'))
                break
            except Exception:
                time.sleep(0.2)
        eng.dispose()
        return f"{self.url}/{name}"

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server on loopback for this test session. Skipped without the binaries, except under
    CI=true, where their absence fails the run."""
    server = PgServer()
    server.start()
    yield server
    server.remove()


@pytest.fixture
def own_pg_server():
    """A PostgreSQL server for one test alone, which it may stop and start again."""
    server = PgServer()
    server.start()
    yield server
    server.remove()


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty database on the session's server."""
    return pg_server.create_database()


@pytest.fixture(params=["sqlite", "postgres"])
def any_db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "k3tune.sqlite")
    return request.getfixturevalue("pg_url")


H100_CLASS = "NVIDIA H100 80GB HBM3|cc9.0|132sm|79GiB"


@pytest.fixture
def cktrig_landed_on_h100(monkeypatch):
    """The registry as in sessions 60-66: gemm.wgmma_cktrig staged, landed on the H100 alone (kernels.LANDED_ON).
    No family is landed on some hardware only since it moved to FAMILIES (session 67); the mechanism stays for the
    next one. The registry's caches are cleared around, so nothing computed on it outlives the test."""
    import k3tune.kernels as kernels

    name = "gemm.wgmma_cktrig"
    for f in (kernels.op_digest, kernels._candidates):
        f.cache_clear()
    monkeypatch.setitem(kernels.STAGED, name, kernels.FAMILIES[name])
    monkeypatch.delitem(kernels.FAMILIES, name)
    monkeypatch.setitem(kernels.LANDED_ON, name, frozenset({H100_CLASS}))
    yield kernels
    for f in (kernels.op_digest, kernels._candidates):
        f.cache_clear()
