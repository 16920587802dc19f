"""Coupled query-key dynamics: pure functions, no Flax, no config objects.

The paper (Gahtan & Bronstein, arXiv 2604.01683v1) evolves each head's query and key *together* before scoring.
With q as position, k as momentum and a learned force f (a two-layer SiLU MLP) one Euler step is

    q' = q + dt * k
    k' = k + dt * f(q)              # both read the old state (simultaneous explicit Euler)

and the Hamiltonian variant is leapfrog (kick-drift-kick):

    k_half = k + dt/2 * f(q)
    q'     = q + dt * k_half
    k'     = k_half + dt/2 * f(q')

The MLP-only ablation ("uncoupled") applies the same f to q and to k separately, with no cross term:

    q' = q + dt * f(q)
    k' = k + dt * f(k)

Every function works on arrays with any leading axes; `evolve_heads` maps over the head axis of [B, T, H, d_head]
tensors with `jax.vmap`, and `integrate` takes its n steps with `jax.lax.scan` (n is static).
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

Array = jax.Array
Force = Callable[[Array], Array]
StepFn = Callable[[Array, Array, Array, Force], tuple[Array, Array]]

METHODS = ("euler", "leapfrog", "uncoupled")


def coupling_mlp(params: Mapping[str, Array], x: Array) -> Array:
    """f(x) = silu(x @ w1 + b1) @ w2 + b2.

    params: w1 [d, h], b1 [h], w2 [h, d], b2 [d].  x: [..., d]  ->  [..., d].
    """
    hidden = jax.nn.silu(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def euler_step(q: Array, k: Array, dt: Array | float, f: Force) -> tuple[Array, Array]:
    """Simultaneous explicit Euler: (q + dt*k, k + dt*f(q)); both updates read the old (q, k)."""
    return q + dt * k, k + dt * f(q)


def leapfrog_step(q: Array, k: Array, dt: Array | float, f: Force) -> tuple[Array, Array]:
    """Kick-drift-kick leapfrog. Volume preserving and time reversible for any f (f depends on q only)."""
    k_half = k + 0.5 * dt * f(q)
    q_new = q + dt * k_half
    k_new = k_half + 0.5 * dt * f(q_new)
    return q_new, k_new


def uncoupled_step(q: Array, k: Array, dt: Array | float, f: Force) -> tuple[Array, Array]:
    """MLP-only ablation: the same f and the same capacity, no cross terms: (q + dt*f(q), k + dt*f(k)).

    f(q) and f(k) stay two calls: one call on jnp.stack([q, k]) was measured 2-5x slower on CPU (the stack copies q
    and k, and its transpose copies the gradients back out; benchmarks/NOTES.md)."""
    return q + dt * f(q), k + dt * f(k)


STEP_FUNCTIONS: dict[str, StepFn] = {
    "euler": euler_step,
    "leapfrog": leapfrog_step,
    "uncoupled": uncoupled_step,
}


def _check(method: str, n_steps: int) -> StepFn:
    if method not in STEP_FUNCTIONS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise ValueError(f"n_steps must be a Python int >= 1, got {n_steps!r}")
    return STEP_FUNCTIONS[method]


def integrate(
    q: Array,
    k: Array,
    dt: Array | float,
    f: Force,
    n_steps: int,
    method: str,
    unroll: int | bool = 1,
) -> tuple[Array, Array]:
    """Take `n_steps` steps of `method` with `jax.lax.scan` (never a Python loop).

    q, k: [..., d]; dt: a scalar (or anything broadcastable against q); n_steps: static int >= 1.
    `unroll` is passed to `lax.scan`: unrolling a small static n lets XLA fuse across steps (see benchmarks/NOTES.md).

    Leapfrog is evaluated with n + 1 force evaluations instead of 2n: the closing half-kick of step i and the opening
    half-kick of step i+1 both use f(q_{i+1}), so that value is computed once and carried through the scan. The ops
    applied to (q, k) are exactly those of `leapfrog_step` in the same order (the same map, not an approximation).
    """
    step = _check(method, n_steps)
    if method == "leapfrog" and n_steps > 1:
        return _integrate_leapfrog_fused(q, k, dt, f, n_steps, unroll)

    def body(carry, _):
        return step(carry[0], carry[1], dt, f), None

    (q, k), _ = jax.lax.scan(body, (q, k), None, length=n_steps, unroll=unroll)
    return q, k


def _integrate_leapfrog_fused(q: Array, k: Array, dt: Array | float, f: Force, n_steps: int,
                              unroll: int | bool) -> tuple[Array, Array]:
    """n leapfrog steps with n + 1 evaluations of f: the scan carries f(q) of the current position."""

    def body(carry, _):
        q, k, fq = carry
        k_half = k + 0.5 * dt * fq
        q_new = q + dt * k_half
        fq_new = f(q_new)
        return (q_new, k_half + 0.5 * dt * fq_new, fq_new), None

    (q, k, _), _ = jax.lax.scan(body, (q, k, f(q)), None, length=n_steps, unroll=unroll)
    return q, k


def _check_heads(q: Array, k: Array, dt: Array, method: str, n_steps: int, head_axis: int = 2) -> int:
    """Validate the per-head inputs shared by both lowerings; return the head count."""
    _check(method, n_steps)
    if head_axis not in (1, 2):
        raise ValueError(f"head_axis must be 1 or 2, got {head_axis}")
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, d_head] (or [B, H, T, d_head]); got {q.shape}, {k.shape}")
    n_heads = q.shape[head_axis]
    if dt.shape != (n_heads,):
        raise ValueError(f"dt must have shape [H]=({n_heads},), got {dt.shape}")
    return n_heads


def evolve_heads(
    q: Array,
    k: Array,
    dt: Array,
    params: Mapping[str, Array],
    n_steps: int,
    method: str,
    per_head_params: bool = False,
    unroll: int | bool = 1,
) -> tuple[Array, Array]:
    """Evolve every head's (q, k) with its own Δt, mapping `jax.vmap` over the head axis.

    q, k: [B, T, H, d_head]; dt: [H]; params: coupling-MLP params (see `coupling_mlp`), shared by all heads, or with
    a leading H axis on every leaf when `per_head_params=True`. Returns (q_n, k_n), both [B, T, H, d_head].
    """
    _check_heads(q, k, dt, method, n_steps)

    def one_head(q_h, k_h, dt_h, params_h):
        return integrate(q_h, k_h, dt_h, functools.partial(coupling_mlp, params_h), n_steps, method, unroll)

    params_axis = 0 if per_head_params else None
    return jax.vmap(one_head, in_axes=(2, 2, 0, params_axis), out_axes=(2, 2))(q, k, dt, params)


def coupling_mlp_heads(params: Mapping[str, Array], x: Array) -> Array:
    """Per-head f on [..., H, d] with params stacked on a leading H axis: one batched matmul over heads.

    params: w1 [H, d, h], b1 [H, h], w2 [H, h, d], b2 [H, d].  x: [..., H, d] -> [..., H, d].
    """
    hidden = jax.nn.silu(jnp.einsum("...hd,hdk->...hk", x, params["w1"]) + params["b1"])
    return jnp.einsum("...hk,hkd->...hd", hidden, params["w2"]) + params["b2"]


def evolve_heads_batched(
    q: Array,
    k: Array,
    dt: Array,
    params: Mapping[str, Array],
    n_steps: int,
    method: str,
    unroll: int | bool = 1,
    per_head_params: bool = False,
    head_axis: int = 2,
) -> tuple[Array, Array]:
    """Same maths as `evolve_heads`, written as one batched matmul over all heads instead of a vmap over heads.

    Δt broadcasts over the head axis ([H] -> [H, 1]), so f runs once on the whole [B, T, H, d_head] tensor (with
    per-head params: one einsum batched over H). head_axis=1 takes the heads-major layout [B, H, T, d_head] that the
    attention layer's explicit path uses. This is the layer's default lowering (`model.coupling_lowering`);
    benchmarks/NOTES.md compares the two.
    """
    n_heads = _check_heads(q, k, dt, method, n_steps, head_axis)
    if per_head_params and head_axis == 1:  # coupling_mlp_heads wants heads next to the feature axis
        q, k = evolve_heads_batched(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), dt, params, n_steps, method,
                                    unroll, per_head_params=True)
        return jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)
    mlp = coupling_mlp_heads if per_head_params else coupling_mlp
    f = functools.partial(mlp, params)
    dt_b = dt.reshape((n_heads,) + (1,) * (q.ndim - 1 - head_axis)).astype(q.dtype)
    return integrate(q, k, dt_b, f, n_steps, method, unroll)


def init_coupling_params(key: Array, d: int, hidden: int, dtype=jnp.float32, zero_output: bool = True) -> dict:
    """Initialise f's params: w1 LeCun-normal, b1 = 0, w2 = 0 (or LeCun-normal), b2 = 0.

    A zero output layer makes f ≡ 0 at init, so the k-update starts as the identity while the q-drift (q += Δt·k)
    already couples the pair; the gradient reaching w2 is non-zero from the first step.
    """
    k1, k2 = jax.random.split(key)
    w1 = jax.random.normal(k1, (d, hidden), dtype) / jnp.sqrt(d).astype(dtype)
    w2 = jnp.zeros((hidden, d), dtype) if zero_output else jax.random.normal(k2, (hidden, d), dtype) / jnp.sqrt(hidden)
    return {"w1": w1, "b1": jnp.zeros((hidden,), dtype), "w2": w2, "b2": jnp.zeros((d,), dtype)}
