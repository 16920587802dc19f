"""MQAR presets, `--config=configs/mqar.py:VARIANT,LEVEL[,PROTOCOL]`: coupled_qk_jax/configs/mqar.py."""

from coupled_qk_jax.configs.mqar import ZOOLOGY_LRS, get_config

__all__ = ["ZOOLOGY_LRS", "get_config"]
