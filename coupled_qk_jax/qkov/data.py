"""Synthetic query-token task of spec §2, drawn from numpy's legacy ``RandomState``.

Vocabulary 0..49. Tokens 0-9 are common (weight 1 in every class); class c in {1,2,3,4} owns tokens 10c..10c+9 with
weights 0.1..1.0. Each class distribution therefore puts 1/15.5 on every common token and (k+1)/155 on token 10c+k.

One example: draw c uniformly, then seq_len-2 i.i.d. context tokens from class c, then append the query token c+4
and the label c. The model input is the first seq_len-1 tokens, the target the last one.

Exact reproduction of the reference RNG stream. The reference draws the class with
``np.random.choice([1,2,3,4], p=[.25]*4)`` and the context with ``np.random.choice(50, p=class_probs,
size=seq_len-2)``. Legacy ``RandomState.choice`` with ``p`` consumes one ``random_sample`` double per drawn item and
maps it through ``searchsorted(cdf, u, side="right")`` with the normalised cumulative sum. So a whole batch consumes
``batch * (seq_len - 1)`` consecutive doubles, one row per example (class first, then its context). We draw them in one
call and map them with the same cdf rule, which is identical to the per-example loop but ~100x faster; the test suite
checks the equality against the literal loop.
"""

from __future__ import annotations

import numpy as np

VOCAB = 50
N_CLASSES = 4
COMMON = 10
QUERY_OFFSET = 4  # query token = class + 4


def class_probs() -> np.ndarray:
    """[4, 50] float64 next-token distribution of each class c = 1..4 (row c-1), built as the reference does."""
    rows = []
    for i in range(N_CLASSES):
        w = np.zeros(VOCAB)
        w[:COMMON] = 1.0
        w[(i + 1) * 10:(i + 2) * 10] = np.arange(0.1, 1.1, 0.1)
        rows.append(w / w.sum())
    return np.stack(rows)


_PROBS = class_probs()


def _cdf(p: np.ndarray) -> np.ndarray:
    # Same construction as numpy's legacy choice: cumulative sum renormalised by its last entry.
    cdf = np.cumsum(p, axis=-1)
    return cdf / cdf[..., -1:]


_CLASS_CDF = _cdf(np.full(N_CLASSES, 0.25))
_TOKEN_CDF = np.stack([_cdf(p) for p in _PROBS])


def _check(batch_size: int, seq_len: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size: must be a positive int, got {batch_size!r}")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 3:
        raise ValueError(f"seq_len: must be an int >= 3, got {seq_len!r}")


def generate_batch(rng: np.random.RandomState, batch_size: int, seq_len: int) -> np.ndarray:
    """Draw one batch of full sequences (context, query, label).

    Args:
      rng: legacy ``np.random.RandomState``; advanced by batch_size * (seq_len - 1) doubles.
    Returns:
      int32 array [batch_size, seq_len]; column -2 is the query c+4, column -1 the label c.
    """
    _check(batch_size, seq_len)
    u = rng.random_sample((batch_size, seq_len - 1))
    cls = np.searchsorted(_CLASS_CDF, u[:, 0], side="right") + 1  # 1..4
    ctx = np.empty((batch_size, seq_len - 2), np.int64)
    for c in range(1, N_CLASSES + 1):
        rows = cls == c
        ctx[rows] = np.searchsorted(_TOKEN_CDF[c - 1], u[rows, 1:], side="right")
    return np.concatenate([ctx, (cls + QUERY_OFFSET)[:, None], cls[:, None]], axis=1).astype(np.int32)


def generate_batch_reference(rng: np.random.RandomState, batch_size: int, seq_len: int) -> np.ndarray:
    """The literal per-example loop of the reference generator (slow; used to test :func:`generate_batch`)."""
    _check(batch_size, seq_len)
    out = []
    for _ in range(batch_size):
        c = rng.choice([1, 2, 3, 4], p=[0.25] * 4)
        ctx = rng.choice(np.arange(VOCAB), p=_PROBS[c - 1], size=seq_len - 2)
        out.append(np.append(ctx, [c + QUERY_OFFSET, c]))
    return np.stack(out).astype(np.int32)


def generate_fixed_attention_batch(rng: np.random.RandomState, per_class: int, seq_len: int) -> np.ndarray:
    """Figure-3 variant: class-balanced, ``[context, c, c+4]`` so the target is the query id.

    *(interpretation)* Classes are not drawn: for c = 1..4 in order, `per_class` examples of class c are generated,
    each consuming seq_len-2 doubles for its context.

    Returns:
      int32 [4 * per_class, seq_len]; input = [:, :-1] (last input token is c), target = [:, -1] = c + 4.
    """
    _check(per_class, seq_len)
    u = rng.random_sample((N_CLASSES, per_class, seq_len - 2))
    parts = []
    for c in range(1, N_CLASSES + 1):
        ctx = np.searchsorted(_TOKEN_CDF[c - 1], u[c - 1], side="right")
        tail = np.tile([c, c + QUERY_OFFSET], (per_class, 1))
        parts.append(np.concatenate([ctx, tail], axis=1))
    return np.concatenate(parts).astype(np.int32)


def generate_batches(rng: np.random.RandomState, n_batches: int, batch_size: int, seq_len: int,
                     fixed_attention: bool = False) -> np.ndarray:
    """``n_batches`` consecutive online batches, stacked: int32 [n_batches, batch, seq_len].

    For ``fixed_attention`` the batch size is 4 * batch_size (class-balanced), matching the Figure-3 runs.
    """
    if not isinstance(n_batches, (int, np.integer)) or n_batches < 1:
        raise ValueError(f"n_batches: must be a positive int, got {n_batches!r}")
    if fixed_attention:
        return np.stack([generate_fixed_attention_batch(rng, batch_size, seq_len) for _ in range(n_batches)])
    # One random_sample call for all batches yields the same stream as n_batches sequential calls.
    _check(batch_size, seq_len)
    u_count = n_batches * batch_size
    seqs = generate_batch(rng, u_count, seq_len)
    return seqs.reshape(n_batches, batch_size, seq_len)


def split(seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs [..., seq_len-1], targets [...]) from full sequences [..., seq_len]."""
    return seqs[..., :-1], seqs[..., -1]


def distinct_mask(tokens):
    """Relevance mask of the synthetic task: token id > 9 (a class-specific token). Same shape as tokens."""
    return tokens > COMMON - 1
