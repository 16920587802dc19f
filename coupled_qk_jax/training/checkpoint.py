"""Checkpoints: one orbax CheckpointManager per workdir holding the train state, the data iterator and the config.

Layout (``WORKDIR/checkpoints``)::

    <step>/state/    params, opt_state, step   (orbax StandardSave: sharded arrays, restored into given shardings)
    <step>/data/     process_<i>-of-<n>.json   (grain iterator state, one file per host)
    <step>/config/   the run's ConfigDict as JSON

orbax writes each step into a temporary directory and renames it when every item is complete, so a crash (even
SIGKILL) during a save leaves the previous checkpoints untouched and the half-written one invisible; leftover
temporary directories are removed when the manager is opened again.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

import grain

from coupled_qk_jax.errors import UserError

ITEMS = ("state", "data", "config")


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions...): the run stops; the message names the cause and
    the last good checkpoint."""


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` that knows this project's three items.

    Args:
      directory: where the step directories go; made absolute (orbax refuses relative paths, and with async saving
        it would only say so from a background thread).
      keep_last: keep the latest ``keep_last`` checkpoints.
      keep_every: also keep every checkpoint whose step is a multiple of this (0 = off).
      async_save: write array data in a background thread; ``save`` returns after the device-to-host copy, so the
        caller may donate / overwrite the saved arrays right away.
    """

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 2, keep_every: int = 0,
                 async_save: bool = True) -> None:
        if keep_last < 1:
            raise UserError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        if keep_every < 0:
            raise UserError(f"checkpoint.keep_every must be >= 0, got {keep_every}")
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        keep: list[Any] = [policies.LatestN(n=keep_last)]
        if keep_every:
            keep.append(policies.EveryNSteps(interval_steps=keep_every))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=policies.AnyPreservationPolicy(keep) if len(keep) > 1 else keep[0],
            cleanup_tmp_directories=True,  # a save interrupted by SIGKILL leaves a tmp dir: drop it on reopen
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    def latest_step(self) -> int | None:
        """The newest *completed* checkpoint's step (unfinished saves are not listed)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def saved_config(self, step: int) -> dict[str, Any]:
        """The config dict stored with checkpoint ``step`` (no arrays are read)."""
        out = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return dict(out["config"])

    def save(self, step: int, state: dict, data_iter: grain.DatasetIterator, config: dict[str, Any]) -> None:
        """Saves all three items under ``step`` (forced: our loop decides when to save)."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            config=ocp.args.JsonSave(config)), force=True)

    def restore(self, step: int, target: dict, data_iter: grain.DatasetIterator | None = None) -> dict:
        """Restores the train state into ``target`` (a tree of ``jax.ShapeDtypeStruct`` with shardings: arrays come
        back already placed, resharded if the mesh changed) and, if given, the data iterator in place."""
        args = {"state": ocp.args.StandardRestore(target)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return out["state"]

    def drop_unverified(self, step: int) -> int | None:
        """After a non-finite loss at ``step + 1``: the params saved at ``step`` produced it (a loss is computed
        with the previous step's params), so that checkpoint is not good. Delete it when an older one exists, so
        that a resume starts from a verified checkpoint; return the step of the last good one."""
        steps = self.all_steps()
        if step in steps and len(steps) > 1:
            self.manager.delete(step)
            steps.remove(step)
        return max(steps) if steps else None

    def wait(self) -> None:
        """Blocks until a pending async save is on disk (and renamed into place)."""
        self.manager.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        """True when the multi-host preemption service (jax.distributed) signalled a preemption at ``step``."""
        return jax.process_count() > 1 and self.manager.reached_preemption(step)

    def close(self) -> None:
        self.manager.close()


def abstract_target(state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the shardings to restore into (no device memory is touched)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
