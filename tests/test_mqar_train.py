"""configs/mqar.py and the seed-parallel MQAR trainer."""

import math

import numpy as np
import pytest

from configs import mqar as mqar_cfg
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.data import mqar
from coupled_qk_jax.training.seeds import train_mqar_seeds


@pytest.mark.parametrize("level", sorted(mqar.LEVELS))
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_config_builds_for_every_level(level, variant):
    cfg = mqar_cfg.get_config(f"{variant},{level}")
    lvl = mqar.LEVELS[level]
    model = ModelConfig.from_dict(dict(cfg.model))  # validates
    assert (model.d_model, model.max_len, model.vocab_size) == (lvl.d_model, lvl.seq_len, lvl.vocab_size)
    assert model.n_layers == 2 and model.d_ff == 0 and model.positions == "learned"
    assert cfg.train.batch_size == lvl.train_batch_size
    assert cfg.train.steps == cfg.mqar.epochs * math.ceil(lvl.num_train / lvl.train_batch_size)
    cfg.mqar.epochs = 3
    cfg.mqar.num_train = 100
    mqar_cfg.finalize(cfg)
    assert cfg.train.steps == 3 * math.ceil(100 / lvl.train_batch_size)


def test_unknown_level():
    with pytest.raises(ValueError, match="unknown MQAR level"):
        mqar_cfg.get_config("standard,impossible")


def test_train_mqar_seeds_metric_matches_reference():
    """After a short run, the trainer's accuracy equals zoology's metric recomputed from each seed's own logits."""
    cfg = mqar_cfg.get_config("coupled_euler,easy")
    cfg.mqar.epochs, cfg.mqar.num_train = 1, 128
    mqar_cfg.finalize(cfg)
    model_cfg = ModelConfig.from_dict(dict(cfg.model))
    res, sp = train_mqar_seeds(model_cfg, dict(cfg.train), [0, 1], "easy", epochs=1, num_train=128)
    assert res.epochs == [1] and len(res.accuracy[0]) == 2
    _, test = mqar.LEVELS["easy"].mix().segments()
    inputs, labels = test[0].generate()
    for i in range(2):
        logits = np.asarray(sp.model_of(i)(inputs[:1000].astype(np.int32)))
        ref = mqar.mqar_accuracy(logits, labels[:1000])
        assert res.accuracy[0][i] == pytest.approx(ref["valid/accuracy"], abs=1e-6)
        assert res.per_kv[0]["valid/num_kv_pairs/accuracy-4"][i] == pytest.approx(ref["valid/accuracy"], abs=1e-6)
    assert all(math.isfinite(x) for x in res.valid_loss[0] + res.train_loss[0])
