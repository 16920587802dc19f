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

Coupling MLP width: hidden = 3/4 · d_head. At 60m (d_head 64, hidden 48, one f per layer shared by its heads)
the coupled variants add 10 · (2·64·48 + 48 + 64 + 8 Δt) = 62,640 parameters = 0.108% — the paper's 0.11%.
"""

from __future__ import annotations

import ml_collections

from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.errors import UserError, did_you_mean
from coupled_qk_jax.training.config import CheckpointConfig, DataConfig, MeshConfig, TrainConfig, configdict

SCALES = {
    #         d_model layers heads d_ff  vocab  max_len batch lr
    "tiny": (128, 4, 4, 512, 2048, 256, 16, 3e-3),
    "small": (256, 8, 4, 1024, 16384, 256, 16, 1e-3),
    "60m": (512, 10, 8, 2048, 50304, 1024, 64, 6e-4),
    "150m": (768, 16, 12, 3072, 50304, 1024, 64, 3e-4),
    "350m": (1024, 24, 16, 4096, 50304, 1024, 64, 3e-4),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, _, scale = (arg or "standard,tiny").partition(",")
    scale = scale or "tiny"
    if scale not in SCALES:
        raise UserError(f"configs/lm.py: unknown scale {scale!r}{did_you_mean(scale, SCALES)}; expected one of "
                        f"{', '.join(SCALES)}")
    if variant not in ALL_VARIANTS:
        raise UserError(f"configs/lm.py: unknown variant {variant!r}{did_you_mean(variant, ALL_VARIANTS)}; expected "
                        f"one of {', '.join(ALL_VARIANTS)}")
    d_model, n_layers, n_heads, d_ff, vocab, max_len, batch, lr = SCALES[scale]
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
        scan_layers=not small))  # scanned layers from 60m up (docs/scaling.md)
    cfg.data = configdict(DataConfig(seq_len=max_len if small else 1024))
    cfg.train = configdict(TrainConfig(steps=2000 if small else 20000, batch_size=batch, lr=lr))
    cfg.checkpoint = configdict(CheckpointConfig())
    cfg.mesh = configdict(MeshConfig())
    return cfg
