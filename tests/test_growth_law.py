"""experiments.growth_law: the exponent p of μ ∝ (log t)^p, against hand computations."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from experiments import growth_law


def test_slope_of_three_points_by_hand():
    # t = e^(e^x) for x = 0, 1, 2, so log log t = x exactly; log mu = 0, 1, 3.
    # Least squares: x̄ = 1, ȳ = 4/3, slope = ((-1)(-4/3) + 0 + (1)(5/3)) / 2 = 1.5.
    t = np.exp(np.exp([0.0, 1.0, 2.0]))
    mu = np.exp([0.0, 1.0, 3.0])
    assert growth_law.loglog_slope(t, mu) == pytest.approx(1.5, abs=1e-12)


def test_refuses_points_without_a_log_log():
    with pytest.raises(ValueError, match="t > 1"):
        growth_law.loglog_slope(np.array([1.0, 10.0]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least 2"):
        growth_law.loglog_slope(np.array([10.0]), np.array([1.0]))


def _ode_csv(path, t):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ratio", "loss", "t", "mu_ov", "mu_qk", "alpha"])
        for x in t[::-1]:  # any row order: the series is sorted by t
            w.writerow([1.0, 0.1, x, 2 * math.log(x), 0.5 * math.log(x) ** 2, 0.5])
    return str(path)


def test_ode_rows_read_the_paper_law_exactly(tmp_path):
    # mu_ov = 2 log t and mu_qk = 0.5 log^2 t: p = 1 and 2 in both decades, whatever the constants.
    t = np.logspace(3, 7, 30)
    (row,) = growth_law.ode_rows(_ode_csv(tmp_path / "ode.csv", t))
    assert row["ov"] == pytest.approx((1.0, 1.0), abs=1e-9) and row["qk"] == pytest.approx((2.0, 2.0), abs=1e-9)
    assert row["t"] == pytest.approx((1e3, 1e7))


def test_curves_use_gradient_flow_time_and_the_last_decade(tmp_path):
    # ov_norm = log(lr * step): p = 1 in t = lr * step; in t = step the slope is not 1 (the unit matters).
    # qk_norm = log(lr*step)^3 before the last decade and log(lr*step)^2 within it: the last decade reads 2.
    cell = tmp_path / "runs" / "caco_r1"
    cell.mkdir(parents=True)
    lr = 0.01
    (cell / "seed1.json").write_text(json.dumps({"train_config": {
        "parametrisation": "caco", "init": "fig2", "qk_ratio": 1.0, "qk_schedule": "constant", "lr_ov": lr}}))
    steps = np.unique(np.logspace(3, 7, 200).round())
    t_end = lr * steps[-1]
    with open(cell / "seed1_curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "step", "train_loss", "train_distinct_mass", "qk_norm", "ov_norm"])
        w.writerow([0, 0, "", "", 1.0, 1.0])  # the initial state, at t = 0: left out
        for e, s in enumerate(steps, 1):
            lt = math.log(lr * s)
            qk = lt ** 2 if lr * s >= t_end / 10 else lt ** 3 / math.log(t_end / 10)
            w.writerow([e, s, 0.1, 0.5, qk, lt])
    (row,) = growth_law.curve_rows(str(tmp_path / "runs"))
    assert row["ov_gf"][0] == pytest.approx(1.0, abs=1e-9) and row["qk_gf"][0] == pytest.approx(2.0, abs=1e-9)
    assert abs(row["ov_steps"][0] - 1.0) > 0.2
    assert row["seeds"] == 1 and row["steps"] == int(steps[-1]) and row["param"] == "CACO"
