"""train.early_stop: the stopping rules against hand-worked trajectories, and the loop's stop, resume and refusal."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from test_training import tiny_config

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training import loop, rundir
from coupled_qk_jax.training.config import EarlyStopConfig
from coupled_qk_jax.training.early_stop import EarlyStop
from coupled_qk_jax.training.writers import read_metrics


def _rule(num_seeds: int = 1, **fields) -> EarlyStop:
    rule = EarlyStopConfig(**{"metric": "valid/accuracy", "mode": "max", "patience": 0, "min_delta": 0.0,
                              "threshold": None, **fields})
    return EarlyStop.from_config(rule, num_seeds, ("valid/accuracy", "valid/loss"))


def _stop_step(rule: EarlyStop, trajectory: list) -> int | None:
    for i, v in enumerate(trajectory):
        if rule.update(10 * (i + 1), v):
            return 10 * (i + 1)
    return None


def test_patience_min_delta_and_threshold_by_hand():
    # best 0.30 at step 10, 0.50 at 20; 0.505 and 0.51 are within min_delta 0.02 of it, 0.49 is worse: the third
    # evaluation in a row without a gain of more than 0.02 is step 50.
    assert _stop_step(_rule(patience=3, min_delta=0.02), [0.30, 0.50, 0.505, 0.51, 0.49, 0.99]) == 50
    # min_delta 0: 0.505 and 0.51 are improvements, so the count restarts; 0.49, 0.50, 0.51 are the three misses.
    assert _stop_step(_rule(patience=3), [0.30, 0.50, 0.505, 0.51, 0.49, 0.50, 0.51, 0.9]) == 70
    # Threshold: the first evaluation at or above it, whatever the patience.
    assert _stop_step(_rule(patience=100, threshold=0.99), [0.2, 0.98, 0.99, 0.5]) == 30
    # mode "min" on a loss: a fall counts, a rise does not.
    loss = _rule(metric="valid/loss", mode="min", patience=2)
    assert _stop_step(loss, [3.0, 2.0, 2.5, 1.9, 1.95, 2.0]) == 60
    # NaN is not an improvement nor a miss (the loop's non-finite check stops such a run).
    assert _stop_step(_rule(patience=1), [0.5, float("nan"), 0.4]) == 30


def test_seeds_are_judged_apart_and_the_run_stops_when_all_have():
    rule = _rule(num_seeds=2, patience=2, threshold=0.99)
    assert not rule.update(10, [0.99, 0.2])  # seed 0 reached the threshold; seed 1 is learning
    assert not rule.update(20, [0.10, 0.2])  # seed 0 stays judged (its later values do not count); seed 1: miss 1
    assert rule.update(30, [0.10, 0.2])  # seed 1: miss 2, plateau
    assert rule.stopped_step == 30
    assert rule.summary()["seeds"][0].startswith("reached valid/accuracy 0.99")
    assert rule.summary()["seeds"][1].startswith("plateau: valid/accuracy no better than 0.2")
    # Replaying the same log gives the same decision (what a resumed run does).
    rows = [{"step": s, "valid/accuracy": float(np.mean(v)), "valid/accuracy/seeds": v}
            for s, v in ((10, [0.99, 0.2]), (20, [0.1, 0.2]), (30, [0.1, 0.2]))]
    assert not _rule(num_seeds=2, patience=2, threshold=0.99).replay(rows, up_to_step=20)
    replay = _rule(num_seeds=2, patience=2, threshold=0.99)
    assert replay.replay(rows, up_to_step=30) and replay.stopped_step == 30
    # A repeated step (a stopped run's final evaluation) counts once: with patience 3, seed 1 has 2 misses, not 3.
    longer = _rule(num_seeds=2, patience=3, threshold=0.99)
    assert not longer.replay(rows + [rows[-1]], up_to_step=30) and longer.waited.tolist() == [0, 2]


@pytest.mark.parametrize("fields, message", [
    ({"metric": "accuracy", "patience": 1}, r"not a metric of this task.*valid/accuracy"),
    ({"mode": "up", "patience": 1}, r"mode must be 'max' or 'min'"),
    ({}, r"needs a rule"),
    ({"patience": -1}, r">= 0"),
])
def test_wrong_settings_are_one_line_user_errors(fields, message):
    with pytest.raises(UserError, match=message):
        _rule(**fields)
    assert EarlyStop.from_config(EarlyStopConfig(), 1, ()) is None  # no metric: off


def test_loop_stops_on_plateau_resumes_to_the_same_step_and_trains_no_further(tmp_path):
    """min_delta so large that no evaluation improves: the run stops at its second evaluation (patience 1), with a
    checkpoint there. A run killed after the first evaluation resumes, replays the log and stops at the same step;
    resuming a stopped run trains nothing. An old run directory without the field resumes under the new config."""
    rule = {"early_stop.metric": "val_loss", "early_stop.mode": "min", "early_stop.patience": 1,
            "early_stop.min_delta": 1e9}

    def plain(**train):  # one layer: the rule reads evaluations, whatever the model (and each train() traces it)
        cfg = tiny_config(tmp_path, "standard", steps=20, eval_every=4, **train)
        cfg.model.n_layers = 1
        return cfg

    def config(**train):
        cfg = plain(**train)
        for k, v in rule.items():
            cfg.train[k.split(".")[0]][k.split(".")[1]] = v
        return cfg

    straight = loop.train(config(), str(tmp_path / "straight"), progress=False)
    assert straight["status"] == "completed" and straight["step"] == 8 and straight["checkpoint_step"] == 8
    assert straight["early_stop"]["stopped_step"] == 8 and "plateau" in straight["early_stop"]["seeds"][0]
    # history.jsonl names the code of the start: this checkout's commit, as git itself gives it
    head = subprocess.run(["git", "rev-parse", "HEAD"], check=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True).stdout.strip()
    start = json.loads((tmp_path / "straight" / rundir.HISTORY).read_text().splitlines()[0])
    assert start["event"] == "start" and head and start["commit"].startswith(head)
    evals = [r["step"] for r in read_metrics(str(tmp_path / "straight")) if "val_loss" in r]
    assert evals == [4, 8, 8]  # two periodic evaluations, then the final whole-split one at the stop

    part = loop.train(config(stop_after=5), str(tmp_path / "resumed"), progress=False)
    assert part["status"] == "stopped" and part["step"] == 5
    resumed = loop.train(config(), str(tmp_path / "resumed"), progress=False)
    assert resumed["step"] == 8 and resumed["status"] == "completed"
    assert resumed["val_loss"] == straight["val_loss"]
    again = loop.train(config(), str(tmp_path / "resumed"), progress=False)
    assert again["step"] == 8 and again["val_loss"] == straight["val_loss"]

    # Changing the rule needs --allow_change (and is recorded); it is one of the changeable fields.
    with pytest.raises(UserError, match=r"train.early_stop.patience: run 1, now 3.*--allow_change"):
        cfg = config()
        cfg.train.early_stop.patience = 3
        loop.train(cfg, str(tmp_path / "resumed"), progress=False)

    # A run directory written before train.early_stop existed: its config.json lacks the block.
    old = plain(stop_after=4)
    loop.train(old, str(tmp_path / "old"), progress=False)
    path = tmp_path / "old" / rundir.CONFIG
    saved = json.loads(path.read_text())
    del saved["train"]["early_stop"]
    path.write_text(json.dumps(saved))
    assert rundir.config_differences(saved, old.to_dict()) == {}
    old.train.stop_after = 6
    assert loop.train(old, str(tmp_path / "old"), progress=False)["step"] == 6


def test_selected_steps_best_validation_up_to_each_seeds_stop_by_hand():
    from coupled_qk_jax.training.early_stop import selected_steps

    rows = [{"step": 5, "train_loss": 1.0},  # not an evaluation
            {"step": 10, "valid/accuracy": 0.5, "valid/accuracy/seeds": [0.2, 0.8]},
            {"step": 20, "valid/accuracy": 0.7, "valid/accuracy/seeds": [0.6, 0.8]},
            {"step": 30, "valid/accuracy": 0.8, "valid/accuracy/seeds": [0.9, 0.7]},
            {"step": 40, "valid/accuracy": 0.85, "valid/accuracy/seeds": [0.7, 1.0]},
            {"step": 40, "valid/accuracy": 0.0, "valid/accuracy/seeds": [0.0, 0.0]}]  # the final row: same step
    # seed 0: best 0.9 at 30; seed 1: 0.8 at 10 and 20 (the earliest wins), 1.0 at 40 is after its stop at 30
    assert selected_steps(rows, "valid/accuracy", "max", 2, [None, 30]) == [(30, 0.9), (10, 0.8)]
    assert selected_steps(rows, "valid/accuracy", "max", 2) == [(30, 0.9), (40, 1.0)]
    assert selected_steps(rows, "valid/accuracy", "min", 2) == [(10, 0.2), (30, 0.7)]
    single = [{"step": 1, "val_loss": 3.0}, {"step": 2, "val_loss": 2.5}, {"step": 3, "val_loss": 2.7}]
    assert selected_steps(single, "val_loss", "min", 1) == [(2, 2.5)]


def test_early_stop_records_each_seeds_stop_step():
    rule = _rule(2, threshold=0.9)
    for step, values in ((10, [0.95, 0.2]), (20, [0.5, 0.3]), (30, [0.1, 0.91])):
        rule.update(step, values)
    assert rule.summary()["seed_steps"] == [10, 30] and rule.stopped_step == 30
