"""What a run trains on and how it is scored: the plug-in chosen by the config's ``task`` (:func:`task_class`),
built by :func:`make_task`. The trainer (``training/loop.py``) and the reader of saved runs (``training/run.py``) ask
the task everything that differs between tasks (:class:`Task`); neither names a task. Above all it gives the loop:

* ``train_dataset(seed, rows)``: a ``grain.MapDataset`` whose element ``i`` is this host's ``rows`` of global batch
  ``i`` (``sharding.host_batch_rows``; None = every row), ``{"inputs", "targets"}`` int32 ``[len(rows), T]``
  (targets -100 = not scored). The loop turns it into the checkpointed iterator; with ``train.num_seeds > 1`` it
  stacks one dataset per seed.
* ``make_evaluator(graphdef, params_shardings, mesh, num_seeds)``: a function
  ``(params, split, max_batches) -> {name: value}``. Per-seed metrics are float64 arrays ``[S]`` (``S = 1`` for a
  single run); counts shared by every seed are Python ints. ``max_batches = 0`` scores the whole held-out set.

and, beside them, what the run directory records of its data (``uses_corpus``, ``record_data``), what
fixes its stream of batches (``stream_spec``), which metrics it reports (``metric_names``, ``loss_metric``,
``summary_placeholders``) and its held-out batch size (``eval_batch_rows``).

Tasks:

* :class:`LMTask` (``task = "lm"``): shuffled windows of a token cache, every token a target once per epoch
  (``data.pipeline``), each seed its own order
  (``seed`` = the model seed, as in a single run); validation loss and perplexity over every token of a split.
* :class:`GlueTask` (``task = "glue"``, ``configs/glue.py``): a GLUE task's examples (``data.glue``) in a seeded order
  reshuffled every epoch, scored by the classification head (``model.num_labels``); the task's official metrics on
  its validation split(s), and GLUE's submission files for its test split(s) (:meth:`GlueTask.write_test_predictions`).
* :class:`MQARTask` (``task = "mqar"``, ``configs/mqar.py``): the training examples in a seeded order, reshuffled every
  epoch (``mqar.shuffle``; off = zoology's fixed order, the same for every seed), accuracy per segment on the labelled
  positions only (``data.mqar.MQARAccuracy``) and the masked cross-entropy of the held-out split asked for: the
  validation segment (periodic evaluations, early stopping, selection) or the test segment.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, ClassVar, Protocol

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.data import mqar
from coupled_qk_jax.data.pipeline import train_batches, train_stream_spec
from coupled_qk_jax.data.token_cache import TokenCache
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training import rundir
from coupled_qk_jax.training.config import RunConfig, TrainConfig
from coupled_qk_jax.training.evaluate import evaluate_tokens
from coupled_qk_jax.training.steps import answer_logits, label_loss, make_eval_step, masked_cross_entropy

Evaluator = Callable[..., dict[str, Any]]


class Task(Protocol):
    """What the trainer and the reader ask of a task; :class:`LMTask`, :class:`MQARTask` and :class:`GlueTask` are
    the tasks. The class attributes are read before a task is built (the config's checks, the run directory)."""

    name: ClassVar[str]  # the config's ``task``
    metric_names: ClassVar[tuple[str, ...]]  # the periodic evaluation's metrics (what train.early_stop may watch)
    loss_metric: ClassVar[str]  # the evaluation's loss: what checkpoint.keep_best=validation_loss ranks by
    summary_placeholders: ClassVar[tuple[str, ...]]  # metrics summary.json holds (None) even when none was computed
    uses_corpus: ClassVar[bool]  # trains on data.corpus through the token cache (else: data the config names)

    @classmethod
    def create(cls, config: RunConfig, batch_devices: int, workdir: str | None, data: Any) -> Task:
        """The task for ``batch_devices`` data-parallel devices; ``data`` is the token cache or the run directory's
        RunData of a corpus task (None otherwise), ``workdir`` the run directory (None: not written yet)."""

    @classmethod
    def eval_batch_rows(cls, train: TrainConfig) -> int:
        """The held-out batch's rows (0: the task derives a multiple of the data-parallel devices itself)."""

    @classmethod
    def record_data(cls, config: RunConfig, workdir: str) -> dict[str, Any]:
        """A task without a corpus: what data.json records beside its name at the first start (process 0). A corpus
        task's data.json is the corpus fingerprint (training/loop.py's prepare_data)."""

    def validate(self, batch_devices: int) -> None: ...

    def train_dataset(self, seed: int, rows: np.ndarray | None = None) -> grain.MapDataset: ...

    def make_evaluator(self, graphdef: nnx.GraphDef, params_shardings: Any, mesh: Mesh,
                       num_seeds: int) -> Evaluator: ...

    def stream_spec(self, seed: int) -> dict[str, Any]:
        """What fixes the sequence of global training batches of ``seed`` besides the step (saved with every
        checkpoint; a resume into another one is refused)."""

    def warnings(self) -> list[str]:
        """What a first look at the data found that a user should hear about (one line each)."""

    def summary(self) -> dict[str, Any]: ...


def _jit_eval(fn: Callable, params_shardings: Any, mesh: Mesh, num_seeds: int) -> Callable:
    """The sharded jit of ``fn(params, batch)``; with several seeds the function is vmapped over the params' seed
    axis (every seed scores the same batch, which has no seed axis)."""
    if num_seeds > 1:
        fn = jax.vmap(fn, in_axes=(0, None))
    return shd.jit_sharded(fn, mesh, params_shardings)


# --------------------------------------------------------------------------------------------------------------------
# Language modelling.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LMTask:
    """Next-token prediction on a token cache (``data.corpus``, ``data.tokenizer``; see docs/data.md)."""

    config: RunConfig
    cache: TokenCache  # or the run directory's rundir.RunData (the held-out splits only)

    name: ClassVar[str] = "lm"
    metric_names: ClassVar[tuple[str, ...]] = ("val_loss", "val_ppl")
    loss_metric: ClassVar[str] = "val_loss"
    summary_placeholders: ClassVar[tuple[str, ...]] = ("val_loss", "val_ppl", "val_tokens")
    uses_corpus: ClassVar[bool] = True

    @classmethod
    def create(cls, config: RunConfig, batch_devices: int, workdir: str | None, data: Any) -> LMTask:
        del batch_devices, workdir  # checked in validate; the corpus is the token cache
        return cls(config, data)

    @classmethod
    def eval_batch_rows(cls, train: TrainConfig) -> int:
        return train.eval_batch_size or train.batch_size

    def __post_init__(self) -> None:
        # Found now, not after hours of training (or after the first steps, inside the pipeline).
        self.require_split("train", self.config.data.seq_len + 1, "one training window (data.seq_len + 1)")
        self.require_split("validation", 2, "an evaluation")

    def require_split(self, split: str, needed: int, what: str) -> None:
        """A one-line error naming the split, its size and the fix when it has fewer than ``needed`` tokens."""
        n = int(self.cache.manifest["splits"][split]["tokens"])  # no file opened: a run directory has no train split
        if n < needed:
            raise UserError(
                f"the {split} split of {self.config.data.corpus} has {n} token(s), fewer than the {needed} that {what} "
                f"needs; give it a larger share with data.split_fractions, e.g. 0.8,0.1,0.1 (train.py "
                f"--config.data.split_fractions=..., main_job --split_fractions, sweep --split-fractions)")

    def eval_batch_size(self) -> int:
        return self.eval_batch_rows(self.config.train)

    def validate(self, batch_devices: int) -> None:
        if self.eval_batch_size() % batch_devices:
            raise UserError(f"the eval batch size {self.eval_batch_size()} is not divisible by the {batch_devices} "
                             f"data-parallel devices; set train.eval_batch_size")

    def train_dataset(self, seed: int, rows: np.ndarray | None = None) -> grain.MapDataset:
        return train_batches(self.cache.tokens("train"), self.config.data.seq_len, self.config.train.batch_size, seed,
                             rows, bos_id=self.cache.eot_id)

    def stream_spec(self, seed: int) -> dict[str, Any]:
        return train_stream_spec(self.cache.tokens("train"), self.config.data.seq_len, self.config.train.batch_size,
                                 seed, bos_id=self.cache.eot_id)

    def make_evaluator(self, graphdef: nnx.GraphDef, params_shardings: Any, mesh: Mesh,
                       num_seeds: int) -> Evaluator:
        step = _jit_eval(make_eval_step(graphdef), params_shardings, mesh, num_seeds)

        def evaluate(params: Any, split: str = "validation", max_batches: int = 0) -> dict[str, Any]:
            self.require_split(split, 2, "an evaluation")
            r = evaluate_tokens(step, params, self.cache.tokens(split), self.config.data.seq_len,
                                self.eval_batch_size(), mesh, bos_id=self.cache.eot_id, max_batches=max_batches)
            return {"val_loss": np.atleast_1d(r["loss"]), "val_ppl": np.atleast_1d(r["ppl"]), "val_tokens": r["tokens"]}

        return evaluate

    def warnings(self) -> list[str]:
        skipped = self.summary()["skipped_non_utf8"]
        if not skipped:
            return []
        return [f"skipped {skipped} non-UTF-8 file(s) in {self.config.data.corpus} (see the token cache manifest)"]

    def summary(self) -> dict[str, Any]:
        skipped = sum(int(v.get("skipped_non_utf8", 0)) for v in self.cache.manifest["splits"].values())
        return {"corpus": self.config.data.corpus, "token_cache": self.cache.directory.name,
                "skipped_non_utf8": skipped}


# --------------------------------------------------------------------------------------------------------------------
# MQAR.
# --------------------------------------------------------------------------------------------------------------------


class _HostRows:
    """MQAR batch -> this host's rows of ``{"inputs", "targets", "answer_positions"}`` (the labels are the next-token
    targets: the label at position t is the value answering the key at t; the loss scores the answer positions
    only, steps.make_loss_fn)."""

    def __init__(self, rows: np.ndarray | None) -> None:
        # Ascending rows of the batch (sharding.host_batch_rows); None = every row.
        self.rows = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = self.rows
        return {"inputs": batch["inputs"][rows], "targets": batch["labels"][rows],
                "answer_positions": batch["answer_positions"][rows]}


class _EpochBatches:
    """The training examples as a sequence of padded batches: ``[b]`` is batch ``b`` in stored order (zoology's);
    :meth:`shuffled` gives batch ``i`` of the seeded order, epoch ``i // len(self)`` a fresh permutation.

    Every epoch is exactly the ``n`` examples once: ``ceil(n / B)`` batches, the last one filled up with padding rows
    (label -100 everywhere, so they carry no weight in the loss), as in the stored order.
    """

    def __init__(self, inputs: np.ndarray, labels: np.ndarray, batch_size: int, num_kv_pairs: int) -> None:
        self.inputs, self.labels = inputs, labels
        self.batch_size, self.num_kv_pairs = batch_size, num_kv_pairs
        self.n = int(inputs.shape[0])
        self._perm: tuple[tuple[int, int], np.ndarray] | None = None  # the last (seed, epoch)'s permutation

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return mqar.pad_batch(self.inputs[rows], self.labels[rows], self.batch_size, self.inputs.shape[1],
                               self.num_kv_pairs)

    def __getitem__(self, b: int) -> dict[str, np.ndarray]:
        return self._rows(np.arange(b * self.batch_size, min((b + 1) * self.batch_size, self.n)))

    def permutation(self, seed: int, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch`` under ``seed``: int64 [n], a pure function of (seed, epoch). SeedSequence
        mixes both, so no two (seed, epoch) pairs share an order by construction (seed + epoch would)."""
        cached = self._perm
        if cached is not None and cached[0] == (seed, epoch):
            return cached[1]
        perm = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(self.n)
        self._perm = ((seed, epoch), perm)
        return perm

    def shuffled(self, seed: int) -> Callable[[int, Any], dict[str, np.ndarray]]:
        def batch(index: int, _: Any) -> dict[str, np.ndarray]:
            epoch, b = divmod(int(index), len(self))
            perm = self.permutation(seed, epoch)
            return self._rows(perm[b * self.batch_size:(b + 1) * self.batch_size])

        return batch


class _ExampleTask:
    """What the tasks trained on examples in a seeded epoch order (:class:`MQARTask`, :class:`GlueTask`) share: data
    the config names (no corpus, no token cache), checked when the task is built."""

    summary_placeholders: ClassVar[tuple[str, ...]] = ()
    uses_corpus: ClassVar[bool] = False
    config: RunConfig
    train: Any  # the training examples' batches; len() = batches per epoch

    @classmethod
    def record_data(cls, config: RunConfig, workdir: str) -> dict[str, Any]:
        """What data.json records beside the task's name at a run's first start (process 0 only)."""
        del config, workdir
        return {}

    def validate(self, batch_devices: int) -> None:
        del batch_devices  # checked when the task was built

    def stream_spec(self, seed: int) -> dict[str, Any]:
        del seed  # the order is a pure function of the seed, which the loop records beside this
        return {"batches_per_epoch": len(self.train), "batch_size": self.config.train.batch_size}

    def warnings(self) -> list[str]:
        return []


class MQARTask(_ExampleTask):
    """Zoology's MQAR (``data.mqar``): one train segment, one validation segment and one test segment of a level.

    ``mqar.protocol`` ("cpu" or "zoology", ``data.mqar.PROTOCOLS``) and ``mqar.level`` fix L, N, the vocabulary and
    the batch sizes; ``mqar.num_train`` / ``num_valid`` / ``num_test`` size the segments (train and test seeds as
    zoology derives them, data seed 123; validation seeds a draw of their own, ``mqar.validation_seeds``). The three
    splits are checked to share no example. Training visits every example once per epoch, in an order set by the
    run's seed and reshuffled every epoch (``mqar.shuffle``; False = zoology's stored order for every seed). Held-out
    batches hold ``train.eval_batch_size`` rows (0: the level's test batch size rounded up to a multiple of the
    data-parallel devices; the extra rows are padding, which the metric skips).
    """

    name: ClassVar[str] = "mqar"
    metric_names: ClassVar[tuple[str, ...]] = ("valid/accuracy", "valid/loss")
    loss_metric: ClassVar[str] = "valid/loss"

    @classmethod
    def create(cls, config: RunConfig, batch_devices: int, workdir: str | None, data: Any) -> MQARTask:
        del workdir, data  # generated from the config alone
        return cls(config, batch_devices)

    @classmethod
    def eval_batch_rows(cls, train: TrainConfig) -> int:
        return train.eval_batch_size

    def __init__(self, config: RunConfig, batch_devices: int) -> None:
        self.config = config
        cfg, train = config.mqar, config.train
        if cfg.protocol not in mqar.PROTOCOLS:
            raise UserError(f"mqar.protocol must be one of {sorted(mqar.PROTOCOLS)}, got {cfg.protocol!r}")
        levels = mqar.PROTOCOLS[cfg.protocol]
        if cfg.level not in levels:
            raise UserError(f"mqar.level must be one of {sorted(levels)}, got {cfg.level!r}")
        level = levels[cfg.level]
        level = dataclasses.replace(level, num_train=cfg.num_train or level.num_train,
                                    num_valid=cfg.num_valid or level.num_valid,
                                    num_test=cfg.num_test or level.num_test)
        self.level, self.protocol, self.shuffle = level, cfg.protocol, cfg.shuffle
        if config.data.seq_len != level.seq_len:
            raise UserError(f"data.seq_len={config.data.seq_len} but MQAR level {cfg.level} has L={level.seq_len}; "
                            f"choose the level with the config argument (configs/mqar.py:VARIANT,LEVEL)")
        if config.model.vocab_size < level.vocab_size:
            raise UserError(f"model.vocab_size={config.model.vocab_size} is smaller than MQAR level {cfg.level}'s "
                            f"vocabulary {level.vocab_size}")
        mix = level.mix()
        (train_seg,), (test_seg,) = mix.segments()
        (valid_seg,) = mix.validation_segments()
        splits = {"train": train_seg.generate(), "validation": valid_seg.generate(), "test": test_seg.generate()}
        for a, b in (("validation", "train"), ("validation", "test"), ("test", "train")):
            shared = mqar.overlapping_rows(splits[a], splits[b])
            if shared.size:  # only a level with very few distinct examples (tiny vocabulary or length) gets here
                raise UserError(f"MQAR level {cfg.level}: {shared.size} {a} example(s) also occur in {b}; a held-out "
                                f"split must be disjoint from the others: use a larger vocabulary or fewer examples")
        inputs, labels = (x.astype(np.int32) for x in splits["train"])
        self.train = _EpochBatches(inputs, labels, train.batch_size, level.num_kv_pairs)
        if cfg.steps_per_epoch and len(self.train) != cfg.steps_per_epoch:
            raise UserError(f"mqar.steps_per_epoch={cfg.steps_per_epoch} but {level.num_train} examples in "
                            f"batches of {train.batch_size} make {len(self.train)}; leave it derived")
        rows = train.eval_batch_size or math.ceil(level.test_batch_size / batch_devices) * batch_devices
        if rows % batch_devices:
            raise UserError(f"train.eval_batch_size={rows} is not divisible by the {batch_devices} data-parallel "
                            f"devices")
        self.held_out = {split: mqar.make_batches([splits[split]], rows) for split in ("validation", "test")}
        self.valid, self.test = self.held_out["validation"], self.held_out["test"]

    def train_dataset(self, seed: int, rows: np.ndarray | None = None) -> grain.MapDataset:
        """Element ``i`` is this host's ``rows`` of global batch ``i``: epoch ``i // steps_per_epoch`` in the order of
        (``seed``, epoch), or, with ``mqar.shuffle`` off, zoology's stored order for every seed and epoch."""
        host_rows = _HostRows(rows)
        if not self.shuffle:
            return grain.MapDataset.source(self.train).repeat().map(host_rows)
        return grain.MapDataset.range(len(self.train)).repeat().map_with_index(self.train.shuffled(seed)).map(host_rows)

    def make_evaluator(self, graphdef: nnx.GraphDef, params_shardings: Any, mesh: Mesh,
                       num_seeds: int) -> Evaluator:
        def scores(params, batch):
            # Logits at the N answer positions only: [B, N, V], not [B, T, V].
            positions = batch["answer_positions"]
            logits = answer_logits(nnx.merge(graphdef, params), batch["inputs"], positions)
            nll_sum, count = masked_cross_entropy(logits, jnp.take_along_axis(batch["targets"], positions, axis=1))
            # argmax on the device: only [B, N] predictions leave it, not [B, N, V] logits.
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), nll_sum, count

        step = _jit_eval(scores, params_shardings, mesh, num_seeds)
        host_rows = _HostRows(shd.host_batch_rows(mesh, jax.process_index(), self.test[0]["inputs"].shape[0]))

        def evaluate(params: Any, split: str = "validation", max_batches: int = 0) -> dict[str, Any]:
            # The metric names are zoology's ("valid/...") for either split; the caller records which one it asked.
            if split not in self.held_out:
                raise UserError(f"MQAR held-out split must be one of {sorted(self.held_out)}, got {split!r}")
            meters = [mqar.MQARAccuracy() for _ in range(num_seeds)]
            nll, tokens = np.zeros(num_seeds), 0
            for i, batch in enumerate(self.held_out[split]):
                if max_batches and i == max_batches:
                    break
                preds, nll_sum, count = jax.device_get(step(params, shd.global_batch(host_rows(batch), mesh)))
                preds = preds.reshape((num_seeds,) + batch["answer_positions"].shape)
                labels = np.take_along_axis(batch["labels"], batch["answer_positions"], axis=1)
                nll += np.asarray(nll_sum, np.float64).reshape(num_seeds)
                tokens += int(np.asarray(count).reshape(-1)[0])
                for meter, p in zip(meters, preds):
                    meter.update(p, labels, batch["num_kv_pairs"])
            per_seed = [m.compute() for m in meters]
            out: dict[str, Any] = {k: np.array([m[k] for m in per_seed]) for k in per_seed[0]}
            out["valid/loss"] = nll / max(tokens, 1)  # token mean of the masked CE over the split
            out["valid/examples"] = meters[0].num_examples
            return out

        return evaluate

    def summary(self) -> dict[str, Any]:
        lvl = self.level
        return {"level": lvl.name, "protocol": self.protocol, "seq_len": lvl.seq_len, "num_kv_pairs": lvl.num_kv_pairs,
                "num_train": lvl.num_train, "num_valid": lvl.num_valid, "num_test": lvl.num_test,
                "steps_per_epoch": len(self.train), "shuffle": self.shuffle}


# --------------------------------------------------------------------------------------------------------------------
# GLUE: sentence classification and regression.
# --------------------------------------------------------------------------------------------------------------------


class _ExampleBatches:
    """Encoded examples (``data.glue.encode``) as batches of ``batch_size`` rows, ``[b]`` in stored order;
    :meth:`shuffled` gives batch ``i`` of the seeded order, epoch ``i // len(self)`` a fresh permutation. Every epoch is
    each example once; a last, short batch is filled with copies of its first row whose labels are not scored
    (-1, or NaN for a regression), so every batch has one shape."""

    KEYS = ("inputs", "positions", "labels")

    def __init__(self, encoded: dict[str, np.ndarray], batch_size: int) -> None:
        self.encoded, self.batch_size = encoded, batch_size
        self.n = int(encoded["labels"].shape[0])

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        batch = {k: self.encoded[k][rows] for k in self.KEYS}
        pad = self.batch_size - len(rows)
        if pad:
            batch = {k: np.concatenate([v, np.repeat(v[:1], pad, axis=0)]) for k, v in batch.items()}
            unscored = np.nan if np.issubdtype(batch["labels"].dtype, np.floating) else -1
            batch["labels"][len(rows):] = unscored
        return batch

    def __getitem__(self, b: int) -> dict[str, np.ndarray]:
        return self.rows(np.arange(b * self.batch_size, min((b + 1) * self.batch_size, self.n)))

    def shuffled(self, seed: int) -> Callable[[int, Any], dict[str, np.ndarray]]:
        def batch(index: int, _: Any) -> dict[str, np.ndarray]:
            epoch, b = divmod(int(index), len(self))
            perm = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(self.n)
            return self.rows(perm[b * self.batch_size:(b + 1) * self.batch_size])

        return batch


class _Rows:
    """A batch -> this host's rows of it (``sharding.host_batch_rows``; None = every row)."""

    def __init__(self, rows: np.ndarray | None) -> None:
        self.rows = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v[self.rows] for k, v in batch.items()}


def sentence_tokenizer(config: RunConfig, workdir: str | None = None) -> Any:
    """The tokenizer a sentence task encodes with: the run directory's copy (``tokenizer.json``, written at its first
    start) when there is one, else ``data.tokenizer_path`` (a BPE ``tokenizer.json``), else ``train.init_from``'s
    ``tokenizer.json`` (an export folder's or a run directory's), else the byte tokenizer (``data.tokenizer =
    "byte"``)."""
    from coupled_qk_jax.data.tokenizer import BPETokenizer, ByteTokenizer  # noqa: PLC0415

    copy = rundir.run_tokenizer_path(workdir) if workdir else None
    source = config.train.init_from and os.path.join(config.train.init_from, rundir.TOKENIZER)
    path = copy or config.data.tokenizer_path or (source if source and os.path.isfile(source) else "")
    if path:
        if not os.path.isfile(path):
            raise UserError(f"data.tokenizer_path={path}: no such file; give the tokenizer.json the model was "
                            f"trained with (an export folder's, or a run directory's)")
        return BPETokenizer.load(path)
    if config.data.tokenizer != "byte":
        raise UserError("a GLUE run needs the model's tokenizer: train.init_from with a tokenizer.json, or "
                        "--config.data.tokenizer_path=RUN/tokenizer.json (data.tokenizer=byte for a byte-level model)")
    return ByteTokenizer()


class GlueTask(_ExampleTask):
    """A GLUE task (``data.corpus = "glue:TASK[:DIR]"``, ``data.glue``): training on its train split through the
    classification head, the task's official metrics on its validation split(s).

    ``tokenizer`` encodes the sentences (the run's: ``train.init_from``'s tokenizer for a fine-tuned model). "validation"
    is the task's first validation split (MNLI: matched); a second one (MNLI mismatched) is reported beside it as
    ``valid/<its suffix>/<metric>``. Held-out batches hold ``train.eval_batch_size`` rows (0: ``train.batch_size``).
    """

    name: ClassVar[str] = "glue"
    metric_names: ClassVar[tuple[str, ...]] = ("valid/main", "valid/loss")
    loss_metric: ClassVar[str] = "valid/loss"

    @classmethod
    def create(cls, config: RunConfig, batch_devices: int, workdir: str | None, data: Any) -> GlueTask:
        del data  # GLUE's own files, which data.corpus names
        return cls(config, batch_devices, sentence_tokenizer(config, workdir))

    @classmethod
    def eval_batch_rows(cls, train: TrainConfig) -> int:
        return train.eval_batch_size or train.batch_size

    @classmethod
    def record_data(cls, config: RunConfig, workdir: str) -> dict[str, Any]:
        """The tokenizer: a BPE is copied into the run directory, so that the run evaluates wherever it is moved."""
        tokenizer = sentence_tokenizer(config)
        if tokenizer.kind == "bpe":
            tokenizer.save(os.path.join(workdir, rundir.TOKENIZER))
        return {"tokenizer": {"kind": tokenizer.kind, "vocab_size": int(tokenizer.vocab_size)}}

    def __init__(self, config: RunConfig, batch_devices: int, tokenizer: Any) -> None:
        from coupled_qk_jax.data import glue  # noqa: PLC0415 - only sentence tasks read GLUE

        self.config, self.tokenizer, self.glue = config, tokenizer, glue
        self.source = glue.parse_source(config.data.corpus)
        self.task = self.source.task
        if config.model.num_labels != self.task.num_labels:
            raise UserError(f"model.num_labels={config.model.num_labels}, but GLUE {self.task.name} needs "
                            f"{self.task.num_labels} (set --config.model.num_labels={self.task.num_labels})")
        self.eval_rows = self.eval_batch_rows(config.train)
        if self.eval_rows % batch_devices:
            raise UserError(f"the eval batch size {self.eval_rows} is not divisible by the {batch_devices} "
                            f"data-parallel devices; set train.eval_batch_size")
        self._encoded: dict[str, dict[str, np.ndarray]] = {}

    @functools.cached_property
    def train(self) -> _ExampleBatches:
        """The train split's batches, encoded on first use (an evaluation never reads the train split)."""
        return _ExampleBatches(self.encoded("train"), self.config.train.batch_size)

    def encoded(self, split: str) -> dict[str, np.ndarray]:
        """``data.glue.encode`` of a split, read once."""
        if split not in self._encoded:
            examples = self.glue.load_examples(self.source, split)
            self._encoded[split] = self.glue.encode(examples, self.tokenizer, self.config.data.seq_len)
        return self._encoded[split]

    def train_dataset(self, seed: int, rows: np.ndarray | None = None) -> grain.MapDataset:
        return grain.MapDataset.range(len(self.train)).repeat().map_with_index(self.train.shuffled(seed)).map(
            _Rows(rows))

    def _outputs(self, graphdef: nnx.GraphDef, params_shardings: Any, mesh: Mesh,
                 num_seeds: int) -> Callable[..., tuple[np.ndarray, np.ndarray, int]]:
        """``outputs(params, split, max_batches) -> (head outputs [S, N, num_labels], summed loss [S], scored
        examples)`` over the split's examples in stored order."""
        def scores(params, batch):
            out = nnx.merge(graphdef, params).classify(batch["inputs"], batch["positions"])
            return (out, *label_loss(out, batch["labels"]))

        step = _jit_eval(scores, params_shardings, mesh, num_seeds)
        host_rows = _Rows(shd.host_batch_rows(mesh, jax.process_index(), self.eval_rows))

        def outputs(params: Any, split: str, max_batches: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
            batches = _ExampleBatches(self.encoded(split), self.eval_rows)
            outs, loss, count = [], np.zeros(num_seeds), 0
            for b in range(len(batches)):
                if max_batches and b == max_batches:
                    break
                out, loss_sum, n = jax.device_get(step(params, shd.global_batch(host_rows(batches[b]), mesh)))
                outs.append(np.asarray(out, np.float32).reshape(num_seeds, self.eval_rows, -1))
                loss += np.asarray(loss_sum, np.float64).reshape(num_seeds)
                count += int(np.asarray(n).reshape(-1)[0])
            real = min(batches.n, len(outs) * self.eval_rows)  # the padding rows of a last, short batch dropped
            return np.concatenate(outs, axis=1)[:, :real], loss, count

        return outputs

    def make_evaluator(self, graphdef: nnx.GraphDef, params_shardings: Any, mesh: Mesh,
                       num_seeds: int) -> Evaluator:
        outputs = self._outputs(graphdef, params_shardings, mesh, num_seeds)

        def evaluate(params: Any, split: str = "validation", max_batches: int = 0) -> dict[str, Any]:
            if split != "validation":
                raise UserError(f"GLUE's test labels are not public: evaluate the validation split, and write the "
                                f"{self.task.name} test predictions with eval.py --split=test (GLUE's submission "
                                "files)")
            result: dict[str, Any] = {}
            for i, name in enumerate(self.task.validation_splits):
                out, loss, count = outputs(params, name, max_batches)
                labels = self.encoded(name)["labels"][:out.shape[1]]
                per_seed = [self.glue.score(self.task, o, labels) for o in out]
                prefix = "valid/" if i == 0 else f"valid/{name.removeprefix('validation_')}/"
                result.update({prefix + k: np.array([m[k] for m in per_seed]) for k in per_seed[0]})
                result[prefix + "loss"] = loss / max(count, 1)
                result[prefix + "examples"] = int(out.shape[1])
            return result

        return evaluate

    def write_test_predictions(self, graphdef: nnx.GraphDef, params_shardings: Any, mesh: Mesh, params: Any,
                               out_dir: str) -> list[str]:
        """GLUE's submission file of each test split (``data.glue.write_submission``) from one model's ``params``;
        every process computes, process 0 writes. Returns the files' paths."""
        outputs = self._outputs(graphdef, params_shardings, mesh, 1)
        written = []
        for split in self.task.test_splits:
            out, _, _ = outputs(params, split)
            if jax.process_index() == 0:
                index = self.encoded(split)["index"][:out.shape[1]]
                written.append(str(self.glue.write_submission(self.task, split, index, out[0], out_dir)))
        return written

    def summary(self) -> dict[str, Any]:
        return {"glue_task": self.task.name, "source": str(self.source), "num_train": self.train.n,
                "steps_per_epoch": len(self.train)}


# --------------------------------------------------------------------------------------------------------------------
# The tasks by the config's name.
# --------------------------------------------------------------------------------------------------------------------


TASKS: dict[str, type[Task]] = {task.name: task for task in (LMTask, MQARTask, GlueTask)}


def task_class(name: str) -> type[Task]:
    """The task of the config's ``task`` (RunConfig checked the name)."""
    return TASKS[name]


def make_task(config: RunConfig, batch_devices: int, workdir: str | None, data: Any = None) -> Task:
    """``config.task``'s task for ``batch_devices`` data-parallel devices (:meth:`Task.create`), checked against them."""
    task = task_class(config.task).create(config, batch_devices, workdir, data)
    task.validate(batch_devices)
    return task
