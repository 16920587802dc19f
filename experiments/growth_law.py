"""Paper 2's growth law (μ_OV = O(log t), μ_QK = O(log² t)) read off committed curves: d log μ / d log log t.

    python -m experiments.growth_law --out results/qkov/growth_law.md

If μ ∝ (log t)^p then log μ = p · log log t + const, so the slope of log μ against log log t is p: 1 for the OV
scalar and 2 for the QK scalar under the paper's law. The slope is fitted by least squares over a window of t,
the first and the last decade of each series (t ≤ 10·t_first, t ≥ t_last/10). A finite-t curve such as
μ = a·log t + b has the local slope a·log t / (a·log t + b), which reaches p only as log t grows, so the last
decade is the estimate and the first shows the trend. The slope also depends on the unit of t (log t shifts by a
constant), which matters at small log t: the SGD curves are given in two units.

Inputs (committed files; nothing is trained):
- ``ode.csv`` (``python -m coupled_qk_jax.qkov.theory``): the reduced gradient-flow ODE read out at 50 losses from 1
  to 1e-4 per learning-rate ratio r = η_QK/η_OV (columns ratio, loss, t, mu_ov, mu_qk, alpha; t in the ODE's time,
  η_OV = 1);
- ``runs/<cell>/seed<S>_curves.csv`` (experiments/qkov_synthetic.py): ‖W_OV‖_F and ‖W_QK‖_F (of the factor
  products for factorised circuits) after every epoch of the SGD runs. t = lr_OV · step, the gradient-flow time of
  the OV circuit, and t = step. A norm includes the random part of a default initialisation (‖W_0‖_F ≈ 4.1).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
from collections import defaultdict

import numpy as np

from coupled_qk_jax.reporting import mean_std


def loglog_slope(t: np.ndarray, mu: np.ndarray) -> float:
    """Least-squares slope of log μ against log log t (float64). t > 1 and μ > 0 everywhere; at least 2 points."""
    t, mu = np.asarray(t, np.float64), np.asarray(mu, np.float64)
    if t.size < 2 or t.shape != mu.shape:
        raise ValueError(f"need at least 2 (t, mu) pairs of one shape, got {t.shape} and {mu.shape}")
    if np.any(t <= 1) or np.any(mu <= 0):
        raise ValueError("log log t needs t > 1 and log mu needs mu > 0")
    x, y = np.log(np.log(t)), np.log(mu)
    x0, y0 = x - x.mean(), y - y.mean()
    return float((x0 * y0).sum() / (x0 * x0).sum())


def decade_slopes(t: np.ndarray, mu: np.ndarray) -> tuple[float, float]:
    """(slope over the first decade of t, slope over the last decade), for a series sorted by t."""
    t, mu = np.asarray(t, np.float64), np.asarray(mu, np.float64)
    first, last = t <= 10 * t[0], t >= t[-1] / 10
    return loglog_slope(t[first], mu[first]), loglog_slope(t[last], mu[last])


def ode_rows(path: str) -> list[dict]:
    """One row per ratio of ode.csv: its t range, α at the end, and both decades' slopes for μ_OV and μ_QK."""
    series: dict[float, list[tuple[float, ...]]] = defaultdict(list)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            series[float(r["ratio"])].append((float(r["t"]), float(r["mu_ov"]), float(r["mu_qk"]),
                                              float(r["alpha"])))
    rows = []
    for ratio, pts in sorted(series.items()):
        t, ov, qk, alpha = np.array(sorted(pts)).T
        (ov0, ov1), (qk0, qk1) = decade_slopes(t, ov), decade_slopes(t, qk)
        rows.append({"ratio": ratio, "t": (t[0], t[-1]), "alpha": (alpha[0], alpha[-1]),
                     "ov": (ov0, ov1), "qk": (qk0, qk1)})
    return rows


def curve_rows(runs_dir: str) -> list[dict]:
    """One row per cell with curves: seed mean ± std of the last-decade slopes of ‖OV‖, ‖QK‖ in both units."""
    rows = []
    for cell_dir in sorted(glob.glob(os.path.join(runs_dir, "*", ""))):
        files = sorted(glob.glob(os.path.join(cell_dir, "seed*_curves.csv")))
        if not files:
            continue
        with open(files[0].replace("_curves.csv", ".json")) as f:
            cfg = json.load(f)["train_config"]
        per_seed = defaultdict(list)
        for path in files:
            with open(path, newline="") as f:
                c = [r for r in csv.DictReader(f) if float(r["step"]) > 0]
            step = np.array([float(r["step"]) for r in c])
            norms = {k: np.array([float(r[f"{k}_norm"]) for r in c]) for k in ("ov", "qk")}
            for unit, t in (("gf", cfg["lr_ov"] * step), ("steps", step)):
                keep = t > 1
                for k, mu in norms.items():
                    per_seed[f"{k}_{unit}"].append(decade_slopes(t[keep], mu[keep])[1])
            per_seed["qk_end"].append(norms["qk"][-1])
            per_seed["ov_end"].append(norms["ov"][-1])
        rows.append({"cell": os.path.basename(os.path.dirname(cell_dir)), "param": cfg["parametrisation"].upper(),
                     "init": cfg["init"], "ratio": cfg["qk_ratio"], "schedule": cfg["qk_schedule"],
                     "steps": int(step[-1]), "lr_ov": cfg["lr_ov"], "seeds": len(files),
                     **{k: mean_std(v) for k, v in per_seed.items()}})
    return rows


def markdown(ode: list[dict], curves: list[dict], ode_path: str, runs_dir: str) -> str:
    pm = lambda ms: f"{ms[0]:.2f} ± {ms[1]:.2f}"  # noqa: E731
    lines = ["# Paper 2's growth law: the exponent p in μ ∝ (log t)^p", "",
             "Produced by `python -m experiments.growth_law --out results/qkov/growth_law.md` from the committed "
             f"`{ode_path}` and `{runs_dir}/*/seed*_curves.csv` (nothing trained). p = least-squares slope of log μ "
             "against log log t over a decade of t; the paper's law gives p = 1 for OV and p = 2 for QK.", "",
             "## The reduced gradient-flow ODE (ode.csv)", "",
             "| ratio η_QK/η_OV | t (first .. last readout) | α (first .. last) | p OV, first decade "
             "| p OV, last decade | p QK, first decade | p QK, last decade |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in ode:
        lines.append(f"| {r['ratio']:g} | {r['t'][0]:.3g} .. {r['t'][1]:.3g} | {r['alpha'][0]:.3f} .. "
                     f"{r['alpha'][1]:.3f} | {r['ov'][0]:.2f} | **{r['ov'][1]:.2f}** | {r['qk'][0]:.2f} | "
                     f"**{r['qk'][1]:.2f}** |")
    lines += ["", "## The SGD runs at the paper's budgets (per-epoch circuit norms)", "",
              "Last decade of t; seed mean ± sample std. 'gf': t = lr_OV · step (lr_OV = 0.01 in every cell); "
              "'steps': t = step.", "",
              "| cell | parametrisation, init | QK rate | steps | seeds | ‖QK‖ end | ‖OV‖ end | p OV (gf) "
              "| p QK (gf) | p OV (steps) | p QK (steps) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in curves:
        rate = f"×{r['ratio']:g}" + (" ramp" if r["schedule"] != "constant" else "")
        lines.append(f"| {r['cell']} | {r['param']}, {r['init']} | {rate} | {r['steps']:,} | {r['seeds']} | "
                     f"{r['qk_end'][0]:.3g} | {r['ov_end'][0]:.3g} | {pm(r['ov_gf'])} | {pm(r['qk_gf'])} | "
                     f"{pm(r['ov_steps'])} | {pm(r['qk_steps'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ode", default="results/qkov/ode.csv")
    p.add_argument("--runs", default="results/qkov/runs")
    p.add_argument("--out", default="", help="write the Markdown here too")
    args = p.parse_args(argv)
    text = markdown(ode_rows(args.ode), curve_rows(args.runs), args.ode, args.runs)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
