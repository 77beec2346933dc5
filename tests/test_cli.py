"""The command line: every command has help; read commands speak JSON; known errors are one line and a
non-zero exit, with the traceback behind K3TUNE_DEBUG=1."""

import json
import re
import shutil
import tomllib
from contextlib import closing
from pathlib import Path

import pytest

from k3tune import kernels
from k3tune.cli import app, main
from k3tune.search.method import method_digest

def _commands(group=None, path=()) -> list[tuple[list[str], bool]]:
    """Every command and group of the app as (its words, whether it is a group), read from the app itself (a command
    added later is covered too)."""
    import typer

    group = group or typer.main.get_command(app)
    out = [(list(path), True)]
    for name, cmd in sorted(group.commands.items()):
        out += _commands(cmd, path + (name,)) if hasattr(cmd, "commands") else [(list(path + (name,)), False)]
    return out


COMMANDS = _commands()


def test_the_command_list_is_the_apps():
    assert {" ".join(c) for c, _ in COMMANDS} >= {"", "sweep", "plan", "lookup", "db", "db show", "db verify",
                                                "db export", "db merge", "db diff", "db redo", "db report",
                                                "db upgrade", "checkpoint", "checkpoint check"}


@pytest.mark.parametrize("cmd,is_group", COMMANDS, ids=[" ".join(c) or "k3tune" for c, _ in COMMANDS])
def test_every_command_has_help_with_an_example(cmd, is_group, capsys):
    assert main(cmd + ["--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage" in out
    if not is_group:  # every command (not a group) shows an example
        assert "Example" in out, cmd


def test_sweep_show_lookup_verify_roundtrip(tmp_path, capsys):
    db = str(tmp_path / "t.sqlite")
    assert main(["sweep", "--gpus", "2", "--simulate", "gb300", "--spec", "smoke", "--db", db, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tuned_now"] == 48 and summary["backend"] == "simulated gb300"
    assert main(["sweep", "--gpus", "2", "--simulate", "gb300", "--spec", "smoke", "--db", db, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trials"] == 0  # resumed: nothing left to do

    assert main(["db", "show", db, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert sum(info["winners_by_op"].values()) == 48 and info["hardware"][0]["simulated"]
    assert info["winners_by_method"] == {method_digest("simulated"): 48}  # every winner says how it was timed

    assert main(["lookup", "--tp", "16", "--batch", "8", "--draft", "1", "--db", db, "--simulate", "gb300", "--json"]) == 0
    look = json.loads(capsys.readouterr().out)
    by_op = {o["op"]: o for o in look["ops"]}
    assert by_op["kda.qkvg_proj"]["source"] == "simulated"
    assert by_op["mla.q_a"]["source"] == "heuristic default"  # not in the smoke spec

    assert main(["db", "verify", db, "--spec", "smoke", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["db", "verify", db, "--json"]) == 1  # the default matrix is not covered
    capsys.readouterr()

    ship = str(tmp_path / "ship.sqlite")
    assert main(["db", "export", db, ship]) == 0
    assert "exported 48 winners" in capsys.readouterr().out
    assert main(["db", "diff", db, ship, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"] == {"same": 48}
    assert main(["db", "merge", str(tmp_path / "m.sqlite"), db, ship]) == 0
    assert main(["db", "upgrade", db]) == 0
    assert "already at schema" in capsys.readouterr().out


def test_plan_json(capsys):
    assert main(["plan", "--spec", "smoke", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["deployments"] == 8 and sum(len(v) for v in p["problems"].values()) == 48
    # a GPU sweep also tunes the 24 dense problems the smoke spec's MoE blocks run and it does not list (s66)
    assert p["estimate"]["simulated"]["problems"] == 48 and p["estimate"]["gpu"]["problems"] == 72
    # the default spec's blocks run up to 512 tokens (drafts): mapping their dense lookups as deployments of batch M
    # made `k3tune plan` a "batch 96 out of range" error (s66, before any commit left the session)
    assert main(["plan", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["estimate"]["gpu"]["problems"] == p["estimate"]["simulated"]["problems"] == 1124


def test_plan_text_agrees_with_its_json(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", "--spec", "smoke"]) == 0
    out = capsys.readouterr().out
    assert "spec smoke: 8 deployments" in out and "-> 48 unique problems" in out
    assert re.search(r"simulated: 48 tunable problems, ~\d+ trials", out)


def test_a_bare_simulate_means_the_detected_or_configured_hardware(tmp_path, capsys, monkeypatch):
    """`--simulate` with no name, last or before another option, is 'auto': K3TUNE_HARDWARE where no GPU is seen."""
    monkeypatch.setenv("K3TUNE_HARDWARE", "h100")
    db = str(tmp_path / "a.sqlite")
    assert main(["sweep", "--spec", "smoke", "--db", db, "--json", "--simulate"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "simulated h100"
    # lookup too: it was "unknown hardware 'auto'" (exit 3)
    assert main(["lookup", "--tp", "8", "--batch", "1", "--spec", "smoke", "--db", db, "--json", "--simulate"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {o["op"]: o["source"] for o in out["ops"]}["kda.qkvg_proj"] == "simulated", out  # the smoke spec's ops
    monkeypatch.setenv("K3TUNE_HARDWARE", "h2OO")  # was "unknown hardware 'h2OO'", as if the command line said it
    assert main(["sweep", "--simulate", "--spec", "smoke", "--db", db]) == 3
    assert "error: K3TUNE_HARDWARE=h2OO: unknown hardware 'h2OO'" in capsys.readouterr().err
    monkeypatch.delenv("K3TUNE_HARDWARE")
    assert main(["sweep", "--simulate", "--spec", "smoke", "--db", db]) == 3
    assert "needs a detected GPU or K3TUNE_HARDWARE" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg, code", [
    (["sweep", "--simulate", "rtx4090"], "unknown hardware 'rtx4090'", 3),
    (["sweep", "--gpus", "2"], "no CUDA GPU found", 3),
    (["lookup", "--tp", "16", "--batch", "0"], "batch 0 out of range", 2),
    (["lookup", "--tp", "8", "--batch", "4", "--dcp", "16"], "dcp 16 invalid", 2),
    (["plan", "--spec", "/nonexistent.toml"], "sweep spec not found", 2),
    (["db", "show", "/nonexistent.sqlite"], "database not found", 4),
    (["db", "verify", "/nonexistent.sqlite"], "database not found", 4),  # was a NOT OK verdict "needs db upgrade"
    (["sweep", "--gpus", "0", "--simulate", "gb300"], "--gpus must be at least 1", 2),  # was run on 1 worker
    (["sweep", "--gpus", "1600", "--simulate", "gb300"], "at most 72 (one NVL72 domain)", 2),  # 1600 processes
    (["lookup", "--tp", "8", "--batch", "4", "--db", "/nonexistent.sqlite"], "database not found", 4),  # was
    # heuristic defaults behind a warning that no GPU was detected
    (["lookup", "--tp", "8", "--batch", "4", "--hardware", "tpu"], "unknown hardware 'tpu'", 3),
    (["lookup", "--tp", "8", "--batch", "4", "--hardware", "h200", "--simulate", "h200"], "not both", 2),  # was
    # heuristic defaults behind a warning that the shipped H200 table holds no simulated winners
    (["sweep", "--simulate", "gb300", "--trial-timeout", "-1"], "--trial-timeout must be more than 0", 2),  # were
    (["sweep", "--simulate", "gb300", "--lease", "0"], "--lease must be at least 10", 2),  # accepted
    (["sweep", "--simulate", "gb300", "--lease", "inf"], "--lease must be at least 10 and at most 604800", 2),  # a
    (["sweep", "--simulate", "gb300", "--lease", "1e300"], "--lease must be", 2),  # traceback (OverflowError)
    (["sweep", "--simulate", "gb300", "--trial-timeout", "inf"], "--trial-timeout must be more than 0 and at most", 2),
    (["sweep", "--simulate", "gb300", "--compile-procs", "100000"], "--compile-procs 100000 is more than the", 2),
])
def test_known_errors_are_one_line(argv, msg, code, capsys):
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and msg in err and "\n" not in err


def test_a_specs_model_config_is_read_beside_the_spec(tmp_path, monkeypatch, capsys):
    """A spec's relative ``[model] config`` was read against the working directory: from anywhere else `plan` said
    "model config not found", or took another file of that name there. It is read beside the spec now."""
    from k3tune.plan import spec as specs

    raw = json.loads((specs.configs_dir() / "kimi_k3_config.json").read_text())
    raw["text_config"]["num_experts"] = 512
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "mine.json").write_text(json.dumps(raw))
    text = (specs.configs_dir() / "sweep_smoke.toml").read_text().replace(
        "[matrix]", '[model]\nconfig = "mine.json"\n\n[matrix]')
    (folder / "mine.toml").write_text(text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.json").write_text("{}")  # a namesake in the working directory, not the spec's
    monkeypatch.chdir(elsewhere)
    assert main(["plan", "--spec", str(folder / "mine.toml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all("experts=512" in p["key"] for p in out["problems"]["moe.block"]), out["problems"]["moe.block"][:1]
    # where the spec lies is no part of its digest
    assert specs.load(folder / "mine.toml").digest() == specs.from_dict(tomllib.loads(text), "mine").digest()


def test_a_redirected_sweep_logs_progress_lines(tmp_path, monkeypatch, capsys):
    """Redirected to a file (a batch job's log), rich drew no progress until the sweep's end: hours of nothing.
    Without a terminal the sweep prints a progress line every LOG_EVERY_S seconds."""
    import k3tune.cli.sweep as sweep_cli

    monkeypatch.setattr(sweep_cli, "LOG_EVERY_S", 0.0)
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(tmp_path / "p.sqlite")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("progress: ")]
    assert len(lines) > 3 and re.match(r"progress: \d+/48 problems, \d+ trials, 0 failed", lines[0]), lines[:2]
    assert lines[-1].startswith("progress: 48/48 problems")


def test_bad_files_are_one_line_and_untouched(tmp_path, capsys):
    notdb = tmp_path / "x.sqlite"
    notdb.write_text("hello")
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(notdb)]) == 4
    assert "is not a SQLite database" in capsys.readouterr().err
    assert notdb.read_text() == "hello"
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(tmp_path)]) == 4
    assert "is a directory, not a database file" in capsys.readouterr().err  # was "disk I/O error"
    # a file where the database's folder would go: FileExistsError tracebacks from sweep, export and merge
    from k3tune.shipped import tuning_db_dir

    shipped = tuning_db_dir() / "h200.sqlite"
    for argv in (["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(notdb / "sub" / "k.sqlite")],
                 ["db", "export", str(shipped), str(notdb / "e.sqlite")],
                 ["db", "merge", str(notdb / "m.sqlite"), str(shipped)]):
        assert main(argv) == 4, argv
        assert f"{notdb} is a file" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[matrix")
    assert main(["plan", "--spec", str(bad)]) == 2
    assert "malformed TOML" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text("{")
    assert main(["plan", "--config", str(cfg)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    for url in ("postgres://u@h/k3tune", "mysql://u@h/k3tune"):  # SQLAlchemy said "Can't load plugin: ..."
        assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", url]) == 4
        assert "unsupported database URL scheme" in capsys.readouterr().err
    # SQLAlchemy's in-memory SQLite: the whole sweep ran, rc 0, and every trial and winner went with the process
    for url in ("sqlite://", "sqlite:///:memory:", "sqlite+pysqlite:///:memory:", "sqlite:///file:k?mode=memory"):
        assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", url]) == 4, url
        assert "in-memory SQLite database" in capsys.readouterr().err


def test_a_spec_the_model_cannot_plan_fails_before_any_database_is_made(tmp_path, capsys):
    """A spec naming an unknown op (or a tp the model's widths do not divide) failed only after the sweep had
    created its database file and started its workers: the error now comes first, and nothing is written. The same
    for a ``[search] whole`` knob that no family of the spec's ops declares."""
    from k3tune.plan import spec as specs

    text = (specs.configs_dir() / "sweep_smoke.toml").read_text()
    for name, edit, msg in (("op", text.replace('"kda.o_proj"', '"kda.oproj"'), "unknown op 'kda.oproj'"),
                            ("tp", text.replace("tp = [8, 16]", "tp = [5]"), "tp 5 does not divide"),
                            ("whole", text.replace("[search]", '[search]\nwhole = ["split_kk"]'),
                             "[search] whole names split_kk, which no kernel family of its ops declares")):
        sp = tmp_path / f"{name}.toml"
        sp.write_text(edit)
        db = tmp_path / f"{name}.sqlite"
        assert main(["sweep", "--simulate", "gb300", "--spec", str(sp), "--db", str(db)]) == 2
        assert msg in capsys.readouterr().err
        assert not db.exists()


def test_shipped_tuning_db_is_read_only(capsys):
    from k3tune.shipped import tuning_db_dir

    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(tuning_db_dir() / "x.sqlite")]) == 2
    assert "read-only shipped data" in capsys.readouterr().err
    assert not (tuning_db_dir() / "x.sqlite").exists()
    # `db redo` marked the shipped table's winners stale in place (and left it in WAL mode): a server on this install
    # then served heuristic defaults for them
    shipped = tuning_db_dir() / "h200.sqlite"
    before = shipped.read_bytes()
    assert main(["db", "redo", str(shipped), "moe.block[tp=8,M=1,%"]) == 2
    assert "read-only shipped data; redo on a copy of it" in capsys.readouterr().err
    assert shipped.read_bytes() == before and not list(tuning_db_dir().glob("*-wal"))


def test_debug_shows_traceback(monkeypatch):
    monkeypatch.setenv("K3TUNE_DEBUG", "1")
    from k3tune.errors import HardwareError

    with pytest.raises(HardwareError):
        main(["sweep", "--simulate", "rtx4090"])


def _smoke_db(path, capsys):
    """A small simulated database made through the CLI; its WAL folded in so the file stands alone."""
    import sqlite3

    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(path), "--json"]) == 0
    capsys.readouterr()
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


def test_verify_reports_a_truncated_database(tmp_path, capsys):
    db = _smoke_db(tmp_path / "t.sqlite", capsys)
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 3])
    assert main(["db", "verify", str(db), "--spec", "smoke", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    # SQLite words it by where the cut falls: "malformed" or the b-tree pages it cannot read
    assert not out["ok"] and any(w in out["integrity"][0] for w in ("malformed", "btreeInitPage", "never used"))
    assert main(["db", "verify", str(db), "--spec", "smoke"]) == 1
    text = capsys.readouterr().out
    assert "schema not read" in text and "upgrade" not in text  # not a case for `k3tune db upgrade`


def _damage_table(path: Path, table: str) -> Path:
    """Overwrite a table's root page with 0xff: a damaged page that opening the database does not read."""
    import sqlite3

    with closing(sqlite3.connect(path)) as c:
        size = c.execute("PRAGMA page_size").fetchone()[0]
        root = c.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    data = bytearray(path.read_bytes())
    data[(root - 1) * size:root * size] = b"\xff" * size
    path.write_bytes(bytes(data))
    return path


def test_a_damaged_page_is_an_error_naming_the_damaged_file(tmp_path, capsys):
    """A page the opening reads do not reach (the winners table's): `lookup --db` served heuristic defaults with exit 0
    behind a warning that named no file, and `db export` / `db merge` named their own temporary file, not the source
    that failed. Each is a one-line error naming the source now, exit 4, and nothing is written."""
    db = _damage_table(_smoke_db(tmp_path / "s.sqlite", capsys), "winners")
    assert main(["lookup", "--tp", "8", "--batch", "1", "--simulate", "gb300", "--db", str(db)]) == 4
    err = capsys.readouterr().err
    assert f"cannot read tuning database {db}: database disk image is malformed" in err, err
    merged = shutil.copy(_smoke_db(tmp_path / "m.sqlite", capsys), tmp_path / "m0.sqlite")
    for argv in (["db", "export", str(db), str(tmp_path / "e.sqlite")], ["db", "merge", str(tmp_path / "m.sqlite"), str(db)]):
        assert main(argv) == 4, argv
        err = capsys.readouterr().err
        assert f"database error on {db}: database disk image is malformed" in err and ".tmp" not in err, err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "e.sqlite").exists()
    assert (tmp_path / "m.sqlite").read_bytes() == Path(merged).read_bytes()
    # --hardware reads the hardware rows first: a damaged page there was a warning and exit 0 as well
    from k3tune.runtime import Selector
    from k3tune.shipped import tuning_db_dir

    h200 = _damage_table(Path(shutil.copy(tuning_db_dir() / "h200.sqlite", tmp_path / "h.sqlite")), "hardware")
    assert main(["lookup", "--tp", "8", "--batch", "1", "--hardware", "h200", "--db", str(h200)]) == 4
    err = capsys.readouterr().err
    assert f"cannot use tuning database: database error on {h200}: database disk image is malformed" in err, err
    sel = Selector.load(h200, measured_on="h200")  # serving: a warning and the defaults, never an exception
    assert sel.unread and "malformed" in sel.unread and sel.warnings == [f"{sel.unread}; serving heuristic defaults"]


def test_unreadable_json_cells_are_listed_by_verify_and_one_line_elsewhere(tmp_path, capsys):
    """A winner's params or a problem's dims that is not a JSON object (a hand edit; SQLite checks no JSON on write)
    was a JSONDecodeError traceback from `db verify`, `db report`, `db export`, `db diff` and `lookup`, and from
    `Selector.load` in a server's start. verify lists the rows and checks the rest; the other commands are one line
    naming the file (exit 4); serving leaves those winners out, with a warning, and serves the rest."""
    import sqlite3

    from k3tune.plan import spec as specs
    from k3tune.runtime import Selector

    db = _smoke_db(tmp_path / "j.sqlite", capsys)
    with closing(sqlite3.connect(db)) as c:
        (w1, w2), total = [r[0] for r in c.execute("SELECT id FROM winners ORDER BY id LIMIT 2")], \
            c.execute("SELECT count(*) FROM winners").fetchone()[0]
        p2, key2, op2 = c.execute("SELECT p.id, p.key, p.op FROM winners w JOIN problems p ON p.id = w.problem_id "
                                  "WHERE w.id = ?", (w2,)).fetchone()
        key1, op1 = c.execute("SELECT p.key, p.op FROM winners w JOIN problems p ON p.id = w.problem_id "
                              "WHERE w.id = ?", (w1,)).fetchone()
        c.execute("UPDATE winners SET params = '{split_k: 4' WHERE id = ?", (w1,))
        c.execute("UPDATE problems SET dims = '[1, 2]' WHERE id = ?", (p2,))
        c.commit()
    assert main(["db", "verify", str(db), "--spec", "smoke", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["unreadable"] == {"winners.params": [w1], "problems.dims": [p2]} and out["winners"] == total - 2
    assert main(["db", "verify", str(db), "--spec", "smoke"]) == 1
    text = capsys.readouterr().out
    assert f"unreadable winners.params in 1 row: id {w1}" in text and "NOT OK" in text
    for argv in (["db", "report", str(db)], ["db", "export", str(db), str(tmp_path / "e.sqlite")],
                 ["db", "diff", str(db), str(db)]):
        assert main(argv) == 4, argv
        err = capsys.readouterr().err
        assert f"{db}: a stored JSON value cannot be read" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "e.sqlite").exists()
    sel = Selector.load(db, simulated="gb300", spec=specs.load("smoke"))
    assert sel.unread is None and any("left out 2 winners" in w for w in sel.warnings), sel.warnings
    for op, key in ((op1, key1), (op2, key2)):
        assert op not in sel._winners or key not in sel._winners[op]
    assert sum(len(v) for v in sel._winners.values()) == total - 2
    assert main(["lookup", "--tp", "8", "--batch", "1", "--simulate", "gb300", "--spec", "smoke", "--db", str(db)]) == 0
    assert "left out 2 winners" in capsys.readouterr().out


def test_verify_names_the_ops_whose_winners_are_stale(tmp_path, capsys):
    """A winner whose key no longer matches fails verify, and verify says which op it belongs to (a dense kernel
    changed under an MoE block makes the block's winners stale too: the count per op tells the two apart)."""
    import sqlite3

    db = _smoke_db(tmp_path / "s.sqlite", capsys)
    with sqlite3.connect(db) as c:
        (op,) = c.execute("SELECT p.op FROM winners w JOIN problems p ON p.id = w.problem_id LIMIT 1").fetchone()
        c.execute("UPDATE winners SET op_digest = 'stale0000000000' WHERE problem_id IN "
                  "(SELECT id FROM problems WHERE op = ?)", (op,))
        n = c.execute("SELECT count(*) FROM winners w JOIN problems p ON p.id = w.problem_id WHERE p.op = ?",
                      (op,)).fetchone()[0]
    assert main(["db", "verify", str(db), "--spec", "smoke", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["stale_by_op"] == {op: n} and len(out["stale"]) == n
    assert main(["db", "verify", str(db), "--spec", "smoke"]) == 1
    assert f"stale winners: {n} ({op} {n})" in capsys.readouterr().out


def test_newer_schema_via_cli(tmp_path, capsys):
    import sqlite3

    db = _smoke_db(tmp_path / "n.sqlite", capsys)
    with sqlite3.connect(db) as c:
        c.execute("update alembic_version set version_num='0042'")
    assert main(["db", "show", str(db)]) == 4
    assert "newer than this k3tune" in capsys.readouterr().err


def test_typer_app_object_is_importable():
    assert app.info.name == "k3tune"
    assert shutil.which("k3tune") or Path(__file__).exists()


def test_shipped_h200_database_is_current():
    """Every shipped winner was tuned with the kernel sources in this tree (a kernel change, or for the MoE
    block an executor change, needs a re-sweep), and covers its spec."""
    from k3tune.shipped import configs_dir, tuning_db_dir

    for spec in ("sweep_h200_dense.toml", "sweep_h200_moe_bf16.toml", "sweep_h200_moe_mxfp4.toml",
                 "sweep_h200_moe_bf16_zipf.toml", "sweep_h200_moe_mxfp4_zipf.toml",  # blocks tuned for Zipf 1.2
                 "sweep_h200x2_allreduce.toml", "sweep_h200x4_allreduce.toml"):  # the all-reduce on 2 and 4 GPUs
        assert main(["db", "verify", str(tuning_db_dir() / "h200.sqlite"), "--spec", str(configs_dir() / spec)]) == 0

def test_shipped_databases_stay_in_rollback_mode():
    """A WAL-mode file opened read-only needs its -shm beside it: a server that cannot write the directory it was
    installed to (site-packages owned by root) got "attempt to write a readonly database" and served heuristic
    defaults for every op (s61, as user nobody). `db verify` opened files read-write and so switched them to WAL, and
    both shipped files were; it now opens them read-only. The shipped files, and an export after verify and lookup,
    are rollback-mode files that leave nothing beside them."""
    from k3tune.shipped import tuning_db_dir
    from k3tune.store.db import journal_mode

    for f in sorted(tuning_db_dir().glob("*.sqlite")):
        assert journal_mode(f) == "delete", f"{f.name} is in WAL mode: PRAGMA journal_mode=DELETE on it"
    assert not list(tuning_db_dir().glob("*.sqlite-*"))


def test_an_export_stays_in_rollback_mode_through_verify_and_lookup(tmp_path, capsys):
    from k3tune.store.db import journal_mode

    db, out = str(tmp_path / "s.sqlite"), tmp_path / "out.sqlite"
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", db]) == 0
    assert main(["db", "export", db, str(out)]) == 0
    assert main(["db", "verify", str(out), "--spec", "smoke"]) == 0
    assert main(["lookup", "--db", str(out), "--simulate", "gb300", "--tp", "8", "--batch", "1", "--json"]) == 0
    assert journal_mode(out) == "delete"
    assert sorted(p.name for p in tmp_path.glob("out.sqlite*")) == ["out.sqlite"]


def test_warm_from_into_a_database_that_does_not_exist_is_refused_before_making_it(tmp_path, capsys):
    """`--warm-from` seeds from another GPU's winners in the database swept into; naming a new file made an empty
    database there and then said it held no such hardware. Now nothing is made."""
    db = tmp_path / "h100.sqlite"
    assert main(["sweep", "--simulate", "h100", "--spec", "smoke", "--db", str(db), "--warm-from", "H200"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --warm-from H200:") and "does not exist" in err and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_shipped_h100_database_is_current():
    """The H100's own table, swept on an H100 from the H200's winners (`--warm-from H200`; sessions 48-49), then
    re-swept with `gemm.wgmma_cktrig` (sessions 57-58): current, covering its specs."""
    from k3tune.shipped import configs_dir, tuning_db_dir

    db = str(tuning_db_dir() / "h100.sqlite")
    for spec in ("sweep_h200_dense.toml", "sweep_h200_moe_bf16.toml", "sweep_h200_moe_mxfp4.toml",
                 "sweep_h200_moe_bf16_zipf.toml", "sweep_h200_moe_mxfp4_zipf.toml"):
        assert main(["db", "verify", db, "--spec", str(configs_dir() / spec)]) == 0


def _shipped_lookup(monkeypatch, capsys, tmp_path, hw: str, tp: int, batch: int) -> dict:
    """`k3tune lookup --hardware HW --json` from an empty directory with no database set."""
    monkeypatch.chdir(tmp_path)
    for var in ("K3TUNE_DB", "K3TUNE_SERVE_DB", "K3TUNE_HARDWARE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["lookup", "--tp", str(tp), "--batch", str(batch), "--hardware", hw, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _shipped_sources(monkeypatch, capsys, tmp_path, hw: str, tp: int, batch: int) -> tuple[dict, list]:
    """The shipped lookup's source of each op, and its warnings."""
    look = _shipped_lookup(monkeypatch, capsys, tmp_path, hw, tp, batch)
    return {o["op"]: o["source"] for o in look["ops"]}, look["warnings"]


def _shipped_block_median(name: str, problem: str) -> float:
    """The median of `problem`'s winner in the shipped tuning_db/NAME.sqlite, read with plain SQL."""
    import sqlite3

    from k3tune.shipped import tuning_db_dir

    with closing(sqlite3.connect(f"file:{tuning_db_dir() / name}.sqlite?mode=ro", uri=True)) as c:
        (us,) = c.execute("SELECT w.median_us FROM winners w JOIN problems p ON p.id = w.problem_id "
                          "WHERE p.key = ?", (problem,)).fetchone()
    return us


def test_lookup_hardware_h100_serves_its_own_dense_table_and_blocks(monkeypatch, capsys, tmp_path):
    """On an H100 the dense ops and the MoE block come from the H100's own table, the block never as the H200's
    winner; the ops neither card has tuned (attention decode, the TP16 all-reduce) are heuristic defaults on both."""
    ops = {hw: {o["op"]: o for o in _shipped_lookup(monkeypatch, capsys, tmp_path, hw, 16, 8)["ops"]}
           for hw in ("h100", "h200")}
    untuned = {op for op, o in ops["h200"].items() if o["source"] != "measured"}
    assert untuned == {"kda.decode", "mla.decode", "tp.allreduce"}
    assert {op for op, o in ops["h100"].items() if o["source"] != "measured"} == untuned
    block = ops["h100"]["moe.block"]
    assert block["median_us"] == _shipped_block_median("h100", block["tuned_problem"])
    assert block["median_us"] != _shipped_block_median("h200", block["tuned_problem"])


def test_lookup_serves_the_late_trigger_picks_of_each_shipped_gpu(monkeypatch, capsys, tmp_path):
    """`gemm.wgmma_cktrig` was landed on the H100 (session 60), then the H200 (session 67), and moved to FAMILIES
    once every shipped table had it: each shipped table, re-swept with it, serves its M = 16 picks as measured
    winners (current: the family's move keyed the H100 and H200 tables as their landing had)."""
    for hw in ("h100", "h200"):
        ops = {o["op"]: o for o in _shipped_lookup(monkeypatch, capsys, tmp_path, hw, 8, 16)["ops"]}
        for op in ("mla.q_a", "kda.o_proj", "moe.shared_w13"):
            assert (ops[op]["family"], ops[op]["source"]) == ("gemm.wgmma_cktrig", "measured"), (hw, op, ops[op])
    assert "gemm.wgmma_cktrig" in kernels.FAMILIES and not kernels.LANDED_ON


def test_lookup_reads_what_the_sweep_wrote_by_default(tmp_path, monkeypatch, capsys):
    """The README's flow: `k3tune sweep --simulate gb300` writes ./k3tune.sqlite, and `k3tune lookup --simulate gb300`
    with no --db serves its winners (it had served heuristic defaults: its default was only the shipped DB)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("K3TUNE_DB", raising=False)
    assert main(["sweep", "--gpus", "2", "--simulate", "gb300", "--spec", "smoke", "--json"]) == 0
    capsys.readouterr()
    assert main(["lookup", "--tp", "16", "--batch", "8", "--draft", "1", "--simulate", "gb300", "--json"]) == 0
    look = json.loads(capsys.readouterr().out)
    assert look["db"] == "k3tune.sqlite" and not look["warnings"]
    assert {o["op"]: o for o in look["ops"]}["kda.qkvg_proj"]["source"] == "simulated"

    # that file holds no H200 winners: `lookup --hardware h200` served heuristic defaults from it (s66), not the
    # shipped H200 table; it now passes it over, and says so; named with --db, it is still used
    argv = ["lookup", "--tp", "16", "--batch", "8", "--hardware", "h200", "--json"]
    assert main(argv) == 0
    look = json.loads(capsys.readouterr().out)
    assert look["db"] == "shipped" and look["warnings"][0].startswith("./k3tune.sqlite not used (")
    assert "no measured winners of NVIDIA H200" in look["warnings"][0]
    assert {o["op"]: o for o in look["ops"]}["kda.qkvg_proj"]["source"] == "measured"
    assert main([*argv, "--db", "k3tune.sqlite"]) == 0
    look = json.loads(capsys.readouterr().out)
    assert look["db"] == "k3tune.sqlite" and {o["op"]: o for o in look["ops"]}["kda.qkvg_proj"]["source"] != "measured"
    from k3tune.shipped import tuning_db_dir
    (tmp_path / "k3tune.sqlite").write_text("not a database\n")  # one it cannot read: passed over, and why
    assert main(argv) == 0
    look = json.loads(capsys.readouterr().out)
    assert look["db"] == "shipped" and "is not a SQLite database" in look["warnings"][0], look["warnings"]
    shutil.copy(tuning_db_dir() / "h200.sqlite", tmp_path / "k3tune.sqlite")  # a local file of H200 winners is used
    assert main(argv) == 0
    look = json.loads(capsys.readouterr().out)
    assert look["db"] == "k3tune.sqlite" and not look["warnings"]


def test_lookup_refuses_a_named_file_that_is_no_tuning_database(tmp_path, monkeypatch, capsys):
    """`k3tune lookup --db notes.txt` (a wrong path that exists) served heuristic defaults, exit 0, and with no GPU it
    did not even warn; a named --db that is not a SQLite file, or has no k3tune schema, is a one-line error (exit 4).
    Warnings are printed once, below the table (the selector's log line went to stderr as well)."""
    import sqlite3

    monkeypatch.chdir(tmp_path)
    for var in ("K3TUNE_DB", "K3TUNE_SERVE_DB", "K3TUNE_HARDWARE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "notes.txt").write_text("not a database\n")
    sqlite3.connect(tmp_path / "other.sqlite").execute("CREATE TABLE t (x)").connection.commit()
    for name, msg in (("notes.txt", "is not a SQLite database"), ("other.sqlite", "no k3tune schema")):
        assert main(["lookup", "--tp", "16", "--batch", "8", "--db", name]) == 4
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("K3TUNE_DB", str(tmp_path))  # named through the environment: a directory
    assert main(["lookup", "--tp", "16", "--batch", "8"]) == 4
    assert "is a directory" in capsys.readouterr().err
    monkeypatch.delenv("K3TUNE_DB")
    assert main(["lookup", "--tp", "16", "--batch", "8"]) == 0  # without a GPU: defaults, and a warning
    out, err = capsys.readouterr()
    warned = [line for line in out.splitlines() if line.startswith("warning:")]
    assert not err.strip() and len(warned) == len(set(warned)), (out, err)


def test_lookup_hardware_serves_that_gpus_database(tmp_path, monkeypatch, capsys):
    """`k3tune lookup --hardware h200` on a machine without that GPU serves the database shipped for it (it had
    served heuristic defaults unless --db was given); a database without that GPU's winners serves heuristic defaults
    with a warning that says so (it had said no GPU was detected), never another GPU's winners."""
    sources, warnings = _shipped_sources(monkeypatch, capsys, tmp_path, "h200", 8, 4)
    assert sources["moe.block"] == "measured" and sources["kda.o_proj"] == "measured", warnings
    db = str(tmp_path / "sim.sqlite")
    assert main(["sweep", "--gpus", "1", "--simulate", "gb300", "--spec", "smoke", "--db", db, "--json"]) == 0
    capsys.readouterr()
    assert main(["lookup", "--tp", "16", "--batch", "8", "--hardware", "h200", "--db", db, "--json"]) == 0
    look = json.loads(capsys.readouterr().out)
    assert [w for w in look["warnings"] if "no measured winners of NVIDIA H200" in w], look["warnings"]
    assert {o["source"] for o in look["ops"]} == {"heuristic default"}


def test_export_and_merge_refuse_to_overwrite_a_source_or_write_a_url(tmp_path, capsys, monkeypatch):
    """`db export a.sqlite a.sqlite` replaced the sweep's database with its winners (every trial lost), and an
    export to a URL wrote a file at ./postgresql:/...: both are one-line errors now, and the source is untouched.
    Until s62 `db merge` to a URL still wrote ./postgresql:/u:pw@h/k3tune (and said it had merged into the URL)."""
    import sqlite3

    monkeypatch.chdir(tmp_path)  # where a collapsed URL would have become a file

    db = tmp_path / "a.sqlite"
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(db), "--json"]) == 0
    capsys.readouterr()
    trials = sqlite3.connect(db).execute("SELECT count(*) FROM trials").fetchone()[0]
    assert trials > 0
    for argv in (["db", "export", str(db), str(db)], ["db", "export", str(db), str(tmp_path / "." / "a.sqlite")],
                 ["db", "merge", str(db), str(db)]):
        assert main(argv) == 4
        assert "is also a source" in capsys.readouterr().err
    assert sqlite3.connect(db).execute("SELECT count(*) FROM trials").fetchone()[0] == trials
    for verb in (["export", str(db)], ["merge"]):
        argv = ["db", verb[0], *verb[1:], "postgresql://u:pw@h/k3tune", *([str(db)] if verb == ["merge"] else [])]
        assert main(argv) == 4, argv
        err = capsys.readouterr().err
        assert "give a path, not postgresql://u:***@h/k3tune" in err and "pw" not in err
    assert not [p for p in tmp_path.rglob("*") if "postgresql" in str(p)]


def test_a_database_urls_password_stays_out_of_every_message(capsys):
    """Errors about a PostgreSQL database quoted its URL whole, password included, into the operator's terminal and
    logs (`cannot read database postgresql://tuner:<password>@...`); they show it as SQLAlchemy hides it now."""
    url = "postgresql://tuner:sekrit@127.0.0.1:1/k3tune"  # nothing listens on port 1: refused at once
    for argv in (["db", "report", url], ["db", "verify", url], ["sweep", "--simulate", "gb300", "--spec", "smoke",
                                                               "--db", url], ["lookup", "--tp", "8", "--batch", "1",
                                                                              "--db", url]):
        assert main(argv) != 0, argv
        out = capsys.readouterr()
        assert "sekrit" not in out.out + out.err and "tuner:***@127.0.0.1:1" in out.out + out.err, argv


def test_a_database_server_that_never_answers_fails_the_command(monkeypatch, capsys):
    """A PostgreSQL server that takes the connection and never answers (overloaded, or the wrong port of a proxy)
    hung every command forever: libpq waits without a limit unless told."""
    import socket

    from k3tune.store import db as store_db

    monkeypatch.setattr(store_db, "CONNECT_TIMEOUT_S", 1)
    with closing(socket.socket()) as mute:  # listens, accepts into its backlog, never speaks
        mute.bind(("127.0.0.1", 0))
        mute.listen(4)
        url = f"postgresql://tuner@127.0.0.1:{mute.getsockname()[1]}/k3tune"
        for argv in (["db", "show", url], ["lookup", "--tp", "8", "--batch", "1", "--db", url]):
            assert main(argv) == 4, argv
            assert "connection timeout expired" in capsys.readouterr().err


def test_merge_reports_the_trials_it_added_and_diff_summarises_in_words(tmp_path, capsys):
    """`db merge all.sqlite a.sqlite a.sqlite` said "2324 trials" while the file held 1162: it counted the rows it
    tried to insert, and the duplicates are (rightly) skipped. `db diff` of two equal databases printed a Python
    dict ("changes: {'same': 48}") over an empty table."""
    import sqlite3

    db = tmp_path / "a.sqlite"
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(db), "--json"]) == 0
    capsys.readouterr()
    trials = sqlite3.connect(db).execute("SELECT count(*) FROM trials").fetchone()[0]
    winners = sqlite3.connect(db).execute("SELECT count(*) FROM winners").fetchone()[0]
    assert main(["db", "merge", str(tmp_path / "all.sqlite"), str(db), str(db)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{trials} trials added ({trials} already there), {winners} winners added" in out
    assert sqlite3.connect(tmp_path / "all.sqlite").execute("SELECT count(*) FROM trials").fetchone()[0] == trials
    assert main(["db", "diff", str(db), str(tmp_path / "all.sqlite")]) == 0
    out = capsys.readouterr().out
    assert f"{winners} problems: {winners} same" in out and "{" not in out and "problem" in out.splitlines()[0]
    assert "┃" not in out  # no empty table


def test_diff_lists_regressions_first_and_names_the_hardware_where_there_are_several(tmp_path, capsys):
    """`db diff` listed rows in key order and printed the first 200: a regression sorting after 200 additions was
    counted but never shown. Regressions now lead, and a database of two hardware kinds names each row's."""
    import sqlite3

    old, new = tmp_path / "old.sqlite", tmp_path / "new.sqlite"
    for hw in ("gb300", "h200"):
        assert main(["sweep", "--simulate", hw, "--spec", "smoke", "--db", str(new), "--json"]) == 0
    capsys.readouterr()
    shutil.copy(new, old)
    with closing(sqlite3.connect(old)) as c, c:  # old lacks kda.*: they sort first, as additions in new
        c.execute("DELETE FROM winners WHERE problem_id IN (SELECT id FROM problems WHERE op LIKE 'kda.%')")
    with closing(sqlite3.connect(new)) as c, c:
        key = c.execute("SELECT p.key FROM winners w JOIN problems p ON p.id = w.problem_id WHERE p.op = "
                        "'moe.shared_w13' ORDER BY p.key DESC LIMIT 1").fetchone()[0]
        c.execute("UPDATE winners SET median_us = 2 * median_us WHERE problem_id = (SELECT id FROM problems "
                  "WHERE key = ?) AND hardware_id = (SELECT min(id) FROM hardware)", (key,))
    assert main(["db", "diff", str(old), str(new), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["change"] for r in rows[:1]] == ["regression"] and rows[0]["problem"] == key
    assert {r["change"] for r in rows[1:]} == {"added"}
    assert main(["db", "diff", str(old), str(new)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split("┃")[2].strip() for line in out if line.startswith("┃")] == ["hardware"]
    body = [line for line in out if line.startswith("│")]
    assert body[0].split("│")[1].strip() == "regression"
    assert {line.split("│")[2].strip().split(" [")[0] for line in body} >= {"sim:NVIDIA GB300|cc10.3|160sm|288GiB"}
    # the regression is the same kernel timed slower (its median doubled): said so, the choice did not change
    assert body[0].rstrip().rstrip("│").split("│")[-1].strip() == "same kernel"
    assert rows[0]["same_kernel"] and rows[0]["a_kernel"] == rows[0]["b_kernel"]


def test_db_redo_marks_winners_for_the_next_sweep_and_refuses_a_pattern_matching_nothing(tmp_path, capsys):
    """`k3tune db redo` (was bench/redo_problems.py, which the sweep's own advice named though a pip install has no
    bench/): the matching problems' winners marked, the next sweep decides exactly those again; a pattern matching
    nothing, or a missing database, is one line and a non-zero exit, the file unchanged."""
    import hashlib

    db = _smoke_db(tmp_path / "a.sqlite", capsys)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    assert main(["db", "redo", str(db), "nope%"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no problem" in err and "nope%" in err and "not * or ?" not in err
    assert main(["db", "redo", str(db), "kda.o_proj*"]) != 0  # a shell glob: said only "no problem"
    assert "(SQL LIKE: % for any run of characters, _ for one; not * or ?)" in capsys.readouterr().err
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert main(["db", "redo", str(tmp_path / "missing.sqlite"), "kda.o_proj[%"]) != 0
    assert "database not found" in capsys.readouterr().err
    assert main(["db", "redo", str(db), "kda.o_proj[%", "--json"]) == 0
    n = json.loads(capsys.readouterr().out)["stale_winners"]
    assert n > 0
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(db), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tuned_now"] == n and out["already_done"] == out["problems"] - n


def test_verify_against_another_spec_names_the_specs_the_database_was_swept_with(tmp_path, capsys):
    """`k3tune db verify tuning_db/h200.sqlite` checks the default spec's 1124 problems and says NOT OK (214 covered)
    with no hint that the database was swept with other specs; it now names them (its runs record their digests)."""
    db = _smoke_db(tmp_path / "a.sqlite", capsys)
    assert main(["db", "verify", str(db)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "NOT OK" in out and "this database was swept with spec smoke: `--spec NAME`" in out
    assert main(["db", "verify", str(db), "--spec", "smoke"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "swept with" not in out
    assert main(["db", "show", str(db)]) == 0  # its counts in words, not Python dicts
    out = capsys.readouterr().out
    assert re.search(r"trials: \d+ ok", out) and "{" not in out, out
    ship = tmp_path / "ship.sqlite"
    assert main(["db", "export", str(db), str(ship)]) == 0 and main(["db", "show", str(ship)]) == 0
    assert "trials: none (a winners-only export)" in capsys.readouterr().out


def test_verify_names_the_spec_file_of_a_digest_no_configs_spec_has(tmp_path, capsys, monkeypatch):
    """The shipped H200 table's runs were swept with specs edited since (or temporary ones): `db verify` listed them
    as bare digests, no clue which `--spec` to check. It now names the --spec each run's command gave."""
    import sys

    from k3tune.shipped import configs_dir

    spec = tmp_path / "my_spec.toml"
    spec.write_text((configs_dir() / "sweep_smoke.toml").read_text().replace("budget = 12", "budget = 11"))
    db = tmp_path / "a.sqlite"
    argv = ["sweep", "--simulate", "gb300", "--spec", str(spec), "--db", str(db), "--json"]
    monkeypatch.setattr(sys, "argv", ["k3tune", *argv])  # what the run records as its command
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["db", "verify", str(db)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"this database was swept with spec {spec} (digest " in out, out
    assert main(["db", "verify", str(db), "--json"]) == 1
    assert list(json.loads(capsys.readouterr().out)["swept_spec_args"].values()) == [str(spec)]


def test_paths_and_names_with_brackets_are_printed_as_they_are(tmp_path, capsys, monkeypatch):
    """Rich read every printed string as markup: a database at `d[/x].sqlite` crashed the sweep at its summary line
    with a MarkupError traceback (after every trial was stored), and bracketed words vanished from what was printed:
    the run status ('[done]') in `db show`, the backend ('[simulated]') in `db verify`."""
    monkeypatch.setenv("COLUMNS", "250")
    (tmp_path / "d[").mkdir()
    db = str(tmp_path / "d[" / "x].sqlite")
    assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", db]) == 0
    assert f"-> {db}" in capsys.readouterr().out
    assert main(["db", "show", db]) == 0
    out = capsys.readouterr().out
    assert "run 1 [done] simulated on " in out, out  # (the command is pytest's argv here)
    assert main(["db", "verify", db, "--spec", "smoke"]) == 0
    assert "288GiB [simulated]: 48/48" in capsys.readouterr().out
    for argv in (["db", "export", db, str(tmp_path / "d[" / "e].sqlite")],
                 ["db", "merge", str(tmp_path / "d[" / "m].sqlite"), db],
                 ["lookup", "--tp", "16", "--batch", "8", "--simulate", "gb300", "--db", db]):
        assert main(argv) == 0
        assert "d[/" in capsys.readouterr().out, argv


def test_export_replaces_an_earlier_export_but_not_a_sweep_database_or_another_file(tmp_path, capsys):
    """`db export ship.sqlite sweep2.sqlite` (arguments swapped, or a name already taken by another sweep) silently
    replaced that sweep's trials with winners; and any file at DEST (a README) was replaced. Now an existing DEST is
    replaced only when it is an earlier export (re-shipping), or with --force."""
    import contextlib
    import gc
    import sqlite3

    def count(path):
        with contextlib.closing(sqlite3.connect(path)) as c:
            return c.execute("SELECT count(*) FROM trials").fetchone()[0]

    sweep, other = tmp_path / "sweep.sqlite", tmp_path / "other.sqlite"
    for db in (sweep, other):
        assert main(["sweep", "--simulate", "gb300", "--spec", "smoke", "--db", str(db), "--json"]) == 0
    capsys.readouterr()
    trials = count(other)
    ship = tmp_path / "ship.sqlite"
    assert main(["db", "export", str(sweep), str(ship)]) == 0
    assert main(["db", "export", str(sweep), str(ship)]) == 0  # an earlier export is replaced
    capsys.readouterr()
    shipped = ship.read_bytes()
    # a misspelt --hardware, or nothing current, wrote an empty export over the earlier one (rc 0, until s62)
    assert main(["db", "export", str(sweep), str(ship), "--hardware", "gb30O"]) == 4
    err = capsys.readouterr().err
    assert "--hardware 'gb30O' matches no hardware" in err and "GB300" in err and len(err.strip().splitlines()) == 1
    stale = tmp_path / "stale.sqlite"
    shutil.copy(sweep, stale)
    with contextlib.closing(sqlite3.connect(stale)) as c, c:
        c.execute("UPDATE winners SET op_digest = 'stale0000000000'")
    assert main(["db", "export", str(stale), str(ship)]) == 4
    assert "nothing to export" in capsys.readouterr().err and ship.read_bytes() == shipped
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ship.sqlite.")]  # no temp file left
    assert main(["db", "export", str(stale), str(ship), "--stale", "--hardware", "gb300"]) == 0  # in any case
    assert main(["db", "export", str(sweep), str(ship)]) == 0
    capsys.readouterr()
    assert main(["db", "export", str(sweep), str(other)]) == 4
    assert f"holds {trials} trials" in capsys.readouterr().err
    assert count(other) == trials
    notes = tmp_path / "NOTES.md"
    notes.write_text("lab notebook\n")
    assert main(["db", "export", str(sweep), str(notes)]) == 4
    assert "is not a tuning database" in capsys.readouterr().err
    assert notes.read_text() == "lab notebook\n"
    held = sqlite3.connect(other)  # a database open elsewhere (its WAL live) is not replaced under its reader
    held.execute("PRAGMA journal_mode=WAL")
    held.execute("BEGIN")
    held.execute("SELECT count(*) FROM trials").fetchone()
    assert main(["db", "export", str(sweep), str(other), "--force"]) == 4
    assert "is open elsewhere" in capsys.readouterr().err
    held.close()
    gc.collect()  # the in-process sweeps' engines
    assert main(["db", "export", str(sweep), str(other), "--force"]) == 0
    assert count(other) == 0  # read through no stale WAL (s29: "database disk image is malformed")
    assert not Path(f"{other}-wal").exists()
