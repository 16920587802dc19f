"""Progress of sweep cells that may not have finished: one Markdown table from the run directories, training nothing.

    python -m experiments.progress runs/mqar/easy_s1 [runs/paper1_a_10m ...] [--out PROGRESS.md]

A sweep (`experiments/sweep.py`) writes its tables only when every cell has finished. On a shared CPU a cell can run
for hours, so this reads what each cell directory holds so far: `cell.json` (the cell and its resolved config),
`summary.json` (status and step of the last start) and `metrics.jsonl` (every evaluation, per seed). For each cell
it gives the status, the step reached out of the planned steps, and every evaluation so far:

* MQAR cells: epoch -> `valid/accuracy` (mean over seeds; per seed in brackets when there are several), and the
  first evaluated epoch at which each seed reaches `reports.JUMP_LEVEL` (the recall jump);
* LM cells: tokens seen per seed -> validation perplexity (mean over seeds, per seed in brackets).

Numbers of an unfinished cell are the run's state at that step of its schedule (its learning rate has not decayed
to the end), not final results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from experiments import reports


def _seeds(row: dict[str, Any], key: str) -> list[float]:
    return [float(x) for x in row.get(f"{key}/seeds", [row[key]])]


def _fmt(values: list[float], digits: int) -> str:
    mean = sum(values) / len(values)
    per = "" if len(values) == 1 else " [" + " ".join(f"{v:.{digits}f}" for v in values) + "]"
    return f"{mean:.{digits}f}{per}"


def _training(workdir: Path) -> bool:
    """Whether the process whose pid the run directory's lock file holds is alive (the loop writes its pid there
    while it trains; a stale file after a kill names a dead process)."""
    try:
        pid = int((workdir / "lock").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def cell_progress(workdir: Path) -> dict[str, Any] | None:
    """One cell directory's state, or None when it holds no cell.json (not a sweep cell)."""
    if not (workdir / "cell.json").is_file():
        return None
    spec = json.loads((workdir / "cell.json").read_text())
    run, cfg = spec["run"], spec["config"]
    summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").is_file() else {}
    rows = []
    if (workdir / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = int(cfg["train"]["steps"])
    reached = max([int(r["step"]) for r in rows] + [int(summary.get("step", 0))])
    status = summary.get("status", "started")
    if status != "completed" and _training(workdir):
        status = "running"
    out = {"cell": run["name"], "variant": run["variant"], "seeds": int(cfg["train"]["num_seeds"]),
           "lr": cfg["train"]["lr"], "status": status, "step": reached, "steps": steps}
    if run["task"] == "mqar":
        spe = int(cfg["mqar"]["steps_per_epoch"])
        evals = reports.one_row_per_step([r for r in rows if "valid/accuracy" in r])
        epochs = [int(r["step"]) // spe for r in evals]
        acc = [_seeds(r, "valid/accuracy") for r in evals]
        n = len(acc[0]) if acc else 0
        jumps = [reports.jump_epoch(epochs, [a[i] for a in acc]) for i in range(n)]
        out.update(progress=f"{reached}/{steps} steps (epoch {reached / spe:.1f} of {steps // spe})",
                   evaluations=", ".join(f"{e}: {_fmt(a, 3)}" for e, a in zip(epochs, acc)),
                   jump=" ".join("-" if j is None else str(j) for j in jumps))
    else:
        tps = int(cfg["train"]["batch_size"]) * int(cfg["data"]["seq_len"])
        evals = [r for r in rows if "val_loss" in r]
        out.update(progress=f"{reached}/{steps} steps ({reached * tps / 1e6:.2f}M of {steps * tps / 1e6:.2f}M "
                            f"tokens per seed)",
                   evaluations=", ".join(f"{int(r['step']) * tps / 1e6:.2f}M: "
                                         f"{_fmt([math.exp(x) for x in _seeds(r, 'val_loss')], 2)}" for r in evals),
                   jump="")
    return out


def progress_table(runs_dirs: list[Path]) -> str:
    """The Markdown table of every cell directory under `runs_dirs` (in name order)."""
    cells = [(d, c) for d in runs_dirs for p in sorted(d.iterdir()) if p.is_dir() and (c := cell_progress(p))]
    if not cells:
        return "no sweep cells found\n"
    md = ["| runs dir | cell | seeds | status | progress | evaluations so far (MQAR: epoch: valid/accuracy; LM: "
          f"tokens per seed: val ppl) | epoch reaching {reports.JUMP_LEVEL:g} (per seed) |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    md += [f"| {d} | {c['cell']} | {c['seeds']} | {c['status']} | {c['progress']} | {c['evaluations'] or '-'} | "
           f"{c['jump'] or '-'} |" for d, c in cells]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dirs", nargs="+", help="sweep runs directories (--runs-dir of experiments.sweep)")
    p.add_argument("--out", help="write the table to this file instead of stdout")
    args = p.parse_args(argv)
    missing = [d for d in args.runs_dirs if not Path(d).is_dir()]
    if missing:
        print(f"error: not a directory: {', '.join(missing)}; pass the --runs-dir of a sweep", file=sys.stderr)
        return 2
    table = progress_table([Path(d) for d in args.runs_dirs])
    if args.out:
        Path(args.out).write_text(table)
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
