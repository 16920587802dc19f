"""MQAR experiments: `--config=configs/mqar.py:VARIANT,LEVEL`, e.g. `coupled_euler,easy`.

The levels are `coupled_qk_jax.data.mqar.LEVELS` (see docs/mqar.md): (seq_len L, num_kv_pairs N, d_model) =
easy (64, 4, 64), medium (128, 8, 64), hard (256, 16, 64), vocabulary 512, fillers off, zoology's fixed batch order.

The model follows zoology's MQAR setting: 2 layers, attention only (`model.d_ff=0`: no block MLP, so recall has to
happen in attention), learned absolute positions, width `d_model` of the level, context = L. Two heads (head dim 32)
rather than one so that Differential Attention, which pairs heads, runs at the same shape as every other variant.

Training: AdamW, linear warm-up then cosine decay over `mqar.epochs` epochs; `train.steps` is derived from the epoch
count and the level's batches per epoch so the schedule ends with the run. Zoology trains 64 epochs; the default of
16 here is sized for a 2-core CPU. Override e.g. `--config.mqar.epochs=32` then call `finalize(cfg)` (the sweep
runner does this) to recompute `train.steps`.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.data import mqar


def finalize(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Recompute the fields derived from `mqar.epochs` and `mqar.num_train` (steps, warm-up)."""
    level = mqar.LEVELS[cfg.mqar.level]
    num_train = int(cfg.mqar.num_train or level.num_train)
    steps_per_epoch = math.ceil(num_train / level.train_batch_size)
    cfg.mqar.steps_per_epoch = steps_per_epoch
    cfg.train.steps = int(cfg.mqar.epochs) * steps_per_epoch
    # 5% warm-up, at most the first epoch: MQAR from a random init is unstable at the peak lr without it.
    cfg.train.warmup_steps = max(1, min(steps_per_epoch, cfg.train.steps // 20))
    return cfg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, _, level_name = (arg or "standard,easy").partition(",")
    level_name = level_name or "easy"
    if level_name not in mqar.LEVELS:
        raise ValueError(f"config arg: unknown MQAR level {level_name!r}; expected one of {sorted(mqar.LEVELS)}")
    level = mqar.LEVELS[level_name]
    d_model, n_heads = level.d_model, 2
    head_dim = d_model // n_heads

    cfg = ml_collections.ConfigDict()
    cfg.task = "mqar"
    # Every ModelConfig field with the library's defaults (the same as configs/lm.py), then the MQAR shape.
    model = dataclasses.asdict(ModelConfig(variant=variant))
    model.update(vocab_size=level.vocab_size, max_len=level.seq_len, d_model=d_model, n_layers=2, n_heads=n_heads,
                 d_ff=0,  # attention-only
                 coupling_hidden=3 * head_dim // 4, affine_hidden=3 * head_dim // 4)
    cfg.model = ml_collections.ConfigDict(model)
    cfg.mqar = ml_collections.ConfigDict(dict(
        level=level_name,
        epochs=16,
        num_train=0,  # 0 = the level's own num_train
        eval_every_epochs=2,
        steps_per_epoch=0,  # derived by finalize()
    ))
    cfg.train = ml_collections.ConfigDict(dict(
        steps=0,  # derived by finalize()
        batch_size=level.train_batch_size,
        grad_accum=1,
        seed=0,
        lr=3e-3,
        warmup_steps=0,  # derived by finalize()
        min_lr_ratio=0.1,
        weight_decay=0.1,
        b1=0.9, b2=0.95, eps=1e-8,
        grad_clip=1.0,
        qk_lr_mult=1.0,
        ov_lr_mult=1.0,
        qk_mult_coupling=False,
    ))
    return finalize(cfg)
