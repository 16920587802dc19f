"""Checkpoints: one orbax CheckpointManager per workdir holding the train state and a meta record.

Layout (``WORKDIR/checkpoints``)::

    <step>/state/    params, opt_state, step   (orbax StandardSave: sharded arrays, restored into given shardings)
    <step>/meta/     JSON: the run's config, its data fingerprint, the training stream's spec
                     (``pipeline.train_stream_spec``), the open train-loss window, and a checksum of every state leaf

No data-loader state is saved: the training batches are a random-access dataset whose order is a pure function of
the seed, so the data position is the step itself (batch ``i`` is global batch ``i`` on any number of hosts), and
a checkpoint written by N processes resumes on M. Checkpoints of older versions also hold ``<step>/data/`` (grain
iterator state, one file per process); it is read only to check that it agrees with the step
(:meth:`Checkpointer.legacy_data_position`).

orbax writes each step into a temporary directory and renames it when every item is complete, so a crash (even
SIGKILL) during a save leaves the previous checkpoints untouched and the half-written one invisible; leftover
temporary directories are removed when the manager is opened again.

Integrity. A completed checkpoint can still be damaged later (a truncated or deleted file, missing metadata, bytes
overwritten on disk). Every restore reads the meta record, restores the arrays and recomputes each leaf's checksum
(:func:`leaf_checksums`); any failure makes that step *damaged*. :meth:`Checkpointer.restore_newest_intact` then
names it in a one-line warning and tries the next older step; nothing is deleted (train.py moves a damaged step
aside, see training/rundir.py). A failed save raises :class:`CheckpointSaveError` at once and removes the
half-written temporary directory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from coupled_qk_jax import paths
from coupled_qk_jax.errors import UserError

ITEMS = ("state", "meta")
LEGACY_DATA_ITEM = "data"  # older versions' per-process grain iterator state
KEEP_BEST = ("", "validation_loss")  # checkpoint.keep_best
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions...): the run stops; the message names the cause and
    the last good checkpoint."""


class DamagedCheckpoint(Exception):
    """A checkpoint step that cannot be read back exactly; the message says what is wrong (one line)."""


# --------------------------------------------------------------------------------------------------------------------
# Per-leaf checksums.
# --------------------------------------------------------------------------------------------------------------------


def _leaf_sums(x: jax.Array) -> jax.Array:
    """[2] uint32: the wrapping sums of x's bit patterns, plain and position-weighted. Integer addition modulo 2^32 is
    associative, so the value does not depend on the sharding, the device count or the reduction order; the weights
    (an odd multiple of each element's flat index, computed from iotas so no reshape gathers the array) catch
    swapped or shifted blocks that the plain sum would miss."""
    width = x.dtype.itemsize
    if width == 8:  # a trailing axis of 2 words
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif width == 4:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        u = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[width]).astype(jnp.uint32)
    if u.ndim == 0:
        return jnp.stack([u, u * jnp.uint32(0x9E3779B1)])
    index = jnp.zeros(u.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(u.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * jnp.uint32(stride % 2**32)
        stride *= u.shape[d]
    weights = index * jnp.uint32(0x9E3779B1) + jnp.uint32(1)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * weights, dtype=jnp.uint32)])


@functools.lru_cache(maxsize=8)
def _sums_fn(mesh: Mesh | None) -> Callable[[Any], Any]:
    # Replicated outputs, so that every process of a multi-host run can read them.
    out = NamedSharding(mesh, P()) if mesh is not None else None
    return jax.jit(lambda tree: jax.tree.map(_leaf_sums, tree), out_shardings=out)


def leaf_checksums(state: Any) -> dict[str, list[int]]:
    """``{leaf path: [plain, weighted]}`` 32-bit checksums of every array of ``state`` (computed on device)."""
    sharding = getattr(jax.tree.leaves(state)[0], "sharding", None)
    sums = _sums_fn(sharding.mesh if isinstance(sharding, NamedSharding) else None)(state)
    flat = jax.tree_util.tree_flatten_with_path(sums)[0]
    return {jax.tree_util.keystr(p): [int(v) for v in np.asarray(s.addressable_data(0)).reshape(-1)]
            for p, s in flat}


# Below this many bytes per replica a replicated array is written whole by one replica (see the function below).
MIN_REPLICA_SLICE_BYTES = 4 << 20


@functools.cache
def _write_small_replicated_arrays_whole() -> None:
    """Orbax splits the write of every replicated array over its replicas (replica-parallel saving: each writes a
    slice), which costs one jitted slice per array shape and replica the first time it meets them: 48 compilations
    and 3.6 s of a 9.7 s run (2-core machine, beside another job) in the first save of the test-sized model on an
    8-device CPU mesh, every process anew. For slices of a few
    MB there is no bandwidth to win, so such arrays are written whole by one replica; large ones are still split.
    The files are the same either way (one array, whichever replica writes which part), so every checkpoint reads
    as before. Orbax takes this setting only from its global jax.Array handler, so it is set there, once, when the
    first writable Checkpointer is made (never on import), keeping the registered handler's array-metadata store
    (orbax's default handler writes per-array metadata, which restores check)."""
    current = ocp.type_handlers.get_type_handler(jax.Array)
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        array_metadata_store=getattr(current, "_array_metadata_store", None),
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES), override=True)


def _save_cause(e: BaseException) -> str:
    """The cause of a failed write in a few words: the OS error (errno and its text) when there is one, found on the
    exception chain or in tensorstore's message (``[os_error_code='28']``), else the first line of the message."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"[Errno {seen.errno}] {seen.strerror or os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    m = re.search(r"os_error_code='?(\d+)", str(e))
    if m:
        return f"[Errno {m.group(1)}] {os.strerror(int(m.group(1)))}"
    return _first_line(e)


def _quiet_orphaned_reads() -> None:
    """When one array of a step cannot be read, orbax's restore fails and closes its asyncio loop while tensorstore
    still completes the step's other reads; each completion then raises "Event loop is closed" in tensorstore's
    callback, reported through sys.unraisablehook as a traceback: hundreds of lines for a damaged step that
    restore_newest_intact reports in one. This process's unraisablehook drops exactly those (installed once, before
    the first restore); every other unraisable exception is reported as before."""
    if getattr(sys.unraisablehook, "_drops_orphaned_reads", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    hook._drops_orphaned_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    # The same reads' other way out: a failed read whose future nobody awaits any more is logged by asyncio's
    # default handler ("Future exception was never retrieved" and the tensorstore error, a dozen lines).
    logging.getLogger("asyncio").addFilter(_drop_orphaned_tensorstore_futures)


def _drop_orphaned_tensorstore_futures(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of an unretrieved future that failed inside a tensorstore read."""
    message = record.getMessage()
    if not message.startswith(("Future exception was never retrieved", "Task exception was never retrieved")):
        return True
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and "tensorstore_spec" in str(exc))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


# --------------------------------------------------------------------------------------------------------------------
# The manager.
# --------------------------------------------------------------------------------------------------------------------


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` that knows this project's three items.

    Args:
      directory: where the step directories go; a local one is made absolute (orbax refuses relative paths, and
        with async saving it would only say so from a background thread); a gs:// URL is used as given (orbax
        writes it through tensorstore).
      keep_last: keep the latest ``keep_last`` checkpoints.
      keep_every: also keep every checkpoint whose step is a multiple of this (0 = off).
      keep_best: ``"validation_loss"``: also keep the checkpoint saved with the lowest ``metrics["validation_loss"]``
        (orbax's BestN; a save without metrics is never the best); ``""`` = off.
      async_save: write array data in a background thread; ``save`` returns after the device-to-host copy, so the
        caller may donate / overwrite the saved arrays right away.
      read_only: for evaluation: never create the directory or remove anything in it.
    """

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 2, keep_every: int = 0,
                 async_save: bool = True, read_only: bool = False, keep_best: str = "") -> None:
        if keep_last < 1:
            raise UserError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        if keep_every < 0:
            raise UserError(f"checkpoint.keep_every must be >= 0, got {keep_every}")
        directory = os.fspath(directory)
        self.directory = paths.resolve(directory if paths.is_remote(directory) else os.path.expanduser(directory))
        keep: list[Any] = [policies.LatestN(n=keep_last)]
        if keep_every:
            keep.append(policies.EveryNSteps(interval_steps=keep_every))
        if keep_best not in KEEP_BEST:
            raise UserError(f"checkpoint.keep_best must be one of {KEEP_BEST}, got {keep_best!r}")
        if keep_best:  # descending order, so the last one (the one kept) has the lowest loss
            keep.append(policies.BestN(get_metric_fn=lambda m: m[keep_best], reverse=True, n=1,
                                       keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save and not read_only,
            preservation_policy=policies.AnyPreservationPolicy(keep) if len(keep) > 1 else keep[0],
            cleanup_tmp_directories=not read_only,  # a save interrupted by SIGKILL leaves a tmp dir: drop it
            create=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,  # (orbax warns when it has to change it itself)
        )
        if not read_only:
            _write_small_replicated_arrays_whole()
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)
        self._pending: int | None = None  # the step of an async save not yet known to be on disk

    def latest_step(self) -> int | None:
        """The newest *completed* checkpoint's step (unfinished saves are not listed)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        """The meta record of checkpoint ``step`` (no arrays are read). Raises DamagedCheckpoint."""
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = dict(out["meta"])
        except Exception as e:  # noqa: BLE001 - any failure to read it means this step is unusable
            raise DamagedCheckpoint(f"its meta record cannot be read ({_first_line(e)})") from e
        if "checksums" not in meta or "config" not in meta:
            raise DamagedCheckpoint("its meta record lacks the checksums or the config")
        return meta

    # -- saving ------------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """Saves both items under ``step`` (forced: our loop decides when to save). ``meta`` gets the state's
        checksums added; ``metrics`` (e.g. ``{"validation_loss": x}``) rank the step for ``keep_best``. Raises CheckpointSaveError (after removing the temporary directory) if this save or the
        previous asynchronous one failed."""
        self.check_saved()
        record = {**meta, "step": int(step), "checksums": leaf_checksums(state)}
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(record)), metrics=metrics, force=True)
        except Exception as e:  # noqa: BLE001 - disk full, permissions...: reported as one line by the caller
            self._failed(step, e)
        self._pending = step

    def check_saved(self) -> None:
        """Raise CheckpointSaveError if the last asynchronous save failed in its background thread."""
        if self._pending is None:
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            self._failed(self._pending, e)

    def wait(self) -> None:
        """Blocks until a pending async save is on disk (and renamed into place); raises CheckpointSaveError."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._failed(self._pending if self._pending is not None else -1, e)
        self._pending = None

    def _failed(self, step: int, e: BaseException) -> None:
        self._pending = None
        self._remove_temporaries_once_quiet()
        good = [s for s in self._completed_steps() if s != step]
        raise CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory} failed: {_save_cause(e)}; the run stopped, the "
            f"last good checkpoint is {'step ' + str(max(good)) if good else 'none'}") from e

    def _completed_steps(self) -> list[int]:
        try:
            return [int(d) for d in paths.listdir(self.directory) if d.isdigit()]
        except OSError:
            return []

    def _remove_temporaries_once_quiet(self, quiet_s: float = 0.5, limit_s: float = 10.0) -> None:
        """Remove a failed save's temporary directories and keep them removed. Orbax writes each array fragment
        in its own asyncio task and the first error (ENOSPC) does not cancel the others, so for a moment after the
        save raised they can still create files there, after an rmtree. So: wait for the manager, then remove
        until the directory has stayed clean for ``quiet_s`` (at most ``limit_s``; only on this failure path)."""
        try:
            self.manager.wait_until_finished()
        except Exception:  # noqa: BLE001 - the save's own error, which the caller is reporting
            pass
        deadline, clean_since = time.monotonic() + limit_s, None
        while time.monotonic() < deadline:
            self.remove_temporaries()
            try:
                names = paths.listdir(self.directory)
            except OSError:
                return
            if any(_TMP_MARK in name for name in names):
                clean_since = None
            elif clean_since is None:
                clean_since = time.monotonic()
            elif time.monotonic() - clean_since >= quiet_s:
                return
            time.sleep(0.05)

    def remove_temporaries(self) -> None:
        """Remove the temporary directories of unfinished saves (never a completed step)."""
        try:
            names = paths.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if _TMP_MARK in name:
                paths.remove_tree(os.path.join(self.directory, name))

    # -- restoring ---------------------------------------------------------------------------------------------
    def restore(self, step: int, target: dict | Callable[[dict], tuple[dict, Callable]], *,
                partial: bool = False) -> tuple[dict, dict]:
        """``(state, meta)`` of checkpoint ``step``: the state restored into ``target`` (a tree of
        ``jax.ShapeDtypeStruct`` with shardings: arrays come back already placed, resharded if the mesh changed)
        and verified against its stored checksums.

        ``target`` may instead be a function of the checkpoint's meta record returning ``(the tree the checkpoint
        was saved as, a function of that state -> the state wanted)``: how a state saved in another layout (scanned
        or unscanned layers) is read. The saved tree is what is verified; the conversion runs after.

        ``partial``: ``target`` names only some of the saved state's top-level entries (a reader's
        ``{"params": ...}``): only their arrays are read from disk, and every saved checksum under those entries is
        checked (the others, e.g. the optimiser's moments, are neither read nor checked). Raises DamagedCheckpoint."""
        _quiet_orphaned_reads()
        meta = self.read_meta(step)
        convert = None
        if callable(target):
            target, convert = target(meta)
        if partial:  # orbax reads only the leaves named in the item; StandardRestore insists on the whole tree
            args = {"state": ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                                    restore_args=ocp.checkpoint_utils.construct_restore_args(target))}
        else:
            args = {"state": ocp.args.StandardRestore(target)}
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(**args))["state"]
        except Exception as e:  # noqa: BLE001 - truncated / missing files surface as many exception types
            raise DamagedCheckpoint(f"its arrays cannot be read ({_first_line(e)})") from e
        got = leaf_checksums(state)
        saved = meta["checksums"]
        if partial:  # every saved leaf under the entries asked for; a leaf of them missing from `got` is bad
            entries = tuple(jax.tree_util.keystr((jax.tree_util.DictKey(k),)) for k in target)
            saved = {k: v for k, v in saved.items() if k.startswith(entries)}
        bad = sorted(k for k in saved if got.get(k) != saved[k])
        missing = sorted(set(got) - set(saved))
        if bad or missing:
            names = bad or missing
            raise DamagedCheckpoint(f"{len(names)} array(s) differ from their saved checksums, e.g. {names[0]}")
        return (state if convert is None else convert(state)), meta

    def restore_newest_intact(self, target: dict | Callable[[dict], tuple[dict, Callable]],
                              on_damaged: Callable[[int, str], None] | None = None, *,
                              partial: bool = False) -> tuple[int, dict, dict] | None:
        """``(step, state, meta)`` of the newest checkpoint that restores and verifies, or None when there is no
        checkpoint at all. Each damaged newer step is reported with a one-line warning on stderr and passed to
        ``on_damaged(step, reason)``. ``partial``: as in :meth:`restore`. Raises UserError when every checkpoint is
        damaged."""
        steps = self.all_steps()
        reasons = []
        for step in reversed(steps):
            try:
                state, meta = self.restore(step, target, partial=partial)
            except DamagedCheckpoint as e:
                reasons.append(f"step {step}: {e}")
                older = [s for s in steps if s < step]
                if jax.process_index() == 0:
                    print(f"warning: checkpoint step {step} in {self.directory} is damaged ({e}); "
                          f"{'trying step ' + str(max(older)) if older else 'no older checkpoint'}",
                          file=sys.stderr, flush=True)
                if on_damaged is not None:
                    on_damaged(step, str(e))
                continue
            return step, state, meta
        if reasons:
            raise UserError(f"no intact checkpoint in {self.directory} ({'; '.join(reasons)}); restore the files "
                            f"or start a new run in another --workdir")
        return None

    def legacy_data_position(self, step: int) -> int | None:
        """The data position that an older version saved with checkpoint ``step`` (its grain iterator's
        ``next_index``, one file per process, all equal), or None when the checkpoint holds none (this version's).
        Raises UserError when the files disagree with each other or are unreadable: the position would be unknown."""
        folder = epath.Path(self.directory) / str(step) / LEGACY_DATA_ITEM
        if not folder.is_dir():
            return None
        positions = {}
        for path in sorted(folder.glob("process_*-of-*.json")):
            try:
                positions[path.name] = int(json.loads(path.read_text())["next_index"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise UserError(f"checkpoint step {step} in {self.directory}: its data iterator state {path} cannot "
                                f"be read ({_first_line(e)}); restore the file or resume from another step") from None
        if len(set(positions.values())) != 1:
            raise UserError(f"checkpoint step {step} in {self.directory}: its per-process data iterator states "
                            f"disagree or are missing ({positions or 'no process_*.json'}); restore the files or "
                            f"resume from another step")
        return positions.popitem()[1]

    def drop_unverified(self, step: int) -> int | None:
        """After a non-finite loss at ``step + 1``: the params saved at ``step`` produced it (a loss is computed
        with the previous step's params), so that checkpoint is not good. Delete it when an older one exists, so
        that a resume starts from a verified checkpoint; return the step of the last good one."""
        steps = self.all_steps()
        if step in steps and len(steps) > 1:
            self.manager.delete(step)
            steps.remove(step)
        return max(steps) if steps else None

    def reached_preemption(self, step: int) -> bool:
        """True when the multi-host preemption service (jax.distributed) signalled a preemption at ``step``."""
        return jax.process_count() > 1 and self.manager.reached_preemption(step)

    def close(self) -> None:
        self.manager.close()


def abstract_target(state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the shardings to restore into (no device memory is touched)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
