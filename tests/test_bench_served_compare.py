"""bench/served_compare.py (what bench/served_vs.sh prints after its two served runs), on moe.py-shaped JSONs."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "served_compare.py"


def _run(tmp_path, new_rows, old_rows):
    paths = []
    for name, rows in (("new", new_rows), ("old", old_rows)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"device": "x", "complete": True, "rows": rows}))
        paths.append(str(p))
    return subprocess.run([sys.executable, str(SCRIPT), *paths], capture_output=True, text=True, timeout=60)


def _row(batch, us, iqr, serial_us=1000.0):
    # the served variant beside its serial twin, which must not be taken for it
    return {"tp": 8, "batch": batch, "routing": "uniform", "served_serial_bf16": {"us": serial_us, "iqr": 0.1},
            "served_bf16": {"us": us, "iqr": iqr}}


def test_verdicts_beyond_the_spread(tmp_path):
    r = _run(tmp_path, [_row(1, 59.7, 0.1), _row(4, 110.3, 0.2), _row(64, 588.5, 0.3)],
             [_row(1, 58.9, 0.1), _row(4, 110.2, 0.2), _row(64, 592.3, 0.3), _row(16, 1.0, 0.1)])
    assert r.returncode == 0, r.stderr
    lines = {int(ln.split()[1]): ln for ln in r.stdout.splitlines()[1:]}
    assert sorted(lines) == [1, 4, 64]  # only the points both runs measured
    assert lines[1].endswith("slower") and " 0.987 " in lines[1]  # 58.9 / 59.7
    assert lines[4].endswith("tie")
    assert lines[64].endswith("faster")
    assert all("served_bf16" in ln for ln in lines.values())


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    r = _run(tmp_path, [_row(1, 1.0, 0.1)], [{**_row(2, 1.0, 0.1)}])
    assert r.returncode == 1 and r.stderr.strip() == "served_compare: the two runs share no point"
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "missing.json"), str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("served_compare: cannot read the runs")
    # a shared point without its served variant: one line too, not a traceback
    r = _run(tmp_path, [_row(1, 1.0, 0.1)], [{"tp": 8, "batch": 1, "routing": "uniform"}])
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("served_compare: cannot read the runs") and "no served variant" in r.stderr
