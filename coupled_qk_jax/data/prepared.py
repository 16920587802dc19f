"""Reading token ids that were prepared ahead of training: the ``tokens:DIR`` corpus.

Two layouts are read:

* a directory written by ``python -m coupled_qk_jax.data.prepare`` (coupled_qk_jax/data/prepare.py): fixed-size
  shards ``<split>-00000.bin`` ... of ``manifest["dtype"]`` token ids, ``manifest.json`` (shard list with token
  counts and SHA-256s, each split's token/text hashes, the tokenizer and its hash) and ``tokenizer.json`` (BPE only);
* a nanoGPT-style folder: ``train.bin`` and ``val.bin`` of uint16 ids (optionally ``test.bin``). nanoGPT has no test
  split; without ``test.bin`` the test split is **empty** (reusing validation would report validation numbers as test
  numbers). nanoGPT's ``meta.pkl`` is never unpickled (unpickling runs arbitrary code); the vocabulary comes from an
  optional ``meta.json`` (``{"vocab_size": N, "eot_id": E, "dtype": "uint16"}``) or else from the model's
  ``vocab_size``, with GPT-2's end-of-text id 50256 (what nanoGPT's openwebtext and shakespeare scripts write) when
  that vocabulary holds it.

:func:`open_tokens` returns a :class:`PreparedTokens`, which the trainer uses exactly like a
``token_cache.TokenCache``: ``tokens(split)`` is a 1-D array-like of token ids (a ``np.memmap`` for one shard,
a :class:`ShardedTokens` over several), and ``manifest`` has the cache manifest's keys.

Identity without re-hashing: a prepared directory is identified by its manifest (the tokenizer hash and every shard's
SHA-256, written by the prepare job), so :func:`tokens_contents` reads no token file. A nanoGPT folder has no
checksums; its train file is identified by its size and the SHA-256 of its first and last MiB (a change in the
middle goes unnoticed), its (small) held-out files by their full SHA-256, which the run directory's held-out copy
is checked against anyway.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np
from etils import epath

from coupled_qk_jax.data.corpora import SPLITS, CorpusError
from coupled_qk_jax.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

MANIFEST = "manifest.json"
FORMAT = "coupled-qk-jax-prepared-tokens"
FORMAT_VERSION = 1
# nanoGPT's file for each of our splits (it has no test split; see the module docstring).
NANOGPT_FILES = {"train": "train.bin", "validation": "val.bin", "test": "test.bin"}
NANOGPT_META = "meta.json"
GPT2_VOCAB, GPT2_EOT = 50257, 50256
_HEAD_TAIL = 1 << 20


def _is_local(path: epath.Path) -> bool:
    return "://" not in str(path)


class ShardedTokens:
    """The token ids of one split stored as several shard files, seen as one read-only 1-D array [n].

    Supports what the input pipeline uses: ``shape``, ``ndim``, ``dtype``, ``len()``, integer / integer-array /
    slice indexing (``tokens[np.clip(pos, 0, n - 1)]`` with ``pos`` of any shape) and ``np.asarray`` (the whole split,
    for the run directory's held-out copy). A global index ``i`` lies in shard ``searchsorted(ends, i, "right")``.
    Local shards are memory-mapped; shards elsewhere (``gs://``) are read whole on first use.
    """

    def __init__(self, paths: list[epath.Path], sizes: list[int], dtype: np.dtype | str) -> None:
        self.paths = list(paths)
        self.sizes = [int(s) for s in sizes]
        self.dtype = np.dtype(dtype)
        self.ends = np.cumsum(self.sizes, dtype=np.int64)  # [shards] exclusive end of each shard
        self.starts = self.ends - np.asarray(self.sizes, dtype=np.int64)
        self.shape = (int(self.ends[-1]) if self.sizes else 0,)
        self.ndim = 1
        self._arrays: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.shape[0]

    def shard(self, k: int) -> np.ndarray:
        """[sizes[k]] ids of shard k (memory-mapped when local)."""
        arr = self._arrays.get(k)
        if arr is None:
            if _is_local(self.paths[k]):
                arr = np.memmap(str(self.paths[k]), dtype=self.dtype, mode="r", shape=(self.sizes[k],))
            else:
                arr = np.frombuffer(self.paths[k].read_bytes(), dtype=self.dtype)
            self._arrays[k] = arr
        return arr

    def __getitem__(self, index: Any) -> Any:
        n = self.shape[0]
        if isinstance(index, slice):
            index = np.arange(n)[index]
        idx = np.asarray(index)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"ShardedTokens takes integer indices, not {idx.dtype}")
        flat = idx.astype(np.int64).reshape(-1)
        flat = np.where(flat < 0, flat + n, flat)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"index out of range for {n} tokens")
        which = np.searchsorted(self.ends, flat, side="right")
        out = np.empty(flat.shape, dtype=self.dtype)
        for k in np.unique(which):
            mask = which == k
            out[mask] = self.shard(int(k))[flat[mask] - self.starts[k]]
        return out.reshape(idx.shape) if idx.ndim else out[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:  # noqa: ARG002 - numpy's signature
        whole = np.concatenate([self.shard(k) for k in range(len(self.sizes))]) if self.sizes else np.empty(
            0, self.dtype)
        return whole if dtype is None else whole.astype(dtype)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by file name (a grain worker process reopens the shards), never by copying the tokens.
        return (ShardedTokens, ([str(p) for p in self.paths], self.sizes, self.dtype.str))


@dataclasses.dataclass
class PreparedTokens:
    """An opened ``tokens:DIR``: what the trainer needs of a ``TokenCache``.

    Attributes:
      directory: the prepared directory (an ``epath.Path``).
      manifest: the prepare job's manifest; ``manifest["splits"][split]`` has ``tokens``, ``documents``,
        ``text_sha256``, ``tokens_sha256`` (None where a nanoGPT folder cannot know them) and ``shards``
        (``[{"file", "tokens", "sha256"}]``); ``manifest["tokenizer"]`` has ``kind``, ``vocab_size``, ``eot_id``,
        ``sha256`` and ``file`` (the tokenizer.json beside the shards, or None).
      tokenizer: the BPE or byte tokenizer, or None for a nanoGPT folder (ids of an unknown tokenizer).
    """

    directory: epath.Path
    manifest: dict[str, Any]
    tokenizer: Tokenizer | None

    def tokens(self, split: str) -> np.ndarray | ShardedTokens:
        """[n] token ids of one split: a read-only ``np.memmap`` when it is one local shard, else a
        :class:`ShardedTokens`; an empty array for an empty split."""
        if split not in SPLITS:
            raise CorpusError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        info = self.manifest["splits"][split]
        dtype = np.dtype(self.manifest["dtype"])
        shards = [s for s in info["shards"] if int(s["tokens"]) > 0]
        if not shards:
            return np.empty(0, dtype=dtype)
        paths = [self.directory / s["file"] for s in shards]
        if len(shards) == 1 and _is_local(paths[0]):
            return np.memmap(str(paths[0]), dtype=dtype, mode="r", shape=(int(shards[0]["tokens"]),))
        return ShardedTokens(paths, [int(s["tokens"]) for s in shards], dtype)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.manifest["tokenizer"]["eot_id"])


def _path(directory: str | epath.PathLike) -> epath.Path:
    text = str(directory)
    return epath.Path(text if "://" in text else epath.Path(text).expanduser())


def read_manifest(directory: str | epath.PathLike) -> dict[str, Any] | None:
    """A prepared directory's manifest, None when it has none; one-line CorpusError when it is not ours or damaged."""
    path = _path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorpusError(f"{path} is not valid JSON ({e}); re-run python -m coupled_qk_jax.data.prepare") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CorpusError(f"{path} is not a format-{FORMAT_VERSION} manifest of python -m coupled_qk_jax.data.prepare "
                          f"(format {manifest.get('format')!r} version {manifest.get('format_version')!r}); "
                          "re-run prepare")
    return manifest


def _sha256_of(path: epath.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_shards(directory: str | epath.PathLike, manifest: dict[str, Any], *, checksums: bool = True) -> None:
    """Checks every shard against the manifest: present, of its size and (``checksums``) of its SHA-256.

    Raises:
      CorpusError: one line naming the first bad shard and saying to re-run prepare.
    """
    root = _path(directory)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    fix = f"re-run python -m coupled_qk_jax.data.prepare --out={root} (it rewrites only bad shards)"
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            p = root / shard["file"]
            if not p.exists():
                raise CorpusError(f"shard {shard['file']} of {root} is missing; {fix}")
            size = p.stat().length
            if size != int(shard["tokens"]) * itemsize:
                raise CorpusError(f"shard {shard['file']} of {root} has {size} bytes, not the "
                                  f"{int(shard['tokens']) * itemsize} of its manifest; {fix}")
            if checksums and _sha256_of(p) != shard["sha256"]:
                raise CorpusError(f"shard {shard['file']} of {root} is damaged (its SHA-256 differs from the "
                                  f"manifest's); {fix}")


def _load_tokenizer(root: epath.Path, info: dict[str, Any]) -> Tokenizer | None:
    if info["kind"] == "byte":
        return ByteTokenizer()
    if not info.get("file"):
        return None
    from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415

    text = (root / info["file"]).read_text()
    if hashlib.sha256(json.dumps(json.loads(text), sort_keys=True).encode()).hexdigest() != info["sha256"]:
        raise CorpusError(f"{root / info['file']} differs from the tokenizer its manifest records; re-run python -m "
                          "coupled_qk_jax.data.prepare")
    tok = BPETokenizer(HFTokenizer.from_str(text))
    if tok.vocab_size != int(info["vocab_size"]) or tok.eot_id != int(info["eot_id"]):
        raise CorpusError(f"{root / info['file']} does not match its manifest (vocab {tok.vocab_size}, eot "
                          f"{tok.eot_id}); re-run python -m coupled_qk_jax.data.prepare")
    return tok


def open_tokens(directory: str | epath.PathLike, *, vocab_size: int | None = None,
                verify: bool = True) -> PreparedTokens:
    """Opens a ``tokens:DIR`` corpus: a prepared directory or a nanoGPT folder (module docstring).

    Args:
      directory: the directory (local, or ``gs://...``).
      vocab_size: the model's vocabulary; only a nanoGPT folder without ``meta.json`` takes its vocabulary from it.
      verify: check every prepared shard's SHA-256 against the manifest (one read of the shards); sizes are always
        checked.

    Raises:
      CorpusError: a missing directory or shard, a damaged shard, a nanoGPT folder whose vocabulary is unknown.
    """
    root = _path(directory)
    if not root.exists():
        raise CorpusError(f"tokens directory {root} does not exist; write it with python -m "
                          "coupled_qk_jax.data.prepare --out=DIR")
    manifest = read_manifest(root)
    if manifest is None:
        if (root / NANOGPT_FILES["train"]).exists():
            return _open_nanogpt(root, vocab_size)
        raise CorpusError(f"{root} has neither a {MANIFEST} (python -m coupled_qk_jax.data.prepare) nor a nanoGPT "
                          f"{NANOGPT_FILES['train']}")
    verify_shards(root, manifest, checksums=verify)
    return PreparedTokens(root, manifest, _load_tokenizer(root, manifest["tokenizer"]))


def _head_tail_sha256(path: epath.Path, size: int) -> str:
    """SHA-256 of the size and the first and last MiB: a nanoGPT train file's identity without reading it all."""
    h = hashlib.sha256(f"{size}\n".encode())
    with path.open("rb") as f:
        h.update(f.read(_HEAD_TAIL))
        if size > _HEAD_TAIL:
            f.seek(max(size - _HEAD_TAIL, _HEAD_TAIL))
            h.update(f.read(_HEAD_TAIL))
    return h.hexdigest()


def _nanogpt_meta(root: epath.Path, vocab_size: int | None) -> tuple[int, int, np.dtype]:
    meta_path = root / NANOGPT_META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    dtype = np.dtype(meta.get("dtype", "uint16"))
    vocab = meta.get("vocab_size", vocab_size)
    eot = meta.get("eot_id")
    if vocab is None:
        raise CorpusError(f"nanoGPT folder {root}: its vocabulary is unknown; write {NANOGPT_META} with "
                          '{"vocab_size": N, "eot_id": E} (meta.pkl is not read)')
    if eot is None:
        if int(vocab) < GPT2_VOCAB:
            raise CorpusError(f"nanoGPT folder {root}: no {NANOGPT_META} and a vocabulary of {vocab} < GPT-2's "
                              f'{GPT2_VOCAB}; write {NANOGPT_META} with {{"vocab_size": N, "eot_id": E}} '
                              "(meta.pkl is not read)")
        vocab, eot = GPT2_VOCAB, GPT2_EOT  # the model's vocabulary may be padded above GPT-2's
    return int(vocab), int(eot), dtype


def _open_nanogpt(root: epath.Path, vocab_size: int | None) -> PreparedTokens:
    vocab, eot, dtype = _nanogpt_meta(root, vocab_size)
    splits: dict[str, Any] = {}
    for split, name in NANOGPT_FILES.items():
        p = root / name
        if not p.exists():
            if split != "test":
                raise CorpusError(f"nanoGPT folder {root} has no {name}")
            splits[split] = {"tokens": 0, "documents": None, "text_sha256": None,
                             "tokens_sha256": hashlib.sha256(b"").hexdigest(), "shards": []}
            continue
        size = p.stat().length
        if size % dtype.itemsize:
            raise CorpusError(f"{p} has {size} bytes, not a whole number of {dtype.name} token ids")
        # Held-out files are small and the run directory keeps a copy checked against this hash: hash them whole.
        full = _sha256_of(p) if split != "train" else None
        head_tail = _head_tail_sha256(p, size) if full is None else None
        splits[split] = {"tokens": size // dtype.itemsize, "documents": None, "text_sha256": None,
                         "tokens_sha256": full, "head_tail_sha256": head_tail,
                         "shards": [{"file": name, "tokens": size // dtype.itemsize, "sha256": full}]}
    manifest = {"format": "nanogpt", "dtype": dtype.name, "splits": splits,
                "tokenizer": {"kind": "ids", "vocab_size": vocab, "eot_id": eot, "file": None,
                              "sha256": f"ids:vocab={vocab}:eot={eot}"}}
    return PreparedTokens(root, manifest, None)


def tokens_contents(directory: str | epath.PathLike) -> dict[str, Any]:
    """What a ``tokens:DIR`` holds, by content, without reading the token files of a prepared directory: its shards'
    ``[file, bytes, sha256, split]`` from the manifest plus the tokenizer hash. A nanoGPT folder: its files'
    ``[file, bytes, sha256 or head/tail sha256, split]`` (module docstring)."""
    root = _path(directory)
    manifest = read_manifest(root)
    if manifest is not None:
        itemsize = np.dtype(manifest["dtype"]).itemsize
        files = [[s["file"], int(s["tokens"]) * itemsize, s["sha256"], split]
                 for split in SPLITS for s in manifest["splits"][split]["shards"]]
        return {"kind": "tokens", "files": files, "tokenizer_sha256": manifest["tokenizer"]["sha256"]}
    if not (root / NANOGPT_FILES["train"]).exists():
        raise CorpusError(f"{root} has neither a {MANIFEST} (python -m coupled_qk_jax.data.prepare) nor a nanoGPT "
                          f"{NANOGPT_FILES['train']}")
    files = []
    for split, name in NANOGPT_FILES.items():
        p = root / name
        if p.exists():
            size = p.stat().length
            files.append([name, size, _head_tail_sha256(p, size) if split == "train" else _sha256_of(p), split])
    return {"kind": "tokens", "files": files}


def tokens_fingerprint(directory: str | epath.PathLike) -> dict[str, Any]:
    """A cheap change detector (``corpora.source_fingerprint``): the manifest's hash, or the nanoGPT files' sizes and
    modification times."""
    root = _path(directory)
    mp = root / MANIFEST
    if mp.exists():
        return {"kind": "tokens", "manifest_sha256": hashlib.sha256(mp.read_bytes()).hexdigest()}
    h = hashlib.sha256()
    for name in NANOGPT_FILES.values():
        p = root / name
        if p.exists():
            st = p.stat()
            h.update(f"{name}\0{st.length}\0{st.mtime}\n".encode())
    return {"kind": "tokens", "file_list_sha256": h.hexdigest()}
