"""grain input pipeline over a flat token array: random windows for training, strided windows for evaluation.

Every batch is a dict of numpy arrays::

    inputs   [B, T] int32   token ids
    targets  [B, T] int32   the next token for each input position; IGNORE_INDEX (-100) = not scored

Training (:func:`make_train_iterator`): the split is cut into ``S = (N - 1) // T`` slots of T tokens; one epoch
visits every slot once in a seeded shuffled order (reshuffled each epoch, infinite), and each visit reads the
T + 1 tokens starting at a random offset inside its slot, so windows cover the whole split each epoch without always
starting at the same positions. Per-host slicing ``[process_index::process_count]`` happens after the random offset
is drawn, so the hosts' streams are disjoint and together are exactly the single-host stream. The iterator is a
``grain.DatasetIterator``: ``get_state()/set_state()`` and ``grain.checkpoint.CheckpointSave/CheckpointRestore``
(orbax) restore it exactly.

Evaluation (:func:`eval_batches`): non-overlapping windows at stride T, so every token is predicted exactly once;
the last partial window and the rows that fill the last batch are padded with IGNORE_INDEX targets, so shapes stay
static (no recompile) and every host runs the same number of batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from coupled_qk_jax.data.corpora import CorpusError

IGNORE_INDEX = -100


class _Gather:
    """Turns a batch of window starts [B] into {"inputs", "targets"} [B, T]; vectorised (one fancy index per batch).

    Picklable without copying the tokens: a memmap is reopened from its file in the receiving process, which matters
    if the pipeline is later moved to grain worker processes.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def __call__(self, starts: np.ndarray) -> dict[str, np.ndarray]:
        idx = np.asarray(starts, dtype=np.int64)[:, None] + self._offsets  # [B, T+1]
        win = np.asarray(self.tokens[idx], dtype=np.int32)
        return {"inputs": win[:, :-1], "targets": win[:, 1:]}

    def __getstate__(self) -> dict[str, Any]:
        t = self.tokens
        if isinstance(t, np.memmap) and t.filename is not None:
            return {"memmap": (t.filename, t.dtype.str, t.shape, t.offset), "seq_len": self.seq_len}
        return {"array": np.asarray(t), "seq_len": self.seq_len}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "memmap" in state:
            fn, dt, shape, offset = state["memmap"]
            tokens = np.memmap(fn, dtype=np.dtype(dt), mode="r", shape=shape, offset=offset)
        else:
            tokens = state["array"]
        self.__init__(tokens, state["seq_len"])  # type: ignore[misc]


def _check_common(tokens: np.ndarray, seq_len: int, batch_size: int, process_index: int, process_count: int) -> None:
    if np.ndim(tokens) != 1:
        raise CorpusError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
    if seq_len < 1 or batch_size < 1:
        raise CorpusError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len} batch_size={batch_size}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise CorpusError(f"process_index {process_index} is not in [0, process_count={process_count})")


def num_train_slots(num_tokens: int, seq_len: int) -> int:
    """Windows per epoch: non-overlapping T-token slots, keeping one token for the last target."""
    return (num_tokens - 1) // seq_len


def train_window_starts(tokens: np.ndarray, seq_len: int, seed: int, process_index: int = 0,
                        process_count: int = 1) -> grain.MapDataset:
    """The infinite, seeded stream of this host's window start positions (int64 scalars); element ``j`` of epoch
    ``e`` is slot ``perm_e[j]``. Exposed for tests and for custom batching; most callers want
    :func:`make_train_iterator`."""
    _check_common(tokens, seq_len, 1, process_index, process_count)
    n = int(tokens.shape[0])
    if n < seq_len + 1:
        raise CorpusError(f"seq_len {seq_len} needs at least {seq_len + 1} tokens, but the split has {n}")
    slots = num_train_slots(n, seq_len)
    last_start = n - seq_len - 1

    def start_of(slot: int, rng: np.random.Generator) -> np.int64:
        # A random offset inside the slot; the last slot is clipped so the window (and its target) stays in range.
        return np.int64(min(int(slot) * seq_len + int(rng.integers(0, seq_len)), last_start))

    ds = grain.MapDataset.range(slots).seed(seed).shuffle().repeat().random_map(start_of)
    return ds[process_index::process_count]


def make_train_iterator(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                        process_count: int = 1, *, num_threads: int = 2,
                        prefetch_buffer_size: int = 8) -> grain.DatasetIterator:
    """Infinite iterator of training batches for one host.

    Args:
      tokens: [N] token ids of the split (a ``TokenCache.tokens("train")`` memmap or any 1-D integer array).
      seq_len: T, the model's context length; each window reads T + 1 tokens.
      batch_size: rows per batch *on this host* (the global batch is ``batch_size * process_count``).
      seed: same seed -> same stream; checkpoint the iterator, not the seed, to resume mid-run.
      process_index, process_count: ``jax.process_index()``, ``jax.process_count()``.
      num_threads, prefetch_buffer_size: grain ``ReadOptions``; each element is a whole batch, gathered with one
        vectorised index, so two threads already far exceed what a CPU-scale model consumes.

    Returns:
      A ``grain.DatasetIterator`` yielding ``{"inputs": [B, T] int32, "targets": [B, T] int32}``; it supports
      ``get_state()/set_state()`` and ``grain.checkpoint.CheckpointSave/CheckpointRestore``.
    """
    ds = train_batches(tokens, seq_len, batch_size, seed, process_index, process_count)
    read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    return iter(ds.to_iter_dataset(read))


def train_batches(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1) -> grain.MapDataset:
    """The random-access dataset behind :func:`make_train_iterator`: element ``i`` is this host's batch ``i``
    (``{"inputs", "targets"}`` [batch_size, T] int32). The training loop stacks one per seed (``train.num_seeds``)."""
    _check_common(tokens, seq_len, batch_size, process_index, process_count)
    return (train_window_starts(tokens, seq_len, seed, process_index, process_count)
            .batch(batch_size, drop_remainder=True)
            .map(_Gather(tokens, seq_len)))


def num_eval_batches(num_tokens: int, seq_len: int, batch_size: int, *, bos_id: int | None = None,
                     process_count: int = 1) -> int:
    """Batches each host gets from :func:`eval_batches` (identical on every host)."""
    stream = num_tokens + (1 if bos_id is not None else 0)
    windows = math.ceil((stream - 1) / seq_len)
    return math.ceil(math.ceil(windows / process_count) / batch_size)


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, *, bos_id: int | None = None,
                 process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Deterministic evaluation batches: strided non-overlapping windows, each token predicted exactly once.

    With ``bos_id`` (pass the tokenizer's ``eot_id``), the stream is ``[bos_id] + tokens`` and all N tokens are
    targets, the first one predicted from the document separator as a real document start would be; without it the
    first token is context only and N - 1 tokens are targets. Window ``k`` has inputs ``stream[kT : kT+T]`` and
    targets ``stream[kT+1 : kT+T+1]``. Window ``k`` goes to host ``k % process_count``.

    Yields:
      ``{"inputs": [B, T] int32, "targets": [B, T] int32}``; padding has inputs 0 and targets IGNORE_INDEX. Sum
      ``targets != IGNORE_INDEX`` over all batches of all hosts to get the number of scored tokens.
    """
    _check_common(tokens, seq_len, batch_size, process_index, process_count)
    n = int(tokens.shape[0])
    stream_len = n + (1 if bos_id is not None else 0)
    if stream_len < 2:
        raise CorpusError(f"the split has {n} token(s): nothing to evaluate")
    windows = math.ceil((stream_len - 1) / seq_len)
    mine = np.arange(process_index, windows, process_count)
    n_batches = num_eval_batches(n, seq_len, batch_size, bos_id=bos_id, process_count=process_count)
    offsets = np.arange(seq_len + 1, dtype=np.int64)
    for b in range(n_batches):
        rows = mine[b * batch_size:(b + 1) * batch_size]
        win = np.full((batch_size, seq_len + 1), -1, dtype=np.int64)
        if rows.size:
            pos = rows[:, None] * seq_len + offsets - (1 if bos_id is not None else 0)  # token index; -1 = bos
            valid = pos < n
            vals = np.asarray(tokens[np.clip(pos, 0, n - 1)], dtype=np.int64)
            if bos_id is not None:
                vals = np.where(pos == -1, bos_id, vals)
            win[: rows.size] = np.where(valid, vals, -1)
        inputs = np.where(win[:, :-1] >= 0, win[:, :-1], 0).astype(np.int32)
        targets = np.where(win[:, 1:] >= 0, win[:, 1:], IGNORE_INDEX).astype(np.int32)
        yield {"inputs": inputs, "targets": targets}
