"""The diagnostics report on a tiny model: keys, finiteness, the PNG, and a uniform-attention sanity check whose
expected values are computed independently in float64 numpy. The report from a saved checkpoint (eval.py
--diagnostics, by run directory and by Run) against the trained in-memory params: tests/test_run.py, on its 2-seed
run."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.diagnostics_report import ATTN_METRICS, QK_METRICS, diagnostics_report
from coupled_qk_jax.model import TransformerLM

T = 12


def _model(variant: str, seed: int = 0) -> TransformerLM:
    cfg = ModelConfig(variant=variant, vocab_size=50, max_len=T, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                      coupling_hidden=8, affine_hidden=8, dt_init=0.1)
    return TransformerLM(cfg, seed=seed)


def _tokens(b: int = 3) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 50, (b, T)).astype(np.int32)


@pytest.mark.parametrize("variant", ["standard", "coupled_euler", "differential"])
def test_report_keys_and_files(tmp_path, variant):
    rep = diagnostics_report(_model(variant), _tokens(), out_dir=tmp_path, name="d")
    saved = json.loads((tmp_path / "d.json").read_text())
    assert saved == json.loads(json.dumps(rep))
    assert (tmp_path / "d.png").stat().st_size > 1000
    assert len(rep["layers"]) == 2
    n_heads = 2 if variant == "differential" else 4  # differential heads pair the projection heads
    for lay in rep["layers"]:
        assert len(lay["heads"]) == n_heads
        for head in lay["heads"]:
            assert set(ATTN_METRICS) <= set(head)
            assert all(math.isfinite(v) for v in head.values())
        assert len(lay["qk_heads"]) == 4 and all(set(QK_METRICS) <= set(h) for h in lay["qk_heads"])
        assert all(math.isfinite(v) for h in lay["qk_heads"] for v in h.values())
        if variant == "coupled_euler":
            assert lay["dt"] == pytest.approx([0.1] * 4)
        else:
            assert lay["dt"] is None
    if variant == "standard":
        # no transform: q/k are unchanged by it
        assert rep["model_mean"]["q_rel_change"] == 0.0
        assert rep["model_mean"]["qk_cos_before"] == pytest.approx(rep["model_mean"]["qk_cos_after"])
    if variant == "coupled_euler":
        # the Euler drift q += Δt·k moves q at init (f ≡ 0 leaves k unchanged)
        assert rep["model_mean"]["q_rel_change"] > 0.0
        assert rep["model_mean"]["k_rel_change"] == pytest.approx(0.0, abs=1e-7)


def test_uniform_attention_sanity():
    """W_Q = W_K = 0 makes every score 0, so attention is uniform over the causal window in every head: the report
    must give the closed-form entropies and numpy's values for rank, gap and sink mass. With q = k = 0 the Δt of
    each head changes nothing, so mixed-sign Δt also checks the signed and absolute Δt means by hand."""
    model = _model("coupled_euler")
    dts = [[0.3, -0.2, 0.1, -0.4], [0.5, -0.5, 0.2, 0.0]]
    for block, dt in zip(model.blocks, dts):
        block.attn.wq[...] = jnp.zeros_like(block.attn.wq[...])
        block.attn.wk[...] = jnp.zeros_like(block.attn.wk[...])
        block.attn.dt[...] = jnp.asarray(dt, jnp.float32)
    rep = diagnostics_report(model, _tokens())
    assert rep["model_mean"]["dt_mean"] == pytest.approx(0.0, abs=1e-7)  # the signs cancel ...
    assert rep["model_mean"]["dt_abs_mean"] == pytest.approx(2.2 / 8)  # ... the magnitudes do not
    A = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    s = np.linalg.svd(A, compute_uv=False)
    p = s / s.sum()
    expected = {
        "entropy": np.mean(np.log(np.arange(1, T + 1))),
        "entropy_normalized": 1.0,
        "effective_rank": math.exp(-(p * np.log(p)).sum()),
        "spectral_gap": s[0] - s[1],
        "sigma2_over_sigma1": s[1] / s[0],
        "sink_mass": np.mean(1.0 / np.arange(1, T + 1)),
    }
    for lay in rep["layers"]:
        for head in lay["heads"]:
            for k, v in expected.items():
                assert head[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
        # q = k = 0 before and after the dynamics (f(0) = 0 at init): norms 0, cosines 0 by the eps floor
        assert lay["qk_mean"]["q_norm_after"] == pytest.approx(0.0, abs=1e-6)
        assert lay["qk_mean"]["qk_cos_after"] == pytest.approx(0.0, abs=1e-6)


def test_colour_scale_is_one_per_metric_group():
    """Hand-made grids: bounded groups keep their natural bounds (widened only by data outside them), related
    panels share the min..max of all their values, and a constant group gets a visible range."""
    from coupled_qk_jax.diagnostics_report import PANELS, colour_limits

    grids = {"sink_mass": np.array([[0.1, 0.2]]), "induction_mass": np.array([[0.3, np.nan]]),
             "q_norm_before": np.array([[2.0, 3.0]]), "k_norm_after": np.array([[1.5, 7.0]]),
             "qk_cos_after": np.array([[-1.2, 0.5]]), "k_rel_change": np.array([[0.0, 0.0]])}
    groups = {k: g for k, _, g in PANELS if k in grids}
    lim = colour_limits(grids, groups)
    assert lim["unit"] == (0.0, 1.0)
    assert lim["norm"] == (1.5, 7.0)  # q and k norms on one scale
    assert lim["cos"] == (-1.2, 1.0)  # differential attention can leave the natural bounds: widened, not clipped
    assert lim["change"] == (-0.5, 0.5)
    assert {g for k, _, g in PANELS if k in ("q_norm_before", "q_norm_after", "k_norm_before", "k_norm_after")} == {
        "norm"}
