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
no weight). Consecutive windows form batches, so a batch may span two epochs: row ``r`` of global batch ``i`` is
element ``i*B + r`` of the window stream, however many hosts there are. A host reads only its ``rows`` of each
global batch (``sharding.host_batch_rows``: any set of rows, since on a TPU pod a host's rows need not be one
block); the hosts that hold different rows read disjoint windows, and together exactly the single-host batches.
The stream is random access (:func:`train_batches`), its order a pure function of the seed, so its position is
the index of the next global batch, the training step: a checkpoint needs no iterator state, and a run resumes on
any number of hosts (``make_train_iterator(..., start=step)``). :func:`train_stream_spec` is what a checkpoint
records to refuse resuming into a different stream.

Evaluation (:func:`eval_batches`): the windows in order, so every token is predicted exactly once; the rows that
fill the last batch are padded with IGNORE_INDEX targets, so shapes stay static (no recompile) and every host runs
the same number of batches. Row ``r`` of evaluation batch ``b`` is window ``b*B + r``; a host reads its ``rows``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
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
        if not isinstance(t, np.ndarray):  # an array-like over files (prepared.ShardedTokens) pickles by file name
            return {"array": t, **common}
        return {"array": np.asarray(t), **common}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "memmap" in state:
            fn, dt, shape, offset = state["memmap"]
            tokens = np.memmap(fn, dtype=np.dtype(dt), mode="r", shape=shape, offset=offset)
        else:
            tokens = state["array"]
        self.__init__(tokens, state["seq_len"], state["bos_id"])  # type: ignore[misc]


def _check_common(tokens: np.ndarray, seq_len: int, batch_size: int) -> None:
    if np.ndim(tokens) != 1:
        raise CorpusError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
    if seq_len < 1 or batch_size < 1:
        raise CorpusError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len} batch_size={batch_size}")


def _host_rows(rows: Sequence[int] | np.ndarray | None, batch_size: int) -> np.ndarray | None:
    """``rows`` checked (ascending, distinct, in [0, batch_size)) as int64 [n], or None when it is every row."""
    if rows is None:
        return None
    r = np.asarray(rows, dtype=np.int64).reshape(-1)
    if r.size == 0 or r[0] < 0 or r[-1] >= batch_size or np.any(np.diff(r) <= 0):
        raise CorpusError(f"rows must be ascending distinct rows of the batch of {batch_size}, got {r.tolist()}")
    return None if r.size == batch_size else r


class _TakeRows:
    """A batch of window indices [B] -> this host's rows of it [n]."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __call__(self, windows: np.ndarray) -> np.ndarray:
        return np.asarray(windows)[self.rows]


def num_windows(num_tokens: int, seq_len: int, *, bos_id: int | None = None) -> int:
    """W, the windows of one epoch (and of one evaluation pass): ceil(targets / T)."""
    targets = num_tokens if bos_id is not None else max(num_tokens - 1, 0)
    return math.ceil(targets / seq_len)


def train_windows(tokens: np.ndarray, seq_len: int, seed: int, *, bos_id: int | None = None) -> grain.MapDataset:
    """The infinite, seeded stream of window indices (int64 scalars): element ``j`` of epoch ``e`` is window
    ``perm_e[j]``, ``perm_e`` a fresh permutation of range(W) each epoch. Exposed for tests and for custom batching;
    most callers want :func:`make_train_iterator`."""
    _check_common(tokens, seq_len, 1)
    n = int(tokens.shape[0])
    if n < (1 if bos_id is not None else 2):
        raise CorpusError(f"the training split has {n} token(s): nothing to train on")
    return grain.MapDataset.range(num_windows(n, seq_len, bos_id=bos_id)).seed(seed).shuffle().repeat()


def train_stream_spec(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, *,
                      bos_id: int | None = None) -> dict[str, Any]:
    """What determines the sequence of global batches of :func:`train_batches` besides the position: a checkpoint
    stores this, and resuming into a stream with another spec is refused (the step would index other windows).
    Independent of the hosts and their rows."""
    n = int(tokens.shape[0])
    return {"format": "windows-v2", "split_tokens": n, "seq_len": int(seq_len), "batch_size": int(batch_size),
            "seed": int(seed), "bos_id": None if bos_id is None else int(bos_id),
            "windows_per_epoch": num_windows(n, seq_len, bos_id=bos_id)}


def train_batches(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                  rows: Sequence[int] | np.ndarray | None = None, *, bos_id: int | None = None) -> grain.MapDataset:
    """The random-access dataset behind :func:`make_train_iterator`: element ``i`` is this host's ``rows`` of
    global batch ``i`` (``{"inputs", "targets"}`` [len(rows), T] int32; every row when ``rows`` is None). The
    training loop stacks one per seed (``train.num_seeds``)."""
    _check_common(tokens, seq_len, batch_size)
    mine = _host_rows(rows, batch_size)
    ds = train_windows(tokens, seq_len, seed, bos_id=bos_id).batch(batch_size, drop_remainder=True)
    if mine is not None:
        ds = ds.map(_TakeRows(mine))
    return ds.map(_Gather(tokens, seq_len, bos_id))


def make_train_iterator(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                        rows: Sequence[int] | np.ndarray | None = None, *, bos_id: int | None = None,
                        start: int = 0, num_threads: int = 2,
                        prefetch_buffer_size: int = 8) -> grain.DatasetIterator:
    """Infinite iterator of training batches for one host.

    Args:
      tokens: [N] token ids of the split (a ``TokenCache.tokens("train")`` memmap or any 1-D integer array).
      seq_len: T, the model's context length.
      batch_size: B, rows per *global* batch (all hosts together).
      seed: same seed -> same stream; checkpoint the iterator, not the seed, to resume mid-run.
      rows: the rows of each global batch this host reads, ascending (``sharding.host_batch_rows``); None = all.
      bos_id: the end-of-text id to put before the split, so that all N tokens are targets (module docstring).
      start: the global batch to begin with: a resumed run's step.
      num_threads, prefetch_buffer_size: grain ``ReadOptions``; each element is a whole batch, gathered with one
        vectorised index, so two threads already far exceed what a CPU-scale model consumes.

    Returns:
      A ``grain.DatasetIterator`` yielding ``{"inputs": [n, T] int32, "targets": [n, T] int32}``, n = len(rows);
      its first element is global batch ``start``.
    """
    ds = train_batches(tokens, seq_len, batch_size, seed, rows, bos_id=bos_id)[start:]
    read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    return iter(ds.to_iter_dataset(read))


def num_eval_batches(num_tokens: int, seq_len: int, batch_size: int, *, bos_id: int | None = None) -> int:
    """Batches of ``batch_size`` global rows that :func:`eval_batches` yields (identical on every host)."""
    return math.ceil(num_windows(num_tokens, seq_len, bos_id=bos_id) / batch_size)


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, *, bos_id: int | None = None,
                 rows: Sequence[int] | np.ndarray | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Deterministic evaluation batches: strided non-overlapping windows, each token predicted exactly once.

    With ``bos_id`` (pass the tokenizer's ``eot_id``), the stream is ``[bos_id] + tokens`` and all N tokens are
    targets, the first one predicted from the document separator as a real document start would be; without it the
    first token is context only and N - 1 tokens are targets. Window ``k`` has inputs ``stream[kT : kT+T]`` and
    targets ``stream[kT+1 : kT+T+1]``. Row ``r`` of global batch ``b`` is window ``b*B + r`` (B = ``batch_size``);
    a host reads only its ``rows`` of each (``sharding.host_batch_rows``; None = every row).

    Yields:
      ``{"inputs": [n, T] int32, "targets": [n, T] int32}``, n = len(rows); padding has inputs 0 and targets
      IGNORE_INDEX. Sum ``targets != IGNORE_INDEX`` over all batches of the hosts that hold distinct rows to get the
      number of scored tokens.
    """
    _check_common(tokens, seq_len, batch_size)
    mine = _host_rows(rows, batch_size)
    n = int(tokens.shape[0])
    stream_len = n + (1 if bos_id is not None else 0)
    if stream_len < 2:
        raise CorpusError(f"the split has {n} token(s): nothing to evaluate")
    windows = num_windows(n, seq_len, bos_id=bos_id)
    rows_here = np.arange(batch_size) if mine is None else mine
    for b in range(num_eval_batches(n, seq_len, batch_size, bos_id=bos_id)):
        wanted = b * batch_size + rows_here
        # Rows past the last window are padding; they come last because the rows are ascending.
        yield _window_batch(tokens, wanted[wanted < windows], seq_len, bos_id, rows_here.size)
