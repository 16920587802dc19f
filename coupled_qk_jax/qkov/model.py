"""One-layer, single-query attention model of spec §1 in four parametrisations, as pure functions on param dicts.

Embeddings are one-hot over d = 50 tokens. Only the last input position queries; keys and values are all input
positions, the query position included. Every matrix is [50, 50] and acts as ``y = W x`` (PyTorch ``nn.Linear``
convention, no bias).

======  ===========================  ==========================
name    score(x_q, x_j)              output logits
======  ===========================  ==========================
fafo    (W_Q x_q)^T (W_K x_j)        W_O W_V sum_j a_j x_j
faco    (W_Q x_q)^T (W_K x_j)        W_OV sum_j a_j x_j
cafo    x_q^T W_QK x_j               W_O W_V sum_j a_j x_j
caco    x_q^T W_QK x_j               W_OV sum_j a_j x_j
======  ===========================  ==========================

with ``a = softmax_j(score / sqrt(50))``. The Figure-3 collapsed readout adds a bias ``b_OV``; any param dict that
contains ``b_OV`` gets it added to the logits.

Parameter groups: ``W_Q, W_K, W_QK`` form the QK circuit; ``W_V, W_O, W_OV, b_OV`` the OV circuit.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

D = 50
PARAMETRISATIONS = ("fafo", "faco", "cafo", "caco")
QK_NAMES = frozenset({"W_Q", "W_K", "W_QK"})
OV_NAMES = frozenset({"W_V", "W_O", "W_OV", "b_OV"})

Params = Mapping[str, jax.Array]


def _check_param(parametrisation: str) -> str:
    p = parametrisation.lower()
    if p not in PARAMETRISATIONS:
        raise ValueError(f"parametrisation: expected one of {PARAMETRISATIONS}, got {parametrisation!r}")
    return p


def param_names(parametrisation: str, ov_bias: bool = False) -> tuple[str, ...]:
    """Names of the trained matrices of a parametrisation (QK first, then OV)."""
    p = _check_param(parametrisation)
    qk = ("W_Q", "W_K") if p[:2] == "fa" else ("W_QK",)
    ov = ("W_V", "W_O") if p[2:] == "fo" else ("W_OV",)
    if ov_bias:
        ov = ov + ("b_OV",)
    return qk + ov


def circuit_of(name: str) -> str:
    """'qk' or 'ov' for a parameter name."""
    if name in QK_NAMES:
        return "qk"
    if name in OV_NAMES:
        return "ov"
    raise ValueError(f"param name: unknown parameter {name!r}")


# Initialisation schemes of spec §1 ("default" = PyTorch nn.Linear, U(-1/sqrt(50), 1/sqrt(50)); "eye" = 1e-6 I).
FIG2_ROW1_INIT = {
    "fafo": {"W_Q": "default", "W_K": "default", "W_V": "eye", "W_O": "eye"},
    "faco": {"W_Q": "eye", "W_K": "eye", "W_OV": "eye"},
    "cafo": {"W_QK": "eye", "W_V": "eye", "W_O": "eye"},
    "caco": {"W_QK": "default", "W_OV": "default"},
}
INIT_SCHEMES = {
    "fig2": FIG2_ROW1_INIT,
    # "CACO_FAFO" notebook and the FAFO learning-rate runs: all four FAFO factors start at 1e-6 I.
    "eye": {p: {n: "eye" for n in param_names(p)} for p in PARAMETRISATIONS},
    "default": {p: {n: "default" for n in param_names(p)} for p in PARAMETRISATIONS},
}


def init_params(key: jax.Array, parametrisation: str, scheme: str | Mapping[str, str] = "fig2",
                ov_bias: bool = False, eye_scale: float = 1e-6) -> dict[str, jax.Array]:
    """Initial parameters.

    Args:
      key: PRNG key (only used by "default" entries; one subkey per matrix, in param_names order).
      parametrisation: fafo | faco | cafo | caco.
      scheme: "fig2" (Figure-2 row 1), "eye" (all 1e-6 I, the CACO_FAFO option), "default" (all PyTorch default),
        or an explicit {name: "default" | "eye" | "zeros"} mapping.
      ov_bias: add a collapsed-readout bias b_OV [50], PyTorch-default U(-1/sqrt(50), 1/sqrt(50)).
    Returns:
      dict name -> float32 [50, 50] (b_OV: [50]).
    """
    p = _check_param(parametrisation)
    if isinstance(scheme, str):
        if scheme not in INIT_SCHEMES:
            raise ValueError(f"scheme: expected one of {tuple(INIT_SCHEMES)} or a mapping, got {scheme!r}")
        table = INIT_SCHEMES[scheme][p]
    else:
        table = dict(scheme)
    names = param_names(p, ov_bias)
    keys = jax.random.split(key, len(names))
    bound = 1.0 / math.sqrt(D)
    out = {}
    for k, name in zip(keys, names):
        kind = "default" if name == "b_OV" else table.get(name)
        if kind == "default":
            shape = (D,) if name == "b_OV" else (D, D)
            out[name] = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
        elif kind == "eye":
            out[name] = eye_scale * jnp.eye(D, dtype=jnp.float32)
        elif kind == "zeros":
            out[name] = jnp.zeros((D, D), jnp.float32)
        else:
            raise ValueError(f"scheme: no valid init ('default'|'eye'|'zeros') for {name!r} in {p}, got {kind!r}")
    return out


def qk_matrix(params: Params) -> jax.Array:
    """Bilinear form B [50, 50] with score(x_q, x_j) = x_q^T B x_j (W_Q^T W_K or W_QK)."""
    if "W_QK" in params:
        return params["W_QK"]
    return params["W_Q"].T @ params["W_K"]


def ov_matrix(params: Params) -> jax.Array:
    """Readout matrix [50, 50] with logits = W pooled (W_O W_V or W_OV)."""
    if "W_OV" in params:
        return params["W_OV"]
    return params["W_O"] @ params["W_V"]


def attention(params: Params, tokens: jax.Array) -> jax.Array:
    """Attention of the last position over all positions.

    Args:
      tokens: int [B, T] input tokens (context + query); the query is tokens[:, -1].
    Returns:
      float [B, T] softmax weights.
    """
    x = jax.nn.one_hot(tokens, D, dtype=params[next(iter(params))].dtype)  # [B, T, D]
    xq = x[:, -1]  # [B, D]
    # (W_Q x_q)^T (W_K x_j) = x_q^T (W_Q^T W_K) x_j: forming the 50x50 bilinear form first costs 125k MACs instead of
    # projecting every position (B*T*2500), and the gradients w.r.t. W_Q, W_K are the same by the chain rule.
    scores = jnp.einsum("bd,btd->bt", xq @ qk_matrix(params), x)
    return jax.nn.softmax(scores / math.sqrt(D), axis=-1)


def readout(params: Params, tokens: jax.Array, attn: jax.Array) -> jax.Array:
    """Logits [B, 50] = OV(sum_j a_j x_j) (+ b_OV) for tokens [B, T] and attention [B, T]."""
    x = jax.nn.one_hot(tokens, D, dtype=attn.dtype)
    return readout_pooled(params, jnp.einsum("bt,btd->bd", attn, x))


def readout_pooled(params: Params, pooled: jax.Array) -> jax.Array:
    """Logits [B, 50] = OV(pooled) (+ b_OV) for the attention-pooled one-hot inputs ``pooled`` [B, 50]."""
    if "W_OV" in params:
        logits = pooled @ params["W_OV"].T
    else:
        logits = (pooled @ params["W_V"].T) @ params["W_O"].T
    if "b_OV" in params:
        logits = logits + params["b_OV"]
    return logits


def forward(params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits [B, 50], attention [B, T]) for int tokens [B, T]."""
    a = attention(params, tokens)
    return readout(params, tokens, a), a


def fixed_attention(tokens: jax.Array, alpha: float | jax.Array) -> jax.Array:
    """Figure-3 attention: mass alpha spread uniformly on distinct tokens (id > 9), 1 - alpha uniformly on the rest.

    If a row has no distinct token (or no other token) the whole mass goes uniformly to the non-empty set, so rows
    always sum to 1. tokens: int [B, T]; returns float32 [B, T].
    """
    rel = (tokens > 9).astype(jnp.float32)
    rest = 1.0 - rel
    n_rel = rel.sum(-1, keepdims=True)
    n_rest = rest.sum(-1, keepdims=True)
    alpha = jnp.asarray(alpha, jnp.float32)
    a_rel = jnp.where(n_rest == 0, 1.0, jnp.where(n_rel == 0, 0.0, alpha))
    return a_rel * rel / jnp.maximum(n_rel, 1.0) + (1.0 - a_rel) * rest / jnp.maximum(n_rest, 1.0)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy; logits [B, C], int targets [B]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss_fn(params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of the attention model on one batch."""
    logits, _ = forward(params, tokens)
    return cross_entropy(logits, targets)


def fixed_attention_loss_fn(params: Params, tokens: jax.Array, targets: jax.Array, alpha) -> jax.Array:
    """Mean cross-entropy with the Figure-3 fixed attention (only OV parameters matter)."""
    return cross_entropy(readout(params, tokens, fixed_attention(tokens, alpha)), targets)


def forward_reference(params: Mapping[str, np.ndarray], tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float64 numpy reference of :func:`forward`, written per example with explicit vectors (used in tests)."""
    P = {k: np.asarray(v, np.float64) for k, v in params.items()}
    logits, attns = [], []
    for seq in np.asarray(tokens):
        X = np.eye(D)[seq]  # [T, D], rows are x_j
        xq = X[-1]
        if "W_QK" in P:
            s = np.array([xq @ P["W_QK"] @ xj for xj in X])
        else:
            s = np.array([(P["W_Q"] @ xq) @ (P["W_K"] @ xj) for xj in X])
        s = s / np.sqrt(D)
        e = np.exp(s - s.max())
        a = e / e.sum()
        pooled = (a[:, None] * X).sum(0)
        z = P["W_OV"] @ pooled if "W_OV" in P else P["W_O"] @ (P["W_V"] @ pooled)
        if "b_OV" in P:
            z = z + P["b_OV"]
        logits.append(z)
        attns.append(a)
    return np.stack(logits), np.stack(attns)
