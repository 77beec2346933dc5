"""pytest plugin for bench/gpu_suite.sh: appends to the file named by $K3TUNE_OOM_IDS the node id and phase
("setup" or "call") of each test that failed by running out of GPU memory, so that the suite can re-run those alone
once the concurrent shards are done. Out of memory: an exception named OutOfMemoryError (as torch.OutOfMemoryError
is), or one whose message says "out of memory" (a measurer catches the torch error and returns an Outcome whose
error says so; the test's assertion message carries it, s35-r1)."""

import os

import pytest


def _out_of_memory(excinfo) -> bool:
    return excinfo.typename == "OutOfMemoryError" or "out of memory" in str(excinfo.value).lower()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("K3TUNE_OOM_IDS")
    if (path and report.failed and call.when in ("setup", "call") and call.excinfo is not None
            and _out_of_memory(call.excinfo)):
        with open(path, "a") as f:
            f.write(f"{item.nodeid}\t{call.when}\n")
