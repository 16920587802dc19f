"""The QK/OV -> LM bridge experiment (experiments/qkov_lm_bridge.py): the metric assembly on hand-made attention
maps with known answers, and one tiny seed-parallel cell end to end (byte tokenizer, text_dir fixture, few steps)
through the report writer."""

import csv
import math

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import qkov_lm_bridge as bridge


def _hand_made():
    """tokens [1, 5] = a b a b c. Induction targets (previous_token_relevance_mask): row 2 (a, earlier at 0) -> key 1;
    row 3 (b, earlier at 1) -> key 2; rows 0, 1, 4 have no earlier occurrence."""
    tokens = jnp.array([[1, 2, 1, 2, 3]], jnp.int32)
    T = 5
    a = np.zeros((1, 2, T, T), np.float32)
    # head 0: row 2 puts 0.8 on key 1 (relevant), row 3 puts 0.3 on key 2 (relevant); other rows uniform causal.
    for h in range(2):
        for t in range(T):
            a[0, h, t, : t + 1] = 1.0 / (t + 1)
    a[0, 0, 2] = [0.1, 0.8, 0.1, 0, 0]
    a[0, 0, 3] = [0.4, 0.1, 0.3, 0.2, 0]
    # head 1: one-hot on the relevant key in both valid rows.
    a[0, 1, 2] = [0, 1, 0, 0, 0]
    a[0, 1, 3] = [0, 0, 1, 0, 0]
    return jnp.asarray(a), tokens


def test_hand_made_attention_ac():
    attn, tokens = _hand_made()
    ok = jnp.ones((1, 5), bool)
    samples = {k: np.asarray(v) for k, v in bridge.layer_samples(attn, tokens, ok).items()}
    np.testing.assert_array_equal(samples["valid"], [[False, False, True, True, False]])
    np.testing.assert_allclose(samples["rel_mass"][0, 0, 2:4], [0.8, 0.3], atol=1e-6)
    np.testing.assert_allclose(samples["rel_mass"][0, 1, 2:4], [1.0, 1.0], atol=1e-6)
    # true-next-token probability: row 2 confident (0.9), row 3 not (0.2); invalid rows are ignored anyway.
    prob = np.array([[0.99, 0.99, 0.9, 0.2, 0.99]])
    s = bridge.summarize_layer(samples, prob, tau_att=0.5, tau_conf=0.5)
    # samples (head, row): (0,2) 0.8  (0,3) 0.3  (1,2) 1.0  (1,3) 1.0 -> 3 of 4 reach 0.5
    assert s["valid_rows"] == 2
    assert s["rel_mass"] == pytest.approx((0.8 + 0.3 + 1.0 + 1.0) / 4, abs=1e-6)
    assert s["ac"] == pytest.approx(75.0)
    assert s["ac_best_head"] == pytest.approx(100.0)  # head 1
    # ACMC: mass >= 0.5 and prob >= 0.5 -> (0,2) and (1,2) only
    assert s["acmc"] == pytest.approx(50.0)
    # a stricter tau_att drops head 0's 0.8 sample
    assert bridge.summarize_layer(samples, prob, tau_att=0.9)["ac"] == pytest.approx(50.0)
    # sink mass averages every query row over both heads (computed by hand from the map)
    want_sink = np.mean(np.asarray(attn)[0, :, :, 0])
    assert s["sink_mass"] == pytest.approx(float(want_sink), abs=1e-6)
    assert 0.0 < s["entropy_norm"] < 1.0
    # padding rows (target_ok False) are not valid samples
    masked = bridge.layer_samples(attn, tokens, jnp.array([[True, True, True, False, True]]))
    assert np.asarray(masked["valid"]).tolist() == [[False, False, True, False, False]]
    out = bridge.assemble([s, s])
    assert out["mean"]["ac"] == pytest.approx(75.0) and len(out["layers"]) == 2
    # chance levels: uniform causal attention gives rows 2 and 3 masses 1/3 and 1/4, below tau_att
    ref = bridge.uniform_reference([{"inputs": np.asarray(tokens), "targets": np.zeros((1, 5), np.int32)}])
    assert ref["rel_mass"] == pytest.approx((1 / 3 + 1 / 4) / 2, abs=1e-6)
    assert ref["ac"] == 0.0 and ref["entropy_norm"] == pytest.approx(1.0, abs=1e-6)


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "query", "key", "value", "attention", "step", "flow"]
    for i in range(40):  # with split fractions 0.5/0.5/0 both train and validation get files
        (d / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, size=120)) + "\n")
    return d


def test_cell_end_to_end(tmp_path, text_dir):
    corpus = {"kind": "text_dir", "path": str(text_dir), "split_fractions": [0.5, 0.5, 0.0]}
    small = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "max_len": 32, "coupling_hidden": 6,
             "affine_hidden": 6}
    # One cell, two seeds; the compiles dominate the time, so the cheaper-to-compile standard variant is used
    # (the coupled variants return their attention through the same diagnostics.capture_layers path).
    cell = bridge.run_cell("standard", 5.0, workdir=tmp_path / "run", scale="tiny", steps=3, seeds=[0, 1],
                           corpus=corpus, cache_dir=str(tmp_path / "cache"), tokenizer="byte", diag_batches=1, eval_points=1,
                           model_overrides=small, train_overrides={"batch_size": 8})
    # a second "cell" re-labelled from the first exercises the multi-row tables without another compile
    cells = [dict(cell, variant="standard_copy", qk_lr_mult=1.0), cell]
    out = tmp_path / "out"
    out.mkdir()
    bridge.report(cells, out, "python -m experiments.qkov_lm_bridge (test)")
    for name in ("results.csv", "results.md", "per_seed.csv", "per_layer.csv", "per_layer.md", "bridge.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    want = {"variant", "qk_lr_mult", "seeds", "tokens_per_seed", "val_ppl_mean", "val_ppl_std"}
    want |= {f"{k}_{s}" for k in bridge.LAYER_METRICS for s in ("mean", "std")}
    assert want <= set(rows[0])
    assert [(r["variant"], float(r["qk_lr_mult"])) for r in rows] == [("standard_copy", 1.0), ("standard", 5.0)]
    for r in rows:
        assert int(r["tokens_per_seed"]) == 3 * 8 * 32
        for k in want - {"variant"}:
            assert math.isfinite(float(r[k])), k
        assert 0.0 <= float(r["ac_mean"]) <= 100.0
        assert 0.0 <= float(r["acmc_mean"]) <= float(r["ac_mean"]) + 1e-9
        assert 0.0 < float(r["entropy_norm_mean"]) <= 1.0 + 1e-6
    with open(out / "per_layer.csv") as f:
        layers = list(csv.DictReader(f))
    assert len(layers) == 2 * 2  # 2 cells x 2 layers
    # the layer-averaged numbers are the mean of the per-layer ones, per seed
    d = cells[1]["diagnostics"][0]
    assert d["mean"]["ac"] == pytest.approx(np.mean([l["ac"] for l in d["layers"]]))
    assert cells[1]["train_cfg"]["qk_lr_mult"] == 5.0 and cells[1]["train_cfg"]["qk_mult_coupling"] is False
