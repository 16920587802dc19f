"""Tests of coupled_qk_jax.qkov: generator, model, trainer, metrics, theory ODE and its CLI."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILE_FLAGS

from coupled_qk_jax.qkov import data as qdata
from coupled_qk_jax.qkov import metrics as qm
from coupled_qk_jax.qkov import model as qmodel
from coupled_qk_jax.qkov import theory
from coupled_qk_jax.qkov import train as qtrain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------- generator


def test_generator_token_frequencies_match_spec():
    seqs = qdata.generate_batches(np.random.RandomState(0), 40, 50, 64)  # 2000 sequences
    seqs = seqs.reshape(-1, 64)
    cls, query, ctx = seqs[:, -1], seqs[:, -2], seqs[:, :-2]
    assert set(np.unique(cls)) == {1, 2, 3, 4}
    np.testing.assert_array_equal(query, cls + 4)
    np.testing.assert_allclose(np.bincount(cls, minlength=5)[1:] / cls.size, 0.25, atol=0.03)
    for c in range(1, 5):
        toks = ctx[cls == c].ravel()
        freq = np.bincount(toks, minlength=50) / toks.size
        n = toks.size  # ~31k tokens per class; 5 sigma of the rarest/most common frequency is < 0.0075
        np.testing.assert_allclose(freq[:10], 1 / 15.5, atol=5 * math.sqrt((1 / 15.5) / n))
        for k in range(10):
            p = (k + 1) / 155
            assert abs(freq[10 * c + k] - p) < 5 * math.sqrt(p / n) + 1e-4, (c, k, freq[10 * c + k], p)
        other = [t for t in range(10, 50) if not 10 * c <= t < 10 * c + 10]
        assert freq[other].sum() == 0


def test_generator_reproduces_reference_rng_stream():
    a = qdata.generate_batches(np.random.RandomState(1234), 3, 32, 64)
    r = np.random.RandomState(1234)
    b = np.stack([qdata.generate_batch_reference(r, 32, 64) for _ in range(3)])
    np.testing.assert_array_equal(a, b)


def test_fixed_attention_generator_is_class_balanced_and_relabelled():
    seqs = qdata.generate_fixed_attention_batch(np.random.RandomState(3), 8, 20)
    assert seqs.shape == (32, 20)
    np.testing.assert_array_equal(seqs[:, -2], np.repeat([1, 2, 3, 4], 8))
    np.testing.assert_array_equal(seqs[:, -1], seqs[:, -2] + 4)
    # Context of class c uses exactly numpy's choice stream: per class one block of per_class x (seq_len-2) draws.
    r = np.random.RandomState(3)
    for c in range(1, 5):
        ref = r.choice(np.arange(50), p=qdata.class_probs()[c - 1], size=(8, 18))
        np.testing.assert_array_equal(seqs[(c - 1) * 8:c * 8, :-2], ref)


def test_generator_rejects_bad_sizes():
    with pytest.raises(ValueError, match="seq_len"):
        qdata.generate_batch(np.random.RandomState(0), 4, 2)
    with pytest.raises(ValueError, match="batch_size"):
        qdata.generate_batch(np.random.RandomState(0), 0, 10)


# ----------------------------------------------------------------------------------------------------- model


@pytest.mark.parametrize("param", qmodel.PARAMETRISATIONS)
def test_forward_matches_float64_reference(param):
    params = qmodel.init_params(jax.random.PRNGKey(7), param, "default", ov_bias=(param == "caco"))
    # Scale up so the attention is far from uniform and the test is sensitive to the score formula.
    params = {k: v * 6.0 for k, v in params.items()}
    tokens = qdata.split(qdata.generate_batch(np.random.RandomState(1), 4, 12))[0]
    logits, attn = qmodel.forward(params, jnp.asarray(tokens))
    ref_logits, ref_attn = qmodel.forward_reference({k: np.asarray(v) for k, v in params.items()}, tokens)
    assert np.asarray(attn).std() > 1e-3
    np.testing.assert_allclose(np.asarray(attn), ref_attn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=1e-4, atol=1e-5)


def test_init_schemes_follow_spec():
    fafo = qmodel.init_params(jax.random.PRNGKey(0), "fafo", "fig2")
    assert set(fafo) == {"W_Q", "W_K", "W_V", "W_O"}
    np.testing.assert_array_equal(np.asarray(fafo["W_V"]), np.float32(1e-6) * np.eye(50, dtype=np.float32))
    bound = 1 / math.sqrt(50)
    q = np.asarray(fafo["W_Q"])
    assert q.min() >= -bound and q.max() <= bound and q.std() > 0.5 * bound / math.sqrt(3)
    caco = qmodel.init_params(jax.random.PRNGKey(0), "caco", "fig2")
    assert set(caco) == {"W_QK", "W_OV"} and np.asarray(caco["W_QK"]).std() > 0.05
    eye = qmodel.init_params(jax.random.PRNGKey(0), "fafo", "eye")
    for v in eye.values():
        np.testing.assert_allclose(np.asarray(v), 1e-6 * np.eye(50), rtol=1e-6)
    cafo = qmodel.init_params(jax.random.PRNGKey(0), "cafo", "fig2")
    assert all(np.count_nonzero(np.asarray(v) - np.diag(np.diag(np.asarray(v)))) == 0 for v in cafo.values())
    with pytest.raises(ValueError, match="parametrisation"):
        qmodel.init_params(jax.random.PRNGKey(0), "ffff")


def test_fixed_attention_weights():
    tokens = jnp.asarray([[1, 12, 3, 45, 5], [11, 12, 13, 14, 15]])
    a = np.asarray(qmodel.fixed_attention(tokens, 0.8))
    np.testing.assert_allclose(a[0], [0.2 / 3, 0.4, 0.2 / 3, 0.4, 0.2 / 3], rtol=1e-6)
    np.testing.assert_allclose(a[1], [0.2] * 5, rtol=1e-6)  # no common token: all mass on the distinct ones


# ----------------------------------------------------------------------------------------------------- trainer


def _tiny_cfg(**kw):
    base = {"parametrisation": "fafo", "init": "default", "n_epochs": 2, "batches_per_epoch": 3, "batch_size": 4,
            "seq_len": 10, "seeds": (1, 2)}
    base.update(kw)
    return qtrain.TrainConfig(**base)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_ratio_zero_freezes_qk(opt):
    cfg = _tiny_cfg(qk_ratio=0.0, optimizer=opt, weight_decay=0.1)
    p0, _, _ = qtrain.init_runs(cfg)
    res = qtrain.train(cfg)
    for k in ("W_Q", "W_K"):
        np.testing.assert_array_equal(np.asarray(res.params[k]), np.asarray(p0[k]))
    for k in ("W_V", "W_O"):
        assert np.abs(np.asarray(res.params[k]) - np.asarray(p0[k])).max() > 1e-6


def test_sgd_group_rates_constant_and_increasing():
    params = {"W_QK": jnp.zeros((50, 50)), "W_OV": jnp.zeros((50, 50))}
    grads = {"W_QK": jnp.ones((50, 50)), "W_OV": jnp.ones((50, 50))}
    total = 8
    for sched, m, ratio in [("constant", 1.0, 20.0), ("increasing", 40.0, 1.0)]:
        cfg = _tiny_cfg(parametrisation="caco", qk_ratio=ratio, qk_schedule=sched, qk_final_multiplier=m,
                        n_epochs=1, batches_per_epoch=total)
        opt = qtrain.make_optimizer(cfg)
        state = opt.init(params)
        for step in range(total):
            upd, state = opt.update(grads, state, params)
            want_qk = 0.01 * ratio * (1 + (m - 1) * step / total)  # LambdaLR-style: step 0 uses multiplier 1
            np.testing.assert_allclose(np.asarray(upd["W_QK"]), -want_qk, rtol=1e-6)
            np.testing.assert_allclose(np.asarray(upd["W_OV"]), -0.01, rtol=1e-6)
        np.testing.assert_allclose(float(qtrain.group_learning_rates(state)["qk"]), want_qk, rtol=1e-6)


def test_training_reduces_loss_and_reports_shapes():
    cfg = _tiny_cfg(parametrisation="caco", lr_ov=0.5, n_epochs=3, batches_per_epoch=20, batch_size=16)
    res = qtrain.train(cfg)
    assert res.epoch_loss.shape == (2, 3) and res.epoch_mass.shape == (2, 3)
    assert np.all(res.epoch_loss[:, -1] < res.epoch_loss[:, 0])
    ev = qtrain.evaluate(res.params, cfg.seeds, 2, 8, cfg.seq_len)
    assert ev["mass"].shape == (2, 16) and ev["attn"].shape == (2, 16, 9)
    np.testing.assert_allclose(ev["attn"].sum(-1), 1.0, rtol=1e-5)
    s = qtrain.summarise(ev)
    assert 0 <= s["AC"] <= 100 and 0 <= s["acc"] <= 100


def test_fixed_alpha_training_shares_data_and_trains_ov_only():
    cfg = _tiny_cfg(parametrisation="caco", init="default", ov_bias=True, fixed_alpha=(0.2, 1.0), seeds=(5,),
                    batch_size=2)
    res = qtrain.train(cfg)
    assert set(res.params) == {"W_OV", "b_OV"} and res.params["W_OV"].shape == (2, 50, 50)
    np.testing.assert_allclose(res.epoch_mass, [[0.2, 0.2], [1.0, 1.0]], rtol=1e-6)


def test_stop_rule_matches_reference_running_loss_loop():
    # The reference notebooks break when running_loss / n_batches <= thr, where running_loss sums batch losses and is
    # reset after every `k`-th epoch. Replay that literal loop on the epoch averages of an unstopped run and check
    # that stop_check_every = k stops at the same epoch.
    k, n = 3, 9
    full = qtrain.train(_tiny_cfg(parametrisation="caco", lr_ov=0.5, n_epochs=n, batches_per_epoch=4, seeds=(3,)))
    h = full.epoch_loss[0]
    thr = float(h[k]) * (1 + 1e-6)  # passes at the 2nd block's first epoch at the latest (loss falls from h[0])
    want, running = n, 0.0
    for e in range(n):
        running += h[e]  # running_loss / n_batches accumulates epoch averages
        if running <= thr:
            want = e + 1
            break
        if (e + 1) % k == 0:
            running = 0.0
    assert h[0] > thr and want <= k + 1
    res = qtrain.train(_tiny_cfg(parametrisation="caco", lr_ov=0.5, n_epochs=n, batches_per_epoch=4, seeds=(3,),
                                 stop_loss=thr, stop_check_every=k))
    assert int(res.stopped_epoch[0]) == want
    np.testing.assert_array_equal(res.epoch_loss[0, :want], h[:want])
    assert np.isnan(res.epoch_loss[0, want:]).all()


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path):
    from experiments import qkov_report as rep

    cfg = _tiny_cfg(parametrisation="fafo", qk_schedule="increasing", qk_final_multiplier=5.0, n_epochs=4,
                    batches_per_epoch=3)
    ref = qtrain.train(cfg)
    path = str(tmp_path / "fafo_r1_s1-2_ckpt")  # the layout of experiments/qkov_synthetic.py, read by the report

    def crash(ep, params):
        if ep == 3:
            raise KeyboardInterrupt  # a kill after epoch 3; the last checkpoint is from epoch 2

    with pytest.raises(KeyboardInterrupt):
        qtrain.train(cfg, callback=crash, ckpt_path=path, ckpt_every=2)
    assert qtrain.checkpoint_progress(path) == (2, 4)
    assert rep.ckpt_epoch(str(tmp_path), "fafo_r1") == ["epoch 2/4 (seeds 1, 2)"]
    logs = []
    res = qtrain.train(cfg, ckpt_path=path, ckpt_every=2, log=logs.append)
    assert any("resumed" in m and "epoch 2/4" in m for m in logs)
    for k in ref.params:
        np.testing.assert_array_equal(np.asarray(res.params[k]), np.asarray(ref.params[k]))
    np.testing.assert_array_equal(res.epoch_loss, ref.epoch_loss)
    np.testing.assert_array_equal(res.epoch_mass, ref.epoch_mass)
    with pytest.raises(ValueError, match="another config") as refused:
        qtrain.train(dataclasses.replace(cfg, lr_ov=0.02), ckpt_path=path)
    assert "lr_ov: saved 0.01, now 0.02" in str(refused.value) and "\n" not in str(refused.value)
    qtrain.remove_checkpoint(path)
    assert not qtrain.has_checkpoint(path)


def test_checkpoint_restores_stopped_runs_and_falls_back_from_a_damaged_step(tmp_path, capsys):
    # Early stop on, so that a checkpoint holds a stopped run (its stop flag and the nan tail of its curves).
    cfg = _tiny_cfg(parametrisation="caco", lr_ov=0.5, n_epochs=5, batches_per_epoch=3, seeds=(3, 4))
    full = qtrain.train(cfg)
    cfg = dataclasses.replace(cfg, stop_loss=float(full.epoch_loss[0, 2]) * (1 + 1e-6))
    ref = qtrain.train(cfg)
    assert int(ref.stopped_epoch[0]) == 3 and int(ref.stopped_epoch[1]) >= 4  # run 0 stops first
    path = str(tmp_path / "ck")

    def crash(ep, params):
        if ep == 4:
            raise KeyboardInterrupt

    def check(res):
        for k in ref.params:
            np.testing.assert_array_equal(np.asarray(res.params[k]), np.asarray(ref.params[k]))
        np.testing.assert_array_equal(res.epoch_loss, ref.epoch_loss)
        np.testing.assert_array_equal(res.stopped_epoch, ref.stopped_epoch)

    with pytest.raises(KeyboardInterrupt):
        qtrain.train(cfg, callback=crash, ckpt_path=path, ckpt_every=1)
    assert sorted(os.listdir(path)) == ["2", "3"]  # the last qtrain.CKPT_KEEP steps; run 0 stopped in step 3
    logs = []
    check(qtrain.train(cfg, ckpt_path=path, ckpt_every=1, log=logs.append))
    assert any("epoch 3/5" in m for m in logs)
    assert sorted(os.listdir(path)) == ["3", "4"]
    shutil.rmtree(os.path.join(path, "4", "meta"))  # step 4 damaged: the run resumes from step 3
    logs = []
    check(qtrain.train(cfg, ckpt_path=path, ckpt_every=1, log=logs.append))
    assert any("epoch 3/5" in m for m in logs)
    assert "checkpoint step 4" in capsys.readouterr().err
    assert os.path.isdir(tmp_path / "damaged_checkpoints" / "4")


def test_checkpoint_old_npz_is_refused_with_a_hint(tmp_path):
    from experiments import qkov_report as rep

    old = tmp_path / "caco_r1_s1234.npz"
    old.write_bytes(b"an earlier version's checkpoint")
    cfg = _tiny_cfg(n_epochs=1)
    with pytest.raises(ValueError, match="is a file"):
        qtrain.train(cfg, ckpt_path=str(old))
    with pytest.raises(ValueError, match="earlier version.*delete it"):
        qtrain.refuse_legacy_checkpoint(str(old), str(tmp_path / "caco_r1_s1234_ckpt"))
    assert rep.ckpt_epoch(str(tmp_path), "caco_r1") == [
        "old-format checkpoint caco_r1_s1234.npz (not resumable: delete it to restart the job) (seeds 1234)"]


def test_trainconfig_rejects_bad_fields():
    with pytest.raises(ValueError, match="optimizer"):
        _tiny_cfg(optimizer="lion").validate()
    with pytest.raises(ValueError, match="qk_ratio"):
        _tiny_cfg(qk_ratio=-1.0).validate()
    with pytest.raises(ValueError, match="parametrisation"):
        _tiny_cfg(parametrisation="xx").validate()


# ----------------------------------------------------------------------------------------------------- metrics


def test_relevant_mass_and_separability_hand_values():
    attn = np.array([[0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]])
    mask = np.array([[0, 1, 1, 0], [1, 1, 1, 1]], bool)
    np.testing.assert_allclose(np.asarray(qm.relevant_mass(attn, mask)), [0.7, 1.0])
    sep = np.asarray(qm.separability(attn, mask))
    np.testing.assert_allclose(sep[0], 0.5 - 0.1)
    assert np.isnan(sep[1])  # no irrelevant position


def test_dtap_counts_match_numpy_histogram2d():
    rng = np.random.RandomState(0)
    x = np.concatenate([rng.rand(500), [0.0, 0.2, 0.4, 1.0, 1.0, -0.1, 1.2]])
    y = np.concatenate([rng.rand(500), [1.0, 0.6, 0.0, 0.2, 1.0, 0.5, 0.5]])
    for edges in ([0, .2, .4, .6, .8, 1], [0, .33, .66, 1.1], [0, .05, .1, .5, 1.001]):
        ref, _, _ = np.histogram2d(x, y, bins=[edges, edges])
        np.testing.assert_array_equal(qm.dtap_counts(x, y, edges, edges), ref.astype(int))
    pct = qm.dtap_percent(np.stack([x[:10], x[10:20]]), np.stack([y[:10], y[10:20]]))
    h1 = np.histogram2d(x[:10], y[:10], bins=[qm.SYNTHETIC_EDGES] * 2)[0]
    h2 = np.histogram2d(x[10:20], y[10:20], bins=[qm.SYNTHETIC_EDGES] * 2)[0]
    np.testing.assert_allclose(pct, (100 * h1 / h1.sum() + 100 * h2 / h2.sum()) / 2)
    with pytest.raises(ValueError, match="x_edges"):
        qm.dtap_counts(x, y, [0, 0.5, 0.4], [0, 1])


def test_dtap_plot_writes_png(tmp_path):
    path = str(tmp_path / "h.png")
    qm.plot_dtap(np.full((5, 5), 4.0), path, title="t")
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_ac_and_acmc_hand_values():
    mass = np.array([0.1, 0.5, 0.7, 0.9])
    prob = np.array([0.9, 0.4, 0.5, 0.99])
    assert qm.attention_concentration(mass) == 75.0
    assert qm.attention_concentration(mass, tau_att=0.8) == 25.0
    assert qm.acmc(mass, prob) == 50.0
    assert qm.acmc(mass, prob, tau_att=0.5, tau_conf=0.95) == 25.0


def test_topk_count_and_positions():
    assert qm.topk_count(128, 0.05) == 7
    assert qm.topk_count(63, 0.05) == 4
    assert qm.topk_count(100, 0.05) == 5
    assert qm.topk_count(10, 0.05) == 1
    np.testing.assert_array_equal(qm.topk_positions(np.array([0.1, 0.4, 0.1, 0.3, 0.1]), 0.4), [1, 3])
    with pytest.raises(ValueError, match="k_frac"):
        qm.topk_count(10, 0.0)


def _fake_model(tokens):
    """Probabilities depend on the count of token 7 and on the first token (to expose reordering)."""
    t = np.asarray(tokens)
    f = (t == 7).sum() / 4.0
    g = 0.2 if (t.size and t[0] == 9) else 0.0
    p = np.array([1.0 - 0.5 * f - g, 0.5 * f, g])
    return p / p.sum()


def test_comprehensiveness_and_sufficiency_with_fake_model():
    tokens = np.array([9, 7, 1, 7, 2, 3, 4, 5, 6, 8])  # T = 10, k = ceil(0.2 * 10) = 2
    attn = np.array([0.05, 0.3, 0.05, 0.4, 0.05, 0.05, 0.02, 0.03, 0.03, 0.02])
    p_full = _fake_model(tokens)  # f = 0.5 -> [0.55, 0.25, 0.2]; predicted class 0
    assert np.argmax(p_full) == 0
    # Delete the two 7s: f = 0, first token still 9 -> p = [0.8, 0, 0.2].
    assert qm.comprehensiveness(_fake_model, tokens, attn, 0.2) == pytest.approx(0.55 - 0.8)
    # Keep only the two 7s (order kept): f = 0.5, first token 7 -> [0.75, 0.25, 0].
    assert qm.sufficiency(_fake_model, tokens, attn, 0.2) == pytest.approx(0.55 - 0.75)
    assert qm.comprehensiveness(_fake_model, tokens, attn, 0.2, target=1) == pytest.approx(0.25 - 0.0)
    # Keeping the first token (top attention) first in original order shows the order is preserved.
    attn2 = attn.copy()
    attn2[0] = 0.35  # top-2 = positions {0, 3}; kept sequence [9, 7] -> f = .25, g = .2 -> [0.675, 0.125, 0.2]
    assert qm.sufficiency(_fake_model, tokens, attn2, 0.2, target=2) == pytest.approx(0.2 - 0.2)
    assert qm.sufficiency(_fake_model, tokens, attn2, 0.2, target=0) == pytest.approx(0.55 - 0.675)
    c, s = qm.erasure_scores(_fake_model, [tokens, tokens], [attn, attn], 0.2)
    assert c == pytest.approx(-0.25) and s == pytest.approx(-0.2)


def test_balancedness():
    rng = np.random.RandomState(0)
    A = rng.randn(6, 6)
    assert float(qm.balancedness(A, A.T)) == pytest.approx(0.0, abs=1e-12)
    # A = 2I, B = I: ||4I - I|| / ||4I|| = 3/4.
    assert float(qm.balancedness(2 * np.eye(5), np.eye(5))) == pytest.approx(0.75)


# ----------------------------------------------------------------------------------------------------- theory


def _hand_rhs(mu_ov, mu_qk, eta_ov, eta_qk):
    m, n, b, M = 5, 50, 50, 20
    alpha = m * math.exp(mu_qk) / (m * math.exp(mu_qk) + n)
    den = math.exp(alpha * mu_ov) + M - 1
    return eta_ov * alpha / (b * den), eta_qk * (M - 1) * alpha * (1 - alpha) * mu_ov / (M * b * b * den)


def test_ode_rhs_hand_values():
    # At the origin: alpha = 5/55 = 1/11, e^0 + 19 = 20: d mu_ov/dt = (1/11) / (50 * 20) = 1/11000, d mu_qk/dt = 0.
    with jax.enable_x64(True):
        d_ov, d_qk = theory.rhs(jnp.float64(0.0), jnp.float64(0.0), 1.0, 10.0)
        assert float(d_ov) == pytest.approx(1 / 11000, rel=1e-10)
        assert float(d_qk) == 0.0
        for mu_ov, mu_qk, r in [(2.0, 1.0, 10.0), (15.0, 3.5, 0.1), (40.0, 0.2, 100.0)]:
            d_ov, d_qk = theory.rhs(jnp.float64(mu_ov), jnp.float64(mu_qk), 1.0, r)
            h_ov, h_qk = _hand_rhs(mu_ov, mu_qk, 1.0, r)
            assert float(d_ov) == pytest.approx(h_ov, rel=1e-9)
            assert float(d_qk) == pytest.approx(h_qk, rel=1e-9)
        assert float(theory.loss_of(jnp.float64(0.0), jnp.float64(0.0))) == pytest.approx(math.log(20), rel=1e-12)


def test_rk4_step_matches_hand_rk4():
    y0, r, h = (3.0, 0.7), 10.0, 10.0
    f = lambda y: tuple(d / min(1.0, r) for d in _hand_rhs(y[0], y[1], 1.0, r))
    k1 = f(y0)
    k2 = f(tuple(y0[i] + h / 2 * k1[i] for i in range(2)))
    k3 = f(tuple(y0[i] + h / 2 * k2[i] for i in range(2)))
    k4 = f(tuple(y0[i] + h * k3[i] for i in range(2)))
    want = [y0[i] + h / 6 * (k1[i] + 2 * k2[i] + 2 * k3[i] + k4[i]) for i in range(2)]
    with jax.enable_x64(True):
        got = theory.rk4_step(jnp.asarray([y0], jnp.float64), jnp.float64(1.0), jnp.float64(r), h)
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-12)


def test_rk4_readout_converged_under_halved_step():
    kw = {"n_thresholds": 8, "target": 1e-2, "tau_start": 2e5}
    coarse = theory.integrate([0.1, 10.0], dtau=10.0, **kw)
    fine = theory.integrate([0.1, 10.0], dtau=5.0, **kw)
    assert coarse.reached.all() and fine.reached.all()
    for name in ("t", "mu_ov", "mu_qk", "alpha"):
        # First-crossing readout is quantised to one step (dtau), so allow ~1e-3 relative.
        np.testing.assert_allclose(getattr(coarse, name), getattr(fine, name), rtol=2e-3, err_msg=name)


def test_thresholds_and_bad_input():
    th = theory.thresholds()
    assert th.size == 50 and th[0] == 1.0 and th[-1] == 1e-4 and np.all(np.diff(th) < 0)
    np.testing.assert_allclose(np.diff(np.log10(th)), -4 / 49)
    with pytest.raises(ValueError, match="ratios"):
        theory.integrate([0.0, 1.0])


def test_cli_writes_exact_columns(tmp_path, capsys):
    """``python -m coupled_qk_jax.qkov.theory`` as a user runs it, in its own process, because that process may
    have XLA's usual optimisations: the session's fast-compile switches (tests/conftest.py) suit programs whose cost
    is their compilation, but this one's is its run (~1e6 RK4 steps of a [5, 2] state), about 3x slower without
    LLVM's optimisations. The CSV checks are of the file's own consistency, which holds under any flags."""
    out = tmp_path / "ode.csv"
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS.split())
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, "-m", "coupled_qk_jax.qkov.theory", "--ratios", "0.01,0.1,1,10,100",
                           "--out", str(out)], check=False, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(out) as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["ratio", "loss", "t", "mu_ov", "mu_qk", "alpha"]
    body = np.array(rows[1:], dtype=float)
    assert body.shape == (250, 6)
    for r in (0.01, 0.1, 1, 10, 100):
        sel = body[body[:, 0] == r]
        assert sel.shape[0] == 50
        assert sel[0, 1] == 1.0 and sel[-1, 1] == 1e-4
        assert np.all(np.isfinite(sel))  # every ratio reaches 1e-4 within the tau cap
        assert np.all(np.diff(sel[:, 2]) >= 0)  # lower thresholds are crossed later
        # t is physical time: t * min(eta) is a whole number of dtau = 10 steps.
        steps = sel[:, 2] * min(r, 1.0) / 10.0
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-6)
        # The recorded state really is below its threshold (and alpha is consistent with mu_qk).
        a = 5 * np.exp(sel[:, 4]) / (5 * np.exp(sel[:, 4]) + 50)
        np.testing.assert_allclose(sel[:, 5], a, rtol=1e-12)
        assert np.all(np.log1p(19 * np.exp(-a * sel[:, 3])) <= sel[:, 1] * (1 + 1e-12))
    # A malformed list is refused before any integration: main's status is the exit status of `python -m` (its
    # `raise SystemExit(main())`, run above), so the refusal needs no process of its own.
    capsys.readouterr()
    assert theory.main(["--ratios", "a,b", "--out", str(tmp_path / "x.csv")]) != 0
    assert "--ratios" in capsys.readouterr().err and not (tmp_path / "x.csv").exists()


# ----------------------------------------------------------------------------------------------------- config


def test_config_grammar():
    from coupled_qk_jax.configs.qkov import get_config, to_train_config

    c = get_config("fafo,20")
    assert c.qk_ratio == 20.0 and c.init == "eye" and len(c.seeds) == 5
    t = to_train_config(get_config("caco,increasing"), n_epochs=2)
    assert t.qk_schedule == "increasing" and t.qk_final_multiplier == 10.0 and t.seq_len == 128
    assert get_config("caco,fixed").ov_bias is True
    with pytest.raises(ValueError, match="RATIO"):
        get_config("fafo,fast")
    with pytest.raises(ValueError, match="PARAM"):
        get_config("xyz,1")


def test_config_budgets_and_stop_rule_are_the_notebooks():
    from coupled_qk_jax.configs.qkov import get_config

    # (epochs, batches, seeds, stop) of the released Figure-2 notebook cells.
    for arg, want in [("fafo,1", (2500, 250, 1, True)), ("faco,1", (2500, 250, 1, True)),
                      ("cafo,1", (5000, 200, 5, True)), ("caco,1", (2500, 200, 3, True)),
                      ("fafo,20", (1000, 100, 5, True)), ("caco,5", (2000, 100, 5, False)),
                      ("fafo,increasing", (2000, 100, 5, False)), ("caco,increasing", (2000, 100, 5, False))]:
        c = get_config(arg)
        got = (c.n_epochs, c.batches_per_epoch, len(c.seeds), c.stop_loss is not None)
        assert got == want, arg
        if c.stop_loss is not None:
            assert (c.stop_loss, c.stop_check_every) == (1e-3, 100)


# ------------------------------------------------------------------------------------ Figure-3 experiment script


def test_fixed_attention_pooled_parts_match_the_model_path():
    from experiments import qkov_fixed_attention as fx

    rng = np.random.RandomState(0)
    x = qdata.split(qdata.generate_batches(rng, 1, 3, 12, fixed_attention=True).reshape(-1, 12))[0]
    x[0] = rng.randint(0, 10, size=x.shape[1])  # a row with no distinct token
    x[1] = rng.randint(10, 50, size=x.shape[1])  # a row with only distinct tokens
    y = jnp.asarray(rng.randint(0, 50, size=len(x)))
    p_rel, p_rest = fx.pooled_parts(x)
    np.testing.assert_allclose(p_rel.sum(-1), 1.0, rtol=1e-6)
    params = qmodel.init_params(jax.random.PRNGKey(1), "caco", "default", ov_bias=True)
    for a in (0.0, 0.3, 1.0):
        want = qmodel.fixed_attention_loss_fn(params, jnp.asarray(x), y, a)
        got = qmodel.cross_entropy(qmodel.readout_pooled(params, a * p_rel + (1 - a) * p_rest), y)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_report_welch_interval_and_verdict_rules():
    from experiments import qkov_report as rep

    # a = [1, 2, 3], b = [0, 0, 0]: difference 2, se = sqrt(1/3), Welch dof = 2, t_0.975(2) = 4.302653 (tables).
    d, lo, hi = rep.welch([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    h = 4.302653 * math.sqrt(1 / 3)
    assert d == pytest.approx(2.0) and lo == pytest.approx(2 - h, rel=1e-5) and hi == pytest.approx(2 + h, rel=1e-5)
    assert math.isnan(rep.welch([1.0], [0.0, 1.0])[1])
    P = np.zeros((5, 5))
    P[4, 4] = 90.0
    P[3, 4] = 10.0
    ref = {"cells": {"faco_r1": {"dtap_percent": P.tolist()}}}
    same = {"dtap_percent": (0.8 * P + 0.2 * np.roll(P, -1, axis=0)).tolist(), "acc": 100.0}
    moved = {"dtap_percent": np.roll(P, -2, axis=0).tolist(), "acc": 100.0}
    assert rep.verdict("faco_r1", [same], ref)[0].startswith("**reproduces** (TV 18.0%)")
    assert rep.verdict("faco_r1", [moved], ref)[0].startswith("**does not reproduce**")
    weak = {"dtap_percent": np.roll(P, -3, axis=0).tolist(), "acc": 100.0}  # mode at mass [0.2, 0.4)
    assert rep.verdict("fafo_r20", [weak], {"cells": {}})[0] == "**does not reproduce** (claim)"
    assert rep.verdict("fafo_r1", [weak], {"cells": {}})[0] == "**reproduces** (claim)"


def test_report_names_the_commit_of_each_seed():
    from experiments import qkov_report as rep

    rows = [{"seed": 1234, "commit": "475a9af" + "0" * 33}, {"seed": 1235, "commit": "2a0d859" + "1" * 33 + "+dirty"},
            {"seed": 1236, "commit": "2a0d859" + "1" * 33 + "+dirty"}]
    assert rep.commits_by_seed(rows) == "475a9af (1234); 2a0d859+dirty (1235, 1236)"
    assert rep.commits_by_seed(rows[:1]) == "475a9af (1234)"
