"""The pod path, compiled for real: libtpu's TPU compiler (Mosaic included), run on this CPU host for the devices of a
real v5e 2x2 topology (jax.experimental.topologies), compiles the project's sharded steps on multi-chip meshes.

Every variant's train step compiles, in bf16 or float32, on one of the meshes (4,1,1), (2,1,2) and (1,2,2), turned so
that every mesh meets both dtypes and both scorings; the eval and decode steps compile for two variants. Each program must hold its Pallas
kernels (Mosaic custom calls: forward, and the backward's dQ and dK/dV), every one of them inside a manual
(shard_map) region: XLA cannot partition a Mosaic kernel, and before the kernels ran under shard_map no multi-chip
program compiled at all. Shapes are tiny (one layer, d_model 64, T = 128, one kernel block) so that a compile costs
a few seconds.

libtpu is an optional extra (`pip install "jax[tpu]==<jax version>"`); without it these tests skip, except in a CI lane
that installed it for its jax (COUPLED_QK_JAX_REQUIRE_LIBTPU set by .ci/run), where a missing libtpu fails them.
"""

from __future__ import annotations

import pytest

from coupled_qk_jax import aot
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training.config import DataConfig, MeshConfig, RunConfig, TrainConfig

from programs import skip_without_libtpu

T = 128
MESHES = ((4, 1, 1), (2, 1, 2), (1, 2, 2))
DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def v5e_2x2():
    skip_without_libtpu()
    devices = aot.topology_devices("v5e:2x2")
    assert len(devices) == 4 and {d.platform for d in devices} == {"tpu"}
    return devices


def run_config(variant: str, dtype: str, mesh: tuple[int, int, int], n_heads: int = 4) -> RunConfig:
    model = ModelConfig(variant=variant, vocab_size=128, max_len=T, d_model=64, n_layers=1, n_heads=n_heads,
                        d_ff=128, coupling_hidden=16, affine_hidden=16, dtype=dtype)
    return RunConfig(model=model, data=DataConfig(seq_len=T), train=TrainConfig(batch_size=8, steps=10,
                                                                               warmup_steps=2),
                     mesh=MeshConfig(*mesh))


# Each variant once; the dtype alternates and the mesh turns with the variant, so that every mesh meets both dtypes,
# both scorings and several QK transforms (i mod 2 and i mod 3 together run through all six mesh-dtype pairs).
CASES = [(variant, DTYPES[i % len(DTYPES)], MESHES[i % len(MESHES)]) for i, variant in enumerate(ALL_VARIANTS)]


def test_cases_cover_every_variant_and_every_mesh_with_both_dtypes_and_scorings():
    assert sorted(v for v, _, _ in CASES) == sorted(ALL_VARIANTS)
    for mesh in MESHES:
        here = [(v, d) for v, d, m in CASES if m == mesh]
        assert {d for _, d in here} == set(DTYPES)
        assert {v.endswith("differential") for v, _ in here} == {True, False}
    for dtype in DTYPES:
        assert {v.endswith("differential") for v, d, _ in CASES if d == dtype} == {True, False}


@pytest.mark.parametrize("variant,dtype,mesh", CASES, ids=[f"{v}-{d}-{'x'.join(map(str, m))}" for v, d, m in CASES])
def test_train_step_compiles_for_a_v5e_2x2_with_its_kernels_under_shard_map(v5e_2x2, variant, dtype, mesh):
    result = aot.compile_steps(run_config(variant, dtype, mesh), v5e_2x2, steps=("train",))
    (train,) = result["steps"]
    assert train.kernels >= 3, (variant, train.kernels)  # forward, dQ, dK/dV
    assert train.kernels_in_manual == train.kernels
    # The gradients of the replicated weights are summed over the data-parallel chips: the program really is
    # partitioned over the mesh.
    assert train.collectives["all-reduce"] >= 1
    assert 0 < train.total_bytes < aot.hbm_bytes("v5e:2x2")


@pytest.mark.parametrize("variant,mesh", [("standard", (2, 1, 2)), ("coupled_euler+differential", (1, 2, 2))])
def test_eval_and_decode_steps_compile(v5e_2x2, variant, mesh):
    result = aot.compile_steps(run_config(variant, "bfloat16", mesh), v5e_2x2, steps=("eval", "decode"))
    evaluate, decode = result["steps"]
    assert evaluate.kernels >= 1 and evaluate.kernels_in_manual == evaluate.kernels
    # Cached decoding scores one new token against the cache: the explicit path, no kernel.
    assert decode.kernels == 0 and decode.total_bytes > 0


def test_a_tensor_axis_that_would_split_a_differential_pair_is_one_line(v5e_2x2):
    # Two half-heads, one pair: tensor=2 would put its halves on two chips.
    with pytest.raises(UserError, match=r"mesh.tensor=2 would split Differential Attention's 1 head pairs"):
        aot.compile_steps(run_config("differential", "bfloat16", (2, 1, 2), n_heads=2), v5e_2x2, steps=("train",))


def test_a_config_that_does_not_fit_names_the_overshoot_and_the_levers():
    report = aot.StepReport("train", 1.0, 10 * aot.GIB, 8 * aot.GIB, 10 * aot.GIB, 10 * aot.GIB, 0, 0.0, 0.0, None,
                            {}, 0, 0)
    assert report.total_bytes == 18 * aot.GIB  # outputs aliased to their inputs take no memory of their own
    message = aot.fit_error(report, aot.hbm_bytes("v5e:4x4"), "v5e")
    assert "18.00 GiB per chip, 2.00 GiB more than a v5e chip's 16 GiB" in message
    assert "fsdp" in message and "remat" in message and "batch_size" in message
    assert aot.fit_error(report, aot.hbm_bytes("v5p:4x4x4"), "v5p") is None
