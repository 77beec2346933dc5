"""bench/moe.py's ``current_block_keys`` (the A/B scripts serve shipped block knobs on this tree's code): each
hardware's block winners take that hardware's digest, so a family landed on one hardware (kernels.LANDED_ON)
keys its winners only. No family is landed on one hardware alone since session 67 (gemm.wgmma_cktrig moved to
FAMILIES once every shipped table had it), so the test stages it again, landed on the H100 only, as it was in
sessions 60-66."""

import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

from k3tune.shipped import tuning_db_dir

BENCH = Path(__file__).resolve().parents[1] / "bench"
CKTRIG = "gemm.wgmma_cktrig"
# in the bench's process: the family staged again and landed on the H100 alone (mutated in place: modules that
# imported the registry's dicts see it)
RESTAGE = ("import k3tune.kernels as k; k.STAGED[{f!r}] = k.FAMILIES.pop({f!r}); "
           "k.LANDED_ON[{f!r}] = frozenset({{{hw!r}}}); k.op_digest.cache_clear(); k._candidates.cache_clear(); ")


def test_each_hardware_keeps_its_own_block_digest(tmp_path, cktrig_landed_on_h100):
    src = tmp_path / "both.sqlite"
    shutil.copyfile(tuning_db_dir() / "h100.sqlite", src)
    with closing(sqlite3.connect(src)) as c, c:
        c.execute("INSERT INTO hardware (digest, class_key, name, compute_capability, sm_count, memory_gib, driver, "
                  "cuda, simulated) SELECT 'other', 'OTHER|cc9.0|132sm|132GiB', 'OTHER', compute_capability, "
                  "sm_count, 132, driver, cuda, simulated FROM hardware")
        (other,) = c.execute("SELECT id FROM hardware WHERE digest = 'other'").fetchone()
        c.execute("UPDATE winners SET op_digest = 'old', hardware_id = ? WHERE id IN (SELECT w.id FROM winners w "
                  "JOIN problems p ON p.id = w.problem_id WHERE p.op = 'moe.block' LIMIT 3)", (other,))
        c.execute("UPDATE winners SET op_digest = 'old' WHERE problem_id IN "
                  "(SELECT id FROM problems WHERE op = 'moe.block')")
        h100 = c.execute("SELECT class_key FROM hardware WHERE id != ?", (other,)).fetchone()[0]
    code = RESTAGE.format(f=CKTRIG, hw=h100) + f"import moe; print(moe.current_block_keys({str(src)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()[-1]
    try:
        with closing(sqlite3.connect(out)) as c:
            got = dict(c.execute("SELECT h.class_key, GROUP_CONCAT(DISTINCT w.op_digest) FROM winners w "
                                 "JOIN problems p ON p.id = w.problem_id JOIN hardware h ON h.id = w.hardware_id "
                                 "WHERE p.op = 'moe.block' GROUP BY h.class_key").fetchall())
    finally:
        Path(out).unlink()
    assert h100 in cktrig_landed_on_h100.LANDED_ON[CKTRIG]  # the bench process re-staged it as the fixture did
    assert got == {hw: cktrig_landed_on_h100.op_digest("moe.block", "gpu", hw)
                   for hw in (h100, "OTHER|cc9.0|132sm|132GiB")}
    assert got[h100] != got["OTHER|cc9.0|132sm|132GiB"]
