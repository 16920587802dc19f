"""The training loop: config -> data -> model -> sharded jit step -> checkpoints, logs and evaluation.

Read top to bottom it is nanoGPT's loop with three additions: the state lives on a device mesh, everything needed to
continue (params, optimiser state, step, data-iterator position, config) is checkpointed together, and nothing in a
step depends on process history. The dropout key of step s is ``fold_in(fold_in(key(seed), 1), s)``, the data order
is the grain iterator's checkpointed position, and the learning rate is a function of the step in the optimiser
state, so 2N steps in one go and N steps + resume + N steps give bitwise identical params and losses.

What is trained and how it is scored is the task plug-in (``training/tasks.py``, ``cfg.task``: language modelling,
MQAR or GLUE): a data source and an evaluator, asked (never named) wherever tasks differ. Seeds are an axis of the
loop: with ``train.num_seeds = S > 1`` the train state has a leading seed axis holding seeds ``train.seed, ...,
train.seed + S - 1``, each initialised, fed and keyed exactly as the single run with that seed, and the step is
``jax.vmap``-ed over it (one compiled program, one checkpoint holding every seed). The seed axis is replicated over the mesh; each seed's batch and params are split
over the mesh exactly as a single run's (docs/experiments.md). A single run (S = 1) has no seed axis.

The config is checked once, at :func:`train` / :func:`setup`: the ConfigDict becomes a typed ``RunConfig``
(training/config.py) that everything below reads; the ConfigDict itself is what config.json and every checkpoint
record. The loop body drives small pieces that each keep their own state (training/loop_parts.py): the cadence of
log / evaluation / sync steps, the training-loss window, the save policy and the throughput meter.

The run directory (training/rundir.py) is the source of truth: a first start records the resolved config, the data
fingerprint, the tokenizer and the held-out splits in it; every later start checks the config and the data against
them before anything is tokenised or trained, and evaluation needs nothing but the run directory.

Public entry point: :func:`train` (used by train.py, the main job and the sweeps). Saved runs are read (evaluated,
sampled, exported, diagnosed) through training/run.py's :class:`Run`; both build the mesh, the optimiser and the
state's shapes with training/layout.py, once per start.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from coupled_qk_jax import paths
from coupled_qk_jax import sharding as shd
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.data.prepared import open_tokens
from coupled_qk_jax.data.token_cache import (
    TokenCache, data_fingerprint, find_token_cache, shared_token_cache, source_contents, tokenizer_sha256)
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.export import initial_tensors, param_name
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import observe
from coupled_qk_jax.training import optimizer as opt_lib
from coupled_qk_jax.training import loop_parts, rundir, tasks
from coupled_qk_jax.training.checkpoint import Checkpointer
from coupled_qk_jax.training.config import RunConfig
from coupled_qk_jax.training.early_stop import EarlyStop
from coupled_qk_jax.training.layout import make_mesh, restore_target, state_layout
from coupled_qk_jax.training.loop_parts import (
    Cadence, LossWindow, SavePolicy, ThroughputMeter, first_nonfinite)
from coupled_qk_jax.training.steps import init_train_state, make_train_step, split_model
from coupled_qk_jax.training.writers import MetricsWriter, per_seed, read_metrics, summary_metrics

# Set by the SIGINT/SIGTERM handler (to the signal's number); the loop checks it at every step boundary, saves,
# writes the summary and returns with status "interrupted".
_STOP_SIGNAL: list[int] = []


def stop_signal() -> int | None:
    """The number of the SIGINT/SIGTERM that asked this process to stop, or None. Drivers that run several trainings
    (experiments/sweep.py, main_job.py) exit 128 + it, as train.py does, so a script can tell stopped from finished."""
    return _STOP_SIGNAL[0] if _STOP_SIGNAL else None


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the message names the step and the last good checkpoint."""


def install_stop_handlers() -> None:
    """SIGINT (Ctrl-C) and SIGTERM (preemption, `kill`) -> finish the current step, save a checkpoint, write the
    summary; train.py then exits 128 + the signal number (130, 143). A second signal while saving is ignored, so
    a repeated Ctrl-C cannot tear the save. Main thread only.

    Single-process runs only: under jax.distributed the preemption service owns SIGTERM and the loop asks orbax's
    ``reached_preemption`` instead (every process must stop at the same step, or their collective save deadlocks).
    """

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        if not _STOP_SIGNAL:
            _STOP_SIGNAL.append(signum)

    if jax.process_count() > 1:
        return
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


# --------------------------------------------------------------------------------------------------------------------
# Set-up: validated config, data, model, shardings.
# --------------------------------------------------------------------------------------------------------------------


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
    """The validated model block of a ConfigDict; ModelConfig's validation errors are the user's config mistakes."""
    try:
        return ModelConfig.from_dict(cfg.model.to_dict())
    except ValueError as e:  # raised only by ModelConfig's own field checks
        raise UserError(str(e)) from None


def load_data(run: RunConfig, *, run_tokenizer: str | None = None, tokenizer_sha: str | None = None) -> TokenCache:
    """Tokenise the corpus once into the cache (or reuse it) and check its vocabulary against the model's.

    On a resume (``tokenizer_sha``, the run's recorded tokenizer hash) the cache entry of these settings is reused
    only if it holds the run's tokenizer; otherwise the corpus is tokenised with the run's own copy
    (``run_tokenizer``), so a BPE is never silently retrained under a run.

    A ``tokens:DIR`` corpus (token ids prepared by ``python -m coupled_qk_jax.data.prepare``, or a nanoGPT folder) is
    opened where it is: no process tokenises, and there is no collective to wait on (every process opens it alone)."""
    data, vocab_size = run.data, run.model.vocab_size
    if paths.is_remote(data.cache_dir):  # its entries are memory-mapped: they must be on this host's disk
        raise UserError(f"data.cache_dir={data.cache_dir}: the token cache must be a local directory (a gs:// "
                        f"workdir is fine)")
    spec, cache_dir = data.corpus_spec(), os.path.expanduser(data.cache_dir)
    if spec.kind == "tokens":
        if data.max_bytes or data.fractions is not None:
            raise UserError(f"data.max_bytes and data.split_fractions do not apply to {spec}: its splits were fixed "
                            "when it was prepared (python -m coupled_qk_jax.data.prepare --max_bytes, "
                            "--split_fractions)")
        # Sizes only: start-up must not grow with the corpus (every host would read all of it); the prepare job,
        # run again on the directory, checks every shard's SHA-256 and rewrites a damaged one.
        cache: Any = open_tokens(spec.path or "", vocab_size=vocab_size, verify=False)
        if cache.vocab_size > vocab_size:
            raise UserError(f"vocab mismatch: {spec} has vocab {cache.vocab_size}, more than model.vocab_size "
                            f"{vocab_size}")
        return cache
    kwargs: dict[str, Any] = dict(tokenizer=data.tokenizer, vocab_size=vocab_size,
                                  tokenizer_path=data.tokenizer_path or None)
    cache = None
    if tokenizer_sha is not None:
        cache = find_token_cache(spec, cache_dir, **kwargs)
        if cache is not None and tokenizer_sha256(cache) != tokenizer_sha:
            cache = None
        if cache is None and run_tokenizer is not None:
            kwargs["tokenizer_path"] = run_tokenizer
    # Every process calls it (process 0 tokenises, the others wait and read); one that found its entry above only
    # joins the barriers.
    cache = shared_token_cache(spec, cache_dir, found=cache, **kwargs)
    if cache.vocab_size > vocab_size:  # smaller is fine: the model's extra ids are padding, never in the data
        raise UserError(f"vocab mismatch: the token cache {cache.directory.name} has vocab {cache.vocab_size}, "
                        f"more than model.vocab_size {vocab_size}")
    return cache


def prepare_data(run: RunConfig, config_json: dict[str, Any], workdir: str,
                 allow_change: tuple[str, ...] = ()) -> tuple[TokenCache | None, dict[str, Any], dict[str, Any]]:
    """The run directory's checks, before anything is trained: ``(cache, data fingerprint, allowed changes)``.

    A first start records the data (fingerprint, tokenizer, held-out splits) in the run directory. A resume refuses
    a config (``config_json``, the ConfigDict's JSON form) that differs from config.json (rundir.resume_changes)
    before reading the corpus, refuses corpus files that differ from data.json before tokenising them, and refuses
    any other data difference (tokenizer, token counts and hashes) after."""
    saved_cfg = rundir.run_config(workdir)
    changes = rundir.resume_changes(saved_cfg, config_json, allow_change, workdir) if saved_cfg else {}
    if saved_cfg and jax.process_index() == 0:  # a run started by an older version: what reading it assumed; and
        # what this start computes differently (the runtime block may change freely)
        for note in rundir.upgrade_config(saved_cfg)[1] + rundir.runtime_notes(saved_cfg, config_json):
            print(f"note: {note}", file=sys.stderr, flush=True)
    saved = rundir.read_json(os.path.join(workdir, rundir.DATA))
    task = tasks.task_class(run.task)
    if not task.uses_corpus:  # generated data (MQAR) or GLUE's files: named by the config, which is checked above
        if saved is not None:  # what the first start recorded, and what its checkpoints hold
            return None, saved, changes
        fingerprint = {"task": run.task}
        if jax.process_index() == 0:
            fingerprint.update(task.record_data(run, workdir))
            rundir.write_json(os.path.join(workdir, rundir.DATA), fingerprint)
        return None, fingerprint, changes
    spec = run.data.corpus_spec()
    sources = source_contents(spec)
    if saved is not None:
        rundir.refuse_other_data(workdir, rundir.source_differences(saved["sources"], sources))
    cache = load_data(run, run_tokenizer=rundir.run_tokenizer_path(workdir),
                      tokenizer_sha=saved["tokenizer"]["sha256"] if saved is not None else None)
    fingerprint = data_fingerprint(spec, cache, sources)
    if saved is not None:
        rundir.refuse_other_data(workdir, rundir.fingerprint_differences(saved, fingerprint))
    elif jax.process_index() == 0:
        rundir.save_run_data(workdir, cache, fingerprint)
    return cache, fingerprint, changes


@dataclasses.dataclass
class Setup:
    """Everything the loop and the evaluator share. Nothing here holds device memory: the state is abstract."""

    config: RunConfig
    mesh: jax.sharding.Mesh
    cache: Any  # a corpus task's TokenCache (training) or the run directory's rundir.RunData (evaluation), else None
    task: tasks.Task  # the data source and the evaluator
    seeds: list[int]  # one per replica; a leading seed axis on every state leaf when len(seeds) > 1
    graphdef: Any
    abstract_state: dict  # ShapeDtypeStructs of {"params", "opt_state", "step"}
    tx: Any
    shardings: dict  # NamedShardings of the train state
    n_params: int
    checkpointer: Checkpointer
    latest: int | None = None  # the restored checkpoint's step (set by whoever restores)
    # (step, old train.steps) of every --allow_change=train.steps resume (optimizer.learning_rate_schedule)
    lr_extensions: tuple[tuple[int, int], ...] = ()

    @property
    def mcfg(self) -> ModelConfig:
        return self.config.model

    def init_state(self) -> dict:
        """A fresh train state, created by one jitted function directly in its shardings (one compile instead of
        one per eager init op, and no full copy on a single device first). Seed i's params are exactly
        ``TransformerLM(mcfg, seeds[i])``'s, as in the single run with that seed."""
        mcfg, seeds, tx, runtime = self.mcfg, self.seeds, self.tx, self.config.runtime
        loaded = self._initial_tensors()

        def init(loaded):
            states = []
            for seed in seeds:
                params = split_model(TransformerLM(mcfg, seed, runtime))[1]
                if loaded:  # train.init_from: the source's tensors replace the fresh ones of the same name
                    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
                    params = treedef.unflatten([loaded.get(param_name(p), x) for p, x in leaves])
                states.append(init_train_state(params, tx))
            return states[0] if len(states) == 1 else jax.tree.map(lambda *xs: jnp.stack(xs), *states)

        return jax.jit(init, out_shardings=self.shardings)(loaded)

    def _initial_tensors(self) -> dict[str, jax.Array]:
        """train.init_from's tensors, checked against this model by name and shape and replicated on the mesh
        ({} without init_from). A source tensor this model has no place for is refused: dropping it would train
        another model than the one asked for."""
        source = self.config.train.init_from
        if not source:
            return {}
        tensors = initial_tensors(source, self.mcfg, self.config.runtime)
        abstract = jax.tree_util.tree_flatten_with_path(self.abstract_state["params"])[0]
        if len(self.seeds) > 1:  # the state's leading seed axis is not the model's
            abstract = [(p, jax.ShapeDtypeStruct(x.shape[1:], x.dtype)) for p, x in abstract]
        ours = {param_name(p): x for p, x in abstract}
        extra = sorted(set(tensors) - set(ours))
        wrong = [f"{k} {tuple(v.shape)} vs {tuple(ours[k].shape)}" for k, v in tensors.items()
                 if k in ours and tuple(v.shape) != tuple(ours[k].shape)]
        if extra or wrong:
            what = "; ".join(filter(None, [f"no parameter for {', '.join(extra[:3])}" if extra else "",
                                           f"shape {', '.join(wrong[:3])}" if wrong else ""]))
            raise UserError(f"train.init_from={source} does not fit model.*: {what}")
        fresh = sorted(set(ours) - set(tensors))
        if jax.process_index() == 0:
            print(f"init_from {source}: {len(tensors)} tensors"
                  + (f"; {len(fresh)} start fresh ({', '.join(fresh[:4])}{', ...' if len(fresh) > 4 else ''})"
                     if fresh else ""), flush=True)
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return {k: jax.make_array_from_callback(v.shape, replicated, lambda index, v=v: v[index])
                for k, v in tensors.items()}


def _checkpointer(run: RunConfig, directory: str, read_only: bool = False) -> Checkpointer:
    ck = run.checkpoint
    return Checkpointer(directory, ck.keep_last, ck.keep_every, ck.async_save, read_only=read_only,
                        keep_best=ck.keep_best)


def setup(run: RunConfig, workdir: str, cache: Any = None, *, read_only: bool = False,
          mesh: jax.sharding.Mesh | None = None) -> Setup:
    """Task, abstract model, optimiser, shardings and the checkpoint manager of ``workdir`` on ``mesh`` (default:
    ``layout.make_mesh(run)``). ``cache`` is an LM run's TokenCache or RunData (default: :func:`load_data`, for
    benchmarks); ``read_only`` for evaluation."""
    observe.enable_compilation_cache()  # before the first compile: reuse the programs of earlier runs
    mesh, mcfg = mesh if mesh is not None else make_mesh(run), run.model
    if cache is None and tasks.task_class(run.task).uses_corpus:
        cache = load_data(run)
    task = tasks.make_task(run, mesh.shape["data"] * mesh.shape["fsdp"], workdir, cache)
    seeds = run.train.seeds
    # Shapes only: the abstract model carries the logical-axis metadata that the shardings are read from.
    layout = state_layout(mcfg, run.train, seeds, mesh, runtime=run.runtime)
    checkpointer = _checkpointer(run, os.path.join(workdir, "checkpoints"), read_only)
    return Setup(run, mesh, cache, task, seeds, layout.graphdef, layout.abstract_state, layout.tx, layout.shardings,
                 layout.n_params, checkpointer)


def make_sharded_train_step(s: Setup):
    """jit(train_step) with explicit shardings; the state is donated (updated in place). With several seeds the
    single-seed step is vmapped over the leading seed axis of the state, the batch ([S, B, T]) and the seeds."""
    train = s.config.train
    step_fn = make_train_step(s.graphdef, s.tx, train.grad_accum, use_dropout=s.mcfg.dropout > 0)
    schedule = opt_lib.learning_rate_schedule(train, s.lr_extensions)

    def one_seed(state, batch, seed):
        # The key depends only on (seed, step): a resumed run draws exactly the keys of an uninterrupted one, and
        # replica i of a seed-parallel run the keys of the single run with seed i.
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), state["step"])
        new_state, metrics = step_fn(state, batch, key)
        # What the logs show beyond the loss (parameter norm, learning rate, Δt per layer and head) is computed
        # here, inside the step, so it costs no extra pass over the parameters (training/observe.py).
        return new_state, {**metrics, **observe.step_observables(new_state["params"], state["step"], schedule)}

    if len(s.seeds) == 1:
        def train_step(state, batch):
            return one_seed(state, batch, s.seeds[0])
    else:
        seeds = np.asarray(s.seeds, np.int32)

        def train_step(state, batch):
            return jax.vmap(one_seed)(state, batch, seeds)

    return shd.jit_sharded(train_step, s.mesh, s.shardings, seed_axis=len(s.seeds) > 1, donate=True)


def make_evaluator(s: Setup) -> tasks.Evaluator:
    """The task's evaluator for this run's params (seed axis included): ``(params, split, max_batches) -> dict``."""
    return s.task.make_evaluator(s.graphdef, s.shardings["params"], s.mesh, len(s.seeds))


class _StackSeeds:
    """Index -> the same element of every seed's dataset, stacked on a leading seed axis."""

    def __init__(self, datasets: list[grain.MapDataset]) -> None:
        self.datasets = datasets

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        items = [d[int(index)] for d in self.datasets]
        return {k: np.stack([item[k] for item in items]) for k in items[0]}


def make_data_iterator(s: Setup, start: int) -> grain.DatasetIterator:
    """This host's iterator of training batches from global batch ``start`` (the step a run starts or resumes at):
    the task's dataset for the run's seed, or with several seeds element i of every seed's dataset stacked
    ([S, B_host, T]), so that seed i sees exactly the single run's batches. The datasets are random access and their
    order is a pure function of the seed, so the step alone positions the stream, on any number of hosts."""
    # The rows of each global batch that this host's devices hold: processes that hold the same rows (a tensor
    # axis across hosts) load the same data, and on a TPU pod a host's rows need not be one block.
    rows = shd.host_batch_rows(s.mesh, jax.process_index(), s.config.train.batch_size)
    datasets = [s.task.train_dataset(seed, rows) for seed in s.seeds]
    ds = datasets[0] if len(datasets) == 1 else grain.MapDataset.range(len(datasets[0])).map(_StackSeeds(datasets))
    read = grain.ReadOptions(num_threads=s.config.data.num_threads, prefetch_buffer_size=8)
    return iter(ds[start:].to_iter_dataset(read))


def next_batch(s: Setup, data_iter: grain.DatasetIterator) -> dict[str, jax.Array]:
    """The next global training batch ([B, T], or [S, B, T] with several seeds) from this host's rows."""
    return shd.global_batch(next(data_iter), s.mesh, seed_axis=len(s.seeds) > 1)


def stream_spec(s: Setup) -> dict[str, Any]:
    """What fixes the run's sequence of global training batches besides the step, saved with every checkpoint: a
    resume into a stream with another spec is refused (the step would index other batches). It says nothing of the
    hosts: which rows a host reads follows from the mesh, so a run resumes on any number of them."""
    return {"task": s.task.name, **s.task.stream_spec(s.seeds[0]), "seed": list(s.seeds)}


def upgrade_stream_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's stream spec in this version's terms. Older versions recorded the rows of the saving host
    (``rows``): dropped, since a global batch is the same on any number of hosts. Single-process checkpoints from
    before host rows recorded (process_index 0, process_count 1, batch_size_per_host B): the same stream as a
    global batch of B, so they resume. A multi-process one from then is left as it is and refused: its hosts read
    interleaved windows, not rows of the global batch."""
    out = {k: v for k, v in spec.items() if k != "rows"}
    if "process_count" not in out or out["process_count"] != 1:
        return out
    out = {k: v for k, v in out.items() if k not in ("process_index", "process_count", "batch_size_per_host")}
    return {**out, "batch_size": int(spec["batch_size_per_host"])}


def _summary_base(s: Setup, workdir: str) -> dict[str, Any]:
    run = s.config
    return {"task": s.task.name, "variant": s.mcfg.variant, "scale": run.scale, "n_params": s.n_params,
            "seeds": list(s.seeds), "seq_len": run.data.seq_len, "batch_size": run.train.batch_size,
            "workdir": os.path.basename(os.path.abspath(workdir)), **s.task.summary(), "devices": jax.device_count(),
            "processes": jax.process_count(), "mesh": dict(s.mesh.shape)}


# --------------------------------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------------------------------


def train(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True, return_state: bool = False,
          allow_change: tuple[str, ...] = ()) -> dict[str, Any] | tuple[dict[str, Any], dict]:
    """Train (or resume) the run in ``workdir`` up to ``train.steps`` (or ``train.stop_after``); returns the summary.

    ``cfg`` is the run's ConfigDict: it is checked once here (:class:`RunConfig`) and recorded as config.json.
    ``allow_change`` names the :data:`rundir.CHANGEABLE_FIELDS` that may differ from the run's config on resume.
    Raises UserError (bad config / data, a run mismatch, the workdir in use, no intact checkpoint),
    NonFiniteLossError or CheckpointSaveError. Returns early, after a checkpoint, when SIGINT or SIGTERM was received
    (``summary["status"] == "interrupted"``, ``summary["signal"]``). With ``return_state`` it returns
    ``(summary, state)``, the final train state as numpy arrays (for tests).
    """
    t_start = time.time()
    run = RunConfig.from_configdict(cfg)  # every config mistake, before anything is written
    workdir = paths.resolve(workdir)  # a local path made absolute; a gs:// URL as given
    main = jax.process_index() == 0
    paths.makedirs(workdir, "workdir")
    lock = rundir.WorkdirLock(workdir) if main else None
    try:
        return _train_locked(run, rundir.jsonable(cfg.to_dict()), workdir, progress, return_state,
                             tuple(allow_change), t_start)
    finally:
        if lock is not None:
            lock.release()


def _restore_or_init(s: Setup, config_json: dict[str, Any], workdir: str,
                     fingerprint: dict[str, Any], stream: dict[str, Any]) -> tuple[dict, dict[str, Any]]:
    """(state, meta of the restored checkpoint or {}). The newest intact checkpoint is used; newer damaged ones are
    moved to WORKDIR/damaged_checkpoints (named in a warning), never deleted."""
    damaged: list[int] = []
    target = restore_target(s.abstract_state, s.shardings, s.mcfg, s.config.runtime, s.config.train, s.seeds,
                            s.mesh)
    found = s.checkpointer.restore_newest_intact(target, on_damaged=lambda step, _: damaged.append(step))
    if damaged:  # out of the manager's sight, or the resumed run would save into the damaged step's name
        s.checkpointer.close()
        if jax.process_index() == 0:
            for step in damaged:
                dest = rundir.move_damaged(s.checkpointer.directory, step)
                print(f"warning: moved the damaged checkpoint step {step} to {dest}", file=sys.stderr, flush=True)
        s.checkpointer = _checkpointer(s.config, s.checkpointer.directory)
    if found is None:
        return s.init_state(), {}
    step, state, meta = found
    # The checkpoint carries its own config, data fingerprint and stream spec: refuse one from another run.
    rundir.resume_changes(meta["config"], config_json, rundir.CHANGEABLE_FIELDS, workdir)
    rundir.refuse_other_data(workdir, rundir.fingerprint_differences(meta["data_fingerprint"], fingerprint))
    saved_stream = upgrade_stream_spec(meta.get("data_stream", {}))
    if saved_stream != stream:
        diffs = rundir.config_differences(saved_stream, stream)
        raise UserError(f"checkpoint step {step} in {s.checkpointer.directory} was trained on another stream of "
                        f"batches ({'; '.join(f'{k}: checkpoint {a!r}, now {b!r}' for k, (a, b) in diffs.items())})")
    legacy = s.checkpointer.legacy_data_position(step)
    if legacy is not None:  # an older version's per-process iterator state: it must say what the step says
        if legacy != step:
            raise UserError(f"checkpoint step {step} in {s.checkpointer.directory}: its saved data iterator stands at "
                            f"batch {legacy}, not {step}; resume from another step or start a new --workdir")
        if jax.process_index() == 0:
            print(f"note: checkpoint step {step} holds an older version's per-process data iterator state; it agrees "
                  f"with the step, which is the data position from now on", flush=True)
    s.latest = step
    if jax.process_index() == 0:
        print(f"resuming from {s.checkpointer.directory} at step {step}", flush=True)
    return state, meta


def _start(run: RunConfig, config_json: dict[str, Any], workdir: str,
           allow_change: tuple[str, ...]) -> tuple[Setup, Any, dict, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Check the run directory, set up, and restore (or initialise): ``(setup, data iterator, state, checkpoint
    meta, checkpoint extras, allowed config changes)``; the extras are what every save stores beside the state."""
    main = jax.process_index() == 0
    mesh = make_mesh(run)  # mesh mistakes before the corpus is read
    cache, fingerprint, changes = prepare_data(run, config_json, workdir, allow_change)
    s = setup(run, workdir, cache, mesh=mesh)
    if main:
        for warning in s.task.warnings():
            print(f"warning: {warning}", flush=True)
    try:
        # State: restored (arrays land directly in their shardings) or fresh; then this host's rows of the
        # seeded stream of global batches, from the state's step.
        stream = stream_spec(s)
        state, meta = _restore_or_init(s, config_json, workdir, fingerprint, stream)
        data_iter = make_data_iterator(s, int(np.asarray(state["step"]).reshape(-1)[0]))
        schedule = _extend_schedule(s, workdir, changes)
        if main:
            rundir.write_json(os.path.join(workdir, rundir.CONFIG), rundir.config_with_schema(config_json))
            rundir.record_history(workdir, "resume" if s.latest is not None else "start", step=s.latest or 0,
                                  changes={k: {"run": a, "now": b} for k, (a, b) in changes.items()},
                                  **({"schedule": schedule} if schedule else {}))
    except BaseException:
        s.checkpointer.close()
        raise
    extras = {"config": config_json, "data_fingerprint": fingerprint, "data_stream": stream}
    return s, data_iter, state, meta, extras, changes


def _extend_schedule(s: Setup, workdir: str, changes: dict[str, Any]) -> dict[str, Any] | None:
    """The learning-rate schedule of a run whose horizon was changed on resume (--allow_change=train.steps): the
    earlier extensions recorded in history.jsonl plus, when this start changes train.steps, one at the restored
    step, so the learning rate decays on from where it is instead of jumping to the new cosine's value. Sets
    ``s.tx`` / ``s.lr_extensions``; returns this start's extension (printed, and recorded in history.jsonl)."""
    extensions = rundir.lr_extensions(workdir)
    extending = "train.steps" in changes and s.latest is not None
    if extending:
        extensions.append((s.latest, int(changes["train.steps"][0])))
    if not extensions:
        return None
    train = s.config.train
    s.lr_extensions = tuple(extensions)
    # The optimiser reads only the params' paths (groups, decay mask), so the seed axis of the abstract state does
    # not matter, and its state's structure does not depend on the schedule: only the step function changes.
    s.tx = opt_lib.make_optimizer(s.abstract_state["params"], train, s.lr_extensions)
    if not extending:
        return None
    old_steps = extensions[-1][1]
    start = float(opt_lib.learning_rate_schedule(train, s.lr_extensions)(s.latest))
    floor = train.lr * train.min_lr_ratio
    if jax.process_index() == 0:
        print(f"train.steps {old_steps} -> {train.steps} at step {s.latest}: the learning rate decays by a cosine "
              f"from {start:.4g} (its value now) to {floor:.4g} at step {train.steps}", flush=True)
    return {"from_step": s.latest, "old_steps": old_steps, "new_steps": train.steps, "lr_at_from_step": start,
            "floor": floor}


def _logged_before(workdir: str, num_seeds: int) -> tuple[np.ndarray, float]:
    """The last logged training loss [S] (NaN if none) and training time of the run's earlier starts: what a
    resumed run that has nothing left to train reports, and where its training time continues from."""
    logged = [r for r in read_metrics(workdir) if "train_loss" in r]
    if not logged:
        return np.full(num_seeds, np.nan), 0.0
    last = logged[-1]
    return (np.asarray(last.get("train_loss/seeds", last["train_loss"]), np.float64).reshape(-1),
            float(last.get("train_seconds", 0.0)))


def _nonfinite_error(s: Setup, at: int, m: dict[str, Any]) -> NonFiniteLossError:
    """Stop at step ``at`` (its metrics ``m`` are not finite): drop any checkpoint newer than ``at - 1``, whose
    params gave this loss (every save follows a sync, so none should be), and name the last good one."""
    s.checkpointer.wait()
    last_saved = s.checkpointer.drop_unverified(at - 1)
    loss = np.asarray(m["loss"], np.float64).reshape(-1)
    grad_norm = np.asarray(m["grad_norm"], np.float64).reshape(-1)
    several = len(s.seeds) > 1
    bad = [seed for seed, l, g in zip(s.seeds, loss, grad_norm) if not (math.isfinite(l) and math.isfinite(g))]
    return NonFiniteLossError(
        f"non-finite loss ({loss.tolist() if several else loss[0]}) or gradient norm at step {at}"
        f"{f' (seeds {bad})' if several else ''}; stopped, the last good checkpoint is "
        f"{'step ' + str(last_saved) if last_saved is not None else 'none (no save yet)'}")


def _sync(s: Setup, pending: list[dict[str, Any]], step: int, window: LossWindow) -> dict[str, Any]:
    """Wait for the device: the host copies of the ``pending`` metrics (of the steps up to ``step``) go into the
    loss window, and the last one is returned. A non-finite loss or gradient norm stops the run at its exact step
    (every step's metrics are kept until here)."""
    host = jax.device_get(pending)
    bad = first_nonfinite(host)
    if bad is not None:
        raise _nonfinite_error(s, step - len(host) + 1 + bad, host[bad])
    for m in host:
        window.add(m["loss"])
    return host[-1] if host else {}


def _evaluate(evaluator: tasks.Evaluator, state: dict, max_batches: int, meter: ThroughputMeter) -> dict[str, Any]:
    """The evaluator's metrics of the current params (the first ``max_batches`` batches, 0 = all); its time is
    not training time."""
    t0 = time.perf_counter()
    out = evaluator(state["params"], max_batches=max_batches)
    meter.evaluated(time.perf_counter() - t0)
    return out


def _log_row(s: Setup, step: int, window: LossWindow, last: dict[str, Any], meter: ThroughputMeter,
             now: float) -> dict[str, Any]:
    """One metrics.jsonl training line: the window's mean loss, the last step's norms and learning rate, the
    window's throughput (all seeds together) and the run's training time so far."""
    run, n_seeds = s.config, len(s.seeds)
    tokens_per_step = run.train.batch_size * run.data.seq_len  # per seed
    flops_per_step = observe.model_flops_per_step(s.n_params, s.mcfg, run.train.batch_size, run.data.seq_len) \
        * n_seeds
    seconds = meter.window_seconds(now)
    row = {**per_seed({"train_loss": window.mean(), "grad_norm": last["grad_norm"],
                       "param_norm": last["param_norm"]}, n_seeds),
           "lr": float(np.ravel(last["lr"])[0]), "tokens_seen": step * tokens_per_step,
           "tokens_per_second": window.steps * tokens_per_step * n_seeds / seconds,
           "train_seconds": meter.total_seconds(now),
           # MFU: model FLOPs of a step over the step time and the devices' peak (train.peak_tflops; observe.py).
           "model_tflops_per_second": flops_per_step * window.steps / seconds / 1e12}
    util = observe.mfu(flops_per_step, window.steps, seconds, run.train.peak_tflops, jax.device_count())
    if util is not None:
        row["mfu"] = util
    if "dt" in last:
        row.update(per_seed(observe.dt_scalars(np.asarray(last["dt"])), n_seeds))
    return row


def _summary(s: Setup, workdir: str, status: str, step: int, train_loss: np.ndarray, val: dict[str, Any],
             last_saved: int | None, early: EarlyStop | None, meter: ThroughputMeter,
             t_start: float) -> dict[str, Any]:
    """summary.json: the run, where this start ended and why, its final metrics and its timings."""
    n_seeds, now = len(s.seeds), time.perf_counter()
    tokens_per_step = s.config.train.batch_size * s.config.data.seq_len  # per seed
    interrupted = {"signal": signal.Signals(_STOP_SIGNAL[0]).name, "signal_number": _STOP_SIGNAL[0]} \
        if status == "interrupted" and _STOP_SIGNAL else {}
    return {**_summary_base(s, workdir), "status": status, **interrupted, "step": step,
            "tokens_seen": step * tokens_per_step,
            **summary_metrics({"train_loss": np.asarray(train_loss, np.float64)}, n_seeds),
            **dict.fromkeys(s.task.summary_placeholders),
            **summary_metrics(val, n_seeds), "checkpoint_step": last_saved,
            **({"early_stop": early.summary()} if early is not None else {}),
            "wall_seconds": round(time.time() - t_start, 3),
            "train_seconds": round(meter.total_seconds(now), 3),
            # compilation (or a persistent-cache hit) plus one step, in this process
            "first_step_seconds": (round(meter.first_step_seconds, 3) if meter.first_step_seconds is not None
                                   else None),
            # all seeds together: the throughput of the compiled program
            "tokens_per_second": meter.tokens_per_second(tokens_per_step * n_seeds, now)}


def _train_locked(run: RunConfig, config_json: dict[str, Any], workdir: str, progress: bool, return_state: bool,
                  allow_change: tuple[str, ...], t_start: float) -> dict[str, Any] | tuple[dict[str, Any], dict]:
    main = jax.process_index() == 0
    s, data_iter, state, meta, extras, changes = _start(run, config_json, workdir, allow_change)
    n_seeds, train = len(s.seeds), run.train
    step = int(np.asarray(state["step"]).reshape(-1)[0])
    finished = rundir.read_json(os.path.join(workdir, "summary.json")) if s.latest is not None else None
    if finished is not None and finished.get("status") == "completed" and finished.get("step") == step \
            and not changes:
        # Nothing to train and the end already evaluated and logged: a rerun must not add a second final row.
        s.checkpointer.close()
        if main:
            print(f"{workdir} already finished at step {step} (summary.json); nothing to do", flush=True)
        return (finished, host_params(state)) if return_state else finished
    last_saved = s.latest
    writer = MetricsWriter(workdir, resume_step=step, seeds=s.seeds)
    train_step, evaluator = make_sharded_train_step(s), make_evaluator(s)
    profiler = observe.Profiler(workdir, train.profile_steps)
    stop_at = train.stop_at
    # train.early_stop: judged on the logged evaluations, so a resumed run first replays them (and a run that had
    # already stopped early trains no further).
    early = EarlyStop.from_config(train.early_stop, n_seeds, s.task.metric_names)
    if early is not None and early.replay(read_metrics(workdir), step):
        stop_at = step
    status = "completed" if stop_at == train.steps or (early is not None and early.done) else "stopped"

    cadence = Cadence(train.steps, train.log_every, train.eval_every)
    saves = SavePolicy(run.checkpoint.every, run.checkpoint.every_seconds, stop_at, cadence, time.monotonic(),
                       agree=loop_parts.agree_across_processes)
    window = LossWindow.from_meta(meta, n_seeds)
    train_loss, seconds_before = _logged_before(workdir, n_seeds)
    meter = ThroughputMeter(seconds_before, time.perf_counter())
    # The device metrics of the steps since the last sync: the loop waits for the device only at sync steps.
    pending: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    val: dict[str, Any] = {}
    val_at = -1  # the step val was computed at (checkpoint.keep_best ranks that step)

    from tqdm import tqdm  # local: only the CLI path needs it

    bar = tqdm(total=stop_at, initial=step, disable=not (progress and main), dynamic_ncols=True, unit="step")
    try:
        while step < stop_at:
            batch = next_batch(s, data_iter)
            profiler.before_step()
            state, metrics = train_step(state, batch)
            profiler.after_step(metrics)
            step += 1
            pending.append(metrics)
            # One process: our SIGINT/SIGTERM flag. Several: orbax's preemption sync (jax.distributed's SIGTERM
            # notice), which makes every process stop at the same step, so their collective save cannot deadlock.
            stop_requested = (bool(_STOP_SIGNAL) if jax.process_count() == 1
                              else s.checkpointer.reached_preemption(step))
            s.checkpointer.check_saved()  # a failed background save stops the run now, not at the end
            log_now, eval_now = cadence.log(step), cadence.eval(step)
            save_now = saves.due(step, stop_requested, time.monotonic())
            if meter.first_done is None or log_now or eval_now or save_now or cadence.clock(step):
                last, pending = _sync(s, pending, step, window), []
            now = time.perf_counter()
            meter.step_done(now)
            if log_now:
                train_loss, row = window.mean(), _log_row(s, step, window, last, meter, now)
                writer.write(step, row)
                bar.set_postfix(loss=f"{float(np.mean(train_loss)):.3f}", tok_s=f"{row['tokens_per_second']:,.0f}")
                window = LossWindow.empty(n_seeds)
                meter.new_window(time.perf_counter())
            bar.update(1)
            if eval_now:
                val, val_at = _evaluate(evaluator, state, train.eval_batches, meter), step
                writer.write(step, per_seed(val, n_seeds))
                if early is not None and early.update(step, val[early.metric]):
                    status, save_now = "completed", True  # the end of learning: this step is the run's last
            if save_now:
                # The open loss window travels with the checkpoint: a resumed run logs an uninterrupted one's losses.
                # A step evaluated just now is ranked by its validation loss (checkpoint.keep_best; mean over seeds).
                ranked = ({"validation_loss": float(np.mean(val[s.task.loss_metric]))} if val_at == step
                          else None)
                writer.flush()  # the metrics up to this step are as durable as the checkpoint
                s.checkpointer.save(step, state, {**extras, "train_window": window.meta()}, ranked)
                last_saved = step
                saves.saved(time.monotonic())
            if stop_requested:
                status = "interrupted"
                break
            if early is not None and early.done:
                break
        bar.close()
        _sync(s, pending, step, window)  # a no-op: the loop's last step always syncs
        if not train.log_every or window.steps:  # steps since the last log line (or logging off): report them
            train_loss = window.mean() if window.steps else train_loss
        if status != "interrupted":
            val = _evaluate(evaluator, state, 0, meter)  # the final evaluation scores every example
            if status == "completed":  # a stopped run continues later: its log must read as one uninterrupted run
                writer.write(step, per_seed(val, n_seeds))
    finally:
        profiler.stop()
        bar.close()
        try:
            s.checkpointer.wait()  # a pending async save must land (or fail loudly) before we report or exit
        finally:
            writer.close()
            s.checkpointer.close()
    summary = _summary(s, workdir, status, step, train_loss, val, last_saved, early, meter, t_start)
    if main:
        rundir.write_json(os.path.join(workdir, "summary.json"), summary)
        rundir.record_history(workdir, "end", status=status, step=step, checkpoint_step=last_saved,
                              **({"signal": summary["signal"]} if "signal" in summary else {}))
    return (summary, host_params(state)) if return_state else summary


# --------------------------------------------------------------------------------------------------------------------
# Helpers for tests and drivers. Reading a saved run (eval, sample, export, diagnostics): training/run.py.
# --------------------------------------------------------------------------------------------------------------------


def host_params(state_or_params: Any) -> Any:
    """A numpy copy of (sharded) arrays, e.g. for tests comparing runs."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state_or_params)


def seed_slice(tree: Any, index: int) -> Any:
    """Replica ``index`` of a seed-parallel state or params tree (a tree without a seed axis for the model)."""
    return jax.tree.map(lambda x: x[index], tree)
