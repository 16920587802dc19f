"""MQAR: multi-query associative recall (Arora, Eyuboglu et al., "Zoology", ICLR 2024).

This module is the project's port of zoology's generator, segments, batching and metric, written from the
project spec (``specs/mqar.md``), not from zoology's source. What it provides:

* :func:`multiquery_ar` -- one segment of examples, ``(inputs, labels)`` as int64 arrays ``[n, L]``. With
  ``random_non_queries=False`` it reproduces zoology's arrays draw for draw (same RNG, same call order).
* :func:`segment_seeds`, :class:`MQARSegment`, :func:`make_segments` -- zoology's per-segment seed derivation;
  :func:`validation_seeds` -- the seeds of a validation split, which zoology does not have.
* :func:`overlapping_rows` -- the examples two splits share, by content (a validation or test set must share none).
* :data:`LEVELS` (``easy`` / ``medium`` / ``hard``, sized for a CPU), :data:`ZOOLOGY_LEVELS` (the same (L, N) at
  ICLR'24 Figure 2's sizes) and :data:`PROTOCOLS` (both by name); each level an :class:`MQARMix` of one segment per split.
* :func:`make_batches` -- single-segment batches, optional right padding, padded last batch.
* :func:`per_example_accuracy`, :class:`MQARAccuracy` -- zoology's pooled per-example
  accuracy with the ``valid/accuracy`` and ``valid/num_kv_pairs/accuracy-{N}`` names.

Deviations from zoology (also listed in ``docs/mqar.md``):

1. Fillers (``random_non_queries=True``) come from ``np.random.default_rng(seed)`` instead of torch's global RNG,
   so a segment is a pure function of (config, seed). Zoology's fillers cannot be reproduced without torch.
2. Batches may be right-padded to a common length and partial last batches are padded with all-``-100`` rows;
   zoology instead compiles nothing and just feeds ragged batches. Neither changes the metric (padding rows are
   excluded; right padding does not change causal logits at real positions).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from coupled_qk_jax.data import IGNORE_INDEX

PAD_TOKEN = 0
"""Token used for right padding; it is also MQAR's blank token."""

ZOOLOGY_VOCAB_SIZE = 8192
ZOOLOGY_DATA_SEED = 123


# ---------------------------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; True as a sequence length is always a bug.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_config(
    vocab_size: int,
    num_examples: int,
    input_seq_len: int,
    num_kv_pairs: int,
    num_passes: int = 1,
    power_a: float = 0.01,
    seed: int = 0,
) -> None:
    """Validate an MQAR configuration up front (spec §1), raising a one-line ``ValueError`` naming the field.

    Constraints: ``input_seq_len`` even, ``vocab_size > input_seq_len``, ``2·N·P + 2·N <= input_seq_len``,
    ``power_a > 0`` and a seed usable by ``np.random.RandomState`` (``0 <= seed < 2**32``).
    """
    _check_int("vocab_size", vocab_size, 1)
    _check_int("num_examples", num_examples, 1)
    _check_int("input_seq_len", input_seq_len, 2)
    _check_int("num_kv_pairs", num_kv_pairs, 1)
    _check_int("num_passes", num_passes, 1)
    _check_int("seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(f"seed must be < 2**32 (numpy RandomState), got {seed}")
    if input_seq_len % 2 != 0:
        raise ValueError(f"input_seq_len must be even, got {input_seq_len}")
    if vocab_size <= input_seq_len:
        raise ValueError(
            f"vocab_size must be > input_seq_len, got vocab_size={vocab_size}, input_seq_len={input_seq_len}"
        )
    need = 2 * num_kv_pairs * num_passes + 2 * num_kv_pairs
    if need > input_seq_len:
        raise ValueError(
            f"num_kv_pairs too large: 2*N*P + 2*N = {need} > input_seq_len={input_seq_len} "
            f"(N={num_kv_pairs}, P={num_passes})"
        )
    if isinstance(power_a, bool) or not isinstance(power_a, (int, float, np.floating, np.integer)):
        raise ValueError(f"power_a must be a float, got {type(power_a).__name__} {power_a!r}")
    if not (math.isfinite(float(power_a)) and float(power_a) > 0):
        raise ValueError(f"power_a must be finite and > 0, got {power_a}")


# ---------------------------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------------------------


def gap_distribution(space: int, power_a: float) -> np.ndarray:
    """Probabilities ``p[j-1] ∝ a · j^(a-1)`` for ``j = 1..space`` (spec §3 step 5). Shape ``[space]``, float64.

    With ``a = 0.01`` this is a steep power law favouring small gaps; ``a = 1`` is uniform.
    """
    x = np.arange(1, space + 1, dtype=np.float64)
    w = power_a * x ** (power_a - 1)
    return w / w.sum()


def multiquery_ar(
    vocab_size: int,
    num_examples: int,
    input_seq_len: int,
    seed: int,
    power_a: float = 0.01,
    num_kv_pairs: int = 8,
    random_non_queries: bool = True,
    num_passes: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Generate one MQAR segment.

    Each example is a key-value block ``k_1 v_1 … k_N v_N`` (tiled ``num_passes`` times) followed by a query
    region in which every key appears exactly once, at an even offset ``2·gap`` whose gap follows a power law.
    The label at a query position is the value paired with the queried key; every other label is ``-100``.

    Keys come from ``1 .. V//2 − 1``, values from ``V//2 .. V − 1``, distinct within an example; ``0`` is the
    blank token.

    RNG (spec §3): ``rs = np.random.RandomState(seed)`` draws, in this order, all key rows (one ``rs.choice`` per
    example), then all value rows, then all gap rows. With ``random_non_queries=False`` the output therefore equals
    zoology's ``multiquery_ar`` bit for bit. Note that example ``i`` depends on ``num_examples``.

    Deviation (``random_non_queries=True``): zoology replaces the blanks with ``torch.randint`` draws from torch's
    global RNG (seeded per run, not per segment). Here the fillers are drawn from a separate
    ``np.random.default_rng(seed)`` after the structure is built: a full ``[n, L]`` array of uniform tokens in
    ``[0, V)`` whose entries are used where ``inputs == 0``. Fillers may be 0, keys or values (distractors);
    labels never change.

    Args:
      vocab_size: V, must exceed ``input_seq_len``.
      num_examples: n, examples in the segment.
      input_seq_len: L, even.
      seed: segment seed, ``0 <= seed < 2**32``.
      power_a: exponent ``a > 0`` of the gap power law.
      num_kv_pairs: N; requires ``2·N·P + 2·N <= L``.
      random_non_queries: replace blanks by random filler tokens.
      num_passes: P, copies of the KV block.

    Returns:
      ``(inputs, labels)``, both int64 ``[num_examples, input_seq_len]``.
    """
    check_config(vocab_size, num_examples, input_seq_len, num_kv_pairs, num_passes, power_a, seed)
    V, n, L, N, P = int(vocab_size), int(num_examples), int(input_seq_len), int(num_kv_pairs), int(num_passes)
    C = 2 * N * P
    space = (L - C) // 2

    rs = np.random.RandomState(seed)
    key_choices = np.arange(1, V // 2)
    value_choices = np.arange(V // 2, V)
    # The call order is the parity contract: every key row, then every value row, then every gap row. Batching the
    # draws (e.g. one rs.choice for all rows) would consume the RNG stream differently.
    keys = np.stack([rs.choice(key_choices, N, replace=False) for _ in range(n)])
    values = np.stack([rs.choice(value_choices, N, replace=False) for _ in range(n)])

    kv = np.zeros((n, 2 * N), dtype=np.int64)
    kv[:, 0::2] = keys
    kv[:, 1::2] = values
    kv = np.tile(kv, (1, P))  # [n, C]

    p = gap_distribution(space, power_a)
    gaps = np.stack([rs.choice(np.arange(space), N, replace=False, p=p) for _ in range(n)])  # [n, N]

    rows = np.arange(n)[:, None]
    queries = np.zeros((n, L - C + 1), dtype=np.int64)
    queries[rows, 2 * gaps] = keys
    seq = np.concatenate([kv, queries], axis=1)  # [n, L + 1]

    lab = np.full((n, L + 1), IGNORE_INDEX, dtype=np.int64)
    lab[rows, C + 2 * gaps + 1] = values

    inputs = seq[:, :L].copy()
    labels = lab[:, 1:].copy()

    if random_non_queries:
        rng = np.random.default_rng(seed)
        fillers = rng.integers(0, V, size=(n, L), dtype=np.int64)
        blank = inputs == 0
        inputs[blank] = fillers[blank]
    return inputs, labels


# ---------------------------------------------------------------------------------------------------------------
# Segments and seeds
# ---------------------------------------------------------------------------------------------------------------


def segment_seeds(n_train: int, n_test: int, seed: int = ZOOLOGY_DATA_SEED) -> tuple[list[int], list[int]]:
    """Zoology's per-segment seeds (spec §5).

    Equivalent to ``np.random.seed(seed)`` followed by ``randint(0, 2**31, size=n_train)`` and
    ``randint(2**31, 2**32, size=n_test)``, but on a private ``RandomState`` so the global RNG is untouched. Train
    seeds lie in ``[0, 2**31)`` and test seeds in ``[2**31, 2**32)``, so the two never collide.

    Returns:
      ``(train_seeds, test_seeds)`` as lists of Python ints of lengths ``n_train`` and ``n_test``.
    """
    _check_int("n_train", n_train, 0)
    _check_int("n_test", n_test, 0)
    _check_int("seed", seed, 0)
    rs = np.random.RandomState(seed)
    train = rs.randint(0, 2**31, size=n_train)
    test = rs.randint(2**31, 2**32, size=n_test)
    return [int(s) for s in train], [int(s) for s in test]


def validation_seeds(n_train: int, n_test: int, n_valid: int, seed: int = ZOOLOGY_DATA_SEED) -> list[int]:
    """Seeds of ``n_valid`` validation segments, a split zoology does not have.

    They are the third draw of the same private ``RandomState(seed)``, after zoology's train and test draws (so
    those stay zoology's seeds): ``randint(2**31, 2**32, size=n_valid)``, the held-out half of the 32-bit seed
    space, with any draw equal to a train or test seed drawn again. Distinct seeds do not by themselves make the
    examples distinct; :func:`overlapping_rows` checks that by content (``training/tasks.py`` refuses an overlap).

    Returns:
      ``n_valid`` Python ints in ``[2**31, 2**32)``, none equal to a train or test seed.
    """
    _check_int("n_train", n_train, 0)
    _check_int("n_test", n_test, 0)
    _check_int("n_valid", n_valid, 0)
    _check_int("seed", seed, 0)
    rs = np.random.RandomState(seed)
    taken = {int(s) for s in rs.randint(0, 2**31, size=n_train)} | {int(s) for s in rs.randint(2**31, 2**32,
                                                                                                size=n_test)}
    out: list[int] = []
    while len(out) < n_valid:
        s = int(rs.randint(2**31, 2**32))
        if s not in taken:
            taken.add(s)
            out.append(s)
    return out


def overlapping_rows(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Indices of the examples of split ``a`` that also occur in split ``b``, by content.

    An example is its ``(inputs, labels)`` row pair; two are the same when every token and label agrees (rows of
    different lengths never agree). ``a`` and ``b`` are ``(inputs, labels)`` pairs of ``[n, L]`` arrays.

    Returns:
      int64 ``[k]``, the sorted row indices into ``a`` (empty when the splits are disjoint).
    """
    def keys(split: tuple[np.ndarray, np.ndarray]) -> list[bytes]:
        x, y = (np.ascontiguousarray(np.asarray(v, np.int64)) for v in split)
        both = np.concatenate([x, y], axis=1)
        return [row.tobytes() for row in both]

    other = set(keys(b))
    return np.asarray([i for i, k in enumerate(keys(a)) if k in other], dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class MQARSegment:
    """One segment: ``num_examples`` examples of a single (L, N), generated with their own seed.

    Attributes:
      L: ``input_seq_len``.
      N: ``num_kv_pairs``.
      num_examples: examples in the segment.
      seed: segment seed (from :func:`segment_seeds`).
      fillers: ``random_non_queries``.
      vocab_size, power_a, num_passes: as in :func:`multiquery_ar`.
    """

    L: int
    N: int
    num_examples: int
    seed: int
    fillers: bool = True
    vocab_size: int = ZOOLOGY_VOCAB_SIZE
    power_a: float = 0.01
    num_passes: int = 1

    def __post_init__(self) -> None:
        check_config(self.vocab_size, self.num_examples, self.L, self.N, self.num_passes, self.power_a, self.seed)

    def generate(self) -> tuple[np.ndarray, np.ndarray]:
        """``(inputs, labels)``, int64 ``[num_examples, L]``; a pure function of the fields."""
        return multiquery_ar(
            vocab_size=self.vocab_size,
            num_examples=self.num_examples,
            input_seq_len=self.L,
            seed=self.seed,
            power_a=self.power_a,
            num_kv_pairs=self.N,
            random_non_queries=self.fillers,
            num_passes=self.num_passes,
        )


def _check_specs(name: str, specs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, (tuple, list)) or len(spec) != 3:
            raise ValueError(f"{name}[{i}] must be an (L, N, num_examples) triple, got {spec!r}")
        out.append((int(spec[0]), int(spec[1]), int(spec[2])))
    return out


def make_segments(
    train: Sequence[tuple[int, int, int]],
    test: Sequence[tuple[int, int, int]],
    *,
    vocab_size: int = ZOOLOGY_VOCAB_SIZE,
    fillers: bool = True,
    power_a: float = 0.01,
    num_passes: int = 1,
    seed: int = ZOOLOGY_DATA_SEED,
) -> tuple[list[MQARSegment], list[MQARSegment]]:
    """Build train and test segments from ``(L, N, num_examples)`` triples, with zoology's seed derivation.

    Segment ``i`` of ``train`` gets ``segment_seeds(len(train), len(test), seed)[0][i]``, likewise for test, so the
    seeds (hence, with fillers off, the data) match zoology's for the same config lists and ``seed``.
    """
    train_specs = _check_specs("train", train)
    test_specs = _check_specs("test", test)
    train_seeds, test_seeds = segment_seeds(len(train_specs), len(test_specs), seed)

    def build(specs: list[tuple[int, int, int]], seeds: list[int]) -> list[MQARSegment]:
        return [
            MQARSegment(L=L, N=N, num_examples=n, seed=s, fillers=fillers, vocab_size=vocab_size,
                        power_a=power_a, num_passes=num_passes)
            for (L, N, n), s in zip(specs, seeds)
        ]

    return build(train_specs, train_seeds), build(test_specs, test_seeds)


# ---------------------------------------------------------------------------------------------------------------
# Levels and presets
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MQARMix:
    """A train/test mix of segments (zoology's ``DataConfig``): lists of ``(L, N, num_examples)`` triples.

    ``max_seq_len`` is the largest L over both splits, the natural ``pad_to`` for one compiled step.
    """

    name: str
    train: tuple[tuple[int, int, int], ...]
    test: tuple[tuple[int, int, int], ...]
    vocab_size: int = ZOOLOGY_VOCAB_SIZE
    fillers: bool = True
    power_a: float = 0.01
    train_batch_size: int = 256
    test_batch_size: int = 32
    seed: int = ZOOLOGY_DATA_SEED
    valid: tuple[tuple[int, int, int], ...] = ()  # validation (L, N, num_examples); zoology has none

    @property
    def max_seq_len(self) -> int:
        return max(L for L, _, _ in (*self.train, *self.valid, *self.test))

    def segments(self) -> tuple[list[MQARSegment], list[MQARSegment]]:
        """``(train_segments, test_segments)`` via :func:`make_segments`."""
        return make_segments(self.train, self.test, vocab_size=self.vocab_size, fillers=self.fillers,
                             power_a=self.power_a, seed=self.seed)

    def validation_segments(self) -> list[MQARSegment]:
        """The validation segments, seeded by :func:`validation_seeds` (their own draw, after train and test)."""
        specs = _check_specs("valid", self.valid)
        seeds = validation_seeds(len(self.train), len(self.test), len(specs), self.seed)
        return [MQARSegment(L=L, N=N, num_examples=n, seed=s, fillers=self.fillers, vocab_size=self.vocab_size,
                            power_a=self.power_a) for (L, N, n), s in zip(specs, seeds)]


@dataclasses.dataclass(frozen=True)
class MQARLevel:
    """A single-difficulty MQAR setting (train, validation and test share (L, N), as in ICLR'24 Fig. 2).

    Attributes:
      name: level name.
      seq_len: L.
      num_kv_pairs: N.
      d_model: model width (Figure 2's smallest, 64; Figure 2 sweeps 64-512).
      vocab_size: V (the CPU levels use 512 instead of zoology's 8192 so the tied LM head does not dominate CPU
        time; see docs).
      num_train, num_test: examples per split (Figure 2 uses 100k / 3k).
      train_batch_size, test_batch_size: batch sizes (the validation split uses the test batch size).
      fillers: ``random_non_queries`` (off, as in Figure 2).
      num_valid: validation examples (a split of our own, :func:`validation_seeds`; zoology has none).
    """

    name: str
    seq_len: int
    num_kv_pairs: int
    d_model: int
    vocab_size: int
    num_train: int
    num_test: int
    train_batch_size: int
    test_batch_size: int
    fillers: bool = False
    num_valid: int = 1_000

    def mix(self, seed: int = ZOOLOGY_DATA_SEED) -> MQARMix:
        """This level as an :class:`MQARMix` of one train, one validation and one test segment."""
        return MQARMix(
            name=self.name,
            train=((self.seq_len, self.num_kv_pairs, self.num_train),),
            test=((self.seq_len, self.num_kv_pairs, self.num_test),),
            vocab_size=self.vocab_size,
            fillers=self.fillers,
            train_batch_size=self.train_batch_size,
            test_batch_size=self.test_batch_size,
            seed=seed,
            valid=((self.seq_len, self.num_kv_pairs, self.num_valid),) if self.num_valid else (),
        )


# The (L, N) pairs are ICLR'24 Figure 2's three difficulties. Every level has the same number of training tokens
# per epoch (640k) so one epoch costs roughly the same on CPU; the longer levels get fewer, longer examples.
LEVELS: dict[str, MQARLevel] = {
    "easy": MQARLevel("easy", seq_len=64, num_kv_pairs=4, d_model=64, vocab_size=512,
                      num_train=10_000, num_test=1_000, train_batch_size=64, test_batch_size=250),
    "medium": MQARLevel("medium", seq_len=128, num_kv_pairs=8, d_model=64, vocab_size=512,
                        num_train=5_000, num_test=1_000, train_batch_size=32, test_batch_size=125),
    "hard": MQARLevel("hard", seq_len=256, num_kv_pairs=16, d_model=64, vocab_size=512,
                      num_train=2_500, num_test=1_000, train_batch_size=16, test_batch_size=100),
}

# ICLR'24 Figure 2 as zoology runs it (experiments/iclr24_zoology_figure2/configs.py): V = 8192, 100,000 training
# and 3,000 test examples per (L, N), one batch size for train and test (512, or 256 at L = 256). The 3,000
# validation examples are ours (zoology selects on its test set). configs/mqar.py:VARIANT,LEVEL,zoology.
ZOOLOGY_LEVELS: dict[str, MQARLevel] = {
    name: MQARLevel(name, seq_len=L, num_kv_pairs=N, d_model=64, vocab_size=ZOOLOGY_VOCAB_SIZE, num_train=100_000,
                    num_test=3_000, train_batch_size=bs, test_batch_size=bs, num_valid=3_000)
    for name, L, N, bs in (("easy", 64, 4, 512), ("medium", 128, 8, 512), ("hard", 256, 16, 256))
}

# The protocols a level name is read under: "cpu" (LEVELS, the default) and "zoology" (ZOOLOGY_LEVELS).
PROTOCOLS: dict[str, dict[str, MQARLevel]] = {"cpu": LEVELS, "zoology": ZOOLOGY_LEVELS}

# ---------------------------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------------------------


def pad_batch(inputs: np.ndarray, labels: np.ndarray, batch_size: int, pad_to: int, num_kv_pairs: int
               ) -> dict[str, np.ndarray]:
    """Rows ``inputs``/``labels`` [b <= batch_size, L] as one batch of ``batch_size`` rows right-padded to ``pad_to``
    (token 0, label -100; padding rows have ``mask`` False and ``num_kv_pairs`` 0). See :func:`iter_segment_batches`.

    ``answer_positions`` int32 [batch_size, num_kv_pairs]: each real row's labelled positions in increasing order
    (0..N-1 on padding rows, whose labels are all -100), so a loss can compute logits there alone. Every real row
    must hold exactly ``num_kv_pairs`` labels (MQAR's invariant); a row with another count is refused, since the
    fixed-width positions would drop or invent answers."""
    b, L = inputs.shape
    counts = (labels != IGNORE_INDEX).sum(axis=1)
    if b and np.any(counts != num_kv_pairs):
        raise ValueError(f"every MQAR row must have {num_kv_pairs} labels, got counts {sorted(set(counts.tolist()))}")
    out_inputs = np.full((batch_size, pad_to), PAD_TOKEN, dtype=np.int32)
    out_labels = np.full((batch_size, pad_to), IGNORE_INDEX, dtype=np.int32)
    out_inputs[:b, :L] = inputs
    out_labels[:b, :L] = labels
    mask = np.zeros((batch_size,), dtype=bool)
    mask[:b] = True
    nkv = np.where(mask, num_kv_pairs, 0).astype(np.int32)
    positions = np.tile(np.arange(num_kv_pairs, dtype=np.int32), (batch_size, 1))
    # A stable argsort puts each row's labelled positions first, in increasing order.
    positions[:b] = np.argsort(labels == IGNORE_INDEX, axis=1, kind="stable")[:, :num_kv_pairs]
    return {"inputs": out_inputs, "labels": out_labels, "mask": mask, "num_kv_pairs": nkv,
            "answer_positions": positions}


def iter_segment_batches(
    inputs: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    *,
    pad_to: int | None = None,
    num_kv_pairs: int | None = None,
    pad_last: bool = True,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield the batches of one segment as contiguous slices in stored order (no shuffling, as in zoology).

    Each batch is a dict of numpy arrays:
      ``inputs`` int32 ``[B, T]``, ``labels`` int32 ``[B, T]`` (``T = pad_to or L``; padding is token 0 /
      label ``-100`` on the right, which does not change a causal model's logits at real positions),
      ``mask`` bool ``[B]`` (True on real rows), ``num_kv_pairs`` int32 ``[B]`` (N on real rows, 0 on padding),
      ``answer_positions`` int32 ``[B, N]`` (the labelled positions of each row, :func:`pad_batch`).

    With ``pad_last=True`` a partial last batch is filled up to ``batch_size`` with all-``-100`` rows (static
    shapes for jit); with ``pad_last=False`` it is yielded short (zoology's behaviour).
    """
    if inputs.ndim != 2 or inputs.shape != labels.shape:
        raise ValueError(f"inputs and labels must both be [n, L], got {inputs.shape} and {labels.shape}")
    _check_int("batch_size", batch_size, 1)
    n, L = inputs.shape
    T = L if pad_to is None else _check_int("pad_to", pad_to, 1)
    if T < L:
        raise ValueError(f"pad_to={T} is shorter than the segment length L={L}")
    if num_kv_pairs is None:
        # MQAR puts exactly N labels in every example, so N is the label count of any row.
        num_kv_pairs = int((labels[0] != IGNORE_INDEX).sum()) if n else 0
    for start in range(0, n, batch_size):
        x, y = inputs[start:start + batch_size], labels[start:start + batch_size]
        rows = batch_size if pad_last else x.shape[0]
        yield pad_batch(x, y, rows, T, num_kv_pairs)


def make_batches(
    segments: Iterable[MQARSegment | tuple[np.ndarray, np.ndarray]],
    batch_size: int,
    *,
    pad_to: int | None = None,
    pad_last: bool = True,
) -> list[dict[str, np.ndarray]]:
    """Generate (if needed) and batch segments in order; every batch comes from a single segment.

    Args:
      segments: :class:`MQARSegment` objects or pre-generated ``(inputs, labels)`` pairs.
      batch_size: rows per batch.
      pad_to: right-pad every batch to this length (e.g. ``mix.max_seq_len``) so one compiled step serves all
        segments; ``None`` keeps each segment's own L (one compiled step per distinct L).
      pad_last: pad partial last batches with all-``-100`` rows (see :func:`iter_segment_batches`).

    Returns:
      The list of batch dicts, in segment order then stored order.
    """
    out: list[dict[str, np.ndarray]] = []
    for seg in segments:
        if isinstance(seg, MQARSegment):
            inputs, labels = seg.generate()
            nkv: int | None = seg.N
        else:
            inputs, labels = seg
            nkv = None
        out.extend(iter_segment_batches(np.asarray(inputs), np.asarray(labels), batch_size, pad_to=pad_to,
                                        num_kv_pairs=nkv, pad_last=pad_last))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Metric (spec §8)
# ---------------------------------------------------------------------------------------------------------------


def per_example_accuracy(logits_or_predictions, labels):
    """Per-example MQAR accuracy (jit-friendly, ``jax.numpy``).

    Args:
      logits_or_predictions: logits ``[..., T, V]`` (argmax taken over V) or integer predictions ``[..., T]``.
      labels: int ``[..., T]``, ``-100`` where nothing is asked.

    Returns:
      ``(acc, num_labels)``: ``acc`` float32 ``[...]`` is the mean of ``[pred == label]`` over labelled positions
      (0 for rows without labels), ``num_labels`` int32 ``[...]`` the number of labelled positions. Rows with
      ``num_labels == 0`` (padding rows) must be excluded from any mean.
    """
    import jax.numpy as jnp  # noqa: PLC0415

    labels = jnp.asarray(labels)
    x = jnp.asarray(logits_or_predictions)
    if x.ndim == labels.ndim + 1:
        preds = jnp.argmax(x, axis=-1)
    elif x.ndim == labels.ndim and jnp.issubdtype(x.dtype, jnp.integer):
        preds = x
    else:
        raise ValueError(
            f"logits_or_predictions must be logits [..., T, V] or int predictions [..., T] matching labels "
            f"{labels.shape}, got {x.shape} {x.dtype}"
        )
    if preds.shape != labels.shape:
        raise ValueError(f"predictions shape {preds.shape} does not match labels shape {labels.shape}")
    valid = labels != IGNORE_INDEX
    correct = jnp.sum((preds == labels) & valid, axis=-1)
    count = jnp.sum(valid, axis=-1).astype(jnp.int32)
    acc = jnp.where(count > 0, correct / jnp.maximum(count, 1), 0.0).astype(jnp.float32)
    return acc, count


class MQARAccuracy:
    """Accumulates per-example accuracy across batches and segments; :meth:`compute` gives zoology's metrics.

    ``valid/accuracy`` is the mean of per-example accuracy over all examples seen, each example weighted equally
    (not a token mean). ``valid/num_kv_pairs/accuracy-{N}`` is the same mean over examples with that N. Rows
    without labels (padding) are skipped.
    """

    def __init__(self, prefix: str = "valid") -> None:
        self.prefix = prefix
        self._sum: dict[int, float] = {}
        self._count: dict[int, int] = {}

    def update(self, logits_or_predictions, labels, num_kv_pairs=None) -> None:
        """Add a batch. ``num_kv_pairs`` (int ``[B]`` or scalar) defaults to each row's label count, which equals
        N for MQAR examples."""
        acc, count = per_example_accuracy(logits_or_predictions, labels)
        acc = np.asarray(acc, dtype=np.float64).reshape(-1)
        count = np.asarray(count).reshape(-1)
        if num_kv_pairs is None:
            nkv = count
        else:
            nkv = np.broadcast_to(np.asarray(num_kv_pairs), np.shape(labels)[:-1]).reshape(-1)
        real = count > 0
        for n_ in np.unique(nkv[real]):
            sel = real & (nkv == n_)
            self._sum[int(n_)] = self._sum.get(int(n_), 0.0) + float(acc[sel].sum())
            self._count[int(n_)] = self._count.get(int(n_), 0) + int(sel.sum())

    @property
    def num_examples(self) -> int:
        return sum(self._count.values())

    def compute(self) -> dict[str, float]:
        """``{prefix/accuracy, prefix/num_kv_pairs/accuracy-{N} for each N seen}`` as Python floats (NaN if empty)."""
        total = self.num_examples
        out = {f"{self.prefix}/accuracy": (sum(self._sum.values()) / total) if total else float("nan")}
        for n_ in sorted(self._count):
            out[f"{self.prefix}/num_kv_pairs/accuracy-{n_}"] = self._sum[n_] / self._count[n_]
        return out
