"""Causal multi-head attention with a pluggable QK transform and scoring rule (Flax NNX).

    x --W_Q,W_K,W_V--> q, k, v  [B, T, H, d_head]
    (q, k) <- QK transform      none | coupled dynamics (dynamics.py) | affine coupling (invertible.py)
    (q, k) <- RoPE              only with positions="rope": the transform runs *before* the rotation
    o      <- scoring           softmax (cuDNN, or explicit causal query blocks)  |  differential (specs/diffattn.md)
    y      =  o W_O

With differential scoring the H = n_heads projections are read as H/2 differential heads, each made of two
half-heads (q1, k1), (q2, k2) of the baseline head dim and a value of twice that width; the QK transform then runs
on the H half-heads, so a coupled+differential layer has exactly the coupled layer's parameters plus DiffAttn's
λ vectors and head-norm scale.

Parameters carry logical axis names (metadata `logical_axes`) that `sharding.py` maps to mesh axes.
"""

from __future__ import annotations

import math
import warnings
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from coupled_qk_jax import dynamics, invertible
from coupled_qk_jax.config import DYNAMICS_METHOD, ModelConfig

Array = jax.Array


# ----------------------------------------------------------------------------------------------------- init helpers
def named_key(key: Array, path: str) -> Array:
    """An init key derived from a parameter's path, so that variants which share a weight draw it identically."""
    return jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def normal_param(key: Array, path: str, shape: tuple[int, ...], std: float, axes: tuple) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(named_key(key, path), shape, jnp.float32), logical_axes=axes)


def const_param(shape: tuple[int, ...], value: float, axes: tuple) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, jnp.float32), logical_axes=axes)


def lambda_init(depth: int) -> float:
    """DiffAttn's λ_init for a 0-based layer index: 0.8 − 0.6·exp(−0.3·depth)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


# ----------------------------------------------------------------------------------------------- shared functions
def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm over the last axis with fp32 statistics."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def apply_rope(x: Array, base: float, seq_axis: int = 1, positions: Array | None = None) -> Array:
    """Rotary position embedding (rotate-half form) on [B, T, H, d] (or [B, H, T, d] with seq_axis=2), at positions
    0..T-1, or at the absolute `positions` [B, T] (cached decoding; [B, T, H, d] layout only)."""
    t, d = x.shape[seq_axis], x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if positions is None:
        angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
        shape = [1] * x.ndim
        shape[seq_axis], shape[-1] = t, d // 2
    else:
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, d/2]
        shape = [x.shape[0], t, 1, d // 2]
    cos = jnp.cos(angles).reshape(shape)
    sin = jnp.sin(angles).reshape(shape)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def choose_implementation(requested: str, dtype, head_dim: int) -> str:
    """cuDNN fused attention when the backend, dtype and head dim allow it; otherwise the explicit chunked-causal path
    ("auto"), or exactly what was asked for ("xla": jax.nn.dot_product_attention's XLA path, "explicit"). A request
    for cuDNN that cannot be honoured falls back to "explicit" with a warning."""
    cudnn_ok = (jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
                and head_dim % 8 == 0 and head_dim <= 128)
    if requested in ("xla", "explicit"):
        return requested
    if requested == "auto":
        return "cudnn" if cudnn_ok else "explicit"
    if not cudnn_ok:
        warnings.warn(f"attention_impl='cudnn' unavailable (backend={jax.default_backend()}, dtype={jnp.dtype(dtype)}, "
                      f"head_dim={head_dim}); falling back to 'explicit'", stacklevel=2)
        return "explicit"
    return "cudnn"


def auto_chunks(t: int) -> int:
    """Query blocks for the explicit causal path: blocks of about 64 queries, at most 8 of them.

    Block i only scores keys [0, end_i), so the upper-triangle work skipped is (1 - (n+1)/(2n)) of a full T×T (25% at
    n=2, 37.5% at n=4, 44% at n=8); more blocks mean more, smaller matmuls and more HLO, hence the cap (NOTES.md).
    """
    return max(1, min(8, t // 64))


def _exp_and_norm(s: Array) -> tuple[Array, Array]:
    """Unnormalised softmax numerators exp(s - max) and the reciprocal of their row sums (fp32).

    The max is a constant shift (stop_gradient), so autodiff differentiates only exp and the sum: the same gradient
    as jax.nn.softmax with fewer ops in the backward pass. One reciprocal per row replaces a divide per element."""
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - m)
    return e, 1.0 / jnp.sum(e, axis=-1, keepdims=True)


def chunked_causal_attention(q: Array, k: Array, v: Array, scale: float, n_chunks: int = 0,
                             mix: Callable[[Array], Array] | None = None, heads_major: bool = False) -> Array:
    """Causal softmax attention computed in query blocks, each against only the keys it can see.

    q, k: [B, T, H, d]; v: [B, T, Hv, dv]; returns [B, T, Hv, dv] (all [B, H, T, d] with heads_major=True, which
    saves the layout transposes). `mix` maps fp32 probabilities [B, H, c, S] to [B, Hv, c, S] before the value
    product (differential attention's A1 − λ·A2); without it Hv must equal H.

    Why not jax.nn.dot_product_attention(implementation="xla")? On CPU its fwd+bwd was ~2× slower than this
    (benchmarks/NOTES.md): it scores the full T×T square, and this path also skips the masked upper-triangle blocks.
    Peak [*, T, T]-sized memory is the same as one full score tensor (the blocks partition it).
    """
    t = q.shape[2] if heads_major else q.shape[1]
    n = n_chunks or auto_chunks(t)
    n = max(1, min(n, t))
    # Heads-major layout: every matmul below is then a plain batch over (B, H) with contiguous [T, d] operands.
    qt = q * jnp.asarray(scale, q.dtype)
    kt, vt = k, v
    if not heads_major:
        qt, kt, vt = (jnp.swapaxes(a, 1, 2) for a in (qt, kt, vt))
    bounds = [t * i // n for i in range(n + 1)]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        s = jnp.einsum("bhqd,bhkd->bhqk", qt[:, :, lo:hi], kt[:, :, :hi], preferred_element_type=jnp.float32)
        visible = (lo + jnp.arange(hi - lo))[:, None] >= jnp.arange(hi)[None, :]
        e, inv_sum = _exp_and_norm(jnp.where(visible, s, jnp.finfo(jnp.float32).min))
        if mix is None:
            # Deferred normalisation: scale the [c, dv] output rows instead of the [c, S] probabilities (S/dv times
            # fewer multiplies, forward and backward); the same softmax(s)·v up to rounding.
            o = jnp.einsum("bhqk,bhkd->bhqd", e.astype(v.dtype), vt[:, :, :hi], preferred_element_type=jnp.float32)
            outs.append((o * inv_sum).astype(v.dtype))
        else:
            p = mix(e * inv_sum)
            outs.append(jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vt[:, :, :hi]))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
    return o if heads_major else jnp.swapaxes(o, 1, 2)


def cached_attention(q: Array, k: Array, v: Array, visible: Array, scale: float,
                     mix: Callable[[Array], Array] | None = None) -> Array:
    """Attention of new queries against a KV cache (cached decoding).

    q: [B, T, H, d]; k: [B, S, H, d] and v: [B, S, Hv, dv], the cache's S slots; visible: bool [B, T, S], which slots
    each query may see. Returns [B, T, Hv, dv]. `mix` as in `chunked_causal_attention`."""
    s = jnp.einsum("bthd,bshd->bhts", q * jnp.asarray(scale, q.dtype), k, preferred_element_type=jnp.float32)
    e, inv_sum = _exp_and_norm(jnp.where(visible[:, None], s, jnp.finfo(jnp.float32).min))
    p = e * inv_sum if mix is None else mix(e * inv_sum)
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v)


def causal_softmax(q: Array, k: Array, scale: float) -> Array:
    """Explicit causal attention probabilities, fp32. q, k: [B, T, H, d] -> [B, H, T, T]."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


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
        # Zero output layer: f ≡ 0 at init, so the k-update starts as the identity (see dynamics.init_coupling_params).
        self.w2 = const_param(lead + (h, d), 0.0, lead_axes + ("coupling", "head_dim"))
        self.b2 = const_param(lead + (d,), 0.0, lead_axes + ("head_dim",))

    def params(self, dtype) -> dict[str, Array]:
        return {name: getattr(self, name)[...].astype(dtype) for name in ("w1", "b1", "w2", "b2")}


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
        return {net: {leaf: getattr(self, f"{net}_{leaf}")[...].astype(dtype) for leaf in ("w1", "b1", "w2", "b2")}
                for net in ("q_net", "k_net")}


# -------------------------------------------------------------------------------------------------------- attention
class CausalSelfAttention(nnx.Module):
    """One causal attention layer. Input and output [B, T, d_model]."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, key: Array):
        self.cfg = cfg
        d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        path = f"layers/{layer_idx}/attn"
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = normal_param(key, path + "/wq", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wk = normal_param(key, path + "/wk", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wv = normal_param(key, path + "/wv", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wo = normal_param(key, path + "/wo", (h, dh, d), out_std, ("heads", "head_dim", "embed"))

        transform = cfg.qk_transform
        if transform in DYNAMICS_METHOD:
            # Δt per head (per half-head under differential scoring: H values either way).
            self.dt = const_param((h,), cfg.dt_init, ("heads",))
            if cfg.coupling_scope == "layer":
                self.coupling = CouplingMLP(cfg, key, path + "/coupling")
        elif transform == "affine":
            self.affine = AffineCouplingNets(cfg, key, path + "/affine")

        if cfg.scoring == "differential":
            self.lambda_init = lambda_init(layer_idx)  # a Python constant, not a parameter
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, normal_param(key, f"{path}/{name}", (dh,), 0.1, ("head_dim",)))
            self.subln_scale = const_param((2 * dh,), 1.0, ("head_dim",))

    # -- the QK transform -------------------------------------------------------------------------------------------
    def transform_qk(self, q: Array, k: Array, shared_coupling: CouplingMLP | None = None,
                     head_axis: int = 2) -> tuple[Array, Array]:
        """(q, k) -> the transformed pair; [B, T, H, d] (head_axis=2) or [B, H, T, d] (head_axis=1)."""
        cfg = self.cfg
        transform = cfg.qk_transform
        if transform in DYNAMICS_METHOD:
            mlp = self.coupling if cfg.coupling_scope == "layer" else shared_coupling
            if mlp is None:
                raise ValueError("model.coupling_scope='shared' needs the model's shared coupling MLP")
            # Δt stays float32: dynamics.py forms Δt·k in float32 (issue 12).
            args = (self.dt[...], mlp.params(q.dtype), cfg.n_steps, DYNAMICS_METHOD[transform])
            kwargs = dict(per_head_params=cfg.per_head_params, unroll=cfg.scan_unroll, backward=cfg.dynamics_backward)
            evolve = dynamics.evolve_heads_batched if cfg.coupling_lowering == "batched" else dynamics.evolve_heads
            if head_axis != 2:  # the dynamics take [..., H, d]
                q, k = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)
            q, k = evolve(q, k, *args, **kwargs)
            return (q, k) if head_axis == 2 else (jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2))
        if transform == "affine":
            return invertible.affine_forward(self.affine.params(q.dtype), q, k)
        return q, k

    def lambda_value(self) -> Array:
        """DiffAttn's scalar λ = exp(<λq1,λk1>) − exp(<λq2,λk2>) + λ_init, in fp32."""
        dot1 = jnp.sum(self.lambda_q1[...] * self.lambda_k1[...])
        dot2 = jnp.sum(self.lambda_q2[...] * self.lambda_k2[...])
        return jnp.exp(dot1) - jnp.exp(dot2) + self.lambda_init

    # -- scoring ----------------------------------------------------------------------------------------------------
    def _softmax_scores(self, q, k, v, impl: str, heads_major: bool = False) -> Array:
        if impl == "explicit":
            return chunked_causal_attention(q, k, v, q.shape[-1] ** -0.5, self.cfg.attention_chunks,
                                            heads_major=heads_major)
        if heads_major:
            q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
            return jnp.swapaxes(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl), 1, 2)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    def _differential_scores(self, q, k, v, impl: str, form: str | None = None, heads_major: bool = False) -> Array:
        """Differential attention on [B, T, H, dh] half-head views; returns [B, T, H, dh] (before W_O).

        form: "virtual_heads" (one fused dot_product_attention call; the default under cuDNN) or "explicit"
        (einsum scores in causal query blocks; the default otherwise, where it does half the FLOPs).
        heads_major: inputs and output are [B, H, T, dh] (explicit form only)."""
        if heads_major:
            return self._differential_heads_major(q, k, v)
        b, t, h, dh = q.shape
        hd = h // 2
        lam = self.lambda_value()
        scale = dh ** -0.5
        form = form or ("virtual_heads" if impl == "cudnn" else "explicit")
        if form == "virtual_heads":
            # 4·hd virtual heads of width dh in one fused call (spec §6 form 2): queries [q1,q1,q2,q2],
            # keys [k1,k1,k2,k2], values [v(1),v(2),v(1),v(2)].
            qh, kh = q.reshape(b, t, hd, 2, dh), k.reshape(b, t, hd, 2, dh)
            vh = v.reshape(b, t, hd, 2, dh)
            qv = jnp.stack([qh[:, :, :, 0]] * 2 + [qh[:, :, :, 1]] * 2, axis=3).reshape(b, t, 4 * hd, dh)
            kv = jnp.stack([kh[:, :, :, 0]] * 2 + [kh[:, :, :, 1]] * 2, axis=3).reshape(b, t, 4 * hd, dh)
            vv = jnp.stack([vh[:, :, :, 0], vh[:, :, :, 1]] * 2, axis=3).reshape(b, t, 4 * hd, dh)
            out = jax.nn.dot_product_attention(qv, kv, vv, is_causal=True, scale=scale, implementation=impl)
            out = out.reshape(b, t, hd, 2, 2 * dh)
            o = out[:, :, :, 0] - lam.astype(out.dtype) * out[:, :, :, 1]
        else:
            # Explicit form: one score tensor for both half-heads, A1 − λ·A2 combined *before* the value product
            # (the same FLOPs as the 2·hd-head baseline).
            def mix(probs: Array) -> Array:  # [B, H, c, S] -> [B, H/2, c, S]
                probs = probs.reshape((b, hd, 2) + probs.shape[2:])
                return probs[:, :, 0] - lam * probs[:, :, 1]

            o = chunked_causal_attention(q, k, v.reshape(b, t, hd, 2 * dh), scale, self.cfg.attention_chunks, mix)
        o = rms_norm(o, self.subln_scale[...], eps=1e-5) * (1.0 - self.lambda_init)
        return o.reshape(b, t, h, dh)

    def _differential_heads_major(self, q: Array, k: Array, v: Array) -> Array:
        """The explicit differential form on [B, H, T, dh]: only v and the output change layout (each differential
        head's value is its two half-heads' values side by side), never the [*, T, T] scores."""
        b, h, t, dh = q.shape
        hd = h // 2
        lam = self.lambda_value()
        v2 = v.reshape(b, hd, 2, t, dh).transpose(0, 1, 3, 2, 4).reshape(b, hd, t, 2 * dh)

        def mix(probs: Array) -> Array:  # [B, H, c, S] -> [B, H/2, c, S]
            probs = probs.reshape((b, hd, 2) + probs.shape[2:])
            return probs[:, :, 0] - lam * probs[:, :, 1]

        o = chunked_causal_attention(q, k, v2, dh ** -0.5, self.cfg.attention_chunks, mix, heads_major=True)
        o = rms_norm(o, self.subln_scale[...], eps=1e-5) * (1.0 - self.lambda_init)
        return o.reshape(b, hd, t, 2, dh).transpose(0, 1, 3, 2, 4).reshape(b, h, t, dh)

    def attention_matrix(self, q: Array, k: Array) -> Array:
        """The effective token-mixing matrix for diagnostics: softmax A [B, H, T, T], or A1 − λ·A2 [B, H/2, T, T]."""
        probs = causal_softmax(q, k, q.shape[-1] ** -0.5)
        if self.cfg.scoring == "differential":
            b, h, t, _ = probs.shape
            probs = probs.reshape(b, h // 2, 2, t, t)
            return probs[:, :, 0] - self.lambda_value() * probs[:, :, 1]
        return probs

    # -- forward ----------------------------------------------------------------------------------------------------
    def __call__(self, x: Array, shared_coupling: CouplingMLP | None = None, collect: bool = False):
        """x: [B, T, d_model] in the compute dtype -> [B, T, d_model] (and a dict of intermediates if collect)."""
        cfg, dtype = self.cfg, x.dtype
        impl = choose_implementation(cfg.attention_impl, dtype, cfg.head_dim)
        # The explicit path works heads-major ([B, H, T, d]) from the projections on: the projections and W_O absorb
        # the layout for free, while a [B, T, H, d] layout cost four transposes per layer and direction (NOTES.md).
        # The collect path keeps the public [B, T, H, d] layout of the diagnostics.
        hm = impl == "explicit" and not collect
        proj = "btd,dhk->bhtk" if hm else "btd,dhk->bthk"
        q = jnp.einsum(proj, x, self.wq[...].astype(dtype))
        k = jnp.einsum(proj, x, self.wk[...].astype(dtype))
        v = jnp.einsum(proj, x, self.wv[...].astype(dtype))
        q0, k0 = q, k
        q, k = self.transform_qk(q, k, shared_coupling, head_axis=1 if hm else 2)
        q1, k1 = q, k
        if cfg.positions == "rope":
            seq_axis = 2 if hm else 1
            q, k = apply_rope(q, cfg.rope_base, seq_axis), apply_rope(k, cfg.rope_base, seq_axis)
        if cfg.scoring == "differential":
            o = self._differential_scores(q, k, v, impl, heads_major=hm)
        else:
            o = self._softmax_scores(q, k, v, impl, heads_major=hm)
        y = jnp.einsum("bhtk,hkd->btd" if hm else "bthk,hkd->btd", o, self.wo[...].astype(dtype))
        if not collect:
            return y
        aux = {"q_before": q0, "k_before": k0, "q_after": q1, "k_after": k1, "attn": self.attention_matrix(q, k)}
        if hasattr(self, "dt"):
            aux["dt"] = self.dt[...]
        return y, aux

    # -- cached decoding (generate.py) ------------------------------------------------------------------------------
    def decode(self, x: Array, cache: dict[str, Array], positions: Array,
               shared_coupling: CouplingMLP | None = None) -> tuple[Array, dict[str, Array]]:
        """The layer on T new tokens with a KV cache: x [B, T, d_model] at absolute `positions` [B, T] (consecutive
        in each row) -> (y [B, T, d_model], the updated cache).

        cache: {"k", "v"}, each [B, S, H, d_head] in the compute dtype. It holds keys *after* the QK transform (and
        after RoPE): every transform acts on each token's own (q, k), so a token's evolved key never changes once
        computed. The new keys and values are written at slots positions[b, 0] + 0..T-1 and query (b, t) sees slots
        <= positions[b, t]. Slots above a row's position may hold stale entries (a shorter prompt's padding); they
        stay masked until that row overwrites them.
        """
        cfg, dtype = self.cfg, x.dtype
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dtype))
        k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dtype))
        v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dtype))
        q, k = self.transform_qk(q, k, shared_coupling)
        if cfg.positions == "rope":  # the transform runs before the rotation, as in __call__
            q = apply_rope(q, cfg.rope_base, positions=positions)
            k = apply_rope(k, cfg.rope_base, positions=positions)
        write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), at, axis=0))
        cache = {"k": write(cache["k"], k, positions[:, 0]), "v": write(cache["v"], v, positions[:, 0])}
        visible = jnp.arange(cache["k"].shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
        if cfg.scoring == "differential":
            b, t, h, dh = q.shape
            lam = self.lambda_value()

            def mix(probs: Array) -> Array:  # [B, H, T, S] -> [B, H/2, T, S]
                probs = probs.reshape((b, h // 2, 2) + probs.shape[2:])
                return probs[:, :, 0] - lam * probs[:, :, 1]

            s = cache["v"].shape[1]
            o = cached_attention(q, cache["k"], cache["v"].reshape(b, s, h // 2, 2 * dh), visible, dh ** -0.5, mix)
            o = (rms_norm(o, self.subln_scale[...], eps=1e-5) * (1.0 - self.lambda_init)).reshape(b, t, h, dh)
        else:
            o = cached_attention(q, cache["k"], cache["v"], visible, cfg.head_dim ** -0.5)
        return jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(dtype)), cache
