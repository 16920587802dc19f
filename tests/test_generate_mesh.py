"""Sharded generation (generate.Generator on parameters placed on a mesh) and export of sharded parameters.

Every test here carries the ``mesh`` marker: they run in the session's one subprocess with 8 CPU devices
(conftest.py). The reference is always the single-device result: greedy tokens of the same model on one device,
its KV cache, or the host values of its parameters. Each variant is one tiny model (test_generate.tiny_model, vocab
64 so that tensor=2 divides it, one layer; the cache test's model has two), one batch of three prompts of different
lengths (three rows on a data x fsdp = 4 mesh: one padding row) and five new tokens: four compilations per
variant, which is most of what this file costs. A trained run opened with Run.open(dir, mesh=...) and generating
on the mesh (sample.py's path) is checked by test_run.py::test_runs_trained_on_8_devices_read_alike_on_1_and_2.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.export import flatten_params
from coupled_qk_jax.generate import Generator, Sampling, init_cache
from test_generate import VARIANT_CASES, tiny_model

pytestmark = pytest.mark.mesh

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
PROMPTS = [np.array([3, 1, 4], np.int32), np.array([1, 5, 9, 2, 6, 5, 3], np.int32), np.array([27, 18], np.int32)]
NEW_TOKENS, VOCAB = 5, 64
GREEDY = Sampling(temperature=0)


def on_mesh(model: nnx.Module, mesh) -> nnx.Module:
    """The same model with its parameters placed by sharding.py's rules (what Run.open(dir, mesh=...) does)."""
    graphdef, state = nnx.split(model)
    placed = jax.device_put(nnx.to_pure_dict(state), shd.named_shardings(shd.param_specs(model, mesh), mesh))
    return nnx.merge(graphdef, placed)


def mesh_of_8():
    return shd.make_mesh(MESH, jax.devices()[:8])


@pytest.mark.parametrize("variant,positions", VARIANT_CASES)
def test_sharded_greedy_tokens_equal_single_device(variant, positions):
    model = tiny_model(variant, positions, vocab_size=VOCAB, n_layers=1)  # layers > 0: the cache test's model
    single = Generator(model, vocab_limit=50)
    assert single.mesh is None
    want = single.generate(PROMPTS, NEW_TOKENS, GREEDY)
    sharded = Generator(on_mesh(model, mesh_of_8()), vocab_limit=50)
    assert dict(sharded.mesh.shape) == MESH
    got = sharded.generate(PROMPTS, NEW_TOKENS, GREEDY)
    assert len(got) == len(PROMPTS)  # the padding row is dropped
    for row, (w, g) in enumerate(zip(want, got)):
        assert w.shape == (NEW_TOKENS,) and 0 <= w.min() and w.max() < 50, (variant, row, w)
        np.testing.assert_array_equal(g, w, err_msg=f"{variant} row {row}")
    assert len({tuple(w) for w in want}) > 1, "every row decoded the same tokens: a weak comparison"


def test_kv_cache_is_sharded_over_batch_and_heads():
    """The cache a sharded prefill returns is split (batch over data x fsdp, heads over tensor): each device holds a
    [L, B/4, S, H/2, D] block, where the single-device cache is one whole block; its values are the single-device
    prefill's (to fp32 rounding of the differently split matmuls), and a decode step keeps the layout."""
    model = tiny_model("coupled_leapfrog+differential", "rope", vocab_size=VOCAB)
    cfg, mesh = model.cfg, mesh_of_8()
    batch, size = 4, cfg.max_len
    tokens = np.zeros((batch, 8), np.int32)
    tokens[:, :3] = [[3, 1, 4], [1, 5, 9], [2, 6, 5], [27, 18, 28]]
    lengths = np.full(batch, 3, np.int32)
    key = jax.random.key(0)

    single = Generator(model)
    _, want = single._prefill(single.state, init_cache(cfg, batch, size), tokens, lengths, key, GREEDY)
    full = (cfg.n_layers, batch, size, cfg.n_heads, cfg.head_dim)
    assert {s.data.shape for s in want["k"].addressable_shards} == {full}  # the control: one whole cache

    sharded = Generator(on_mesh(model, mesh))
    rows = jax.sharding.NamedSharding(mesh, P(shd.BATCH_AXES))
    tok, got = sharded._prefill(sharded.state, sharded._new_cache(cfg, batch, size),
                                jax.device_put(tokens, rows), jax.device_put(lengths, rows), key, GREEDY)
    block = (cfg.n_layers, batch // 4, size, cfg.n_heads // 2, cfg.head_dim)
    for name in ("k", "v"):
        assert got[name].sharding.spec == P(None, ("data", "fsdp"), None, "tensor", None), name
        assert got[name].shape == full
        assert {s.data.shape for s in got[name].addressable_shards} == {block}, name
        expected = np.asarray(want[name])
        assert np.isfinite(expected).all() and np.abs(expected).max() > 0.1
        np.testing.assert_allclose(np.asarray(got[name]), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    _, after = sharded._decode(sharded.state, got, tok, jax.device_put(lengths, rows), 1, key, GREEDY)
    assert after["k"].sharding.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    assert {s.data.shape for s in after["k"].addressable_shards} == {block}


def test_export_of_sharded_params_is_bitwise_the_single_device_export():
    """flatten_params (what write_export saves) of parameters split over 8 devices: every tensor bitwise the host
    value it was placed from, with its dtype and shape."""
    model = tiny_model("coupled_euler", "learned", vocab_size=VOCAB)
    host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    sharded = nnx.to_pure_dict(nnx.state(on_mesh(model, mesh_of_8())))
    wq = sharded["blocks"][0]["attn"]["wq"]
    assert len(wq.sharding.device_set) == 8 and wq.addressable_shards[0].data.shape != wq.shape  # really split
    expected = {".".join(str(getattr(k, "key", k)) for k in path): x
                for path, x in jax.tree_util.tree_flatten_with_path(host)[0]}
    got = flatten_params(sharded)
    assert got.keys() == expected.keys() and "blocks.0.attn.wq" in got
    for name, want in expected.items():
        assert np.isfinite(want).all(), name
        assert isinstance(got[name], np.ndarray) and got[name].dtype == want.dtype, name
        assert np.array_equal(got[name], want), name
