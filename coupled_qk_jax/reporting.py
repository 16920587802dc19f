"""The small helpers every experiment and the training loop's summaries share: seed statistics, CSV and Markdown
tables, a timestamped log line. One copy here instead of one per experiment script."""

from __future__ import annotations

import csv
import io
import math
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coupled_qk_jax import paths


def code_commit() -> str:
    """The checkout's git commit, with ``+dirty`` when the code (``coupled_qk_jax``, ``configs``, ``experiments``)
    differs from it; "unknown" outside a git checkout. Recorded with results (result files written into the tree
    while experiments run do not count as changes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "coupled_qk_jax", "configs", "experiments"],
                               cwd=root, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value) of a list of floats, in float64."""
    a = np.asarray(values, np.float64).reshape(-1)
    return float(a.mean()), (float(a.std(ddof=1)) if a.size > 1 else 0.0)


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """One header line (the first row's keys) and one line per row; nothing is written for no rows."""
    if not rows:
        return
    if paths.is_remote(path):  # an object is written whole (coupled_qk_jax/paths.py)
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        paths.write_text(path, buf.getvalue())
        return
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def fmt(value: Any) -> str:
    """A table cell: floats to 3 decimals (1 above 100, 3 significant digits above 1e5), NaN as a dash."""
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        if abs(value) >= 1e5:
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A Markdown table of ``rows`` with ``columns`` = [(key, title), ...]."""
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "| " + " | ".join("---" for _ in columns) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row[key]) for key, _ in columns) + " |")
    return "\n".join(lines)


def log(msg: str) -> None:
    """``HH:MM:SS msg`` on stdout, flushed (experiment drivers' progress lines)."""
    print(time.strftime("%H:%M:%S"), msg, flush=True)
