"""GLUE fine-tuning data and metrics: the nine tasks, their examples, fixed-length encoding, scores, submissions.

Sources (a string like the library's corpora, see :func:`parse_source`):

* ``glue:TASK:DIR`` - ``DIR`` is either one task's folder of GLUE's own TSV files as GLUE's download script lays
  them out (``CoLA/train.tsv``, ``dev.tsv``, ``test.tsv``; MNLI: ``dev_matched.tsv``, ``dev_mismatched.tsv``,
  ``test_matched.tsv``, ``test_mismatched.tsv``), or the ``glue_data`` folder holding it, or a Hugging Face
  ``datasets`` ``save_to_disk`` folder (``dataset_dict.json`` inside). The files present tell them apart.
* ``glue:TASK`` - the Hugging Face hub (``nyu-mll/glue``, config ``TASK``), through ``datasets``.

Splits use Hugging Face's names: ``train``, ``validation``, ``test``; MNLI has ``validation_matched``,
``validation_mismatched``, ``test_matched``, ``test_mismatched``.

Labels: every task has ONE internal label order (:attr:`GlueTask.label_names`; for MNLI the sorted TSV strings
contradiction/entailment/neutral), whatever the source, so a model trained on the TSV files and one trained on the
hub's copy predict the same ids. Hugging Face's own ids (MNLI: entailment=0, neutral=1, contradiction=2) are mapped
to it by name.

Encoding (:func:`encode`): ``[eot] a [eot] b [eot]`` for pairs and ``[eot] a [eot]`` for single sentences, padded
with ``eot``; the classifier reads the last real token (the final ``eot``), at ``positions``.

``datasets`` is imported only when a Hugging Face source is read. Everything else is numpy and the standard library.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coupled_qk_jax.errors import UserError, did_you_mean

HUB_DATASET = "nyu-mll/glue"
"""The hub repository of GLUE (the old name ``glue`` redirects to it)."""

_NEEDS_DATASETS = 'the Hugging Face datasets package: pip install datasets (or pip install -e ".[hf]")'


@dataclasses.dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its text and labels are in each format, how it is scored and submitted.

    ``tsv_labels[i]`` is how internal label ``i`` is written in GLUE's TSV files (and in a submission);
    ``label_names[i]`` is its meaning, which is also the name Hugging Face's ``ClassLabel`` gives it;
    ``hf_label_names`` are those names in Hugging Face's id order. A regression task (STS-B) has no label names
    and ``num_labels == 1``.
    """

    name: str                             # "mnli": the spec's and Hugging Face's config name
    folder: str                           # "MNLI": the task's folder in GLUE's download
    tsv_text_columns: tuple[str, ...]     # header names of the one or two text columns in GLUE's TSV files
    tsv_label_column: str                 # header name of the label column (CoLA's headerless files: see _read_tsv)
    hf_text_columns: tuple[str, ...]      # the same text in Hugging Face's columns
    label_names: tuple[str, ...]          # internal order: id i means label_names[i]
    tsv_labels: tuple[str, ...]           # id i is written tsv_labels[i] in GLUE's files and in submissions
    hf_label_names: tuple[str, ...]       # Hugging Face's ClassLabel names, in its id order
    metrics: tuple[str, ...]              # GLUE's official metrics for the task
    main_metric: str                      # the one used to pick a checkpoint (one of metrics)
    validation_splits: tuple[str, ...]
    test_splits: tuple[str, ...]
    submission_files: tuple[str, ...]     # GLUE server's file name for each of test_splits
    tsv_files: tuple[tuple[str, str], ...]  # (split, file name in the task folder)

    @property
    def is_pair(self) -> bool:
        return len(self.tsv_text_columns) == 2

    @property
    def is_regression(self) -> bool:
        return not self.label_names

    @property
    def num_labels(self) -> int:
        """Width of the classification head: the number of classes, or 1 for regression."""
        return 1 if self.is_regression else len(self.label_names)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *self.validation_splits, *self.test_splits)

    def tsv_file(self, split: str) -> str:
        """GLUE's file name for ``split`` (``dev_matched.tsv`` for MNLI's ``validation_matched``)."""
        self.check_split(split)
        return dict(self.tsv_files)[split]

    def check_split(self, split: str) -> None:
        if split not in self.splits:
            raise UserError(f"GLUE task {self.name} has no split {split!r}{did_you_mean(split, self.splits)}; "
                            f"use one of {', '.join(self.splits)}")


_STANDARD_FILES = (("train", "train.tsv"), ("validation", "dev.tsv"), ("test", "test.tsv"))
_BINARY = ("0", "1")


def _task(name: str, folder: str, tsv_text: tuple[str, ...], tsv_label: str, hf_text: tuple[str, ...],
          label_names: tuple[str, ...], tsv_labels: tuple[str, ...], hf_label_names: tuple[str, ...],
          metrics: tuple[str, ...], main_metric: str, submission: str) -> GlueTask:
    return GlueTask(name, folder, tsv_text, tsv_label, hf_text, label_names, tsv_labels, hf_label_names, metrics,
                    main_metric, ("validation",), ("test",), (submission,), _STANDARD_FILES)


TASKS: dict[str, GlueTask] = {t.name: t for t in (
    _task("cola", "CoLA", ("sentence",), "label", ("sentence",), ("unacceptable", "acceptable"), _BINARY,
          ("unacceptable", "acceptable"), ("matthews_corrcoef",), "matthews_corrcoef", "CoLA.tsv"),
    _task("sst2", "SST-2", ("sentence",), "label", ("sentence",), ("negative", "positive"), _BINARY,
          ("negative", "positive"), ("accuracy",), "accuracy", "SST-2.tsv"),
    _task("mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", ("sentence1", "sentence2"),
          ("not_equivalent", "equivalent"), _BINARY, ("not_equivalent", "equivalent"), ("f1", "accuracy"), "f1",
          "MRPC.tsv"),
    _task("stsb", "STS-B", ("sentence1", "sentence2"), "score", ("sentence1", "sentence2"), (), (), (),
          ("pearson", "spearman"), "spearman", "STS-B.tsv"),
    _task("qqp", "QQP", ("question1", "question2"), "is_duplicate", ("question1", "question2"),
          ("not_duplicate", "duplicate"), _BINARY, ("not_duplicate", "duplicate"), ("f1", "accuracy"), "f1",
          "QQP.tsv"),
    GlueTask("mnli", "MNLI", ("sentence1", "sentence2"), "gold_label", ("premise", "hypothesis"),
             ("contradiction", "entailment", "neutral"), ("contradiction", "entailment", "neutral"),
             ("entailment", "neutral", "contradiction"), ("accuracy",), "accuracy",
             ("validation_matched", "validation_mismatched"), ("test_matched", "test_mismatched"),
             ("MNLI-m.tsv", "MNLI-mm.tsv"),
             (("train", "train.tsv"), ("validation_matched", "dev_matched.tsv"),
              ("validation_mismatched", "dev_mismatched.tsv"), ("test_matched", "test_matched.tsv"),
              ("test_mismatched", "test_mismatched.tsv"))),
    _task("qnli", "QNLI", ("question", "sentence"), "label", ("question", "sentence"),
          ("entailment", "not_entailment"), ("entailment", "not_entailment"), ("entailment", "not_entailment"),
          ("accuracy",), "accuracy", "QNLI.tsv"),
    _task("rte", "RTE", ("sentence1", "sentence2"), "label", ("sentence1", "sentence2"),
          ("entailment", "not_entailment"), ("entailment", "not_entailment"), ("entailment", "not_entailment"),
          ("accuracy",), "accuracy", "RTE.tsv"),
    # WNLI's TSV files write its labels as 0/1 (1 = entailment), unlike RTE's strings.
    _task("wnli", "WNLI", ("sentence1", "sentence2"), "label", ("sentence1", "sentence2"),
          ("not_entailment", "entailment"), _BINARY, ("not_entailment", "entailment"), ("accuracy",), "accuracy",
          "WNLI.tsv"),
)}
"""The nine GLUE tasks by name. Hugging Face's label orders (``hf_label_names``) are those of its ``glue``
dataset; where it differs from the internal order (MNLI), labels are mapped by name."""


def get_task(name: str | GlueTask) -> GlueTask:
    """The task called ``name``; case, ``-`` and ``_`` are ignored, so ``SST-2``, ``STS-B``, ``CoLA`` work."""
    if isinstance(name, GlueTask):
        return name
    key = name.lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise UserError(f"unknown GLUE task {name!r}{did_you_mean(key, TASKS)}; use one of {', '.join(TASKS)}")
    return TASKS[key]


# --------------------------------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True, eq=False)
class GlueExamples:
    """The examples of one split, column-wise (N examples).

    ``text_b`` is None for single-sentence tasks. ``labels`` is [N] int32 internal ids (-1 where unlabelled, as in
    test splits) or, for STS-B, [N] float32 scores (NaN where unlabelled). ``index`` is [N] int32: GLUE's
    ``index``/``id`` column (Hugging Face's ``idx``), or the row number (from 0) in files without one; a submission
    is written in its order.
    """

    task: GlueTask
    split: str
    text_a: tuple[str, ...]
    text_b: tuple[str, ...] | None
    labels: np.ndarray
    index: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.text_a)

    @property
    def labelled(self) -> bool:
        """True when every example has a label (a test split has none)."""
        return bool(len(self)) and not _unlabelled(self.task, self.labels).any()


def _unlabelled(task: GlueTask, labels: np.ndarray) -> np.ndarray:
    return np.isnan(labels) if task.is_regression else labels < 0


def _make_examples(task: GlueTask, split: str, a: list[str], b: list[str] | None, labels: list[Any],
                   index: list[int], source: str) -> GlueExamples:
    if task.is_regression:
        lab = np.array([math.nan if v is None else v for v in labels], dtype=np.float32)
    else:
        lab = np.array([-1 if v is None else v for v in labels], dtype=np.int32)
    return GlueExamples(task, split, tuple(a), None if b is None else tuple(b), lab.reshape(len(a)),
                        np.asarray(index, dtype=np.int32).reshape(len(a)), source)


@dataclasses.dataclass(frozen=True)
class GlueSource:
    """A parsed ``glue:TASK[:DIR]``: ``kind`` is ``tsv`` (``path`` is the task's folder), ``hf_disk`` (a
    ``save_to_disk`` folder) or ``hub`` (``path`` is None)."""

    task: GlueTask
    kind: str
    path: Path | None

    def __str__(self) -> str:
        return f"glue:{self.task.name}" + ("" if self.path is None else f":{self.path}")


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()


def _has_tsv(task: GlueTask, p: Path) -> bool:
    return any((p / f).is_file() for _, f in task.tsv_files)


def parse_source(spec: str) -> GlueSource:
    """Parses ``glue:TASK:DIR`` or ``glue:TASK``; checks the task and that ``DIR`` holds GLUE data.

    ``DIR`` may be the task's folder of TSV files (``glue_data/MNLI``), the folder above it (``glue_data``), or a
    ``save_to_disk`` folder. Everything after the second ``:`` is the path, so it may contain colons.
    """
    parts = spec.split(":", 2)
    if len(parts) < 2 or parts[0] != "glue" or not parts[1]:
        raise UserError(f"cannot parse GLUE source {spec!r}; write glue:TASK:DIR (GLUE's TSV folder or a "
                        f"datasets save_to_disk folder) or glue:TASK (the Hugging Face hub)")
    task = get_task(parts[1])
    if len(parts) == 2 or not parts[2]:
        return GlueSource(task, "hub", None)
    root = Path(os.path.expanduser(parts[2])).absolute()
    if not root.is_dir():
        raise UserError(f"{spec}: folder {root} does not exist; give GLUE's task folder (glue_data/{task.folder} "
                        "from GLUE's download script) or a datasets save_to_disk folder")
    for p in (root, root / task.folder):
        if _is_saved_dataset(p):
            return GlueSource(task, "hf_disk", p)
        if _has_tsv(task, p):
            return GlueSource(task, "tsv", p)
    files = ", ".join(f for _, f in task.tsv_files)
    raise UserError(f"{spec}: {root} holds neither GLUE's {task.folder} files ({files}) nor a {task.folder} folder "
                    "nor a datasets save_to_disk folder (dataset_dict.json); point DIR at one of them")


def load_examples(source: str | GlueSource, split: str, *, skip_bad_rows: bool = False) -> GlueExamples:
    """The examples of ``split`` (Hugging Face's split names, e.g. ``validation_matched``) from a source.

    ``skip_bad_rows`` drops TSV rows whose number of columns differs from the header's instead of raising.
    """
    src = source if isinstance(source, GlueSource) else parse_source(source)
    task = src.task
    task.check_split(split)
    if src.kind == "tsv":
        assert src.path is not None
        return read_tsv(task, src.path / task.tsv_file(split), split, skip_bad_rows=skip_bad_rows)
    return _from_hf(task, _open_hf(src), split, str(src))


# ------------------------------------------------------------------------------------------------ GLUE's TSVs


def _file_error(path: Path, line: int, problem: str) -> UserError:
    return UserError(f"{path}, line {line}: {problem}")


def read_tsv(task: str | GlueTask, path: str | os.PathLike[str], split: str = "", *,
             skip_bad_rows: bool = False) -> GlueExamples:
    """One of GLUE's TSV files (any split): text, labels where the file has a label column, and each row's index.

    Read with ``csv`` and ``QUOTE_NONE``: GLUE's text contains unbalanced quotes, which are literal characters. A
    leading byte-order mark (MRPC's files can start with one) is dropped. Columns are found by their header names;
    CoLA's train and dev files have no header (source, label, original mark, sentence) while its test file has
    ``index\\tsentence``. Blank lines are skipped.
    """
    task = get_task(task)
    p = Path(path)
    if not p.is_file():
        raise UserError(f"GLUE {task.name} file {p} does not exist; GLUE's download script writes "
                        f"{', '.join(f for _, f in task.tsv_files)} into {task.folder}/")
    a: list[str] = []
    b: list[str] | None = [] if task.is_pair else None
    labels: list[Any] = []
    index: list[int] = []
    with open(p, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        try:
            rows = [(reader.line_num, row) for row in reader if row]
        except csv.Error as e:
            raise _file_error(p, reader.line_num, f"not readable as GLUE's TSV ({e}); re-download the file") from None
    if not rows:
        return _make_examples(task, split, a, b, labels, index, str(p))
    first = rows[0][1]
    if task.name == "cola" and first[0] != "index":
        # CoLA's train/dev files are headerless: source, label, original mark, sentence.
        header = ["source", task.tsv_label_column, "original_mark", task.tsv_text_columns[0]]
        body = rows
    else:
        header, body = first, rows[1:]
    cols = {name: i for i, name in enumerate(header)}
    missing = [c for c in task.tsv_text_columns if c not in cols]
    if missing:
        raise _file_error(p, rows[0][0], f"header has no column {missing[0]!r} for GLUE {task.name} (columns: "
                                         f"{', '.join(header)}); is this {task.folder}'s file from GLUE's download?")
    text_idx = [cols[c] for c in task.tsv_text_columns]
    label_idx = cols.get(task.tsv_label_column)
    if label_idx is None and split and split not in task.test_splits:
        raise _file_error(p, rows[0][0], f"{split} file has no label column {task.tsv_label_column!r} (columns: "
                                         f"{', '.join(header)}); is this {task.folder}'s file from GLUE's download?")
    index_idx = cols.get("index", cols.get("id"))
    label_of = {s: i for i, s in enumerate(task.tsv_labels)}
    for row_number, (line, row) in enumerate(body):
        if len(row) != len(header):
            if skip_bad_rows:
                continue
            raise _file_error(p, line, f"expected {len(header)} tab-separated columns, found {len(row)}; fix or "
                                       "re-download the file, or pass skip_bad_rows=True to drop such rows")
        a.append(row[text_idx[0]])
        if b is not None:
            b.append(row[text_idx[1]])
        if index_idx is None:
            index.append(row_number)
        else:
            try:
                index.append(int(row[index_idx]))
            except ValueError:
                raise _file_error(p, line, f"index {row[index_idx]!r} is not an integer; fix or re-download "
                                           "the file") from None
        if label_idx is None:
            labels.append(None)
        elif task.is_regression:
            try:
                labels.append(float(row[label_idx]))
            except ValueError:
                raise _file_error(p, line, f"score {row[label_idx]!r} is not a number; fix or re-download the "
                                           "file") from None
        else:
            label = row[label_idx]
            if label not in label_of:
                raise _file_error(p, line, f"unknown {task.name} label {label!r}; GLUE's labels are "
                                           f"{', '.join(task.tsv_labels)} (fix the row or re-download the file)")
            labels.append(label_of[label])
    return _make_examples(task, split, a, b, labels, index, str(p))


# -------------------------------------------------------------------------------------------- Hugging Face


def _open_hf(src: GlueSource) -> Any:
    try:
        import datasets  # optional dependency, imported only for a Hugging Face source
    except ImportError:
        raise UserError(f"GLUE source {src} needs {_NEEDS_DATASETS}") from None
    try:
        if src.kind == "hf_disk":
            assert src.path is not None
            ds = datasets.load_from_disk(str(src.path))
            return ds if isinstance(ds, datasets.DatasetDict) else {"train": ds}
        return datasets.load_dataset(HUB_DATASET, src.task.name)
    except Exception as e:  # noqa: BLE001 - hub and disk errors come in many types; one clear line is what matters
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = ("; name a local GLUE folder instead (glue:TASK:DIR), or set HF_HUB_OFFLINE=1 without a network"
                if src.path is None else "; re-save it with DatasetDict.save_to_disk")
        raise UserError(f"cannot open GLUE source {src}: {type(e).__name__}: {first}{hint}") from None


def _from_hf(task: GlueTask, dsd: Any, split: str, source: str) -> GlueExamples:
    """Examples of ``split`` from a ``DatasetDict`` (or a dict of ``Dataset``) with Hugging Face's GLUE columns."""
    if split not in dsd:
        raise UserError(f"{source} has no split {split!r} (it has {', '.join(dsd)}); save the split or pick "
                        "one of those")
    ds = dsd[split]
    names = list(ds.column_names)
    need = [*task.hf_text_columns, "label"]
    missing = [c for c in need if c not in names]
    if missing:
        raise UserError(f"{source} split {split} has no column {missing[0]!r} (columns: {', '.join(names)}); "
                        f"GLUE {task.name} needs {', '.join(need)} as in Hugging Face's glue dataset")
    a = [str(s) for s in ds[task.hf_text_columns[0]]]
    b = [str(s) for s in ds[task.hf_text_columns[1]]] if task.is_pair else None
    raw = list(ds["label"])
    index = [int(i) for i in ds["idx"]] if "idx" in names else list(range(len(a)))
    labels: list[Any]
    if task.is_regression:
        # Hugging Face marks unlabelled STS-B rows with -1 (scores lie in [0, 5]).
        labels = [None if v is None or float(v) < 0 else float(v) for v in raw]
    else:
        feature = ds.features.get("label")
        hf_names = list(getattr(feature, "names", None) or task.hf_label_names)
        unknown = [n for n in hf_names if n not in task.label_names]
        if unknown:
            raise UserError(f"{source} label {unknown[0]!r} is not a GLUE {task.name} label "
                            f"({', '.join(task.label_names)}); is this the {task.name} dataset?")
        to_internal = [task.label_names.index(n) for n in hf_names]
        labels = []
        for v in raw:
            if v is None or int(v) < 0:
                labels.append(None)
            elif int(v) >= len(to_internal):
                raise UserError(f"{source} split {split} has label id {int(v)} but GLUE {task.name} has "
                                f"{len(to_internal)} labels; is this the {task.name} dataset?")
            else:
                labels.append(to_internal[int(v)])
    return _make_examples(task, split, a, b, labels, index, source)


# ------------------------------------------------------------------------------------------------- encoding


def truncated_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths of two segments cut to ``len_a + len_b <= budget`` by removing one token at a time from the end of
    the longer segment (of the second when they are equal): the longer is cut down to the shorter first, then the
    two shrink in turn, so the first keeps ``ceil(budget / 2)`` and the second ``floor(budget / 2)``. Closed form
    of that loop."""
    if len_a + len_b <= budget:
        return len_a, len_b
    if len_a <= len_b and 2 * len_a <= budget:
        return len_a, budget - len_a
    if len_b < len_a and 2 * len_b <= budget:
        return budget - len_b, len_b
    return (budget + 1) // 2, budget // 2


def encode(examples: GlueExamples, tokenizer: Any, seq_len: int) -> dict[str, np.ndarray]:
    """Fixed-length token rows for a classifier that reads the last real token.

    Each row is ``[eot] a [eot] b [eot]`` (pairs) or ``[eot] a [eot]`` (single sentences), then ``eot`` padding to
    ``seq_len``. Too long a pair is truncated by removing tokens from the END of the longer segment, one at a time
    (the second when they are equal; :func:`truncated_lengths`); a single sentence loses its end. The final
    ``eot`` always fits, so the classifier always reads an end-of-text token that has seen the whole input.

    Returns ``inputs`` [N, seq_len] int32, ``positions`` [N] int32 (column of the final ``eot``), ``labels`` [N]
    (int32 ids, -1 unlabelled; float32 for STS-B, NaN unlabelled) and ``index`` [N] int32 (GLUE's row index).
    """
    task = examples.task
    specials = 3 if task.is_pair else 2
    if seq_len < specials:
        raise UserError(f"seq_len {seq_len} is too short for GLUE {task.name}: its layout needs {specials} "
                        f"end-of-text tokens; use seq_len >= {specials} (128 is usual)")
    budget = seq_len - specials
    eot = int(tokenizer.eot_id)
    n = len(examples)

    def tokens(texts: Sequence[str]) -> list[np.ndarray]:
        batch = getattr(tokenizer, "encode_batch", None)
        return list(batch(list(texts))) if batch is not None else [tokenizer.encode(t) for t in texts]

    ta = tokens(examples.text_a)
    tb = tokens(examples.text_b) if examples.text_b is not None else None
    inputs = np.full((n, seq_len), eot, dtype=np.int32)
    positions = np.zeros(n, dtype=np.int32)
    for i in range(n):
        a = np.asarray(ta[i], dtype=np.int32)
        if tb is None:
            la = min(len(a), budget)
            inputs[i, 1:1 + la] = a[:la]
            positions[i] = la + 1
        else:
            b = np.asarray(tb[i], dtype=np.int32)
            la, lb = truncated_lengths(len(a), len(b), budget)
            inputs[i, 1:1 + la] = a[:la]
            inputs[i, 2 + la:2 + la + lb] = b[:lb]
            positions[i] = la + lb + 2
    return {"inputs": inputs, "positions": positions, "labels": examples.labels.copy(),
            "index": examples.index.copy()}


# -------------------------------------------------------------------------------------------------- metrics


def _pair(predictions: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    p, y = np.asarray(predictions).reshape(-1), np.asarray(labels).reshape(-1)
    if p.shape != y.shape:
        raise UserError(f"{p.size} predictions for {y.size} labels; score one prediction per example")
    if p.size == 0:
        raise UserError("no examples to score; the evaluation split is empty")
    return p, y


def accuracy(predictions: Any, labels: Any) -> float:
    """Fraction of [N] predicted ids equal to the [N] label ids."""
    p, y = _pair(predictions, labels)
    return float(np.mean(p == y))


def f1(predictions: Any, labels: Any) -> float:
    """F1 of the positive class 1 over [N] binary ids: ``2 tp / (2 tp + fp + fn)``; 0 when no example is
    predicted or labelled positive (precision or recall undefined counts as 0)."""
    p, y = _pair(predictions, labels)
    tp = int(np.sum((p == 1) & (y == 1)))
    fp = int(np.sum((p == 1) & (y != 1)))
    fn = int(np.sum((p != 1) & (y == 1)))
    return 0.0 if tp == 0 else 2.0 * tp / (2 * tp + fp + fn)


def matthews_corrcoef(predictions: Any, labels: Any) -> float:
    """Matthews correlation of [N] predicted and true ids (any number of classes; for two it is
    ``(tp tn - fp fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn))``). 0 when either side has a single class, where the
    correlation is undefined (a constant predictor has no skill)."""
    p, y = _pair(predictions, labels)
    classes, inv = np.unique(np.concatenate([p, y]), return_inverse=True)
    k = len(classes)
    conf = np.zeros((k, k), dtype=np.float64)  # [true, predicted]
    np.add.at(conf, (inv[p.size:], inv[:p.size]), 1.0)
    t, q = conf.sum(axis=1), conf.sum(axis=0)
    s, c = conf.sum(), np.trace(conf)
    den = math.sqrt((s * s - q @ q) * (s * s - t @ t))
    return 0.0 if den == 0 else float((c * s - t @ q) / den)


def pearson(predictions: Any, labels: Any) -> float:
    """Pearson correlation of [N] values; 0 when either side is constant (undefined there)."""
    p, y = _pair(predictions, labels)
    dp, dy = p.astype(np.float64) - p.mean(dtype=np.float64), y.astype(np.float64) - y.mean(dtype=np.float64)
    den = math.sqrt(float(dp @ dp) * float(dy @ dy))
    return 0.0 if den == 0 else float(dp @ dy) / den


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1; tied values share the mean of the ranks they span."""
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # rank - 1 of each distinct value's first occurrence
    return (first + (counts + 1) / 2.0)[inv.reshape(-1)]


def spearman(predictions: Any, labels: Any) -> float:
    """Spearman correlation of [N] values: Pearson of their ranks, ties given their average rank."""
    p, y = _pair(predictions, labels)
    return pearson(_average_ranks(p.astype(np.float64)), _average_ranks(y.astype(np.float64)))


METRICS = {"accuracy": accuracy, "f1": f1, "matthews_corrcoef": matthews_corrcoef, "pearson": pearson,
           "spearman": spearman}


def _predicted(task: GlueTask, predictions: Any) -> np.ndarray:
    """[N] ids from [N] ids or [N, num_labels] logits; [N] floats from STS-B's [N] or [N, 1] outputs."""
    p = np.asarray(predictions)
    if task.is_regression:
        if p.ndim == 2 and p.shape[1] == 1:
            p = p[:, 0]
        if p.ndim != 1:
            raise UserError(f"STS-B predictions must have shape [N] or [N, 1], got {list(p.shape)}")
        return p.astype(np.float64)
    if p.ndim == 2:
        if p.shape[1] != task.num_labels:
            raise UserError(f"{task.name} logits must have shape [N, {task.num_labels}], got {list(p.shape)}")
        p = p.argmax(axis=1)
    if p.ndim != 1:
        raise UserError(f"{task.name} predictions must be [N] label ids or [N, {task.num_labels}] logits, got "
                        f"shape {list(p.shape)}")
    if not np.issubdtype(p.dtype, np.integer):
        if not np.all(p == np.round(p)):
            raise UserError(f"{task.name} predictions must be integer label ids or [N, {task.num_labels}] logits")
        p = p.astype(np.int64)
    if p.size and (p.min() < 0 or p.max() >= task.num_labels):
        raise UserError(f"{task.name} label ids lie in 0..{task.num_labels - 1}, got {int(p.min())}..{int(p.max())}")
    return p


def score(task: str | GlueTask, predictions: Any, labels: Any) -> dict[str, float]:
    """GLUE's official metrics of a task, plus ``main``: the value of the task's :attr:`GlueTask.main_metric`.

    ``predictions``: [N] label ids or [N, num_labels] logits (argmax is taken); for STS-B [N] or [N, 1] scores.
    ``labels``: [N] internal ids (float scores for STS-B), e.g. ``encode(...)["labels"]``. Unlabelled rows (-1 or
    NaN: a test split) cannot be scored.
    """
    t = get_task(task)
    p = _predicted(t, predictions)
    y = np.asarray(labels).reshape(-1)
    if y.size and _unlabelled(t, y.astype(np.float64) if t.is_regression else y).any():
        raise UserError(f"{t.name} labels include unlabelled rows (-1 or NaN, as in a test split); score a "
                        "validation split, and write_submission for a test split")
    out = {m: METRICS[m](p, y) for m in t.metrics}
    out["main"] = out[t.main_metric]
    return out


# ----------------------------------------------------------------------------------------------- submission


def write_submission(task: str | GlueTask, split: str, index: Any, predictions: Any,
                     out_dir: str | os.PathLike[str]) -> Path:
    """Writes GLUE's submission file for a test split and returns its path.

    ``index``: [N] GLUE row indices (``encode(...)["index"]``); ``predictions``: [N] ids or [N, num_labels] logits
    (STS-B: [N] or [N, 1] scores). The file, named as GLUE's server expects (``CoLA.tsv``, ..., ``MNLI-m.tsv`` /
    ``MNLI-mm.tsv`` for MNLI's matched / mismatched test), holds a header ``index\\tprediction`` and one row per
    example in increasing index order. Predictions are written as GLUE's TSV files write labels: strings for
    MNLI, QNLI and RTE (``entailment``...), 0/1 for CoLA, SST-2, MRPC, QQP and WNLI, and STS-B scores clipped to
    [0, 5]. Written to a temporary file in ``out_dir`` and renamed over the final name.
    """
    t = get_task(task)
    if split not in t.test_splits:
        raise UserError(f"GLUE's server takes {t.name}'s test split{'s' if len(t.test_splits) > 1 else ''} "
                        f"({', '.join(t.test_splits)}), not {split!r}; predict on that split")
    p = _predicted(t, predictions)
    idx = np.asarray(index).reshape(-1)
    if idx.size != p.size:
        raise UserError(f"{idx.size} indices for {p.size} predictions; pass encode(...)['index'] of the same rows")
    if len(np.unique(idx)) != idx.size:
        raise UserError(f"{t.name} {split} indices repeat; each test example must be predicted exactly once")
    order = np.argsort(idx, kind="stable")
    if t.is_regression:
        values = [f"{v:.6f}" for v in np.clip(p[order], 0.0, 5.0)]
    else:
        values = [t.tsv_labels[int(v)] for v in p[order]]
    body = "".join(f"{int(i)}\t{v}\n" for i, v in zip(idx[order], values))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / t.submission_files[t.test_splits.index(split)]
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write("index\tprediction\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
