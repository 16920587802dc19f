"""Training observability (training/observe.py): FLOP formula, Δt table, in-step norms and learning rate, MFU,
against hand computations and float64 numpy."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.training import observe


def test_model_flops_per_step_by_hand():
    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4)
    # 6 * N * B * T + 12 * L * T^2 * d * B with N = 1000, B = 2, T = 8
    assert observe.model_flops_per_step(1000, cfg, 2, 8) == 6 * 1000 * 2 * 8 + 12 * 3 * 64 * 64 * 2
    assert observe.mfu(1e12, 10, 5.0, 1.0, 2) == pytest.approx(1.0)  # 2e12 FLOP/s on 2 devices of 1 TFLOP/s
    assert observe.mfu(1e12, 10, 5.0, 0.0, 2) is None


def test_dt_table_orders_layers_numerically_and_observables_match_numpy():
    rng = np.random.default_rng(0)
    dts = [rng.normal(size=4).astype(np.float32) for _ in range(12)]
    params = {"blocks": {i: {"attn": {"dt": dts[i], "wq": rng.normal(size=(3, 4)).astype(np.float32)}}
                         for i in range(12)}, "embed": rng.normal(size=(5, 3)).astype(np.float32)}
    table = np.asarray(observe.dt_table(params))
    np.testing.assert_array_equal(table, np.stack(dts))  # layer 10 after layer 9, not after layer 1
    assert observe.dt_table({"embed": np.zeros(3)}) is None
    schedule = optax.linear_schedule(0.0, 1.0, 10)
    obs = observe.step_observables(params, np.int32(3), schedule)
    flat = np.concatenate([np.ravel(x).astype(np.float64) for x in
                           [params["embed"]] + [v for b in params["blocks"].values() for v in b["attn"].values()]])
    assert float(obs["param_norm"]) == pytest.approx(np.sqrt(np.sum(flat ** 2)), rel=1e-6)
    assert float(obs["lr"]) == pytest.approx(0.3)
    scalars = observe.dt_scalars(table[None])  # a leading seed axis of 1
    assert scalars["dt/layer11/head2"].tolist() == [dts[11][2]]
    assert scalars["dt/layer3/max"][0] == dts[3].max() and scalars["dt/layer3/mean"][0] == pytest.approx(dts[3].mean())
