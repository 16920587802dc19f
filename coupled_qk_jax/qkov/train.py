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
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from coupled_qk_jax.qkov import data as qdata
from coupled_qk_jax.qkov import metrics as qm
from coupled_qk_jax.qkov import model as qmodel

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


def _save_checkpoint(path: str, cfg: TrainConfig, epoch: int, params, opt_state, rng_states, hist, mhist, stopped,
                     active) -> None:
    """Atomically write the state after ``epoch`` completed epochs (numpy .npz, written to a temp file, renamed)."""
    arrays = {f"leaf_{i}": np.asarray(v) for i, v in enumerate(jax.tree.leaves((params, opt_state)))}
    arrays.update(
        config=np.array(_config_json(cfg)), epoch=np.array(epoch), hist=hist, mhist=mhist, stopped=stopped,
        active=active, rng_keys=np.stack([st[1] for st in rng_states]),
        rng_pos=np.array([st[2] for st in rng_states]), rng_has_gauss=np.array([st[3] for st in rng_states]),
        rng_gauss=np.array([st[4] for st in rng_states]))
    tmp = f"{path}.tmp{os.getpid()}.npz"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _load_checkpoint(path: str, cfg: TrainConfig, params, opt_state):
    """State saved by :func:`_save_checkpoint`, checked against ``cfg`` and the fresh state's structure."""
    with np.load(path) as z:
        saved = {k: z[k] for k in z.files}
    if str(saved["config"]) != _config_json(cfg):
        raise ValueError(f"checkpoint {path} was written for another config; delete it to start afresh\n"
                         f"  saved:   {saved['config']}\n  current: {_config_json(cfg)}")
    leaves, treedef = jax.tree.flatten((params, opt_state))
    new = []
    for i, ref in enumerate(leaves):
        v = saved[f"leaf_{i}"]
        if v.shape != np.shape(ref):
            raise ValueError(f"checkpoint {path}: leaf {i} has shape {v.shape}, expected {np.shape(ref)}")
        new.append(jnp.asarray(v, dtype=jnp.asarray(ref).dtype))
    params, opt_state = jax.tree.unflatten(treedef, new)
    rng_states = [("MT19937", k, int(p), int(h), float(g)) for k, p, h, g in
                  zip(saved["rng_keys"], saved["rng_pos"], saved["rng_has_gauss"], saved["rng_gauss"])]
    return (int(saved["epoch"]), params, opt_state, rng_states, saved["hist"], saved["mhist"], saved["stopped"],
            saved["active"].astype(bool))


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

    Checkpoints: with ``ckpt_path``, the full state (params, optimiser state, every run's numpy RNG state, curves,
    stop flags) is written there atomically every ``ckpt_every`` epochs; if the file exists when training starts,
    training resumes from it and gives the same result as an uninterrupted run. The caller deletes it when done.
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
    if ckpt_path is not None and os.path.exists(ckpt_path):
        start, params, opt_state, states, hist, mhist, stopped, active = _load_checkpoint(
            ckpt_path, cfg, params, opt_state)
        for r, st in zip(rngs, states):
            r.set_state(st)
        log(f"  resumed from {ckpt_path} at epoch {start}/{cfg.n_epochs}")
    t0 = time.time()

    def make_epoch_data():
        # The RNG states before drawing, so that a checkpoint taken while this epoch is prefetched can replay it.
        states = [r.get_state() for r in rngs]
        b = [qdata.generate_batches(r, cfg.batches_per_epoch, cfg.batch_size, cfg.seq_len, shared) for r in rngs]
        return states, (b[0] if shared else np.stack(b))

    # Host data generation (numpy, mostly GIL-free) runs in a worker thread one epoch ahead of the jitted epoch, so
    # the two overlap on a 2-core machine. The RNG streams are consumed in the same order as a sequential loop.
    if callback is not None:
        callback(start, params)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
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
        if ckpt_path is not None and ckpt_every and (ep + 1) % ckpt_every == 0 and ep + 1 < cfg.n_epochs:
            _save_checkpoint(ckpt_path, cfg, ep + 1, params, opt_state, next_data.result()[0], hist, mhist,
                             stopped, active)
    pool.shutdown(wait=True)
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
