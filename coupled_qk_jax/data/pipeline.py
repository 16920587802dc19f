"""grain input pipeline over a flat token array: shuffled windows for training, strided windows for evaluation.

Every batch is a dict of numpy arrays::

    inputs   [B, T] int32   token ids
    targets  [B, T] int32   the next token for each input position; IGNORE_INDEX (-100) = not scored

Both paths cut the same stream into the same windows. With ``bos_id`` (the loop passes the tokenizer's
end-of-text id) the stream is ``[bos_id] + tokens`` and all N tokens of the split are targets, the first one
predicted from the document separator as a real document start would be; without it the first token is context
only and N - 1 tokens are targets. Window ``k`` has inputs ``stream[kT : kT+T]`` and targets
``stream[kT+1 : kT+T+1]``: ``W = ceil(targets / T)`` non-overlapping windows, the last one holding the remaining
``targets mod T`` targets and IGNORE_INDEX padding after them.

Training (:func:`make_train_iterator`): one epoch is the W windows in a seeded random order, reshuffled every
epoch (infinite), so **an epoch makes every token of the split a target exactly once**; the remainder is not
dropped but trained on as the one partly padded window (the loss is a mean over scored tokens, so padding carries
no weight). Consecutive windows form batches, so a batch may span two epochs. Per-host slicing
``[process_index::process_count]`` of the window stream makes the hosts' streams disjoint; together they are
exactly the single-host stream. The iterator is a ``grain.DatasetIterator``: ``get_state()/set_state()`` and
``grain.checkpoint.CheckpointSave/CheckpointRestore`` (orbax) restore it exactly; :func:`train_stream_spec` is
what a checkpoint records beside that state to refuse restoring it into a different stream.

Evaluation (:func:`eval_batches`): the windows in order, so every token is predicted exactly once; the rows that
fill the last batch are padded with IGNORE_INDEX targets, so shapes stay static (no recompile) and every host runs
the same number of batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from coupled_qk_jax.data import IGNORE_INDEX
from coupled_qk_jax.data.corpora import CorpusError


def _window_batch(tokens: np.ndarray, windows: np.ndarray, seq_len: int, bos_id: int | None,
                  rows: int) -> dict[str, np.ndarray]:
    """Windows ``windows`` [n <= rows] of the stream as a padded batch of ``rows`` rows (see the module docstring)."""
    n = int(tokens.shape[0])
    offsets = np.arange(seq_len + 1, dtype=np.int64)
    win = np.full((rows, seq_len + 1), -1, dtype=np.int64)
    if windows.size:
        pos = windows[:, None] * seq_len + offsets - (1 if bos_id is not None else 0)  # token index; -1 = bos
        vals = np.asarray(tokens[np.clip(pos, 0, n - 1)], dtype=np.int64)
        if bos_id is not None:
            vals = np.where(pos == -1, bos_id, vals)
        win[: windows.size] = np.where(pos < n, vals, -1)
    inputs = np.where(win[:, :-1] >= 0, win[:, :-1], 0).astype(np.int32)
    targets = np.where(win[:, 1:] >= 0, win[:, 1:], IGNORE_INDEX).astype(np.int32)
    return {"inputs": inputs, "targets": targets}


class _Gather:
    """Turns a batch of window indices [B] into {"inputs", "targets"} [B, T]; vectorised (one fancy index per batch).

    Picklable without copying the tokens: a memmap is reopened from its file in the receiving process, which matters
    if the pipeline is later moved to grain worker processes.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, bos_id: int | None = None) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.bos_id = bos_id

    def __call__(self, windows: np.ndarray) -> dict[str, np.ndarray]:
        w = np.asarray(windows, dtype=np.int64).reshape(-1)
        return _window_batch(self.tokens, w, self.seq_len, self.bos_id, w.size)

    def __getstate__(self) -> dict[str, Any]:
        t = self.tokens
        common = {"seq_len": self.seq_len, "bos_id": self.bos_id}
        if isinstance(t, np.memmap) and t.filename is not None:
            return {"memmap": (t.filename, t.dtype.str, t.shape, t.offset), **common}
        return {"array": np.asarray(t), **common}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "memmap" in state:
            fn, dt, shape, offset = state["memmap"]
            tokens = np.memmap(fn, dtype=np.dtype(dt), mode="r", shape=shape, offset=offset)
        else:
            tokens = state["array"]
        self.__init__(tokens, state["seq_len"], state["bos_id"])  # type: ignore[misc]


def _check_common(tokens: np.ndarray, seq_len: int, batch_size: int, process_index: int, process_count: int) -> None:
    if np.ndim(tokens) != 1:
        raise CorpusError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
    if seq_len < 1 or batch_size < 1:
        raise CorpusError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len} batch_size={batch_size}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise CorpusError(f"process_index {process_index} is not in [0, process_count={process_count})")


def num_windows(num_tokens: int, seq_len: int, *, bos_id: int | None = None) -> int:
    """W, the windows of one epoch (and of one evaluation pass): ceil(targets / T)."""
    targets = num_tokens if bos_id is not None else max(num_tokens - 1, 0)
    return math.ceil(targets / seq_len)


def train_windows(tokens: np.ndarray, seq_len: int, seed: int, process_index: int = 0, process_count: int = 1, *,
                  bos_id: int | None = None) -> grain.MapDataset:
    """The infinite, seeded stream of this host's window indices (int64 scalars): element ``j`` of epoch ``e`` of
    the single-host stream is window ``perm_e[j]``, ``perm_e`` a fresh permutation of range(W) each epoch. Exposed
    for tests and for custom batching; most callers want :func:`make_train_iterator`."""
    _check_common(tokens, seq_len, 1, process_index, process_count)
    n = int(tokens.shape[0])
    if n < (1 if bos_id is not None else 2):
        raise CorpusError(f"the training split has {n} token(s): nothing to train on")
    ds = grain.MapDataset.range(num_windows(n, seq_len, bos_id=bos_id)).seed(seed).shuffle().repeat()
    return ds[process_index::process_count]


def train_stream_spec(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                      process_count: int = 1, *, bos_id: int | None = None) -> dict[str, Any]:
    """What determines the batch stream of :func:`make_train_iterator` besides its position: a checkpoint stores
    this beside the iterator state, and restoring into a stream with another spec is refused (the saved position
    would silently index other windows)."""
    n = int(tokens.shape[0])
    return {"format": "windows-v2", "split_tokens": n, "seq_len": int(seq_len), "batch_size_per_host": int(batch_size),
            "seed": int(seed), "process_index": int(process_index), "process_count": int(process_count),
            "bos_id": None if bos_id is None else int(bos_id),
            "windows_per_epoch": num_windows(n, seq_len, bos_id=bos_id)}


def train_batches(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1, *, bos_id: int | None = None) -> grain.MapDataset:
    """The random-access dataset behind :func:`make_train_iterator`: element ``i`` is this host's batch ``i``
    (``{"inputs", "targets"}`` [batch_size, T] int32). The training loop stacks one per seed (``train.num_seeds``)."""
    _check_common(tokens, seq_len, batch_size, process_index, process_count)
    return (train_windows(tokens, seq_len, seed, process_index, process_count, bos_id=bos_id)
            .batch(batch_size, drop_remainder=True)
            .map(_Gather(tokens, seq_len, bos_id)))


def make_train_iterator(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                        process_count: int = 1, *, bos_id: int | None = None, num_threads: int = 2,
                        prefetch_buffer_size: int = 8) -> grain.DatasetIterator:
    """Infinite iterator of training batches for one host.

    Args:
      tokens: [N] token ids of the split (a ``TokenCache.tokens("train")`` memmap or any 1-D integer array).
      seq_len: T, the model's context length.
      batch_size: rows per batch *on this host* (the global batch is ``batch_size * process_count``).
      seed: same seed -> same stream; checkpoint the iterator, not the seed, to resume mid-run.
      process_index, process_count: ``jax.process_index()``, ``jax.process_count()``.
      bos_id: the end-of-text id to put before the split, so that all N tokens are targets (module docstring).
      num_threads, prefetch_buffer_size: grain ``ReadOptions``; each element is a whole batch, gathered with one
        vectorised index, so two threads already far exceed what a CPU-scale model consumes.

    Returns:
      A ``grain.DatasetIterator`` yielding ``{"inputs": [B, T] int32, "targets": [B, T] int32}``; it supports
      ``get_state()/set_state()`` and ``grain.checkpoint.CheckpointSave/CheckpointRestore``.
    """
    ds = train_batches(tokens, seq_len, batch_size, seed, process_index, process_count, bos_id=bos_id)
    read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    return iter(ds.to_iter_dataset(read))


def num_eval_batches(num_tokens: int, seq_len: int, batch_size: int, *, bos_id: int | None = None,
                     process_count: int = 1) -> int:
    """Batches each host gets from :func:`eval_batches` (identical on every host)."""
    windows = num_windows(num_tokens, seq_len, bos_id=bos_id)
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
    windows = num_windows(n, seq_len, bos_id=bos_id)
    mine = np.arange(process_index, windows, process_count)
    n_batches = num_eval_batches(n, seq_len, batch_size, bos_id=bos_id, process_count=process_count)
    for b in range(n_batches):
        yield _window_batch(tokens, mine[b * batch_size:(b + 1) * batch_size], seq_len, bos_id, batch_size)
