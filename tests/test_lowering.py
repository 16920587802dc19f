"""The TPU and GPU programs, checked on CPU: jax.export lowers the full bf16 train step (forward, backward, AdamW) of
every QK transform and both scorings (COVERING_VARIANTS) for `tpu` and for `cuda`, and any lowering error fails the test. Tracing and lowering only (no XLA
compile), at tiny shapes: about a second per program on an idle machine.

With attention_impl=auto at T = 128 the TPU program must contain the Pallas flash kernel (Mosaic custom calls), so the
coupled variants keep a fused attention path there. In the CUDA program the variants with a mix (Differential
Attention), and float32 softmax, must contain the Pallas GPU (Triton) kernel; its custom call is not export-stable,
so it is allowed explicitly. bf16 softmax is lowered with the explicit kernel: cuDNN attention needs a GPU to be
lowered (jax checks the cuDNN version while tracing), so it is not checked here.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import export

from coupled_qk_jax import kernels
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import steps
from coupled_qk_jax.training.config import TrainConfig
from coupled_qk_jax.training.optimizer import make_optimizer

TRAIN = TrainConfig(lr=1e-3, steps=10, warmup_steps=2)
T = 128  # a multiple of the Pallas block


def triton_kernels() -> int:
    """The Pallas GPU kernels in a train step: jax's (jax <= 0.11) runs a forward, the backward's preprocessing and
    its dQ/dK/dV; tokamax's (jax 0.12 on) a forward and one backward (its preprocessing is plain XLA)."""
    return 3 if kernels.gpu.backend() == "jax" else 2


def triton_target() -> str:
    """The Pallas Triton custom call's name (exported by jax.experimental.pallas.triton from jax 0.11 on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as plgpu
    return getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


def cuda_target(mesh=None):
    """The context to trace a program for CUDA in on this CPU host. jax 0.12 lowers a Pallas Triton call only for a
    GPU it knows (it reads the compute capability): an abstract one, NVIDIA H100, on an abstract mesh of `mesh`'s
    axes (none without one). jax's own kernel (jax <= 0.11) needs none, so nothing is set there. Skips where this
    install has no Pallas GPU attention at all."""
    if kernels.gpu.backend() is None:
        pytest.skip(kernels.gpu.interpreted_gradient_missing())
    if kernels.gpu.backend() == "jax":
        return contextlib.nullcontext()
    gpu = kernels.gpu.abstract_gpu()
    if mesh is not None:
        gpu = mesh.abstract_mesh.update(abstract_device=gpu.abstract_device)
    return jax.sharding.use_abstract_mesh(gpu)


def exported_train_step(variant: str, platform: str, dtype: str = "bfloat16") -> export.Exported:
    cfg = ModelConfig(variant=variant, vocab_size=128, max_len=T, d_model=64, n_layers=1, n_heads=4, d_ff=128,
                      coupling_hidden=16, affine_hidden=16, dtype=dtype)
    model = nnx.eval_shape(lambda: TransformerLM(cfg, 0))
    graphdef, params = steps.split_model(model)
    tx = make_optimizer(params, TRAIN)
    state = jax.eval_shape(lambda p: steps.init_train_state(p, tx), params)
    batch = {"inputs": jax.ShapeDtypeStruct((2, T), jnp.int32), "targets": jax.ShapeDtypeStruct((2, T), jnp.int32)}
    step = jax.jit(steps.make_train_step(graphdef, tx))
    allow = [export.DisabledSafetyCheck.custom_call(triton_target())] if platform == "cuda" else []
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        return export.export(step, platforms=(platform,), disabled_checks=allow)(
            state, batch, jax.eval_shape(lambda: jax.random.key(0)))


# Every QK transform once and both scorings: the platform-specific lowering is the attention kernel's, chosen by the
# scoring and the dtype; a transform is plain jnp (its custom VJPs included) and lowers alike before either.
COVERING_VARIANTS = ("standard", "coupled_euler+differential", "coupled_leapfrog", "mlp_only+differential", "affine")


def test_covering_variants_cover_every_transform_and_scoring():
    cfgs = [ModelConfig(variant=v) for v in COVERING_VARIANTS]
    assert {c.qk_transform for c in cfgs} == {ModelConfig(variant=v).qk_transform for v in ALL_VARIANTS}
    assert {c.scoring for c in cfgs} == {ModelConfig(variant=v).scoring for v in ALL_VARIANTS}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_train_step_exports_for_every_variant(platform):
    for variant in COVERING_VARIANTS:
        exp = exported_train_step(variant, platform)
        assert exp.platforms == (platform,)
        text = exp.mlir_module()
        mosaic, triton = text.count("tpu_custom_call"), text.count(triton_target())
        if platform == "tpu":
            # the Pallas flash kernels: forward, and the backward's dK/dV and dQ
            assert mosaic >= 3 and triton == 0, (variant, mosaic, triton)
        elif variant.endswith("differential"):
            # the Pallas GPU kernels: forward, the backward's preprocessing and its dQ/dK/dV
            assert mosaic == 0 and triton >= triton_kernels(), (variant, triton)
        else:
            assert mosaic == 0 and triton == 0, (variant, triton)
    if platform == "cuda":  # float32 softmax: no cuDNN (bf16/fp16 only), the Pallas GPU kernel
        fp32 = exported_train_step("standard", "cuda", "float32").mlir_module()
        assert fp32.count(triton_target()) >= triton_kernels()


@pytest.mark.mesh
@pytest.mark.parametrize("variant,dtype", [("coupled_euler+differential", "bfloat16"), ("standard", "float32")])
def test_cuda_train_step_on_an_8_device_mesh_runs_its_triton_kernels_under_shard_map(variant, dtype):
    """The sharded train step lowered for CUDA on a (2, 2, 2) mesh of the lane's 8 CPU devices: XLA cannot
    partition a Triton custom call, so each must sit inside a manual (shard_map) region, where every GPU attends
    over its own batch rows and heads."""
    from coupled_qk_jax import aot, sharding as shd
    from coupled_qk_jax.training import run as run_lib

    cfg = ModelConfig(variant=variant, vocab_size=128, max_len=T, d_model=64, n_layers=1, n_heads=4, d_ff=128,
                      coupling_hidden=16, affine_hidden=16, dtype=dtype)
    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    layout = run_lib.state_layout(cfg, TRAIN, [0], mesh)
    step = steps.make_train_step(layout.graphdef, layout.tx)
    jitted = shd.jit_sharded(lambda state, batch: step(state, batch, jax.random.key(0)), mesh, layout.shardings,
                             donate=True)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), layout.abstract_state,
                         layout.shardings)
    tokens = jax.ShapeDtypeStruct((8, T), jnp.int32, sharding=shd.batch_sharding(mesh))
    with cuda_target(mesh):
        lowered = jitted.trace(state, {"inputs": tokens, "targets": tokens}).lower(lowering_platforms=("cuda",))
    inside, total = aot.kernel_calls(lowered, triton_target())
    assert total >= triton_kernels() and inside == total, (variant, inside, total)
