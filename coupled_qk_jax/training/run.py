"""One way to open a saved run, on any machine, from any later version of this code.

    run = Run.open("runs/ce_tiny")                  # one device; Run.open(DIR, mesh="data:2") for a mesh
    run.steps                                      # [3, 6]: the completed checkpoints, oldest first
    model = run.model()                            # replica 0 of the newest intact checkpoint (a TransformerLM)
    params = run.params(step=3, replica=1)         # seed 1 of a seed-parallel run, as saved at step 3
    result = run.evaluate("validation", replica="all")

Everything comes from the run directory: config.json (upgraded to this version's schema: rundir.upgrade_config),
data.json, tokenizer.json, heldout/ and checkpoints/; no corpus, no token cache. Only the parameters are read from
a checkpoint (never the optimiser's moments, twice their size with AdamW), verified against the checksums saved with
them, onto the mesh the caller gives (default: one device), in its shardings, whatever mesh trained it: none of the
training-only rules (a batch size divisible by the devices, the run's own mesh sizes) apply. A reader started on
several processes (after ``distributed.initialize_distributed``) reads onto a mesh over every process's devices
(``layout.reader_mesh``). A replica is one seed of a seed-parallel run (``train.num_seeds``); a single run has one,
replica 0. Nothing in the run directory is written. eval.py, sample.py, export.py, the diagnostics report, the sweep reports
and the qkov bridge all read runs through this class; training builds the same shapes with the same
``layout.state_layout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as std_logging
import math
import os
import time
from typing import Any, Iterator, Mapping

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from coupled_qk_jax import paths
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import rundir, tasks
from coupled_qk_jax.training.checkpoint import Checkpointer, DamagedCheckpoint
from coupled_qk_jax.training.config import RunConfig
from coupled_qk_jax.training.layout import StateLayout, reader_mesh, restore_target, state_layout
from coupled_qk_jax.training.writers import summary_metrics

CHECKPOINTS = "checkpoints"


# --------------------------------------------------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------------------------------------------------


class _QuietReadOnly(std_logging.Filter):
    """orbax warns that a read-only manager's directory is read only: true, asked for, and nothing a user can act on."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return "is read only" not in record.getMessage() and "read_only=True" not in record.getMessage()


@contextlib.contextmanager
def _checkpointer(directory: str) -> Iterator[Checkpointer]:
    quiet = _QuietReadOnly()
    logger = std_logging.getLogger("absl")
    logger.addFilter(quiet)
    try:
        ck = Checkpointer(directory, async_save=False, read_only=True)
    finally:
        logger.removeFilter(quiet)
    try:
        yield ck
    finally:
        ck.close()


@dataclasses.dataclass
class Run:
    """A run directory opened for reading: see the module docstring. Build it with :meth:`Run.open`."""

    workdir: str
    cfg: ml_collections.ConfigDict  # the run's config, upgraded to this version's schema
    config: RunConfig  # the same, typed
    mcfg: ModelConfig
    mesh: Mesh  # where its arrays are restored
    data: Any  # rundir.RunData (LM: tokenizer, held-out splits) or None (MQAR: generated data)
    fingerprint: dict[str, Any]  # data.json
    seeds: list[int]  # one per replica
    layout: StateLayout
    steps: list[int]  # the completed checkpoints' steps, oldest first
    notes: list[str]  # what upgrading config.json to this version's schema did (one line each)
    _restored: tuple[int | None, int, dict] | None = None  # (the step asked for, the step restored, the state)

    @classmethod
    def open(cls, workdir: str | os.PathLike[str], *, mesh: str | Mapping[str, int] | Mesh | None = None,
             config: ml_collections.ConfigDict | None = None, runtime: Mapping[str, Any] | None = None,
             report: bool = True) -> "Run":
        """Open ``workdir`` (a train.py run directory). ``config``, when given, must agree with the run in every
        field that changes what is evaluated (rundir.check_eval_config); its ``runtime`` block is how the model is
        computed here. ``runtime``: fields of that block to use (e.g. ``{"attention_impl": "explicit"}``), over
        both; the checkpoints are read in whichever layer layout they were saved and converted. With ``report`` the
        upgrade and runtime notes are printed once, on stderr. Raises UserError (not a run directory, a removed field set to a non-default
        value, a damaged tokenizer or split)."""
        workdir = paths.resolve(workdir)  # a local path made absolute; a gs:// URL as given
        saved = rundir.run_config(workdir)
        if saved is None:
            raise UserError(f"{workdir} is not a run directory (no {rundir.CONFIG}): train first, "
                            f"python train.py --config=... --workdir={workdir}")
        upgraded, notes = rundir.upgrade_config(saved)
        if config is not None:
            notes += rundir.check_eval_config(upgraded, config.to_dict(), workdir)
            runtime = {**rundir.upgrade_config(config.to_dict())[0].get("runtime", {}), **(runtime or {})}
        if runtime:  # how to compute the run's model here: any values, one note per change
            wanted = {**upgraded, "runtime": {**upgraded["runtime"], **runtime}}
            notes += rundir.runtime_notes(upgraded, wanted)
            upgraded = wanted
        cfg = ml_collections.ConfigDict(upgraded)
        typed = RunConfig.from_configdict(cfg)
        mcfg, seeds = typed.model, typed.train.seeds
        data = rundir.RunData(workdir) if tasks.task_class(typed.task).uses_corpus else None
        fingerprint = data.fingerprint if data is not None else rundir.read_json(os.path.join(workdir,
                                                                                              rundir.DATA)) or {}
        mesh = reader_mesh(mesh)
        with _checkpointer(os.path.join(workdir, CHECKPOINTS)) as ck:
            steps = ck.all_steps()
        if report and jax.process_index() == 0:  # one copy of each note, however many processes read
            import sys  # noqa: PLC0415

            for note in notes:
                print(f"note: {note}", file=sys.stderr, flush=True)
        return cls(workdir, cfg, typed, mcfg, mesh, data, fingerprint, seeds,
                   state_layout(mcfg, typed.train, seeds, mesh, runtime=typed.runtime), steps, notes)

    # -- what the run is ---------------------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return len(self.seeds)

    @property
    def tokenizer(self) -> Any:
        """The run's tokenizer (an LM run's BPE or byte tokenizer; None for MQAR)."""
        return self.data.tokenizer if self.data is not None else None

    @property
    def graphdef(self) -> Any:
        return self.layout.graphdef

    def check_replica(self, replica: int) -> int:
        if isinstance(replica, bool) or not isinstance(replica, (int, np.integer)) \
                or not 0 <= replica < self.num_replicas:
            raise UserError(f"--replica={replica}: the run has {self.num_replicas} seed replica(s), "
                            f"0..{self.num_replicas - 1} (seeds {self.seeds})")
        return int(replica)

    # -- restoring ---------------------------------------------------------------------------------------------
    def state(self, step: int | None = None) -> tuple[int, dict]:
        """``(step, {"params": params})`` of checkpoint ``step`` (default: the newest intact one, older ones tried
        after a one-line warning per damaged step), every replica (a leading seed axis [S, ...] when S > 1), in this
        run's mesh. Only the parameters are read and verified: the optimiser's state and the step counter are not
        (see the module docstring). The last restore is kept."""
        if self._restored is not None and step in (self._restored[0], self._restored[1]):
            return self._restored[1], self._restored[2]
        run = self.config
        target = restore_target(self.layout.abstract_state, self.layout.shardings, run.model, run.runtime, run.train,
                                self.seeds, self.mesh, ("params",))
        directory = os.path.join(self.workdir, CHECKPOINTS)
        with _checkpointer(directory) as ck:
            if step is None:
                found = ck.restore_newest_intact(target, partial=True)
                if found is None:
                    raise UserError(f"no completed checkpoint in {directory}: train first")
                at, state, _ = found
            else:
                if step not in self.steps:
                    raise UserError(f"--step={step}: {directory} has checkpoints at steps "
                                    f"{', '.join(map(str, self.steps)) or 'none'}")
                try:
                    state, _ = ck.restore(step, target, partial=True)
                except DamagedCheckpoint as e:
                    raise UserError(f"checkpoint step {step} in {directory} is damaged ({e}); choose another "
                                    f"--step of {', '.join(str(s) for s in self.steps if s != step)}") from None
                at = step
        self._restored = (step, int(at), state)
        return int(at), state

    def params(self, step: int | None = None, replica: int | None = 0) -> Any:
        """One replica's params (the tree ``nnx.to_pure_dict`` of the model gives), or with ``replica=None`` every
        replica's (a leading seed axis when the run has several), on this run's mesh."""
        _, state = self.state(step)
        if replica is None or self.num_replicas == 1:
            if replica is not None:
                self.check_replica(replica)
            return state["params"]
        r = self.check_replica(replica)
        return jax.tree.map(lambda x, sh: jax.device_put(x[r], sh), state["params"], self.layout.param_shardings)

    def model(self, step: int | None = None, replica: int = 0) -> TransformerLM:
        """The model of one replica of checkpoint ``step`` (default: the newest intact one)."""
        return nnx.merge(self.layout.graphdef, self.params(step, replica))

    # -- evaluating --------------------------------------------------------------------------------------------
    def task(self) -> tasks.Task:
        """The run's task (tasks.make_task; a corpus task on the run's held-out splits) for this mesh. An eval
        batch size the mesh's data-parallel devices do not divide is rounded up to a multiple of them: every token
        (example) is still scored once, and only float32 summation order within a batch changes."""
        devices = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        run = self.config
        rows = tasks.task_class(run.task).eval_batch_rows(run.train)
        if rows % devices:
            run = dataclasses.replace(run, train=dataclasses.replace(
                run.train, eval_batch_size=math.ceil(rows / devices) * devices))
        return tasks.make_task(run, devices, self.workdir, self.data)

    def write_glue_predictions(self, out_dir: str, step: int | None = None, replica: int = 0) -> list[str]:
        """A GLUE run's submission files (GLUE's format, one per test split) from one replica of checkpoint
        ``step`` (default: the newest intact one), written to ``out_dir`` by process 0; returns their paths."""
        if not hasattr(tasks.task_class(self.config.task), "write_test_predictions"):
            raise UserError(f"{self.workdir} is a {self.config.task} run; test predictions are written for GLUE runs")
        at, _ = self.state(step)
        task = self.task()
        return task.write_test_predictions(self.layout.graphdef, self.layout.param_shardings, self.mesh,
                                           self.params(at, self.check_replica(replica)), out_dir)

    def evaluate(self, split: str = "validation", step: int | None = None,
                 replica: int | str = "all") -> dict[str, Any]:
        """Score checkpoint ``step`` on a whole held-out split (every token once). ``replica``: one replica, or
        "all" (the seed axis evaluated in one program; ``name/seeds`` and ``name/std`` with several seeds).
        LM keys: ``loss``, ``ppl``, ``tokens``; MQAR: its metrics. Writes nothing."""
        if split not in rundir.HELD_OUT_SPLITS:
            raise UserError(f"--split must be 'validation' or 'test', got {split!r}")
        t_start = time.time()
        at, _ = self.state(step)
        if replica == "all":
            params, seeds, shardings = self.params(at, None), self.seeds, self.layout.shardings["params"]
        else:
            r = self.check_replica(replica)
            params, seeds, shardings = self.params(at, r), [self.seeds[r]], self.layout.param_shardings
        task = self.task()
        result = task.make_evaluator(self.layout.graphdef, shardings, self.mesh, len(seeds))(params, split=split)
        metrics = {(k[4:] if k.startswith("val_") else k): v for k, v in result.items()}
        return {"split": split, "step": at, **summary_metrics(metrics, len(seeds)), "task": task.name,
                "variant": self.mcfg.variant, "n_params": self.layout.n_params, "seeds": list(seeds),
                **({} if replica == "all" else {"replica": int(replica)}),
                "seq_len": int(self.cfg.data.seq_len),
                "tokens_seen": at * int(self.cfg.train.batch_size) * int(self.cfg.data.seq_len),
                "workdir": self.workdir, "devices": int(self.mesh.size), "mesh": dict(self.mesh.shape),
                "wall_seconds": round(time.time() - t_start, 3)}
