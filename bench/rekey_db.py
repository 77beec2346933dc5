"""Re-key a tuning database after a change that only widens what its keys cover, never after a change to code that
runs. A family's digest covers its module and its ``depends_on``; adding a module to ``depends_on`` (a gap closed:
tests/test_digests.py) changes every digest of that family and of the ops it serves, so results measured with exactly
that code would read as stale. This rewrites the digests of those results, and only of those:

    python bench/rekey_db.py --base COMMIT [--target COMMIT] DB.sqlite [...]

``base``: the commit whose code the database is current under; ``target``: the commit (default: this checkout, which
must have no uncommitted changes to the modules involved) whose digests it gets. It refuses unless every family whose
digest differs differs only by its ``depends_on`` or its docstrings and comments (module syntax trees equal once that
assignment and the docstrings are removed: neither reaches generated code), or only
in members that the simulated backend alone calls (``work``, ``simulate_us``) and in the ``archs`` it declares code
for (then only measured results on a supported arch are re-keyed; simulated ones stay stale), and every module that
was already covered differs at most in docstrings and comments (its syntax tree without docstrings equal at both
commits; a newly covered module must be byte-identical). A result is re-keyed only if its stored
digest is the base code's and every newly covered module it depends on was last committed before the result was
created (otherwise it may have run other code: it stays stale). One transaction per database: all or nothing.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKEND_OF = {"measured": "gpu", "simulated": "simulated", "cpu": "cpu"}  # store value -> registry backend
PROBE = """
import json
from k3tune import kernels
from k3tune.plan.problems import OPS
fams = kernels.FAMILIES


def op_families(op, b):  # kernels.op_families, for commits from before it existed
    if hasattr(kernels, "op_families"):
        return kernels.op_families(op, b)
    kind = OPS[op].kind
    return [f for f in fams.values() if b in f.backends and kind in f.kinds and (f.ops is None or op in f.ops)]


print(json.dumps({
    "families": {n: {"digest": f.digest, "module": type(f).__module__, "depends_on": list(f.depends_on),
                     "archs": list(getattr(f, "archs", None) or []) or None} for n, f in fams.items()},
    "ops": {f"{op}|{b}": {"digest": kernels.op_digest(op, b), "families": [f.name for f in op_families(op, b)],
                          "runs": list(getattr(OPS[op], "runs", ()))}
            for op in OPS for b in ("gpu", "simulated", "cpu")}}))
"""


class RekeyError(Exception):
    pass


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def _source(commit: str | None, module: str) -> str:
    path = module.replace(".", "/") + ".py"
    return (ROOT / path).read_text() if commit is None else _git("show", f"{commit}:{path}")


def _keys(commit: str | None) -> dict:
    """Family and op digests as the code at ``commit`` (None: this checkout) computes them, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "K3TUNE_EXTRA_FAMILIES"}
    with tempfile.TemporaryDirectory() as d:
        tree = ROOT
        if commit is not None:
            blob = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "k3tune"], check=True,
                                  capture_output=True).stdout
            tarfile.open(fileobj=io.BytesIO(blob)).extractall(d)
            tree = Path(d)
        env["PYTHONPATH"] = str(tree)
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=d, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


SIMULATION_ONLY = ("work", "simulate_us")  # family members only the simulated backend calls (search/simulate.py)
MEASURED_NEUTRAL = ("archs",)  # where a family is offered: no change on an arch it still supports


def _without(src: str, methods: tuple[str, ...] = (), attrs: tuple[str, ...] = (), deps: bool = False) -> str:
    """The module's syntax tree without docstrings (comments are not in it either), without class-level
    ``depends_on`` assignments (kept with ``deps``) and without the named methods and class attributes."""
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                and isinstance(node.body[0].value.value, str)):
            node.body = node.body[1:] or [ast.Pass()]
        if isinstance(node, ast.ClassDef):
            node.body = [s for s in node.body if not (
                isinstance(s, ast.Assign | ast.AnnAssign)
                and any(isinstance(t, ast.Name) and t.id in (*(() if deps else ("depends_on",)), *attrs)
                        for t in (s.targets if isinstance(s, ast.Assign) else [s.target])))
                and not (isinstance(s, ast.FunctionDef) and s.name in methods)]
    return ast.dump(tree)


def _last_change(commit: str | None, module: str) -> datetime:
    path = module.replace(".", "/") + ".py"
    if commit is None and _git("status", "--porcelain", "--", path).strip():
        raise RekeyError(f"{path} has uncommitted changes: commit them or name --target")
    stamp = _git("log", "-1", "--format=%cI", commit or "HEAD", "--", path).strip()
    return datetime.fromisoformat(stamp).astimezone(timezone.utc).replace(tzinfo=None)


def plan(base: str, target: str | None) -> dict:
    """What may be re-keyed: per family, old digest -> (new digest, newly covered modules with their last change)."""
    old, new = _keys(base), _keys(target)
    fams = {}
    for name, n in new["families"].items():
        o = old["families"].get(name)
        if o is None or o["digest"] == n["digest"]:
            continue
        if o["module"] != n["module"]:
            raise RekeyError(f"{name} moved from {o['module']} to {n['module']}: not a widening")
        before, after = _source(base, o["module"]), _source(target, n["module"])
        if _without(before) == _without(after):
            scope = "all"
        elif _without(before, SIMULATION_ONLY, MEASURED_NEUTRAL) == _without(after, SIMULATION_ONLY, MEASURED_NEUTRAL):
            scope = "measured"  # the simulation model changed: simulated results are stale, measured ones are not
        else:
            raise RekeyError(f"{name}: {n['module']} changed beyond its depends_on between the commits: re-sweep it")
        if not set(o["depends_on"]) <= set(n["depends_on"]):
            raise RekeyError(f"{name}: its depends_on lost {sorted(set(o['depends_on']) - set(n['depends_on']))}")
        for m in o["depends_on"]:  # a module already covered may differ in docstrings and comments only
            if _without(_source(base, m), deps=True) != _without(_source(target, m), deps=True):
                raise RekeyError(f"{name}: {m}, already in its key, changed between the commits: re-sweep it")
        added = {m: _last_change(target, m) for m in n["depends_on"] if m not in o["depends_on"]}
        for m in added:
            if _source(base, m) != _source(target, m):
                raise RekeyError(f"{name}: {m} changed between the commits: re-sweep it")
        fams[name] = {"old": o["digest"], "new": n["digest"], "added": added, "scope": scope, "archs": n["archs"]}
    ops = {k: {"old": old["ops"][k]["digest"], "new": v["digest"], "families": v["families"]}
           for k, v in new["ops"].items() if k in old["ops"] and old["ops"][k]["digest"] != v["digest"]}
    check_ops(old, new, ops, fams)
    return {"families": fams, "ops": ops}


def check_ops(old: dict, new: dict, ops: dict, fams: dict) -> None:
    """Every changed op digest must be explained by a widening: one of its families re-keyed (``fams``), or, for an
    op that runs other ops' tuned kernels (``runs``: the MoE block's dense projections), one of those ops re-keyed.
    A digest that changed otherwise (the ``runs`` list itself widened, say) may cover results measured with other
    kernels than the key now names: refused."""
    for k, v in ops.items():
        o = old["ops"][k]
        changed = set(v["families"]) ^ set(o["families"])
        if changed:
            raise RekeyError(f"op {k}: families {sorted(changed)} added or removed: re-sweep it")
        if any(old["families"][f]["digest"] != new["families"][f]["digest"] and f not in fams for f in v["families"]):
            raise RekeyError(f"op {k}: a family changed that is not a widening")
        runs, backend = new["ops"][k].get("runs", []), k.rsplit("|", 1)[1]
        if runs != o.get("runs", []):
            raise RekeyError(f"op {k}: the ops it runs changed ({o.get('runs', [])} -> {runs}): its results may have "
                             "run other kernels: re-sweep it")
        if not any(f in fams for f in v["families"]) and not any(f"{r}|{backend}" in ops for r in runs):
            raise RekeyError(f"op {k}: its key changed but none of its families nor the ops it runs did: re-sweep it")


def _created(value) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(str(value))


def rekey(db: Path, keys: dict) -> dict:
    """Rewrite one SQLite database's digests in one transaction (all or nothing; SQLite's journal makes it atomic, and
    a copy moved over a database in WAL mode could meet that database's old -wal file)."""
    fams, ops = keys["families"], keys["ops"]

    def scoped(f, backend, arch) -> bool:
        archs = fams[f]["archs"]
        return fams[f]["scope"] == "all" or (backend == "measured" and (
            archs is None or any(arch.startswith(a) for a in archs)))

    def allowed(created, backend, families, arch) -> bool:
        return all(scoped(f, backend, arch) for f in families if f in fams) and all(
            t < _created(created) for f in families if f in fams for t in fams[f]["added"].values())

    counts = {"winners_family": 0, "winners_op": 0, "trials": 0, "left_stale": 0}
    con = sqlite3.connect(db, isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        arch_of = {hid: "sm_" + cc.replace(".", "") + "a"
                   for hid, cc in con.execute("SELECT id, compute_capability FROM hardware")}
        rows = con.execute("SELECT w.id, p.op, w.backend, w.family, w.family_digest, w.op_digest, w.created_at, "
                           "w.hardware_id FROM winners w JOIN problems p ON p.id = w.problem_id").fetchall()
        for wid, op, backend, fam, fdig, odig, created, hid in rows:
            okey = f"{op}|{BACKEND_OF[backend]}"
            if fam in fams and fdig == fams[fam]["old"]:
                if allowed(created, backend, [fam], arch_of[hid]):
                    con.execute("UPDATE winners SET family_digest = ? WHERE id = ?", (fams[fam]["new"], wid))
                    counts["winners_family"] += 1
                else:
                    counts["left_stale"] += 1
            if okey in ops and odig == ops[okey]["old"]:
                if allowed(created, backend, ops[okey]["families"], arch_of[hid]):
                    con.execute("UPDATE winners SET op_digest = ? WHERE id = ?", (ops[okey]["new"], wid))
                    counts["winners_op"] += 1
                else:
                    counts["left_stale"] += 1
        for tid, fam, fdig, created, backend, hid in con.execute(
                "SELECT id, family, family_digest, created_at, backend, hardware_id FROM trials").fetchall():
            if fam in fams and fdig == fams[fam]["old"] and allowed(created, backend, [fam], arch_of[hid]):
                con.execute("UPDATE trials SET family_digest = ? WHERE id = ?", (fams[fam]["new"], tid))
                counts["trials"] += 1
        if con.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            raise RekeyError(f"{db}: integrity check failed: nothing written")
        con.execute("COMMIT")
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise
    finally:
        con.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="commit whose code the databases are current under")
    ap.add_argument("--target", default=None, help="commit whose digests they get (default: this checkout)")
    ap.add_argument("dbs", nargs="+", type=Path)
    args = ap.parse_args()
    try:
        for db in args.dbs:
            if not db.is_file():
                raise RekeyError(f"{db}: no such SQLite file")
        keys = plan(args.base, args.target)
        print(json.dumps({f: {"old": v["old"], "new": v["new"], "added": sorted(v["added"]), "scope": v["scope"]}
                          for f, v in keys["families"].items()}, indent=1))
        for db in args.dbs:
            print(db, rekey(db, keys))
    except (RekeyError, subprocess.CalledProcessError, sqlite3.Error) as e:
        detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr else e
        print(f"error: {detail}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
