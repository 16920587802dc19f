"""MQAR experiments: `python train.py --config=configs/mqar.py:VARIANT,LEVEL --workdir=DIR`, e.g. `coupled_euler,easy`.

The levels are `coupled_qk_jax.data.mqar.LEVELS` (see docs/mqar.md): (seq_len L, num_kv_pairs N, d_model) =
easy (64, 4, 64), medium (128, 8, 64), hard (256, 16, 64), vocabulary 512, fillers off, zoology's fixed batch order.
The run is an ordinary run of the training loop (`training/loop.py`, `cfg.task = "mqar"`): its data (zoology-order
batches) and its metric (accuracy per segment on the labelled positions) are the loop's MQAR task plug-in
(`training/tasks.py`), so checkpoints, exact resume, SIGTERM saves and seed-parallel runs (`train.num_seeds`) work
as for language models.

The model follows zoology's MQAR setting: 2 layers, attention only (`model.d_ff=0`: no block MLP, so recall has to
happen in attention), learned absolute positions, width `d_model` of the level, context = L. Two heads (head dim 32)
rather than one so that Differential Attention, which pairs heads, runs at the same shape as every other variant.

Training: AdamW, linear warm-up (5% of the run) then cosine decay over `mqar.epochs` epochs. The loop's schedule
fields are ml_collections FieldReferences of the MQAR fields, so they follow any command-line override with no
extra call:

    mqar.steps_per_epoch = ceil(mqar.num_train / train.batch_size)
    train.steps          = mqar.epochs * mqar.steps_per_epoch
    train.warmup_steps   = train.steps // 20
    train.eval_every     = mqar.eval_every_epochs * mqar.steps_per_epoch
    checkpoint.every     = mqar.steps_per_epoch          (one checkpoint per epoch)

Setting one of the derived fields itself (e.g. `--config.train.steps=100`) replaces the reference by that number.
Zoology trains 64 epochs; the default of 16 here is sized for a 2-core CPU.
"""

from __future__ import annotations

import ml_collections

from configs import lm
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.data import mqar
from coupled_qk_jax.training.config import MQARConfig, configdict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, _, level_name = (arg or "standard,easy").partition(",")
    level_name = level_name or "easy"
    if level_name not in mqar.LEVELS:
        raise ValueError(f"config arg: unknown MQAR level {level_name!r}; expected one of {sorted(mqar.LEVELS)}")
    level = mqar.LEVELS[level_name]
    d_model, n_heads = level.d_model, 2
    head_dim = d_model // n_heads

    # The loop's train / checkpoint / mesh blocks are configs/lm.py's, MQAR-sized below; the data block holds only
    # what the MQAR task reads (its data is generated).
    cfg = lm.get_config(f"{variant},tiny")
    cfg.task = "mqar"
    del cfg.scale
    cfg.model = configdict(ModelConfig(
        variant=variant, vocab_size=level.vocab_size, max_len=level.seq_len, d_model=d_model, n_layers=2,
        n_heads=n_heads, d_ff=0,  # attention-only
        coupling_hidden=3 * head_dim // 4, affine_hidden=3 * head_dim // 4))
    cfg.data = ml_collections.ConfigDict(dict(seq_len=level.seq_len, num_threads=1))
    # level: choose it with the config argument (it also sets the model's shape); num_train / num_test: the level's
    # segment sizes; steps_per_epoch: derived below.
    cfg.mqar = configdict(MQARConfig(level=level_name, num_train=level.num_train, num_test=level.num_test))
    cfg.train.update(batch_size=level.train_batch_size, lr=3e-3)
    bs = cfg.train.get_ref("batch_size")
    cfg.mqar.steps_per_epoch = (cfg.mqar.get_ref("num_train") + bs - 1) // bs
    spe = cfg.mqar.get_ref("steps_per_epoch")
    cfg.train.steps = cfg.mqar.get_ref("epochs") * spe
    cfg.train.warmup_steps = cfg.train.get_ref("steps") // 20  # MQAR from a random init is unstable at peak lr
    cfg.train.eval_every = cfg.mqar.get_ref("eval_every_epochs") * spe
    cfg.checkpoint.every = spe
    return cfg
