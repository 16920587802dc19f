"""The one causal attention kernel (kernels.attend) against float64 numpy, at sequence lengths that use
the default multi-block explicit path; the fused forms (XLA, Pallas TPU flash in interpret mode) against it; and the
kernel choice per platform."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coupled_qk_jax import attention, kernels
from coupled_qk_jax.kernels import auto_chunks, choose_implementation
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig, RuntimeConfig

B, H, D = 2, 4, 8
causal_attention = jax.jit(kernels.attend, static_argnames=("impl", "n_chunks", "return_weights"))


def qkv(t, g=H, dv=D, seed=0, b=B, h=H):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, h, D))
    k = jax.random.normal(ks[1], (b, t, h, D))
    v = jax.random.normal(ks[2], (b, t, g, dv))
    return q, k, v


def np_attention(q, k, v, mix=None):
    """float64 reference: per-head causal softmax, mixed within value groups, times the group's value."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    t, h, d = q.shape[1:]
    g = v.shape[2]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    w = np.ones(h) if mix is None else np.asarray(mix, np.float64)
    mixed = (a * w[:, None, None]).reshape(a.shape[0], g, h // g, t, t).sum(2)  # [B, G, T, T]
    return np.einsum("bgqk,bkgd->bqgd", mixed, v), mixed


MIX = jnp.array([1.0, -0.4, 1.0, -0.7])  # differential attention's [1, −λ] per pair of half-heads


@pytest.mark.parametrize("t", [130, 192])
@pytest.mark.parametrize("differential", [False, True])
def test_explicit_multi_block_matches_numpy(t, differential):
    assert auto_chunks(t) >= 2  # the default path runs several query blocks at these lengths
    g, dv, mix = (H // 2, 2 * D, MIX) if differential else (H, D, None)
    q, k, v = qkv(t, g, dv)
    ref, ref_w = np_attention(q, k, v, mix)
    out = causal_attention(q, k, v, mix)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    out_w, weights = causal_attention(q, k, v, mix, return_weights=True)  # the diagnostics' collect path
    np.testing.assert_allclose(out_w, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=1e-6)
    # a block count that does not divide T
    np.testing.assert_allclose(causal_attention(q, k, v, mix, n_chunks=7), ref, rtol=2e-5, atol=2e-5)


def full_square(q, k, v, mix):
    """An fp32 full-square implementation (jax.nn.softmax over the masked T×T scores) as the gradient reference."""
    t, h, d = q.shape[1:]
    g = v.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    a = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf), axis=-1)
    a = (a * mix[:, None, None]).reshape(a.shape[0], g, h // g, t, t).sum(2)
    return jnp.einsum("bgqk,bkgd->bqgd", a, v)


def test_explicit_multi_block_gradients():
    q, k, v = qkv(130, H // 2, 2 * D, seed=1)
    cot = jax.random.normal(jax.random.key(9), (B, 130, H // 2, 2 * D))

    def loss(fn):
        return jax.jit(jax.grad(lambda q, k, v, mix: jnp.sum(fn(q, k, v, mix) * cot), argnums=(0, 1, 2, 3)))

    got = loss(kernels.attend)(q, k, v, MIX)
    ref = loss(full_square)(q, k, v, MIX)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_fused_xla_form_matches_explicit():
    for g, dv, mix in ((H, D, None), (H // 2, 2 * D, MIX)):
        q, k, v = qkv(130, g, dv, seed=2)
        np.testing.assert_allclose(causal_attention(q, k, v, mix, impl="xla"), causal_attention(q, k, v, mix),
                                   rtol=1e-5, atol=1e-5)


def test_pallas_tpu_flash_in_interpret_mode_matches_explicit(monkeypatch):
    """The TPU kernel itself, run by Pallas' TPU interpreter on CPU: forward and gradients of one differential head
    (the mix over 2 half-heads, as 4 virtual heads of the plain softmax kernel) at T = 128 (one Pallas block)."""
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setattr(kernels.tpu, "PREFERRED", "flash")  # splash: the mesh test below
    q, k, v = qkv(128, 1, 2 * D, seed=3, b=1, h=2)
    mix = MIX[:2]
    cot = jax.random.normal(jax.random.key(8), (1, 128, 1, 2 * D))

    def loss(impl):
        return lambda q, k, v, mix: jnp.sum(kernels.attend(q, k, v, mix, impl=impl) * cot)

    with pltpu.force_tpu_interpret_mode():  # jitted: the interpreter's op-by-op dispatch costs more than compiling
        out, grads = jax.jit(jax.value_and_grad(loss("pallas"), argnums=(0, 1, 2, 3)))(q, k, v, mix)
    assert np.isfinite(float(out))
    np.testing.assert_allclose(out, np.sum(np_attention(q, k, v, mix)[0] * np.asarray(cot)), rtol=1e-4)
    for a, b in zip(grads, jax.jit(jax.grad(loss("explicit"), argnums=(0, 1, 2, 3)))(q, k, v, mix)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("requested,dtype,head_dim,seq,platform,expected", [
    ("auto", jnp.bfloat16, 64, 256, "gpu", "cudnn"),
    ("auto", jnp.float32, 64, 256, "gpu", "pallas"),   # cuDNN attention needs bf16/fp16: the Pallas GPU kernel
    ("auto", jnp.float32, 64, 200, "gpu", "explicit"),  # T not in the Pallas GPU kernel's blocks of 64
    ("auto", jnp.bfloat16, 160, 256, "gpu", "explicit"),  # head dim over 128
    ("auto", jnp.bfloat16, 64, 256, "tpu", "pallas"),
    ("auto", jnp.float32, 64, 384, "tpu", "pallas"),
    ("auto", jnp.bfloat16, 64, 200, "tpu", "explicit"),  # T not a multiple of the 128 Pallas block
    ("auto", jnp.bfloat16, 64, 256, "cpu", "explicit"),
    ("xla", jnp.bfloat16, 64, 256, "tpu", "xla"),
    ("pallas", jnp.bfloat16, 64, 256, "tpu", "pallas"),
])
def test_choose_implementation(requested, dtype, head_dim, seq, platform, expected):
    assert choose_implementation(requested, dtype, head_dim, seq, platform) == expected


@pytest.mark.parametrize("requested,dtype,head_dim,seq,expected", [
    ("auto", jnp.bfloat16, 64, 256, "pallas"),  # cuDNN returns bf16 per-head outputs: the Pallas GPU kernel
    ("auto", jnp.float32, 32, 32, "pallas"),    # one power-of-two block
    ("auto", jnp.bfloat16, 64, 96, "explicit"),  # T neither whole blocks of 64 nor one power-of-two block
    ("auto", jnp.bfloat16, 8, 256, "explicit"),  # head dim under Triton's 16
    ("pallas", jnp.bfloat16, 64, 256, "pallas"),
])
def test_choose_implementation_on_gpu_with_a_mix(requested, dtype, head_dim, seq, expected):
    """Differential Attention on GPU gets the fused Pallas GPU kernel instead of the explicit path."""
    assert choose_implementation(requested, dtype, head_dim, seq, "gpu", mix=True) == expected


def test_unavailable_kernel_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="falling back to 'explicit'"):
        assert choose_implementation("cudnn", jnp.bfloat16, 64, 256, "cpu") == "explicit"
    with pytest.warns(UserWarning, match="falling back"):
        assert choose_implementation("pallas", jnp.bfloat16, 64, 100, "tpu") == "explicit"
    with pytest.warns(UserWarning, match=r"with a mix\); falling back"):
        assert choose_implementation("cudnn", jnp.bfloat16, 64, 256, "gpu", mix=True) == "explicit"
    with pytest.raises(ValueError, match="mix must have shape"):
        kernels.attend(jnp.zeros((1, 8, H, D)), jnp.zeros((1, 8, H, D)), jnp.zeros((1, 8, H // 2, D)),
                                   jnp.ones(3))


def test_auto_on_cpu_is_the_explicit_kernel_with_no_tpu_branch_left():
    """impl='auto' at T = 128 picks per lowering platform (platform_dependent): the CPU program must be the explicit
    kernel alone, the Pallas TPU branch dropped and no conditional left."""
    q, k, v = qkv(128, seed=4)
    auto = jax.jit(lambda q, k, v: kernels.attend(q, k, v, impl="auto"))
    hlo = auto.lower(q, k, v).compile().as_text()
    assert not re.search(r"\bconditional\(", hlo) and "tpu_custom_call" not in hlo
    np.testing.assert_allclose(auto(q, k, v), np_attention(q, k, v)[0], rtol=2e-5, atol=2e-5)


MIX_VARIANTS = [v for v in ALL_VARIANTS if v.endswith("differential")]


def test_pallas_gpu_kernel_in_interpret_mode_matches_explicit_with_and_without_a_mix(monkeypatch):
    """runtime.attention_impl="pallas" as on a GPU (the Pallas GPU kernel, run by Pallas' interpreter on
    CPU): a float32 attention layer's output and its gradients (input and every parameter, off init so that the
    QK transform acts) equal the explicit path's, with a mix and for float32 softmax (standard);
    T = 32 (one block of the kernel), head dim 16. Positive control: the program holds the interpreted kernels
    (while loops over their grids), which the explicit one lacks."""
    from flax import nnx

    if why := kernels.gpu.interpreted_gradient_missing():
        pytest.skip(why)
    x = jax.random.normal(jax.random.key(0), (1, 32, 32))
    cot = jax.random.normal(jax.random.key(1), (1, 32, 32))
    # The kernel sees the mix and float32 q, k, v; which transform made q and k only changes the values (all five
    # transforms lower alike, test_lowering.py): standard (no mix), the plain mix, and the mix behind leapfrog's
    # custom VJP.
    variants = ["standard", "differential", "coupled_leapfrog+differential"]
    assert set(variants[1:]) <= set(MIX_VARIANTS)

    def layer_grads(impl):
        def one(variant):
            cfg = ModelConfig(variant=variant, vocab_size=61, max_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=32,
                              coupling_hidden=8, affine_hidden=8, n_steps=2)
            layer = attention.CausalSelfAttention(cfg, 0, jax.random.key(0), RuntimeConfig(attention_impl=impl))
            rng = np.random.default_rng(0)
            for _, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
                var.set_value(var.get_value() + jnp.asarray(0.1 * rng.normal(size=var.get_value().shape),
                                                            jnp.float32))
            return nnx.value_and_grad(lambda layer, x: jnp.sum(layer(x) * cot), argnums=(0, 1))(layer, x)

        return jax.jit(lambda: [one(v) for v in variants])

    monkeypatch.setattr(kernels.gpu, "INTERPRET", True)
    fused, explicit = layer_grads("pallas"), layer_grads("explicit")
    assert (fused.lower().as_text().count("stablehlo.while")
            >= explicit.lower().as_text().count("stablehlo.while") + 3 * len(variants))  # kernel fwd, dq, dk/dv
    for variant, (lg, gg), (lw, gw) in zip(variants, fused(), explicit()):
        np.testing.assert_allclose(lg, lw, rtol=1e-5, err_msg=variant)
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(gg)[0], jax.tree.leaves(gw)):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4 * float(jnp.max(jnp.abs(w))),
                                       err_msg=f"{variant} {jax.tree_util.keystr(path)}")


@pytest.mark.skipif(kernels.gpu.backend() != "tokamax", reason="tokamax's kernel serves only where jax has no "
                    "Pallas GPU attention of its own (jax 0.12 on), and is installed (the `gpu` extra)")
def test_tokamax_gpu_kernel_forward_in_interpret_mode_matches_explicit(monkeypatch):
    """jax 0.12 on: tokamax's Pallas Triton kernel, in Pallas' interpreter on CPU (its forward: the interpreter cannot
    run its causal backward, interpreted_gradient_missing), equals the explicit path with a mix (float32 per-head
    outputs from bf16 q, k, v) and without one, at T = 32 (one block, the least tokamax's backward takes here) and
    T = 128 (two blocks), head dim 16."""
    monkeypatch.setattr(kernels.gpu, "INTERPRET", True)
    for t in (32, 128):
        ks = jax.random.split(jax.random.key(5), 4)
        q, k, v = (jax.random.normal(key, (2, t, 4, 16)).astype(jnp.bfloat16) for key in ks[:3])
        v_pairs = jax.random.normal(ks[3], (2, t, 2, 32)).astype(jnp.bfloat16)
        for v_, mix in ((v_pairs, MIX), (v, None)):
            assert choose_implementation("pallas", q.dtype, q.shape[-1], t, "gpu", mix=mix is not None) == "pallas"
            got = jax.jit(lambda q, k, v, mix: kernels.attend(q, k, v, mix, impl="pallas"))(q, k, v_, mix)
            want = kernels.attend(q, k, v_, mix, impl="explicit")
            assert got.dtype == (jnp.float32 if mix is not None else jnp.bfloat16)
            tol = 2e-5 if mix is not None else 1e-2
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol,
                                       err_msg=f"T={t} mix={mix is not None}")


@pytest.mark.mesh
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_fused_kernels_under_shard_map_on_an_8_device_mesh_match_the_float64_reference(monkeypatch, kernel):
    """The fused kernels as a pod runs them: under shard_map on a (2, 2, 2) mesh of 8 CPU devices (batch rows over
    data x fsdp, heads over tensor), in Pallas' interpreter (splash for TPU, Triton's for GPU). Loss and gradients
    against float64 numpy, and the gradients against the explicit path's on the same mesh, for standard attention,
    coupled Euler dynamics in front of it (the gradient flows through the shard_map into the dynamics), and
    Differential Attention's mix (a pair's two half-heads on one device)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from coupled_qk_jax import dynamics, sharding as shd

    if kernel == "gpu" and (why := kernels.gpu.interpreted_gradient_missing()):
        pytest.skip(why)
    monkeypatch.setattr(kernels.tpu, "INTERPRET", True)
    monkeypatch.setattr(kernels.gpu, "INTERPRET", kernel == "gpu")
    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    heads = NamedSharding(mesh, P(shd.BATCH_AXES, None, "tensor", None))
    t, d = 128, 16
    ks = jax.random.split(jax.random.key(7), 6)
    q, k = (jax.random.normal(key, (4, t, H, d)) for key in ks[:2])
    v_plain, v_pairs = jax.random.normal(ks[2], (4, t, H, d)), jax.random.normal(ks[3], (4, t, H // 2, 2 * d))
    mlp = {"w1": 0.3 * jax.random.normal(ks[4], (d, 8)), "b1": jnp.zeros(8),
           "w2": 0.3 * jax.random.normal(ks[5], (8, d)), "b2": jnp.zeros(d)}
    dt = jnp.full((H,), 0.1)
    cases = {"standard": (v_plain, None, False), "coupled_euler": (v_plain, None, True),
             "differential": (v_pairs, MIX, False)}
    for name, (v, mix, coupled) in cases.items():
        cot = jax.random.normal(jax.random.key(9), v.shape)
        args = [jax.device_put(a, heads) for a in (q, k, v, cot)]

        def loss(impl, mix=mix, coupled=coupled):
            def fn(q, k, v, cot):
                if coupled:
                    q, k = dynamics.evolve_heads_batched(q, k, dt, mlp, 1, "euler")
                return jnp.sum(kernels.attend(q, k, v, mix, impl) * cot)
            return jax.jit(jax.value_and_grad(shd.under_mesh(fn, mesh), argnums=(0, 1, 2)))

        fused = loss("pallas")
        assert fused.lower(*args).as_text().count("sdy.manual_computation") >= 2, name  # forward, backward
        (value, grads), (_, ref_grads) = fused(*args), loss("explicit")(*args)
        q_in, k_in = (q, k) if not coupled else dynamics.evolve_heads_batched(q, k, dt, mlp, 1, "euler")
        expected = np.sum(np_attention(q_in, k_in, v, mix)[0] * np.asarray(cot, np.float64))
        np.testing.assert_allclose(value, expected, rtol=1e-4, err_msg=name)
        for got, want in zip(grads, ref_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)
