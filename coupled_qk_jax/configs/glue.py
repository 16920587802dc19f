"""GLUE fine-tuning: `--config=configs/glue.py:VARIANT,SCALE,TASK`, e.g. `coupled_euler,60m,sst2`.

    python train.py --config=configs/glue.py:coupled_euler,60m,sst2 --workdir=runs/sst2_ce \
        --config.train.init_from=runs/60m_ce --config.data.corpus=glue:sst2:glue_data
    python eval.py --workdir=runs/sst2_ce --split=test        # GLUE's submission file, runs/sst2_ce/eval/SST-2.tsv

The model block is configs/lm.py's VARIANT,SCALE (the shape of the run named by train.init_from, which must match)
plus a classification head of the task's width (model.num_labels; 1 = STS-B's regression) on the final hidden state
of each example's last token. data.corpus is `glue:TASK` (the Hugging Face hub) unless given as `glue:TASK:DIR` (GLUE's
TSV folder or a save_to_disk folder, coupled_qk_jax/data/glue.py); the tokenizer is the init_from run's. Three epochs
of the task's train split at batch 32 and lr 5e-5 with a 6% warm-up (BERT's recipe; the step count comes from GLUE's
published train sizes), validation twice an epoch, and the checkpoint with the lowest validation loss kept besides
the last (checkpoint.keep_best).
"""

from __future__ import annotations

import math

import ml_collections

from coupled_qk_jax.configs import lm
from coupled_qk_jax.data.glue import get_task
from coupled_qk_jax.errors import UserError

# Examples in each task's train split (GLUE's release): what the step count of three epochs is computed from.
TRAIN_EXAMPLES = {"cola": 8551, "sst2": 67349, "mrpc": 3668, "stsb": 5749, "qqp": 363846, "mnli": 392702,
                  "qnli": 104743, "rte": 2490, "wnli": 635}
EPOCHS, BATCH, LR, SEQ_LEN = 3, 32, 5e-5, 128


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    parts = (arg or "standard,tiny,sst2").split(",")
    if len(parts) != 3:
        raise UserError(f"configs/glue.py takes VARIANT,SCALE,TASK (e.g. coupled_euler,60m,sst2), got {arg!r}")
    variant, scale, name = parts
    task = get_task(name)
    cfg = lm.get_config(f"{variant},{scale}")
    cfg.task = "glue"
    cfg.model.num_labels = task.num_labels
    cfg.data.corpus = f"glue:{task.name}"
    cfg.data.seq_len = min(SEQ_LEN, cfg.model.max_len)
    steps = math.ceil(EPOCHS * TRAIN_EXAMPLES[task.name] / BATCH)
    per_epoch = steps // EPOCHS
    cfg.train.update(steps=steps, batch_size=BATCH, lr=LR, warmup_steps=max(1, round(0.06 * steps)),
                     log_every=max(1, per_epoch // 20), eval_every=max(1, per_epoch // 2), eval_batches=0,
                     weight_decay=0.01)
    cfg.checkpoint.update(every=max(1, per_epoch // 2), keep_best="validation_loss")
    return cfg
