"""Invertible affine query-key coupling (RealNVP style): pure functions, no Flax.

From the coupled-QK authors' follow-up ("Invertible Query-Key Coupling Composes with Attention Mechanisms"): each
token's (q, k) pair goes through alternating affine coupling maps

    q <- q * exp(s1(k)) + t1(k)
    k <- k * exp(s2(q)) + t2(q)          # reads the *updated* q

where (s1, t1) and (s2, t2) are small two-layer SiLU MLPs d -> h -> 2d whose last layer starts at zero, so the map
starts as the identity. Each half-step is invertible in closed form, so the whole map is:

    k = (k' - t2(q')) * exp(-s2(q'))
    q = (q' - t1(k)) * exp(-s1(k))

params: a dict {"q_net": mlp, "k_net": mlp} whose leaves carry a leading `pairs` axis; mlp = {w1 [d,h], b1 [h],
w2 [h,2d], b2 [2d]}. q, k: [..., d]; the same nets apply to every head (and every leading axis).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

Array = jax.Array


def _shift_and_log_scale(net: Mapping[str, Array], x: Array) -> tuple[Array, Array]:
    """The net d -> h -> 2d on x [..., d]: (log_scale, shift), each [..., d], in float32 (at least).

    The matmuls take the compute dtype (bf16 operands under the bf16 policy) and accumulate and return float32; the
    SiLU runs in float32 and only the hidden activation is rounded to the compute dtype. This is stricter than the
    coupling MLP f (dynamics.coupling_mlp), because exp(log_scale) multiplies q and k: a bf16 log-scale is a 2^-8
    relative error on every coordinate. With f's bf16 form here, the second net's first-layer gradient came out
    with cosine 0.96 to the float32 one on jax 0.12's CPU backend (0.999 on jax 0.10), tests/test_precision.py."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    pre = jnp.matmul(x, net["w1"], preferred_element_type=acc) + net["b1"].astype(acc)
    hidden = jax.nn.silu(pre).astype(x.dtype)
    out = jnp.matmul(hidden, net["w2"], preferred_element_type=acc) + net["b2"].astype(acc)
    log_scale, shift = jnp.split(out, 2, axis=-1)
    return log_scale, shift


def _scale_and_shift(x: Array, log_s: Array, t: Array) -> Array:
    """x * exp(log_s) + t in float32 (at least), rounded once to x's dtype."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return (x.astype(acc) * jnp.exp(log_s.astype(acc)) + t.astype(acc)).astype(x.dtype)


def _unshift_and_unscale(x: Array, log_s: Array, t: Array) -> Array:
    """(x - t) * exp(-log_s) in float32 (at least), rounded once to x's dtype: `_scale_and_shift`'s inverse."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return ((x.astype(acc) - t.astype(acc)) * jnp.exp(-log_s.astype(acc))).astype(x.dtype)


def _pair(params: Mapping[str, Mapping[str, Array]], i: int) -> tuple[dict, dict]:
    take = lambda tree: jax.tree.map(lambda leaf: leaf[i], tree)
    return take(params["q_net"]), take(params["k_net"])


def affine_forward(params: Mapping[str, Mapping[str, Array]], q: Array, k: Array) -> tuple[Array, Array]:
    """Apply every coupling pair in order. q, k: [..., d] -> (q', k'), same shapes."""
    n_pairs = params["q_net"]["w1"].shape[0]
    for i in range(n_pairs):  # static and small (1-2): a Python loop keeps the map readable
        q_net, k_net = _pair(params, i)
        log_s, t = _shift_and_log_scale(q_net, k)
        q = _scale_and_shift(q, log_s, t)
        log_s, t = _shift_and_log_scale(k_net, q)
        k = _scale_and_shift(k, log_s, t)
    return q, k


def affine_inverse(params: Mapping[str, Mapping[str, Array]], q: Array, k: Array) -> tuple[Array, Array]:
    """Exact inverse of `affine_forward`: undo the pairs in reverse order."""
    n_pairs = params["q_net"]["w1"].shape[0]
    for i in reversed(range(n_pairs)):
        q_net, k_net = _pair(params, i)
        log_s, t = _shift_and_log_scale(k_net, q)
        k = _unshift_and_unscale(k, log_s, t)
        log_s, t = _shift_and_log_scale(q_net, k)
        q = _unshift_and_unscale(q, log_s, t)
    return q, k


def init_affine_params(key: Array, d: int, hidden: int, pairs: int, zero_output: bool = True) -> dict:
    """Identity-initialised params: first layers LeCun-normal, last layers zero (so s = t = 0 at init)."""

    def net(key):
        k1, k2 = jax.random.split(key)
        w1 = jax.random.normal(k1, (pairs, d, hidden)) / jnp.sqrt(d)
        w2 = jnp.zeros((pairs, hidden, 2 * d)) if zero_output else 0.1 * jax.random.normal(k2, (pairs, hidden, 2 * d))
        return {"w1": w1, "b1": jnp.zeros((pairs, hidden)), "w2": w2, "b2": jnp.zeros((pairs, 2 * d))}

    kq, kk = jax.random.split(key)
    return {"q_net": net(kq), "k_net": net(kk)}
