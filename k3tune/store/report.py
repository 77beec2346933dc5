"""What tuning bought, read from a database for people: each current winner's speedup over the safe baseline (cuBLAS
for a dense projection, the stock block for the MoE block), both timed in the same sweep under the same conditions.

Rows are an op's problems that differ in more than their token count (a dense op's per-rank shape, a block's tp,
weight format and routing), columns the token counts (tokens per step, or batch x query length for attention). Each
hardware of the database is its own section, labelled measured or simulated. Stale winners (their kernels changed
since) are left out and counted. ``plot`` draws the same numbers with matplotlib (the ``report`` extra).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from sqlalchemy import select

from k3tune.errors import CannotImplement, ConfigError
from k3tune.kernels import families_for
from k3tune.plan import problems as plans
from k3tune.store.db import Database
from k3tune.store.inspect import BACKEND_OF, is_current
from k3tune.store.models import Hardware, ProblemRow, Winner


def _size(dims: dict) -> int:
    return dims["M"] if "M" in dims else dims.get("batch", 1) * dims.get("qlen", 1)


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def report(db: Database) -> dict:
    """Per hardware, per op: rows of speedups by token count, each row's and each op's geometric mean, and which
    kernels won. A winner without a baseline time (an older record) counts among the kernels, not the speedups."""
    with db.session() as s:
        rows = s.execute(select(Winner, ProblemRow, Hardware).join(ProblemRow, ProblemRow.id == Winner.problem_id)
                         .join(Hardware, Hardware.id == Winner.hardware_id)).all()
    by_hw: dict[tuple, list] = defaultdict(list)
    stale = Counter()
    for w, p, h in rows:
        if not is_current(p.op, w.op_digest, w.backend.value, h.class_key):
            stale[h.class_key] += 1
            continue
        by_hw[(h.class_key, h.name, w.backend.value)].append((w, p))
    out = []
    for (class_key, name, backend), winners in sorted(by_hw.items()):
        ops = []
        for op in sorted({p.op for _, p in winners}):
            mine = [(w, p) for w, p in winners if p.op == op]
            varying = _varying(p.dims for _, p in mine)
            groups: dict[str, dict] = {}
            order: dict[str, tuple] = {}  # numeric order of the dims (ctx=4096 before ctx=16384), not the label's
            for w, p in mine:
                label = ",".join(f"{k}={p.dims[k]}" for k in varying)
                order.setdefault(label, tuple((isinstance(v, str), v) for v in (p.dims[k] for k in varying)))
                if label not in groups:
                    groups[label] = {"label": label, "baseline": _baseline(p, backend), "cells": {}}
                g = groups[label]
                sp = w.default_us / w.median_us if w.default_us and w.median_us else None
                g["cells"][_size(p.dims)] = {"family": w.family, "median_us": w.median_us, "baseline_us": w.default_us,
                                             "speedup": sp}
            for g in groups.values():
                g["cells"] = dict(sorted(g["cells"].items()))
                g["geomean"] = _geomean([c["speedup"] for c in g["cells"].values() if c["speedup"]])
            ops.append({"op": op, "rows": [groups[k] for k in sorted(groups, key=order.__getitem__)],
                        "geomean": _geomean([w.default_us / w.median_us for w, _ in mine if w.default_us]),
                        "kernels": dict(Counter(w.family for w, _ in mine).most_common())})
        out.append({"hardware": name, "class_key": class_key, "backend": backend, "ops": ops,
                    "winners": len(winners), "stale_left_out": stale.pop(class_key, 0)})
    return {"database": db.name, "hardware": out,
            "stale_left_out_elsewhere": sum(stale.values())}  # hardware with only stale winners


def _varying(dims_seq) -> list[str]:
    """The dims (token count and batch aside) whose values differ across an op's problems, in their stored order, less
    those that an earlier one decides (a block's expert widths follow from its tp)."""
    dims_seq = list(dims_seq)
    # the query length stays: an attention problem's tokens per step are batch x qlen, which two problems can share
    names = [k for k in (dims_seq[0] if dims_seq else {}) if k not in ("M", "batch")]
    varying = [k for k in names if len({d[k] for d in dims_seq}) > 1]
    kept: list[str] = []
    for k in varying:
        if not any(len({(d[j], d[k]) for d in dims_seq}) == len({d[j] for d in dims_seq}) for j in kept):
            kept.append(k)
    return kept


def _baseline(p: ProblemRow, backend: str) -> str:
    """What the winner's speedup is over: the safest family that runs the problem on that backend, at its default
    knobs (cuBLAS; the stock MoE block, or the tuned block's defaults where the stock one cannot run the format)."""
    problem = plans.Problem(p.op, p.kind, tuple(p.dims.items()))
    try:
        fams = families_for(problem, BACKEND_OF[backend])
    except (CannotImplement, ConfigError):
        fams = []
    if not fams:
        return "?"
    return fams[0].name + (" defaults" if fams[0].config_cls.__dataclass_fields__ else "")


def plot(data: dict, path: str | os.PathLike) -> Path:
    """One panel per (hardware, op): speedup over the safe baseline against tokens per step, a line per row. Written
    atomically (PNG, or any format matplotlib infers from the suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'k3tune[report]'") from None
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write the plot {path}: {path.parent} is not a directory")
    if path.is_dir():  # (the plot was drawn, then its rename onto the folder was an IsADirectoryError traceback)
        raise ConfigError(f"cannot write the plot {path}: it is a directory")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise ConfigError(f"cannot write the plot {path}: name it .png, .svg or .pdf "
                          f"(known: {', '.join(sorted(formats))})")
    panels = [(hw, op) for hw in data["hardware"] for op in hw["ops"] if any(r["geomean"] for r in op["rows"])]
    if not panels:
        raise ConfigError("nothing to plot: no current winner has a baseline time")
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (hw, op) in zip(axes.flat, panels):
        for r in op["rows"]:
            pts = [(m, c["speedup"]) for m, c in r["cells"].items() if c["speedup"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=f"{r['label'] or op['op']} (vs {r['baseline']})")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op['op']} — {hw['hardware']} ({hw['backend']})", fontsize=8)
        ax.set_xlabel("tokens per step", fontsize=7)
        ax.set_ylabel("speedup over baseline", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    try:  # a folder the user may not write (or /proc) was a FileNotFoundError/PermissionError traceback
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    except OSError as e:
        plt.close(fig)
        raise ConfigError(f"cannot write the plot {path}: {e.strerror or e}") from None
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=130)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as any file the user writes (mkstemp's is 0600)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
