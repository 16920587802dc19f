"""GLUE fine-tuning presets, `--config=configs/glue.py:VARIANT,SCALE,TASK`: coupled_qk_jax/configs/glue.py."""

from coupled_qk_jax.configs.glue import TRAIN_EXAMPLES, get_config

__all__ = ["TRAIN_EXAMPLES", "get_config"]
