"""The training loop: config -> data -> model -> sharded jit step -> checkpoints, logs and evaluation.

Read top to bottom it is nanoGPT's loop with three additions: the state lives on a device mesh, everything needed to
continue (params, optimiser state, step, data-iterator position, config) is checkpointed together, and nothing in a
step depends on process history. The dropout key of step s is ``fold_in(fold_in(key(seed), 1), s)``, the data order
is the grain iterator's checkpointed position, and the learning rate is a function of the step in the optimiser
state, so 2N steps in one go and N steps + resume + N steps give bitwise identical params and losses.

What is trained and how it is scored is the task plug-in (``training/tasks.py``, ``cfg.task``: language modelling or
MQAR): a data source and an evaluator. Seeds are an axis of the loop: with ``train.num_seeds = S > 1`` the train
state has a leading seed axis holding seeds ``train.seed, ..., train.seed + S - 1``, each initialised, fed and keyed
exactly as the single run with that seed, and the step is ``jax.vmap``-ed over it (one compiled program, one
checkpoint holding every seed). The seed axis is replicated over the mesh; each seed's batch and params are split
over the mesh exactly as a single run's (docs/experiments.md). A single run (S = 1) has no seed axis.

The run directory (training/rundir.py) is the source of truth: a first start records the resolved config, the data
fingerprint, the tokenizer and the held-out splits in it; every later start checks the config and the data against
them before anything is tokenised or trained, and evaluation needs nothing but the run directory.

Public entry points: :func:`train` (used by train.py and the main job), :func:`evaluate_run` (eval.py) and
:func:`restore_latest` (diagnostics, export).
"""

from __future__ import annotations

import dataclasses
import json
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
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.data.corpora import CorpusSpec
from coupled_qk_jax.data.pipeline import train_stream_spec
from coupled_qk_jax.data.token_cache import (
    TokenCache, data_fingerprint, find_token_cache, shared_token_cache, source_contents, tokenizer_sha256)
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import observe
from coupled_qk_jax.training import optimizer as opt_lib
from coupled_qk_jax.training import rundir, tasks
from coupled_qk_jax.training.early_stop import EarlyStop
from coupled_qk_jax.training.checkpoint import Checkpointer, abstract_target
from coupled_qk_jax.training.steps import init_train_state, make_train_step, split_model
from coupled_qk_jax.reporting import mean_std
from coupled_qk_jax.training.writers import MetricsWriter, read_metrics, write_json_atomic

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
# Set-up: validated config pieces, data, model, shardings.
# --------------------------------------------------------------------------------------------------------------------


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
    """The validated model block; ModelConfig's validation errors are the user's config mistakes."""
    try:
        return ModelConfig.from_dict(cfg.model.to_dict())
    except ValueError as e:  # raised only by ModelConfig's own field checks
        raise UserError(str(e)) from None


def corpus_spec(data_cfg: ml_collections.ConfigDict) -> CorpusSpec:
    """data.corpus (the data layer's string, or the JSON of a CorpusSpec dict, e.g. a mixture with per-source splits)
    plus the optional split_fractions / max_bytes overrides."""
    text = str(data_cfg.corpus).strip()
    spec = CorpusSpec.coerce(json.loads(text) if text.startswith("{") else text)
    changes: dict[str, Any] = {}
    if str(data_cfg.get("split_fractions", "")).strip():
        try:
            fractions = tuple(float(x) for x in str(data_cfg.split_fractions).split(","))
        except ValueError:
            raise UserError(f"data.split_fractions must be 'train,validation,test' numbers, "
                             f"got {data_cfg.split_fractions!r}") from None
        changes["split_fractions"] = fractions
    if int(data_cfg.get("max_bytes", 0)):
        changes["max_bytes"] = int(data_cfg.max_bytes)
    return dataclasses.replace(spec, **changes) if changes else spec


def validate(cfg: ml_collections.ConfigDict, mesh_batch_devices: int) -> ModelConfig:
    """Every check that needs no data or devices beyond the mesh size; UserError with a one-line message."""
    mcfg = model_config(cfg)
    t, b = int(cfg.data.seq_len), int(cfg.train.batch_size)
    if t < 1:
        raise UserError(f"data.seq_len must be >= 1, got {t}")
    if t > mcfg.max_len:
        raise UserError(f"data.seq_len={t} exceeds model.max_len={mcfg.max_len}")
    if int(cfg.train.steps) < 1:
        raise UserError(f"train.steps must be >= 1, got {cfg.train.steps}")
    accum = int(cfg.train.grad_accum)
    if accum < 1 or b % accum:
        raise UserError(f"train.batch_size={b} must be a positive multiple of train.grad_accum={accum}")
    if b % jax.process_count():
        raise UserError(f"train.batch_size={b} is not divisible by the {jax.process_count()} processes")
    if (b // accum) % mesh_batch_devices:
        raise UserError(f"the micro-batch train.batch_size/train.grad_accum={b // accum} is not divisible by the "
                         f"{mesh_batch_devices} data-parallel devices (mesh.data * mesh.fsdp); change the batch "
                         f"size or --config.mesh.data")
    seeds_of(cfg)  # validates train.num_seeds
    EarlyStop.from_config(cfg.train, 1, tasks.METRIC_NAMES[tasks.task_name(cfg)])  # validates train.early_stop
    for name in ("log_every", "eval_every", "eval_batches"):
        if int(cfg.train[name]) < 0:
            raise UserError(f"train.{name} must be >= 0, got {cfg.train[name]}")
    if int(cfg.checkpoint.every) < 1:
        raise UserError(f"checkpoint.every must be >= 1, got {cfg.checkpoint.every}")
    if float(cfg.checkpoint.get("every_seconds", 0)) < 0:
        raise UserError(f"checkpoint.every_seconds must be >= 0 (0 = off), got {cfg.checkpoint.every_seconds}")
    return mcfg


def seeds_of(cfg: ml_collections.ConfigDict) -> list[int]:
    """The run's seeds: ``train.seed, ..., train.seed + train.num_seeds - 1`` (replica i = the single run with the
    i-th of them)."""
    n = int(cfg.train.get("num_seeds", 1))
    if n < 1:
        raise UserError(f"train.num_seeds must be >= 1, got {n}")
    return [int(cfg.train.seed) + i for i in range(n)]


def load_data(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, *, run_tokenizer: str | None = None,
              tokenizer_sha: str | None = None) -> TokenCache:
    """Tokenise the corpus once into the cache (or reuse it) and check its vocabulary against the model's.

    On a resume (``tokenizer_sha``, the run's recorded tokenizer hash) the cache entry of these settings is reused
    only if it holds the run's tokenizer; otherwise the corpus is tokenised with the run's own copy
    (``run_tokenizer``), so a BPE is never silently retrained under a run."""
    spec, cache_dir = corpus_spec(cfg.data), os.path.expanduser(str(cfg.data.cache_dir))
    kwargs: dict[str, Any] = dict(tokenizer=str(cfg.data.tokenizer), vocab_size=mcfg.vocab_size,
                                  tokenizer_path=str(cfg.data.tokenizer_path) or None)
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
    if cache.vocab_size > mcfg.vocab_size:  # smaller is fine: the model's extra ids are padding, never in the data
        raise UserError(f"vocab mismatch: the token cache {cache.directory.name} has vocab {cache.vocab_size}, "
                        f"more than model.vocab_size {mcfg.vocab_size}")
    return cache


def prepare_data(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, workdir: str,
                 allow_change: tuple[str, ...] = ()) -> tuple[TokenCache | None, dict[str, Any], dict[str, Any]]:
    """The run directory's checks, before anything is trained: ``(cache, data fingerprint, allowed changes)``.

    A first start records the data (fingerprint, tokenizer, held-out splits) in the run directory. A resume refuses
    a config that differs from config.json (rundir.resume_changes) before reading the corpus, refuses corpus files
    that differ from data.json before tokenising them, and refuses any other data difference (tokenizer, token
    counts and hashes) after."""
    saved_cfg = rundir.run_config(workdir)
    changes = rundir.resume_changes(saved_cfg, cfg.to_dict(), allow_change, workdir) if saved_cfg else {}
    saved = rundir.read_json(os.path.join(workdir, rundir.DATA))
    if tasks.task_name(cfg) != "lm":  # generated data (MQAR): fixed by the config, which is checked above
        fingerprint = {"task": tasks.task_name(cfg)}
        if saved is None and jax.process_index() == 0:
            rundir.write_json(os.path.join(workdir, rundir.DATA), fingerprint)
        return None, fingerprint, changes
    spec = corpus_spec(cfg.data)
    sources = source_contents(spec)
    if saved is not None:
        rundir.refuse_other_data(workdir, rundir.source_differences(saved["sources"], sources))
    cache = load_data(cfg, mcfg, run_tokenizer=rundir.run_tokenizer_path(workdir),
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

    cfg: ml_collections.ConfigDict
    mcfg: ModelConfig
    mesh: jax.sharding.Mesh
    cache: Any  # an LM task's TokenCache (training) or the run directory's rundir.RunData (evaluation); None for MQAR
    task: Any  # tasks.LMTask | tasks.MQARTask: the data source and the evaluator
    seeds: list[int]  # one per replica; a leading seed axis on every state leaf when len(seeds) > 1
    graphdef: Any
    abstract_state: dict  # ShapeDtypeStructs of {"params", "opt_state", "step"}
    tx: Any
    shardings: dict  # NamedShardings of the train state
    n_params: int
    checkpointer: Checkpointer
    latest: int | None = None  # the restored checkpoint's step (set by whoever restores)

    def init_state(self) -> dict:
        """A fresh train state, created by one jitted function directly in its shardings (one compile instead of
        one per eager init op, and no full copy on a single device first). Seed i's params are exactly
        ``TransformerLM(mcfg, seeds[i])``'s, as in the single run with that seed."""
        mcfg, seeds, tx = self.mcfg, self.seeds, self.tx

        def init():
            states = [init_train_state(split_model(TransformerLM(mcfg, seed))[1], tx) for seed in seeds]
            return states[0] if len(states) == 1 else jax.tree.map(lambda *xs: jnp.stack(xs), *states)

        return jax.jit(init, out_shardings=self.shardings)()


def check_config(cfg: ml_collections.ConfigDict) -> tuple[jax.sharding.Mesh, ModelConfig]:
    """The mesh and the validated model config; every config mistake found here is a UserError."""
    try:
        shd.mesh_shape(cfg.mesh)  # the mesh block's own checks (sizes, -1) are the user's config mistakes
    except ValueError as e:
        raise UserError(str(e)) from None
    mesh = shd.make_mesh(cfg.mesh)
    return mesh, validate(cfg, mesh.shape["data"] * mesh.shape["fsdp"])


def setup(cfg: ml_collections.ConfigDict, workdir: str, cache: Any = None, *, read_only: bool = False) -> Setup:
    """Task, abstract model, optimiser, shardings and the checkpoint manager of ``workdir``. ``cache`` is an LM
    run's TokenCache or RunData (default: :func:`load_data`, for benchmarks); ``read_only`` for evaluation."""
    observe.enable_compilation_cache()  # before the first compile: reuse the programs of earlier runs
    mesh, mcfg = check_config(cfg)
    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    if tasks.task_name(cfg) == "lm":
        cache = cache if cache is not None else load_data(cfg, mcfg)
        task = tasks.LMTask(cfg, cache)
    else:
        task = tasks.MQARTask(cfg, mcfg, batch_devices)
    task.validate(batch_devices)
    seeds = seeds_of(cfg)
    # Shapes only: the abstract model carries the logical-axis metadata that the shardings are read from.
    abstract_model = nnx.eval_shape(lambda: TransformerLM(mcfg, seeds[0]))
    graphdef, abstract_params = split_model(abstract_model)
    tx = opt_lib.make_optimizer(abstract_params, cfg.train)
    abstract_state = jax.eval_shape(lambda p: init_train_state(p, tx), abstract_params)
    shardings = shd.train_state_shardings(abstract_model, tx, abstract_state, mesh)
    if len(seeds) > 1:  # the seed axis leads every leaf and is replicated: each seed is sharded as a single run
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((len(seeds),) + x.shape, x.dtype),
                                      abstract_state)
        shardings = jax.tree.map(lambda sh: NamedSharding(mesh, P(None, *sh.spec)), shardings)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))
    ck = cfg.checkpoint
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), int(ck.keep_last), int(ck.keep_every),
                                bool(ck.async_save), read_only=read_only)
    return Setup(cfg, mcfg, mesh, cache, task, seeds, graphdef, abstract_state, tx, shardings, n_params,
                 checkpointer)


def make_sharded_train_step(s: Setup):
    """jit(train_step) with explicit shardings; the state is donated (updated in place). With several seeds the
    single-seed step is vmapped over the leading seed axis of the state, the batch ([S, B, T]) and the seeds."""
    cfg = s.cfg
    step_fn = make_train_step(s.graphdef, s.tx, int(cfg.train.grad_accum), use_dropout=s.mcfg.dropout > 0)
    schedule = opt_lib.learning_rate_schedule(cfg.train)

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

    batch_sh = tasks.seed_batch_sharding(s.mesh, len(s.seeds))
    replicated = NamedSharding(s.mesh, P())
    # Traced under the mesh: the model's per-layer FSDP gathers and activation constraints (sharding.py).
    return jax.jit(shd.under_mesh(train_step, s.mesh), in_shardings=(s.shardings, {"inputs": batch_sh, "targets": batch_sh}),
                   out_shardings=(s.shardings, replicated), donate_argnums=(0,))


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


def make_data_iterator(s: Setup) -> grain.DatasetIterator:
    """This host's checkpointable iterator of training batches: the task's dataset for the run's seed, or with
    several seeds element i of every seed's dataset stacked ([S, B_host, T]), so one iterator position (one
    checkpointed state) serves every seed and seed i sees exactly the single run's batches."""
    cfg = s.cfg
    # Which rows of the global batch this host loads: usually (process_index, process_count), but processes
    # that hold the same batch rows (a tensor axis across hosts) must load the same data.
    slice_index, slice_count = shd.process_batch_slice(s.mesh, int(cfg.train.batch_size))
    datasets = [s.task.train_dataset(seed, slice_index, slice_count) for seed in s.seeds]
    ds = datasets[0] if len(datasets) == 1 else grain.MapDataset.range(len(datasets[0])).map(_StackSeeds(datasets))
    read = grain.ReadOptions(num_threads=int(cfg.data.get("num_threads", 2)), prefetch_buffer_size=8)
    return iter(ds.to_iter_dataset(read))


def stream_spec(s: Setup) -> dict[str, Any]:
    """What fixes this host's training batch stream besides its position, saved beside the iterator state: a
    restore into a stream with another spec is refused (the saved position would index other batches)."""
    cfg = s.cfg
    slice_index, slice_count = shd.process_batch_slice(s.mesh, int(cfg.train.batch_size))
    per_host = int(cfg.train.batch_size) // slice_count
    if s.task.name == "lm":
        spec = train_stream_spec(s.cache.tokens("train"), int(cfg.data.seq_len), per_host, s.seeds[0], slice_index,
                                 slice_count, bos_id=s.cache.eot_id)
    else:
        spec = {"batches_per_epoch": len(s.task.train), "batch_size_per_host": per_host,
                "process_index": slice_index, "process_count": slice_count}
    return {"task": s.task.name, **spec, "seed": list(s.seeds)}


def per_seed(metrics: dict[str, Any], num_seeds: int) -> dict[str, Any]:
    """Per-seed arrays [S] -> the metrics.jsonl / summary form: ``name`` = the mean over seeds (the value itself for
    a single run) and, with several seeds, ``name/seeds`` = the list in seed order. Other values pass through."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, np.ndarray):
            out[k] = float(np.mean(v))
            if num_seeds > 1:
                out[f"{k}/seeds"] = [float(x) for x in v]
        else:
            out[k] = v
    return out


def _summary_base(s: Setup, workdir: str) -> dict[str, Any]:
    cfg = s.cfg
    return {"task": s.task.name, "variant": s.mcfg.variant, "scale": str(cfg.get("scale", "")),
            "n_params": s.n_params, "seeds": list(s.seeds), "seq_len": int(cfg.data.seq_len),
            "batch_size": int(cfg.train.batch_size), "workdir": os.path.basename(os.path.abspath(workdir)),
            **s.task.summary(), "devices": jax.device_count(), "processes": jax.process_count(),
            "mesh": dict(s.mesh.shape)}


# --------------------------------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------------------------------


def train(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True, return_state: bool = False,
          allow_change: tuple[str, ...] = ()) -> dict[str, Any] | tuple[dict[str, Any], dict]:
    """Train (or resume) the run in ``workdir`` up to ``train.steps`` (or ``train.stop_after``); returns the summary.

    ``allow_change`` names the :data:`rundir.CHANGEABLE_FIELDS` that may differ from the run's config on resume.
    Raises UserError (bad config / data, a run mismatch, the workdir in use, no intact checkpoint),
    NonFiniteLossError or CheckpointSaveError. Returns early, after a checkpoint, when SIGINT or SIGTERM was received
    (``summary["status"] == "interrupted"``, ``summary["signal"]``). With ``return_state`` it returns
    ``(summary, state)``, the final train state as numpy arrays (for tests).
    """
    t_start = time.time()
    workdir = os.path.abspath(workdir)
    main = jax.process_index() == 0
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create workdir {workdir}: {e.strerror or e}") from None
    lock = rundir.WorkdirLock(workdir) if main else None
    try:
        return _train_locked(cfg, workdir, progress, return_state, tuple(allow_change), t_start)
    finally:
        if lock is not None:
            lock.release()


def _restore_or_init(s: Setup, data_iter: Any, cfg: ml_collections.ConfigDict, workdir: str,
                     fingerprint: dict[str, Any], stream: dict[str, Any]) -> tuple[dict, dict[str, Any]]:
    """(state, meta of the restored checkpoint or {}). The newest intact checkpoint is used; newer damaged ones are
    moved to WORKDIR/damaged_checkpoints (named in a warning), never deleted."""
    damaged: list[int] = []
    found = s.checkpointer.restore_newest_intact(abstract_target(s.abstract_state, s.shardings), data_iter,
                                                 on_damaged=lambda step, _: damaged.append(step))
    if damaged:  # out of the manager's sight, or the resumed run would save into the damaged step's name
        s.checkpointer.close()
        if jax.process_index() == 0:
            for step in damaged:
                dest = rundir.move_damaged(s.checkpointer.directory, step)
                print(f"warning: moved the damaged checkpoint step {step} to {dest}", file=sys.stderr, flush=True)
        ck = cfg.checkpoint
        s.checkpointer = Checkpointer(s.checkpointer.directory, int(ck.keep_last), int(ck.keep_every),
                                      bool(ck.async_save))
    if found is None:
        return s.init_state(), {}
    step, state, meta = found
    # The checkpoint carries its own config, data fingerprint and stream spec: refuse one from another run.
    rundir.resume_changes(meta["config"], cfg.to_dict(), rundir.CHANGEABLE_FIELDS, workdir)
    rundir.refuse_other_data(workdir, rundir.fingerprint_differences(meta["data_fingerprint"], fingerprint))
    saved_stream = meta.get("data_stream", {})
    if saved_stream != stream:
        diffs = rundir.config_differences(saved_stream, stream)
        raise UserError(f"checkpoint step {step} in {s.checkpointer.directory} holds a data iterator of another "
                        f"stream ({'; '.join(f'{k}: checkpoint {a!r}, now {b!r}' for k, (a, b) in diffs.items())})")
    s.latest = step
    if jax.process_index() == 0:
        print(f"resuming from {s.checkpointer.directory} at step {step}", flush=True)
    return state, meta


def _train_locked(cfg: ml_collections.ConfigDict, workdir: str, progress: bool, return_state: bool,
                  allow_change: tuple[str, ...], t_start: float) -> dict[str, Any] | tuple[dict[str, Any], dict]:
    main = jax.process_index() == 0
    _, mcfg = check_config(cfg)  # config mistakes first, before the corpus is read
    cache, fingerprint, changes = prepare_data(cfg, mcfg, workdir, allow_change)
    s = setup(cfg, workdir, cache)
    if s.task.name == "lm" and main and s.task.summary()["skipped_non_utf8"]:
        print(f"warning: skipped {s.task.summary()['skipped_non_utf8']} non-UTF-8 file(s) in {cfg.data.corpus} "
              f"(see the token cache manifest)", flush=True)
    n_seeds = len(s.seeds)
    steps = int(cfg.train.steps)
    stop_at = min(steps, int(cfg.train.get("stop_after", 0)) or steps)
    tokens_per_step = int(cfg.train.batch_size) * int(cfg.data.seq_len)  # per seed
    config_json = rundir.jsonable(cfg.to_dict())

    try:
        # Data: this host's slice of one seeded stream of batches per seed.
        data_iter = make_data_iterator(s)
        stream = stream_spec(s)
        # State: restored (arrays land directly in their shardings, the iterator at its saved position) or fresh.
        state, meta = _restore_or_init(s, data_iter, cfg, workdir, fingerprint, stream)
        if main:
            rundir.write_json(os.path.join(workdir, rundir.CONFIG), config_json)
            rundir.record_history(workdir, "resume" if s.latest is not None else "start", step=s.latest or 0,
                                  changes={k: {"run": a, "now": b} for k, (a, b) in changes.items()})
    except BaseException:
        s.checkpointer.close()
        raise
    step = int(np.asarray(state["step"]).reshape(-1)[0])
    last_saved = s.latest
    writer = MetricsWriter(workdir, resume_step=step, seeds=s.seeds)
    train_step = make_sharded_train_step(s)
    evaluator = make_evaluator(s)
    # MFU: model FLOPs of a step over the step time and the devices' peak (train.peak_tflops; training/observe.py).
    flops_per_step = observe.model_flops_per_step(s.n_params, s.mcfg, int(cfg.train.batch_size),
                                                  int(cfg.data.seq_len)) * n_seeds
    peak_tflops = float(cfg.train.get("peak_tflops", 0.0))
    profiler = observe.Profiler(workdir, int(cfg.train.get("profile_steps", 0)))

    def validate_now(whole: bool = False) -> dict[str, Any]:
        """Periodic evaluations may use the first train.eval_batches batches; the final one scores every example."""
        nonlocal eval_seconds
        t0 = time.perf_counter()
        out = evaluator(state["params"], max_batches=0 if whole else int(cfg.train.eval_batches))
        eval_seconds += time.perf_counter() - t0
        return out

    def save(at: int) -> None:
        nonlocal last_saved, t_saved
        # The open train-loss window travels with the checkpoint, so a resumed run logs the losses of an
        # uninterrupted one.
        s.checkpointer.save(at, state, data_iter, {
            "config": config_json, "data_fingerprint": fingerprint, "data_stream": stream,
            "train_window": {"loss_sum": [float(x) for x in window_loss], "steps": window_n}})
        last_saved, t_saved = at, time.monotonic()

    every_seconds = float(cfg.checkpoint.get("every_seconds", 0))
    t_saved = time.monotonic()

    def save_due(now: float) -> bool:
        """checkpoint.every_seconds elapsed since the last save (or the start). Several processes must agree, or
        their collective save deadlocks: process 0's clock decides."""
        if not every_seconds:
            return False
        due = now - t_saved >= every_seconds
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    from tqdm import tqdm  # local: only the CLI path needs it

    bar = tqdm(total=stop_at, initial=step, disable=not (progress and main), dynamic_ncols=True, unit="step")
    log_every, eval_every, ckpt_every = int(cfg.train.log_every), int(cfg.train.eval_every), int(cfg.checkpoint.every)
    saved_window = meta.get("train_window", {})
    window_loss = np.asarray(saved_window.get("loss_sum", np.zeros(n_seeds)), np.float64).reshape(n_seeds)
    window_n = int(saved_window.get("steps", 0))
    # The device metrics of the steps since the last host sync. The loop waits for the device only in sync(): at
    # log, evaluation and checkpoint steps (and at least every 100 steps), not at every step.
    pending: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    # A resumed run that has nothing left to train reports the last logged training loss; its training time
    # continues from the last logged total.
    logged = [r for r in read_metrics(workdir) if "train_loss" in r]
    train_loss = (np.asarray(logged[-1].get("train_loss/seeds", logged[-1]["train_loss"]), np.float64).reshape(-1)
                  if logged else np.full(n_seeds, np.nan))
    train_seconds_before = float(logged[-1].get("train_seconds", 0.0)) if logged else 0.0
    val: dict[str, Any] = {}
    # train.early_stop: judged on the logged evaluations, so a resumed run first replays them (and a run that had
    # already stopped early trains no further).
    early = EarlyStop.from_config(cfg.train, n_seeds, tasks.METRIC_NAMES[s.task.name])
    if early is not None and early.replay(read_metrics(workdir), step):
        stop_at = step
    status = "completed" if stop_at == steps or (early is not None and early.done) else "stopped"
    # Throughput over this process's steps, from the end of the first step (which includes compilation), with the
    # periodic evaluations' time taken out.
    t_first, steps_timed, eval_seconds, first_step_seconds = None, 0, 0.0, None
    t_window = t_loop = time.perf_counter()

    def sync() -> None:
        """Fetch the pending steps' metrics, add their losses to the log window, and stop at the first non-finite
        loss or gradient norm (its step is exact: every step's metrics are kept until here)."""
        nonlocal window_loss, window_n, status, last_saved, last
        if not pending:
            return
        host = jax.device_get(pending)
        for i, m in enumerate(host):
            at = step - len(host) + 1 + i
            loss = np.asarray(m["loss"], np.float64).reshape(-1)
            grad_norm = np.asarray(m["grad_norm"], np.float64).reshape(-1)
            if not (np.all(np.isfinite(loss)) and np.all(np.isfinite(grad_norm))):
                status = "nonfinite"
                s.checkpointer.wait()
                # Every save happens after a sync, so no checkpoint is newer than at - 1, whose params gave this loss.
                last_saved = s.checkpointer.drop_unverified(at - 1)
                bad = [seed for seed, l, g in zip(s.seeds, loss, grad_norm) if not (math.isfinite(l)
                                                                                    and math.isfinite(g))]
                raise NonFiniteLossError(
                    f"non-finite loss ({loss.tolist() if n_seeds > 1 else loss[0]}) or gradient norm at step {at}"
                    f"{f' (seeds {bad})' if n_seeds > 1 else ''}; stopped, the last good checkpoint is "
                    f"{'step ' + str(last_saved) if last_saved is not None else 'none (no save yet)'}")
            window_loss += loss
            window_n += 1
        last = host[-1]
        pending.clear()

    try:
        while step < stop_at:
            batch = tasks.global_seed_batch(next(data_iter), s.mesh, n_seeds)
            profiler.before_step()
            state, metrics = train_step(state, batch)
            profiler.after_step(metrics)
            step += 1
            pending.append(metrics)
            log_now = bool(log_every) and (step % log_every == 0 or step == steps)
            # One process: our SIGINT/SIGTERM flag. Several: orbax's preemption sync (jax.distributed's SIGTERM
            # notice), which makes every process stop at the same step, so their collective save cannot deadlock.
            stop_requested = (bool(_STOP_SIGNAL) if jax.process_count() == 1
                              else s.checkpointer.reached_preemption(step))
            s.checkpointer.check_saved()  # a failed background save stops the run now, not at the end
            save_now = step % ckpt_every == 0 or step == stop_at or stop_requested or save_due(time.monotonic())
            eval_now = bool(eval_every) and step % eval_every == 0 and step < steps
            if t_first is None or log_now or save_now or eval_now or len(pending) >= (log_every or 100):
                sync()
            now = time.perf_counter()
            if t_first is None:  # the first step, synced above: compilation plus one step
                t_first, first_step_seconds = now, now - t_loop
            else:
                steps_timed += 1
            if log_now:
                train_loss = window_loss / window_n
                window_seconds = max(now - t_window, 1e-9)
                tps = window_n * tokens_per_step * n_seeds / window_seconds
                elapsed = train_seconds_before + (now - t_first - eval_seconds)
                row = {**per_seed({"train_loss": train_loss, "grad_norm": last["grad_norm"],
                                   "param_norm": last["param_norm"]}, n_seeds),
                       "lr": float(np.ravel(last["lr"])[0]), "tokens_seen": step * tokens_per_step,
                       "tokens_per_second": tps, "train_seconds": elapsed,
                       "model_tflops_per_second": flops_per_step * window_n / window_seconds / 1e12}
                util = observe.mfu(flops_per_step, window_n, window_seconds, peak_tflops, jax.device_count())
                if util is not None:
                    row["mfu"] = util
                if "dt" in last:
                    row.update(per_seed(observe.dt_scalars(np.asarray(last["dt"])), n_seeds))
                writer.write(step, row)
                bar.set_postfix(loss=f"{float(np.mean(train_loss)):.3f}", tok_s=f"{tps:,.0f}")
                window_loss, window_n, t_window = np.zeros(n_seeds), 0, time.perf_counter()
            bar.update(1)
            if eval_now:
                val = validate_now()
                writer.write(step, per_seed(val, n_seeds))
                t_window += time.perf_counter() - now  # the window's tokens/s counts training time only
                if early is not None and early.update(step, val[early.metric]):
                    status, save_now = "completed", True  # the end of learning: this step is the run's last
            if save_now:
                save(step)
            if stop_requested:
                status = "interrupted"
                break
            if early is not None and early.done:
                break
        bar.close()
        sync()
        if not log_every or window_n:  # steps since the last log line (or logging off): still report a train loss
            train_loss = window_loss / window_n if window_n else train_loss
        if status != "interrupted":
            val = validate_now(whole=True)
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
    train_time = (time.perf_counter() - t_first - eval_seconds) if t_first is not None else 0.0
    interrupted = {"signal": signal.Signals(_STOP_SIGNAL[0]).name, "signal_number": _STOP_SIGNAL[0]} \
        if status == "interrupted" and _STOP_SIGNAL else {}
    summary = {**_summary_base(s, workdir), "status": status, **interrupted, "step": step,
               "tokens_seen": step * tokens_per_step,
               **summary_metrics({"train_loss": np.asarray(train_loss, np.float64)}, n_seeds),
               **({"val_loss": None, "val_ppl": None, "val_tokens": None} if s.task.name == "lm" else {}),
               **summary_metrics(val, n_seeds), "checkpoint_step": last_saved,
               **({"early_stop": early.summary()} if early is not None else {}),
               "wall_seconds": round(time.time() - t_start, 3),
               "train_seconds": round(train_seconds_before + train_time, 3),
               # compilation (or a persistent-cache hit) plus one step, in this process
               "first_step_seconds": round(first_step_seconds, 3) if first_step_seconds is not None else None,
               # all seeds together: the throughput of the compiled program
               "tokens_per_second": (steps_timed * tokens_per_step * n_seeds / train_time) if steps_timed else None}
    if main:
        write_json_atomic(os.path.join(workdir, "summary.json"), summary)
        rundir.record_history(workdir, "end", status=status, step=step, checkpoint_step=last_saved,
                              **({"signal": interrupted["signal"]} if interrupted else {}))
    return (summary, host_params(state)) if return_state else summary


def summary_metrics(metrics: dict[str, Any], num_seeds: int) -> dict[str, Any]:
    """summary.json's form of per-seed metrics: ``name`` = the mean over seeds and, with several seeds,
    ``name/seeds`` (the list) and ``name/std`` (sample standard deviation, ddof 1)."""
    out = per_seed(metrics, num_seeds)
    for k, v in metrics.items():
        if isinstance(v, np.ndarray) and num_seeds > 1:
            out[f"{k}/std"] = mean_std(v)[1]
    return out


# --------------------------------------------------------------------------------------------------------------------
# Evaluation of a saved run.
# --------------------------------------------------------------------------------------------------------------------


def saved_run_config(workdir: str, cfg: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
    """The run's config, WORKDIR/config.json. An explicit ``cfg`` is returned only when it agrees with the run
    (runtime fields such as the mesh aside); otherwise a UserError names every differing field."""
    workdir = os.path.abspath(workdir)
    saved = rundir.run_config(workdir)
    if saved is None:
        raise UserError(f"{workdir} is not a run directory (no {rundir.CONFIG}): train first, "
                        f"python train.py --config=... --workdir={workdir}")
    if cfg is not None:
        rundir.check_eval_config(saved, cfg.to_dict(), workdir)
        return cfg
    return ml_collections.ConfigDict(saved)


def restore_latest(cfg: ml_collections.ConfigDict | None, workdir: str) -> tuple[Setup, dict]:
    """Set up ``workdir``'s run from the run directory alone (its config, tokenizer and held-out splits: no corpus,
    no token cache) and restore its newest intact train state into the mesh's shardings (no data iterator: for
    evaluation, diagnostics and export). ``cfg`` may be None (the run's own) or must agree with the run. Nothing
    in ``workdir`` is written; the checkpoint manager is closed before returning."""
    workdir = os.path.abspath(workdir)
    cfg = saved_run_config(workdir, cfg)
    data = rundir.RunData(workdir) if tasks.task_name(cfg) == "lm" else None
    s = setup(cfg, workdir, data, read_only=True)
    try:
        found = s.checkpointer.restore_newest_intact(abstract_target(s.abstract_state, s.shardings))
        if found is None:
            raise UserError(f"no completed checkpoint in {s.checkpointer.directory}: train first")
        s.latest, state, _ = found
    finally:
        s.checkpointer.close()
    return s, state


def evaluate_run(workdir: str, split: str = "validation",
                 cfg: ml_collections.ConfigDict | None = None) -> dict[str, Any]:
    """Score the newest intact checkpoint of ``workdir`` on a whole held-out split (every token once). Writes
    nothing: the caller prints the result, then stores it (rundir.write_eval_result), never over summary.json.
    LM keys: ``loss``, ``ppl``, ``tokens`` (``name/seeds``, ``name/std`` with several seeds); MQAR: its metrics."""
    if split not in rundir.HELD_OUT_SPLITS:
        raise UserError(f"--split must be 'validation' or 'test', got {split!r}")
    t_start = time.time()
    s, state = restore_latest(cfg, workdir)
    result = make_evaluator(s)(state["params"], split=split)
    metrics = {(k[4:] if k.startswith("val_") else k): v for k, v in result.items()}
    step = int(np.asarray(state["step"]).reshape(-1)[0])
    return {"split": split, "step": step, **summary_metrics(metrics, len(s.seeds)), "task": s.task.name,
            "variant": s.mcfg.variant, "n_params": s.n_params, "seeds": list(s.seeds),
            "seq_len": int(s.cfg.data.seq_len),
            "tokens_seen": step * int(s.cfg.train.batch_size) * int(s.cfg.data.seq_len),
            "workdir": os.path.abspath(workdir), "devices": jax.device_count(),
            "wall_seconds": round(time.time() - t_start, 3)}


def host_params(state_or_params: Any) -> Any:
    """A numpy copy of (sharded) arrays, e.g. for tests comparing runs."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state_or_params)


def seed_slice(tree: Any, index: int) -> Any:
    """Replica ``index`` of a seed-parallel state or params tree (a tree without a seed axis for the model)."""
    return jax.tree.map(lambda x: x[index], tree)
