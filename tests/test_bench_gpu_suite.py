"""bench/gpu_suite.sh (the GPU suite sharded over concurrent pytest processes, for one device call), run for real on a
project of GPU-marked tests that need no GPU: every id runs once, the shards' counts add up, a failure or a shard cut
by its time limit makes the exit status non-zero, and a test that ran out of GPU memory beside the other shards is
re-run alone."""

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
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["gpu-suite.log"]  # the device returns at most 8 files
    log = (tmp_path / "out" / "gpu-suite.log").read_text()
    assert [line for line in log.splitlines() if line.startswith("==> ")] == [f"==> shard {i}" for i in range(3)]


def test_a_failure_or_a_cut_shard_fails_the_suite(tmp_path):
    r = run_suite(tmp_path, TESTS + "\n@pytest.mark.gpu\ndef test_broken():\n    assert 1 == 2\n", "2")
    assert r.returncode == 1
    assert "FAILED test_probe.py::test_broken" in r.stdout
    assert "suite: 6 passed, 0 skipped, 1 failed, 0 errors (7 of 7 ids reported)" in r.stdout
    slow = TESTS + "\n@pytest.mark.gpu\ndef test_slow():\n    import time\n    time.sleep(30)\n"
    r = run_suite(tmp_path, slow, "2", SUITE_S="3")
    assert r.returncode == 1 and "rc=124" in r.stdout, r.stdout


OOM_ONCE = """

class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name: what the suite's plugin looks for
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("when", ["first", "second"])
def test_runs_out_of_memory_beside_the_others(when):
    import os
    mark = os.path.join(os.environ["PROBE_STATE"], when)
    if not os.path.exists(mark):  # the first run (in a shard): out of memory; alone afterwards: fine
        open(mark, "w").close()
        raise OutOfMemoryError("CUDA out of memory (probe)")

@pytest.mark.gpu
def test_a_measurer_returns_out_of_memory():  # the GPU measurer catches torch's error; its Outcome says so
    import os
    mark = os.path.join(os.environ["PROBE_STATE"], "outcome")
    if not os.path.exists(mark):
        open(mark, "w").close()
        assert False, "moe.stock: runtime_failed: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
"""

OOM_ALWAYS = """

class OutOfMemoryError(RuntimeError):
    pass

@pytest.mark.gpu
def test_always_out_of_memory():
    raise OutOfMemoryError("CUDA out of memory (probe)")
"""

OOM_SETUP = """

class OutOfMemoryError(RuntimeError):
    pass

@pytest.fixture
def big():
    import os
    mark = os.path.join(os.environ["PROBE_STATE"], "fixture")
    if not os.path.exists(mark):
        open(mark, "w").close()
        raise OutOfMemoryError("CUDA out of memory in a fixture (probe)")

@pytest.mark.gpu
def test_needs_a_big_fixture(big):
    pass
"""


def test_tests_out_of_gpu_memory_beside_the_shards_are_rerun_alone(tmp_path):
    """A test that ran out of memory in its shard (in the test or in a fixture) runs again alone after the shards and
    counts by that run; one that runs out of memory alone too fails the suite; a plain failure is never re-run."""
    state = tmp_path / "state"
    state.mkdir()
    r = run_suite(tmp_path, TESTS + OOM_ONCE + OOM_SETUP.replace("class OutOfMemoryError", "class _Unused"), "3",
                  PROBE_STATE=str(state))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 ids ran out of GPU memory beside the other shards: re-run alone" in r.stdout
    assert "suite: 10 passed, 0 skipped, 0 failed, 0 errors (10 of 10 ids reported)" in r.stdout, r.stdout
    assert "==> shard retry" in (tmp_path / "out" / "gpu-suite.log").read_text()

    for f in state.iterdir():
        f.unlink()
    r = run_suite(tmp_path, TESTS + OOM_ALWAYS + "\n@pytest.mark.gpu\ndef test_broken():\n    assert 1 == 2\n", "2",
                  PROBE_STATE=str(state))
    assert r.returncode == 1
    assert "1 ids ran out of GPU memory beside the other shards: re-run alone" in r.stdout  # not test_broken
    assert "suite: 6 passed, 0 skipped, 2 failed, 0 errors (8 of 8 ids reported)" in r.stdout, r.stdout
