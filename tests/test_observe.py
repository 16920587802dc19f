"""Training observability (training/observe.py): FLOP formula, Δt table, in-step norms and learning rate, MFU,
against hand computations and float64 numpy."""

from __future__ import annotations

import os

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


# -- in the training loop --------------------------------------------------------------------------------------------
import math  # noqa: E402

import jax  # noqa: E402

from coupled_qk_jax.training import loop  # noqa: E402
from coupled_qk_jax.training.writers import read_metrics  # noqa: E402
from test_training import tiny_config  # noqa: E402


def test_training_logs_norms_lr_dt_mfu_and_a_profile(tmp_path):
    cfg = tiny_config(tmp_path, steps=6, log_every=2, profile_steps=2, peak_tflops=1.0)
    work = str(tmp_path / "run")
    summary, state = loop.train(cfg, work, progress=False, return_state=True)
    rows = [r for r in read_metrics(work) if "train_loss" in r]
    assert [r["step"] for r in rows] == [2, 4, 6]
    last = rows[-1]
    flat = np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(state["params"])])
    assert last["param_norm"] == pytest.approx(np.sqrt(np.sum(flat ** 2)), rel=1e-5)
    # warm-up 2 steps to lr 3e-3, then cosine to 0.1 * lr over the remaining 4; the update of step s uses count s - 1
    lr, end = 3e-3, 3e-4
    assert rows[0]["lr"] == pytest.approx(lr * 1 / 2)
    assert rows[1]["lr"] == pytest.approx(end + (lr - end) * 0.5 * (1 + math.cos(math.pi * 1 / 4)))
    for i, block in state["params"]["blocks"].items():
        for h, value in enumerate(np.asarray(block["attn"]["dt"])):
            assert last[f"dt/layer{i}/head{h}"] == pytest.approx(float(value), rel=1e-6)
        assert last[f"dt/layer{i}/max"] == pytest.approx(float(np.max(block["attn"]["dt"])), rel=1e-6)
    assert last["mfu"] == pytest.approx(last["model_tflops_per_second"] / jax.device_count())
    assert last["model_tflops_per_second"] > 0 and summary["first_step_seconds"] > 0
    traces = [f for _, _, fs in os.walk(os.path.join(work, "profile")) for f in fs if f.endswith(".trace.json.gz")]
    assert traces, "train.profile_steps=2 should leave a jax.profiler trace in WORKDIR/profile"


def test_nonfinite_step_is_exact_without_per_step_syncs(tmp_path):
    """Logging and checkpoints every 8 steps: the loop syncs only after step 1 and at step 8, yet the error names the
    first non-finite step. lr 1e30 from step 2 on (warm-up of 1 step from 0) makes step 2's update explode, so the
    loss of step 3, computed with those params, is the first non-finite one."""
    cfg = tiny_config(tmp_path, lr=1e30, steps=8, warmup_steps=1, grad_clip=1e30, log_every=8)
    cfg.checkpoint.every = 8
    with pytest.raises(loop.NonFiniteLossError, match=r"at step 3;.*last good checkpoint is none"):
        loop.train(cfg, str(tmp_path / "run"), progress=False)


def test_compilation_cache_directory(tmp_path, monkeypatch):
    """The test session's cache is conftest's temporary directory (the user's ~/.cache is never touched); without
    JAX_COMPILATION_CACHE_DIR the default is DEFAULT_COMPILATION_CACHE under the home directory, created on demand;
    JAX_ENABLE_COMPILATION_CACHE=false turns it off."""
    session = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert observe.enable_compilation_cache() == session and os.path.isdir(session)
    monkeypatch.setenv("HOME", str(tmp_path))  # expanduser("~") follows HOME: the default lands in tmp_path
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        default = observe.enable_compilation_cache()
        assert default == str(tmp_path / ".cache" / "coupled_qk_jax" / "xla") and os.path.isdir(default)
        jax.config.update("jax_enable_compilation_cache", False)
        assert observe.enable_compilation_cache() is None
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", session)


def _tfrecords(path) -> list[bytes]:
    """The records of a TFRecord file (an event file): u64 length, u32 crc, data, u32 crc; read by hand."""
    import struct  # noqa: PLC0415

    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        out.append(data[at + 12:at + 12 + length])
        at += 12 + length + 4
    return out


def test_tensorboard_gets_every_scalar_of_a_log_line_in_one_event(tmp_path):
    from tensorboardX.proto.event_pb2 import Event  # noqa: PLC0415

    from coupled_qk_jax.training.writers import MetricsWriter  # noqa: PLC0415

    writer = MetricsWriter(str(tmp_path), seeds=[3, 4])
    writer.write(5, {"train_loss": 1.5, "train_loss/seeds": [1.0, 2.0], "lr": 0.125, "status": "ok"})
    writer.write(10, {"val_loss": 2.5})
    writer.close()
    (events_file,) = (tmp_path / "tb").iterdir()
    events = [Event.FromString(record) for record in _tfrecords(events_file)]
    with_scalars = [e for e in events if e.summary.value]
    assert [e.step for e in with_scalars] == [5, 10]  # one event per line, however many keys it has
    assert {(e.step, v.tag): v.simple_value for e in with_scalars for v in e.summary.value} == {
        (5, "train_loss"): 1.5, (5, "train_loss/seed_3"): 1.0, (5, "train_loss/seed_4"): 2.0, (5, "lr"): 0.125,
        (10, "val_loss"): 2.5}
