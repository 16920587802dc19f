"""Language-model experiments: `--config=configs/lm.py:VARIANT,SCALE`, e.g. `coupled_euler,tiny`.

Every field is an ordinary ConfigDict entry that can be overridden on the command line
(`--config.model.n_steps=3 --config.train.steps=200`). Variants: see coupled_qk_jax/config.py.

Scales. `tiny` and `small` are ours, sized for 2 CPU cores. The paper's 60M/150M/350M shapes are not published;
ours are GPT-2-style assumptions with vocab 50304 and context 1024 (parameter counts include the tied embedding):

    scale   d_model layers heads d_ff   vocab  ctx   params (standard)
    tiny    128     4      4     512    2048   256   ≈1.1M
    small   256     8      4     1024   16384  256   ≈10.6M
    60m     512     10     8     2048   50304  1024  ≈57.8M
    150m    768     16     12    3072   50304  1024  ≈153M
    350m    1024    24     16    4096   50304  1024  ≈355M

Accelerator scales (60m and up) are set for a TPU pod or a GPU node, not for this CPU:
- bf16 compute, float32 parameters and optimiser state (model.dtype; coupled_qk_jax/precision.py);
- a global batch of 256 sequences (262,144 tokens; 512 at 350m) that divides every power-of-two slice up to 256
  chips, and train.steps for about 20 tokens per parameter (Chinchilla) at that batch;
- evaluation every 500 steps on the first 64 validation batches (~4% of the training FLOPs between them; the whole
  split is scored at the end and by eval.py), a checkpoint every 20 minutes of training (and at the end, and on
  SIGTERM), not every N steps.

Coupling MLP width: hidden = 3/4 · d_head. At 60m (d_head 64, hidden 48, one f per layer shared by its heads)
the coupled variants add 10 · (2·64·48 + 48 + 64 + 8 Δt) = 62,640 parameters = 0.108% — the paper's 0.11%.
"""

from __future__ import annotations

import ml_collections

from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig, RuntimeConfig
from coupled_qk_jax.errors import UserError, did_you_mean
from coupled_qk_jax.training.config import CheckpointConfig, DataConfig, MeshConfig, TrainConfig, configdict

SCALES = {
    #         d_model layers heads d_ff  vocab  max_len batch lr    steps
    "tiny": (128, 4, 4, 512, 2048, 256, 16, 3e-3, 2000),
    "small": (256, 8, 4, 1024, 16384, 256, 16, 1e-3, 2000),
    "60m": (512, 10, 8, 2048, 50304, 1024, 256, 6e-4, 4500),
    "150m": (768, 16, 12, 3072, 50304, 1024, 256, 3e-4, 12000),
    "350m": (1024, 24, 16, 4096, 50304, 1024, 512, 3e-4, 13500),
    # GPT-2 124M's shape, to continue a checkpoint imported by coupled_qk_jax.convert (train.init_from): LayerNorm,
    # projection biases and Δt starting at 0, where the coupling leaves the imported function unchanged.
    "gpt2": (768, 12, 12, 3072, 50257, 1024, 32, 1e-4, 2000),
}
ACCELERATOR_EVAL_BATCHES = 64  # periodic validation batches from 60m up (the whole split at the end)
ACCELERATOR_CHECKPOINT_SECONDS = 1200.0  # a preemption without notice loses at most this much training


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, _, scale = (arg or "standard,tiny").partition(",")
    scale = scale or "tiny"
    if scale not in SCALES:
        raise UserError(f"configs/lm.py: unknown scale {scale!r}{did_you_mean(scale, SCALES)}; expected one of "
                        f"{', '.join(SCALES)}")
    if variant not in ALL_VARIANTS:
        raise UserError(f"configs/lm.py: unknown variant {variant!r}{did_you_mean(variant, ALL_VARIANTS)}; expected "
                        f"one of {', '.join(ALL_VARIANTS)}")
    d_model, n_layers, n_heads, d_ff, vocab, max_len, batch, lr, steps = SCALES[scale]
    head_dim = d_model // n_heads

    cfg = ml_collections.ConfigDict()
    cfg.task = "lm"  # the loop's data + metric plug-in (training/tasks.py): "lm" or "mqar" (configs/mqar.py)
    cfg.scale = scale

    # Every block is its dataclass's defaults (where each field is documented: coupled_qk_jax/config.py for the
    # model, coupled_qk_jax/training/config.py for the rest) with this scale's values.
    small = scale in ("tiny", "small")
    cfg.model = configdict(ModelConfig(
        variant=variant, vocab_size=vocab, max_len=max_len, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        d_ff=d_ff, coupling_hidden=3 * head_dim // 4, affine_hidden=3 * head_dim // 4,
        dtype="float32" if small else "bfloat16"))
    # How the model is computed (may change on resume): scanned layers from 60m up, where compile time would grow
    # with depth.
    cfg.runtime = configdict(RuntimeConfig(scan_layers=not small))
    if scale == "gpt2":
        cfg.model.update(norm="layernorm", attn_bias=True, dt_init=0.0)
    cfg.data = configdict(DataConfig(seq_len=max_len))
    if small:
        cfg.train = configdict(TrainConfig(steps=steps, batch_size=batch, lr=lr))
        cfg.checkpoint = configdict(CheckpointConfig())
    else:
        cfg.train = configdict(TrainConfig(steps=steps, batch_size=batch, lr=lr, warmup_steps=steps // 50,
                                           eval_batches=ACCELERATOR_EVAL_BATCHES))
        cfg.checkpoint = configdict(CheckpointConfig(every=steps, every_seconds=ACCELERATOR_CHECKPOINT_SECONDS))
    cfg.mesh = configdict(MeshConfig())
    return cfg
