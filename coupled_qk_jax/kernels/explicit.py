"""The explicit causal attention path: einsums over causal query blocks, each scored against only the keys it can see.

This is the CPU kernel, the reference the fused kernels are tested against, the only kernel that returns the
attention weights (diagnostics), and the kernel of cached decoding (a `visible` mask over a KV cache). It is plain
jnp, so under a mesh XLA partitions it by itself: no shard_map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def auto_chunks(t: int) -> int:
    """Query blocks for a sequence of length t: blocks of about 64 queries, at most 8 of them.

    Block i only scores keys [0, end_i), so the upper-triangle work skipped is (1 - (n+1)/(2n)) of a full T×T (25% at
    n=2, 37.5% at n=4, 44% at n=8); more blocks mean more, smaller matmuls and more HLO, hence the cap.
    """
    return max(1, min(8, t // 64))


def _exp_and_norm(s: Array) -> tuple[Array, Array]:
    """Unnormalised softmax numerators exp(s - max) and the reciprocal of their row sums (fp32).

    The max is a constant shift (stop_gradient), so autodiff differentiates only exp and the sum: the same gradient
    as jax.nn.softmax with fewer ops in the backward pass. One reciprocal per row replaces a divide per element."""
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - m)
    return e, 1.0 / jnp.sum(e, axis=-1, keepdims=True)


def explicit_attention(q: Array, k: Array, v: Array, mix: Array | None = None, n_chunks: int = 0,
                       return_weights: bool = False, visible: Array | None = None):
    """Causal attention as einsums over query blocks.

    q, k: [B, T, H, D]; v: [B, T, G, Dv] -> [B, T, G, Dv] (and with return_weights the mixed attention matrices
    [B, G, T, S] in float32). With `visible` [B, T, S], k and v hold a KV cache of S slots and query t sees the slots
    where visible[:, t] (one block). `mix` [H] as in kernels.attend.

    Why not jax.nn.dot_product_attention(implementation="xla")? On CPU its fwd+bwd was about 2× slower than this: it
    scores the full T×T square, and this path skips the masked upper-triangle blocks. Peak [*, T, T]-sized memory is
    the same as one full score tensor (the blocks partition it).
    """
    b, t, h, d = q.shape
    g, s_kv = v.shape[2], k.shape[1]
    n = 1 if visible is not None else max(1, min(n_chunks or auto_chunks(t), t))
    # Heads-major inside the kernel: every matmul below is a plain batch over (B, H) with contiguous [T, d] operands
    # (what XLA:CPU's dot emitter wants); the transposes stay here, the layer sees [B, T, H, D].
    qt = jnp.swapaxes(q * jnp.asarray(d ** -0.5, q.dtype), 1, 2)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    bounds = [t * i // n for i in range(n + 1)]
    outs, weights = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        if visible is None:  # block [lo, hi) of queries sees keys [0, hi)
            keys, mask = hi, (lo + jnp.arange(hi - lo))[:, None] >= jnp.arange(hi)[None, :]
        else:
            keys, mask = s_kv, visible[:, None]
        s = jnp.einsum("bhqd,bhkd->bhqk", qt[:, :, lo:hi], kt[:, :, :keys], preferred_element_type=jnp.float32)
        e, inv_sum = _exp_and_norm(jnp.where(mask, s, jnp.finfo(jnp.float32).min))
        if mix is None and not return_weights:
            # Deferred normalisation: scale the [c, dv] output rows instead of the [c, S] probabilities (S/dv times
            # fewer multiplies, forward and backward); the same softmax(s)·v up to rounding.
            o = jnp.einsum("bhqk,bhkd->bhqd", e.astype(v.dtype), vt[:, :, :keys], preferred_element_type=jnp.float32)
            outs.append((o * inv_sum).astype(v.dtype))
            continue
        p = e * inv_sum
        if mix is not None:  # [B, H, c, S] -> [B, G, c, S]
            p = (p * mix[:, None, None]).reshape((b, g, h // g) + p.shape[2:]).sum(axis=2)
        if return_weights:
            weights.append(jnp.pad(p, ((0, 0), (0, 0), (0, 0), (0, s_kv - keys))))
        if mix is None:
            o = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vt[:, :, :keys], preferred_element_type=jnp.float32)
            outs.append(o.astype(v.dtype))
        else:
            # float32 value product and output (precision.py): the mixed weights' cotangent, from which λ's gradient
            # is summed over T×T entries, is then not rounded to bf16 (that put λ's gradient off by up to 2×).
            outs.append(jnp.einsum("bhqk,bhkd->bhqd", p, vt[:, :, :keys].astype(jnp.float32)))
    o = jnp.swapaxes(jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0], 1, 2)
    if not return_weights:
        return o
    return o, (jnp.concatenate(weights, axis=2) if len(weights) > 1 else weights[0])
