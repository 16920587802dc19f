"""The training loop: config -> data -> model -> sharded jit step -> checkpoints, logs and evaluation.

Read top to bottom it is nanoGPT's loop with three additions: the state lives on a device mesh, everything needed to
continue (params, optimiser state, step, data-iterator position, config) is checkpointed together, and nothing in a
step depends on process history. The dropout key of step s is ``fold_in(fold_in(key(seed), 1), s)``, the data order
is the grain iterator's checkpointed position, and the learning rate is a function of the step in the optimiser
state, so 2N steps in one go and N steps + resume + N steps give bitwise identical params and losses.

Public entry points: :func:`train` (used by train.py and the main job) and :func:`evaluate_checkpoint` (eval.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.data.corpora import CorpusSpec
from coupled_qk_jax.data.pipeline import make_train_iterator
from coupled_qk_jax.data.token_cache import TokenCache, build_token_cache
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import optimizer as opt_lib
from coupled_qk_jax.training.checkpoint import Checkpointer, abstract_target
from coupled_qk_jax.training.evaluate import evaluate_tokens, make_sharded_eval_step
from coupled_qk_jax.training.steps import init_train_state, make_train_step, split_model
from coupled_qk_jax.training.writers import MetricsWriter, read_metrics, write_json_atomic

# Set by the SIGINT/SIGTERM handler (to the signal's number); the loop checks it at every step boundary, saves,
# writes the summary and returns with status "interrupted".
_STOP_SIGNAL: list[int] = []


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
    """data.corpus (the data layer's string) plus the optional split_fractions / max_bytes overrides."""
    spec = CorpusSpec.coerce(str(data_cfg.corpus))
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
    if eval_batch_size(cfg) % mesh_batch_devices:
        raise UserError(f"the eval batch size {eval_batch_size(cfg)} is not divisible by the {mesh_batch_devices} "
                         f"data-parallel devices; set train.eval_batch_size")
    for name in ("log_every", "eval_every", "eval_batches"):
        if int(cfg.train[name]) < 0:
            raise UserError(f"train.{name} must be >= 0, got {cfg.train[name]}")
    if int(cfg.checkpoint.every) < 1:
        raise UserError(f"checkpoint.every must be >= 1, got {cfg.checkpoint.every}")
    if float(cfg.checkpoint.get("every_seconds", 0)) < 0:
        raise UserError(f"checkpoint.every_seconds must be >= 0 (0 = off), got {cfg.checkpoint.every_seconds}")
    return mcfg


def eval_batch_size(cfg: ml_collections.ConfigDict) -> int:
    return int(cfg.train.get("eval_batch_size", 0)) or int(cfg.train.batch_size)


def load_data(cfg: ml_collections.ConfigDict, mcfg: ModelConfig) -> TokenCache:
    """Tokenise the corpus once into the cache (or reuse it) and check its vocabulary against the model's."""
    cache = build_token_cache(
        corpus_spec(cfg.data), os.path.expanduser(str(cfg.data.cache_dir)), tokenizer=str(cfg.data.tokenizer),
        vocab_size=mcfg.vocab_size, tokenizer_path=str(cfg.data.tokenizer_path) or None)
    if cache.vocab_size > mcfg.vocab_size:  # smaller is fine: the model's extra ids are padding, never in the data
        raise UserError(f"vocab mismatch: the token cache {cache.directory.name} has vocab {cache.vocab_size}, "
                        f"more than model.vocab_size {mcfg.vocab_size}")
    return cache


def check_compatible(saved: dict[str, Any], cfg: ml_collections.ConfigDict, workdir: str, step: int) -> None:
    """Refuse a config whose model differs from the checkpoint's: resuming would silently mix two models."""
    old, new = dict(saved.get("model", {})), cfg.model.to_dict()
    diffs = [f"model.{k}: checkpoint {old.get(k)!r} vs config {new.get(k)!r}"
             for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diffs:
        raise UserError(f"workdir {workdir} holds a checkpoint (step {step}) of a different model "
                         f"({'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}); use a new --workdir")


@dataclasses.dataclass
class Setup:
    """Everything the loop and the evaluator share. Nothing here holds device memory: the state is abstract."""

    cfg: ml_collections.ConfigDict
    mcfg: ModelConfig
    mesh: jax.sharding.Mesh
    cache: TokenCache
    graphdef: Any
    abstract_state: dict  # ShapeDtypeStructs of {"params", "opt_state", "step"}
    tx: Any
    shardings: dict  # NamedShardings of the train state
    n_params: int
    checkpointer: Checkpointer
    latest: int | None  # latest completed checkpoint step in the workdir
    param_transform: Any = None  # params -> params at the start of each step (the FSDP weight all-gather)

    def init_state(self) -> dict:
        """A fresh train state, created by one jitted function directly in its shardings (one compile instead of
        one per eager init op, and no full copy on a single device first)."""
        mcfg, seed, tx = self.mcfg, int(self.cfg.train.seed), self.tx

        def init():
            return init_train_state(split_model(TransformerLM(mcfg, seed))[1], tx)

        return jax.jit(init, out_shardings=self.shardings)()


def setup(cfg: ml_collections.ConfigDict, workdir: str) -> Setup:
    try:
        shd.mesh_shape(cfg.mesh)  # the mesh block's own checks (sizes, -1) are the user's config mistakes
    except ValueError as e:
        raise UserError(str(e)) from None
    mesh = shd.make_mesh(cfg.mesh)
    mcfg = validate(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
    ck = cfg.checkpoint
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), int(ck.keep_last), int(ck.keep_every),
                                bool(ck.async_save))
    try:
        return _setup_rest(cfg, mcfg, mesh, checkpointer, workdir)
    except BaseException:
        checkpointer.close()  # else orbax's background threads die noisily at interpreter exit
        raise


def _setup_rest(cfg: ml_collections.ConfigDict, mcfg: ModelConfig, mesh: jax.sharding.Mesh,
                checkpointer: Checkpointer, workdir: str) -> Setup:
    latest = checkpointer.latest_step()
    if latest is not None:  # before the (possibly slow) tokenisation: refuse early
        check_compatible(checkpointer.saved_config(latest), cfg, workdir, latest)
    cache = load_data(cfg, mcfg)
    skipped = sum(int(v.get("skipped_non_utf8", 0)) for v in cache.manifest["splits"].values())
    if skipped and jax.process_index() == 0:
        print(f"warning: skipped {skipped} non-UTF-8 file(s) in {cfg.data.corpus} (see the token cache manifest)",
              flush=True)
    seed = int(cfg.train.seed)
    # Shapes only: the abstract model carries the logical-axis metadata that the shardings are read from.
    abstract_model = nnx.eval_shape(lambda: TransformerLM(mcfg, seed))
    graphdef, abstract_params = split_model(abstract_model)
    tx = opt_lib.make_optimizer(abstract_params, cfg.train)
    abstract_state = jax.eval_shape(lambda p: init_train_state(p, tx), abstract_params)
    shardings = shd.train_state_shardings(abstract_model, tx, abstract_state, mesh)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))
    gather = shd.fsdp_gather(abstract_model, mesh)  # identity unless mesh.fsdp > 1
    return Setup(cfg, mcfg, mesh, cache, graphdef, abstract_state, tx, shardings, n_params, checkpointer, latest,
                 gather)


def make_sharded_train_step(s: Setup):
    """jit(train_step) with explicit shardings; the state is donated (updated in place)."""
    cfg = s.cfg
    step_fn = make_train_step(s.graphdef, s.tx, int(cfg.train.grad_accum), use_dropout=s.mcfg.dropout > 0,
                              param_transform=s.param_transform)
    seed = int(cfg.train.seed)

    def train_step(state, batch):
        # The key depends only on (seed, step): a resumed run draws exactly the keys of an uninterrupted one.
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), state["step"])
        return step_fn(state, batch, key)

    batch_sh = shd.batch_sharding(s.mesh)
    replicated = NamedSharding(s.mesh, P())
    return jax.jit(train_step, in_shardings=(s.shardings, {"inputs": batch_sh, "targets": batch_sh}),
                   out_shardings=(s.shardings, replicated), donate_argnums=(0,))


def _summary_base(s: Setup, workdir: str) -> dict[str, Any]:
    cfg = s.cfg
    return {"variant": s.mcfg.variant, "scale": str(cfg.get("scale", "")), "n_params": s.n_params,
            "corpus": str(cfg.data.corpus), "seq_len": int(cfg.data.seq_len),
            "batch_size": int(cfg.train.batch_size), "workdir": os.path.basename(os.path.abspath(workdir)),
            "token_cache": s.cache.directory.name,
            "skipped_non_utf8": sum(int(v.get("skipped_non_utf8", 0)) for v in s.cache.manifest["splits"].values()), "devices": jax.device_count(), "processes": jax.process_count(),
            "mesh": dict(s.mesh.shape)}


# --------------------------------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------------------------------


def train(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
          return_state: bool = False) -> dict[str, Any] | tuple[dict[str, Any], dict]:
    """Train (or resume) the run in ``workdir`` up to ``train.steps`` (or ``train.stop_after``); returns the summary.

    Raises UserError (bad config / data / incompatible checkpoint) or NonFiniteLossError. Returns early, after a
    checkpoint, when SIGINT or SIGTERM was received (``summary["status"] == "interrupted"``, ``summary["signal"]``). With ``return_state`` it returns
    ``(summary, state)``, the final train state as numpy arrays (for tests).
    """
    t_start = time.time()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    s = setup(cfg, workdir)
    main = jax.process_index() == 0
    steps = int(cfg.train.steps)
    stop_at = min(steps, int(cfg.train.get("stop_after", 0)) or steps)
    tokens_per_step = int(cfg.train.batch_size) * int(cfg.data.seq_len)
    config_json = cfg.to_dict()

    try:
        if s.cache.tokens("validation").shape[0] < 2:  # found now, not after hours of training
            raise UserError(f"the validation split of {cfg.data.corpus} is empty; a small directory needs larger "
                             f"held-out shares, e.g. --config.data.split_fractions=0.8,0.1,0.1")
        # Data: this host's slice of one seeded stream of random windows.
        # Which rows of the global batch this host loads: usually (process_index, process_count), but processes
        # that hold the same batch rows (a tensor axis across hosts) must load the same data.
        slice_index, slice_count = shd.process_batch_slice(s.mesh, int(cfg.train.batch_size))
        per_host = int(cfg.train.batch_size) // slice_count
        data_iter = make_train_iterator(s.cache.tokens("train"), int(cfg.data.seq_len), per_host,
                                        int(cfg.train.seed), slice_index, slice_count,
                                        num_threads=int(cfg.data.get("num_threads", 2)))
        # State: restored (arrays land directly in their shardings, the iterator at its saved position) or fresh.
        if s.latest is not None:
            state = s.checkpointer.restore(s.latest, abstract_target(s.abstract_state, s.shardings), data_iter)
            if main:
                print(f"resuming from {s.checkpointer.directory} at step {s.latest}", flush=True)
        else:
            state = s.init_state()
    except BaseException:
        s.checkpointer.close()
        raise
    step = int(state["step"])
    last_saved = s.latest
    writer = MetricsWriter(workdir, resume_step=step)
    train_step = make_sharded_train_step(s)
    eval_step = make_sharded_eval_step(s.graphdef, s.shardings["params"], s.mesh, s.param_transform)
    schedule = opt_lib.learning_rate_schedule(cfg.train)
    val_tokens = s.cache.tokens("validation")

    def validate_now(whole: bool = False) -> dict[str, Any]:
        """Periodic evaluations may use the first train.eval_batches batches; the final one scores every token."""
        return evaluate_tokens(eval_step, state["params"], val_tokens, int(cfg.data.seq_len), eval_batch_size(cfg),
                               s.mesh, bos_id=s.cache.eot_id, max_batches=0 if whole else int(cfg.train.eval_batches))

    def save(at: int) -> None:
        nonlocal last_saved, t_saved
        s.checkpointer.save(at, state, data_iter, config_json)
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
    window_loss, window_n = 0.0, 0
    # A resumed run that has nothing left to train reports the last logged training loss.
    logged = [r["train_loss"] for r in read_metrics(workdir) if "train_loss" in r]
    train_loss = float(logged[-1]) if logged else float("nan")
    val: dict[str, Any] = {}
    status = "completed" if stop_at == steps else "stopped"
    # Throughput over this process's steps, from the end of the first step (which includes compilation).
    t_first, steps_timed = None, 0
    t_window = time.perf_counter()
    try:
        while step < stop_at:
            batch = shd.global_batch(next(data_iter), s.mesh)
            state, metrics = train_step(state, batch)
            step += 1
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])  # syncs: cheap next to a step
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                status = "nonfinite"
                s.checkpointer.wait()
                last_saved = s.checkpointer.drop_unverified(step - 1)
                raise NonFiniteLossError(
                    f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; stopped, the last good "
                    f"checkpoint is {'step ' + str(last_saved) if last_saved is not None else 'none (no save yet)'}")
            now = time.perf_counter()
            if t_first is None:
                t_first = now
            else:
                steps_timed += 1
            window_loss += loss
            window_n += 1
            if log_every and (step % log_every == 0 or step == stop_at):
                train_loss = window_loss / window_n
                tps = window_n * tokens_per_step / max(now - t_window, 1e-9)
                writer.write(step, {"train_loss": train_loss, "lr": float(schedule(step - 1)),
                                    "grad_norm": grad_norm, "tokens_seen": step * tokens_per_step,
                                    "tokens_per_second": tps})
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}")
                window_loss, window_n, t_window = 0.0, 0, time.perf_counter()
            bar.update(1)
            if eval_every and step % eval_every == 0 and step < stop_at:
                val = validate_now()
                writer.write(step, {"val_loss": val["loss"], "val_ppl": val["ppl"], "val_tokens": val["tokens"]})
            # One process: our SIGINT/SIGTERM flag. Several: orbax's preemption sync (jax.distributed's SIGTERM
            # notice), which makes every process stop at the same step, so their collective save cannot deadlock.
            stop_requested = (bool(_STOP_SIGNAL) if jax.process_count() == 1
                              else s.checkpointer.reached_preemption(step))
            if step % ckpt_every == 0 or step == stop_at or stop_requested or save_due(time.monotonic()):
                save(step)
            if stop_requested:
                status = "interrupted"
                break
        bar.close()
        if not log_every or window_n:  # steps since the last log line (or logging off): still report a train loss
            train_loss = window_loss / window_n if window_n else train_loss
        if status != "interrupted":
            val = validate_now(whole=True)
            writer.write(step, {"val_loss": val["loss"], "val_ppl": val["ppl"], "val_tokens": val["tokens"]})
    finally:
        bar.close()
        s.checkpointer.wait()  # a pending async save must land before we report (or exit)
        writer.close()
        s.checkpointer.close()
    train_time = (time.perf_counter() - t_first) if t_first is not None else 0.0
    interrupted = {"signal": signal.Signals(_STOP_SIGNAL[0]).name, "signal_number": _STOP_SIGNAL[0]} \
        if status == "interrupted" and _STOP_SIGNAL else {}
    summary = {**_summary_base(s, workdir), "status": status, **interrupted, "step": step, "tokens_seen": step * tokens_per_step,
               "train_loss": train_loss, "val_loss": val.get("loss"), "val_ppl": val.get("ppl"),
               "val_tokens": val.get("tokens"), "checkpoint_step": last_saved,
               "wall_seconds": round(time.time() - t_start, 3),
               "tokens_per_second": (steps_timed * tokens_per_step / train_time) if steps_timed else None}
    if main:
        write_json_atomic(os.path.join(workdir, "summary.json"), summary)
    return (summary, host_params(state)) if return_state else summary


# --------------------------------------------------------------------------------------------------------------------
# Evaluation of a saved run.
# --------------------------------------------------------------------------------------------------------------------


def restore_latest(cfg: ml_collections.ConfigDict, workdir: str) -> tuple[Setup, dict]:
    """Set up ``workdir``'s run and restore its latest completed train state into the mesh's shardings (no data
    iterator: for evaluation and diagnostics). The checkpoint manager is closed before returning."""
    s = setup(cfg, workdir)
    try:
        if s.latest is None:
            raise UserError(f"no completed checkpoint in {s.checkpointer.directory}: train first")
        state = s.checkpointer.restore(s.latest, abstract_target(s.abstract_state, s.shardings))
    finally:
        s.checkpointer.close()
    return s, state


def evaluate_checkpoint(cfg: ml_collections.ConfigDict, workdir: str, split: str = "validation") -> dict[str, Any]:
    """Evaluate the latest checkpoint in ``workdir`` on a whole split; updates summary.json and metrics.jsonl."""
    if split not in ("validation", "test"):
        raise UserError(f"--split must be 'validation' or 'test', got {split!r}")
    t_start = time.time()
    workdir = os.path.abspath(workdir)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise UserError(f"no checkpoint in {workdir}: train first (python train.py --workdir={workdir} ...)")
    s, state = restore_latest(cfg, workdir)
    eval_step = make_sharded_eval_step(s.graphdef, s.shardings["params"], s.mesh, s.param_transform)
    result = evaluate_tokens(eval_step, state["params"], s.cache.tokens(split), int(cfg.data.seq_len),
                             eval_batch_size(cfg), s.mesh, bos_id=s.cache.eot_id)
    prefix = "val" if split == "validation" else "test"
    step = int(state["step"])
    path = os.path.join(workdir, "summary.json")
    previous: dict[str, Any] = {}
    if os.path.exists(path):
        import json

        with open(path, encoding="utf-8") as f:
            previous = json.load(f)
    summary = {"train_loss": None, "val_loss": None, "val_ppl": None, "tokens_per_second": None, **previous,
               **_summary_base(s, workdir), "step": step,
               "tokens_seen": step * int(cfg.train.batch_size) * int(cfg.data.seq_len),
               f"{prefix}_loss": result["loss"], f"{prefix}_ppl": result["ppl"], f"{prefix}_tokens": result["tokens"],
               "checkpoint_step": s.latest, "eval_wall_seconds": round(time.time() - t_start, 3)}
    summary.setdefault("wall_seconds", summary["eval_wall_seconds"])
    if jax.process_index() == 0:
        writer = MetricsWriter(workdir)
        writer.write(step, {"loss": result["loss"], "ppl": result["ppl"], "tokens": result["tokens"]},
                     prefix=f"eval_{prefix}_")
        writer.close()
        write_json_atomic(path, summary)
    return summary


def saved_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config stored with the latest checkpoint in ``workdir`` (what eval.py uses without --config)."""
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    if not os.path.isdir(directory):
        raise UserError(f"no checkpoint in {os.path.abspath(workdir)}: train first, or pass --config")
    ck = Checkpointer(directory)
    try:
        step = ck.latest_step()
        if step is None:
            raise UserError(f"no completed checkpoint in {directory}")
        return ml_collections.ConfigDict(ck.saved_config(step))
    finally:
        ck.close()


def host_params(state_or_params: Any) -> Any:
    """A numpy copy of (sharded) arrays, e.g. for tests comparing runs."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state_or_params)
