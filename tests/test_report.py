"""`k3tune db report` (k3tune/store/report.py): speedups over the safe baseline read from real databases (the shipped
H200 one, and a simulated sweep made here), stale winners left out, and the plot written whole or not at all."""

import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from k3tune.cli import main
from k3tune.shipped import tuning_db_dir
from k3tune.store import db as store_db, report

H200_DB = tuning_db_dir() / "h200.sqlite"


def _h200():
    data = report.report(store_db.open_db(H200_DB, create=False, readonly=True))
    (hw,) = data["hardware"]
    return hw, {op["op"]: op for op in hw["ops"]}


def test_shipped_h200_speedups_are_the_stored_ratios_with_their_baselines_named():
    hw, ops = _h200()
    with sqlite3.connect(H200_DB) as c:
        assert hw["backend"] == "measured" and hw["stale_left_out"] == 0
        assert hw["winners"] == c.execute("SELECT count(*) FROM winners").fetchone()[0]
        stored = {(k, m): d / t for k, m, d, t in c.execute(
            "SELECT p.op, json_extract(p.dims, '$.M'), w.default_us, w.median_us FROM winners w "
            "JOIN problems p ON p.id = w.problem_id WHERE p.op = 'kda.o_proj' AND json_extract(p.dims, '$.K') = 768")}
    row = next(r for r in ops["kda.o_proj"]["rows"] if r["label"] == "K=768")
    assert row["baseline"] == "gemm.cublas"
    assert {("kda.o_proj", m): c["speedup"] for m, c in row["cells"].items()} == pytest.approx(stored)
    assert row["geomean"] == pytest.approx(math.exp(sum(map(math.log, stored.values())) / len(stored)))
    # a block's rows are told apart by tp, format and routing only (its widths follow from tp); bf16 blocks are
    # compared with the stock block, MXFP4 ones (which the stock path cannot run) with the tuned block's defaults
    blocks = {r["label"]: r for r in ops["moe.block"]["rows"]}
    assert set(blocks) == {f"tp={tp},format={f},routing={r}" for tp in (16, 8) for f in ("bf16", "mxfp4")
                           for r in ("uniform", "zipf:1.2")}
    assert blocks["tp=16,format=bf16,routing=zipf:1.2"]["baseline"] == "moe.stock"
    assert blocks["tp=16,format=mxfp4,routing=uniform"]["baseline"] == "moe.overlap defaults"
    assert blocks["tp=16,format=bf16,routing=zipf:1.2"]["cells"][1]["speedup"] > 2.5
    assert sum(ops["moe.block"]["kernels"].values()) == 56


def test_stale_winners_are_left_out_and_counted(tmp_path, capsys):
    db = tmp_path / "s.sqlite"
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(db), "--json"]) == 0
    capsys.readouterr()
    with sqlite3.connect(db) as c:
        c.execute("UPDATE winners SET op_digest = 'stale0000000000' WHERE problem_id IN "
                  "(SELECT id FROM problems WHERE op = 'kda.o_proj')")
        stale = c.execute("SELECT count(*) FROM winners WHERE op_digest = 'stale0000000000'").fetchone()[0]
    assert main(["db", "report", str(db), "--json"]) == 0
    (hw,) = json.loads(capsys.readouterr().out)["hardware"]
    assert hw["backend"] == "simulated" and hw["stale_left_out"] == stale > 0
    ops = {op["op"]: op for op in hw["ops"]}
    assert "kda.o_proj" not in ops and ops
    # attention rows keep their query length: batch 8 x qlen 1 and batch 4 x qlen 2 would share a column
    assert {r["label"] for r in ops["kda.decode"]["rows"]} == {f"heads={h},qlen={q}" for h in (6, 12) for q in (1, 2)}
    n_cells = sum(len(r["cells"]) for r in ops["kda.decode"]["rows"])
    with sqlite3.connect(db) as c:
        assert n_cells == c.execute("SELECT count(*) FROM winners w JOIN problems p ON p.id = w.problem_id "
                                    "WHERE p.op = 'kda.decode'").fetchone()[0]
    assert main(["db", "report", str(db)]) == 0
    out = capsys.readouterr().out
    assert "(simulated)" in out and f"{stale} stale left out" in out


def test_the_plot_is_written_whole_or_refused_in_one_line(tmp_path, capsys):
    png = tmp_path / "h200.png"
    assert main(["db", "report", str(H200_DB), "--plot", str(png), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["h200.png"]  # no temporary file left beside it
    mask = os.umask(0)
    os.umask(mask)
    assert png.stat().st_mode & 0o777 == 0o666 & ~mask  # as any file the user writes (was mkstemp's 0600)
    (tmp_path / "dir.png").mkdir()
    for bad, msg in [(tmp_path / "no" / "x.png", "is not a directory"), (tmp_path / "x.docx", "name it .png"),
                     (tmp_path / "dir.png", "it is a directory"),  # these two were tracebacks, after the drawing
                     (Path("/proc/k3tune.png"), "cannot write the plot /proc/k3tune.png")]:
        assert main(["db", "report", str(H200_DB), "--plot", str(bad)]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1
        assert not bad.exists() or bad.is_dir()


def test_a_piped_report_keeps_its_numbers():
    """Redirected to a file (no terminal, no COLUMNS), rich drew the table 80 columns wide and cut every number to
    an ellipsis ("1.… │ 1…"); piped output is now 200 columns wide."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "k3tune", "db", "report", str(H200_DB)], capture_output=True,
                         text=True, env=env, check=True).stdout
    row = next(line for line in out.splitlines() if "kda.o_proj" in line and "K=1536" in line)
    assert "…" not in row and "gemm.cublas" in row
    assert len([c for c in row.split("│") if c.strip().replace(".", "").isdigit()]) == 11  # M = 1 … 512 and geomean


def test_a_narrow_report_folds_its_labels_and_orders_rows_by_value():
    """Rows were sorted as strings (K=1536 before K=768, tp=16 before tp=8), and a narrow table cut labels and
    baselines to an ellipsis, so rows that differ only in their tail (a block's routing, mla.decode's ctx) read
    alike. Rows now follow their dims' values, and text folds inside its cell while every number stays whole."""
    _, ops = _h200()
    assert [r["label"] for r in ops["kda.o_proj"]["rows"]] == ["K=768", "K=1536"]
    assert [r["label"].split(",")[0] for r in ops["moe.block"]["rows"]] == ["tp=8"] * 4 + ["tp=16"] * 4
    env = {**os.environ, "COLUMNS": "120"}
    out = subprocess.run([sys.executable, "-m", "k3tune", "db", "report", str(H200_DB)], capture_output=True,
                         text=True, env=env, check=True).stdout
    assert "…" not in out
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("│ moe.block") and "│ moe.stock" in line)
    end = next(j for j in range(i + 1, len(lines)) if not lines[j].startswith("│  "))  # the row's folded lines
    assert "".join(line.split("│")[2].strip() for line in lines[i:end]) == "tp=8,format=bf16,routing=uniform"
    row = next(line for line in lines if line.startswith("│ kda.o_proj") and "K=1536" in line)
    assert len([c for c in row.split("│") if c.strip().replace(".", "").isdigit()]) == 11
