"""benchmarks/memory_model.py's activation count against the residuals JAX saves for the backward pass.

The reference is `jax.ad_checkpoint.print_saved_residuals`. Scanned layers (the layout of the 60m-350m configs,
whose XLA figure `memory_model.py --xla` checks; remat=none runs as "dots" there): a residual that carries the layer
axis ([L, ...]) is saved once per layer, so the sum of those that are not arguments (the stacked weights are the
step's own inputs), divided by L, is one layer's activations. "everything" (the Python loop's remat=none, and the
one layer that the scanned backward pass recomputes at a time): the residuals of one block under its remat policy.
The model's count is built by hand from the code's structure; bytes are integers, so the two must agree exactly.
T = 256 gives the explicit kernel 4 causal query blocks (the multi-block path users run); B = 2 separates
per-sequence from per-layer terms.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import memory_model
from flax import nnx

from coupled_qk_jax.config import ModelConfig, RuntimeConfig
from coupled_qk_jax.model import REMAT_POLICIES, Block, TransformerLM, _run_block
from coupled_qk_jax.training import steps

L, B, T = 3, 2, 256
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "u32": 4, "bool": 1}
LINE = re.compile(r"^(\w+)\[([\d,]*)\] (.*)$")


def residuals(fn, *args) -> list[tuple[list[int], int, str]]:
    """(shape, bytes, source) of every residual print_saved_residuals lists for fn(*args)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    rows = []
    for line in out.getvalue().splitlines():
        dtype, dims, source = LINE.match(line).groups()
        shape = [int(n) for n in dims.split(",") if n]
        rows.append((shape, ITEMSIZE[dtype] * math.prod(shape), source))
    return rows


def saved_per_layer(cfg: ModelConfig, runtime: RuntimeConfig) -> float:
    """Bytes of the non-argument residuals stacked over the layer axis, per layer."""
    graphdef, params = steps.split_model(TransformerLM(cfg, 0, runtime))
    loss_fn = steps.make_loss_fn(graphdef)
    tokens = jnp.zeros((B, T), jnp.int32)
    rows = residuals(lambda p: loss_fn(p, {"inputs": tokens, "targets": tokens})[0], params)
    return sum(n for shape, n, src in rows if shape[:1] == [L] and "from the argument" not in src) / L


@pytest.mark.parametrize("variant,dtype,extra", [
    ("standard", "float32", {}),
    ("coupled_euler", "bfloat16", {}),
    ("coupled_leapfrog", "float32", {}),
    ("mlp_only", "bfloat16", {}),
    ("coupled_euler", "float32", {"dynamics_backward": "autodiff", "n_steps": 2}),
    ("coupled_leapfrog", "float32", {"dynamics_backward": "autodiff", "n_steps": 2}),
    ("mlp_only", "float32", {"dynamics_backward": "autodiff", "n_steps": 2}),
])
def test_layer_residuals_match_what_jax_saves(variant, dtype, extra):
    cfg = ModelConfig(variant=variant, vocab_size=64, max_len=T, d_model=64, n_layers=L, n_heads=4, d_ff=256,
                      coupling_hidden=12, dtype=dtype, n_steps=extra.get("n_steps", 1))
    runtime = RuntimeConfig(attention_impl="explicit", scan_layers=True,
                            dynamics_backward=extra.get("dynamics_backward", "reversible"))
    assert memory_model.saved_policy(runtime) == "dots"
    per_seq, per_layer = memory_model.layer_residuals(cfg, runtime, T, jnp.dtype(dtype).itemsize, policy="dots")
    assert B * sum(per_seq.values()) + sum(per_layer.values()) == saved_per_layer(cfg, runtime)


@pytest.mark.parametrize("variant,dtype,extra", [
    ("standard", "float32", {}),
    ("coupled_euler", "bfloat16", {}),
    ("coupled_leapfrog", "float32", {}),
    ("mlp_only", "float32", {"dynamics_backward": "autodiff", "n_steps": 2}),
])
def test_everything_policy_matches_one_block(variant, dtype, extra):
    """One block under the Python loop's remat=none policy. Beyond the model's count the block saves the causal
    mask of each query block as a bool and the fill of `jnp.where` as fp32 (1 + 4 bytes per score element): the same
    constants in every layer, which the layer scan keeps once and XLA folds, so the model leaves them out; the test
    adds them by hand. With nothing FSDP-gathered the loop runs its blocks without the checkpoint: what
    plain autodiff saves then stays within 3% of this count (equal but for a few scalars, 2.4% fewer for mlp_only
    with autodiff at n = 2), so the count still describes what the loop keeps."""
    cfg = ModelConfig(variant=variant, vocab_size=64, max_len=T, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                      coupling_hidden=12, dtype=dtype, n_steps=extra.get("n_steps", 1))
    runtime = RuntimeConfig(attention_impl="explicit", dynamics_backward=extra.get("dynamics_backward", "reversible"))
    graphdef, params = nnx.split(Block(cfg, 0, jax.random.key(0), runtime))
    plain = lambda p, x: _run_block(nnx.merge(graphdef, p), x, 0, None)
    args = (nnx.to_pure_dict(params), jnp.zeros((B, T, cfg.d_model), dtype))

    def saved(fn) -> int:
        return sum(n for _, n, src in residuals(fn, *args) if not ("from the argument" in src and "['" in src))  # but x

    blocks = memory_model._query_blocks(runtime, T)
    mask = 5 * B * cfg.n_heads * sum((hi - lo) * hi for lo, hi in blocks)
    per_seq, per_layer = memory_model.layer_residuals(cfg, runtime, T, jnp.dtype(dtype).itemsize, policy="everything")
    counted = B * sum(per_seq.values()) + sum(per_layer.values()) + mask
    assert counted == saved(jax.checkpoint(plain, policy=REMAT_POLICIES["none"]))
    assert abs(saved(plain) - counted) <= 0.03 * counted


def test_query_blocks_follow_the_kernel():
    """The explicit kernel's blocks at T = 1024 (the 60m-350m context): 8 blocks of 128 queries, whose key prefixes
    sum to (8+1)/2 = 4.5 copies of K and whose scores cover 9/16 of the T×T square."""
    blocks = memory_model._query_blocks(RuntimeConfig(), 1024)
    assert blocks == [(128 * i, 128 * (i + 1)) for i in range(8)]
    assert sum(hi for _, hi in blocks) == 4.5 * 1024
    assert sum((hi - lo) * hi for lo, hi in blocks) == 1024 * 1024 * 9 // 16
