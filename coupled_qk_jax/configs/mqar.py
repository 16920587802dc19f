"""MQAR experiments: `python train.py --config=configs/mqar.py:VARIANT,LEVEL[,PROTOCOL] --workdir=DIR`, e.g.
`coupled_euler,easy` (the CPU protocol) or `standard,medium,zoology` (zoology's ICLR'24 Figure-2 protocol).

The levels are `coupled_qk_jax.data.mqar.PROTOCOLS[PROTOCOL]` (see docs/mqar.md): (seq_len L, num_kv_pairs N) =
easy (64, 4), medium (128, 8), hard (256, 16), fillers off. The run is an ordinary run of the training loop
(`training/loop.py`, `cfg.task = "mqar"`): its data and its metric (accuracy per segment on the labelled positions) are
the loop's MQAR task plug-in (`training/tasks.py`), so checkpoints, exact resume, SIGTERM saves and seed-parallel runs
(`train.num_seeds`) work as for language models.

Splits: train, validation (`mqar.num_valid`, seeds of its own, disjoint from train and test by content) and test.
Every periodic evaluation, early stopping and checkpoint selection read the validation split; the test split is
scored once per seed, at its selected checkpoint (`experiments/select_test.py`), which is why every evaluated
checkpoint is kept (`checkpoint.keep_every = train.eval_every`). The seed sets the initial weights and the order of
the training examples, reshuffled every epoch (`mqar.shuffle`; False = zoology's stored order for every seed).

Protocols:

    setting              cpu (default)                          zoology (ICLR'24 Figure 2)
    vocabulary           512                                    8192
    train / valid / test 10,000 / 1,000 / 1,000 (easy),         100,000 / 3,000 / 3,000 per level
                         5,000 (medium), 2,500 (hard) train
    batch (train = test) 64 / 32 / 16 (test 250 / 125 / 100)    512 / 512 / 256
    heads                2 (head dim 32)                        1 (2 for Differential scoring, which pairs heads)
    dropout              0                                      0.1
    width                64                                     64 (a sweep axis: --grid model.d_model=64,128,256,512)
    optimiser            AdamW b2 0.95, clip 1.0, 5% warm-up    AdamW b2 0.999, no clipping, no warm-up
    schedule             per-step cosine to 10% of the peak     per-epoch cosine to 0 (torch CosineAnnealingLR,
                                                                T_max = epochs, stepped once an epoch)
    epochs, evaluation   16, every 2 epochs                     64, every epoch; stop at validation accuracy 0.99

Zoology's lr grid (np.logspace(-4, -2, 4)) is `ZOOLOGY_LRS`. The model follows zoology's MQAR setting in both: 2
layers, attention only (`model.d_ff=0`: no block MLP, so recall has to happen in attention), learned absolute
positions, context = L. The coupling and affine hidden widths (3/4 of the head dim) follow `model.d_model` and
`model.n_heads` on the command line.

The loop's schedule fields are ml_collections FieldReferences of the MQAR fields, so they follow any command-line
override with no extra call:

    mqar.steps_per_epoch = ceil(mqar.num_train / train.batch_size)
    train.steps          = mqar.epochs * mqar.steps_per_epoch
    train.warmup_steps   = train.steps // 20                (cpu; 0 for zoology)
    train.eval_every     = mqar.eval_every_epochs * mqar.steps_per_epoch
    checkpoint.every     = mqar.steps_per_epoch          (one checkpoint per epoch)
    checkpoint.keep_every = train.eval_every             (every evaluated checkpoint is kept, for selection)
    train.schedule_every = mqar.steps_per_epoch          (zoology only: the lr changes once an epoch)

Setting one of the derived fields itself (e.g. `--config.train.steps=100`) replaces the reference by that number.
Zoology trains 64 epochs; the cpu protocol's default of 16 is sized for a 2-core CPU.
"""

from __future__ import annotations

import ml_collections

from coupled_qk_jax.configs import lm
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.data import mqar
from coupled_qk_jax.training.config import MQARConfig, configdict


# Zoology's Figure-2 learning rates, np.logspace(-4, -2, 4) (experiments/iclr24_zoology_figure2/configs.py).
ZOOLOGY_LRS = (1e-4, 4.6415888336127773e-4, 2.154434690031882e-3, 1e-2)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, _, rest = (arg or "standard,easy").partition(",")
    level_name, _, protocol = rest.partition(",")
    level_name, protocol = level_name or "easy", protocol or "cpu"
    if protocol not in mqar.PROTOCOLS:
        raise ValueError(f"config arg: unknown MQAR protocol {protocol!r}; expected one of {sorted(mqar.PROTOCOLS)}")
    levels = mqar.PROTOCOLS[protocol]
    if level_name not in levels:
        raise ValueError(f"config arg: unknown MQAR level {level_name!r}; expected one of {sorted(levels)}")
    level = levels[level_name]
    zoology = protocol == "zoology"
    differential = "differential" in variant
    # Zoology's attention has one head; Differential Attention pairs heads, so it needs two.
    n_heads = 2 if (differential or not zoology) else 1

    # The loop's train / checkpoint / mesh blocks are configs/lm.py's, MQAR-sized below; the data block holds only
    # what the MQAR task reads (its data is generated).
    cfg = lm.get_config(f"{variant},tiny")
    cfg.task = "mqar"
    del cfg.scale
    cfg.model = configdict(ModelConfig(
        variant=variant, vocab_size=level.vocab_size, max_len=level.seq_len, d_model=level.d_model, n_layers=2,
        n_heads=n_heads, d_ff=0,  # attention-only
        dropout=0.1 if zoology else 0.0))
    # 3/4 of the head dim, following d_model and n_heads when they are overridden (a width sweep).
    hidden = cfg.model.get_ref("d_model") // cfg.model.get_ref("n_heads") * 3 // 4
    cfg.model.coupling_hidden = hidden
    cfg.model.affine_hidden = hidden
    cfg.data = ml_collections.ConfigDict(dict(seq_len=level.seq_len, num_threads=1))
    # level, protocol: choose them with the config argument (they also set the model's shape); num_*: the level's
    # segment sizes; steps_per_epoch: derived below.
    cfg.mqar = configdict(MQARConfig(level=level_name, protocol=protocol, epochs=64 if zoology else 16,
                                     num_train=level.num_train, num_valid=level.num_valid, num_test=level.num_test,
                                     eval_every_epochs=1 if zoology else 2))
    cfg.train.update(batch_size=level.train_batch_size, lr=ZOOLOGY_LRS[2] if zoology else 3e-3)
    bs = cfg.train.get_ref("batch_size")
    cfg.mqar.steps_per_epoch = (cfg.mqar.get_ref("num_train") + bs - 1) // bs
    spe = cfg.mqar.get_ref("steps_per_epoch")
    cfg.train.steps = cfg.mqar.get_ref("epochs") * spe
    cfg.train.eval_every = cfg.mqar.get_ref("eval_every_epochs") * spe
    cfg.checkpoint.every = spe * 1  # derived: setting it must not set mqar.steps_per_epoch (the same reference)
    # The selected checkpoint must survive. `* 1` makes a derived reference: setting keep_every on the command line
    # then replaces only it (the bare reference would be train.eval_every itself, and setting one would set both).
    cfg.checkpoint.keep_every = cfg.train.get_ref("eval_every") * 1
    if zoology:
        cfg.train.schedule_every = spe * 1  # a derived reference, as keep_every
        # torch AdamW (betas 0.9, 0.999; eps 1e-8; weight decay 0.1), no clipping, CosineAnnealingLR(T_max=epochs,
        # eta_min=0) stepped after every epoch, and zoology's early stop: accuracy above 0.99 (on validation here).
        cfg.train.update(b2=0.999, grad_clip=0.0, warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.1)
        cfg.train.early_stop.update(metric="valid/accuracy", mode="max", threshold=0.99)
    else:
        cfg.train.warmup_steps = cfg.train.get_ref("steps") // 20  # MQAR from a random init is unstable at peak lr
    return cfg
