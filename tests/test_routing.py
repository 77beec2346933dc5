"""Expert routing for MoE measurements: uniform, Zipf-skewed and recorded traces (format checked)."""

import json
import random

import pytest

from k3tune.errors import ConfigError
from k3tune.plan import model, problems, routing, spec


def test_uniform_matches_the_independent_measurement():
    # ../shared/reference/h200-baselines.md: 120 experts touched at batch 8, 624 at batch 64 (uniform, top-16/896)
    assert routing.expected_touched("uniform", 896, 16, 8) == pytest.approx(120, rel=0.02)
    assert routing.expected_touched("uniform", 896, 16, 64) == pytest.approx(624, rel=0.03)


def test_skew_touches_fewer_experts():
    z = routing.canonical("zipf:1.2", 896, 16)
    for m in (8, 64):
        assert 16 <= routing.expected_touched(z, 896, 16, m) < routing.expected_touched("uniform", 896, 16, m)
    rows = routing.sample(z, 896, 16, 64, random.Random(0))
    assert len(rows) == 64 and all(len(set(r)) == 16 for r in rows)
    assert len({e for r in rows for e in r}) < 600


def test_shipped_trace_is_keyed_by_its_content():
    c = routing.canonical("trace:synthetic", 896, 16)
    assert c.startswith("trace:synthetic@") and len(c.split("@")[1]) == 8
    assert 16 <= routing.expected_touched(c, 896, 16, 8) <= 128
    assert [len(r) for r in routing.sample(c, 896, 16, 5, random.Random(1))] == [16] * 5


def _trace(tmp_path, header, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([json.dumps(header)] + [json.dumps(r) for r in rows]) + "\n")
    routing.load_trace.cache_clear()
    return str(p)


HEAD = {"format": "k3tune-routing-trace", "version": 1, "experts": 896, "top_k": 16}


@pytest.mark.parametrize("header, rows, msg", [
    ({"format": "other"}, [], "not a k3tune routing trace"),
    (HEAD, [{"experts": list(range(15))}], "16 distinct expert ids"),
    (HEAD, [{"experts": [900] + list(range(15))}], "16 distinct expert ids"),
    (HEAD, [{"ids": []}], "expected"),
    (HEAD, [], "no tokens"),
    ({**HEAD, "experts": 64, "top_k": 4}, [{"experts": [0, 1, 2, 3]}], "recorded for 64 experts"),
])
def test_bad_traces_are_refused(tmp_path, header, rows, msg):
    with pytest.raises(ConfigError, match=msg):
        routing.canonical(f"trace:{_trace(tmp_path, header, rows)}", 896, 16)


def test_a_steep_skew_is_sampled_at_once_from_the_same_distribution():
    """zipf:5 took 39 s to sample 8 tokens (repeats discarded until 16 distinct experts came: the tail is that
    unlikely), zipf:1000 overflowed and zipf:inf (accepted) never ended: a sweep lost every block trial to its
    timeout. The tail is now drawn by the Gumbel top-k trick, whose inclusion frequencies match the old draws'."""
    from collections import Counter

    for s in ("zipf:8", "zipf:1000"):
        rows = routing.sample(routing.canonical(s, 896, 16), 896, 16, 64, random.Random(0))
        assert len(rows) == 64 and all(len(set(r)) == 16 and all(0 <= e < 896 for e in r) for r in rows)
    a, n = 1.5, 3000
    w = routing._zipf_weights(896, a)
    freq = []
    for rounds in (10**6, 0):  # repeats discarded only; Gumbel only
        rng, c = random.Random(1), Counter()
        for _ in range(n):
            c.update(routing._distinct_by_weight(w, a, 16, rng, rounds))
        freq.append([c[i] / n for i in (0, 2, 5, 10, 20, 50, 100)])
    assert freq[0] == pytest.approx(freq[1], abs=0.04)


@pytest.mark.parametrize("bad", ["gaussian", "zipf:-1", "zipf:x", "zipf:inf", "zipf:nan", "trace:nope"])
def test_bad_routing_specs(bad):
    with pytest.raises(ConfigError):
        routing.canonical(bad, 896, 16)


def test_moe_problems_carry_the_routing():
    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [8], "routing": "trace:synthetic", "ops": ["moe.block"]}})
    plan = problems.build(sp, model.load())
    assert [p["routing"] for p in plan.problems] == [routing.canonical("trace:synthetic", 896, 16)]


def test_each_trial_records_its_routing(tmp_path):
    import sqlite3

    from k3tune.plan import hardware
    from k3tune.search.driver import SweepOptions, run_sweep
    from k3tune.store.db import open_db

    sp = spec.from_dict({"matrix": {"tp": [16], "batch": [1, 8], "routing": "zipf:1.2", "ops": ["moe.block"]},
                         "buckets": {"tokens": [1, 8], "batch": [1, 8], "query_len": [1]},
                         "search": {"budget": 6, "samples": 5, "remeasure_top": 1}})
    db = open_db(tmp_path / "r.sqlite")
    st = run_sweep(SweepOptions(sp, model.load(), db, "simulated", 2, hw=hardware.spec("gb300")))
    assert st.problems_done == 2
    with sqlite3.connect(tmp_path / "r.sqlite") as c:
        assert {r[0] for r in c.execute("select routing from trials")} == {"zipf:1.2"}
