"""The optimiser: AdamW with linear warm-up + cosine decay, global-norm clipping, a weight-decay mask and
per-circuit learning-rate multipliers (optax).

Parameter groups are read off the parameter path (a pure dict from `nnx.to_pure_dict`):

    qk        W_Q, W_K                          lr × train.qk_lr_mult
    ov        W_V, W_O                          lr × train.ov_lr_mult
    coupling  f's params and Δt (coupled / mlp_only), the affine nets   lr × qk_lr_mult if train.qk_mult_coupling
    other     everything else                   lr

A group's multiplier scales that group's whole AdamW update (Adam direction and decoupled decay alike), which is
exactly a per-group learning rate; a multiplier of 0 freezes the group. Weight decay applies to matrices only:
norms, biases, Δt and DiffAttn's λ vectors are not decayed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from coupled_qk_jax.training.config import TrainConfig

QK_NAMES = {"wq", "wk"}
OV_NAMES = {"wv", "wo"}
COUPLING_PARENTS = {"coupling", "shared_coupling", "affine"}
DECAYED_NAMES = {"wq", "wk", "wv", "wo", "w_in", "w_out", "w1", "w2", "embed", "pos_embed",
                 "q_net_w1", "q_net_w2", "k_net_w1", "k_net_w2"}


def _names(path) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]


def param_group(path) -> str:
    names = _names(path)
    leaf = names[-1]
    if leaf in QK_NAMES:
        return "qk"
    if leaf in OV_NAMES:
        return "ov"
    if leaf == "dt" or COUPLING_PARENTS.intersection(names[:-1]):
        return "coupling"
    return "other"


def param_groups(params: Any) -> Any:
    """A tree of group labels ('qk' | 'ov' | 'coupling' | 'other') with the structure of `params`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_group(path), params)


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: weight matrices and embeddings, never norms, biases, Δt or λ."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _names(path)[-1] in DECAYED_NAMES, params)


def lr_multipliers(params: Any, train: TrainConfig) -> Any:
    coupling = train.qk_lr_mult if train.qk_mult_coupling else 1.0
    table = {"qk": train.qk_lr_mult, "ov": train.ov_lr_mult, "coupling": coupling, "other": 1.0}
    return jax.tree.map(lambda group: table[group], param_groups(params))


class _EmptyState(NamedTuple):
    pass


def scale_by_tree(multipliers: Any) -> optax.GradientTransformation:
    """Multiply each update leaf by a fixed Python float (stateless)."""

    def init(params):
        del params
        return _EmptyState()

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, m: u if m == 1.0 else u * m, updates, multipliers), state

    return optax.GradientTransformation(init, update)


def learning_rate_schedule(train: TrainConfig, extensions: tuple[tuple[int, int], ...] = ()) -> optax.Schedule:
    """Linear warm-up then cosine decay to ``lr * min_lr_ratio`` at ``train.steps``, read at the last multiple of
    ``train.schedule_every`` (1: every step; N: constant over each block of N steps, e.g. torch's CosineAnnealingLR
    stepped once an epoch).

    ``extensions``: the run's ``(step, old train.steps)`` pairs, in order, where a resume extended (or shortened) the
    horizon with ``--allow_change=train.steps`` (rundir.lr_extensions). The schedule is the original one, with the
    first horizon, up to the first such step; from there it decays by a cosine from the learning rate it had reached
    to the same floor at the next horizon (the last one is ``train.steps``): continuous, where simply re-reading the
    cosine at the new horizon would make the learning rate jump."""
    lr = train.lr
    floor = lr * train.min_lr_ratio
    horizons = [old for _, old in extensions] + [train.steps]
    steps = horizons[0]
    warmup = min(train.warmup_steps, max(steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1), end_value=floor)
    for (at, _), horizon in zip(extensions, horizons[1:]):
        schedule = _extended(schedule, at, horizon, floor)
    every = train.schedule_every
    if every == 1:
        return schedule
    return lambda step: schedule(step // every * every)


def _extended(schedule: optax.Schedule, at: int, horizon: int, floor: float) -> optax.Schedule:
    """``schedule`` before step ``at``; from ``at`` a cosine from ``schedule(at)`` down to ``floor`` at ``horizon``
    (held at the floor beyond it, as optax's cosine is)."""
    start = float(schedule(at))
    length = max(horizon - at, 1)

    def extended(step):
        frac = jnp.clip((step - at) / length, 0.0, 1.0)
        decayed = floor + (start - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(step < at, schedule(step), decayed)

    return extended


def make_optimizer(params: Any, train: TrainConfig,
                   extensions: tuple[tuple[int, int], ...] = ()) -> optax.GradientTransformation:
    """clip_by_global_norm (none when ``train.grad_clip`` is 0) -> adamw(schedule, decay mask) -> per-group
    multipliers (``train`` is validated: the multipliers and grad_clip are >= 0)."""
    return optax.chain(
        optax.clip_by_global_norm(train.grad_clip) if train.grad_clip > 0 else optax.identity(),
        optax.adamw(learning_rate_schedule(train, extensions), b1=train.b1, b2=train.b2, eps=train.eps,
                    weight_decay=train.weight_decay, mask=decay_mask(params)),
        scale_by_tree(lr_multipliers(params, train)),
    )
