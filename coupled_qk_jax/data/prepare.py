"""Prepare a corpus for training ahead of time: one pass that splits, tokenises in parallel and writes token shards.

    python -m coupled_qk_jax.data.prepare --corpus=SPEC --out=DIR [--tokenizer=PATH/tokenizer.json | --tokenizer=byte]
        [--vocab_size=8192] [--workers=N] [--shard_tokens=100000000]

Then train with ``--config.data.corpus=tokens:DIR`` (coupled_qk_jax/data/prepared.py reads it): no process of the run
tokenises. Output (``DIR``, local or ``gs://``)::

    tokenizer.json         the BPE (trained once on the train split, or the given file); absent for bytes
    train-00000.bin ...    fixed-size shards of token ids (``token_cache.token_dtype``: uint16 when they fit)
    validation-00000.bin   each document followed by <|endoftext|>, exactly as the token cache writes them, so the
    test-00000.bin         shards of a split, concatenated, are the token cache's <split>.bin
    progress.json          the shards finished so far (for resuming); removed when the manifest is written
    manifest.json          written last: format version, corpus spec, tokenizer (kind, vocab, eot id, sha256), each
                           split's shards (file, tokens, sha256), token/document/text-byte counts and hashes, totals

How the work is divided: the main process reads each split's documents (``corpora.iter_documents``, the split
assignment every reader uses) and cuts them into chunks of whole documents of about ``chunk_bytes`` of text; N worker
processes encode chunks (``encode_batch`` in each); the main process takes the encoded chunks back in order and cuts
the token stream into shards of exactly ``shard_tokens`` tokens (the last one of a split shorter). Chunk and shard
boundaries depend only on the documents and these two sizes, never on the worker count, so any ``--workers`` writes
byte-identical files.

Resuming: every shard is written atomically (temporary name, fsync, rename) and then recorded in progress.json with
where it ends in the chunk stream (chunk index, token offset). A rerun with the same settings verifies the recorded
shards (size and SHA-256), skips encoding the chunks they cover (the documents are still read, to hash the text), and
continues at the first missing one; a rerun after completion checks the manifest's shards and rewrites them from the
first bad one on.
"""

from __future__ import annotations

import collections
import contextlib
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from etils import epath

from coupled_qk_jax.data.corpora import (
    SPLITS, CorpusError, CorpusSpec, ReadStats, iter_documents, source_fingerprint)
from coupled_qk_jax.data.prepared import FORMAT, FORMAT_VERSION, MANIFEST
from coupled_qk_jax.data.token_cache import _chunks as token_cache_chunks
from coupled_qk_jax.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, tokenizer_json_sha256
from coupled_qk_jax.errors import UserError

PROGRESS = "progress.json"
TOKENIZER = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16: few files for a pod, small enough to rewrite one cheaply
DEFAULT_CHUNK_BYTES = 4 << 20  # text per worker task: large enough for encode_batch's threads, small in memory
DEFAULT_BPE_TRAIN_BYTES = 200 << 20  # build_token_cache's default cap on the BPE's training text


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when the ids fit (as the token cache), else uint32."""
    from coupled_qk_jax.data.token_cache import token_dtype as cache_dtype  # noqa: PLC0415 - one rule for both

    return cache_dtype(vocab_size)


# -- files -----------------------------------------------------------------------------------------------------------
def _write_atomic(path: epath.Path, data: bytes) -> None:
    """``data`` to ``path`` via a temporary name beside it, made durable before the rename (local files: fsync)."""
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            try:
                os.fsync(f.fileno())
            except (AttributeError, OSError, ValueError):  # an object store's file has no descriptor to sync
                pass
        tmp.replace(path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise


def _write_json(path: epath.Path, obj: Any) -> None:
    _write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tokenizer_sha256(data: bytes) -> str:
    """The hash of a tokenizer.json's canonical JSON, as ``tokenizer.tokenizer_json_sha256`` (the run directory
    records and checks this one)."""
    return _sha256(json.dumps(json.loads(data), sort_keys=True).encode())


# -- workers ---------------------------------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}
_SERIAL_ENV = "TOKENIZERS_PARALLELISM"  # "false": encode_batch encodes on the calling thread (read at every call)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """encode_batch on the calling thread only, for the one-worker job that encodes in this process."""
    before = os.environ.get(_SERIAL_ENV)
    os.environ[_SERIAL_ENV] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_SERIAL_ENV, None)
        else:
            os.environ[_SERIAL_ENV] = before


def _make_tokenizer(kind: str, tokenizer_json: str | None) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415

    return BPETokenizer(HFTokenizer.from_str(tokenizer_json or ""))


def _init_worker(kind: str, tokenizer_json: str | None, dtype: str) -> None:
    # One encoding thread per worker: --workers is the number of cores the job encodes on, and N single-threaded
    # processes scale where N processes each starting a thread per core would fight over the cores.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ[_SERIAL_ENV] = "false"
    _WORKER["tok"] = _make_tokenizer(kind, tokenizer_json)
    _WORKER["dtype"] = np.dtype(dtype)


def _encode(tok: Tokenizer, dtype: np.dtype, docs: list[str]) -> np.ndarray:
    """[tokens] of ``docs``, each followed by <|endoftext|> (as token_cache._tokenize_split writes them)."""
    eot = np.asarray([tok.eot_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    for ids in tok.encode_batch(docs):
        pieces.append(ids.astype(dtype, copy=False))
        pieces.append(eot)
    return np.concatenate(pieces) if pieces else np.empty(0, dtype)


def _encode_in_worker(docs: list[str]) -> np.ndarray:
    return _encode(_WORKER["tok"], _WORKER["dtype"], docs)


class _Encoder:
    """Encodes chunks in order: inline for one worker, else in a spawned process pool with a bounded number of
    chunks in flight (bounded memory; the main process keeps reading while the workers encode)."""

    def __init__(self, tok: Tokenizer, dtype: np.dtype, workers: int) -> None:
        self.tok, self.dtype, self.workers = tok, dtype, workers
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        if workers > 1:
            tok_json = tok.to_json() if isinstance(tok, BPETokenizer) else None
            # spawn, not fork: the caller may have started threads (JAX, tokenizers' pool) that fork would copy
            # in an undefined state.
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                initargs=(tok.kind, tok_json, dtype.str))

    def map(self, chunks: Iterator[tuple[int, list[str] | None]]) -> Iterator[tuple[int, np.ndarray | None]]:
        """(index, chunk or None) -> (index, its tokens or None), in order; None chunks are skipped, not encoded."""
        if self.pool is None:
            for i, docs in chunks:
                if docs is None:
                    yield i, None
                    continue
                with _one_thread():
                    tokens = _encode(self.tok, self.dtype, docs)
                yield i, tokens
            return
        pending: collections.deque = collections.deque()
        for i, docs in chunks:
            pending.append((i, None if docs is None else self.pool.submit(_encode_in_worker, docs)))
            while len(pending) > 2 * self.workers:
                j, fut = pending.popleft()
                yield j, None if fut is None else fut.result()
        while pending:
            j, fut = pending.popleft()
            yield j, None if fut is None else fut.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _chunks(docs: Iterator[str], chunk_bytes: int, text_hash: Any) -> Iterator[list[str]]:
    """Whole documents in lists of at least ``chunk_bytes`` characters (the last one shorter), as the token cache
    cuts them; hashes the text as token_cache._tokenize_split does (each document's UTF-8 then a NUL)."""

    def hashed(docs: Iterator[str]) -> Iterator[str]:
        for d in docs:
            text_hash.update(d.encode("utf-8"))
            text_hash.update(b"\0")
            yield d

    return token_cache_chunks(hashed(docs), chunk_bytes)


# -- the job ---------------------------------------------------------------------------------------------------------
def _shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}.bin"


def _request(spec: CorpusSpec, tokenizer: str, vocab_size: int | None, bpe_train_bytes: int | None,
             shard_tokens: int, chunk_bytes: int) -> dict[str, Any]:
    """What was asked for; a resume continues only under an equal request (checked before anything is written)."""
    named = tokenizer not in ("bpe", "byte")
    path = os.path.expanduser(tokenizer)
    if named and not os.path.isfile(path):
        raise CorpusError(f"--tokenizer: no tokenizer file {tokenizer!r}; give a tokenizer.json, bpe or byte")
    return {"corpus": spec.to_dict(), "tokenizer": "file" if named else tokenizer,
            "tokenizer_file_sha256": tokenizer_json_sha256(path) if named else None, "vocab_size": vocab_size,
            "bpe_train_bytes": bpe_train_bytes if tokenizer == "bpe" else None, "shard_tokens": shard_tokens,
            "chunk_bytes": chunk_bytes}


def _verified_prefix(out: epath.Path, shards: list[dict[str, Any]], split_hash: Any) -> list[dict[str, Any]]:
    """The recorded shards, in order, up to the first one that is missing or differs from its record; the good ones'
    bytes are fed to ``split_hash`` (the split's running token hash)."""
    good = []
    for s in shards:
        p = out / s["file"]
        if not p.exists():
            break
        data = p.read_bytes()
        if _sha256(data) != s["sha256"]:
            break
        split_hash.update(data)
        good.append(s)
    return good


def _prepare_split(spec: CorpusSpec, split: str, out: epath.Path, encoder: _Encoder, dtype: np.dtype,
                   shard_tokens: int, chunk_bytes: int, progress: dict[str, Any], save_progress: Callable[[], None],
                   after_shard: Callable[[str, int], None] | None) -> dict[str, Any]:
    """Writes one split's shards (resuming after those in ``progress``) and returns its manifest entry."""
    record = progress["splits"].setdefault(split, {"shards": []})
    token_hash = hashlib.sha256()
    record["shards"] = _verified_prefix(out, record["shards"], token_hash)
    done = record["shards"]
    start_chunk, start_offset = (done[-1]["end"] if done else (0, 0))
    stats, text_hash = ReadStats(), hashlib.sha256()
    chunks = _chunks(iter_documents(spec, split, stats=stats), chunk_bytes, text_hash)
    # Chunks before the resume point are read (their text is hashed) but not encoded.
    todo = ((i, docs if i >= start_chunk else None) for i, docs in enumerate(chunks))
    pending: list[np.ndarray] = []  # encoded tokens not yet in a shard, in order
    buffered = 0

    def write_shard(data: np.ndarray, end: tuple[int, int]) -> None:
        raw = data.tobytes()
        name = _shard_name(split, len(done))
        _write_atomic(out / name, raw)
        token_hash.update(raw)
        done.append({"file": name, "tokens": int(data.size), "sha256": _sha256(raw), "end": list(end)})
        save_progress()
        if after_shard is not None:
            after_shard(split, len(done))

    last = -1
    for i, ids in encoder.map(todo):
        last = i
        if ids is None:
            continue
        full = ids.size
        if i == start_chunk and start_offset:
            ids = ids[start_offset:]
        pending.append(ids)
        buffered += ids.size
        while buffered >= shard_tokens:
            stream = np.concatenate(pending)
            remainder = stream[shard_tokens:]
            # The shard ends ``remainder.size`` tokens before the end of chunk i (all of the remainder is chunk i's:
            # before chunk i was added, fewer than shard_tokens tokens were buffered).
            write_shard(stream[:shard_tokens], (i, full - int(remainder.size)))
            pending, buffered = [remainder], int(remainder.size)
    if buffered:
        write_shard(np.concatenate(pending), (last + 1, 0))  # the split's last shard: it ends after every chunk
    tokens = sum(int(s["tokens"]) for s in done)
    if tokens == 0:
        print(f"warning: corpus {spec} split {split} is empty", file=sys.stderr, flush=True)
    return {"shards": [{k: s[k] for k in ("file", "tokens", "sha256")} for s in done], "tokens": tokens,
            "documents": stats.documents, "bytes": stats.bytes, "text_sha256": text_hash.hexdigest(),
            "tokens_sha256": token_hash.hexdigest(), "skipped_non_utf8": len(stats.skipped_non_utf8)}


def _tokenizer(spec: CorpusSpec, out: epath.Path, tokenizer: str, vocab_size: int | None,
               bpe_train_bytes: int | None, resume_sha: str | None) -> tuple[Tokenizer, str]:
    """(tokenizer, its sha256). A trained BPE left in ``out`` by an interrupted run of the same request
    (``resume_sha``, its recorded hash) is reused, so a resume never retrains it."""
    if tokenizer == "byte":
        if vocab_size is not None and vocab_size < ByteTokenizer.vocab_size:
            raise CorpusError(f"the byte tokenizer has {ByteTokenizer.vocab_size} tokens (256 bytes + "
                              f"<|endoftext|>), more than --vocab_size {vocab_size}")
        return ByteTokenizer(), "byte"
    target = out / TOKENIZER
    if resume_sha is not None:
        if not target.exists() or _tokenizer_sha256(target.read_bytes()) != resume_sha:
            raise UserError(f"{target} differs from the one the shards in {out} were written with; empty --out and "
                            "prepare again")
        print(f"resuming with the tokenizer in {target}", flush=True)
        return _make_tokenizer("bpe", target.read_text()), resume_sha
    if tokenizer != "bpe":  # a tokenizer.json to use as is
        tok = BPETokenizer.load(os.path.expanduser(tokenizer))
        if vocab_size is not None and tok.vocab_size > vocab_size:
            raise CorpusError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens, more than --vocab_size "
                              f"{vocab_size}")
    else:
        from coupled_qk_jax.data.token_cache import _limited  # noqa: PLC0415 - the cache's own training-text cap

        size = vocab_size if vocab_size is not None else 8192
        t0 = time.perf_counter()
        tok = BPETokenizer.train(_limited(iter_documents(spec, "train", warn=False), bpe_train_bytes), size)
        print(f"trained a {size}-token BPE on {spec} in {time.perf_counter() - t0:.1f} s", flush=True)
    data = tok.to_json().encode()
    _write_atomic(target, data)
    return tok, _tokenizer_sha256(data)


def prepare(corpus: CorpusSpec | str | dict[str, Any], out: str | os.PathLike[str], *, tokenizer: str = "bpe",
            vocab_size: int | None = None, workers: int = 1, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, bpe_train_bytes: int | None = DEFAULT_BPE_TRAIN_BYTES,
            after_shard: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Prepares ``corpus`` into ``out`` (module docstring) and returns the manifest.

    Args:
      corpus: a CorpusSpec or its string / dict form (any kind that holds text).
      out: the output directory, local or ``gs://...``; created if missing.
      tokenizer: ``"bpe"`` (trained on the train split with ``vocab_size`` tokens), ``"byte"``, or the path of a
        tokenizer.json to use.
      vocab_size: the BPE's size; for a given tokenizer or bytes, an upper bound that is checked (the model's).
      workers: encoding processes (1 = encode in this process).
      shard_tokens: tokens per shard (the last shard of a split holds the rest).
      chunk_bytes: text per encoding task (whole documents); part of the settings, since it places resume points.
      bpe_train_bytes: cap on the text the BPE is trained on (as ``build_token_cache``'s).
      after_shard: called as ``after_shard(split, shards_written)`` after each shard is durable (tests interrupt
        the job here).

    Raises:
      CorpusError / UserError: a bad corpus, tokenizer, vocabulary, or an output directory that cannot be written or
        holds another preparation.
    """
    spec = CorpusSpec.coerce(corpus)
    if spec.kind == "tokens":
        raise CorpusError(f"corpus {spec} is already token ids; train on it directly with data.corpus={spec}")
    if workers < 1 or shard_tokens < 1 or chunk_bytes < 1:
        raise UserError(f"--workers, --shard_tokens and chunk_bytes must be >= 1, got {workers}, {shard_tokens}, "
                        f"{chunk_bytes}")
    root = epath.Path(str(out) if "://" in str(out) else os.path.expanduser(str(out)))
    try:
        if root.exists() and not root.is_dir():
            raise UserError(f"--out {root} is a file, not a directory")
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--out {root} cannot be written: {e.strerror or e}") from None
    request = _request(spec, tokenizer, vocab_size, bpe_train_bytes, shard_tokens, chunk_bytes)
    source_fingerprint(spec)  # a missing or empty corpus is refused before anything is written
    t0 = time.perf_counter()
    progress_path, manifest_path = root / PROGRESS, root / MANIFEST
    progress = json.loads(progress_path.read_text()) if progress_path.exists() else None
    if progress is None and manifest_path.exists():  # complete before: check its shards, rewriting from a bad one
        old = json.loads(manifest_path.read_text())
        progress = {"request": old.get("request"), "tokenizer_sha256": old["tokenizer"]["sha256"],
                    "splits": {s: {"shards": [dict(x, end=e) for x, e in zip(old["splits"][s]["shards"],
                                                                             old["resume_points"][s])]}
                               for s in SPLITS}}
    if progress is not None and progress["request"] != request:
        changed = sorted(k for k in request if (progress["request"] or {}).get(k) != request[k])
        raise UserError(f"--out {root} holds a preparation of other settings ({', '.join(changed)} differ); give "
                        "another --out or empty it")
    resume_sha = progress["tokenizer_sha256"] if progress is not None and request["tokenizer"] == "bpe" else None
    tok, tok_sha = _tokenizer(spec, root, tokenizer, vocab_size, bpe_train_bytes, resume_sha)
    dtype = token_dtype(tok.vocab_size)
    if progress is None:
        progress = {"request": request, "tokenizer_sha256": tok_sha, "splits": {}}
    if manifest_path.exists():
        manifest_path.unlink()  # incomplete again until the new manifest is written
    save = lambda: _write_json(progress_path, progress)  # noqa: E731
    save()
    encoder = _Encoder(tok, dtype, workers)
    try:
        splits = {s: _prepare_split(spec, s, root, encoder, dtype, shard_tokens, chunk_bytes, progress, save,
                                    after_shard) for s in SPLITS}
    finally:
        encoder.close()
    import tokenizers  # noqa: PLC0415 - only for the version recorded in the manifest

    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "corpus": spec.to_dict(), "corpus_str": str(spec),
        "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
                      "file": TOKENIZER if tok.kind == "bpe" else None, "sha256": tok_sha},
        "dtype": dtype.name, "shard_tokens": shard_tokens, "request": request,
        "splits": splits,
        # Where each shard ends in its split's chunk stream: what a rerun needs to rewrite a damaged shard alone.
        "resume_points": {s: [x["end"] for x in progress["splits"][s]["shards"]] for s in SPLITS},
        "totals": {k: sum(int(splits[s][k]) for s in SPLITS) for k in ("tokens", "documents", "bytes")}
        | {"shards": sum(len(splits[s]["shards"]) for s in SPLITS)},
        # Worker count and timings stay out: any --workers must write the same bytes.
        "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__,
                     "numpy": np.__version__},
    }
    _write_json(manifest_path, manifest)
    progress_path.unlink()
    seconds = time.perf_counter() - t0
    total = manifest["totals"]
    print(f"prepared {spec} into {root}: {total['tokens']} tokens in {total['shards']} shards from "
          f"{total['documents']} documents ({total['bytes'] / 1e6:.1f} MB of text) in {seconds:.1f} s", flush=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); a user mistake is one ``error:`` line and exit status 2."""
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m coupled_qk_jax.data.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True, help="stdlib | text_dir:DIR | wikitext103:DIR | hf:NAME[:CONFIG[:F]] "
                    "| mixture:SPEC@W;... | the JSON of a CorpusSpec dict (docs/data.md)")
    ap.add_argument("--out", required=True, help="output directory (local or gs://)")
    ap.add_argument("--tokenizer", default="bpe", help="bpe (trained on the train split) | byte | PATH/tokenizer.json")
    ap.add_argument("--vocab_size", type=int, default=None, help="the BPE's size (default 8192); else an upper bound")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="encoding processes, one thread each (default: one per CPU)")
    ap.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    ap.add_argument("--split_fractions", default="", help="train,validation,test fractions, e.g. 0.8,0.1,0.1")
    ap.add_argument("--max_bytes", type=int, default=0, help="cap on the text read per split (0 = none)")
    ap.add_argument("--bpe_train_bytes", type=int, default=DEFAULT_BPE_TRAIN_BYTES)
    args = ap.parse_args(argv)
    try:
        text = args.corpus.strip()
        spec = CorpusSpec.coerce(json.loads(text) if text.startswith("{") else text)
        changes: dict[str, Any] = {}
        if args.split_fractions:
            try:
                changes["split_fractions"] = tuple(float(x) for x in args.split_fractions.split(","))
            except ValueError:
                raise UserError(f"--split_fractions must be three numbers, got {args.split_fractions!r}") from None
        if args.max_bytes:
            changes["max_bytes"] = args.max_bytes
        if changes:
            spec = CorpusSpec.coerce({**spec.to_dict(), **changes})
        prepare(spec, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size, workers=args.workers,
                shard_tokens=args.shard_tokens, bpe_train_bytes=args.bpe_train_bytes)
    except UserError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else "unknown error"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
