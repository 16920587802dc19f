"""Trainer with per-circuit learning rates for the one-layer QK/OV model.

The QK group (W_Q, W_K, W_QK) and the OV group (W_V, W_O, W_OV, b_OV) get separate optax transforms via
``optax.partition``; each is wrapped in ``optax.inject_hyperparams`` so its current learning rate is inspectable.

* QK rate = ``lr_ov * qk_ratio * s(step)`` with ``s = 1`` ("constant") or ``s = 1 + (m - 1) step / total_steps``
  ("increasing", a linear ramp from 1x to m x as the reference's LambdaLR). ``qk_ratio = 0`` freezes QK.
* Optimiser: plain SGD (the paper) or AdamW.

Several runs (seeds, or Figure-3 alpha values) are trained as one program: every leaf carries a leading run axis
and one epoch is a ``jax.vmap`` of a ``lax.scan`` over that epoch's batches. Data come from the legacy numpy
generator (one ``RandomState(seed)`` per run), generated one epoch at a time on the host.

Why this is not the project's training loop (``training/loop.py``): only the pattern is shared (a leading run axis
and a vmapped step, as the loop's ``train.num_seeds``), the maths is not. The model is the paper's pure-function
one-layer model with its parametrisations (not ``TransformerLM``), the loss is the last-token cross-entropy, the
optimiser is per-circuit plain SGD with a QK ramp (``training/optimizer.py`` is AdamW with clipping, a decay mask
and warm-up + cosine, which the paper's Figures 1-3 do not use), every epoch draws fresh batches from the task's
generator (no token cache, no held-out split), runs stop one by one at ``stop_loss``, and Figure 3's runs share one
data stream. No step or optimiser code of the loop computes the same thing, so none is reused; optax is shared.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.qkov import data as qdata
from coupled_qk_jax.qkov import metrics as qm
from coupled_qk_jax.qkov import model as qmodel
from coupled_qk_jax.training import checkpoint as ckpt
from coupled_qk_jax.training import rundir

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "increasing")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training cell. Epoch counts are in units of ``batches_per_epoch`` fresh batches."""

    parametrisation: str = "caco"
    init: str = "fig2"  # fig2 | eye | default
    lr_ov: float = 1e-2
    qk_ratio: float = 1.0
    qk_schedule: str = "constant"  # constant | increasing
    qk_final_multiplier: float = 1.0  # m of the increasing schedule
    optimizer: str = "sgd"
    weight_decay: float = 0.0  # AdamW only
    batch_size: int = 32
    seq_len: int = 64
    n_epochs: int = 10
    batches_per_epoch: int = 100
    seeds: tuple[int, ...] = (1234,)
    stop_loss: float | None = None  # stop a run once its epoch-average loss <= stop_loss ...
    stop_check_every: int = 1  # ... tested at 1-based epochs 1, 1 + k, 1 + 2k, ... only (see train())
    fixed_alpha: tuple[float, ...] | None = None  # Figure 3: one run per alpha, attention fixed, OV trained only
    ov_bias: bool = False
    eval_batches: int = 200

    def validate(self) -> "TrainConfig":
        if self.parametrisation.lower() not in qmodel.PARAMETRISATIONS:
            raise ValueError(f"parametrisation: expected one of {qmodel.PARAMETRISATIONS}, got {self.parametrisation!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.qk_schedule not in SCHEDULES:
            raise ValueError(f"qk_schedule: expected one of {SCHEDULES}, got {self.qk_schedule!r}")
        if not self.lr_ov > 0:
            raise ValueError(f"lr_ov: must be > 0, got {self.lr_ov}")
        if not self.qk_ratio >= 0:
            raise ValueError(f"qk_ratio: must be >= 0, got {self.qk_ratio}")
        if not self.qk_final_multiplier >= 0:
            raise ValueError(f"qk_final_multiplier: must be >= 0, got {self.qk_final_multiplier}")
        for name in ("batch_size", "n_epochs", "batches_per_epoch", "eval_batches", "stop_check_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 3:
            raise ValueError(f"seq_len: must be >= 3, got {self.seq_len}")
        if len(self.seeds) == 0:
            raise ValueError("seeds: need at least one seed")
        if self.fixed_alpha is not None:
            if len(self.seeds) != 1:
                raise ValueError("seeds: fixed_alpha runs share one data stream, so give exactly one seed")
            if not all(0.0 <= a <= 1.0 for a in self.fixed_alpha) or len(self.fixed_alpha) == 0:
                raise ValueError(f"fixed_alpha: values must lie in [0, 1], got {self.fixed_alpha}")
        return self

    @property
    def total_steps(self) -> int:
        return self.n_epochs * self.batches_per_epoch

    @property
    def n_runs(self) -> int:
        return len(self.fixed_alpha) if self.fixed_alpha is not None else len(self.seeds)


def qk_lr_schedule(lr_ov: float, qk_ratio: float, schedule: str, total_steps: int,
                   final_multiplier: float = 1.0) -> Callable[[jax.Array], jax.Array] | float:
    """QK learning rate as a float (constant) or an optax schedule of the step count (increasing)."""
    base = lr_ov * qk_ratio
    if schedule == "constant":
        return base
    if schedule == "increasing":
        if total_steps < 1:
            raise ValueError(f"total_steps: must be >= 1, got {total_steps}")
        m = final_multiplier

        def sched(count):
            return base * (1.0 + (m - 1.0) * count / total_steps)

        return sched
    raise ValueError(f"qk_schedule: expected one of {SCHEDULES}, got {schedule!r}")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """optax.partition over {'qk', 'ov'} with an inject_hyperparams SGD/AdamW per group."""
    qk_lr = qk_lr_schedule(cfg.lr_ov, cfg.qk_ratio, cfg.qk_schedule, cfg.total_steps, cfg.qk_final_multiplier)
    if cfg.optimizer == "sgd":
        make = lambda lr: optax.inject_hyperparams(optax.sgd)(learning_rate=lr)  # noqa: E731
    else:
        make = lambda lr: optax.inject_hyperparams(optax.adamw)(  # noqa: E731
            learning_rate=lr, weight_decay=cfg.weight_decay)
    labels = lambda params: {k: qmodel.circuit_of(k) for k in params}  # noqa: E731
    return optax.partition({"qk": make(qk_lr), "ov": make(cfg.lr_ov)}, labels)


def group_learning_rates(opt_state) -> dict[str, jax.Array]:
    """Current learning rate of each group, read from the inject_hyperparams states."""
    # partition wraps each group state in a MaskedState whose .inner_state is the InjectHyperparamsState.
    return {g: s.inner_state.hyperparams["learning_rate"] for g, s in opt_state.inner_states.items()}


def make_epoch_fn(cfg: TrainConfig, opt: optax.GradientTransformation, shared_data: bool):
    """Jitted epoch over all runs: (params, opt_state, batches, alpha, active) -> (params, opt_state, losses, masses).

    params/opt_state have a leading run axis R; batches int [R, n, B, T+1] (or [n, B, T+1] if shared_data);
    alpha [R] (used only by fixed-attention runs); active bool [R] (inactive runs keep their parameters).
    losses, masses: [R, n] per-step training loss and mean distinct-token attention mass of the batch.
    """
    fixed = cfg.fixed_alpha is not None

    def run_epoch(params, opt_state, batches, alpha, active):
        def step(carry, batch):
            p, s = carry
            x, y = batch[:, :-1], batch[:, -1]
            if fixed:
                loss, g = jax.value_and_grad(qmodel.fixed_attention_loss_fn)(p, x, y, alpha)
                mass = jnp.float32(alpha)
            else:
                def lf(p_):
                    logits, attn = qmodel.forward(p_, x)
                    return qmodel.cross_entropy(logits, y), attn

                (loss, attn), g = jax.value_and_grad(lf, has_aux=True)(p)
                # Training-batch distinct-token mass, logged so attention sharpening can be followed per step.
                mass = qm.relevant_mass(attn, qdata.distinct_mask(x)).mean()
            upd, s = opt.update(g, s, p)
            return (optax.apply_updates(p, upd), s), (loss, mass)

        (p_new, s_new), (losses, masses) = jax.lax.scan(step, (params, opt_state), batches)
        keep = lambda new, old: jnp.where(active, new, old)  # noqa: E731
        return jax.tree.map(keep, p_new, params), jax.tree.map(keep, s_new, opt_state), losses, masses

    in_axes = (0, 0, None if shared_data else 0, 0, 0)
    return jax.jit(jax.vmap(run_epoch, in_axes=in_axes))


def init_runs(cfg: TrainConfig):
    """Stacked initial params [R, ...] and optimiser state. Fixed-alpha runs share one init (one seed)."""
    p = cfg.parametrisation.lower()
    if cfg.fixed_alpha is not None:
        one = qmodel.init_params(jax.random.PRNGKey(cfg.seeds[0]), p, cfg.init, cfg.ov_bias)
        # Figure 3 trains OV only: drop the QK matrices so nothing but the readout exists.
        one = {k: v for k, v in one.items() if qmodel.circuit_of(k) == "ov"}
        params = jax.tree.map(lambda v: jnp.stack([v] * cfg.n_runs), one)
    else:
        params = jax.vmap(lambda k: qmodel.init_params(k, p, cfg.init, cfg.ov_bias))(
            jnp.stack([jax.random.PRNGKey(s) for s in cfg.seeds]))
    opt = make_optimizer(cfg)
    opt_state = jax.vmap(opt.init)(params)
    return params, opt, opt_state


@dataclasses.dataclass
class TrainResult:
    """params: stacked [R, ...]; epoch_loss / epoch_mass: [R, n_epochs] epoch-average training loss and distinct-token
    attention mass (nan after a run stopped);
    stopped_epoch: [R] epoch at which the run stopped (n_epochs if it never did); seconds: wall time."""

    config: TrainConfig
    params: dict
    epoch_loss: np.ndarray
    epoch_mass: np.ndarray
    stopped_epoch: np.ndarray
    seconds: float


def _config_json(cfg: TrainConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


# In-job checkpoints go through the project's Checkpointer (training/checkpoint.py): orbax's atomic step directories,
# per-leaf checksums verified on every restore, and a fall-back to the older step when the newest is damaged. Two
# steps are kept so that a damaged newest one still leaves one to resume from.
CKPT_KEEP = 2


def _floats_to_json(a: np.ndarray) -> list:
    """Nested lists of a float array with nan as None (strict JSON has no nan; a float's repr round-trips exactly)."""
    return [_floats_to_json(r) for r in a] if a.ndim > 1 else [None if np.isnan(v) else float(v) for v in a]


def _floats_from_json(x: list) -> np.ndarray:
    return np.array(x, dtype=object).astype(np.float64)  # None -> nan


def _rng_state_to_json(st: dict) -> dict:
    """A ``RandomState.get_state(legacy=False)`` dict with its 624-word MT19937 key as a list of ints."""
    return {**st, "state": {"key": np.asarray(st["state"]["key"]).tolist(), "pos": int(st["state"]["pos"])},
            "has_gauss": int(st["has_gauss"]), "gauss": float(st["gauss"])}


def _rng_state_from_json(st: dict) -> dict:
    return {**st, "state": {"key": np.asarray(st["state"]["key"], np.uint32), "pos": int(st["state"]["pos"])}}


def _checkpoint_state(params, opt_state) -> dict:
    return {"params": params, "opt_state": opt_state}


def refuse_legacy_checkpoint(npz_path: str, ckpt_dir: str) -> None:
    """Raise UserError when ``npz_path`` holds a checkpoint of an earlier version (one numpy .npz file).

    This version neither reads nor silently skips such a file: restarting the job from epoch 0 beside it would hide
    that the saved epochs are thrown away, so the user decides (delete it, or finish the job with the earlier
    commit)."""
    if os.path.isfile(npz_path):
        raise UserError(f"found {npz_path}, a checkpoint of an earlier version (one .npz file), which this version "
                        f"cannot resume (its checkpoints are orbax directories, here {ckpt_dir}); delete it to "
                        f"restart this job from epoch 0, or finish the job with the commit that wrote it")


def _open_checkpointer(path: str, read_only: bool = False) -> ckpt.Checkpointer:
    if os.path.isfile(path):  # e.g. an old caller still passing a .npz path
        raise UserError(f"checkpoint path {path} is a file (a .npz checkpoint of an earlier version?); checkpoints "
                        f"are now orbax directories: pass a directory path, and delete or move the file")
    # Synchronous saves: the state is a few small matrices, written every few epochs, so a background write would
    # save nothing measurable, while a save finished on return is on disk when a callback raises or the job is
    # killed right after it.
    return ckpt.Checkpointer(path, keep_last=CKPT_KEEP, async_save=False, read_only=read_only)


def has_checkpoint(path: str) -> bool:
    """Whether the checkpoint directory ``path`` holds a completed step (an unfinished save does not count)."""
    return os.path.isdir(path) and any(d.isdigit() for d in os.listdir(path))


def checkpoint_progress(path: str) -> tuple[int, int] | None:
    """``(epoch, n_epochs)`` of the newest checkpoint in directory ``path`` (only its meta record is read), None
    when there is none. Raises DamagedCheckpoint when that record cannot be read."""
    if not has_checkpoint(path):
        return None
    ck = _open_checkpointer(path, read_only=True)
    try:
        step = ck.latest_step()
        if step is None:
            return None
        meta = ck.read_meta(step)
        return int(meta["epoch"]), int(meta["config"]["n_epochs"])
    finally:
        ck.close()


def remove_checkpoint(path: str) -> None:
    """Delete the checkpoint directory ``path`` (a finished job's in-job checkpoints)."""
    shutil.rmtree(path, ignore_errors=True)


def _save_checkpoint(ck: ckpt.Checkpointer, cfg: TrainConfig, epoch: int, params, opt_state, rng_states: list[dict],
                     hist: np.ndarray, mhist: np.ndarray, stopped: np.ndarray, active: np.ndarray) -> None:
    """Save the state after ``epoch`` completed epochs as step ``epoch``: the arrays (params, optimiser state) as
    the state item, everything else (the config, every run's numpy RNG state, curves, stop flags) in the meta
    record."""
    meta = {"config": dataclasses.asdict(cfg), "epoch": int(epoch),
            "rng_states": [_rng_state_to_json(s) for s in rng_states],
            "epoch_loss": _floats_to_json(hist), "epoch_mass": _floats_to_json(mhist),
            "stopped_epoch": [int(v) for v in stopped], "active": [bool(v) for v in active]}
    ck.save(epoch, _checkpoint_state(params, opt_state), meta)


def _check_config(meta: dict, cfg: TrainConfig, directory: str) -> None:
    """Refuse (one line) a checkpoint written for another config, naming the fields that differ."""
    saved, now = meta["config"], json.loads(_config_json(cfg))
    if json.dumps(saved, sort_keys=True) != _config_json(cfg):
        diffs = "; ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in sorted(set(saved) | set(now))
                          if saved.get(k) != now.get(k))
        raise UserError(f"checkpoint {directory} was written for another config ({diffs}); delete it to start "
                        f"afresh")


def _restore_checkpoint(path: str, cfg: TrainConfig, params, opt_state):
    """``(checkpointer, restored)``: the checkpointer of directory ``path`` and, when it holds a checkpoint, the
    newest intact one as ``(epoch, params, opt_state, rng_states, hist, mhist, stopped, active)`` (else None).

    The config is checked on the meta record before any array is read (another config can have other shapes), and
    the arrays are restored into the fresh state's structure. A damaged newer step is named in a warning and moved
    to ``damaged_checkpoints/`` beside the directory, as the main trainer does, so that this run can save that
    step again."""
    ck = _open_checkpointer(path)
    state = _checkpoint_state(params, opt_state)
    fresh = ckpt.abstract_target(state, jax.tree.map(lambda x: x.sharding, state))

    def target(meta: dict) -> tuple[dict, None]:
        _check_config(meta, cfg, ck.directory)
        return fresh, None

    damaged: list[int] = []
    found = ck.restore_newest_intact(target, on_damaged=lambda step, _: damaged.append(step))
    if damaged:
        ck.close()
        for step in damaged:
            dest = rundir.move_damaged(ck.directory, step)
            print(f"warning: moved the damaged checkpoint step {step} to {dest}", file=sys.stderr, flush=True)
        ck = _open_checkpointer(path)
    if found is None:
        return ck, None
    _, state, meta = found
    return ck, (int(meta["epoch"]), state["params"], state["opt_state"],
                [_rng_state_from_json(s) for s in meta["rng_states"]], _floats_from_json(meta["epoch_loss"]),
                _floats_from_json(meta["epoch_mass"]), np.asarray(meta["stopped_epoch"]),
                np.asarray(meta["active"], bool))


def train(cfg: TrainConfig, log_every: int = 0, log: Callable[[str], None] = print,
          callback: Callable[[int, dict], None] | None = None, ckpt_path: str | None = None,
          ckpt_every: int = 0) -> TrainResult:
    """Train all runs of a cell. Each seed's data stream is ``RandomState(seed)``.

    ``callback(epoch, params)`` (optional) is called with the stacked params after every epoch (epoch is 1-based)
    and once before training with epoch 0 (with the resumed epoch instead, after a resume).

    Early stop: with ``stop_loss`` set, a run stops after 1-based epoch n if ``(n - 1) % stop_check_every == 0`` and
    its epoch-average loss is <= stop_loss. ``stop_check_every = 100`` is exactly the reference notebooks' rule:
    they break when ``running_loss / n_batches <= stop_loss`` with ``running_loss`` summed over the epochs since the
    last reset every 100 epochs, a sum of positive epoch averages that can first pass at a block's first epoch.

    Checkpoints: ``ckpt_path`` is a checkpoint directory (``training/checkpoint.py``'s Checkpointer, the last
    ``CKPT_KEEP`` steps kept). Every ``ckpt_every`` epochs the full state (params, optimiser state, every run's numpy
    RNG state, curves, stop flags) is saved there atomically as step = epoch; if it holds a checkpoint when training
    starts, training resumes from the newest intact one and gives the same result as an uninterrupted run. One
    written for another config is refused (UserError). The caller removes it when done (:func:`remove_checkpoint`).
    """
    cfg.validate()
    params, opt, opt_state = init_runs(cfg)
    shared = cfg.fixed_alpha is not None
    epoch_fn = make_epoch_fn(cfg, opt, shared)
    rngs = [np.random.RandomState(s) for s in cfg.seeds]
    R = cfg.n_runs
    alpha = jnp.asarray(cfg.fixed_alpha if shared else [0.0] * R, jnp.float32)
    active = np.ones(R, bool)
    hist = np.full((R, cfg.n_epochs), np.nan)
    mhist = np.full((R, cfg.n_epochs), np.nan)
    stopped = np.full(R, cfg.n_epochs)
    start = 0
    ck = None
    if ckpt_path is not None:
        ck, restored = _restore_checkpoint(ckpt_path, cfg, params, opt_state)
        if restored is not None:
            start, params, opt_state, states, hist, mhist, stopped, active = restored
            for r, st in zip(rngs, states):
                r.set_state(st)
            log(f"  resumed from {ckpt_path} at epoch {start}/{cfg.n_epochs}")
    t0 = time.time()

    def make_epoch_data():
        # The RNG states before drawing, so that a checkpoint taken while this epoch is prefetched can replay it.
        states = [r.get_state(legacy=False) for r in rngs]
        b = [qdata.generate_batches(r, cfg.batches_per_epoch, cfg.batch_size, cfg.seq_len, shared) for r in rngs]
        return states, (b[0] if shared else np.stack(b))

    # Host data generation (numpy, mostly GIL-free) runs in a worker thread one epoch ahead of the jitted epoch, so
    # the two overlap on a 2-core machine. The RNG streams are consumed in the same order as a sequential loop.
    if callback is not None:
        callback(start, params)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        next_data = pool.submit(make_epoch_data)
        for ep in range(start, cfg.n_epochs):
            if not active.any():
                break
            batches = jnp.asarray(next_data.result()[1])
            if ep + 1 < cfg.n_epochs:
                next_data = pool.submit(make_epoch_data)
            params, opt_state, losses, masses = epoch_fn(params, opt_state, batches, alpha, jnp.asarray(active))
            ep_loss = np.asarray(losses).mean(axis=1)
            hist[active, ep] = ep_loss[active]
            mhist[active, ep] = np.asarray(masses).mean(axis=1)[active]
            if cfg.stop_loss is not None and ep % cfg.stop_check_every == 0:
                newly = active & (ep_loss <= cfg.stop_loss)
                stopped[newly] = ep + 1
                active &= ~newly
            if callback is not None:
                callback(ep + 1, params)
            if log_every and ((ep + 1) % log_every == 0 or ep == 0):
                log(f"  epoch {ep + 1}/{cfg.n_epochs} loss {np.array2string(ep_loss, precision=4)} "
                    f"mass {np.array2string(mhist[:, ep], precision=3)} ({time.time() - t0:.1f}s)")
            if ck is not None and ckpt_every and (ep + 1) % ckpt_every == 0 and ep + 1 < cfg.n_epochs:
                _save_checkpoint(ck, cfg, ep + 1, params, opt_state, next_data.result()[0], hist, mhist, stopped,
                                 active)
    finally:
        pool.shutdown(wait=True)
        if ck is not None:  # saves are synchronous: nothing is pending, this only frees the manager
            ck.close()
    return TrainResult(cfg, params, hist, mhist, stopped, time.time() - t0)


def _eval_fn(params, tokens, targets):
    logits, attn = qmodel.forward(params, tokens)
    mask = qdata.distinct_mask(tokens)
    return {
        "mass": qm.relevant_mass(attn, mask),
        "prob": qm.true_label_prob(logits, targets),
        "sep": qm.separability(attn, mask),
        "correct": jnp.argmax(logits, -1) == targets,
        "nll": optax.softmax_cross_entropy_with_integer_labels(logits, targets),
        "attn": attn,
    }


_eval_all = jax.jit(jax.vmap(_eval_fn))


def evaluate(params, seeds: Sequence[int], n_batches: int, batch_size: int, seq_len: int,
             eval_seed_offset: int = 1_000_000) -> dict[str, np.ndarray]:
    """Evaluate stacked params [R, ...] on fresh test batches from ``RandomState(seed + eval_seed_offset)``.

    Returns per-run arrays [R, N] (N = n_batches * batch_size): mass (distinct-token attention), prob (true-label
    probability), sep (separability), correct, nll; plus tokens [R, N, T] and attn [R, N, T].
    """
    seqs = np.stack([qdata.generate_batches(np.random.RandomState(s + eval_seed_offset), n_batches, batch_size,
                                            seq_len).reshape(-1, seq_len) for s in seeds])
    x, y = qdata.split(seqs)
    out = {k: np.asarray(v) for k, v in _eval_all(params, jnp.asarray(x), jnp.asarray(y)).items()}
    out["tokens"] = x
    return out


def summarise(ev: dict[str, np.ndarray], tau_att: float = 0.5, tau_conf: float = 0.5) -> dict[str, float]:
    """Mean and across-run std of the scalar metrics of :func:`evaluate`, plus AC/ACMC at the given thresholds."""
    per_run = {
        "loss": ev["nll"].mean(1),
        "acc": 100.0 * ev["correct"].mean(1),
        "distinct_mass": ev["mass"].mean(1),
        "separability": np.nanmean(ev["sep"], 1),
        "AC": np.array([qm.attention_concentration(m, tau_att) for m in ev["mass"]]),
        "ACMC": np.array([qm.acmc(m, p, tau_att, tau_conf) for m, p in zip(ev["mass"], ev["prob"])]),
    }
    out = {}
    for k, v in per_run.items():
        out[k] = float(np.mean(v))
        out[k + "_std"] = float(np.std(v))
    return out
