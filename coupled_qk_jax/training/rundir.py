"""The run directory is the source of truth of a run: its config, tokenizer and data identity live in it, and every
resume and evaluation checks them.

Layout (``WORKDIR``; process 0 writes, every file atomically)::

    config.json       the fully resolved config (every field, defaults included), rewritten at each start
    data.json         the data fingerprint (``token_cache.data_fingerprint``): corpus spec, every file's relative
                      path / size / SHA-256 / split, each split's token count and text and token hashes, tokenizer
    tokenizer.json    a copy of the run's BPE tokenizer (absent for the byte tokenizer)
    heldout/          validation.bin, test.bin: the held-out token ids, so that evaluation needs no corpus and no
                      token cache (a run directory can be moved or copied and evaluated with --workdir alone)
    history.jsonl     one line per start, resume (with the changes allowed by --allow_change) and end
    lock              held (fcntl.flock) by the train.py that trains here; it contains that process's pid (on
                      gs:// it only records who started last: Cloud Storage has no lock that a crash releases)
    checkpoints/      training/checkpoint.py; a damaged step is moved to damaged_checkpoints/<step>, not deleted
    metrics.jsonl, tb/, summary.json     training/writers.py
    eval/             eval.py's results, eval_<split>_step<step>.json (or under eval.py --out)

Resume rules (:func:`resume_changes`): a field of :data:`RUNTIME_FIELDS` (the ``runtime`` block, the mesh, ...)
may differ freely, with a note each (it changes no result; a checkpoint saved with the other layer layout is
converted on restore); ``data.corpus`` / ``data.tokenizer_path`` may point elsewhere when the files there match the fingerprint;
a field of :data:`CHANGEABLE_FIELDS` may differ only when named in ``--allow_change`` (recorded in history.jsonl);
every other field (model, data, batch size, seed, optimiser, schedule shape...) must equal the run's.

WORKDIR may be a local path or a Cloud Storage URL (``gs://bucket/run``); coupled_qk_jax/paths.py says how each is
written.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coupled_qk_jax import paths
from coupled_qk_jax.config import RUNTIME_FIELD_NAMES, ModelConfig, RuntimeConfig
from coupled_qk_jax.data.corpora import SPLITS, CorpusSpec
from coupled_qk_jax.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from coupled_qk_jax.errors import UserError, did_you_mean
from coupled_qk_jax.paths import jsonable, write_json
from coupled_qk_jax.reporting import code_commit

CONFIG, DATA, TOKENIZER, HISTORY, LOCK, HELD_OUT = (
    "config.json", "data.json", "tokenizer.json", "history.jsonl", "lock", "heldout")
HELD_OUT_SPLITS = ("validation", "test")

# Fields that change no result: free to differ on resume and in eval.py's --config. The runtime block's are also
# noted when they change (how a run computes is worth a line in its log; where its cache is is not).
RUNTIME_BLOCK_FIELDS = frozenset(f"runtime.{name}" for name in RUNTIME_FIELD_NAMES)
RUNTIME_FIELDS = frozenset({"data.cache_dir", "data.num_threads", "mesh.data", "mesh.fsdp", "mesh.tensor",
                            "mesh.dcn_data", "mesh.dcn_fsdp", "checkpoint.async_save", "train.stop_after",
                            *RUNTIME_BLOCK_FIELDS})
# Where the data is, not what it is: checked through the data fingerprint instead of by value.
FINGERPRINTED_FIELDS = frozenset({"data.corpus", "data.tokenizer_path"})
# Fields added to the configs after runs existed, with the value that means what those runs did: a run whose
# config.json lacks one resumes (and is evaluated) under a config holding that value, as if it had been recorded.
ADDED_FIELDS = {"train.early_stop.metric": "", "train.early_stop.mode": "max", "train.early_stop.patience": 0,
                "train.early_stop.min_delta": 0.0, "train.early_stop.threshold": None, "checkpoint.keep_best": "",
                "train.schedule_every": 1,
                # MQAR runs from before the validation split: the CPU levels and one fixed training order. They had no
                # validation segment (their "validation" was the test segment); 0 = the level's own size now.
                "mqar.protocol": "cpu", "mqar.shuffle": False, "mqar.num_valid": 0,
                # Runs from before multi-slice meshes: one slice.
                "mesh.dcn_data": 1, "mesh.dcn_fsdp": 1,
                # Runs from before imported GPT-2 checkpoints: projections without biases.
                "model.attn_bias": False, "train.init_from": "",
                # Runs from before sentence classification: the language model alone.
                "model.num_labels": 0}
# Fields the code no longer has, with their last default: a run that used it is read (resumed, evaluated) as if the
# field had never existed; a run that set another value is refused (this version cannot reproduce its results).
REMOVED_FIELDS = {"model.coupling_lowering": "batched"}  # one lowering of f over heads is left
# config.json's schema: written as its "schema_version" key. 1: no key (every run before the key existed). 3: the
# runtime block, whose fields were model.* fields before (read from there in older runs).
SCHEMA_VERSION, SCHEMA_KEY = 3, "schema_version"
# What an evaluation depends on: eval.py --config may differ from the run elsewhere (it is ignored there, with a note).
EVAL_FIELDS = ("task", "model.", "data.", "mqar.")
# Meaningful to change on resume; each needs --allow_change=FIELD and is recorded in history.jsonl. The stopping
# rule (train.early_stop.*) is among them: a stopped run is a prefix of the full one; so is the compute dtype, which
# changes the numbers but not the function (moving a run between hardware).
CHANGEABLE_FIELDS = ("model.dtype", "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
                     "train.eval_batch_size", "checkpoint.every", "checkpoint.every_seconds", "checkpoint.keep_last",
                     "checkpoint.keep_every", "checkpoint.keep_best", *(k for k in ADDED_FIELDS if k.startswith("train.early_stop.")))
_ABSENT = "<absent>"


# --------------------------------------------------------------------------------------------------------------------
# Files.
# --------------------------------------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The parsed file, None when it does not exist; a damaged file is a one-line UserError naming it."""
    path = paths.epath_of(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); restore it from a copy of the run") from None


def record_history(workdir: str, event: str, **fields: Any) -> None:
    """Append one line to WORKDIR/history.jsonl (process 0 only): the event, when, where, the command line and the
    code's git commit (reporting.code_commit), so every result can name the code that made it."""
    line = {"event": event, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "pid": os.getpid(), "argv": sys.argv, "commit": code_commit(), **fields}
    path, text = os.path.join(workdir, HISTORY), json.dumps(jsonable(line), sort_keys=True) + "\n"
    try:
        paths.append_text(path, text)
    except paths.io_errors(path) as e:
        raise UserError(f"cannot write {path}: {paths.cause(e)}") from None


def lr_extensions(workdir: str) -> list[tuple[int, int]]:
    """``(step, old train.steps)`` of every resume recorded in WORKDIR/history.jsonl that changed train.steps
    (--allow_change=train.steps), in order: what the learning-rate schedule of the run's later starts follows."""
    path = os.path.join(workdir, HISTORY)
    if not paths.is_file(path):
        return []
    out = []
    for line in paths.read_text(path).splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        change = (row.get("changes") or {}).get("train.steps")
        if row.get("event") == "resume" and change is not None:
            out.append((int(row["step"]), int(change["run"])))
    return out


# --------------------------------------------------------------------------------------------------------------------
# The lock: one training process per run directory.
# --------------------------------------------------------------------------------------------------------------------


class WorkdirLock:
    """An exclusive ``fcntl.flock`` on WORKDIR/lock for as long as the process trains there. The kernel drops it
    when the process dies (SIGKILL included), so a stale lock file never blocks a later run.

    A gs:// workdir has no such lock: an object lock that a killed process leaves behind would block every later
    resume until removed by hand, which is worse than what it prevents. There the lock file is only written (host
    and pid of the latest train.py, which also shows at once whether the workdir is writable); keeping to one
    train.py per gs:// workdir is up to the user (a scheduler that restarts a preempted job does this)."""

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, LOCK)
        self.fd = -1
        if paths.is_remote(workdir):
            try:
                paths.write_text(self.path, f"{socket.gethostname()} {os.getpid()}\n")
            except paths.io_errors(self.path) as e:  # a missing bucket, no permission
                raise UserError(f"cannot write to workdir {workdir}: {paths.cause(e)}") from None
            return
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot write to workdir {workdir}: {e.strerror or e}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise UserError(f"workdir {workdir} is in use by another train.py (pid {holder}); wait for it to finish "
                            f"or use another --workdir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing releases the flock
            self.fd = -1


# --------------------------------------------------------------------------------------------------------------------
# Config comparison.
# --------------------------------------------------------------------------------------------------------------------


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{field: (old, new)}`` of every leaf field that differs (a missing field reads as "<absent>"; a field of
    :data:`ADDED_FIELDS` missing from ``old`` reads as its value there)."""
    a, b = flatten(jsonable(old)), flatten(jsonable(new))
    a.pop(SCHEMA_KEY, None)  # which schema wrote a config is not one of its fields
    b.pop(SCHEMA_KEY, None)
    for k, v in ADDED_FIELDS.items():
        if k not in a and k in b:
            a[k] = v
    return {k: (a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in sorted(set(a) | set(b))
            if a.get(k, _ABSENT) != b.get(k, _ABSENT)}


def _describe(diffs: dict[str, tuple[Any, Any]], old: str, new: str) -> str:
    return "; ".join(f"{k}: {old} {a!r}, {new} {b!r}" for k, (a, b) in diffs.items())


def resume_changes(saved: dict[str, Any], new: dict[str, Any], allow_change: Sequence[str],
                   workdir: str) -> dict[str, tuple[Any, Any]]:
    """The allowed changes ``{field: (run's, new)}`` of a resume; raises UserError naming every refused field. Both
    configs are compared in this version's schema (:func:`upgrade_config`): a field added since the run started
    counts as its default, a removed one as absent."""
    for name in allow_change:
        if name not in CHANGEABLE_FIELDS:
            raise UserError(f"--allow_change={name}: not a field that may change on resume"
                            f"{did_you_mean(name, CHANGEABLE_FIELDS)}; those are {', '.join(CHANGEABLE_FIELDS)}")
    diffs = {k: v for k, v in config_differences(upgrade_config(saved)[0], upgrade_config(new)[0]).items()
             if k not in RUNTIME_FIELDS and k not in FINGERPRINTED_FIELDS}
    fixed = {k: v for k, v in diffs.items() if k not in CHANGEABLE_FIELDS}
    unallowed = {k: v for k, v in diffs.items() if k in CHANGEABLE_FIELDS and k not in allow_change}
    if fixed or unallowed:
        parts = []
        if fixed:
            parts.append(f"{_describe(fixed, 'run', 'now')}; use a new --workdir for another setting")
        if unallowed:
            parts.append(f"{_describe(unallowed, 'run', 'now')}; to change "
                         f"{'it' if len(unallowed) == 1 else 'them'} pass --allow_change={','.join(unallowed)}")
        raise UserError(f"workdir {workdir} holds a run with other settings: {'; '.join(parts)}")
    return {k: v for k, v in diffs.items() if k in CHANGEABLE_FIELDS}


def runtime_notes(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per ``runtime.*`` field that ``new`` computes differently from ``saved`` (both in any schema)."""
    diffs = config_differences(upgrade_config(saved)[0], upgrade_config(new)[0])
    return [f"{k}: the run's {a!r}, now {b!r} (how the model is computed, not what it computes)"
            for k, (a, b) in diffs.items() if k in RUNTIME_BLOCK_FIELDS]


def check_eval_config(run_cfg: dict[str, Any], given: dict[str, Any], workdir: str) -> list[str]:
    """eval.py --config must agree with the run in every field that changes what is evaluated (:data:`EVAL_FIELDS`;
    runtime fields aside); the others are ignored, one note each (returned). The run's own config needs no
    --config."""
    diffs = {k: v for k, v in config_differences(run_cfg, upgrade_config(given)[0]).items()
             if k not in RUNTIME_FIELDS}
    refused = {k: v for k, v in diffs.items() if k == "task" or k.startswith(EVAL_FIELDS[1:])}
    if refused:
        raise UserError(f"--config disagrees with the run in {workdir}: {_describe(refused, 'run', '--config')}; "
                        f"omit --config to evaluate with the run's own config.json")
    return [f"{k}: --config has {b!r}, the run {a!r}; it does not change the evaluation, ignored"
            for k, (a, b) in diffs.items() if k not in refused]


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def upgrade_config(saved: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A config.json of any schema version -> ``(this version's config dict, notes)``, without the version key.

    * A field this code added (:data:`ADDED_FIELDS`, or a ``ModelConfig`` field) that the run lacks takes the value
      that means what the run did, noted as "X: not in this run, using default Y" (unless it is a
      :data:`RUNTIME_FIELDS` one, e.g. the mesh's slices).
    * A field this code removed (:data:`REMOVED_FIELDS`) is dropped with a note if the run held its last default;
      any other value is a UserError (the run's results would differ under this code).
    * The runtime fields that an older run recorded under ``model`` move to the ``runtime`` block; a run without
      one gets RuntimeConfig's defaults there, silently (they change no result).
    * A run written by a newer schema than this code reads is a UserError.
    """
    version = saved.get(SCHEMA_KEY, 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise UserError(f"config.json has schema version {version!r}; this code reads up to {SCHEMA_VERSION}: the "
                        f"run was written by a newer version of coupled_qk_jax, update it")
    flat = flatten(jsonable({k: v for k, v in saved.items() if k != SCHEMA_KEY}))
    notes = []
    for name, last in REMOVED_FIELDS.items():
        if name in flat:
            value = flat.pop(name)
            if value != last:
                raise UserError(f"{name}={value!r}: this run set a field that this version no longer has (its last "
                                f"default was {last!r}), so it cannot reproduce the run; use the commit that trained "
                                f"it (history.jsonl)")
            notes.append(f"{name}: removed from this version; the run used its last default {last!r}, dropped")
    for name in RUNTIME_FIELD_NAMES:
        if f"model.{name}" in flat:
            flat[f"runtime.{name}"] = flat.pop(f"model.{name}")
    added = dict(ADDED_FIELDS)
    if "model" in saved:
        for f in dataclasses.fields(ModelConfig):
            added.setdefault(f"model.{f.name}", f.default)
        for f in dataclasses.fields(RuntimeConfig):
            added.setdefault(f"runtime.{f.name}", f.default)
    for name, value in added.items():
        if (name.split(".")[0] in saved or name in RUNTIME_BLOCK_FIELDS) and name not in flat:
            flat[name] = value
            if name not in RUNTIME_FIELDS:  # how a run is laid out on devices says nothing about what it did
                notes.append(f"{name}: not in this run, using default {value!r}")
    return _unflatten(flat), notes


def config_with_schema(cfg: dict[str, Any]) -> dict[str, Any]:
    """What config.json holds: the config and this code's :data:`SCHEMA_VERSION`."""
    return {**jsonable(cfg), SCHEMA_KEY: SCHEMA_VERSION}


# --------------------------------------------------------------------------------------------------------------------
# Data fingerprint comparison.
# --------------------------------------------------------------------------------------------------------------------


def _without_paths(spec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in spec.items() if k != "path"}
    out["sources"] = [[_without_paths(s), w] for s, w in spec.get("sources", [])]
    return out


def _file_table(sources: dict[str, Any]) -> dict[str, tuple]:
    if sources.get("kind") == "mixture":
        return {f"{i}/{k}": v for i, (sub, _) in enumerate(sources["sources"]) for k, v in _file_table(sub).items()}
    if "files" in sources:
        return {f[0]: tuple(f[1:]) for f in sources["files"]}
    return {"<dataset>": (sources.get("name"), sources.get("config"))}


def source_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between two ``source_contents`` (files added, removed, changed or moved to another split)."""
    a, b = _file_table(old), _file_table(new)
    added, removed = sorted(set(b) - set(a)), sorted(set(a) - set(b))
    changed = sorted(k for k in set(a) & set(b) if a[k][:2] != b[k][:2])
    moved = sorted(k for k in set(a) & set(b) if a[k][:2] == b[k][:2] and a[k][2:] != b[k][2:])
    out = []
    for what, names in (("added", added), ("removed", removed), ("changed", changed), ("in another split", moved)):
        if names:
            out.append(f"{len(names)} file(s) {what} (e.g. {names[0]})")
    return out


def fingerprint_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every difference between two data fingerprints except where the corpus lives."""
    if "corpus" not in old or "corpus" not in new:  # generated data (MQAR): the task alone
        return [] if old == new else [f"data: run {old}, now {new}"]
    out = []
    a, b = _without_paths(old["corpus"]), _without_paths(new["corpus"])
    if a != b:
        out.append(f"corpus spec: run {CorpusSpec.coerce(old['corpus'])}, now {CorpusSpec.coerce(new['corpus'])} "
                   f"({_describe(config_differences(a, b), 'run', 'now')})")
    out += source_differences(old["sources"], new["sources"])
    if old["tokenizer"] != new["tokenizer"]:
        out.append(f"tokenizer: {_describe(config_differences(old['tokenizer'], new['tokenizer']), 'run', 'now')}")
    for split in SPLITS:
        x, y = old["splits"][split], new["splits"][split]
        if x != y:
            out.append(f"{split} split: {_describe(config_differences(x, y), 'run', 'now')}")
    return out


def refuse_other_data(workdir: str, differences: list[str]) -> None:
    if differences:
        raise UserError(f"the data differs from the run in {workdir} (data.json): {'; '.join(differences)}; point "
                        f"data.corpus at the run's corpus, or use a new --workdir")


# --------------------------------------------------------------------------------------------------------------------
# The run's own data: tokenizer copy and held-out splits.
# --------------------------------------------------------------------------------------------------------------------


def save_run_data(workdir: str, cache: Any, fingerprint: dict[str, Any]) -> None:
    """Copy the tokenizer and the held-out splits of ``cache`` (a TokenCache) into WORKDIR, then write data.json
    (last: its presence means the rest is complete)."""
    info = cache.manifest["tokenizer"]
    has_file = info["kind"] != "byte" and bool(info.get("file"))  # a nanoGPT folder's ids have no tokenizer file
    if paths.is_remote(workdir):  # whole objects (paths.write_bytes); data.json still comes last
        if has_file:
            paths.write_bytes(os.path.join(workdir, TOKENIZER), (cache.directory / info["file"]).read_bytes())
        for split in HELD_OUT_SPLITS:
            tokens = np.asarray(cache.tokens(split)).tobytes()
            paths.write_bytes(os.path.join(workdir, HELD_OUT, f"{split}.bin"), tokens)
        write_json(os.path.join(workdir, DATA), fingerprint)
        return
    if has_file:
        shutil.copyfile(cache.directory / info["file"], os.path.join(workdir, TOKENIZER))
    held = Path(workdir) / HELD_OUT
    held.mkdir(exist_ok=True)
    for split in HELD_OUT_SPLITS:
        tmp = held / f".{split}.bin.tmp{os.getpid()}"
        np.asarray(cache.tokens(split)).tofile(tmp)
        os.replace(tmp, held / f"{split}.bin")
    write_json(os.path.join(workdir, DATA), fingerprint)


def run_tokenizer_path(workdir: str) -> str | None:
    """WORKDIR/tokenizer.json as a local file (a downloaded copy for a gs:// workdir: the tokenizers library opens
    files by name), None when the run has none."""
    p = os.path.join(workdir, TOKENIZER)
    return paths.local_copy(p) if paths.is_file(p) else None


class RunData:
    """The held-out token ids and tokenizer of a run directory: what evaluation needs, duck-typed like a TokenCache
    (``tokens(split)``, ``eot_id``, ``vocab_size``, ``tokenizer``, ``manifest``, ``directory``)."""

    def __init__(self, workdir: str) -> None:
        self.directory = (paths.epath_of(workdir) if paths.is_remote(workdir) else Path(workdir)) / HELD_OUT
        fp = read_json(os.path.join(workdir, DATA))
        if fp is None:
            raise UserError(f"{workdir} has no {DATA}: not a run directory written by train.py (or its first start "
                            f"did not get past data preparation)")
        self.fingerprint = fp
        self.manifest = {"splits": {s: dict(fp["splits"][s]) for s in SPLITS}, "dtype": fp["dtype"],
                         "tokenizer": fp["tokenizer"]}
        info = fp["tokenizer"]
        if info["kind"] == "byte":
            self.tokenizer: Tokenizer | None = ByteTokenizer()
        elif info["kind"] == "ids":  # trained on a nanoGPT folder's ids: no tokenizer to decode with
            self.tokenizer = None
        else:
            path = run_tokenizer_path(workdir)
            if path is None:
                raise UserError(f"{workdir}/{TOKENIZER} is missing; copy the whole run directory")
            from coupled_qk_jax.data.tokenizer import tokenizer_json_sha256  # noqa: PLC0415

            if tokenizer_json_sha256(path) != info["sha256"]:
                raise UserError(f"{path} differs from the tokenizer recorded in {DATA}; restore the run's copy")
            self.tokenizer = BPETokenizer.load(path, int(info["vocab_size"]))
        self._verified: set[str] = set()
        self._read: dict[str, np.ndarray] = {}  # a gs:// run's splits, read once

    @property
    def vocab_size(self) -> int:
        return int(self.fingerprint["tokenizer"]["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.fingerprint["tokenizer"]["eot_id"])

    def tokens(self, split: str) -> np.ndarray:
        """[n] token ids of a held-out split, memory-mapped; its SHA-256 is checked against data.json once."""
        if split not in HELD_OUT_SPLITS:
            raise UserError(f"the run directory holds the {' and '.join(HELD_OUT_SPLITS)} splits, not {split!r}")
        info = self.fingerprint["splits"][split]
        n, dtype = int(info["tokens"]), np.dtype(self.fingerprint["dtype"])
        path = self.directory / f"{split}.bin"
        remote = paths.is_remote(self.directory)
        if remote and split in self._read:
            return self._read[split]
        if not path.is_file() or (path.stat().length if remote else path.stat().st_size) != n * dtype.itemsize:
            raise UserError(f"{path} is missing or has the wrong size ({n} tokens expected); copy the whole run "
                            f"directory")
        if n == 0:
            return np.empty(0, dtype=dtype)
        if remote:  # read whole, once: no memory map of an object (and the held-out splits are small)
            arr = self._read[split] = np.frombuffer(path.read_bytes(), dtype=dtype)
        else:
            arr = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
        if split not in self._verified:
            import hashlib  # noqa: PLC0415

            if hashlib.sha256(arr.tobytes()).hexdigest() != info["tokens_sha256"]:
                raise UserError(f"{path} is damaged (its SHA-256 differs from {DATA}); copy the run directory again")
            self._verified.add(split)
        return arr


def run_config(workdir: str) -> dict[str, Any] | None:
    """The run's config: WORKDIR/config.json (None for a directory no run has started in)."""
    return read_json(os.path.join(workdir, CONFIG))


def move_damaged(checkpoint_dir: str, step: int) -> str:
    """Move a damaged checkpoint step out of the manager's sight (to WORKDIR/damaged_checkpoints/<step>[.n]); the
    resumed run would otherwise save that step again into the same name. Returns the new path."""
    dest_root = os.path.join(os.path.dirname(checkpoint_dir), "damaged_checkpoints")
    paths.makedirs(dest_root)
    dest, n = os.path.join(dest_root, str(step)), 1
    while paths.exists(dest):
        dest, n = os.path.join(dest_root, f"{step}.{n}"), n + 1
    source = os.path.join(checkpoint_dir, str(step))
    if paths.is_remote(source):  # no rename in Cloud Storage: epath copies each object, then deletes the original
        paths.epath_of(source).rename(dest)
    else:
        os.replace(source, dest)
    return dest


def write_eval_result(out_dir: str, result: dict[str, Any]) -> str:
    """OUT/eval_<split>_step<step>[_replica<K>].json (never summary.json); returns its path."""
    try:
        if not paths.is_remote(out_dir):  # a URL needs no directory (paths.makedirs)
            os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the evaluation to {out_dir}: {e.strerror or e}; pass --out=DIR") from None
    replica = f"_replica{result['replica']}" if "replica" in result else ""
    path = os.path.join(out_dir, f"eval_{result['split']}_step{result['step']}{replica}.json")
    try:
        write_json(path, result)
    except UserError as e:
        raise UserError(f"{e}; pass --out=DIR to write the evaluation elsewhere") from None
    return path
