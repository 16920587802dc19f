"""MQAR through the training loop (`configs/mqar.py`, task "mqar"): derived fields follow command-line overrides,
and the accuracy is zoology's metric on the labelled positions only, checked against hand counts."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import jax
import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.configs import mqar as mqar_cfg
from coupled_qk_jax.data import mqar
from coupled_qk_jax.training import loop, tasks
from coupled_qk_jax.training.config import RunConfig

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


# The module's one run: 64 training examples in batches of 32 (2 steps an epoch), 40 validation and 40 test ones.
NUM_TRAIN, NUM_HELD_OUT, BATCH, EPOCHS = 64, 40, 32, 4


def _level():
    return dataclasses.replace(mqar.LEVELS["easy"], num_train=NUM_TRAIN, num_test=NUM_HELD_OUT,
                               num_valid=NUM_HELD_OUT)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Four epochs (8 steps) of MQAR easy, two seeds, through the loop, with an evaluation and a checkpoint every
    epoch and keep_last 1, so that only checkpoint.keep_every keeps the older evaluated checkpoints (what
    select_test reads). lr 1e-2: even so a run this short stays near accuracy 0, and ties go to the earliest step
    (in select_test as in numpy's argmax, the reference)."""
    cfg = mqar_cfg.get_config("coupled_euler,easy")
    cfg.mqar.update(epochs=EPOCHS, num_train=NUM_TRAIN, num_valid=NUM_HELD_OUT, num_test=NUM_HELD_OUT,
                    eval_every_epochs=1)
    cfg.train.update(batch_size=BATCH, num_seeds=2, lr=1e-2)
    cfg.checkpoint.keep_last = 1
    workdir = str(tmp_path_factory.mktemp("mqar") / "run")
    summary, state = loop.train(cfg, workdir, progress=False, return_state=True)
    return cfg, workdir, summary, state


def _logits(cfg, params, inputs):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: loop.TransformerLM(ModelConfig.from_dict(cfg.model.to_dict()), 0)))
    return np.asarray(_forward(graphdef, params, inputs), np.float64)


@jax.jit  # cheaper than op by op; the graphdef is a static pytree node: one compilation per model and shape
def _forward(graphdef, params, inputs):
    return nnx.merge(graphdef, params)(inputs)


def test_mqar_run_accuracy_equals_hand_count(trained):
    cfg, _, summary, state = trained
    assert summary["task"] == "mqar" and summary["status"] == "completed"
    assert summary["step"] == cfg.train.steps == 8 and summary["steps_per_epoch"] == 2
    level = _level()
    # the run's evaluations (and its summary) score the validation segment
    inputs, labels = level.mix().validation_segments()[0].generate()
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
    batch = task.valid[0]
    params0 = loop.host_params(run.params(replica=0))
    preds = _logits(cfg, params0, batch["inputs"]).argmax(-1)
    labels = np.full_like(batch["labels"], -100)
    hand = []
    for e in np.flatnonzero(batch["mask"]):
        asked = np.flatnonzero(batch["labels"][e] != -100)
        j = e % 5
        labels[e, asked] = np.where(np.arange(len(asked)) < j, preds[e, asked], (preds[e, asked] + 1) % 512)
        hand.append(j / len(asked))
    task.held_out["validation"] = [{**batch, "labels": labels}]
    out = task.make_evaluator(run.graphdef, run.layout.shardings["params"], run.mesh, run.num_replicas)(
        run.params(replica=None))
    assert out["valid/accuracy"][0] == pytest.approx(np.mean(hand), abs=1e-9)
    assert out["valid/examples"] == 40  # the padding rows of the batch are not examples


def _hand_accuracy(cfg, params, segment):
    inputs, labels = segment.generate()
    preds = _logits(cfg, params, inputs.astype(np.int32)).argmax(-1)
    asked = labels != -100
    return float(np.mean([(preds[e][asked[e]] == labels[e][asked[e]]).mean() for e in range(len(inputs))]))


def test_validation_and_test_splits_are_different_segments(trained):
    """eval.py --split=validation and --split=test score different examples (main scored the test segment for
    both): each split's accuracy equals the hand count on its own segment, and the loss differs between them."""
    cfg, workdir, _, _ = trained
    level = _level()
    valid_seg, test_seg = level.mix().validation_segments()[0], level.mix().segments()[1][0]
    assert valid_seg.seed != test_seg.seed
    from coupled_qk_jax.training.run import Run

    run = Run.open(workdir, config=cfg)
    params = loop.host_params(run.params(replica=None))
    results = {split: run.evaluate(split) for split in ("validation", "test")}
    for i in range(2):
        p = loop.seed_slice(params, i)
        assert results["validation"]["valid/accuracy/seeds"][i] == pytest.approx(_hand_accuracy(cfg, p, valid_seg),
                                                                                 abs=1e-9)
        assert results["test"]["valid/accuracy/seeds"][i] == pytest.approx(_hand_accuracy(cfg, p, test_seg),
                                                                           abs=1e-9)
    assert results["validation"]["valid/loss"] != results["test"]["valid/loss"]


def test_eval_prints_mqar_metrics_without_the_validation_prefix(trained, capsys):
    """eval.py's report of a test evaluation names the split once and its metrics plainly: zoology's "valid/" keys
    (kept in the JSON) do not make a test score read as a validation one."""
    from coupled_qk_jax.cli import eval as eval_cli

    cfg, workdir, _, _ = trained
    from coupled_qk_jax.training.run import Run

    result = Run.open(workdir, config=cfg).evaluate("test")
    eval_cli.print_result(result, "test")
    out = capsys.readouterr().out
    assert " test, 2 replicas" in out and "accuracy" in out and "loss" in out  # positive control: it printed
    assert "valid/" not in out
    seed0 = out.splitlines()[2].split()
    assert float(seed0[2]) == pytest.approx(result["valid/accuracy/seeds"][0], abs=5e-5)


def _order(seed, shuffle=True, epochs=2):
    cfg = mqar_cfg.get_config("standard,easy")
    cfg.mqar.update(num_train=50, num_valid=8, num_test=8, shuffle=shuffle)
    cfg.train.batch_size = 16  # 4 batches per epoch, the last one 2 rows + 14 padding rows
    task = tasks.MQARTask(RunConfig.from_configdict(cfg), batch_devices=1)
    ds = task.train_dataset(seed)
    inputs = task.train.inputs
    out = []
    for e in range(epochs):
        rows = []
        for b in range(len(task.train)):
            batch = ds[e * len(task.train) + b]
            real = batch["targets"] != -100
            for x, keep in zip(batch["inputs"], real.any(axis=1)):
                if keep:  # which stored example this row is, by content
                    rows.append(int(np.flatnonzero((inputs == x).all(axis=1))[0]))
        out.append(rows)
    return out


def test_the_seed_sets_the_data_order_and_every_epoch_visits_each_example_once():
    """main ignored the seed (`del seed`): every seed saw zoology's stored order. Now the same seed gives the same
    order, two seeds give different ones, each epoch is a permutation of all 50 examples, and epochs differ."""
    a0, a1 = _order(0), _order(1)
    assert a0 == _order(0)
    assert a0 != a1
    for order in (*a0, *a1):
        assert sorted(order) == list(range(50))  # each example exactly once per epoch
    assert a0[0] != a0[1]  # reshuffled every epoch
    # positive control: with mqar.shuffle off the order is the stored one, the same for every seed
    assert _order(0, shuffle=False) == _order(1, shuffle=False) == [list(range(50))] * 2


def test_a_held_out_split_that_overlaps_train_is_refused(monkeypatch):
    """The task checks the splits by content: a validation segment seeded like the training one (forced here) holds
    the training examples and is refused with one line; the real seeds pass (positive control)."""
    cfg = mqar_cfg.get_config("standard,easy")
    cfg.mqar.update(num_train=48, num_valid=48, num_test=8)
    tasks.MQARTask(RunConfig.from_configdict(cfg), batch_devices=1)
    train_seed = mqar.segment_seeds(1, 1)[0][0]
    monkeypatch.setattr(mqar, "validation_seeds", lambda n_train, n_test, n_valid, seed: [train_seed] * n_valid)
    with pytest.raises(loop.UserError, match="48 validation example.* also occur in train"):
        tasks.MQARTask(RunConfig.from_configdict(cfg), batch_devices=1)


def test_zoology_protocol_config_is_figure_2():
    from coupled_qk_jax.training import optimizer as opt_lib

    for level, L, N, bs in (("easy", 64, 4, 512), ("medium", 128, 8, 512), ("hard", 256, 16, 256)):
        cfg = mqar_cfg.get_config(f"standard,{level},zoology")
        m, t = cfg.model, cfg.train
        assert (m.vocab_size, m.max_len, m.n_heads, m.dropout, m.d_model, m.n_layers, m.d_ff) == (
            8192, L, 1, 0.1, 64, 2, 0)
        assert (cfg.mqar.num_train, cfg.mqar.num_valid, cfg.mqar.num_test) == (100_000, 3_000, 3_000)
        assert t.batch_size == bs and cfg.mqar.epochs == 64 and cfg.mqar.eval_every_epochs == 1
        assert (t.b1, t.b2, t.eps, t.weight_decay, t.grad_clip, t.warmup_steps, t.min_lr_ratio) == (
            0.9, 0.999, 1e-8, 0.1, 0.0, 0, 0.0)
        spe = math.ceil(100_000 / bs)
        assert t.schedule_every == spe and t.steps == 64 * spe and t.eval_every == spe
        assert (t.early_stop.metric, t.early_stop.threshold) == ("valid/accuracy", 0.99)
        assert cfg.checkpoint.keep_every == t.eval_every
        cfg.checkpoint.keep_every = 7  # its own field: setting it leaves the evaluation interval alone
        cfg.checkpoint.every = 5  # likewise (main: this set mqar.steps_per_epoch, the same reference, to 5)
        assert t.eval_every == spe and cfg.mqar.steps_per_epoch == spe and t.steps == 64 * spe
    assert list(mqar_cfg.ZOOLOGY_LRS) == np.logspace(-4, -2, 4).tolist()
    # widths are a sweep axis: the coupling width follows d_model; differential keeps two heads
    cfg = mqar_cfg.get_config("coupled_euler,easy,zoology")
    cfg.model.d_model = 256
    assert cfg.model.coupling_hidden == 192 and ModelConfig.from_dict(cfg.model.to_dict()).head_dim == 256
    assert mqar_cfg.get_config("differential,easy,zoology").model.n_heads == 2
    # the schedule: torch's CosineAnnealingLR(T_max=64, eta_min=0) stepped once an epoch, lr_e = lr (1 + cos(pi e / 64)) / 2
    cfg = mqar_cfg.get_config("standard,easy,zoology")
    schedule = opt_lib.learning_rate_schedule(RunConfig.from_configdict(cfg).train)
    lr, spe = cfg.train.lr, cfg.mqar.steps_per_epoch
    for step in (0, 1, spe - 1, spe, 5 * spe + 7, 63 * spe, 64 * spe - 1):
        epoch = step // spe
        assert float(schedule(step)) == pytest.approx(lr * (1 + math.cos(math.pi * epoch / 64)) / 2, abs=1e-6 * lr)  # float32


def test_no_clipping_passes_a_large_gradient_unchanged():
    """grad_clip = 0 is no clipping (main clipped to norm 0: a zero update). Reference: optax.adamw alone."""
    import jax.numpy as jnp
    import optax

    from coupled_qk_jax.training import optimizer as opt_lib

    cfg = RunConfig.from_configdict(mqar_cfg.get_config("standard,easy,zoology")).train
    params = {"w": jnp.ones((3,))}
    grads = {"w": jnp.array([100.0, -50.0, 3.0])}
    tx = opt_lib.make_optimizer(params, cfg)
    ours, _ = tx.update(grads, tx.init(params), params)
    ref_tx = optax.adamw(opt_lib.learning_rate_schedule(cfg), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1,
                         mask=opt_lib.decay_mask(params))
    ref, _ = ref_tx.update(grads, ref_tx.init(params), params)
    np.testing.assert_allclose(np.asarray(ours["w"]), np.asarray(ref["w"]), rtol=1e-6)
    assert np.abs(np.asarray(ours["w"])).min() > 0
    # the per-step default is unchanged: schedule_every = 1 is optax's schedule itself
    lm_train = RunConfig.from_configdict(mqar_cfg.get_config("standard,easy")).train
    assert lm_train.schedule_every == 1
    plain = optax.warmup_cosine_decay_schedule(0.0, lm_train.lr, lm_train.warmup_steps, lm_train.steps,
                                               lm_train.lr * lm_train.min_lr_ratio)
    for step in (0, 7, 100, lm_train.steps - 1):
        assert float(opt_lib.learning_rate_schedule(lm_train)(step)) == float(plain(step))


def test_test_split_is_scored_at_each_seeds_validation_selected_checkpoint(trained):
    """The module's run (an evaluation and a checkpoint every epoch, keep_last 1). select_test picks each seed's
    best validation step from metrics.jsonl (reference: numpy argmax here), restores that checkpoint and scores the
    test segment there (reference: hand count with those params); --prune then leaves only the selected steps and
    the newest (the newest is what the module's other tests open, so the pruning leaves them their run)."""
    from coupled_qk_jax.training.checkpoint import Checkpointer, abstract_target
    from coupled_qk_jax.training.writers import read_metrics
    from experiments.select_test import select_test

    cfg, workdir, _, _ = trained
    rows = [r for r in read_metrics(workdir) if "valid/accuracy" in r]
    steps = sorted({r["step"] for r in rows})
    assert steps == [2, 4, 6, 8]
    acc = np.array([next(r for r in rows if r["step"] == s)["valid/accuracy/seeds"] for s in steps])  # [E, S]
    expected = [steps[int(np.argmax(acc[:, i]))] for i in range(2)]
    result = select_test(workdir)
    assert result["selected_step"] == expected
    test_seg = _level().mix().segments()[1][0]
    s = loop.setup(RunConfig.from_configdict(cfg), workdir, None, read_only=True)
    try:
        for i, step in enumerate(expected):
            state, _ = s.checkpointer.restore(step, abstract_target(s.abstract_state, s.shardings))
            p = loop.seed_slice(loop.host_params(state["params"]), i)
            assert result["test"]["valid/accuracy"][i] == pytest.approx(_hand_accuracy(cfg, p, test_seg), abs=1e-9)
    finally:
        s.checkpointer.close()
    select_test(workdir, prune=True)  # read back from test_selected.json, then pruned
    ck = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert ck.all_steps() == sorted(set(expected) | {8})
    ck.close()
