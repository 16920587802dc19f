"""Training loop, optimiser, checkpoints and evaluation (in-process, on one CPU device; the mesh test in
conftest.py's 8-device subprocess).

Every test uses a tiny model (d_model 32, 2 layers, T 32) and the byte tokenizer on a text_dir corpus written into
tmp_path, so nothing needs a download or BPE training.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from coupled_qk_jax.configs.lm import get_config
from coupled_qk_jax import sharding as shd
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.data.pipeline import IGNORE_INDEX
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import loop
from coupled_qk_jax.training import optimizer as opt_lib
from coupled_qk_jax.training.checkpoint import Checkpointer
from coupled_qk_jax.training.evaluate import evaluate_tokens
from coupled_qk_jax.training.config import TrainConfig
from coupled_qk_jax.training.steps import init_train_state, make_eval_step, make_train_step, split_model
from coupled_qk_jax.training.writers import read_metrics

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega").split()


def write_corpus(root, n_files: int = 12, words: int = 400, bad_files: int = 1) -> str:
    """A deterministic text_dir corpus (plus `bad_files` non-UTF-8 files that must be skipped)."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    for i in range(n_files):
        text = " ".join(rng.choice(WORDS, size=words)) + f"\n# file {i}\n"
        with open(os.path.join(root, f"doc{i:02d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    for i in range(bad_files):
        with open(os.path.join(root, f"bad{i}.txt"), "wb") as f:
            f.write(b"\xff\xfe\xfa not utf-8 \x80\x81")
    return str(root)


def tiny_config(tmp_path, variant: str = "coupled_euler", **train) -> ml_collections.ConfigDict:
    cfg = get_config(f"{variant},tiny")
    cfg.model.update(vocab_size=257, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=32, coupling_hidden=6,
                     affine_hidden=6)
    corpus = write_corpus(tmp_path / "corpus") if not (tmp_path / "corpus").exists() else str(tmp_path / "corpus")
    cfg.data.update(corpus=f"text_dir:{corpus}", tokenizer="byte", seq_len=32, split_fractions="0.6,0.2,0.2",
                    cache_dir=str(tmp_path / "cache"), num_threads=1)
    cfg.train.update(steps=6, batch_size=8, warmup_steps=2, log_every=1, eval_every=0, eval_batches=2)
    cfg.train.update(**train)
    cfg.checkpoint.update(every=3, keep_last=5)
    return cfg


def leaves_with_names(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---------------------------------------------------------------------------------------------------------------------
# Exact resume, incompatible configs, NaN stop, bad input.
# ---------------------------------------------------------------------------------------------------------------------


def test_exact_resume_is_bitwise(tmp_path, capfd):
    """6 steps straight == 3 steps, stop (checkpoint), resume in a fresh train() for 3 more: params and losses. Then
    the same resume under another runtime (:func:`_resume_under_another_runtime`)."""
    cfg = tiny_config(tmp_path)
    cfg.model.dropout = 0.1  # exercises the per-step dropout keys, which must depend on (seed, step) only
    straight, straight_state = loop.train(cfg, str(tmp_path / "straight"), progress=False, return_state=True)

    first = tiny_config(tmp_path, stop_after=3)
    first.model.dropout = 0.1
    part, _ = loop.train(first, str(tmp_path / "resumed"), progress=False, return_state=True)
    assert part["status"] == "stopped" and part["step"] == 3 and part["checkpoint_step"] == 3
    shutil.copytree(tmp_path / "resumed", tmp_path / "switched")  # for test_resume_under_another_runtime
    cfg2 = tiny_config(tmp_path)
    cfg2.model.dropout = 0.1
    resumed, resumed_state = loop.train(cfg2, str(tmp_path / "resumed"), progress=False, return_state=True)
    assert resumed["step"] == straight["step"] == 6

    a, b = leaves_with_names(straight_state), leaves_with_names(resumed_state)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    losses_a = [r["train_loss"] for r in read_metrics(str(tmp_path / "straight")) if "train_loss" in r]
    losses_b = [r["train_loss"] for r in read_metrics(str(tmp_path / "resumed")) if "train_loss" in r]
    assert len(losses_a) == 6 and losses_a == losses_b  # exact float equality
    assert straight["val_loss"] == resumed["val_loss"]
    assert straight["skipped_non_utf8"] == 1  # the corpus's bad file was skipped and counted

    # Checkpoint retention: steps 3 and 6 are kept; the config item holds the run's config.
    ck = Checkpointer(tmp_path / "resumed" / "checkpoints")
    assert ck.all_steps() == [3, 6]
    assert ck.read_meta(6)["config"]["model"] == cfg2.model.to_dict()
    ck.close()

    # A config with a different model is refused, and the checkpoints are left untouched.
    before = sorted(os.listdir(tmp_path / "resumed" / "checkpoints"))
    other = tiny_config(tmp_path, steps=9)
    other.model.d_model = 64
    with pytest.raises(UserError, match=r"other settings: model.d_model: run 32, now 64.*train.steps: run 6, now 9"):
        loop.train(other, str(tmp_path / "resumed"), progress=False)
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == before
    _resume_under_another_runtime(tmp_path, straight, straight_state, capfd)


def _resume_under_another_runtime(tmp_path, straight, straight_state, capfd):
    """The same run resumed at step 3 with every runtime knob a user turns when moving hardware: scanned layers (the
    checkpoint, saved unscanned, is converted with AdamW's moments), full remat and the XLA attention kernel. It is
    the same function, so the run continues as the straight one to float32 rounding (the layouts' programs round
    differently: rtol 1e-5 as in test_scan.py). The reader then opens it back in the unscanned layout."""
    from coupled_qk_jax.model import to_unscanned
    from coupled_qk_jax.training.run import Run

    cfg = tiny_config(tmp_path)
    cfg.model.dropout = 0.1
    cfg.runtime.update(scan_layers=True, remat="full", attention_impl="xla")
    capfd.readouterr()
    resumed, state = loop.train(cfg, str(tmp_path / "switched"), progress=False, return_state=True)
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note: runtime.")]
    assert sorted(n.split(":")[1].strip() for n in notes) == ["runtime.attention_impl", "runtime.remat",
                                                               "runtime.scan_layers"]
    assert resumed["step"] == 6 and state["params"]["blocks"]["attn"]["wq"].shape[0] == 2  # [L, ...]: scanned
    a, b = leaves_with_names(straight_state), leaves_with_names(to_unscanned(state))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7, err_msg=name)
    losses_a = [r["train_loss"] for r in read_metrics(str(tmp_path / "straight")) if "train_loss" in r]
    losses_b = [r["train_loss"] for r in read_metrics(str(tmp_path / "switched")) if "train_loss" in r]
    assert losses_b[:3] == losses_a[:3]
    np.testing.assert_allclose(losses_b[3:], losses_a[3:], rtol=1e-5)
    run = Run.open(str(tmp_path / "switched"), runtime={"scan_layers": False, "remat": "none"}, report=False)
    assert [n.split(":")[0] for n in run.notes] == ["runtime.remat", "runtime.scan_layers"]
    assert run.evaluate("validation")["loss"] == pytest.approx(straight["val_loss"], rel=1e-5)


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    # lr 1e30: step 1 runs at lr 0 (warm-up starts at 0) and is checkpointed; the next updates blow the params up.
    cfg = tiny_config(tmp_path, lr=1e30, steps=8, warmup_steps=1, grad_clip=1e30)
    cfg.checkpoint.every = 1
    with pytest.raises(loop.NonFiniteLossError, match=r"at step (\d+)") as info:
        loop.train(cfg, str(tmp_path / "run"), progress=False)
    bad_step = int(info.value.args[0].split("at step ")[1].split(";")[0])
    ck = Checkpointer(tmp_path / "run" / "checkpoints")
    last = ck.latest_step()
    assert last is not None and last < bad_step
    assert f"checkpoint is step {last}" in str(info.value)
    ck.close()
    # The kept checkpoint is finite: resuming from it evaluates to a finite loss.
    from coupled_qk_jax.training.run import Run

    result = Run.open(str(tmp_path / "run")).evaluate("validation")
    assert result["step"] == last and math.isfinite(result["loss"])


def test_bad_input_errors(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.data.seq_len = 64  # > model.max_len = 32
    with pytest.raises(ValueError, match=r"data.seq_len=64 exceeds model.max_len=32"):
        loop.train(cfg, str(tmp_path / "a"), progress=False)

    cfg = tiny_config(tmp_path)
    cfg.data.corpus = f"text_dir:{tmp_path / 'missing'}"
    with pytest.raises(ValueError, match="missing"):
        loop.train(cfg, str(tmp_path / "b"), progress=False)

    os.makedirs(tmp_path / "empty")
    cfg.data.corpus = f"text_dir:{tmp_path / 'empty'}"
    with pytest.raises(ValueError):
        loop.train(cfg, str(tmp_path / "c"), progress=False)

    cfg = tiny_config(tmp_path)
    cfg.model.vocab_size = 200  # the byte tokenizer has 257 (a larger model vocab is padding, see test_export.py)
    with pytest.raises(ValueError, match="vocab mismatch"):
        loop.train(cfg, str(tmp_path / "d"), progress=False)

    cfg = tiny_config(tmp_path)
    cfg.data.split_fractions = "1,0,0"  # nothing held out: refused before training, not at the final evaluation
    with pytest.raises(ValueError, match=r"the validation split of .* has 0 token\(s\), fewer than the 2 .*"
                                         r"data.split_fractions"):
        loop.train(cfg, str(tmp_path / "f"), progress=False)
    cfg.data.split_fractions = "0,0.5,0.5"  # no training text: named before any step, not inside the pipeline
    with pytest.raises(ValueError, match=r"the train split of .* has 0 token\(s\), fewer than the 33"):
        loop.train(cfg, str(tmp_path / "g"), progress=False)


@pytest.mark.mesh
def test_batch_that_does_not_split_over_the_mesh_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, batch_size=4)  # 4 rows cannot split over 8 data-parallel devices
    with pytest.raises(ValueError, match="not divisible by the 8 data-parallel devices"):
        loop.train(cfg, str(tmp_path / "e"), progress=False)


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation: perplexity against a float64 numpy reference.
# ---------------------------------------------------------------------------------------------------------------------


def _rms(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def test_perplexity_is_exp_mean_nll_against_numpy(tmp_path):
    """With W_O = 0 and the MLP output = 0 every block is the identity, so logits = RMSNorm(E[x] + P[t]) E^T, which
    numpy computes in float64 with no model code. Evaluate a token stream that does not fill the last batch."""
    mcfg = ModelConfig(variant="coupled_euler", vocab_size=257, max_len=16, d_model=32, n_layers=2, n_heads=4,
                       d_ff=64, coupling_hidden=6)
    graphdef, params = split_model(TransformerLM(mcfg, 3))
    for blk in params["blocks"].values():
        blk["attn"]["wo"] = jnp.zeros_like(blk["attn"]["wo"])
        blk["mlp"]["w_out"] = jnp.zeros_like(blk["mlp"]["w_out"])
    params["final_norm"]["scale"] = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, 32), jnp.float32)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=16 * 11 + 5).astype(np.uint16)  # 11 full windows + a partial one
    eot, t = 256, 16
    mesh = shd.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    replicated = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params)
    step = shd.jit_sharded(make_eval_step(graphdef), mesh, replicated)
    got = evaluate_tokens(step, params, tokens, t, 8, mesh, bos_id=eot)

    # Reference: stream = [eot] + tokens, windows at stride T; position p inside its window sees input stream[i].
    emb = np.asarray(params["embed"], np.float64)
    pos = np.asarray(params["pos_embed"], np.float64)
    scale = np.asarray(params["final_norm"]["scale"], np.float64)
    stream = np.concatenate([[eot], tokens.astype(np.int64)])
    nll = []
    for i in range(len(stream) - 1):
        h = _rms(emb[stream[i]] + pos[i % t], scale)
        logits = emb @ h
        logz = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
        nll.append(logz - logits[stream[i + 1]])
    assert got["tokens"] == len(tokens)  # every token scored exactly once
    np.testing.assert_allclose(got["loss"], np.mean(nll), rtol=1e-5)
    np.testing.assert_allclose(got["ppl"], math.exp(np.mean(nll)), rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Optimiser: per-circuit learning rates, decay mask, gradient accumulation.
# ---------------------------------------------------------------------------------------------------------------------


def _train_steps(mcfg: ModelConfig, train_cfg: TrainConfig, batches, grad_accum: int = 1):
    graphdef, params = split_model(TransformerLM(mcfg, 0))
    tx = opt_lib.make_optimizer(params, train_cfg)
    state = init_train_state(params, tx)
    step = jax.jit(make_train_step(graphdef, tx, grad_accum))
    for i, batch in enumerate(batches):
        state, _ = step(state, batch, jax.random.key(i))
    return params, state["params"]


def _batches(n: int, b: int = 8, t: int = 16, vocab: int = 257):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = rng.integers(0, vocab, size=(b, t + 1)).astype(np.int32)
        out.append({"inputs": x[:, :-1], "targets": x[:, 1:]})
    return out


SMALL = ModelConfig(variant="coupled_euler", vocab_size=257, max_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                    coupling_hidden=6)


def test_qk_lr_mult_zero_freezes_wq_wk_only():
    train_cfg = TrainConfig(qk_lr_mult=0.0, ov_lr_mult=1.0, warmup_steps=0, steps=10, weight_decay=0.1)
    before, after = _train_steps(SMALL, train_cfg, _batches(3))
    for i in range(SMALL.n_layers):
        b, a = before["blocks"][i]["attn"], after["blocks"][i]["attn"]
        np.testing.assert_array_equal(np.asarray(a["wq"]), np.asarray(b["wq"]))  # bit-identical, despite decay
        np.testing.assert_array_equal(np.asarray(a["wk"]), np.asarray(b["wk"]))
        assert np.abs(np.asarray(a["wv"]) - np.asarray(b["wv"])).max() > 1e-5
        assert np.abs(np.asarray(a["wo"]) - np.asarray(b["wo"])).max() > 1e-5
        # The coupling MLP follows qk_lr_mult only with qk_mult_coupling=True; here it trains.
        assert np.abs(np.asarray(a["coupling"]["w1"]) - np.asarray(b["coupling"]["w1"])).max() > 0


def test_qk_mult_coupling_also_freezes_coupling():
    train_cfg = TrainConfig(qk_lr_mult=0.0, qk_mult_coupling=True, warmup_steps=0, steps=10)
    before, after = _train_steps(SMALL, train_cfg, _batches(2))
    for i in range(SMALL.n_layers):
        b, a = before["blocks"][i]["attn"], after["blocks"][i]["attn"]
        for name in ("w1", "b1", "w2", "b2"):
            np.testing.assert_array_equal(np.asarray(a["coupling"][name]), np.asarray(b["coupling"][name]))
        np.testing.assert_array_equal(np.asarray(a["dt"]), np.asarray(b["dt"]))


@pytest.mark.parametrize("variant", ["coupled_euler+differential", "affine"])
def test_weight_decay_mask_excludes_norms_biases_dt_lambda(variant):
    mcfg = ModelConfig(variant=variant, vocab_size=257, max_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64,
                       coupling_hidden=6, affine_hidden=6, norm="layernorm")
    _, params = split_model(TransformerLM(mcfg, 0))
    mask = leaves_with_names(opt_lib.decay_mask(params))
    shapes = {k: v.shape for k, v in leaves_with_names(params).items()}
    never = ("scale']", "bias']", "['b_in']", "['b_out']", "['b1']", "['b2']", "['dt']", "lambda", "_b1']", "_b2']")
    for name, decayed in mask.items():
        last = name.rsplit("[", 1)[-1]
        if any(name.endswith(s) or s in last for s in never):
            assert not decayed, name
        elif last.strip("[]'") in ("wq", "wk", "wv", "wo", "w_in", "w_out", "w1", "w2", "embed", "pos_embed") \
                or last.strip("[]'").endswith(("_w1", "_w2")):
            assert decayed, name
            assert len(shapes[name]) >= 2, name
        else:
            assert not decayed, name  # anything else (e.g. λ vectors) is a vector and undecayed
    # Every rank-1 parameter is undecayed (norms, biases, Δt, λ).
    assert all(not mask[k] for k, s in shapes.items() if len(s) <= 1)
    if variant.endswith("differential"):
        assert any("lambda" in k for k in mask)


def test_grad_accumulation_matches_full_batch():
    """2 micro-batches of B/2 give the full batch's token-weighted gradient. Checked through SGD (update = -lr·g),
    because Adam's normalisation would turn float32 rounding in near-zero gradients into visible differences."""
    import optax

    mcfg = ModelConfig(variant="coupled_euler", vocab_size=257, max_len=16, d_model=32, n_layers=2, n_heads=4,
                       d_ff=64, coupling_hidden=6)
    graphdef, params = split_model(TransformerLM(mcfg, 0))
    batch = _batches(1)[0]
    batch["targets"][1, :5] = IGNORE_INDEX  # unequal token counts per micro-batch: the average must weight by tokens
    tx = optax.sgd(1.0)
    results = {}
    for accum in (1, 2):
        step = jax.jit(make_train_step(graphdef, tx, accum))
        new_state, metrics = step(init_train_state(params, tx), batch, jax.random.key(0))
        results[accum] = (leaves_with_names(new_state["params"]), float(metrics["loss"]), int(metrics["tokens"]))
    (full, loss1, n1), (acc, loss2, n2) = results[1], results[2]
    assert n1 == n2 == 8 * 16 - 5
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    before = leaves_with_names(params)
    for name in full:
        np.testing.assert_allclose(acc[name] - before[name], full[name] - before[name], rtol=1e-4, atol=1e-8,
                                   err_msg=name)


def test_ignore_index_targets_do_not_count():
    """Padding targets (-100) contribute neither loss nor tokens (what makes eval counts exact)."""
    from coupled_qk_jax.training.steps import masked_cross_entropy

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    targets = jnp.asarray([[1, IGNORE_INDEX, 4], [IGNORE_INDEX, IGNORE_INDEX, 0]])
    total, count = masked_cross_entropy(logits, targets)
    lp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    ref = -(lp[0, 0, 1] + lp[0, 2, 4] + lp[1, 2, 0])
    assert int(count) == 3
    np.testing.assert_allclose(float(total), ref, rtol=1e-5)


def test_loss_at_answer_positions_is_the_masked_loss_over_all_positions():
    """With "answer_positions" the loss computes logits at those K positions only; its value is the masked CE over
    every position (reference: numpy float64 log-softmax of the model's full logits) and its gradient that of the
    full-logits loss (the ignored positions contribute nothing). Padding rows (all -100) stay weightless."""
    from coupled_qk_jax.training.steps import make_loss_fn

    mcfg = ModelConfig(variant="coupled_euler", vocab_size=257, max_len=16, d_model=32, n_layers=2, n_heads=4,
                       d_ff=64, coupling_hidden=6)
    graphdef, params = split_model(TransformerLM(mcfg, 0))
    rng = np.random.default_rng(3)
    inputs = rng.integers(0, 257, size=(3, 16)).astype(np.int32)
    positions = np.sort(np.stack([rng.choice(16, 3, replace=False) for _ in range(3)]), axis=1).astype(np.int32)
    targets = np.full((3, 16), IGNORE_INDEX, np.int32)
    np.put_along_axis(targets[:2], positions[:2], rng.integers(0, 257, size=(2, 3)).astype(np.int32), axis=1)
    positions[2] = np.arange(3)  # row 2 is a padding row, as pad_batch writes it
    full = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    sparse = dict(full, answer_positions=jnp.asarray(positions))
    loss_fn = make_loss_fn(graphdef)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))  # jitted: op-by-op dispatch costs 10x the compile
    (loss_s, (nll_s, count_s)), grads_s = grad_fn(params, sparse)
    (loss_f, _), grads_f = grad_fn(params, full)
    logits = np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, full["inputs"]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    rows, cols = np.nonzero(targets != IGNORE_INDEX)
    ref = -logp[rows, cols, targets[rows, cols]].sum()
    assert int(count_s) == 6 and np.isfinite(float(nll_s))
    np.testing.assert_allclose(float(nll_s), ref, rtol=1e-5)
    np.testing.assert_allclose(float(loss_s), ref / 6, rtol=1e-5)
    np.testing.assert_allclose(float(loss_s), float(loss_f), rtol=1e-6)
    flat_s, flat_f = leaves_with_names(grads_s), leaves_with_names(grads_f)
    for name in flat_f:
        assert np.all(np.isfinite(flat_s[name])), name
        np.testing.assert_allclose(flat_s[name], flat_f[name], rtol=1e-4, atol=1e-7, err_msg=name)
    # Positive control: the gathered loss differs when a position is moved off its answer.
    moved = positions.copy()
    moved[0, 0] = (moved[0, 0] + 1) % 16 if (moved[0, 0] + 1) % 16 not in moved[0] else (moved[0, 0] + 2) % 16
    nll_moved = float(grad_fn(params, dict(full, answer_positions=jnp.asarray(moved)))[0][1][0])
    assert abs(nll_moved - float(nll_s)) > 1e-3


def test_extending_a_run_keeps_the_learning_rate_continuous(tmp_path, capsys):
    """3 steps of a 6-step run, then --allow_change=train.steps to 12 (stopping at 7), then to the end with no
    change: from step 3 the learning rate decays by a cosine from the value it had reached to the same floor at
    step 12, in both later starts (the second reads the extension from history.jsonl). Reference: optax's warm-up
    cosine and the extension, written out by hand in float64. Positive control: re-reading a 12-step cosine at
    step 3 (what the schedule did before) gives a value the run must not log."""
    from coupled_qk_jax.training.writers import read_metrics

    workdir = str(tmp_path / "run")
    loop.train(tiny_config(tmp_path, steps=6, stop_after=3), workdir, progress=False)
    loop.train(tiny_config(tmp_path, steps=12, stop_after=7), workdir, progress=False, allow_change=("train.steps",))
    assert "train.steps 6 -> 12 at step 3: the learning rate decays by a cosine from" in capsys.readouterr().out
    summary = loop.train(tiny_config(tmp_path, steps=12), workdir, progress=False)
    assert summary["status"] == "completed" and summary["step"] == 12

    cfg = tiny_config(tmp_path)
    lr, floor, warmup = cfg.train.lr, cfg.train.lr * cfg.train.min_lr_ratio, cfg.train.warmup_steps  # warm-up 2

    def original(c: int, horizon: int) -> float:
        if c < warmup:
            return lr * c / warmup
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * (c - warmup) / (horizon - warmup)))

    start = original(3, 6)
    want = [original(c, 6) if c < 3 else floor + (start - floor) * 0.5 * (1 + math.cos(math.pi * (c - 3) / 9))
            for c in range(12)]
    rows = {r["step"]: r["lr"] for r in read_metrics(workdir) if "lr" in r}
    assert sorted(rows) == list(range(1, 13))
    got = [rows[step] for step in range(1, 13)]  # the row of step k logs the learning rate its update used, c = k-1
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert abs(original(3, 12) - start) > 0.05 * lr  # the jump the schedule had: the comparison above can fail
    resumes = [json.loads(line) for line in open(os.path.join(workdir, "history.jsonl")) if '"resume"' in line]
    assert resumes[0]["schedule"] == {"from_step": 3, "old_steps": 6, "new_steps": 12,
                                      "lr_at_from_step": pytest.approx(start, rel=1e-6), "floor": floor}
    assert "schedule" not in resumes[1]
