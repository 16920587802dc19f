"""MQAR through the training loop (`configs/mqar.py`, task "mqar"): derived fields follow command-line overrides,
and the accuracy is zoology's metric on the labelled positions only, checked against hand counts."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from configs import mqar as mqar_cfg
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.data import mqar
from coupled_qk_jax.training import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("level", sorted(mqar.LEVELS))
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_config_builds_for_every_level(level, variant):
    cfg = mqar_cfg.get_config(f"{variant},{level}")
    lvl = mqar.LEVELS[level]
    model = ModelConfig.from_dict(dict(cfg.model))  # validates
    assert (model.d_model, model.max_len, model.vocab_size) == (lvl.d_model, lvl.seq_len, lvl.vocab_size)
    assert model.n_layers == 2 and model.d_ff == 0 and model.positions == "learned"
    assert cfg.task == "mqar" and cfg.data.seq_len == lvl.seq_len and cfg.train.batch_size == lvl.train_batch_size
    assert cfg.train.steps == cfg.mqar.epochs * math.ceil(lvl.num_train / lvl.train_batch_size)


def test_unknown_level():
    with pytest.raises(ValueError, match="unknown MQAR level"):
        mqar_cfg.get_config("standard,impossible")


def test_command_line_epochs_override_changes_steps(monkeypatch):
    """train.py's flag parsing (config_flags, locked config): overriding mqar.epochs / num_train / batch_size
    re-derives train.steps, the warm-up, the eval interval and the checkpoint interval with no extra call."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True)
    argv = ["train.py", f"--config={ROOT}/configs/mqar.py:standard,easy", "--config.mqar.epochs=3",
            "--config.mqar.num_train=1000", "--config.train.batch_size=32"]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv, as under app.run
    fv(argv)
    cfg = fv.config
    spe = math.ceil(1000 / 32)  # 32 batches per epoch
    assert cfg.mqar.steps_per_epoch == spe
    assert cfg.train.steps == 3 * spe
    assert cfg.train.warmup_steps == 3 * spe // 20
    assert cfg.train.eval_every == cfg.mqar.eval_every_epochs * spe and cfg.checkpoint.every == spe
    assert cfg.to_dict()["train"]["steps"] == 3 * spe  # what the checkpoint's config records


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of MQAR easy (128 training examples, 40 test examples), two seeds, through the loop."""
    cfg = mqar_cfg.get_config("coupled_euler,easy")
    cfg.mqar.update(epochs=1, num_train=128, num_test=40)
    cfg.train.num_seeds = 2
    workdir = str(tmp_path_factory.mktemp("mqar") / "run")
    summary, state = loop.train(cfg, workdir, progress=False, return_state=True)
    return cfg, workdir, summary, state


def _logits(cfg, params, inputs):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: loop.TransformerLM(ModelConfig.from_dict(cfg.model.to_dict()), 0)))
    return np.asarray(nnx.merge(graphdef, params)(inputs), np.float64)


def test_mqar_run_accuracy_equals_hand_count(trained):
    cfg, _, summary, state = trained
    assert summary["task"] == "mqar" and summary["status"] == "completed"
    assert summary["step"] == cfg.train.steps == 2 and summary["steps_per_epoch"] == 2
    level = dataclasses.replace(mqar.LEVELS["easy"], num_train=128, num_test=40)
    inputs, labels = level.mix().segments()[1][0].generate()  # the test segment
    for i in range(2):
        logits = _logits(cfg, loop.seed_slice(state["params"], i), inputs.astype(np.int32))
        preds = logits.argmax(-1)
        # by hand: per example, the fraction of its labelled positions answered right; then the mean over examples
        per_example = []
        for e in range(inputs.shape[0]):
            asked = [t for t in range(inputs.shape[1]) if labels[e, t] != -100]
            assert len(asked) == 4
            per_example.append(sum(preds[e, t] == labels[e, t] for t in asked) / len(asked))
        assert summary["valid/accuracy/seeds"][i] == pytest.approx(np.mean(per_example), abs=1e-9)
        assert summary["valid/num_kv_pairs/accuracy-4/seeds"][i] == pytest.approx(np.mean(per_example), abs=1e-9)
        # valid/loss: the token mean of the cross-entropy over the labelled positions (numpy float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        asked = labels != -100
        nll = -np.take_along_axis(logp, np.where(asked, labels, 0)[..., None], -1)[..., 0]
        assert summary["valid/loss/seeds"][i] == pytest.approx(nll[asked].mean(), rel=1e-4)
    assert summary["valid/examples"] == 40


def test_accuracy_counts_only_labelled_positions(trained):
    """A fixed batch whose labels agree with the model's own predictions at exactly j_e of each example's 4
    labelled positions (j_e = e mod 5): accuracy = mean(j_e / 4), whatever the model predicts elsewhere."""
    cfg, workdir, _, _ = trained
    from coupled_qk_jax.training.run import Run

    run = Run.open(workdir, config=cfg)
    task = run.task()
    batch = task.test[0]
    params0 = loop.host_params(run.params(replica=0))
    preds = _logits(cfg, params0, batch["inputs"]).argmax(-1)
    labels = np.full_like(batch["labels"], -100)
    hand = []
    for e in np.flatnonzero(batch["mask"]):
        asked = np.flatnonzero(batch["labels"][e] != -100)
        j = e % 5
        labels[e, asked] = np.where(np.arange(len(asked)) < j, preds[e, asked], (preds[e, asked] + 1) % 512)
        hand.append(j / len(asked))
    task.test = [{**batch, "labels": labels}]
    out = task.make_evaluator(run.graphdef, run.layout.shardings["params"], run.mesh, run.num_replicas)(
        run.params(replica=None))
    assert out["valid/accuracy"][0] == pytest.approx(np.mean(hand), abs=1e-9)
    assert out["valid/examples"] == 40  # the padding rows of the batch are not examples
