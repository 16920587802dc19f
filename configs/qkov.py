"""QK/OV learning-rate presets, `get_config("PARAM,RATIO")`: coupled_qk_jax/configs/qkov.py."""

from coupled_qk_jax.configs.qkov import get_config, to_train_config

__all__ = ["get_config", "to_train_config"]
