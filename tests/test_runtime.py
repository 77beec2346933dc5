"""The runtime selector: dense tables, sources, nearest buckets, and safe fallbacks that never raise in the
serving path."""

import logging
import sqlite3

import pytest

from k3tune.errors import ConfigError
from k3tune.plan import hardware, model, spec
from k3tune.runtime import Selector
from k3tune.search.driver import SweepOptions, run_sweep
from k3tune.store import db as store_db

GB300 = hardware.spec("gb300")


@pytest.fixture(scope="module")
def smoke_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("rt") / "smoke.sqlite"
    db = store_db.open_db(path)
    run_sweep(SweepOptions(spec.load("smoke"), model.load(), db, "simulated", 2, hw=GB300))
    db.dispose()
    return path


def test_tuned_entries_are_served_as_simulated(smoke_db):
    sel = Selector.load(smoke_db, simulated="gb300")
    c = sel.lookup("kda.qkvg_proj", tp=16, batch=8, draft=1)
    assert c.source == "simulated" and c.problem == c.tuned_problem == "kda.qkvg_proj[M=16,N=3072,K=7168]"
    assert c.median_us > 0
    c1 = sel.lookup("kda.qkvg_proj", tp=8, batch=1)
    assert c1.source == "simulated" and c1.problem.startswith("kda.qkvg_proj[M=1,")


def test_every_deployment_is_covered_without_exceptions(smoke_db):
    sel = Selector.load(smoke_db, simulated="gb300")
    for tp in (8, 16):
        for dcp in (1, 2, 4, 8):
            for batch in range(1, 65):
                for draft in range(8):
                    for op in ("kda.o_proj", "mla.decode", "moe.block", "kda.decode"):
                        c = sel.lookup(op, tp, batch, draft, dcp, 20000)
                        assert c.family


def test_a_spec_with_small_buckets_serves_every_deployment(smoke_db):
    """Loaded with the spec its table was swept under (smoke: tokens up to 16, batch buckets 1 and 8), the selector
    serves every deployment: those its buckets cover from the table, larger ones by the safe default at their true
    size (no bucket holds them). Until s61 every lookup raised "17 is above the largest bucket 16"."""
    sel = Selector.load(smoke_db, simulated="gb300", spec=spec.load("smoke"))
    assert sel.lookup("kda.qkvg_proj", tp=16, batch=8, draft=1).source == "simulated"
    big = sel.lookup("kda.qkvg_proj", tp=16, batch=64, draft=7)
    assert big.source == "heuristic default" and big.problem.startswith("kda.qkvg_proj[M=512,")
    assert sel.warnings == [f"kda.qkvg_proj: {big.problem} has no tuned bucket at or above it; serving the "
                            "heuristic default"]
    assert sel.lookup("kda.decode", tp=8, batch=9).problem.endswith("batch=9,qlen=1]")
    for tp in (8, 16):
        for batch in (1, 3, 8, 9, 17, 64):
            for draft in (0, 1, 2, 7):
                for op in ("kda.o_proj", "mla.decode", "moe.block", "kda.decode"):
                    assert sel.lookup(op, tp, batch, draft, 1, 20000).family


def test_untuned_size_uses_nearest_bucket_above_and_warns_once(smoke_db, caplog):
    sel = Selector.load(smoke_db, simulated="gb300")
    with caplog.at_level(logging.WARNING, logger="k3tune.runtime"):
        c = sel.lookup("kda.decode", tp=16, batch=3)  # batch 4 bucket: the smoke sweep tuned batch in {1, 8}
        sel.lookup("kda.decode", tp=16, batch=4)
    assert c.source == "nearest bucket (simulated)" and "batch=8" in c.tuned_problem and "batch=4" in c.problem
    assert sum("untuned" in r.message for r in caplog.records) == 1


def test_a_context_above_every_bucket_is_served_the_largest_with_a_word(smoke_db):
    """A context longer than the spec's largest context bucket (K3 allows 1M tokens; the default spec tunes up to
    128k) was served that bucket's choice without a word; now once per op it says so."""
    sel = Selector.load(smoke_db, simulated="gb300", spec=spec.load("smoke"))
    top = sel.context_bucket(None)
    assert sel.lookup("mla.decode", 16, 8, 0, 1, top).source == "simulated" and not sel.warnings
    c = sel.lookup("mla.decode", 16, 8, 0, 1, top + 1)
    assert sel.lookup("mla.decode", 16, 1, 0, 1, 4 * top).source == "simulated"
    assert c == sel.lookup("mla.decode", 16, 8, 0, 1, top) and sel.context_bucket(top + 1) == top
    assert sel.warnings == [f"mla.decode: context {top + 1} is above the spec's largest context bucket {top}; "
                            "serving that bucket's choice (add a longer context to the sweep spec's matrix to tune it)"]


def test_simulated_winners_are_never_served_as_measurements(smoke_db):
    fp = hardware.Fingerprint("NVIDIA GB300", "10.3", 160, 288, "580", "13.0", False)
    sel = Selector.load(smoke_db, fingerprint=fp)
    c = sel.lookup("kda.qkvg_proj", tp=16, batch=8, draft=1)
    assert c.source == "heuristic default" and c.family == "gemm.cublas"
    assert any("not NVIDIA GB300" in w for w in sel.warnings)


def test_no_database_and_other_hardware_give_defaults(smoke_db, tmp_path):
    sel = Selector.load(tmp_path / "missing.sqlite", simulated="gb300")
    assert sel.lookup("moe.block", 16, 4).source == "heuristic default"
    assert sel.warnings
    other = Selector.load(smoke_db, simulated="h100")
    assert other.lookup("kda.o_proj", 16, 8).source == "heuristic default"
    assert any("tuned for" in w for w in other.warnings)


def test_corrupt_database_gives_defaults(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"SQLite format 3\x00" + b"\x07" * 5000)
    sel = Selector.load(bad, simulated="gb300")
    assert sel.lookup("kda.o_proj", 8, 1).source == "heuristic default"
    assert any("cannot" in w for w in sel.warnings)


def test_an_older_schema_is_served_with_a_note_and_a_newer_one_is_not(smoke_db, tmp_path):
    """Upgrading k3tune (schema 0005 added winners.method) sent a server reading a 0004 database back to heuristic
    defaults until someone ran `k3tune db upgrade`. The serving read uses columns every schema since 0001 has: an
    older known schema is served as it is, with a note; a newer one still gives defaults with a warning."""
    import shutil

    old = tmp_path / "old.sqlite"
    shutil.copy(smoke_db, old)
    with sqlite3.connect(old) as c:  # what a 0004 database looks like: no winners.method
        c.execute("ALTER TABLE winners DROP COLUMN method")
        c.execute("UPDATE alembic_version SET version_num = '0004'")
    sel = Selector.load(old, simulated="gb300")
    assert sel.lookup("kda.o_proj", 16, 8).source == "simulated"
    assert [w for w in sel.warnings if "schema 0004 is older than" in w and "k3tune db upgrade" in w], sel.warnings
    with sqlite3.connect(old) as c:
        c.execute("UPDATE alembic_version SET version_num = '0099'")
    sel = Selector.load(old, simulated="gb300")
    assert sel.lookup("kda.o_proj", 16, 8).source == "heuristic default"
    assert [w for w in sel.warnings if "newer than this k3tune" in w], sel.warnings
    assert not [w for w in Selector.load(smoke_db, simulated="gb300").warnings if "older than" in w]


def test_stale_digest_and_out_of_space_winners_are_not_served(smoke_db, tmp_path):
    path = tmp_path / "edited.sqlite"
    src, dst = sqlite3.connect(smoke_db), sqlite3.connect(path)
    src.backup(dst)
    src.close()
    pid_qkv = dst.execute("select id from problems where key='kda.qkvg_proj[M=16,N=3072,K=7168]'").fetchone()[0]
    pid_o = dst.execute("select id from problems where key='kda.o_proj[M=16,N=7168,K=768]'").fetchone()[0]
    dst.execute("update winners set op_digest='0000' where problem_id=?", (pid_qkv,))
    dst.execute("update winners set family='gemm.smallm', params='{\"rows_per_cta\": 3, \"warps\": 4, \"split_k\": 1}' "
                "where problem_id=?", (pid_o,))
    dst.commit()
    dst.close()
    sel = Selector.load(path, simulated="gb300")
    assert sel.lookup("kda.qkvg_proj", 16, 8, 1).source == "heuristic default"
    assert sel.lookup("kda.o_proj", 16, 8, 1).family != "gemm.smallm" or \
        dict(sel.lookup("kda.o_proj", 16, 8, 1).params)["rows_per_cta"] != 3
    assert [w for w in sel.warnings if "1 problems have only stale winners" in w], sel.warnings
    assert any("outside the declared space" in w for w in sel.warnings)


def test_a_stale_row_beside_a_current_winner_is_superseded_not_warned_of(smoke_db, tmp_path):
    """s36: a sweep's database keeps bench/redo_problems.py's marks (op digest "redo") after the redo decided those
    problems; every load said "7 winners are stale ...: defaults serve them" while the new winners served them."""
    path = tmp_path / "redone.sqlite"
    src, dst = sqlite3.connect(smoke_db), sqlite3.connect(path)
    src.backup(dst)
    src.close()
    cols = [r[1] for r in dst.execute("pragma table_info(winners)") if r[1] not in ("id", "op_digest")]
    key = "kda.o_proj[M=16,N=7168,K=768]"
    dst.execute(f"insert into winners ({', '.join(cols)}, op_digest) select {', '.join(cols)}, 'redo' from winners "
                "where problem_id = (select id from problems where key = ?)", (key,))
    dst.commit()
    assert dst.execute("select count(*) from winners where op_digest = 'redo'").fetchone()[0] == 1
    dst.close()
    sel = Selector.load(path, simulated="gb300")
    assert sel.lookup("kda.o_proj", 16, 8, 1).source != "heuristic default"
    assert not [w for w in sel.warnings if "stale" in w], sel.warnings


@pytest.mark.parametrize("args, msg", [
    (dict(op="kda.o_proj", tp=8, batch=0), "batch 0"),
    (dict(op="kda.decode", tp=8, batch=65), "batch 65"),
    (dict(op="kda.o_proj", tp=8, batch=513), "batch 513"),  # a dense op: up to 512 tokens (see below)
    (dict(op="kda.o_proj", tp=8, batch=65, draft=7), "batch 65"),
    (dict(op="kda.o_proj", tp=8, batch=4, dcp=16), "dcp 16"),
    (dict(op="kda.o_proj", tp=8, batch=4, draft=9), "draft length 9"),
    (dict(op="nope", tp=8, batch=4), "unknown op"),
    (dict(op="kda.o_proj", tp=5, batch=4), "tp 5 does not divide"),
    (dict(op="mla.decode", tp=8, batch=4, context=0), "context 0 must be a positive"),  # was served from 8192
    (dict(op="mla.decode", tp=8, batch=4, context=-5), "context -5 must be a positive"),
    # sizes that are not integers were TypeErrors from the tables (float batch, str batch or context)
    (dict(op="kda.o_proj", tp=8, batch=2.0), "must be integers, not .*batch=2.0"),
    (dict(op="kda.decode", tp=8, batch="4"), "must be integers, not .*batch='4'"),
    (dict(op="mla.decode", tp=8, batch=4, context="8192"), "must be integers, not .*context='8192'"),
    (dict(op="kda.o_proj", tp=8.0, batch=4), "must be integers, not tp=8.0"),
])
def test_bad_lookups_raise_clear_errors(smoke_db, args, msg):
    sel = Selector.load(smoke_db, simulated="gb300")
    with pytest.raises(ConfigError, match=msg):
        sel.lookup(**args)


def test_numpy_integer_sizes_are_served_as_ints(smoke_db):
    import numpy as np

    sel = Selector.load(smoke_db, simulated="gb300")
    for op in ("kda.o_proj", "kda.decode", "mla.decode"):
        a = sel.lookup(op, np.int64(16), np.int32(8), draft=np.int64(1), context=np.int64(32768))
        b = sel.lookup(op, 16, 8, draft=1, context=32768)
        assert (a.problem, a.family, a.params, a.source) == (b.problem, b.family, b.params, b.source), op


def test_a_dense_op_is_looked_up_by_tokens_up_to_512(smoke_db):
    """A measured MoE block at M tokens builds the runtime executor with batch M, no draft, and the executor asks the
    selector for its dense kernels at that batch: M > 64 (a spec with drafts: up to 512 tokens) was refused, so every
    such block trial failed on a GPU. A dense op is keyed by tokens per step alone: batch M, no draft, is served what
    batch M / (1 + d) with draft d is; an attention op still takes batches up to 64."""
    sel = Selector.load(smoke_db, simulated="gb300")
    for op in ("kda.o_proj", "moe.shared_w13", "moe.latent_up"):
        for tokens, batch, draft in ((96, 48, 1), (512, 64, 7), (128, 64, 1), (16, 8, 1)):
            a, b = sel.lookup(op, 16, tokens), sel.lookup(op, 16, batch, draft)
            assert (a.problem, a.family, a.params) == (b.problem, b.family, b.params), (op, tokens)
    c = sel.lookup("moe.router_latent", 4, 96)  # outside the spec's tp: built on the lookup, as any deployment
    assert c.problem == "moe.router_latent[M=96,N=1120,K=7168]", c.problem
    with pytest.raises(ConfigError, match="tp 5 does not divide"):
        sel.lookup("kda.o_proj", 5, 96)


def test_a_spec_given_without_a_model_serves_the_spec_s_model():
    """``Selector.load(spec=the bf16-expert spec)`` planned with K3's published (MXFP4) config: it served the MXFP4
    blocks' knobs to a bf16 checkpoint. The spec's model config is the default model now."""
    from k3tune.plan import spec
    from k3tune.shipped import tuning_db_dir

    sel = Selector.load(tuning_db_dir() / "h200.sqlite", measured_on="h200", spec=spec.load("h200_moe_bf16"))
    c = sel.lookup("moe.block", tp=8, batch=4)
    assert "format=bf16" in c.problem and c.source == "measured", (c.problem, c.source)


def test_a_block_tuned_under_a_trace_is_served_under_it_by_any_path(tmp_path, monkeypatch):
    """A trace's key names the path the sweep read it from; the serving machine keeps its copy elsewhere. Told the
    same trace (its content) at another path, serving took the blocks tuned for uniform routing instead."""
    import shutil

    from k3tune.plan import hardware, model, spec
    from k3tune.search.driver import SweepOptions, run_sweep
    from k3tune.store.db import open_db

    shipped = spec.configs_dir() / "routing" / "synthetic.jsonl"
    (tmp_path / "sweep").mkdir()
    (tmp_path / "serve").mkdir()
    at_sweep, at_serve = tmp_path / "sweep" / "prod.jsonl", tmp_path / "serve" / "prod.jsonl"
    shutil.copy(shipped, at_sweep)
    shutil.copy(shipped, at_serve)
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [8], "routing": f"trace:{at_sweep}", "ops": ["moe.block"]},
                         "buckets": {"tokens": [8], "batch": [8], "query_len": [1]},
                         "search": {"budget": 4, "samples": 5, "remeasure_top": 1}})
    db = open_db(tmp_path / "t.sqlite")
    assert run_sweep(SweepOptions(sp, model.load(), db, "simulated", 1, hw=hardware.spec("gb300"))).problems_done == 1
    db.close()
    c = Selector.load(tmp_path / "t.sqlite", simulated="gb300", routing=f"trace:{at_serve}").lookup(
        "moe.block", tp=16, batch=8)
    assert c.source == "simulated" and not c.approx and f"routing=trace:{at_serve}@" in c.problem
    other = tmp_path / "serve" / "other.jsonl"  # another trace: one token fewer
    other.write_text(at_serve.read_text().rsplit("\n", 2)[0] + "\n")
    c = Selector.load(tmp_path / "t.sqlite", simulated="gb300", routing=f"trace:{other}").lookup(
        "moe.block", tp=16, batch=8)
    assert c.source == "heuristic default"  # (this database tuned no block for uniform routing)


def test_table_hash_agrees_across_loads_and_changes_with_content(smoke_db, tmp_path):
    a = Selector.load(smoke_db, simulated="gb300")
    b = Selector.load(smoke_db, simulated="gb300")
    assert a.hash == b.hash
    assert Selector.load(tmp_path / "none.sqlite", simulated="gb300").hash != a.hash


def test_the_block_serves_the_routing_it_is_told(smoke_db, tmp_path, monkeypatch):
    """The MoE block's winners are keyed by the routing they were tuned under. Told a routing (argument or
    K3TUNE_ROUTING), the selector serves blocks tuned for it; with none tuned for it, those tuned for uniform
    routing, labelled so (never a heuristic default while a tuned block exists). Dense ops do not depend on it."""
    import shutil

    sel = Selector.load(smoke_db, simulated="gb300", routing="zipf:1.2")
    c = sel.lookup("moe.block", tp=16, batch=8)
    assert c.source == "tuned for uniform routing (simulated)" and c.approx
    assert "routing=zipf:1.2" in c.problem and "routing=uniform" in c.tuned_problem
    assert sel.lookup("kda.qkvg_proj", tp=16, batch=8, draft=1).source == "simulated"
    monkeypatch.setenv("K3TUNE_ROUTING", "zipf:1.2")
    assert Selector.load(smoke_db, simulated="gb300").lookup("moe.block", tp=16, batch=8).source == c.source
    monkeypatch.setenv("K3TUNE_ROUTING", "zipf1.2")  # the error named the routing, not where it came from
    with pytest.raises(ConfigError, match=r"^K3TUNE_ROUTING=zipf1.2: unknown routing 'zipf1.2'"):
        Selector.load(smoke_db, simulated="gb300")
    monkeypatch.delenv("K3TUNE_ROUTING")
    with pytest.raises(ConfigError, match="zipf"):
        Selector.load(smoke_db, simulated="gb300", routing="zipf:-1")

    both = tmp_path / "both.sqlite"  # the same database plus blocks tuned under Zipf routing
    shutil.copy(smoke_db, both)
    db = store_db.open_db(both)
    zipf = spec.from_dict({"matrix": {"tp": [16], "batch": [8], "ops": ["moe.block"], "routing": "zipf:1.2"},
                           "buckets": {"tokens": [8], "batch": [8], "query_len": [1]},
                           "search": {"budget": 4, "samples": 3, "remeasure_top": 1}})
    run_sweep(SweepOptions(zipf, model.load(), db, "simulated", 1, hw=GB300))
    db.dispose()
    tuned = Selector.load(both, simulated="gb300", routing="zipf:1.2").lookup("moe.block", tp=16, batch=8)
    assert tuned.source == "simulated" and tuned.problem == tuned.tuned_problem == c.problem
    assert Selector.load(both, simulated="gb300").lookup("moe.block", tp=16, batch=8).tuned_problem == c.tuned_problem


def test_serve_db_from_the_environment_replaces_the_shipped_one(smoke_db, monkeypatch):
    """K3TUNE_SERVE_DB (what a GPU sweep gives the workers that measure MoE blocks): with no database named, the
    selector reads that one instead of the shipped database; a database named in the call still wins."""
    monkeypatch.delenv("K3TUNE_SERVE_DB", raising=False)
    assert Selector.load(simulated="gb300").lookup("kda.o_proj", 16, 8).source == "heuristic default"  # none shipped
    monkeypatch.setenv("K3TUNE_SERVE_DB", str(smoke_db))
    assert Selector.load(simulated="gb300").lookup("kda.o_proj", 16, 8).source == "simulated"
    monkeypatch.setenv("K3TUNE_SERVE_DB", str(smoke_db) + ".missing")
    assert Selector.load(smoke_db, simulated="gb300").lookup("kda.o_proj", 16, 8).source == "simulated"


def test_no_gpu_and_no_hardware_names_what_the_database_could_serve(smoke_db, monkeypatch):
    """With no GPU found and none named, the selector serves heuristic defaults; the warning said only that, and a
    user holding tuning_db/h200.sqlite was left to guess `--hardware` and its spelling (h200, not "NVIDIA H200")."""
    from k3tune.plan import hardware
    from k3tune.shipped import tuning_db_dir

    monkeypatch.setattr(hardware, "detect", lambda: [])
    monkeypatch.delenv("K3TUNE_SERVE_DB", raising=False)
    cases = ((tuning_db_dir() / "h200.sqlite", "holds measured h200 (measured_on=..., `k3tune lookup --hardware`)"),
             (smoke_db, "holds simulated gb300 (simulated=..., `k3tune lookup --simulate`)"),
             (None, "the shipped tables hold measured h100, h200"))
    for db, said in cases:
        sel = Selector.load(db)
        warned = [w for w in sel.warnings if w.startswith("no GPU detected")]
        assert len(warned) == 1 and said in warned[0], (db, sel.warnings)
        assert sel.lookup("kda.o_proj", 8, 4).source == "heuristic default"
    assert Selector.load(smoke_db, simulated="gb300").lookup("kda.o_proj", 8, 8).source == "simulated"
    assert Selector.load(db=tuning_db_dir() / "h200.sqlite", measured_on="h200").lookup(
        "kda.o_proj", 8, 4).source == "measured"


def test_a_block_above_every_tuned_bucket_is_served_with_a_word():
    """The shipped H200 blocks are tuned up to 64 tokens, the default spec's tables go to 512: a block at batch 33 with
    one draft (66 tokens) was served the stock path from the tables built at load with no warning, where the same
    case outside them (the slow path) had one."""
    from k3tune.plan import model as models
    from k3tune.shipped import tuning_db_dir

    bf16 = models.load(spec.configs_dir() / "kimi_k3_bf16_experts.json")
    sel = Selector.load(tuning_db_dir() / "h200.sqlite", measured_on="h200", model=bf16)
    assert sel.lookup("moe.block", 16, 64).source == "measured" and not sel.warnings, sel.warnings
    c = sel.lookup("moe.block", 16, 33, draft=1)
    assert (c.family, c.source, c.tuned_problem) == ("moe.stock", "heuristic default", None)
    assert sel.warnings == [f"moe.block: {c.problem} has no tuned bucket at or above it; serving the heuristic "
                            "default"], sel.warnings
    sel.lookup("moe.block", 16, 9, draft=7)  # once per op
    assert len(sel.warnings) == 1
    # a routing with no blocks of its own is served the uniform ones, and the same word above them
    sel = Selector.load(tuning_db_dir() / "h200.sqlite", measured_on="h200", model=bf16, routing="zipf:2")
    assert sel.lookup("moe.block", 16, 33, draft=1).source == "heuristic default"
    assert [w for w in sel.warnings if "has no tuned bucket at or above it" in w], sel.warnings
    assert sel.lookup("moe.block", 16, 64).source == "tuned for uniform routing (measured)"
