"""bench/gpu_suite.sh (the GPU suite sharded over concurrent pytest processes, for one device call), run for real on a
project of GPU-marked tests that need no GPU: every id runs once, the shards' counts add up, and a failure or a shard
cut by its time limit makes the exit status non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(5))
def test_passes(i):
    assert i >= 0

@pytest.mark.gpu
def test_named():
    pass

def test_not_gpu_is_left_out():
    pass
"""


def run_suite(tmp_path: Path, body: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: marked\n")
    (tmp_path / "test_probe.py").write_text(body)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    python = Path(sys.executable).parent  # the script calls python3: this interpreter's, with its pytest
    return subprocess.run(["bash", str(ROOT / "bench/gpu_suite.sh"), *args, "test_probe.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(out), "PATH": f"{python}:{os.environ['PATH']}", **env})


def test_every_gpu_test_runs_once_across_the_shards(tmp_path):
    r = run_suite(tmp_path, TESTS, "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "6 GPU tests in test_probe.py, 3 shards" in r.stdout
    assert "suite: 6 passed, 0 skipped, 0 failed, 0 errors (6 of 6 ids reported)" in r.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"gpu-suite-{i}.log" for i in range(3)]


def test_a_failure_or_a_cut_shard_fails_the_suite(tmp_path):
    r = run_suite(tmp_path, TESTS + "\n@pytest.mark.gpu\ndef test_broken():\n    assert 1 == 2\n", "2")
    assert r.returncode == 1
    assert "FAILED test_probe.py::test_broken" in r.stdout
    assert "suite: 6 passed, 0 skipped, 1 failed, 0 errors (7 of 7 ids reported)" in r.stdout
    slow = TESTS + "\n@pytest.mark.gpu\ndef test_slow():\n    import time\n    time.sleep(30)\n"
    r = run_suite(tmp_path, slow, "2", SUITE_S="3")
    assert r.returncode == 1 and "rc=124" in r.stdout, r.stdout
