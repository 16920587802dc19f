"""Attention diagnostics: pure ``jax.numpy`` functions over attention matrices and query/key activations, and the
diagnostic forward that produces them from a model (:func:`capture_layers`).

Conventions:

* An attention matrix ``A`` has shape ``[..., T, T]``: query rows ``i``, key columns ``j``, each row a probability
  distribution (row-stochastic) that is zero above the diagonal (causal). Leading axes are anything, typically
  ``[B, H]`` (the ``(B, N, T, S)`` layout of ``jax.nn.dot_product_attention``'s mask).
* Every function returns arrays over the leading axes ``[...]`` and is jit/vmap friendly (no Python control flow
  on values). Shape errors raise ``ValueError`` at trace time. Values are not checked inside the functions; call
  :func:`check_attention` on concrete arrays when in doubt.
* Computation is done in at least float32 (bf16/fp16 inputs are upcast) because ``A log A`` and SVDs in half
  precision are too coarse for these summaries.

Definitions (``specs/coupled_qk.md``, "Standard diagnostic definitions"; they are standard choices, not confirmed
to be the paper's):

* entropy ``H_i = −Σ_j A_ij log A_ij`` (``0·log 0 = 0``), averaged over query rows; normalised form divides row
  ``i`` (0-based) by ``log(i+1)``, the log of its number of visible positions, and averages rows ``1..T−1``
  (row 0 sees one position and has ``log 1 = 0``);
* effective rank (Roy & Vetterli 2007) ``exp(−Σ_k p_k log p_k)`` with ``p_k = σ_k / Σ σ``;
* spectral gap: both ``σ1 − σ2`` and ``σ2 / σ1`` of the singular values (not eigenvalues) of ``A``;
* sink mass: mean over query rows of ``A_i0``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array


def _as_float(x: Any) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"expected a floating-point array, got dtype {x.dtype}")
    # Upcast half precision; keep float64 when x64 is enabled so references can be matched tightly.
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _check_square(name: str, attn: Array) -> None:
    if attn.ndim < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"{name}: attention must have shape [..., T, T], got {attn.shape}")


def _xlogx(p: Array) -> Array:
    """``p log p`` with ``0 log 0 = 0``; the inner ``where`` keeps gradients finite at ``p = 0``."""
    safe = jnp.where(p > 0, p, 1.0)
    return jnp.where(p > 0, p * jnp.log(safe), 0.0)


def check_attention(attn: Any, atol: float = 1e-4) -> None:
    """Raise ``ValueError`` unless ``attn`` (concrete, ``[..., T, T]``) is row-stochastic, non-negative and causal.

    Not jit-able (it inspects values); meant for tests and for data loaded from disk.
    """
    a = np.asarray(attn, dtype=np.float64)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"attention must have shape [..., T, T], got {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("attention has non-finite entries")
    if a.min() < -atol:
        raise ValueError(f"attention has negative entries (min {a.min():.3g})")
    row_err = np.abs(a.sum(-1) - 1.0).max()
    if row_err > atol:
        raise ValueError(f"attention rows do not sum to 1 (max error {row_err:.3g})")
    upper = np.abs(np.triu(a, k=1)).max() if a.shape[-1] > 1 else 0.0
    if upper > atol:
        raise ValueError(f"attention is not causal (max weight above the diagonal {upper:.3g})")


def row_entropy(attn: Array) -> Array:
    """Per-row entropy ``H_i = −Σ_j A_ij log A_ij`` in nats. ``[..., T, T] -> [..., T]``."""
    attn = _as_float(attn)
    _check_square("row_entropy", attn)
    return -jnp.sum(_xlogx(attn), axis=-1)


def attention_entropy(attn: Array, normalized: bool = False) -> Array:
    """Mean attention entropy over query rows. ``[..., T, T] -> [...]``.

    Args:
      attn: row-stochastic causal attention ``[..., T, T]``.
      normalized: if True, divide row ``i`` (0-based) by ``log(i + 1)`` (its causal length is ``i + 1``), so uniform
        causal attention scores exactly 1 and one-hot attention 0, and average over rows ``1 .. T−1`` only (row 0
        has a single visible position, ``log 1 = 0``, and carries no information). Requires ``T >= 2``.

    Returns:
      Mean entropy (nats, or the normalised ratio) over the leading axes.
    """
    h = row_entropy(attn)  # [..., T]
    if not normalized:
        return jnp.mean(h, axis=-1)
    T = h.shape[-1]
    if T < 2:
        raise ValueError(f"attention_entropy(normalized=True) needs T >= 2, got T={T}")
    denom = jnp.log(jnp.arange(2, T + 1, dtype=h.dtype))  # log(i + 1) for rows i = 1 .. T−1
    return jnp.mean(h[..., 1:] / denom, axis=-1)


def singular_values(x: Array) -> Array:
    """Singular values in descending order. ``[..., M, N] -> [..., min(M, N)]``."""
    x = _as_float(x)
    if x.ndim < 2:
        raise ValueError(f"singular_values: expected a matrix [..., M, N], got shape {x.shape}")
    return jnp.linalg.svd(x, compute_uv=False)


def effective_rank(x: Array) -> Array:
    """Roy & Vetterli effective rank ``exp(−Σ_k p_k log p_k)``, ``p_k = σ_k / Σ_k σ_k``. ``[..., M, N] -> [...]``.

    Ranges from 1 (rank one) to ``min(M, N)`` (all singular values equal, e.g. the identity). Works for any
    matrix, so it also applies to Q or K activations ``[T, d]``. The all-zero matrix returns 1 by convention
    (there is no distribution over singular values; guarding avoids a NaN).
    """
    s = singular_values(x)
    total = jnp.sum(s, axis=-1, keepdims=True)
    p = s / jnp.where(total > 0, total, 1.0)
    return jnp.exp(-jnp.sum(_xlogx(p), axis=-1))


class SpectralGap(NamedTuple):
    """Spectral-gap summaries of an attention matrix's singular values (a pytree; fine under jit/vmap).

    Attributes:
      gap: ``σ1 − σ2`` (absolute gap). For a row-stochastic ``A``, ``σ1 >= 1``.
      ratio: ``σ2 / σ1`` in ``[0, 1]``: 0 for a rank-one matrix, 1 when the top two singular values tie (e.g. the
        identity). ``1 − ratio`` is the relative gap. Note: this is the singular-value variant, not ``1 − |λ2|``
        of the eigenvalues.
    """

    gap: Array
    ratio: Array


def spectral_gap(attn: Array) -> SpectralGap:
    """Singular-value spectral gap of attention matrices. ``[..., T, T] -> SpectralGap([...], [...])``.

    Returns a :class:`SpectralGap` named tuple ``(gap = σ1 − σ2, ratio = σ2 / σ1)``. Requires ``T >= 2``.
    """
    attn = _as_float(attn)
    _check_square("spectral_gap", attn)
    if attn.shape[-1] < 2:
        raise ValueError(f"spectral_gap needs T >= 2, got T={attn.shape[-1]}")
    s = singular_values(attn)
    s1, s2 = s[..., 0], s[..., 1]
    ratio = jnp.where(s1 > 0, s2 / jnp.where(s1 > 0, s1, 1.0), 0.0)
    return SpectralGap(gap=s1 - s2, ratio=ratio)


def sink_mass(attn: Array) -> Array:
    """Mean attention weight on position 0 over query rows (the "attention sink"). ``[..., T, T] -> [...]``.

    Row 0 is included: causally it can only attend to position 0, so it always contributes 1. This matches the
    spec's "mean attention weight on position 0" and keeps the value 1 for all-on-position-0 attention.
    """
    attn = _as_float(attn)
    _check_square("sink_mass", attn)
    return jnp.mean(attn[..., :, 0], axis=-1)


# ---------------------------------------------------------------------------------------------------------------
# Query / key statistics
# ---------------------------------------------------------------------------------------------------------------


def qk_stats(
    q_before: Array,
    k_before: Array,
    q_after: Array,
    k_after: Array,
    mask: Array | None = None,
    eps: float = 1e-12,
) -> dict[str, Array]:
    """Per-head query/key statistics before and after the coupled dynamics.

    Cosine is between a token's own query and key (``cos(q_t, k_t)``), the quantity the coupled update acts on
    jointly; norms are Euclidean over the head dimension. All means are over batch and positions (``mask``
    selects real tokens).

    Args:
      q_before, k_before, q_after, k_after: ``[B, T, H, d]``, all the same shape.
      mask: optional bool/0-1 ``[B, T]``; True on tokens to include (e.g. excluding right padding).
      eps: floor on norms inside the cosine.

    Returns:
      Dict of ``[H]`` arrays: ``q_norm_before``, ``k_norm_before``, ``q_norm_after``, ``k_norm_after``,
      ``qk_cos_before``, ``qk_cos_after``, ``q_rel_change`` and ``k_rel_change`` (mean of
      ``‖x_after − x_before‖ / ‖x_before‖``, 0 when the dynamics is the identity).
    """
    arrays = [_as_float(a) for a in (q_before, k_before, q_after, k_after)]
    shape = arrays[0].shape
    if len(shape) != 4:
        raise ValueError(f"qk_stats expects [B, T, H, d] inputs, got shape {shape}")
    for name, a in zip(("k_before", "q_after", "k_after"), arrays[1:]):
        if a.shape != shape:
            raise ValueError(f"qk_stats: {name} has shape {a.shape}, expected {shape} like q_before")
    qb, kb, qa, ka = arrays
    B, T, H, _ = shape
    if mask is None:
        w = jnp.ones((B, T), dtype=qb.dtype)
    else:
        mask = jnp.asarray(mask)
        if mask.shape != (B, T):
            raise ValueError(f"qk_stats: mask must have shape {(B, T)}, got {mask.shape}")
        w = mask.astype(qb.dtype)
    denom = jnp.maximum(jnp.sum(w), 1.0)

    def mean_bt(x: Array) -> Array:  # [B, T, H] -> [H]
        return jnp.einsum("bth,bt->h", x, w) / denom

    def norm(x: Array) -> Array:
        return jnp.linalg.norm(x, axis=-1)

    def cos(q: Array, k: Array) -> Array:
        return jnp.sum(q * k, axis=-1) / jnp.maximum(norm(q) * norm(k), eps)

    def rel(after: Array, before: Array) -> Array:
        return norm(after - before) / jnp.maximum(norm(before), eps)

    return {
        "q_norm_before": mean_bt(norm(qb)),
        "k_norm_before": mean_bt(norm(kb)),
        "q_norm_after": mean_bt(norm(qa)),
        "k_norm_after": mean_bt(norm(ka)),
        "qk_cos_before": mean_bt(cos(qb, kb)),
        "qk_cos_after": mean_bt(cos(qa, ka)),
        "q_rel_change": mean_bt(rel(qa, qb)),
        "k_rel_change": mean_bt(rel(ka, kb)),
    }


# ---------------------------------------------------------------------------------------------------------------
# Induction targets
# ---------------------------------------------------------------------------------------------------------------


def previous_token_relevance_mask(tokens: Array) -> tuple[Array, Array]:
    """Induction-style relevance mask: where an induction head at query ``t`` should attend.

    Definition. For query position ``t`` let ``p(t) = max{p < t : tokens[p] == tokens[t]}`` be the latest *earlier*
    occurrence of the current token. The relevant key position is ``j = p(t) + 1``, the token that followed that
    occurrence (the one an induction head copies). Since ``p(t) < t``, ``j <= t`` always lies in the causal window;
    ``j == t`` happens when the token repeats back to back (``tokens[t−1] == tokens[t]``). Rows with no earlier
    occurrence have no target and are invalid (their mask row is all False).

    For MQAR, a query key at position ``t`` whose pair sits at ``(2m, 2m+1)`` gets ``j = 2m+1``, the value
    position (when no filler repeats the key in between).

    Args:
      tokens: int ``[..., T]``.

    Returns:
      ``(mask, valid)``: ``mask`` bool ``[..., T, T]`` with ``mask[..., t, j]`` True iff ``j == p(t) + 1``
      (exactly one True per valid row); ``valid`` bool ``[..., T]``, True where an earlier occurrence exists.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim < 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [..., T], got shape {tokens.shape} dtype {tokens.dtype}")
    T = tokens.shape[-1]
    pos = jnp.arange(T)
    same = tokens[..., :, None] == tokens[..., None, :]  # [..., t, p]
    earlier = pos[None, :] < pos[:, None]  # p < t
    prev = jnp.max(jnp.where(same & earlier, pos, -1), axis=-1)  # [..., T], −1 if none
    valid = prev >= 0
    mask = (pos == (prev + 1)[..., None]) & valid[..., None]
    return mask, valid


def masked_attention_mass(attn: Array, mask: Array, valid: Array | None = None) -> Array:
    """Mean over valid query rows of the attention mass on masked keys: ``mean_t Σ_j A_tj · mask_tj``.

    With :func:`previous_token_relevance_mask` this is the attention placed on induction targets. ``[..., T, T]``
    attention with a mask broadcastable to it and ``valid`` broadcastable to ``[..., T]`` -> ``[...]``. Rows of
    ``valid`` that are all False give 0.
    """
    attn = _as_float(attn)
    _check_square("masked_attention_mass", attn)
    mass = jnp.sum(attn * jnp.asarray(mask, dtype=attn.dtype), axis=-1)  # [..., T]
    if valid is None:
        return jnp.mean(mass, axis=-1)
    v = jnp.broadcast_to(jnp.asarray(valid, dtype=attn.dtype), mass.shape)
    return jnp.sum(mass * v, axis=-1) / jnp.maximum(jnp.sum(v, axis=-1), 1.0)


# ---------------------------------------------------------------------------------------------------------------
# The diagnostic forward
# ---------------------------------------------------------------------------------------------------------------


def capture_layers(model: Any, tokens: Array) -> tuple[Array, list[dict[str, Array]]]:
    """One forward of a ``TransformerLM`` that keeps what the attention layers compute: tokens int ``[B, T]`` ->
    (logits ``[B, T, V]`` float32, one dict per layer).

    Each layer's dict holds ``q_before``, ``k_before``, ``q_after``, ``k_after`` (q and k before and after the QK
    transform, ``[B, T, H, d_head]``), ``attn`` (softmax ``[B, H, T, T]``, or ``A1 − λ·A2`` ``[B, H/2, T, T]``
    under differential scoring) and, with dynamics, ``dt`` ``[H]``. The model's copy from ``model.capturing()``
    runs the explicit attention kernel and sows these values (nnx.sow), and ``nnx.capture`` collects them: the
    model's own forward carries no diagnostics flag. Jit it whole (``nnx.jit``), as op-by-op dispatch of the
    attention matrices compiles hundreds of small programs.
    """
    probe = model.capturing()
    logits, sown = nnx.capture(probe, nnx.Intermediate)(tokens)
    sown = nnx.to_pure_dict(sown)["blocks"]
    return logits, [dict(sown[i]["attn"]) for i in range(len(probe.blocks))]


# ---------------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------------


def _head_metrics(attn: Array, tokens: Array | None) -> dict[str, Array]:
    """All per-matrix metrics of ``[B, H, T, T]`` attention, averaged over B -> dict of ``[H]`` arrays."""
    T = attn.shape[-1]
    out = {
        "entropy": attention_entropy(attn),
        "effective_rank": effective_rank(attn),
        "sink_mass": sink_mass(attn),
    }
    if T >= 2:
        out["entropy_normalized"] = attention_entropy(attn, normalized=True)
        sg = spectral_gap(attn)
        out["spectral_gap"] = sg.gap
        out["sigma2_over_sigma1"] = sg.ratio
    out = {k: jnp.mean(v, axis=0) for k, v in out.items()}
    if tokens is not None:
        mask, valid = previous_token_relevance_mask(tokens)  # [B, T, T], [B, T]
        mass = jnp.sum(attn * mask[:, None].astype(attn.dtype), axis=-1)  # [B, H, T]
        v = valid[:, None, :].astype(attn.dtype)
        # Pool over all valid (batch, row) pairs so examples with many repeats weigh more, like a token mean.
        out["induction_mass"] = jnp.sum(mass * v, axis=(0, 2)) / jnp.maximum(jnp.sum(v, axis=(0, 2)), 1.0)
    return out


# One compiled program per attention shape: run op by op, the metrics (SVDs, entropies) compile dozens of tiny
# programs on every call.
_head_metrics_jit = jax.jit(_head_metrics)


def summarize_attention(
    attn_per_layer: Sequence[Array] | Mapping[str, Array] | Array,
    tokens: Array | None = None,
) -> dict[str, Any]:
    """JSON-friendly per-layer, per-head summary of attention matrices.

    Args:
      attn_per_layer: a sequence (or ``{layer_name: attn}`` mapping, or stacked array ``[layers, ...]``) of
        per-layer attention ``[B, H, T, T]`` (``[H, T, T]`` is taken as B = 1). Use unpadded sequences: padded
        query rows would be averaged in.
      tokens: optional int ``[B, T]`` input tokens; adds ``induction_mass`` (attention on the targets of
        :func:`previous_token_relevance_mask`, pooled over valid rows).

    Returns:
      ``{"layers": [{"layer": name_or_index, "heads": [{"head": h, metric: float, ...}, ...],
      "mean": {metric: float, ...}}, ...]}`` with Python floats only. Metrics: ``entropy``,
      ``entropy_normalized``, ``effective_rank``, ``spectral_gap`` (σ1 − σ2), ``sigma2_over_sigma1``,
      ``sink_mass`` and, with tokens, ``induction_mass``; each averaged over the batch.
    """
    if isinstance(attn_per_layer, Mapping):
        items = list(attn_per_layer.items())
    else:
        items = list(enumerate(attn_per_layer))
    if tokens is not None:
        tokens = jnp.asarray(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None]
    layers = []
    for name, attn in items:
        attn = _as_float(attn)
        if attn.ndim == 3:
            attn = attn[None]
        if attn.ndim != 4:
            raise ValueError(f"summarize_attention: layer {name!r} attention must be [B, H, T, T], got {attn.shape}")
        _check_square(f"summarize_attention layer {name!r}", attn)
        if tokens is not None and tokens.shape != (attn.shape[0], attn.shape[-1]):
            raise ValueError(f"summarize_attention: tokens shape {tokens.shape} does not match attention "
                             f"[B, T] = {(attn.shape[0], attn.shape[-1])} at layer {name!r}")
        metrics = jax.device_get(_head_metrics_jit(attn, tokens))
        H = attn.shape[1]
        heads = [{"head": h, **{k: float(v[h]) for k, v in metrics.items()}} for h in range(H)]
        mean = {k: float(np.mean(v)) for k, v in metrics.items()}
        layers.append({"layer": name if isinstance(name, str) else int(name), "heads": heads, "mean": mean})
    return {"layers": layers}
