"""Causal multi-head attention with a pluggable QK transform and scoring rule (Flax NNX).

The layer, :class:`CausalSelfAttention`, comes first with its maths; then the parameter modules of the QK transforms
(:class:`CouplingMLP`, :class:`AffineCouplingNets`); then the pure functions they use (norm, RoPE, DiffAttn's λ_init,
parameter initialisers).

Parameters carry logical axis names (metadata `logical_axes`) that `sharding.py` maps to mesh axes. Precision follows
precision.py: softmax, λ, norms and biases in float32, matmuls in the compute dtype.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from coupled_qk_jax import dynamics, invertible
from coupled_qk_jax.config import DYNAMICS_METHOD, ModelConfig, RuntimeConfig
from coupled_qk_jax.kernels import attend, choose_implementation
from coupled_qk_jax.precision import add_bias

Array = jax.Array

# The per-layer values a diagnostic forward keeps (nnx.Intermediate, see CausalSelfAttention.capture_intermediates).
INTERMEDIATES = ("q_before", "k_before", "q_after", "k_after", "attn", "dt")


class CausalSelfAttention(nnx.Module):
    """One causal attention layer, x [B, T, d_model] -> y [B, T, d_model]:

        q, k, v = x W_Q, x W_K, x W_V                 [B, T, H, d_head]
        (q, k) <- QK transform                      none | coupled dynamics (dynamics.py) | affine coupling
                                                    (invertible.py), on each token's own (q, k) pair
        (q, k) <- RoPE(q), RoPE(k)                  only with positions="rope": the transform runs *before* the rotation
        o      =  softmax(q kᵀ/√d_head + causal) v  or, differential scoring (specs/diffattn.md), per pair of
                                                    half-heads RMSNorm((A1 − λ·A2) [v1 v2]) · (1 − λ_init)
        y      =  o W_O

    The kernel that computes o (cuDNN, Pallas, explicit query blocks) is chosen by kernels.attend from ``runtime``,
    which says how the layer is computed, never what.

    With differential scoring the H = n_heads projections are read as H/2 differential heads, each made of two
    half-heads (q1, k1), (q2, k2) of the baseline head dim and a value of twice that width; the QK transform then
    runs on the H half-heads, so a coupled+differential layer has exactly the coupled layer's parameters plus
    DiffAttn's λ vectors and head-norm scale. λ = exp(<λq1,λk1>) − exp(<λq2,λk2>) + λ_init(depth).

    The coupling MLP f of the dynamics is ``self.coupling``: the layer's own (model.coupling_scope="layer"), or,
    under "shared", the model's one MLP, which the model lends to the layer where it runs it
    (TransformerLM.lend_shared_coupling) rather than storing it here, so that its params keep their one path.

    ``capture_intermediates`` (off; TransformerLM.capturing turns it on in a diagnostic copy) makes the layer run
    the explicit kernel, which also yields the attention weights, and sow (nnx.sow, nnx.Intermediate) the
    values named in INTERMEDIATES: q, k before and after the transform [B, T, H, d_head], the weights (softmax
    A [B, H, T, T], or A1 − λ·A2 [B, H/2, T, T]) and Δt [H].
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, key: Array, runtime: RuntimeConfig = RuntimeConfig()):
        self.cfg, self.runtime = cfg, runtime
        self.capture_intermediates = False
        d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        path = f"layers/{layer_idx}/attn"
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = normal_param(key, path + "/wq", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wk = normal_param(key, path + "/wk", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wv = normal_param(key, path + "/wv", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wo = normal_param(key, path + "/wo", (h, dh, d), out_std, ("heads", "head_dim", "embed"))
        if cfg.attn_bias:  # GPT-2's projections carry biases (checkpoints imported by convert.py)
            for name in ("bq", "bk", "bv"):
                setattr(self, name, const_param((h, dh), 0.0, ("heads", "head_dim")))
            self.bo = const_param((d,), 0.0, ("embed",))

        transform = cfg.qk_transform
        if transform in DYNAMICS_METHOD:
            # Δt per head (per half-head under differential scoring: H values either way).
            self.dt = const_param((h,), cfg.dt_init, ("heads",))
            if cfg.coupling_scope == "layer":
                self.coupling = CouplingMLP(cfg, key, path + "/coupling")
        elif transform == "affine":
            self.affine = AffineCouplingNets(cfg, key, path + "/affine")

        if cfg.scoring == "differential":
            # λ_init depends on the depth: the layer index is kept (a Python int, not a parameter) and can be
            # overridden per call, which is how a scanned stack of layers (runtime.scan_layers) passes its index.
            self.layer_idx = layer_idx
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, normal_param(key, f"{path}/{name}", (dh,), 0.1, ("head_dim",)))
            self.subln_scale = const_param((2 * dh,), 1.0, ("head_dim",))

    # -- forward ----------------------------------------------------------------------------------------------------
    def __call__(self, x: Array, layer_idx: int | Array | None = None) -> Array:
        """x: [B, T, d_model] in the compute dtype -> [B, T, d_model]. layer_idx: this layer's depth (default: the
        index it was built with; a scanned stack passes its own, traced).

        Activations are [B, T, H, d] from the projections on (the layout jax.nn.dot_product_attention and cuDNN
        take)."""
        cfg, capture = self.cfg, self.capture_intermediates
        impl = "explicit" if capture else self.runtime.attention_impl
        if impl not in ("auto", "explicit"):  # a named kernel: honoured where it can run (choose_implementation)
            impl = choose_implementation(impl, x.dtype, cfg.head_dim, x.shape[1], mix=cfg.scoring == "differential")
        q, k, v = self.project_qkv(x)
        if capture:
            self.sow_intermediates(q_before=q, k_before=k)
        q, k = self.transform_qk(q, k)
        if capture:
            self.sow_intermediates(q_after=q, k_after=k)
        if cfg.positions == "rope":
            q, k = apply_rope(q, cfg.rope_base), apply_rope(k, cfg.rope_base)
        o = self.score(q, k, v, impl, return_weights=capture, depth=layer_idx)
        if capture:
            o, weights = o
            self.sow_intermediates(attn=weights, **({"dt": self.dt[...]} if hasattr(self, "dt") else {}))
        return self.project_out(o)

    def sow_intermediates(self, **values: Array) -> None:
        """Keep `values` as nnx.Intermediate variables of this layer, replacing those of an earlier forward (one
        forward's values per layer; read with nnx.pop(model, nnx.Intermediate))."""
        for name, value in values.items():
            self.sow(nnx.Intermediate, name, value, reduce_fn=lambda _, new: new, init_fn=lambda: None)

    # -- cached decoding (generate.py) ------------------------------------------------------------------------------
    def decode(self, x: Array, cache: dict[str, Array], positions: Array,
               layer_idx: int | Array | None = None) -> tuple[Array, dict[str, Array]]:
        """The layer on T new tokens with a KV cache: x [B, T, d_model] at absolute `positions` [B, T] (consecutive
        in each row) -> (y [B, T, d_model], the updated cache).

        cache: {"k", "v"}, each [B, S, H, d_head] in the compute dtype. It holds keys *after* the QK transform (and
        after RoPE): every transform acts on each token's own (q, k), so a token's evolved key never changes once
        computed. The new keys and values are written at slots positions[b, 0] + 0..T-1 and query (b, t) sees slots
        <= positions[b, t]. Slots above a row's position may hold stale entries (a shorter prompt's padding); they
        stay masked until that row overwrites them.
        """
        cfg = self.cfg
        q, k, v = self.project_qkv(x)
        q, k = self.transform_qk(q, k)
        if cfg.positions == "rope":  # the transform runs before the rotation, as in __call__
            q = apply_rope(q, cfg.rope_base, positions=positions)
            k = apply_rope(k, cfg.rope_base, positions=positions)
        write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), at, axis=0))
        cache = {"k": write(cache["k"], k, positions[:, 0]), "v": write(cache["v"], v, positions[:, 0])}
        visible = jnp.arange(cache["k"].shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
        o = self.score(q, cache["k"], cache["v"], "explicit", visible=visible, depth=layer_idx)
        return self.project_out(o), cache

    # -- projections ------------------------------------------------------------------------------------------------
    def project_qkv(self, x: Array) -> tuple[Array, Array, Array]:
        """x [B, T, d_model] in the compute dtype -> q, k, v [B, T, H, d_head] (plus their biases with attn_bias)."""
        dtype = x.dtype
        out = []
        for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")):
            y = jnp.einsum("btd,dhk->bthk", x, getattr(self, w)[...].astype(dtype))
            out.append(add_bias(y, getattr(self, b)[...]) if self.cfg.attn_bias else y)
        return tuple(out)

    def project_out(self, o: Array) -> Array:
        """The heads' outputs o [B, T, H, d_head] -> [B, T, d_model] through W_O (plus its bias with attn_bias)."""
        y = jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(o.dtype))
        return add_bias(y, self.bo[...]) if self.cfg.attn_bias else y

    # -- the QK transform -------------------------------------------------------------------------------------------
    def transform_qk(self, q: Array, k: Array) -> tuple[Array, Array]:
        """(q, k) [B, T, H, d] -> the transformed pair, same shape."""
        cfg = self.cfg
        transform = cfg.qk_transform
        if transform in DYNAMICS_METHOD:
            mlp = getattr(self, "coupling", None)
            if mlp is None:
                raise ValueError("model.coupling_scope='shared': run the layer through its model, which lends it the "
                                 "shared coupling MLP (TransformerLM.lend_shared_coupling)")
            # Δt stays float32: dynamics.py forms Δt·k in float32, since bf16 Δt gradients are far off.
            return dynamics.evolve_heads_batched(q, k, self.dt[...], mlp.params(q.dtype), cfg.n_steps,
                                                 DYNAMICS_METHOD[transform], unroll=self.runtime.scan_unroll,
                                                 per_head_params=cfg.per_head_params,
                                                 backward=self.runtime.dynamics_backward)
        if transform == "affine":
            return invertible.affine_forward(self.affine.params(q.dtype), q, k)
        return q, k

    # -- scoring ----------------------------------------------------------------------------------------------------
    def score(self, q: Array, k: Array, v: Array, impl: str, return_weights: bool = False,
              visible: Array | None = None, depth: int | Array | None = None):
        """q, k, v [B, T, H, d] -> the per-head output [B, T, H, d] before W_O (and the attention weights: softmax
        A [B, H, T, T], or A1 − λ·A2 [B, H/2, T, T] under differential scoring, with return_weights). With
        `visible` [B, T, S], k and v are a KV cache [B, S, H, d] (kernels.attend).

        Differential scoring reads the H heads as H/2 pairs of half-heads; each pair shares the value of width 2d
        made of both halves' values, and mixes its two attention matrices as A1 − λ·A2 (specs/diffattn.md). `depth`:
        the layer index for λ_init (default: the one the layer was built with)."""
        chunks = self.runtime.attention_chunks
        if self.cfg.scoring != "differential":
            return attend(q, k, v, None, impl, chunks, return_weights, visible)
        b, t, h, dh = q.shape
        depth = self.layer_idx if depth is None else depth
        lam = self.lambda_value(depth)
        mix = jnp.tile(jnp.stack([jnp.ones_like(lam), -lam]), h // 2)  # [1, −λ, 1, −λ, ...]
        v = v.reshape(v.shape[:2] + (h // 2, 2 * dh))
        out = attend(q, k, v, mix, impl, chunks, return_weights, visible)
        o, weights = out if return_weights else (out, None)
        o = (rms_norm(o, self.subln_scale[...], eps=1e-5) * (1.0 - lambda_init(depth))).astype(q.dtype)
        o = o.reshape(b, t, h, dh)
        return (o, weights) if return_weights else o

    def lambda_value(self, depth: int | Array | None = None) -> Array:
        """DiffAttn's scalar λ = exp(<λq1,λk1>) − exp(<λq2,λk2>) + λ_init(depth), in fp32 (depth: this layer's
        index unless given)."""
        depth = self.layer_idx if depth is None else depth
        dot1 = jnp.sum(self.lambda_q1[...] * self.lambda_k1[...])
        dot2 = jnp.sum(self.lambda_q2[...] * self.lambda_k2[...])
        return jnp.exp(dot1) - jnp.exp(dot2) + lambda_init(depth)


# ---------------------------------------------------------------------------------------------------- QK transforms
class CouplingMLP(nnx.Module):
    """f: R^d_head -> R^d_head, a two-layer SiLU MLP (dynamics.coupling_mlp); shared by heads unless per-head."""

    def __init__(self, cfg: ModelConfig, key: Array, path: str):
        d, h = cfg.head_dim, cfg.coupling_hidden
        lead = (cfg.n_heads,) if cfg.per_head_params else ()
        lead_axes = ("heads",) if cfg.per_head_params else ()
        self.w1 = nnx.Param(jax.random.normal(named_key(key, path + "/w1"), lead + (d, h)) / math.sqrt(d),
                            logical_axes=lead_axes + ("head_dim", "coupling"))
        self.b1 = const_param(lead + (h,), 0.0, lead_axes + ("coupling",))
        # Zero output layer: f ≡ 0 at init, so the k-update starts as the identity while the q-drift (q += Δt·k)
        # already couples the pair; the gradient reaching w2 is non-zero from the first step.
        self.w2 = const_param(lead + (h, d), 0.0, lead_axes + ("coupling", "head_dim"))
        self.b2 = const_param(lead + (d,), 0.0, lead_axes + ("head_dim",))

    def params(self, dtype) -> dict[str, Array]:
        """Weights in the compute dtype, biases in float32 (precision.py)."""
        return {"w1": self.w1[...].astype(dtype), "b1": self.b1[...], "w2": self.w2[...].astype(dtype),
                "b2": self.b2[...]}


class AffineCouplingNets(nnx.Module):
    """The s/t nets of the invertible affine coupling (invertible.py), one set per layer, shared by heads."""

    def __init__(self, cfg: ModelConfig, key: Array, path: str):
        d, h, p = cfg.head_dim, cfg.affine_hidden, cfg.affine_pairs
        for net in ("q_net", "k_net"):
            w1 = jax.random.normal(named_key(key, f"{path}/{net}/w1"), (p, d, h)) / math.sqrt(d)
            setattr(self, f"{net}_w1", nnx.Param(w1, logical_axes=(None, "head_dim", "coupling")))
            setattr(self, f"{net}_b1", const_param((p, h), 0.0, (None, "coupling")))
            setattr(self, f"{net}_w2", const_param((p, h, 2 * d), 0.0, (None, "coupling", "head_dim")))
            setattr(self, f"{net}_b2", const_param((p, 2 * d), 0.0, (None, "head_dim")))

    def params(self, dtype) -> dict[str, dict[str, Array]]:
        """Weights in the compute dtype, biases in float32 (precision.py)."""
        cast = {"w1": dtype, "b1": jnp.float32, "w2": dtype, "b2": jnp.float32}
        return {net: {leaf: getattr(self, f"{net}_{leaf}")[...].astype(cast[leaf]) for leaf in cast}
                for net in ("q_net", "k_net")}


# ---------------------------------------------------------------------------------------------------------- maths
def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm over the last axis with fp32 statistics."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def apply_rope(x: Array, base: float, positions: Array | None = None) -> Array:
    """Rotary position embedding (rotate-half form) on [B, T, H, d], at positions 0..T-1 or at the absolute
    `positions` [B, T] (cached decoding)."""
    t, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    pos = jnp.arange(t, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)  # [T] or [B, T]
    angles = (pos[..., None] * inv_freq)[..., None, :]  # [T, 1, d/2] or [B, T, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def lambda_init(depth: int | Array) -> Array:
    """DiffAttn's λ_init for a 0-based layer index: 0.8 − 0.6·exp(−0.3·depth), fp32. `depth` may be traced (the
    layer index of a scanned stack of layers, runtime.scan_layers)."""
    return 0.8 - 0.6 * jnp.exp(-0.3 * jnp.asarray(depth, jnp.float32))


# ----------------------------------------------------------------------------------------------------- init helpers
def named_key(key: Array, path: str) -> Array:
    """An init key derived from a parameter's path, so that variants which share a weight draw it identically."""
    return jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def normal_param(key: Array, path: str, shape: tuple[int, ...], std: float, axes: tuple) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(named_key(key, path), shape, jnp.float32), logical_axes=axes)


def const_param(shape: tuple[int, ...], value: float, axes: tuple) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, jnp.float32), logical_axes=axes)
