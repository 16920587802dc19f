"""Tokenizers with one tiny interface: ``encode``, ``encode_batch``, ``decode``, ``vocab_size``, ``eot_id``.

* :class:`ByteTokenizer` - UTF-8 bytes 0..255 plus ``<|endoftext|>`` = 256 (so ``vocab_size`` is 257). No training;
  for tests and byte-level baselines.
* :class:`BPETokenizer` - byte-level BPE trained locally with Hugging Face ``tokenizers`` (offline, a few seconds
  for 10 MB), saved as JSON. ``<|endoftext|>`` is its id 0.

Both round-trip any string exactly: ``decode(encode(s)) == s``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from coupled_qk_jax.data.corpora import CorpusError

EOT = "<|endoftext|>"


class Tokenizer(Protocol):
    """The interface the cache and the trainer use."""

    kind: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> np.ndarray: ...  # [n] int32

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``<|endoftext|>`` is 256. Decoding skips the end-of-text id, as BPE decoding does."""

    kind = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> [len(text.encode())] int32."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        arr = arr[arr != self.eot_id]
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokenizer ids must lie in 0..256, got {int(arr.min())}..{int(arr.max())}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "vocab_size": self.vocab_size}


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) wrapping a ``tokenizers.Tokenizer``."""

    kind = "bpe"

    def __init__(self, tk: "object") -> None:
        self._tk = tk
        eot = tk.token_to_id(EOT)  # type: ignore[attr-defined]
        if eot is None:
            raise CorpusError(f"BPE tokenizer has no {EOT} token")
        self.eot_id: int = int(eot)
        self.vocab_size: int = int(tk.get_vocab_size())  # type: ignore[attr-defined]

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> "BPETokenizer":
        """Trains on an iterator of documents. Raises if the corpus is too small to reach ``vocab_size`` exactly,
        because the model's embedding is sized from the configured vocab and the two must agree."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 258:
            raise CorpusError(f"a byte-level BPE needs vocab_size >= 258 (256 bytes + {EOT} + 1 merge), "
                              f"got {vocab_size}")
        tk = HFTokenizer(models.BPE())
        # add_prefix_space=False keeps decode(encode(s)) == s exactly (no invented leading space).
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
            # All 256 byte symbols up front, so any text (unseen scripts included) stays encodable.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tk.train_from_iterator(texts, trainer=trainer)
        got = tk.get_vocab_size()
        if got != vocab_size:
            raise CorpusError(f"the training text is too small for a {vocab_size}-token BPE (it learned {got}); "
                              f"lower vocab_size or use a larger corpus")
        return cls(tk)

    @classmethod
    def load(cls, path: str | os.PathLike[str], vocab_size: int | None = None) -> "BPETokenizer":
        """Loads a saved tokenizer; with ``vocab_size``, raises :class:`CorpusError` when it differs."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path)
        if not p.is_file():
            raise CorpusError(f"tokenizer file {p} does not exist")
        tok = cls(HFTokenizer.from_file(str(p)))
        if vocab_size is not None and tok.vocab_size != vocab_size:
            raise CorpusError(f"vocab mismatch: tokenizer {p} has vocab_size {tok.vocab_size} but {vocab_size} was "
                              "asked for; set vocab_size to match or delete the tokenizer/cache")
        return tok

    def save(self, path: str | os.PathLike[str]) -> None:
        """Atomic: written to a temporary file beside ``path``, fsynced, then renamed over it (a failed write
        removes the temporary file)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
        try:
            self._tk.save(str(tmp))  # type: ignore[attr-defined]
            with open(tmp, "rb+") as f:  # the Rust writer has closed it; make its bytes durable before the rename
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> [n] int32."""
        return np.asarray(self._tk.encode(text).ids, dtype=np.int32)  # type: ignore[attr-defined]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encodes in parallel (Rust threads); much faster than a Python loop over :meth:`encode`."""
        encs = self._tk.encode_batch(list(texts))  # type: ignore[attr-defined]
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids_list = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        return self._tk.decode(ids_list, skip_special_tokens=True)  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "vocab_size": self.vocab_size}

    def to_json(self) -> str:
        return self._tk.to_str()  # type: ignore[attr-defined]


def tokenizer_json_sha256(path: str | os.PathLike[str]) -> str:
    """Hash of a tokenizer file's canonical JSON (so formatting differences do not change the cache key)."""
    import hashlib

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
