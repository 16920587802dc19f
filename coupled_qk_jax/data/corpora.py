"""Text corpora: where documents come from and which split each one belongs to.

A corpus is described by a :class:`CorpusSpec` (a small frozen dataclass that can also be written as a string, see
:meth:`CorpusSpec.parse`) and read with :func:`iter_documents`, which yields the documents (``str``) of one split,
``"train"``, ``"validation"`` or ``"test"``, in a deterministic order.

Kinds:

* ``stdlib`` - the running interpreter's standard library ``.py`` files (``sysconfig.get_paths()["stdlib"]``),
  without ``test``/``tests`` folders or ``site-packages``; about 12 MB. The embedded default corpus.
* ``text_dir`` - every ``.txt``/``.md``/``.rst``/``.py`` file under a local directory.
* ``wikitext103`` - the raw WikiText-103 files ``wiki.{train,valid,test}.raw`` in a local directory; one document
  per article.
* ``hf`` - any Hugging Face dataset by name, config and text field, from the hub or a local parquet/arrow/json/csv
  folder or file or a ``save_to_disk`` folder; ``datasets`` (the ``[hf]`` extra) is imported only here.
* ``mixture`` - weighted sources, for heterogeneous-corpus experiments.
* ``tokens`` - token ids already prepared: a directory written by ``python -m coupled_qk_jax.data.prepare`` (shards
  and a manifest) or a nanoGPT-style folder (``train.bin``, ``val.bin``). It holds no text, so
  :func:`iter_documents` refuses it; the trainer opens it with ``coupled_qk_jax.data.prepared.open_tokens``.

File-based corpora split *by file*: a file's split is a function of the SHA-256 of its path relative to the corpus
root alone, so adding or removing other files never moves it, and the split is the same on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import re
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from coupled_qk_jax.errors import UserError

logger = logging.getLogger(__name__)

SPLITS: tuple[str, ...] = ("train", "validation", "test")
TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".rst", ".py")
# Folders never read from the standard library: its test suites (about 20 MB of mostly synthetic code) and anything
# installed into it, which is not the standard library.
STDLIB_EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
WIKITEXT_FILES: dict[str, str] = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}
KINDS: tuple[str, ...] = ("stdlib", "text_dir", "wikitext103", "hf", "mixture", "tokens")


class CorpusError(UserError):
    """A corpus cannot be read as asked (missing or empty directory, unknown kind, bad split...). One-line message."""


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """What to read. Everything that changes the documents is a field, so the spec alone keys the token cache.

    Attributes:
      kind: one of :data:`KINDS`.
      path: root directory for ``text_dir``, ``wikitext103`` and ``tokens``.
      name, config, text_field: the Hugging Face dataset (``hf`` only): a hub name or a local file or folder.
      sources: ``((spec, weight), ...)`` for ``mixture``; weights are relative shares of the mixture's text.
      split_fractions: (train, validation, test) fractions for file-based splitting (and for ``hf`` datasets that
        lack a validation/test split). Ignored by ``wikitext103``, which ships its own split.
      suffixes: file endings read by ``text_dir``.
      max_bytes: optional cap on the UTF-8 bytes yielded per split (whole documents; at least one).
      seed: the order in which a ``mixture`` interleaves its sources' documents.
    """

    kind: str = "stdlib"
    path: str | None = None
    name: str | None = None
    config: str | None = None
    text_field: str = "text"
    sources: tuple[tuple["CorpusSpec", float], ...] = ()
    split_fractions: tuple[float, float, float] = (0.98, 0.01, 0.01)
    suffixes: tuple[str, ...] = TEXT_SUFFIXES
    max_bytes: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CorpusError(f"unknown corpus kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        fr = tuple(float(f) for f in self.split_fractions)
        if len(fr) != 3 or min(fr) < 0 or abs(sum(fr) - 1.0) > 1e-6:
            raise CorpusError(f"split_fractions must be three non-negative numbers summing to 1, got {fr}")
        object.__setattr__(self, "split_fractions", fr)
        object.__setattr__(self, "suffixes", tuple(self.suffixes))
        if self.kind in ("text_dir", "wikitext103", "tokens") and not self.path:
            raise CorpusError(f"corpus kind {self.kind!r} needs a directory: {self.kind}:/path/to/dir")
        if self.kind == "hf" and not self.name:
            raise CorpusError("corpus kind 'hf' needs a dataset name: hf:NAME[:CONFIG[:TEXT_FIELD]]")
        if self.kind == "mixture":
            if not self.sources:
                raise CorpusError("a mixture needs at least one (spec, weight) source")
            srcs = tuple((CorpusSpec.coerce(s), float(w)) for s, w in self.sources)
            if any(w <= 0 for _, w in srcs):
                raise CorpusError(f"mixture weights must be positive, got {[w for _, w in srcs]}")
            object.__setattr__(self, "sources", srcs)
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise CorpusError(f"max_bytes must be positive, got {self.max_bytes}")

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "CorpusSpec":
        """Parses the string form used in configs and on command lines.

        ``stdlib`` | ``text_dir:DIR`` | ``wikitext103:DIR`` | ``tokens:DIR`` | ``hf:NAME[:CONFIG[:TEXT_FIELD]]`` |
        ``mixture:SPEC@WEIGHT;SPEC@WEIGHT;...`` (e.g. ``mixture:stdlib@1;text_dir:/data/shakespeare@2``).
        """
        text = text.strip()
        kind, _, rest = text.partition(":")
        if kind == "stdlib" and not rest:
            return cls("stdlib")
        if kind in ("text_dir", "wikitext103", "tokens"):
            return cls(kind, path=rest)
        if kind == "hf":
            parts = rest.split(":")
            if not parts[0] or len(parts) > 3:
                raise CorpusError(f"bad hf corpus spec {text!r}; expected hf:NAME[:CONFIG[:TEXT_FIELD]]")
            return cls("hf", name=parts[0], config=(parts[1] or None) if len(parts) > 1 else None,
                       text_field=parts[2] if len(parts) > 2 and parts[2] else "text")
        if kind == "mixture":
            sources = []
            for item in filter(None, (s.strip() for s in rest.split(";"))):
                spec, at, weight = item.rpartition("@")
                if not at:
                    raise CorpusError(f"mixture source {item!r} lacks a weight; write SPEC@WEIGHT")
                try:
                    sources.append((cls.parse(spec), float(weight)))
                except ValueError as e:
                    if isinstance(e, CorpusError):
                        raise
                    raise CorpusError(f"mixture weight {weight!r} in {item!r} is not a number") from None
            return cls("mixture", sources=tuple(sources))
        raise CorpusError(f"cannot parse corpus spec {text!r}; expected stdlib, text_dir:DIR, wikitext103:DIR, "
                          "tokens:DIR, hf:NAME[:CONFIG[:FIELD]] or mixture:SPEC@W;SPEC@W")

    @classmethod
    def coerce(cls, spec: "CorpusSpec | str | dict[str, Any]") -> "CorpusSpec":
        """Accepts a spec, its string form or its :meth:`to_dict` form."""
        if isinstance(spec, CorpusSpec):
            return spec
        if isinstance(spec, str):
            return cls.parse(spec)
        if isinstance(spec, dict):
            d = dict(spec)
            if "sources" in d:
                d["sources"] = tuple((cls.coerce(s), float(w)) for s, w in d["sources"])
            for key in ("split_fractions", "suffixes"):
                if key in d:
                    d[key] = tuple(d[key])
            return cls(**d)
        raise CorpusError(f"a corpus spec must be a CorpusSpec, str or dict, not {type(spec).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; stable, so its hash keys the token cache. Directories are made absolute."""
        d = dataclasses.asdict(self)
        d["path"] = _absolute(self.path) if self.path else None
        if self.kind == "hf" and self.name and os.path.exists(os.path.expanduser(self.name)):
            d["name"] = os.path.abspath(os.path.expanduser(self.name))  # a local dataset: key it by where it is
        d["sources"] = [[s.to_dict(), w] for s, w in self.sources]
        d["split_fractions"] = list(self.split_fractions)
        d["suffixes"] = list(self.suffixes)
        return d

    def __str__(self) -> str:
        if self.kind == "stdlib":
            return "stdlib"
        if self.kind in ("text_dir", "wikitext103", "tokens"):
            return f"{self.kind}:{self.path}"
        if self.kind == "hf":
            return f"hf:{self.name}:{self.config or ''}:{self.text_field}"
        return "mixture:" + ";".join(f"{s}@{w:g}" for s, w in self.sources)


def _absolute(path: str) -> str:
    """A local path made absolute; a URL such as ``gs://bucket/dir`` (prepared tokens may live there) kept as is."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


@dataclasses.dataclass
class ReadStats:
    """Filled in by :func:`iter_documents`: what was read and what was skipped."""

    documents: int = 0
    bytes: int = 0
    skipped_non_utf8: list[str] = dataclasses.field(default_factory=list)


# -- splitting -----------------------------------------------------------------------------------------------------
def split_of(key: str, fractions: Sequence[float] = (0.98, 0.01, 0.01)) -> str:
    """The split of one file (or record), from the SHA-256 of ``key`` alone.

    Why a hash and not a shuffle: the assignment of a file must not depend on which other files exist, so a corpus
    that grows keeps its old validation/test files where they were and the split is identical on every machine.
    """
    u = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if u < fractions[0]:
        return "train"
    if u < fractions[0] + fractions[1]:
        return "validation"
    return "test"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, suffixes: Sequence[str], excluded_dirs: frozenset[str]) -> list[str]:
    """Relative POSIX paths of the matching files under ``root``, sorted (sorted so the order is reproducible)."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excluded_dirs and not d.startswith("."))
        for fn in filenames:
            if fn.endswith(tuple(suffixes)) and not fn.startswith("."):
                out.append((Path(dirpath) / fn).relative_to(root).as_posix())
    return sorted(out)


def _corpus_root(spec: CorpusSpec) -> Path:
    if spec.kind == "stdlib":
        root = stdlib_root()
    else:
        assert spec.path is not None
        root = Path(os.path.expanduser(spec.path))
    if not root.exists():
        raise CorpusError(f"corpus directory {root} does not exist")
    if not root.is_dir():
        raise CorpusError(f"corpus path {root} is not a directory")
    return root


def all_files(spec: CorpusSpec) -> tuple[Path, list[str]]:
    """(root, sorted relative paths of every file) of a ``stdlib`` or ``text_dir`` corpus, across all splits."""
    spec = CorpusSpec.coerce(spec)
    if spec.kind not in ("stdlib", "text_dir"):
        raise CorpusError(f"corpus kind {spec.kind!r} is not a directory of files")
    root = _corpus_root(spec)
    if spec.kind == "stdlib":
        files = _walk(root, (".py",), STDLIB_EXCLUDED_DIRS)
    else:
        files = _walk(root, spec.suffixes, frozenset({"__pycache__"}))
    if not files:
        raise CorpusError(f"corpus directory {root} has no {'/'.join(spec.suffixes)} files")
    return root, files


def list_files(spec: CorpusSpec | str, split: str) -> list[str]:
    """Sorted relative paths of the files of one split of a ``stdlib`` or ``text_dir`` corpus (reads no file)."""
    spec = CorpusSpec.coerce(spec)
    _check_split(split)
    _, files = all_files(spec)
    return [f for f in files if split_of(f, spec.split_fractions) == split]


def source_fingerprint(spec: CorpusSpec | str) -> dict[str, Any]:
    """A cheap description of the sources as they are now (no file contents read), to notice a changed corpus.

    For file corpora: the SHA-256 of the list of (relative path, size, mtime_ns); for WikiText the same over its
    three files; for a local ``hf`` file or folder the same over its files; for a hub dataset only the spec (the
    hub versions it); for a mixture, its sources'.
    """
    spec = CorpusSpec.coerce(spec)
    h = hashlib.sha256()
    if spec.kind in ("stdlib", "text_dir"):
        root, files = all_files(spec)
        for f in files:
            st = (root / f).stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"kind": spec.kind, "files": len(files), "file_list_sha256": h.hexdigest()}
    if spec.kind == "wikitext103":
        paths = _wikitext_paths(spec)
        for split in SPLITS:
            st = paths[split].stat()
            h.update(f"{paths[split].name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"kind": spec.kind, "files": 3, "file_list_sha256": h.hexdigest()}
    if spec.kind == "hf":
        local = hf_local_path(spec)
        if local is None:  # a hub dataset: the hub versions it
            return {"kind": "hf", "name": spec.name, "config": spec.config}
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for p in files:
            st = p.stat()
            h.update(f"{p.name if p == local else p.relative_to(local)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"kind": "hf", "files": len(files), "file_list_sha256": h.hexdigest()}
    if spec.kind == "tokens":
        from coupled_qk_jax.data.prepared import tokens_fingerprint  # noqa: PLC0415 - avoids an import cycle

        return tokens_fingerprint(spec.path or "")
    return {"kind": "mixture", "sources": [source_fingerprint(s) for s, _ in spec.sources]}


# -- readers ---------------------------------------------------------------------------------------------------------
def _read_files(root: Path, files: list[str], stats: ReadStats) -> Iterator[str]:
    for f in files:
        data = (root / f).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            # One badly encoded file should not stop a 2,000-file corpus; it is counted and reported instead.
            stats.skipped_non_utf8.append(f)
            continue
        if text:
            yield text


def _wikitext_paths(spec: CorpusSpec) -> dict[str, Path]:
    assert spec.path is not None
    root = Path(os.path.expanduser(spec.path))
    for cand in (root, root / "wikitext-103-raw"):
        paths = {s: cand / fn for s, fn in WIKITEXT_FILES.items()}
        if all(p.is_file() for p in paths.values()):
            return paths
    raise CorpusError(
        f"WikiText-103 not found: put wiki.train.raw, wiki.valid.raw and wiki.test.raw in {root} (with a network: "
        f"pip install datasets, then python -m coupled_qk_jax.data.corpora wikitext103 {root}; or use the corpus "
        "hf:Salesforce/wikitext:wikitext-103-raw-v1)")


# An article title line in the raw WikiText files is " = Title = " (sections use " = = ... = = ").
_WIKI_TITLE = re.compile(r"^ = [^=].* = $")


def _read_wikitext(path: Path) -> Iterator[str]:
    """One document per article: the lines from one top-level title up to the next."""
    buf: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if _WIKI_TITLE.match(line.rstrip("\n")) and any(s.strip() for s in buf):
                yield "".join(buf)
                buf = []
            buf.append(line)
    if any(s.strip() for s in buf):
        yield "".join(buf)


# Local single files an ``hf:`` corpus may name, and the ``datasets`` builder that reads each.
HF_FILE_BUILDERS: dict[str, str] = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json",
                                    ".csv": "csv"}
_NEEDS_DATASETS = 'the Hugging Face datasets package: pip install datasets (or pip install -e ".[hf]")'


def hf_local_path(spec: CorpusSpec) -> Path | None:
    """The local file or folder an ``hf:`` spec names, or None for a hub dataset.

    ``hf:DIR:CONFIG`` with a ``DIR/CONFIG`` folder reads that folder, which is the layout of a downloaded hub
    snapshot (``huggingface-cli download Salesforce/wikitext --repo-type dataset --local-dir DIR`` gives
    ``DIR/wikitext-103-raw-v1/{train,validation,test}-*.parquet``).
    """
    assert spec.name is not None
    p = Path(os.path.expanduser(spec.name))
    if not p.exists():
        return None
    if spec.config and (p / spec.config).is_dir():
        p = p / spec.config
    return p.absolute()


def _hf_offline() -> bool:
    import datasets  # noqa: PLC0415

    return bool(getattr(datasets.config, "HF_HUB_OFFLINE", False)) or os.environ.get(
        "HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _open_hf(spec: CorpusSpec) -> Any:
    """``{split name: iterable of row dicts}`` of an ``hf:`` corpus: streamed from the hub or a local folder/file
    (parquet, arrow, json, csv; split names inferred from the file names, as ``datasets.load_dataset`` does), or a
    ``save_to_disk`` folder (memory-mapped)."""
    try:
        import datasets  # noqa: PLC0415 - optional dependency, imported only when an hf corpus is asked for
    except ImportError:
        raise CorpusError(f"corpus {spec} needs {_NEEDS_DATASETS}") from None
    local = hf_local_path(spec)
    try:
        if local is None:  # the hub; streaming avoids downloading all of a 40 GB corpus when max_bytes caps it
            return datasets.load_dataset(spec.name, spec.config, streaming=True)
        if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():  # save_to_disk
            ds = datasets.load_from_disk(str(local))
            return ds if isinstance(ds, datasets.DatasetDict) else {"train": ds}
        if local.is_file():
            builder = HF_FILE_BUILDERS.get(local.suffix)
            if builder is None:
                raise CorpusError(f"hf corpus file {local} is not one of {', '.join(HF_FILE_BUILDERS)}; for plain "
                                  "text use text_dir:DIR")
            return datasets.load_dataset(builder, data_files=str(local), streaming=True)
        return datasets.load_dataset(str(local), streaming=True)
    except CorpusError:
        raise
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; one clear line is what matters here
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if local is None and _hf_offline():
            raise CorpusError(f"hf:{spec.name} is not a local path and not in the Hugging Face cache, and "
                              "HF_HUB_OFFLINE is set: download it once with a network, or name a local parquet/"
                              "arrow/save_to_disk folder (docs/data.md)") from None
        hint = "" if local is not None else " (without a network, set HF_HUB_OFFLINE=1 to fail at once)"
        raise CorpusError(f"cannot open Hugging Face dataset {spec.name!r} (config {spec.config!r}): "
                          f"{type(e).__name__}: {first}{hint}") from None


def carve_fractions(available: set[str], fractions: Sequence[float]) -> tuple[float, float, float] | None:
    """How train rows are divided when a dataset lacks some splits: None when it has all three; otherwise the
    fractions of (train, validation, test) over train's rows, zero for the splits the dataset has itself and
    renormalised over the others, so every row lands in exactly one split (train included)."""
    missing = [s for s in SPLITS[1:] if s not in available]
    if not missing:
        return None
    kept = [f if s == "train" or s in missing else 0.0 for s, f in zip(SPLITS, fractions)]
    total = sum(kept)
    if total <= 0:
        raise CorpusError(f"split_fractions {tuple(fractions)} give no rows to the carved split(s) {missing}")
    return (kept[0] / total, kept[1] / total, kept[2] / total)


def _read_hf(spec: CorpusSpec, split: str) -> Iterator[str]:
    splits = _open_hf(spec)
    available = set(splits)
    if "train" not in available:
        raise CorpusError(f"dataset {spec.name!r} has splits {sorted(available)}, no train split")
    carve = carve_fractions(available, spec.split_fractions)
    from_train = carve is not None and (split == "train" or split not in available)
    if from_train:
        # Datasets such as OpenWebText ship only "train": the missing splits are carved out of it by a hash of the
        # row index, and train keeps only the rest (no row is in two splits).
        logger.info("dataset %s lacks %s; carving from train with fractions %s", spec.name,
                    [s for s in SPLITS if s not in available], carve)
    for i, row in enumerate(splits["train" if from_train else split]):
        if from_train and split_of(f"row/{i}", carve) != split:
            continue
        text = row.get(spec.text_field)
        if text is None:
            raise CorpusError(f"dataset {spec.name!r} has no text field {spec.text_field!r}; fields: {sorted(row)}")
        if text:
            yield text


def _read_mixture(spec: CorpusSpec, split: str, stats: ReadStats) -> Iterator[str]:
    """Weighted mixture of the sources' same split, documents interleaved in a seeded random order.

    Weights are shares of the mixture's UTF-8 bytes. No document is repeated: the mixture is as large as the
    scarcest source allows (total = min_i bytes_i / w_i) and each source contributes its first w_i * total bytes.
    The sources' text is held in memory while mixing (cap large sources with max_bytes).
    """
    weights = [w for _, w in spec.sources]
    total_w = sum(weights)
    docs_per_source: list[list[str]] = []
    for sub, _ in spec.sources:
        sub_stats = ReadStats()
        docs_per_source.append(list(iter_documents(sub, split, stats=sub_stats, warn=False)))
        stats.skipped_non_utf8.extend(f"{sub}/{f}" for f in sub_stats.skipped_non_utf8)
    sizes = [sum(len(d.encode("utf-8")) for d in docs) for docs in docs_per_source]
    if not any(sizes):
        return
    # Sources with no text in this split (a tiny validation split) are left out rather than emptying the mixture.
    live = [(i, w / total_w) for i, w in enumerate(weights) if sizes[i] > 0]
    live_w = sum(w for _, w in live)
    total = min(sizes[i] / (w / live_w) for i, w in live)
    chosen: list[str] = []
    for i, w in live:
        budget, used = total * w / live_w, 0
        for d in docs_per_source[i]:
            if used >= budget * (1 - 1e-9):
                break
            chosen.append(d)
            used += len(d.encode("utf-8"))
    random.Random(f"mixture/{spec.seed}/{split}").shuffle(chosen)
    yield from chosen


def iter_documents(spec: CorpusSpec | str | dict[str, Any], split: str, *, stats: ReadStats | None = None,
                   warn: bool = True) -> Iterator[str]:
    """Yields the documents (non-empty ``str``) of one split, in a deterministic order.

    Args:
      spec: a :class:`CorpusSpec`, its string form or its dict form.
      split: ``"train"``, ``"validation"`` or ``"test"``.
      stats: optional :class:`ReadStats`, filled in as documents are read (counts, skipped non-UTF-8 files).
      warn: when files were skipped, emit one ``UserWarning`` naming the count at the end.

    Raises:
      CorpusError: missing/empty directory, missing WikiText files, unknown split, missing ``datasets``.
    """
    spec = CorpusSpec.coerce(spec)
    _check_split(split)
    stats = stats if stats is not None else ReadStats()
    if spec.kind in ("stdlib", "text_dir"):
        root, files = all_files(spec)
        docs = _read_files(root, [f for f in files if split_of(f, spec.split_fractions) == split], stats)
    elif spec.kind == "wikitext103":
        docs = _read_wikitext(_wikitext_paths(spec)[split])
    elif spec.kind == "hf":
        docs = _read_hf(spec, split)
    elif spec.kind == "tokens":
        raise CorpusError(f"corpus {spec} holds token ids, not text: it can be trained on (data.corpus) but not "
                          "read as documents, tokenised again or mixed")
    else:
        docs = _read_mixture(spec, split, stats)
    for doc in docs:
        n = len(doc.encode("utf-8"))
        if spec.max_bytes is not None and stats.documents > 0 and stats.bytes + n > spec.max_bytes:
            break
        stats.documents += 1
        stats.bytes += n
        yield doc
    if warn and stats.skipped_non_utf8:
        msg = (f"corpus {spec} split {split}: skipped {len(stats.skipped_non_utf8)} non-UTF-8 file(s), e.g. "
               f"{stats.skipped_non_utf8[0]}")
        logger.warning(msg)
        warnings.warn(msg, stacklevel=2)


def download_wikitext103(dest: str | os.PathLike[str]) -> Path:
    """Writes ``wiki.{train,valid,test}.raw`` into ``dest`` from the hub's ``wikitext-103-raw-v1`` (needs a network
    and ``pip install datasets``). The hub rows are the raw files' lines, so joining them restores the raw files."""
    try:
        import datasets  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise CorpusError(f"downloading WikiText-103 needs {_NEEDS_DATASETS}") from None
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for split, fn in WIKITEXT_FILES.items():
        ds = datasets.load_dataset("Salesforce/wikitext", "wikitext-103-raw-v1", split=split)
        tmp = out / f".{fn}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in ds:
                fh.write(row["text"])
        os.replace(tmp, out / fn)
    return out


if __name__ == "__main__":  # python -m coupled_qk_jax.data.corpora wikitext103 DIR
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "wikitext103":
        sys.exit("usage: python -m coupled_qk_jax.data.corpora wikitext103 DEST_DIR")
    print(download_wikitext103(sys.argv[2]))
