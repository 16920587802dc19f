"""The attention family inside the LM: equivalences, causality, DiffAttn, dtypes, parameter counts, bad configs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coupled_qk_jax import diagnostics
from coupled_qk_jax.attention import CausalSelfAttention, lambda_init
from coupled_qk_jax.config import ALL_VARIANTS, DYNAMICS_METHOD, ModelConfig, RuntimeConfig
from coupled_qk_jax.configs import lm
from coupled_qk_jax.model import TransformerLM, abstract_param_count, count_params

SMALL = dict(vocab_size=61, max_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64, coupling_hidden=8,
             affine_hidden=8)


def make(variant, **overrides):
    return TransformerLM(ModelConfig(variant=variant, **{**SMALL, **overrides}), seed=0)


def randomize_transforms(model, seed=0):
    """Give every coupling/affine output layer and Δt non-trivial values, so that the transforms really act."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, path))
        if any(tag in name for tag in ("coupling", "affine")) and ("w2" in name or "b2" in name):
            var.set_value(jnp.asarray(0.3 * rng.normal(size=var.get_value().shape), jnp.float32))
        if name.endswith("dt"):
            var.set_value(jnp.asarray(rng.uniform(0.1, 0.4, size=var.get_value().shape), jnp.float32))
    return model


def set_dt(model, value):
    for blk in model.blocks:
        blk.attn.dt[...] = jnp.full_like(blk.attn.dt[...], value)


TOKENS = jax.random.randint(jax.random.key(3), (2, 12), 0, SMALL["vocab_size"])


@pytest.mark.parametrize("transform", ["coupled_euler", "coupled_leapfrog", "mlp_only"])
@pytest.mark.parametrize("scoring", ["", "+differential"])
def test_dt_zero_gives_the_standard_layer(transform, scoring):
    base = make("standard" if not scoring else "differential")
    model = randomize_transforms(make(transform + scoring))
    set_dt(model, 0.0)
    np.testing.assert_allclose(model(TOKENS), base(TOKENS), rtol=1e-6, atol=1e-6)
    set_dt(model, 0.3)  # and with Δt ≠ 0 the transform changes the output
    assert float(jnp.max(jnp.abs(model(TOKENS) - base(TOKENS)))) > 1e-4


@pytest.mark.parametrize("scoring", ["", "+differential"])
def test_affine_at_identity_init_gives_the_standard_layer(scoring):
    base = make("standard" if not scoring else "differential")
    np.testing.assert_allclose(make("affine" + scoring)(TOKENS), base(TOKENS), rtol=1e-6, atol=1e-6)


def test_shared_coupling_scope_and_per_head_params():
    shared = make("coupled_euler", coupling_scope="shared")
    per_layer = make("coupled_euler")
    per_head = make("coupled_euler", per_head_params=True)
    mlp = 2 * (32 // 4) * 8 + 8 + 8  # w1 + b1 + w2 + b2 at head_dim 8, hidden 8
    base = count_params(make("standard"))
    assert count_params(per_layer) - base == 2 * (mlp + 4)
    assert count_params(shared) - base == mlp + 2 * 4
    assert count_params(per_head) - base == 2 * (4 * mlp + 4)
    for m in (shared, per_head):
        assert np.isfinite(np.asarray(randomize_transforms(m)(TOKENS))).all()


def test_shared_coupling_is_lent_not_stored_in_the_blocks():
    """The shared f keeps its one path (shared_coupling/...), the blocks hold no copy of it after any forward, and
    the layers really use it: changing it changes the logits, in the forward and in the diagnostic forward alike."""
    model = randomize_transforms(make("coupled_euler", coupling_scope="shared"))
    logits, _ = diagnostics.capture_layers(model, TOKENS)
    np.testing.assert_allclose(logits, model(TOKENS), rtol=1e-6, atol=1e-6)
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))]
    assert [p for p in paths if "coupling" in p] == [f"shared_coupling/{n}" for n in ("b1", "b2", "w1", "w2")]
    assert not nnx.state(model, nnx.Intermediate)  # the capture ran on a copy
    before = model(TOKENS)
    model.shared_coupling.b2[...] = model.shared_coupling.b2[...] + 1.0
    assert not np.allclose(model(TOKENS), before)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_causality(variant):
    model = randomize_transforms(make(variant, positions="rope" if "leapfrog" in variant else "learned"))
    t = 6
    changed = TOKENS.at[:, t + 1:].set((TOKENS[:, t + 1:] + 7) % SMALL["vocab_size"])
    a, b = model(TOKENS), model(changed)
    np.testing.assert_allclose(a[:, :t + 1], b[:, :t + 1], rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(a[:, t + 1:] - b[:, t + 1:]))) > 1e-4


def test_lambda_init_table():
    table = [0.200000, 0.355509, 0.470713, 0.556058, 0.619283, 0.666122, 0.700821, 0.726526]
    np.testing.assert_allclose([lambda_init(i) for i in range(8)], table, atol=1e-6)


def test_differential_parameter_count_identity():
    cfg = dict(SMALL, n_heads=8, d_model=64)
    std = CausalSelfAttention(ModelConfig(variant="standard", **cfg), 0, jax.random.key(0))
    diff = CausalSelfAttention(ModelConfig(variant="differential", **cfg), 0, jax.random.key(0))
    d = 64 // 8  # half-head dim = the 8-head baseline's head dim
    n_std, n_diff = count_params(std), count_params(diff)
    print(f"MHA(64, 8 heads) = {n_std}, DiffAttn(64, 4 heads) = {n_diff}")
    assert n_std == 4 * 64 * 64
    assert n_diff == n_std + 6 * d


def naive_diffattn(x, attn: CausalSelfAttention):
    """Float64 numpy reference of specs/diffattn.md §2, one head at a time."""
    p = {n: np.asarray(getattr(attn, n)[...], np.float64) for n in
         ("wq", "wk", "wv", "wo", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln_scale")}
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, dh = p["wq"].shape[1:]
    q, k, v = (np.einsum("btd,dhk->bthk", x, p[n]) for n in ("wq", "wk", "wv"))
    li = float(lambda_init(attn.layer_idx))
    lam = np.exp(p["lambda_q1"] @ p["lambda_k1"]) - np.exp(p["lambda_q2"] @ p["lambda_k2"]) + li
    mask = np.tril(np.ones((t, t), bool))
    out = np.zeros((b, t, h // 2, 2 * dh))
    for head in range(h // 2):
        a = []
        for half in range(2):
            s = np.einsum("bqd,bkd->bqk", q[:, :, 2 * head + half], k[:, :, 2 * head + half]) / np.sqrt(dh)
            s = np.where(mask, s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            a.append(e / e.sum(-1, keepdims=True))
        vh = v[:, :, 2 * head:2 * head + 2].reshape(b, t, 2 * dh)
        o = np.einsum("bqk,bke->bqe", a[0] - lam * a[1], vh)
        o = o / np.sqrt(np.mean(o ** 2, -1, keepdims=True) + 1e-5) * p["subln_scale"]
        out[:, :, head] = (1 - li) * o
    return np.einsum("bthk,hkd->btd", out.reshape(b, t, h, dh), p["wo"])


def test_differential_fast_forms_match_naive_reference():
    cfg = ModelConfig(variant="differential", **SMALL)
    attn = CausalSelfAttention(cfg, 3, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 10, cfg.d_model))
    ref = naive_diffattn(x, attn)
    np.testing.assert_allclose(attn(x), ref, rtol=1e-4, atol=1e-5)  # explicit form (CPU default)
    q = jnp.einsum("btd,dhk->bthk", x, attn.wq[...])
    k = jnp.einsum("btd,dhk->bthk", x, attn.wk[...])
    v = jnp.einsum("btd,dhk->bthk", x, attn.wv[...])
    virtual = attn.score(q, k, v, "xla")  # the fused kernel's form: 2H virtual heads, mix after the values
    explicit = attn.score(q, k, v, "explicit")
    np.testing.assert_allclose(virtual, explicit, rtol=1e-5, atol=1e-5)
    # λ at init: exactly λ_init with zero λ vectors
    for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        getattr(attn, n)[...] = jnp.zeros_like(getattr(attn, n)[...])
    assert float(attn.lambda_value()) == pytest.approx(float(lambda_init(3)), abs=1e-7)


def expected_standard_params(c: ModelConfig) -> int:
    """Hand count: embeddings + per layer (4 D² attention (+ 4 D biases), 2 D F + F + D MLP, 2 norms of D (RMSNorm)
    or 2 D (LayerNorm)) + final norm."""
    d, f = c.d_model, c.d_ff
    norm = d if c.norm == "rmsnorm" else 2 * d
    per_layer = 4 * d * d + (4 * d if c.attn_bias else 0) + 2 * d * f + f + d + 2 * norm
    return c.vocab_size * d + c.max_len * d + c.n_layers * per_layer + norm


def test_parameter_counts_per_scale():
    for scale in lm.SCALES:
        counts = {v: abstract_param_count(ModelConfig.from_dict(lm.get_config(f"{v},{scale}").model))
                  for v in ("standard", "coupled_euler", "coupled_leapfrog", "mlp_only", "affine", "differential")}
        cfg = ModelConfig.from_dict(lm.get_config(f"standard,{scale}").model)
        assert counts["standard"] == expected_standard_params(cfg)
        assert counts["coupled_euler"] == counts["coupled_leapfrog"] == counts["mlp_only"]
        extra = (counts["coupled_euler"] - counts["standard"]) / counts["standard"]
        print(f"{scale}: " + ", ".join(f"{v}={n:,}" for v, n in counts.items()) + f"; coupled extra {extra:.4%}")
        if scale == "60m":
            assert 0.0009 <= extra <= 0.0013
        if scale == "gpt2":  # GPT-2 124M's published count (tied head, 50257 tokens, 1024 positions)
            assert counts["standard"] == 124_439_808
    assert 0.9e6 < expected_standard_params(ModelConfig.from_dict(lm.get_config("standard,tiny").model)) < 1.5e6


@pytest.mark.parametrize("field,value,match", [
    ("variant", "coupled_rk4", "model.variant"),
    ("d_model", 30, "divisible"),
    ("n_steps", 0, "model.n_steps"),
    ("positions", "alibi", "model.positions"),
    ("dtype", "float64", "model.dtype"),
    ("dtype", "float16", "needs loss scaling"),
    ("dropout", 1.5, "model.dropout"),
])
def test_bad_config_raises_named_error(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**SMALL, field: value})


def test_bad_config_differential_head_split_and_unknown_field():
    with pytest.raises(ValueError, match="n_heads=3 must be even"):
        ModelConfig(variant="differential", **{**SMALL, "n_heads": 3, "d_model": 33})
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({"variant": "standard", "n_step": 2})
    with pytest.raises(ValueError, match="max_len"):
        make("standard")(jnp.zeros((1, 17), jnp.int32))


def test_capture_layers_returns_diagnostics_inputs():
    model = randomize_transforms(make("coupled_euler"))
    logits, layers = diagnostics.capture_layers(model, TOKENS)
    np.testing.assert_allclose(logits, model(TOKENS), rtol=1e-6, atol=1e-6)
    assert len(layers) == SMALL["n_layers"]
    attn = np.asarray(layers[0]["attn"])
    assert attn.shape == (2, 4, 12, 12)
    np.testing.assert_allclose(attn.sum(-1), 1.0, atol=1e-5)
    assert np.allclose(np.triu(attn, 1), 0.0)
    assert layers[0]["dt"].shape == (4,)


@pytest.mark.parametrize("variant", ["coupled_leapfrog", "coupled_euler+differential"])
def test_capture_layers_at_multi_block_length(variant):
    """At T = 130 the default explicit path runs 2 query blocks; the diagnostic forward runs that kernel and returns
    its weights."""
    model = randomize_transforms(make(variant, max_len=130))
    tokens = jax.random.randint(jax.random.key(5), (1, 130), 0, SMALL["vocab_size"])
    logits, layers = nnx.jit(diagnostics.capture_layers)(model, tokens)
    np.testing.assert_allclose(logits, nnx.jit(lambda m, t: m(t))(model, tokens), rtol=1e-5, atol=1e-5)
    aux = layers[1]
    q, k = (np.asarray(aux[n], np.float64) for n in ("q_after", "k_after"))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((130, 130), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    if variant.endswith("differential"):
        lam = float(model.blocks[1].attn.lambda_value())
        a = a[:, 0::2] - lam * a[:, 1::2]
    np.testing.assert_allclose(aux["attn"], a, rtol=1e-4, atol=1e-5)


def _checkpoints(jaxpr) -> int:
    """The number of jax.checkpoint (remat) equations in a jaxpr, nested ones included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in ("checkpoint", "remat2", "remat")  # its name differs across jax versions
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    count += _checkpoints(sub)
    return count


def test_unscanned_blocks_are_checkpointed_only_where_something_is_dropped():
    """remat="none" with nothing FSDP-gathered runs the Python loop's
    blocks without jax.checkpoint, whose reduce_precision markers cost fusions on CPU. Positive controls: remat
    "full" checkpoints every block, and so does "none" under a mesh with fsdp = 2 (its gathered weights are not
    saved)."""
    from coupled_qk_jax import sharding
    from coupled_qk_jax.training import steps

    def count(remat, fsdp=1):
        cfg = ModelConfig(variant="coupled_euler", vocab_size=32, max_len=16, d_model=16, n_layers=2, n_heads=2,
                          d_ff=32)
        graphdef, params = steps.split_model(TransformerLM(cfg, 0, RuntimeConfig(remat=remat)))
        tokens = jnp.zeros((2, 16), jnp.int32)
        loss = lambda p: steps.make_loss_fn(graphdef)(p, {"inputs": tokens, "targets": tokens})[0]
        # Auto axes, as sharding.make_mesh builds them: AbstractMesh's default became Explicit in jax 0.11, where
        # with_sharding_constraint asserts a sharding instead of setting one.
        mesh = jax.sharding.AbstractMesh((1, fsdp, 1), sharding.MESH_AXES,
                                         axis_types=(jax.sharding.AxisType.Auto,) * len(sharding.MESH_AXES))
        with jax.sharding.use_abstract_mesh(mesh):
            return _checkpoints(jax.make_jaxpr(loss)(params).jaxpr)

    assert count("none") == 0
    assert count("full") == 2
    assert count("none", fsdp=2) == 2


def test_classification_head_reads_the_last_real_tokens_final_hidden_state():
    """An identity: with the head set to the tied embedding's transpose (num_labels = V, bias 0), the head's output
    at each row's position is the language model's logits there; a gradient reaches the head through the loss."""
    from coupled_qk_jax.training.steps import make_loss_fn, split_model

    cfg = ModelConfig(vocab_size=61, max_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64, num_labels=61)
    graphdef, params = split_model(TransformerLM(cfg, 0))
    params["cls_head"] = params["embed"].T
    tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, 61)
    positions = jnp.array([15, 4, 9])
    batch = {"inputs": tokens, "positions": positions, "labels": jnp.array([3, -1, 7])}

    @jax.jit
    def run(params):
        model = nnx.merge(graphdef, params)
        grads = jax.grad(lambda p: make_loss_fn(graphdef)(p, batch)[0])(params)
        return model.classify(tokens, positions), model(tokens), grads["cls_head"]

    heads, logits, head_grad = run(params)
    np.testing.assert_allclose(np.asarray(heads), np.asarray(logits)[np.arange(3), np.asarray(positions)],
                               rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(head_grad).max()) > 0
    assert not hasattr(TransformerLM(ModelConfig(vocab_size=61, max_len=16, d_model=32, n_layers=1), 0), "cls_head")


def test_label_loss_cross_entropy_and_squared_error_by_hand():
    from coupled_qk_jax.training.steps import label_loss

    out = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [1.0, 2.0, 3.0]])
    total, count = label_loss(out, jnp.array([0, 2, -1]))  # the third row is padding
    ce = -(2.0 - math.log(math.exp(2.0) + 1.0 + math.exp(-1.0))) - (0.0 - math.log(2 * math.exp(0.5) + 1.0))
    assert float(total) == pytest.approx(ce, rel=1e-6) and int(count) == 2
    total, count = label_loss(jnp.array([[1.5], [0.0], [2.0]]), jnp.array([1.0, 0.5, jnp.nan]))
    assert float(total) == pytest.approx(0.5 ** 2 + 0.5 ** 2, rel=1e-6) and int(count) == 2
