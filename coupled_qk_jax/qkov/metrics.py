"""Attention-interpretability metrics of spec §2 and §6, as pure functions on generic attention rows.

Conventions: an attention row is ``attn [..., T]`` (non-negative, summing to 1 over the last axis), a relevance mask
is ``mask [..., T]`` (bool or 0/1 float; for the synthetic task ``tokens > 9``, for an LM the rationale tokens), and
per-sample scalars are ``[...]``. The jnp functions work on numpy inputs too and can be jitted/vmapped; the
histogram, AC/ACMC, erasure and plotting helpers run on the host with numpy.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

SYNTHETIC_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def relevant_mass(attn, mask):
    """Attention mass on relevant positions, sum_j a_j [mask_j]. attn, mask [..., T] -> [...].

    With mask = tokens > 9 this is the spec's "distinct-token attention".
    """
    attn = jnp.asarray(attn)
    return jnp.sum(attn * jnp.asarray(mask).astype(attn.dtype), axis=-1)


def separability(attn, mask):
    """max_j relevant a_j - min_j irrelevant a_j per row. attn, mask [..., T] -> [...].

    Rows with no relevant or no irrelevant position give nan (the quantity is undefined there).
    """
    m = jnp.asarray(mask, bool)
    hi = jnp.max(jnp.where(m, attn, -jnp.inf), axis=-1)
    lo = jnp.min(jnp.where(m, jnp.inf, attn), axis=-1)
    return jnp.where(jnp.isfinite(hi) & jnp.isfinite(lo), hi - lo, jnp.nan)


def true_label_prob(logits, targets):
    """Softmax probability of the target class. logits [..., C], int targets [...] -> [...]."""
    logp = logits - jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logp)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    return jnp.take_along_axis(p, jnp.asarray(targets)[..., None], axis=-1)[..., 0]


def _check_edges(edges, name: str) -> np.ndarray:
    e = np.asarray(edges, np.float64)
    if e.ndim != 1 or e.size < 2 or not np.all(np.diff(e) > 0):
        raise ValueError(f"{name}: bin edges must be a strictly increasing 1-D sequence of >= 2 numbers, got {edges}")
    return e


def _bin_index(v: np.ndarray, e: np.ndarray) -> np.ndarray:
    """numpy.histogram2d binning: [e_i, e_{i+1}) with the last bin closed; -1 for values outside [e_0, e_-1]."""
    idx = np.searchsorted(e, v, side="right") - 1
    idx = np.where(v == e[-1], e.size - 2, idx)
    out = (v < e[0]) | (v > e[-1]) | ~np.isfinite(v)
    return np.where(out, -1, idx)


def dtap_counts(att_mass, prob, x_edges=SYNTHETIC_EDGES, y_edges=SYNTHETIC_EDGES) -> np.ndarray:
    """2-D histogram counts H [nx, ny] (x = attention mass, y = probability), numpy.histogram2d semantics.

    att_mass, prob: [N]. Samples outside the edge range are dropped, as numpy does.
    """
    xe, ye = _check_edges(x_edges, "x_edges"), _check_edges(y_edges, "y_edges")
    x = np.asarray(att_mass, np.float64).ravel()
    y = np.asarray(prob, np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"prob: must have the same number of samples as att_mass, got {y.size} vs {x.size}")
    ix, iy = _bin_index(x, xe), _bin_index(y, ye)
    ok = (ix >= 0) & (iy >= 0)
    H = np.zeros((xe.size - 1, ye.size - 1), np.int64)
    np.add.at(H, (ix[ok], iy[ok]), 1)
    return H


def dtap_percent(att_mass, prob, x_edges=SYNTHETIC_EDGES, y_edges=SYNTHETIC_EDGES) -> np.ndarray:
    """DTAP heatmap cells in percent, averaged over seeds.

    att_mass, prob: [N] (one seed) or [S, N] (S seeds; the per-seed percentages 100 h / h.sum() are averaged).
    Returns float64 [nx, ny].
    """
    x, y = np.asarray(att_mass), np.asarray(prob)
    if x.shape != y.shape:
        raise ValueError(f"prob: shape {y.shape} must equal att_mass shape {x.shape}")
    if x.ndim == 1:
        x, y = x[None], y[None]
    out = []
    for xs, ys in zip(x, y):
        h = dtap_counts(xs, ys, x_edges, y_edges).astype(np.float64)
        out.append(100.0 * h / max(h.sum(), 1.0))
    return np.mean(out, axis=0)


def plot_dtap(percent: np.ndarray, path: str, x_edges=SYNTHETIC_EDGES, y_edges=SYNTHETIC_EDGES,
              title: str = "", vmin: float = 5.0, vmax: float = 70.0) -> None:
    """Save a DTAP heatmap PNG: coolwarm, vmin 5 / vmax 70, probability axis high-to-low from the top, cell labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xe, ye = _check_edges(x_edges, "x_edges"), _check_edges(y_edges, "y_edges")
    P = np.asarray(percent, np.float64)
    if P.shape != (xe.size - 1, ye.size - 1):
        raise ValueError(f"percent: expected shape {(xe.size - 1, ye.size - 1)}, got {P.shape}")
    img = P.T[::-1]  # rows = probability bins, highest at the top
    fig, ax = plt.subplots(figsize=(4.6, 4.0))
    im = ax.imshow(img, cmap="coolwarm", vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(xe.size - 1))
    ax.set_xticklabels([f"{a:g}-{b:g}" for a, b in zip(xe[:-1], xe[1:])], fontsize=7)
    ax.set_yticks(range(ye.size - 1))
    ax.set_yticklabels([f"{a:g}-{b:g}" for a, b in zip(ye[:-1], ye[1:])][::-1], fontsize=7)
    ax.set_xlabel("attention mass on relevant tokens")
    ax.set_ylabel("probability of true label")
    for i in range(img.shape[0]):
        for j in range(img.shape[1]):
            ax.text(j, i, f"{img[i, j]:.1f}", ha="center", va="center", fontsize=7)
    ax.set_title(title, fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attention_concentration(att_mass, tau_att: float = 0.5) -> float:
    """AC (project definition): percentage of samples with relevant-token attention mass >= tau_att. [N] -> float."""
    m = np.asarray(att_mass, np.float64)
    if m.size == 0:
        raise ValueError("att_mass: no samples")
    return float(100.0 * np.mean(m >= tau_att))


def acmc(att_mass, prob, tau_att: float = 0.5, tau_conf: float = 0.5) -> float:
    """ACMC (project definition): percentage of samples with mass >= tau_att and true-label prob >= tau_conf."""
    m, p = np.asarray(att_mass, np.float64), np.asarray(prob, np.float64)
    if m.shape != p.shape:
        raise ValueError(f"prob: shape {p.shape} must equal att_mass shape {m.shape}")
    if m.size == 0:
        raise ValueError("att_mass: no samples")
    return float(100.0 * np.mean((m >= tau_att) & (p >= tau_conf)))


def topk_count(length: int, k_frac: float) -> int:
    """k = max(1, ceil(k_frac * length))."""
    if not 0 < k_frac <= 1:
        raise ValueError(f"k_frac: must be in (0, 1], got {k_frac}")
    # Round before ceil so 0.05 * 100 = 5.000000000000001 does not become 6.
    return max(1, math.ceil(round(k_frac * length, 9)))


def topk_positions(attn, k_frac: float = 0.05) -> np.ndarray:
    """Positions of the top-k attention weights of one row attn [T], returned in increasing (original) order.

    Ties are broken towards the earlier position (stable sort), so the choice is deterministic.
    """
    a = np.asarray(attn, np.float64)
    if a.ndim != 1:
        raise ValueError(f"attn: expected one attention row [T], got shape {a.shape}")
    k = min(topk_count(a.size, k_frac), a.size)
    order = np.argsort(-a, kind="stable")[:k]
    return np.sort(order)


def erase(tokens, positions, mode: str):
    """Delete the positions ("delete": sequence shortens) or keep only them ("keep"); original order preserved."""
    t = np.asarray(tokens)
    sel = np.zeros(t.shape[0], bool)
    sel[np.asarray(positions, int)] = True
    if mode == "delete":
        return t[~sel]
    if mode == "keep":
        return t[sel]
    raise ValueError(f"mode: expected 'delete' or 'keep', got {mode!r}")


def _erasure_score(prob_fn: Callable[[np.ndarray], np.ndarray], tokens, attn, k_frac: float, mode: str,
                   target: int | None) -> float:
    p_full = np.asarray(prob_fn(np.asarray(tokens)), np.float64)
    if p_full.ndim != 1:
        raise ValueError(f"prob_fn: must return a 1-D probability vector, got shape {p_full.shape}")
    y = int(np.argmax(p_full)) if target is None else int(target)
    p_erased = np.asarray(prob_fn(erase(tokens, topk_positions(attn, k_frac), mode)), np.float64)
    return float(p_full[y] - p_erased[y])


def comprehensiveness(prob_fn: Callable[[np.ndarray], np.ndarray], tokens, attn, k_frac: float = 0.05,
                      target: int | None = None) -> float:
    """p(y | x) - p(y | x without its top-k attended tokens). Higher is better.

    Args:
      prob_fn: maps a 1-D token sequence (any length) to a probability vector [C].
      tokens: [T]; attn: [T] the attention row used to rank positions.
      target: class y; default the predicted class argmax p(. | x).
    """
    return _erasure_score(prob_fn, tokens, attn, k_frac, "delete", target)


def sufficiency(prob_fn: Callable[[np.ndarray], np.ndarray], tokens, attn, k_frac: float = 0.05,
                target: int | None = None) -> float:
    """p(y | x) - p(y | only the top-k attended tokens, in original order). Lower is better."""
    return _erasure_score(prob_fn, tokens, attn, k_frac, "keep", target)


def erasure_scores(prob_fn: Callable[[np.ndarray], np.ndarray], tokens: Sequence, attn: Sequence,
                   k_frac: float = 0.05) -> tuple[float, float]:
    """Mean (comprehensiveness, sufficiency) over samples; tokens and attn are sequences of 1-D rows."""
    if len(tokens) != len(attn) or len(tokens) == 0:
        raise ValueError(f"tokens: need as many non-empty rows as attn, got {len(tokens)} vs {len(attn)}")
    c = [comprehensiveness(prob_fn, t, a, k_frac) for t, a in zip(tokens, attn)]
    s = [sufficiency(prob_fn, t, a, k_frac) for t, a in zip(tokens, attn)]
    return float(np.mean(c)), float(np.mean(s))


def balancedness(outer, inner):
    """delta = ||A^T A - B B^T||_F / max(||B B^T||_F, ||A^T A||_F) for a product W = A B (A = outer, B = inner).

    Gradient flow on (A, B) conserves A^T A - B B^T. For the OV circuit W_O W_V pass (W_O, W_V); for the QK form
    W_Q^T W_K pass (W_Q^T, W_K). Shapes: A [m, k], B [k, n] -> scalar.
    """
    A, B = jnp.asarray(outer), jnp.asarray(inner)
    ata, bbt = A.T @ A, B @ B.T
    num = jnp.linalg.norm(ata - bbt)
    return num / jnp.maximum(jnp.maximum(jnp.linalg.norm(bbt), jnp.linalg.norm(ata)), 1e-30)
