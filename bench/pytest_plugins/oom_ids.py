"""pytest plugin for bench/gpu_suite.sh: appends to the file named by $K3TUNE_OOM_IDS the node id and phase
("setup" or "call") of each test that failed by running out of GPU memory (an exception named OutOfMemoryError, as
torch.OutOfMemoryError is), so that the suite can re-run those alone once the concurrent shards are done."""

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("K3TUNE_OOM_IDS")
    if (path and report.failed and call.when in ("setup", "call") and call.excinfo is not None
            and call.excinfo.typename == "OutOfMemoryError"):
        with open(path, "a") as f:
            f.write(f"{item.nodeid}\t{call.when}\n")
