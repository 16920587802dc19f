"""Tokenise a corpus once into flat token files, one per split, and reuse them.

Layout (``CACHE`` is the ``cache_dir`` argument)::

    CACHE/tokens/<corpus kind>-<key>/
        manifest.json        written last: its presence means the entry is complete
        tokenizer.json       the BPE tokenizer (absent for the byte tokenizer)
        train.bin            flat token ids, uint16 when vocab_size <= 65535 else uint32,
        validation.bin       every document followed by <|endoftext|>
        test.bin

``<key>`` is the first 16 hex digits of the SHA-256 of the corpus spec plus the tokenizer settings (kind, vocab size,
the tokenizer file's hash when one is given, the BPE training cap) plus :data:`FORMAT_VERSION`. An entry is reused
when its manifest has the same key and the corpus files still have the same list/sizes/mtimes; otherwise it is rebuilt.
Every file is written to a temporary name in the entry's directory, fsynced and moved into place with ``os.replace``,
so a crash never leaves a half-written file under the final name; a rebuild removes the old manifest first, so an
interrupted one leaves an incomplete entry, never a complete-looking mix.

In a multi-process run (:func:`shared_token_cache`) one process tokenises: process 0 trains the BPE and writes the
entry while the others wait at a barrier, then open it. Where ``cache_dir`` is not storage the processes share (each
host's own disk), each host's processes build their own copy instead, as a single process would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import secrets
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from coupled_qk_jax.data.corpora import (
    SPLITS, CorpusError, CorpusSpec, ReadStats, all_files, hf_local_path, iter_documents, list_files,
    source_fingerprint, split_of)
from coupled_qk_jax.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, tokenizer_json_sha256
from coupled_qk_jax.paths import write_json

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Documents per encode_batch call: large enough to keep the Rust thread pool busy, small enough to bound memory.
_ENCODE_CHUNK_BYTES = 8 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the file and the page cache when the ids fit; uint32 otherwise."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


@dataclasses.dataclass(frozen=True)
class TokenCache:
    """A built cache entry. ``tokens(split)`` is a read-only ``np.memmap`` [n_tokens] of ``manifest['dtype']``."""

    directory: Path
    manifest: dict[str, Any]
    tokenizer: Tokenizer

    def tokens(self, split: str) -> np.ndarray:
        """[n] uint16/uint32 token ids of one split, memory-mapped (an empty array for an empty split)."""
        if split not in SPLITS:
            raise CorpusError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        n = int(self.manifest["splits"][split]["tokens"])
        dtype = np.dtype(self.manifest["dtype"])
        if n == 0:  # np.memmap cannot map an empty file
            return np.empty(0, dtype=dtype)
        return np.memmap(self.directory / f"{split}.bin", dtype=dtype, mode="r", shape=(n,))

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.manifest["tokenizer"]["eot_id"])


def cache_key(spec: CorpusSpec, tokenizer: str, vocab_size: int, tokenizer_path: str | None,
              bpe_train_bytes: int | None) -> tuple[str, dict[str, Any]]:
    """(16-hex-digit key, the settings it hashes)."""
    settings = {
        "format_version": FORMAT_VERSION,
        "corpus": spec.to_dict(),
        "tokenizer": {
            "kind": tokenizer, "vocab_size": vocab_size,
            "file_sha256": tokenizer_json_sha256(tokenizer_path) if tokenizer_path else None,
            "bpe_train_bytes": bpe_train_bytes if tokenizer == "bpe" and not tokenizer_path else None,
        },
    }
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16], settings


def _chunks(docs: Iterator[str], max_bytes: int) -> Iterator[list[str]]:
    buf: list[str] = []
    size = 0
    for d in docs:
        buf.append(d)
        size += len(d)
        if size >= max_bytes:
            yield buf
            buf, size = [], 0
    if buf:
        yield buf


def _tokenize_split(spec: CorpusSpec, split: str, tok: Tokenizer, out: Path, dtype: np.dtype) -> dict[str, Any]:
    """Streams one split into ``out`` (atomically); returns its manifest entry."""
    stats = ReadStats()
    text_hash = hashlib.sha256()
    token_hash = hashlib.sha256()
    n_tokens = 0
    eot = np.asarray([tok.eot_id], dtype=dtype)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with warnings.catch_warnings(record=True) as caught, open(tmp, "wb") as fh:
            warnings.simplefilter("always")
            for chunk in _chunks(iter_documents(spec, split, stats=stats), _ENCODE_CHUNK_BYTES):
                for doc in chunk:
                    text_hash.update(doc.encode("utf-8"))
                    text_hash.update(b"\0")
                pieces: list[np.ndarray] = []
                for ids in tok.encode_batch(chunk):
                    pieces.append(ids.astype(dtype, copy=False))
                    pieces.append(eot)  # documents are separated (and terminated) by <|endoftext|>
                arr = np.concatenate(pieces)
                buf = arr.tobytes()
                token_hash.update(buf)
                fh.write(buf)
                n_tokens += arr.size
            fh.flush()
            os.fsync(fh.fileno())  # durable before the rename: a power loss cannot leave a short file in place
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for w in caught:  # re-emit the corpus reader's skipped-file warning to the caller
        warnings.warn(str(w.message), w.category, stacklevel=3)
    entry: dict[str, Any] = {
        "file": out.name, "tokens": n_tokens, "documents": stats.documents, "bytes": stats.bytes,
        "text_sha256": text_hash.hexdigest(), "tokens_sha256": token_hash.hexdigest(),
        "skipped_non_utf8": len(stats.skipped_non_utf8), "skipped_files": stats.skipped_non_utf8[:20],
    }
    if spec.kind in ("stdlib", "text_dir"):
        files = list_files(spec, split)
        entry["files"] = len(files)
        entry["file_list_sha256"] = hashlib.sha256("\n".join(files).encode()).hexdigest()
    if n_tokens == 0:
        msg = f"corpus {spec} split {split} is empty; a training/eval pipeline on it will refuse to start"
        logger.warning(msg)
        warnings.warn(msg, stacklevel=3)
    return entry


def _limited(docs: Iterator[str], max_bytes: int | None) -> Iterator[str]:
    used = 0
    for d in docs:
        if max_bytes is not None and used >= max_bytes:
            return
        used += len(d.encode("utf-8"))
        yield d


def _make_tokenizer(spec: CorpusSpec, kind: str, vocab_size: int, tokenizer_path: str | None,
                    bpe_train_bytes: int | None, entry: Path) -> tuple[Tokenizer, str | None]:
    # The model's vocabulary may be padded above the tokenizer's (e.g. GPT-2's 50,257 tokens in a 50,304-row
    # embedding, a multiple of 64): the padding ids never occur in the data, and generation masks them.
    if kind == "byte":
        if vocab_size < ByteTokenizer.vocab_size:
            raise CorpusError(f"vocab mismatch: the byte tokenizer has vocab_size {ByteTokenizer.vocab_size} "
                              f"(256 bytes + <|endoftext|>), more than the {vocab_size} asked for")
        return ByteTokenizer(), None
    if kind != "bpe":
        raise CorpusError(f"unknown tokenizer {kind!r}; expected 'bpe' or 'byte'")
    target = entry / "tokenizer.json"
    if tokenizer_path:
        tok = BPETokenizer.load(tokenizer_path)
        if tok.vocab_size > vocab_size:
            raise CorpusError(f"vocab mismatch: tokenizer {tokenizer_path} has {tok.vocab_size} tokens, more than "
                              f"model.vocab_size {vocab_size}; set model.vocab_size >= {tok.vocab_size}")
    else:
        t0 = time.perf_counter()
        tok = BPETokenizer.train(_limited(iter_documents(spec, "train", warn=False), bpe_train_bytes), vocab_size)
        logger.info("trained a %d-token BPE on %s in %.1f s", vocab_size, spec, time.perf_counter() - t0)
    tok.save(target)
    return tok, target.name


def build_token_cache(corpus: CorpusSpec | str | dict[str, Any], cache_dir: str | os.PathLike[str], *,
                      tokenizer: str = "bpe", vocab_size: int = 8192, tokenizer_path: str | None = None,
                      bpe_train_bytes: int | None = 200 << 20, rebuild: bool = False) -> TokenCache:
    """Returns the token cache of ``corpus``, building it first unless a matching entry exists.

    Args:
      corpus: a :class:`CorpusSpec`, its string form (``"stdlib"``, ``"text_dir:DIR"``, ...) or its dict form.
      cache_dir: root of the cache (created if missing).
      tokenizer: ``"bpe"`` (trained on the corpus's train split unless ``tokenizer_path`` is given) or ``"byte"``.
      vocab_size: the model's vocabulary. A trained BPE gets exactly this many tokens; a given tokenizer file and
        the byte tokenizer (257) may be smaller (the model's extra rows are padding ids that never occur).
      tokenizer_path: an existing BPE ``tokenizer.json`` to use instead of training one (e.g. to compare corpora
        under one tokenizer, or a pretrained one such as GPT-2's; it must contain ``<|endoftext|>``).
      bpe_train_bytes: cap on the training text fed to BPE training (text bytes, whole documents).
      rebuild: rebuild even when a matching entry exists.

    Raises:
      CorpusError: bad corpus, vocab mismatch, or a corpus too small for the requested BPE.
    """
    spec = CorpusSpec.coerce(corpus)
    key, settings = cache_key(spec, tokenizer, vocab_size, tokenizer_path, bpe_train_bytes)
    entry = Path(cache_dir) / "tokens" / f"{spec.kind}-{key}"
    fingerprint = source_fingerprint(spec)
    manifest_path = entry / "manifest.json"
    if manifest_path.is_file() and not rebuild:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        reason = _stale_reason(manifest, key, fingerprint, entry)
        if reason is None:
            return TokenCache(entry, manifest, _load_tokenizer(manifest, entry))
        logger.info("rebuilding token cache %s: %s", entry, reason)

    entry.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # incomplete until the new manifest is written (module docstring)
    tok, tok_file = _make_tokenizer(spec, tokenizer, vocab_size, tokenizer_path, bpe_train_bytes, entry)
    dtype = token_dtype(tok.vocab_size)
    t0 = time.perf_counter()
    splits = {s: _tokenize_split(spec, s, tok, entry / f"{s}.bin", dtype) for s in SPLITS}
    import tokenizers  # noqa: PLC0415 - only for the version recorded in the manifest

    manifest = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "corpus": settings["corpus"],
        "corpus_str": str(spec),
        "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "file": tok_file,
                      "source_file_sha256": settings["tokenizer"]["file_sha256"],
                      "bpe_train_bytes": settings["tokenizer"]["bpe_train_bytes"]},
        "dtype": dtype.name,
        "splits": splits,
        "source_fingerprint": fingerprint,
        "build_seconds": round(time.perf_counter() - t0, 3),
        "created_unix": int(time.time()),
        "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__,
                     "numpy": np.__version__},
    }
    write_json(manifest_path, manifest)
    return TokenCache(entry, manifest, tok)


def shared_token_cache(corpus: CorpusSpec | str | dict[str, Any], cache_dir: str | os.PathLike[str], *,
                       found: TokenCache | None = None, **kwargs: Any) -> TokenCache:
    """:func:`build_token_cache` called by every process of a run at the same point: one tokeniser per pod.

    With one process it is :func:`build_token_cache`. With several, process 0 builds (or reuses) the entry while
    the others wait at a barrier and then open it. Whether ``cache_dir`` is storage the processes share is found out
    first: process 0 leaves a probe file there and tells the others its name; a process that cannot see it (a
    host-local disk) builds its own copy at the same time as process 0. A process that tokenises says so on stdout.
    An error in process 0's build is raised there, and the others stop with a CorpusError instead of waiting.

    Args:
      found: an entry this process has already opened (a resume's own): it is returned, and the process only joins
        the barriers (every process must call this at the same point, whatever it found).
      kwargs: those of :func:`build_token_cache`.
    """
    import jax  # noqa: PLC0415 - the data layer needs JAX only to coordinate processes
    from jax.experimental import multihost_utils  # noqa: PLC0415

    spec = CorpusSpec.coerce(corpus)
    if jax.process_count() == 1:
        return found if found is not None else _build_announced(spec, cache_dir, "", kwargs)
    index = jax.process_index()
    root = Path(cache_dir) / "tokens"
    root.mkdir(parents=True, exist_ok=True)
    nonce = secrets.randbelow(2**31) if index == 0 else 0
    probe = root / f".shared-probe-{nonce}"
    if index == 0:
        probe.touch()
    # The broadcast is also the barrier: when it returns, process 0 has written the probe.
    nonce = int(multihost_utils.broadcast_one_to_all(np.int32(nonce)))
    shared = (root / f".shared-probe-{nonce}").exists()
    cache, error = found, None
    if cache is None and (index == 0 or not shared):
        try:
            cache = _build_announced(spec, cache_dir, f" (process {index})", kwargs)
        except Exception as e:  # reach the barrier anyway, so that the other processes do not wait forever
            error = e
    built = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))  # process 0's outcome
    if index == 0:
        probe.unlink(missing_ok=True)
    if error is not None:
        raise error
    if not built:
        raise CorpusError(f"process 0 could not build the token cache of {spec} in {cache_dir}; its error is in "
                          f"its output")
    if cache is None:
        cache = find_token_cache(spec, cache_dir, **{k: v for k, v in kwargs.items() if k != "rebuild"})
        if cache is None:
            raise CorpusError(f"process {index} finds no up-to-date token cache of {spec} in {cache_dir} after "
                              f"process 0 built it there; the corpus files must be the same on every host")
    return cache


def _build_announced(spec: CorpusSpec, cache_dir: str | os.PathLike[str], who: str,
                     kwargs: dict[str, Any]) -> TokenCache:
    """build_token_cache, with one line on stdout when it is going to tokenise (it can take minutes)."""
    lookup = {k: v for k, v in kwargs.items() if k != "rebuild"}
    if kwargs.get("rebuild") or find_token_cache(spec, cache_dir, **lookup) is None:
        print(f"tokenising {spec} into the token cache in {cache_dir}{who}", flush=True)
    return build_token_cache(spec, cache_dir, **kwargs)


def _stale_reason(manifest: dict[str, Any], key: str, fingerprint: dict[str, Any], entry: Path) -> str | None:
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("key") != key:
        return "settings differ"
    if manifest.get("source_fingerprint") != fingerprint:
        return "corpus files changed"
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        p = entry / manifest["splits"][split]["file"]
        if not p.is_file() or p.stat().st_size != manifest["splits"][split]["tokens"] * itemsize:
            return f"{p.name} missing or truncated"
    return None


def _load_tokenizer(manifest: dict[str, Any], entry: Path) -> Tokenizer:
    info = manifest["tokenizer"]
    if info["kind"] == "byte":
        return ByteTokenizer()
    # A tokenizer.json that no longer matches its manifest (replaced by hand) must not silently re-map the ids.
    return BPETokenizer.load(entry / info["file"], int(info["vocab_size"]))


def find_token_cache(corpus: CorpusSpec | str | dict[str, Any], cache_dir: str | os.PathLike[str], *,
                     tokenizer: str = "bpe", vocab_size: int = 8192, tokenizer_path: str | None = None,
                     bpe_train_bytes: int | None = 200 << 20) -> TokenCache | None:
    """The existing, up-to-date entry that :func:`build_token_cache` would return for these arguments, or None
    (nothing is built: a resumed run uses this to reuse its own entry before falling back to its tokenizer copy)."""
    spec = CorpusSpec.coerce(corpus)
    key, _ = cache_key(spec, tokenizer, vocab_size, tokenizer_path, bpe_train_bytes)
    entry = Path(cache_dir) / "tokens" / f"{spec.kind}-{key}"
    manifest_path = entry / "manifest.json"
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if _stale_reason(manifest, key, source_fingerprint(spec), entry) is not None:
        return None
    return TokenCache(entry, manifest, _load_tokenizer(manifest, entry))


# -- data fingerprint ------------------------------------------------------------------------------------------------
def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_contents(corpus: CorpusSpec | str | dict[str, Any]) -> dict[str, Any]:
    """What a corpus is made of right now, by content: every file's path relative to the corpus root, size,
    SHA-256 and split (``[[path, size, sha256, split], ...]``). Reads every file once; no tokenisation.

    Paths are relative, so a corpus moved to another directory (or machine) has the same contents. A hub dataset
    (``hf:NAME`` not on disk) is described by its name and config only; its documents' hashes are in the token
    counts' ``text_sha256`` of :func:`data_fingerprint`. Prepared token ids (``tokens:DIR``) are described by their
    manifest (``prepared.tokens_contents``).
    """
    spec = CorpusSpec.coerce(corpus)
    if spec.kind == "tokens":  # the prepare job's manifest holds every shard's SHA-256: no token file is read
        from coupled_qk_jax.data.prepared import tokens_contents  # noqa: PLC0415

        return tokens_contents(spec.path or "")
    if spec.kind in ("stdlib", "text_dir"):
        root, files = all_files(spec)
        entries = [[f, (root / f).stat().st_size, file_sha256(root / f), split_of(f, spec.split_fractions)]
                   for f in files]
        return {"kind": spec.kind, "files": entries}
    if spec.kind == "wikitext103":
        from coupled_qk_jax.data.corpora import _wikitext_paths  # noqa: PLC0415 - the reader's own file lookup

        paths = _wikitext_paths(spec)
        return {"kind": spec.kind, "files": [[p.name, p.stat().st_size, file_sha256(p), split]
                                             for split, p in paths.items()]}
    if spec.kind == "hf":
        local = hf_local_path(spec)
        if local is None:
            return {"kind": "hf", "name": spec.name, "config": spec.config}
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        return {"kind": "hf", "files": [[p.name if p == local else p.relative_to(local).as_posix(),
                                         p.stat().st_size, file_sha256(p), "*"] for p in files]}
    return {"kind": "mixture", "sources": [[source_contents(sub), w] for sub, w in spec.sources]}


def tokenizer_sha256(cache: TokenCache) -> str:
    """Identity of a cache entry's tokenizer: the canonical-JSON hash of its tokenizer.json, or "byte". Prepared
    tokens (``prepared.PreparedTokens``) carry it in their manifest."""
    info = cache.manifest["tokenizer"]
    if info.get("sha256"):  # the same canonical-JSON hash, or "byte", or a nanoGPT folder's "ids:vocab=...:eot=..."
        return str(info["sha256"])
    return "byte" if info["kind"] == "byte" else tokenizer_json_sha256(cache.directory / info["file"])


def data_fingerprint(corpus: CorpusSpec | str | dict[str, Any], cache: TokenCache,
                     sources: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything that makes a run's data what it is: the corpus spec, its files by content
    (:func:`source_contents`, which decides the split assignment), each split's token count and hashes of its
    text and tokens, and the tokenizer. Two runs with equal fingerprints (ignoring the corpus root directory)
    train and evaluate on the same token ids."""
    spec = CorpusSpec.coerce(corpus)
    splits = {s: {k: cache.manifest["splits"][s][k] for k in ("tokens", "documents", "text_sha256", "tokens_sha256")}
              for s in SPLITS}
    for s in SPLITS:  # a nanoGPT train file is known by its size and first and last MiB only (data/prepared.py)
        if cache.manifest["splits"][s].get("head_tail_sha256"):
            splits[s]["head_tail_sha256"] = cache.manifest["splits"][s]["head_tail_sha256"]
    info = cache.manifest["tokenizer"]
    return {"corpus": spec.to_dict(), "sources": sources if sources is not None else source_contents(spec),
            "splits": splits, "dtype": cache.manifest["dtype"],
            "tokenizer": {"kind": info["kind"], "vocab_size": int(info["vocab_size"]), "eot_id": int(info["eot_id"]),
                          "sha256": tokenizer_sha256(cache)}}


def load_token_cache(directory: str | os.PathLike[str]) -> TokenCache:
    """Opens an existing entry directory (``CACHE/tokens/<kind>-<key>``) without checking the corpus."""
    entry = Path(directory)
    mp = entry / "manifest.json"
    if not mp.is_file():
        raise CorpusError(f"{entry} is not a token cache entry (no manifest.json)")
    manifest = json.loads(mp.read_text(encoding="utf-8"))
    return TokenCache(entry, manifest, _load_tokenizer(manifest, entry))
