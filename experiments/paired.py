"""Paired comparison of two sweep cells that live in different tables (results.csv of two sweeps).

    python -m experiments.paired results/paper1/a_10m/results.csv:coupled_euler \
        results/paper1/c_10m/results.csv:coupled_euler_n7

A sweep's own table pairs every cell with standard attention in the same sweep. Cells of *different* sweeps (e.g.
recipe c's n = 7 against recipe a's n = 1) are paired here: seed s of one cell against seed s of the other (same
initial weights and data order when both start at seed 0, as every recipe does), on the final validation
perplexity of each seed (`val_ppl_seeds`). Prints one Markdown table: both cells' per-seed values, the per-seed
change of B against A in percent, its mean ± sample std and the 95% paired-t interval (`reports.t_interval`).
Trains nothing.

`--metric KEY` pairs an attention diagnostic instead (any key of a model mean in `diagnostics_report`, e.g.
`effective_rank`, `entropy_normalized`): the per-seed model means are read from the run's JSON in the `runs/`
folder beside the table (`runs/<cell>.json`, as the sweep's reports wrote them), e.g.

    python -m experiments.paired --metric effective_rank results/paper1/a_long/results.csv:standard \
        results/paper1/a_long/results.csv:coupled_euler
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.reporting import mean_std
from coupled_qk_jax.training import cli
from experiments import reports


def seed_values(ref: str, metric: str = "val_ppl") -> list[float]:
    """Per-seed values of the cell ``RESULTS_CSV:RUN``: final validation perplexities (``metric="val_ppl"``) or the
    model mean of an attention diagnostic, from ``runs/<cell>.json`` beside the table."""
    path, sep, run = ref.rpartition(":")
    if not sep or not path or not run:
        raise UserError(f"expected RESULTS_CSV:RUN (e.g. results/paper1/a_10m/results.csv:coupled_euler), "
                        f"got {ref!r}")
    if not Path(path).is_file():
        raise UserError(f"{path}: no such results.csv; give the table a sweep wrote (its --out)/results.csv")
    with open(path, newline="") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    if run not in rows:
        raise UserError(f"{path} has no run {run!r}; its runs: {', '.join(rows)}")
    if metric == "val_ppl":
        if "val_ppl_seeds" not in rows[run]:
            raise UserError(f"{path}: run {run!r} has no per-seed perplexities (an MQAR table?); pair LM cells only")
        return [float(x) for x in rows[run]["val_ppl_seeds"].split()]
    run_json = Path(path).parent / "runs" / f"{reports.safe_name(run)}.json"
    if not run_json.is_file():
        raise UserError(f"{run_json}: no per-seed diagnostics of {run!r} were committed beside {path} (only seed "
                        f"means are in the table); rerun the sweep to get them")
    diags = json.loads(run_json.read_text()).get("diagnostics") or []
    if not diags or any(metric not in d["model_mean"] for d in diags):
        known = ", ".join(sorted(diags[0]["model_mean"])) if diags else "none"
        raise UserError(f"{run_json} has no per-seed diagnostic {metric!r}; its diagnostics: {known}")
    return [float(d["model_mean"][metric]) for d in diags]


def paired_table(a_ref: str, b_ref: str, metric: str = "val_ppl", first: int = 0) -> str:
    """Markdown: per-seed values of A and B, B's change against A per seed (%), mean ± std, 95% t interval.
    ``first = N`` pairs seeds 0..N-1 of both cells (e.g. a 3-seed run against a 5-seed one)."""
    a, b = seed_values(a_ref, metric), seed_values(b_ref, metric)
    if first:
        if first > min(len(a), len(b)):
            raise UserError(f"--first {first}: {a_ref} has {len(a)} seeds and {b_ref} has {len(b)}")
        a, b = a[:first], b[:first]
    if len(a) != len(b):
        raise UserError(f"{a_ref} has {len(a)} seeds and {b_ref} has {len(b)}; pairing needs the same seeds "
                        f"(--first N pairs the first N of both)")
    rel = [100.0 * (y / x - 1.0) for x, y in zip(a, b)]
    mean, std = mean_std(rel)
    lo, hi = reports.t_interval(rel)
    name = "val ppl" if metric == "val_ppl" else metric
    lines = [f"A = `{a_ref}`, B = `{b_ref}`", "",
             f"| seed | A {name} | B {name} | B vs A % |", "| --- | --- | --- | --- |"]
    lines += [f"| {s} | {x:.3f} | {y:.3f} | {r:+.2f} |" for s, (x, y, r) in enumerate(zip(a, b, rel))]
    lines += ["", f"paired change of B against A: mean {mean:+.2f}%, sample std {std:.2f}%, "
                  f"95% paired-t interval [{lo:+.2f}, {hi:+.2f}] ({len(rel)} seeds)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="the reference cell, RESULTS_CSV:RUN")
    p.add_argument("b", help="the compared cell, RESULTS_CSV:RUN")
    p.add_argument("--metric", default="val_ppl",
                   help="val_ppl (default) or an attention diagnostic's key, e.g. effective_rank (runs/<cell>.json)")
    p.add_argument("--first", type=int, default=0, help="pair only seeds 0..N-1 of both cells")
    args = p.parse_args(argv)
    code = cli.run_guarded(lambda: print(paired_table(args.a, args.b, args.metric, args.first)))
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
