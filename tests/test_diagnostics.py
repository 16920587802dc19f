"""Tests for coupled_qk_jax.diagnostics against closed forms and float64 numpy references."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coupled_qk_jax import diagnostics as D
from coupled_qk_jax.data.mqar import multiquery_ar

T = 7


def uniform_causal(t: int = T) -> np.ndarray:
    return np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]


def all_on_first(t: int = T) -> np.ndarray:
    a = np.zeros((t, t))
    a[:, 0] = 1.0
    return a


def random_causal(shape, t, seed=0, sharp=1.0) -> np.ndarray:
    """Random row-stochastic causal matrices: softmax of Gaussian scores over the causal window."""
    rng = np.random.default_rng(seed)
    s = sharp * rng.normal(size=tuple(shape) + (t, t))
    s = np.where(np.tril(np.ones((t, t), dtype=bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# float64 numpy references, written independently of the module.
def np_entropy(a, normalized=False):
    t = a.shape[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.sum(np.where(a > 0, a * np.log(a), 0.0), axis=-1)
    if not normalized:
        return h.mean(-1)
    return (h[..., 1:] / np.log(np.arange(2, t + 1))).mean(-1)


def np_erank(a):
    s = np.linalg.svd(a, compute_uv=False)
    p = s / s.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.exp(-np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=-1))


# ---------------------------------------------------------------------------------------------------------------
# Closed forms on hand-made matrices
# ---------------------------------------------------------------------------------------------------------------


def test_uniform_causal_attention():
    a = uniform_causal()
    expected = np.mean([np.log(i + 1) for i in range(T)])
    assert float(D.attention_entropy(a)) == pytest.approx(expected, rel=1e-6)
    assert float(D.attention_entropy(a, normalized=True)) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(np.asarray(D.row_entropy(a)), np.log(np.arange(1, T + 1)), atol=1e-6)
    # Row i puts 1/(i+1) on position 0.
    assert float(D.sink_mass(a)) == pytest.approx(np.mean(1.0 / np.arange(1, T + 1)), rel=1e-6)
    D.check_attention(a)


def test_all_rows_on_position_zero_is_rank_one():
    a = all_on_first()
    assert float(D.attention_entropy(a)) == 0.0
    assert float(D.attention_entropy(a, normalized=True)) == 0.0
    assert float(D.effective_rank(a)) == pytest.approx(1.0, abs=1e-6)
    sg = D.spectral_gap(a)
    # A = 1 e_0^T has the single singular value ||1|| ||e_0|| = sqrt(T).
    assert float(sg.gap) == pytest.approx(np.sqrt(T), rel=1e-6)
    assert float(sg.ratio) == pytest.approx(0.0, abs=1e-6)
    assert float(D.sink_mass(a)) == 1.0


def test_identity_attention():
    a = np.eye(T)
    assert float(D.attention_entropy(a)) == 0.0
    assert float(D.effective_rank(a)) == pytest.approx(T, rel=1e-6)
    sg = D.spectral_gap(a)
    assert float(sg.gap) == pytest.approx(0.0, abs=1e-6)
    assert float(sg.ratio) == pytest.approx(1.0, rel=1e-6)
    assert float(D.sink_mass(a)) == pytest.approx(1.0 / T)


def test_rank_one_and_rectangular_matrices():
    rng = np.random.default_rng(1)
    u, v = rng.random(6) + 0.1, rng.random(4) + 0.1
    m = np.outer(u, v)
    assert float(D.effective_rank(m)) == pytest.approx(1.0, abs=1e-5)
    # Non-causal rank-one stochastic matrix: every row is the same distribution pi; sigma1 = sqrt(T) ||pi||.
    pi = rng.random(T)
    pi /= pi.sum()
    a = np.tile(pi, (T, 1))
    sg = D.spectral_gap(a)
    assert float(sg.gap) == pytest.approx(np.sqrt(T) * np.linalg.norm(pi), rel=1e-5)
    assert float(sg.ratio) == pytest.approx(0.0, abs=1e-5)
    # Equal singular values: an orthogonal matrix, also rectangular (Q activations [T, d]).
    q, _ = np.linalg.qr(rng.normal(size=(9, 5)))
    assert float(D.effective_rank(q)) == pytest.approx(5.0, rel=1e-5)
    assert float(D.effective_rank(np.zeros((3, 3)))) == 1.0  # documented convention, no NaN


def test_block_diagonal_effective_rank_closed_form():
    # Two diagonal blocks with singular values (2, 1): p = (2/3, 1/3), erank = exp(H(p)).
    a = np.diag([2.0, 1.0])
    p = np.array([2 / 3, 1 / 3])
    assert float(D.effective_rank(a)) == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Random causal matrices against numpy float64
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharp", [0.3, 3.0, 30.0])
def test_random_causal_against_numpy(sharp):
    a = random_causal((2, 3), 16, seed=int(sharp * 10), sharp=sharp)
    D.check_attention(a)
    a32 = a.astype(np.float32)
    np.testing.assert_allclose(np.asarray(D.attention_entropy(a32)), np_entropy(a), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(D.attention_entropy(a32, normalized=True)), np_entropy(a, True),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(D.effective_rank(a32)), np_erank(a), rtol=1e-4)
    s = np.linalg.svd(a, compute_uv=False)
    sg = D.spectral_gap(a32)
    assert sg.gap.shape == sg.ratio.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(sg.gap), s[..., 0] - s[..., 1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sg.ratio), s[..., 1] / s[..., 0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(D.sink_mass(a32)), a[..., :, 0].mean(-1), rtol=1e-5)
    # Row-stochastic => sigma1 >= 1 (spec); the top singular value is at least the spectral radius.
    assert np.all(s[..., 0] >= 1 - 1e-9)


def test_jit_vmap_and_half_precision():
    a = jnp.asarray(random_causal((4,), 8, seed=3))
    f = jax.jit(lambda x: (D.attention_entropy(x, normalized=True), D.effective_rank(x), D.spectral_gap(x),
                           D.sink_mass(x)))
    ent, er, sg, sink = f(a)
    ent_v = jax.vmap(D.attention_entropy)(a)
    np.testing.assert_allclose(np.asarray(ent_v), np_entropy(np.asarray(a, np.float64)), rtol=1e-4)
    assert ent.shape == er.shape == sg.gap.shape == sink.shape == (4,)
    half = D.attention_entropy(a.astype(jnp.bfloat16))
    assert half.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(half), np_entropy(np.asarray(a, np.float64)), rtol=2e-2)


def test_entropy_gradient_is_finite_with_zeros():
    # Causal attention is full of exact zeros; 0 log 0 must not poison gradients.
    g = jax.grad(lambda x: D.attention_entropy(x))(jnp.asarray(all_on_first(), jnp.float32))
    assert np.all(np.isfinite(np.asarray(g)))


def test_shape_and_value_errors():
    with pytest.raises(ValueError, match=r"\[\.\.\., T, T\]"):
        D.attention_entropy(np.ones((3, 4)))
    with pytest.raises(ValueError, match="T >= 2"):
        D.spectral_gap(np.ones((1, 1)))
    with pytest.raises(ValueError, match="T >= 2"):
        D.attention_entropy(np.ones((1, 1)), normalized=True)
    with pytest.raises(ValueError, match="floating"):
        D.sink_mass(np.eye(3, dtype=np.int32))
    with pytest.raises(ValueError, match="causal"):
        D.check_attention(np.full((3, 3), 1 / 3))
    with pytest.raises(ValueError, match="sum to 1"):
        D.check_attention(np.tril(np.ones((3, 3))))


# ---------------------------------------------------------------------------------------------------------------
# qk_stats
# ---------------------------------------------------------------------------------------------------------------


def test_qk_stats_against_numpy():
    rng = np.random.default_rng(0)
    B, T_, H, d = 2, 5, 3, 4
    qb, kb = rng.normal(size=(2, B, T_, H, d))
    qa, ka = qb + 0.1 * rng.normal(size=qb.shape), kb * 2.0
    mask = np.ones((B, T_), dtype=bool)
    mask[1, 3:] = False
    out = D.qk_stats(qb, kb, qa, ka, mask=mask)
    sel = mask[..., None].repeat(H, -1)  # [B, T, H]

    def ref(x):  # mean over masked (b, t) per head
        return np.array([x[..., h][sel[..., h]].mean() for h in range(H)])

    nrm = lambda x: np.sqrt((x ** 2).sum(-1))  # noqa: E731
    np.testing.assert_allclose(out["q_norm_before"], ref(nrm(qb)), rtol=1e-5)
    np.testing.assert_allclose(out["k_norm_after"], ref(nrm(ka)), rtol=1e-5)
    np.testing.assert_allclose(out["qk_cos_before"], ref((qb * kb).sum(-1) / (nrm(qb) * nrm(kb))), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(out["qk_cos_after"], ref((qa * ka).sum(-1) / (nrm(qa) * nrm(ka))), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(out["q_rel_change"], ref(nrm(qa - qb) / nrm(qb)), rtol=1e-4)
    # Scaling k by 2 doubles its norm, leaves the cosine unchanged and is a relative change of exactly 1.
    np.testing.assert_allclose(out["k_rel_change"], np.ones(H), rtol=1e-5)
    np.testing.assert_allclose(out["k_norm_after"], 2 * np.asarray(out["k_norm_before"]), rtol=1e-5)
    assert all(v.shape == (H,) for v in out.values())


def test_qk_stats_identity_dynamics_and_errors():
    x = np.random.default_rng(1).normal(size=(1, 4, 2, 3))
    out = D.qk_stats(x, x, x, x)
    np.testing.assert_allclose(out["qk_cos_before"], 1.0, rtol=1e-5)  # q == k
    np.testing.assert_allclose(out["q_rel_change"], 0.0, atol=1e-7)
    with pytest.raises(ValueError, match="k_after"):
        D.qk_stats(x, x, x, x[:, :3])
    with pytest.raises(ValueError, match=r"\[B, T, H, d\]"):
        D.qk_stats(x[0], x[0], x[0], x[0])
    with pytest.raises(ValueError, match="mask"):
        D.qk_stats(x, x, x, x, mask=np.ones((1, 3)))


# ---------------------------------------------------------------------------------------------------------------
# Induction relevance mask
# ---------------------------------------------------------------------------------------------------------------


def _ref_relevance(tokens):
    t_ = len(tokens)
    mask = np.zeros((t_, t_), dtype=bool)
    valid = np.zeros(t_, dtype=bool)
    for t in range(t_):
        earlier = [p for p in range(t) if tokens[p] == tokens[t]]
        if earlier:
            valid[t] = True
            mask[t, earlier[-1] + 1] = True
    return mask, valid


def test_relevance_mask_hand_made():
    mask, valid = D.previous_token_relevance_mask(jnp.array([1, 2, 3, 1, 2, 2]))
    np.testing.assert_array_equal(valid, [False, False, False, True, True, True])
    # t=3 (token 1, seen at 0) -> 1; t=4 (token 2, seen at 1) -> 2; t=5 (token 2, latest at 4) -> 5 itself.
    expected = np.zeros((6, 6), dtype=bool)
    expected[3, 1] = expected[4, 2] = expected[5, 5] = True
    np.testing.assert_array_equal(mask, expected)


def test_relevance_mask_random_against_loop():
    tokens = np.random.default_rng(0).integers(0, 5, size=(3, 20))
    mask, valid = D.previous_token_relevance_mask(tokens)
    assert mask.shape == (3, 20, 20) and valid.shape == (3, 20)
    for b in range(3):
        m_ref, v_ref = _ref_relevance(tokens[b].tolist())
        np.testing.assert_array_equal(mask[b], m_ref)
        np.testing.assert_array_equal(valid[b], v_ref)
    # Causal: every target lies at or before its query.
    assert not np.any(np.triu(np.asarray(mask), k=1))
    with pytest.raises(ValueError, match="int"):
        D.previous_token_relevance_mask(np.zeros(4, dtype=np.float32))


def test_relevance_mask_on_mqar_points_at_values():
    inputs, labels = multiquery_ar(256, 4, 32, 5, num_kv_pairs=4, random_non_queries=False)
    mask, valid = D.previous_token_relevance_mask(inputs)
    mask = np.asarray(mask)
    for i in range(4):
        for t in np.flatnonzero(labels[i] != -100):
            j = int(np.flatnonzero(mask[i, t])[0])
            assert inputs[i, j] == labels[i, t]  # the target token is the value to recall


def test_masked_attention_mass():
    tokens = jnp.array([[1, 2, 1, 2]])
    mask, valid = D.previous_token_relevance_mask(tokens)
    a = uniform_causal(4)[None]
    # Valid rows: t=2 -> j=1 (weight 1/3), t=3 -> j=2 (weight 1/4).
    assert float(D.masked_attention_mass(a, mask, valid)[0]) == pytest.approx((1 / 3 + 1 / 4) / 2)
    assert float(D.masked_attention_mass(a, mask)[0]) == pytest.approx((1 / 3 + 1 / 4) / 4)


# ---------------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------------


def test_summarize_attention_matches_functions_and_is_json():
    layer0 = random_causal((2, 3), 6, seed=4)          # [B, H, T, T]
    layer1 = np.broadcast_to(uniform_causal(6), (2, 3, 6, 6))
    tokens = np.array([[1, 2, 1, 2, 3, 1], [4, 4, 4, 5, 5, 4]])
    out = D.summarize_attention({"block0": layer0, "block1": layer1}, tokens=tokens)
    json.dumps(out)
    assert [lay["layer"] for lay in out["layers"]] == ["block0", "block1"]
    head = out["layers"][0]["heads"][1]
    a = layer0[:, 1]
    assert head["entropy"] == pytest.approx(np_entropy(a).mean(), rel=1e-4)
    assert head["entropy_normalized"] == pytest.approx(np_entropy(a, True).mean(), rel=1e-4)
    assert head["effective_rank"] == pytest.approx(np_erank(a).mean(), rel=1e-4)
    s = np.linalg.svd(a, compute_uv=False)
    assert head["spectral_gap"] == pytest.approx((s[:, 0] - s[:, 1]).mean(), rel=1e-4)
    assert head["sigma2_over_sigma1"] == pytest.approx((s[:, 1] / s[:, 0]).mean(), rel=1e-4)
    assert head["sink_mass"] == pytest.approx(a[:, :, 0].mean(), rel=1e-5)
    # induction_mass pooled over all valid (batch, row) pairs, from the loop reference.
    num, den = 0.0, 0
    for b in range(2):
        m_ref, v_ref = _ref_relevance(tokens[b].tolist())
        num += (a[b] * m_ref).sum()
        den += v_ref.sum()
    assert head["induction_mass"] == pytest.approx(num / den, rel=1e-5)
    assert out["layers"][1]["mean"]["entropy_normalized"] == pytest.approx(1.0, rel=1e-5)
    # Sequence input and a single [H, T, T] matrix.
    seq = D.summarize_attention([uniform_causal(4)[None]])
    assert seq["layers"][0]["layer"] == 0 and len(seq["layers"][0]["heads"]) == 1
    with pytest.raises(ValueError, match="tokens shape"):
        D.summarize_attention([layer0], tokens=tokens[:, :5])
