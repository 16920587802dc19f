"""The all-variant loss and gradient programs that several test modules share, on one tiny shape: compiled once per
config in a process (test_precision's fp32 references are test_scan's unscanned side; both modules run in the same
lane, tests/conftest.py).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coupled_qk_jax.config import ModelConfig, RuntimeConfig
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import steps

T = 128  # two query blocks of the default explicit path
TOKENS = jax.random.randint(jax.random.key(1), (4, T + 1), 0, 97)
BATCH = {"inputs": TOKENS[:, :-1], "targets": TOKENS[:, 1:]}


def model_config(variant: str, **overrides) -> ModelConfig:
    # coupled_euler at n = 1 with learned positions: adding f's output bias b2 to every key shifts every score of a
    # query by the same q·(Δt·b2), which the softmax ignores, so b2's true gradient is exactly 0 and the comparison
    # has no signal; RoPE rotates the shift per position and gives b2 a real gradient.
    rope = variant.startswith("coupled_euler")
    return ModelConfig(variant=variant, vocab_size=97, max_len=T, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                       coupling_hidden=8, affine_hidden=8, norm="layernorm", dt_init=0.3,
                       positions="rope" if rope else "learned", **overrides)


def trained_looking_params(cfg: ModelConfig) -> dict:
    """Init params (unscanned layout) with the zero-initialised output layers of f and the affine nets made non-zero
    (at f ≡ 0 the first layer's gradient is exactly 0) and LayerNorm shifts non-zero."""
    _, params = steps.split_model(TransformerLM(cfg, 0))
    rng = np.random.default_rng(0)

    def perturb(path, x):
        name = jax.tree_util.keystr(path)
        if any(tag in name for tag in ("coupling", "affine")) and any(w in name for w in ("w2", "b2", "b1")):
            return jnp.asarray(0.3 * rng.normal(size=x.shape), jnp.float32)
        return x

    return jax.tree_util.tree_map_with_path(perturb, params)


@functools.cache
def grad_fn(cfg: ModelConfig, runtime: RuntimeConfig = RuntimeConfig()):
    """The jitted (mean loss, gradient) on BATCH, one per config and runtime (compiled once, reused by every call)."""
    graphdef, _ = steps.split_model(nnx.eval_shape(lambda: TransformerLM(cfg, 0, runtime)))
    loss_fn = steps.make_loss_fn(graphdef)
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(p, BATCH)[0]))


# Set by .ci/run in a lane whose jax has a libtpu to install: the TPU topology tests then fail without it instead of
# skipping (on Python 3.12 the registry may serve no libtpu for the newest jax, and that lane says so).
REQUIRE_LIBTPU_ENV = "COUPLED_QK_JAX_REQUIRE_LIBTPU"


def skip_without_libtpu() -> None:
    """Skip the calling test where libtpu is not installed, or fail it where CI installed it for this jax."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("libtpu") is None:
        if os.environ.get(REQUIRE_LIBTPU_ENV):
            pytest.fail(f"libtpu is missing but {REQUIRE_LIBTPU_ENV} is set: pip install \"jax[tpu]==<jax version>\"")
        pytest.skip("libtpu is not installed (pip install \"jax[tpu]==<jax version>\")")
