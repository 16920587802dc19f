"""Language-model presets, `--config=configs/lm.py:VARIANT,SCALE`: coupled_qk_jax/configs/lm.py."""

from coupled_qk_jax.configs.lm import SCALES, get_config

__all__ = ["SCALES", "get_config"]
