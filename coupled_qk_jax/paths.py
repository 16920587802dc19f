"""Paths a user gives (workdir, checkpoints, eval/export output): a local path or a URL such as ``gs://bucket/run``.

Local paths behave as they always have (made absolute, written through a temporary file, fsync and os.replace).
URLs go through ``etils.epath`` (fsspec; gs:// needs gcsfs: ``pip install coupled-qk-jax[gcs]``). Paths stay plain
strings everywhere: ``os.path.join`` and ``os.path.basename`` treat ``gs://bucket/run`` correctly, ``os.path.abspath``
and ``open`` do not, which is why every touch of the file system goes through this module or ``epath``.

Cloud Storage has no rename and no append: an object appears whole when its upload completes, so writing the final
name directly is already atomic for readers, and appending means rewriting the object (:func:`append_text`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from etils import epath

from coupled_qk_jax.errors import UserError

# fsspec's implementation of each protocol we can name in an error, and the extra that installs it.
_PROTOCOL_PACKAGES = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for a URL (``gs://...``), False for a local path."""
    return "://" in str(path)


def resolve(path: str | os.PathLike[str]) -> str:
    """A local path made absolute (as before: the run must not depend on the current directory later), or a URL as
    given without a trailing slash. Raises UserError when the URL's file-system package is not installed."""
    p = os.fspath(path)
    if not is_remote(p):
        return os.path.abspath(p)
    protocol = p.split("://", 1)[0]
    package, extra = _PROTOCOL_PACKAGES.get(protocol, (None, None))
    if package is not None and importlib.util.find_spec(package) is None:
        raise UserError(f"{p}: {protocol}:// paths need {package}; pip install 'coupled-qk-jax[{extra}]'")
    return p.rstrip("/")


def epath_of(path: str | os.PathLike[str]) -> epath.Path:
    """The ``epath.Path`` of a local path or URL."""
    return epath.Path(os.fspath(path))


def as_path(path: str | os.PathLike[str]) -> Path | epath.Path:
    """A ``pathlib.Path`` for a local path (exactly as before), an ``epath.Path`` for a URL: both support ``/``,
    ``mkdir``, ``exists``, ``read_text`` / ``write_text`` and ``read_bytes`` / ``write_bytes``."""
    return epath_of(path) if is_remote(path) else Path(path)


def cause(e: BaseException) -> str:
    """The first line of an I/O error's reason (OSError's strerror when it has one)."""
    text = (getattr(e, "strerror", None) or str(e) or type(e).__name__).strip()
    return text.splitlines()[0] if text else type(e).__name__


def io_errors(path: str | os.PathLike[str]) -> tuple[type[BaseException], ...]:
    """What a failed read or write of ``path`` raises: OSError locally; for a URL also the file system's own errors
    (gcsfs's HTTP errors, a credentials error), which share no base class with it."""
    return (Exception,) if is_remote(path) else (OSError,)


def makedirs(path: str, what: str = "directory") -> None:
    """Create ``path`` and its parents; UserError if it cannot. A no-op for a URL: Cloud Storage has no
    directories, and gcsfs's mkdir creates a missing *bucket* (in the credentials' project, at a default location),
    which must never happen behind a mistyped --workdir; the first write names a missing bucket instead."""
    if is_remote(path):
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {what} {path}: {cause(e)}") from None


def exists(path: str) -> bool:
    return epath_of(path).exists()


def is_file(path: str) -> bool:
    return epath_of(path).is_file()


def read_text(path: str) -> str:
    return epath_of(path).read_text(encoding="utf-8")


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never part of it.
    Raises OSError (or the remote file system's error) on failure."""
    p = os.fspath(path)
    if is_remote(p):
        epath_of(p).write_bytes(data)  # an object becomes visible only once completely uploaded
        return
    tmp = os.path.join(os.path.dirname(p), f".{os.path.basename(p)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # after a crash or power loss: the old file or the whole new one, never an empty one
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`write_bytes` of UTF-8 text."""
    write_bytes(path, text.encode("utf-8"))


def jsonable(obj: Any) -> Any:
    """The strict-JSON form of ``obj`` (a config dict, a summary): tuples become lists, numpy scalars Python ones,
    NaN/inf the strings "nan"/"inf", anything else unknown its str()."""
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, np.generic):
            x = x.item()
        return str(x) if isinstance(x, float) and not np.isfinite(x) else x

    return json.loads(json.dumps(plain(obj), sort_keys=True, default=str))


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Human-readable JSON (:func:`jsonable`), written atomically (:func:`write_text`: readers never see half a
    file). The one JSON file writer: a run directory's config.json, data.json, summary.json and eval results, the
    token cache's manifest. Local path or gs:// URL; a failed write is a one-line UserError naming the file."""
    text = json.dumps(jsonable(obj), indent=2, sort_keys=True) + "\n"
    try:
        write_text(path, text)
    except io_errors(path) as e:
        raise UserError(f"cannot write {os.fspath(path)}: {cause(e)}") from None


def append_text(path: str, text: str) -> None:
    """Append ``text`` to ``path``. Locally an ``open(..., "a")``; Cloud Storage objects cannot be appended to, so
    there the object is read and written back whole (the files appended to, history.jsonl and metrics.jsonl, are
    small, and the rewrite keeps the old content readable until the new one is complete)."""
    if not is_remote(path):
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return
    p = epath_of(path)
    old = p.read_text(encoding="utf-8") if p.exists() else ""
    p.write_text(old + text, encoding="utf-8")


def remove_tree(path: str) -> None:
    """Remove a directory (or every object under a prefix) and everything in it; errors (a missing one) are
    ignored."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(Exception):  # as shutil.rmtree(ignore_errors=True) locally
        epath_of(path).rmtree()


def listdir(path: str) -> list[str]:
    """The names in a directory (the next level of object names under a prefix). Raises OSError if it is missing."""
    if not is_remote(path):
        return os.listdir(path)
    p = epath_of(path)
    if not p.exists():
        raise FileNotFoundError(path)
    return [c.name for c in p.iterdir()]


def save_figure(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``fig.savefig(path, **kwargs)`` (a matplotlib figure; the format from the file name), also to a URL:
    matplotlib writes local files only, so a remote image is rendered in memory and uploaded whole."""
    if not is_remote(path):
        fig.savefig(path, **kwargs)
        return
    buf = io.BytesIO()
    fig.savefig(buf, format=os.path.splitext(str(path))[1].lstrip(".") or "png", **kwargs)
    epath_of(path).write_bytes(buf.getvalue())


@functools.cache
def _download_dir() -> str:
    # One directory per process for the downloaded copies that readers need as local files (a tokenizer that the
    # Rust library opens by name), removed when the process exits.
    directory = tempfile.mkdtemp(prefix="coupled_qk_jax_")
    atexit.register(shutil.rmtree, directory, True)
    return directory


def local_copy(path: str) -> str:
    """``path`` itself when it is local; else a downloaded copy of the object, as a local file path."""
    if not is_remote(path):
        return path
    dest = os.path.join(_download_dir(), f"{abs(hash(path)):x}_{os.path.basename(path)}")
    with open(dest, "wb") as f:
        f.write(epath_of(path).read_bytes())
    return dest


def upload_dir(local: str, remote: str, last: str | None = None) -> None:
    """Copy every file of the local directory ``local`` to ``remote``; ``last`` (a file name) is copied after all
    the others, so that its presence means the rest is complete."""
    names = sorted(os.listdir(local), key=lambda n: n == last)
    dest = epath_of(remote)
    for name in names:
        (dest / name).write_bytes(Path(local, name).read_bytes())
