"""Scanned layers (runtime.scan_layers) against the Python loop of blocks, which is the independent reference: a
different program (one traced block run by jax.lax.scan over stacked params vs L traced blocks) that must give the
same numbers.

For every variant: the same initial values (the stacked block is the list's blocks stacked), the same loss and
gradients in fp32 (rtol 1e-5; 2 layers, whose DiffAttn λ_init differ, 0.2 and 0.36, so a wrong layer index
inside the scan changes the loss), with remat, the shared coupling MLP, dropout and the diagnostic forward; and a train
state saved in one layout restores in the other with the same values (orbax, and the training loop's resume).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from coupled_qk_jax import diagnostics
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig, RuntimeConfig
from coupled_qk_jax.model import TransformerLM, to_scanned, to_unscanned
from coupled_qk_jax.training import steps

import programs

TINY = dict(vocab_size=32, max_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=32, coupling_hidden=4,
            affine_hidden=4)
RTOL, ATOL = 1e-5, 1e-7  # the atol floor covers gradient entries ~1e-11 (f's output bias), as in test_sharding.py
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


SCANNED = RuntimeConfig(scan_layers=True)


def pair(cfg: ModelConfig, remat: str = "none"):
    """(unscanned graphdef, scanned graphdef, unscanned params perturbed off init, a batch with masked targets)."""
    g0, p0 = steps.split_model(TransformerLM(cfg, 0, RuntimeConfig(remat=remat)))
    g1, p1 = steps.split_model(TransformerLM(cfg, 0, RuntimeConfig(remat=remat, scan_layers=True)))
    # Same init in both layouts, exactly.
    jax.tree.map(np.testing.assert_array_equal, to_scanned(p0), p1)
    rng = np.random.default_rng(0)
    p0 = jax.tree.map(lambda x: np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(np.float32), p0)
    tokens = rng.integers(0, TINY["vocab_size"], (2, 9)).astype(np.int32)
    targets = tokens[:, 1:].copy()
    targets[0, :3] = steps.IGNORE_INDEX
    return g0, g1, p0, {"inputs": tokens[:, :-1], "targets": targets}


def loss_and_grads(graphdef, params, batch, key=None):
    loss_fn = steps.make_loss_fn(graphdef)
    fn = jax.jit(jax.value_and_grad(lambda p, b, k: loss_fn(p, b, k)[0]))
    return fn.lower(params, batch, key).compile(FAST_COMPILE)(params, batch, key)


def assert_same(unscanned, scanned, what: str):
    want = jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, unscanned))[0]
    got = jax.tree.leaves(to_unscanned(jax.tree.map(np.asarray, scanned)))
    assert len(want) == len(got)
    for (path, w), g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_scanned_equals_unscanned_loss_and_grads(variant):
    """On the shared shape of tests/programs.py (T = 128, two query blocks), whose unscanned fp32 program is
    test_precision's reference, compiled once for both modules."""
    cfg = programs.model_config(variant)
    p0 = programs.trained_looking_params(cfg)
    _, p1 = steps.split_model(TransformerLM(cfg, 0, SCANNED))
    jax.tree.map(np.testing.assert_array_equal, to_scanned(steps.split_model(TransformerLM(cfg, 0))[1]), p1)
    l0, gr0 = programs.grad_fn(cfg)(p0)
    l1, gr1 = programs.grad_fn(cfg, SCANNED)(to_scanned(p0))
    assert np.isfinite(float(l0))
    np.testing.assert_allclose(float(l1), float(l0), rtol=RTOL)
    assert_same(gr0, gr1, variant)


@pytest.mark.parametrize("extra", [
    dict(variant="coupled_euler", coupling_scope="shared", remat="full"),
    dict(variant="coupled_leapfrog+differential", remat="dots", dropout=0.1),
], ids=["shared-coupling-remat-full", "differential-remat-dots-dropout"])
def test_scanned_equals_unscanned_with_remat_shared_coupling_and_dropout(extra):
    """Remat policies wrap the scan body; the shared f is closed over by it; layer i's dropout key is the same key
    in both layouts (split of the step key into L + 1)."""
    extra = dict(extra)
    remat = extra.pop("remat")
    g0, g1, p0, batch = pair(ModelConfig(**{**TINY, **extra}), remat)
    key = jax.random.key(3)
    l0, gr0 = loss_and_grads(g0, p0, batch, key)
    l1, gr1 = loss_and_grads(g1, to_scanned(p0), batch, key)
    np.testing.assert_allclose(float(l1), float(l0), rtol=RTOL)
    assert_same(gr0, gr1, str(extra))
    if extra.get("dropout"):  # the key really is used: another key gives another loss
        assert abs(float(loss_and_grads(g0, p0, batch, jax.random.key(4))[0]) - float(l0)) > 1e-4


def test_capture_layers_is_per_layer_in_both_layouts():
    """Diagnostics (diagnostics.capture_layers) get a list of per-layer dicts from a scanned model too, equal to the
    loop's, and logits equal to the model's own forward."""
    g0, g1, p0, batch = pair(ModelConfig(variant="coupled_euler+differential", **TINY))
    # jitted: op-by-op dispatch of the two forwards costs more than compiling them
    out0 = jax.jit(lambda p, x: diagnostics.capture_layers(nnx.merge(g0, p), x))(p0, batch["inputs"])
    out1 = jax.jit(lambda p, x: diagnostics.capture_layers(nnx.merge(g1, p), x))(to_scanned(p0), batch["inputs"])
    plain = jax.jit(lambda p, x: nnx.merge(g1, p)(x))(to_scanned(p0), batch["inputs"])
    np.testing.assert_allclose(out1[0], plain, rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(out1[0], out0[0], rtol=RTOL, atol=1e-6)
    assert len(out1[1]) == len(out0[1]) == TINY["n_layers"]
    for a, b in zip(out0[1], out1[1]):
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=RTOL, atol=1e-6, err_msg=name)


def test_layout_conversion_round_trip_and_structure():
    cfg = ModelConfig(variant="coupled_euler", **TINY)
    _, params = steps.split_model(TransformerLM(cfg, 0))
    stacked = to_scanned(params)
    assert stacked["blocks"]["attn"]["wq"].shape == (TINY["n_layers"],) + params["blocks"][0]["attn"]["wq"].shape
    np.testing.assert_array_equal(stacked["blocks"]["mlp"]["w_in"][1], params["blocks"][1]["mlp"]["w_in"])
    back = to_unscanned(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, back, params)


@functools.lru_cache(maxsize=None)
def _one_step(scan: bool):
    """A train state after one AdamW step (non-zero moments), in the given layout."""
    cfg = ModelConfig(variant="coupled_euler", **TINY)
    g0, _, p0, batch = pair(cfg)
    graphdef = nnx.split(TransformerLM(cfg, 0, RuntimeConfig(scan_layers=scan)))[0]
    params = to_scanned(p0) if scan else p0
    # eps 1e-3: Adam's first step is ~lr·sign(g), which would amplify the last-bit differences of near-zero
    # gradients between the layouts; a large eps keeps the update proportional to g.
    tx = optax.adamw(1e-2, eps=1e-3, weight_decay=0.1)
    step = jax.jit(steps.make_train_step(graphdef, tx))
    state, _ = step(steps.init_train_state(params, tx), batch, jax.random.key(0))
    return jax.tree.map(np.asarray, state)


@pytest.mark.parametrize("saved_scan", [False, True])
def test_checkpoint_saved_in_one_layout_restores_in_the_other(tmp_path, saved_scan):
    """orbax save in one layout, restore, convert: the values equal those of the same step taken in the other
    layout (params and AdamW moments, rtol 1e-5)."""
    saved = _one_step(saved_scan)
    directory = str(tmp_path.absolute() / "ckpt")
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(saved))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(directory) as mngr:
        restored = mngr.restore(1, args=ocp.args.StandardRestore(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved)))
    converted = to_unscanned(restored) if saved_scan else to_scanned(restored)
    other = _one_step(not saved_scan)
    assert jax.tree.structure(converted) == jax.tree.structure(other)
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(other)[0], jax.tree.leaves(converted)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))
