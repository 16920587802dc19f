"""The TPU and GPU programs, checked on CPU: jax.export lowers the full bf16 train step (forward, backward, AdamW) of
every variant for `tpu` and for `cuda`, and any lowering error fails the test. Tracing and lowering only (no XLA
compile), at tiny shapes: about a second per program on an idle machine.

With attention_impl=auto at T = 128 the TPU program must contain the Pallas flash kernel (Mosaic custom calls), so the
coupled variants keep a fused attention path there. The CUDA program is lowered with the explicit kernel: cuDNN
attention needs a GPU to be lowered (jax checks the cuDNN version while tracing), so it is not checked here.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import export

from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import steps
from coupled_qk_jax.training.config import TrainConfig
from coupled_qk_jax.training.optimizer import make_optimizer

TRAIN = TrainConfig(lr=1e-3, steps=10, warmup_steps=2)
T = 128  # a multiple of the Pallas block


def exported_train_step(variant: str, platform: str) -> export.Exported:
    cfg = ModelConfig(variant=variant, vocab_size=128, max_len=T, d_model=64, n_layers=1, n_heads=4, d_ff=128,
                      coupling_hidden=16, affine_hidden=16, dtype="bfloat16")
    model = nnx.eval_shape(lambda: TransformerLM(cfg, 0))
    graphdef, params = steps.split_model(model)
    tx = make_optimizer(params, TRAIN)
    state = jax.eval_shape(lambda p: steps.init_train_state(p, tx), params)
    batch = {"inputs": jax.ShapeDtypeStruct((2, T), jnp.int32), "targets": jax.ShapeDtypeStruct((2, T), jnp.int32)}
    step = jax.jit(steps.make_train_step(graphdef, tx))
    return export.export(step, platforms=(platform,))(state, batch, jax.eval_shape(lambda: jax.random.key(0)))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_train_step_exports_for_every_variant(platform):
    for variant in ALL_VARIANTS:
        exp = exported_train_step(variant, platform)
        assert exp.platforms == (platform,)
        text = exp.mlir_module()
        mosaic = text.count("tpu_custom_call")
        if platform == "tpu":
            # the Pallas flash kernels: forward, and the backward's dK/dV and dQ
            assert mosaic >= 3, (variant, mosaic)
        else:
            assert mosaic == 0, variant
