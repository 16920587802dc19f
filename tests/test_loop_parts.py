"""The training loop's pieces (training/loop_parts.py) against hand-computed values, the save clock's broadcasts
counted over a real run (at most one per log interval, not one per step), and the typed config
(training/config.py): defaults, did-you-mean errors, types, missing fields."""

from __future__ import annotations

import os

import ml_collections
import numpy as np
import pytest

from coupled_qk_jax.configs import lm, mqar
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training import loop, loop_parts
from coupled_qk_jax.training.config import CheckpointConfig, EarlyStopConfig, RunConfig, TrainConfig, configdict
from coupled_qk_jax.training.loop_parts import Cadence, LossWindow, SavePolicy, ThroughputMeter, first_nonfinite
from test_training import tiny_config


# ---------------------------------------------------------------------------------------------------------- pieces
def test_cadence_by_hand():
    c = Cadence(steps=10, log_every=4, eval_every=5)
    assert [s for s in range(1, 11) if c.log(s)] == [4, 8, 10]  # and always the schedule's last step
    assert [s for s in range(1, 11) if c.eval(s)] == [5]  # step 10's evaluation is the final one, after the loop
    assert [s for s in range(1, 11) if c.clock(s)] == [4, 8]
    quiet = Cadence(steps=250, log_every=0, eval_every=0)
    assert not any(quiet.log(s) or quiet.eval(s) for s in range(1, 251))
    assert [s for s in range(1, 251) if quiet.clock(s)] == [100, 200]  # without logs: every 100 steps


def test_loss_window_by_hand():
    w = LossWindow.empty(2)
    assert np.isnan(w.mean()).all() and w.steps == 0
    w.add(np.array([1.0, 2.0]))
    w.add(np.array([3.0, 5.0]))
    np.testing.assert_array_equal(w.mean(), [2.0, 3.5])
    assert w.meta() == {"loss_sum": [4.0, 7.0], "steps": 2}
    back = LossWindow.from_meta({"train_window": w.meta()}, 2)  # what a resumed run continues from
    back.add(np.array([5.0, 2.0]))
    np.testing.assert_array_equal(back.mean(), [3.0, 3.0])
    assert w.steps == 2  # the restored window is a copy
    fresh = LossWindow.from_meta({}, 1)  # a first start
    assert fresh.steps == 0 and fresh.loss_sum.tolist() == [0.0]


def test_first_nonfinite_names_the_first_bad_step():
    ok = {"loss": np.array([1.0, 2.0]), "grad_norm": np.array([0.5, 0.5])}
    assert first_nonfinite([ok, ok]) is None
    assert first_nonfinite([]) is None
    nan_loss = {"loss": np.array([1.0, np.nan]), "grad_norm": np.array([0.5, 0.5])}
    inf_grad = {"loss": np.float32(1.0), "grad_norm": np.float32(np.inf)}
    assert first_nonfinite([ok, nan_loss, inf_grad]) == 1
    assert first_nonfinite([ok, ok, inf_grad, nan_loss]) == 2


class _Agree:
    """A stand-in for the cross-process broadcast: counts the calls and answers ``answer`` (None: the flag)."""

    def __init__(self, answer: bool | None = None) -> None:
        self.calls: list[bool] = []
        self.answer = answer

    def __call__(self, flag: bool) -> bool:
        self.calls.append(flag)
        return flag if self.answer is None else self.answer


def _saves(policy: SavePolicy, steps: range, seconds_per_step: float, stop_at_step: int | None = None) -> list[int]:
    out = []
    for step in steps:
        now = step * seconds_per_step
        if policy.due(step, stop_requested=step == stop_at_step, now=now):
            out.append(step)
            policy.saved(now)
    return out


def test_save_policy_clock_reads_once_per_log_interval():
    """every_seconds = 30 at 1 s per step, log every 5: the clock is read at steps 5, 10, ..., 90 (step 95 is the
    end of the run, saved without asking): 18 reads over 95 steps, one per log interval, never one per step."""
    agree = _Agree()
    policy = SavePolicy(every=1000, every_seconds=30, stop_at=95, cadence=Cadence(95, 5, 0), now=0.0, agree=agree)
    assert _saves(policy, range(1, 96), 1.0) == [30, 60, 90, 95]
    assert len(agree.calls) == 18 <= 95 // 5
    assert agree.calls.count(True) == 3  # the three wall-clock saves
    # Step-based saves and stop requests need no agreement (every process decides them alike) and restart the clock.
    agree = _Agree()
    policy = SavePolicy(every=20, every_seconds=30, stop_at=95, cadence=Cadence(95, 5, 0), now=0.0, agree=agree)
    assert _saves(policy, range(1, 96), 1.0, stop_at_step=47) == [20, 40, 47, 60, 80, 95]
    assert agree.calls.count(True) == 0
    # Off (every_seconds = 0): no clock reads at all.
    agree = _Agree()
    policy = SavePolicy(every=1000, every_seconds=0, stop_at=95, cadence=Cadence(95, 5, 0), now=0.0, agree=agree)
    assert _saves(policy, range(1, 96), 1.0) == [95] and agree.calls == []


def test_save_policy_follows_process_zero():
    """The agreed answer decides: a process whose own clock says 'due' does not save when process 0 says no."""
    agree = _Agree(answer=False)
    policy = SavePolicy(every=1000, every_seconds=30, stop_at=95, cadence=Cadence(95, 5, 0), now=0.0, agree=agree)
    assert _saves(policy, range(1, 96), 1.0) == [95]
    assert agree.calls.count(True) == 18 - 5  # its own clock was due from step 30 on


def test_agree_broadcasts_once_with_several_processes(monkeypatch):
    sent = []
    monkeypatch.setattr(loop_parts.jax, "process_count", lambda: 2)
    monkeypatch.setattr(loop_parts.multihost_utils, "broadcast_one_to_all",
                        lambda x: (sent.append(bool(x)), np.asarray(False))[1])
    assert loop_parts.agree_across_processes(True) is False and sent == [True]  # process 0's answer wins
    monkeypatch.setattr(loop_parts.jax, "process_count", lambda: 1)
    assert loop_parts.agree_across_processes(True) is True and sent == [True]  # one process: no collective


def test_throughput_meter_by_hand():
    m = ThroughputMeter(seconds_before=7.0, now=100.0)
    assert m.train_seconds(105.0) == 0.0 and m.tokens_per_second(100, 105.0) is None
    m.step_done(110.0)  # the first step: compilation + one step
    assert m.first_step_seconds == 10.0 and m.steps_timed == 0
    m.new_window(110.0)
    m.step_done(111.0)
    m.step_done(112.0)
    m.evaluated(0.5)
    assert m.steps_timed == 2
    assert m.train_seconds(113.0) == pytest.approx(2.5)  # 113 - 110 - 0.5 s of evaluation
    assert m.total_seconds(113.0) == pytest.approx(9.5)
    assert m.tokens_per_second(100, 113.0) == pytest.approx(2 * 100 / 2.5)
    assert m.window_seconds(112.0) == pytest.approx(1.5)  # the evaluation is not part of the window


# ------------------------------------------------------------------------------------ the save clock in a real run
def test_run_reads_the_save_clock_once_per_log_interval(tmp_path, monkeypatch):
    """12 steps, a log line every 4, checkpoint.every_seconds tiny (always due when read): the loop asks the
    cross-process agreement at steps 4 and 8 only (the old loop broadcast at every step of a multi-process
    run), and those answers are what saved (positive control: the counted calls decide real checkpoints)."""
    calls = []
    real = loop_parts.agree_across_processes
    monkeypatch.setattr(loop_parts, "agree_across_processes", lambda flag: (calls.append(flag), real(flag))[1])
    cfg = tiny_config(tmp_path, steps=12, log_every=4)
    cfg.checkpoint.update(every=1000, every_seconds=1e-6, keep_last=10, async_save=False)
    summary = loop.train(cfg, str(tmp_path / "run"), progress=False)
    assert summary["status"] == "completed" and summary["step"] == 12
    assert calls == [True] * 2 and len(calls) <= 12 // 4
    saved = sorted(int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit())
    assert saved == [4, 8, 12]  # the last step is always saved, asked or not


# ------------------------------------------------------------------------------------------------- typed config
def test_config_files_hold_the_dataclass_defaults():
    """configs/lm.py sets only its scale's values; everything else is TrainConfig's / EarlyStopConfig's default."""
    run = RunConfig.from_configdict(lm.get_config("coupled_euler,tiny"))
    assert run.train == TrainConfig(steps=2000, batch_size=16, lr=3e-3)
    assert run.checkpoint == CheckpointConfig() and run.model.dtype == "float32"
    run = RunConfig.from_configdict(lm.get_config("coupled_euler,60m"))
    assert run.train == TrainConfig(steps=4500, batch_size=256, lr=6e-4, warmup_steps=90, eval_batches=64)
    assert run.data.seq_len == 1024 and run.data.corpus == "stdlib" and run.mesh.data == -1
    assert run.mqar is None and run.scale == "60m"
    m = RunConfig.from_configdict(mqar.get_config("standard,easy"))
    spe = m.mqar.steps_per_epoch
    assert m.task == "mqar" and spe > 0 and m.train.steps == 16 * spe and m.checkpoint.every == spe
    assert m.train.warmup_steps == m.train.steps // 20 and m.train.eval_every == 2 * spe


@pytest.mark.parametrize("scale", ["60m", "150m", "350m"])
def test_accelerator_scales_default_to_bf16_a_pod_sized_batch_sampled_evaluation_and_timed_checkpoints(scale):
    run = RunConfig.from_configdict(lm.get_config(f"coupled_euler,{scale}"))
    assert run.model.dtype == "bfloat16" and run.runtime.scan_layers
    for chips in (8, 16, 32, 64, 128, 256):  # the global batch splits evenly over every power-of-two slice
        assert run.train.batch_size % chips == 0
    # About 20 tokens per parameter (Chinchilla): within 10% at this batch.
    params = {"60m": 57.8e6, "150m": 153e6, "350m": 355e6}[scale]
    tokens = run.train.steps * run.train.batch_size * run.data.seq_len
    assert 18 <= tokens / params <= 22, tokens / params
    # A periodic evaluation (forward only: a third of a training step's FLOPs per token) costs under 5% of the
    # training between two of them; the end and eval.py still score the whole split.
    eval_tokens = run.train.eval_batches * (run.train.eval_batch_size or run.train.batch_size)
    train_tokens = run.train.eval_every * run.train.batch_size
    assert 0 < eval_tokens / 3 <= 0.05 * train_tokens
    # Saves by the clock, not by steps: at most every 20 minutes, and at the end.
    assert run.checkpoint.every == run.train.steps and 0 < run.checkpoint.every_seconds <= 1200


def test_config_mistakes_are_one_line_user_errors():
    def build(**blocks):
        cfg = lm.get_config("standard,tiny").to_dict()
        for block, fields in blocks.items():
            cfg[block] = {**cfg.get(block, {}), **fields} if isinstance(fields, dict) else fields
        return RunConfig.from_configdict(cfg)

    with pytest.raises(UserError, match=r'train: unknown field \'stepz\' \(did you mean "steps"\?\)'):
        build(train={"stepz": 3})
    with pytest.raises(UserError, match=r'unknown block \'trian\' \(did you mean "train"\?\)'):
        build(trian={})
    with pytest.raises(UserError, match=r'train.early_stop: unknown field \'metrc\' \(did you mean "metric"'):
        build(train={"early_stop": {"metrc": "val_loss"}})
    with pytest.raises(UserError, match=r'model: unknown field.*did you mean "n_steps"'):
        build(model={"n_stepz": 2})
    with pytest.raises(UserError, match=r"train.steps must be an int, got '3'"):
        build(train={"steps": "3"})
    with pytest.raises(UserError, match=r"train.lr must be a float, got True"):
        build(train={"lr": True})
    with pytest.raises(UserError, match=r"checkpoint.every_seconds must be >= 0"):
        build(checkpoint={"every_seconds": -1})
    with pytest.raises(UserError, match=r"data.seq_len=512 exceeds model.max_len=256"):
        build(data={"seq_len": 512})
    with pytest.raises(UserError, match=r"data.split_fractions must be 'train,validation,test' numbers"):
        build(data={"split_fractions": "a,b,c"})
    with pytest.raises(UserError, match=r"train.early_stop needs periodic evaluations"):
        build(train={"eval_every": 0, "early_stop": {"metric": "val_loss", "patience": 2}})
    with pytest.raises(UserError, match=r"task must be one of lm, mqar"):
        build(task="mlm")


def test_missing_fields_take_the_defaults_and_optional_floats_can_be_set():
    """A run's config.json from before a field existed still builds (early_stop missing here); the ConfigDict of an
    optional float field takes a float on the command line."""
    old = lm.get_config("standard,tiny").to_dict()
    del old["train"]["early_stop"], old["data"]["max_bytes"]
    run = RunConfig.from_configdict(old)
    assert run.train.early_stop == EarlyStopConfig() and run.data.max_bytes == 0
    block = configdict(TrainConfig())
    block.early_stop.threshold = 0.5
    assert isinstance(block, ml_collections.ConfigDict) and block.early_stop.threshold == 0.5
    assert RunConfig.from_configdict({"train": {**block.to_dict(), "early_stop": {
        "metric": "val_loss", "mode": "min", "threshold": 0.5}}}).train.early_stop.threshold == 0.5


def test_train_refuses_a_bad_config_before_writing(tmp_path):
    cfg = tiny_config(tmp_path)
    with cfg.unlocked():
        cfg.train.stepz = 3
    with pytest.raises(UserError, match=r'did you mean "steps"'):
        loop.train(cfg, str(tmp_path / "never"), progress=False)
    assert not (tmp_path / "never").exists()


def test_per_seed_means_and_lists_match_a_hand_computation():
    three = {"loss": np.asarray([1.0, 2.0, 4.5], np.float32), "dt/layer0/head1": np.asarray([0.25, 0.5, 0.75]),
             "tokens": 96, "grad_norm": np.asarray([[3.0], [3.0], [6.0]], np.float32)}
    assert loop.per_seed(three, 3) == {"loss": 2.5, "loss/seeds": [1.0, 2.0, 4.5], "dt/layer0/head1": 0.5,
                                       "dt/layer0/head1/seeds": [0.25, 0.5, 0.75], "tokens": 96, "grad_norm": 4.0,
                                       "grad_norm/seeds": [3.0, 3.0, 6.0]}
    one = {"loss": np.asarray(1.5, np.float32), "lr": np.asarray([0.125]), "step": 3}
    assert loop.per_seed(one, 1) == {"loss": 1.5, "lr": 0.125, "step": 3}
