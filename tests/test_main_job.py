"""The main job's own-corpus flags: --corpus / --split_fractions / --vocab_size reach the config, and a corpus whose
held-out split is empty stops before training with one line (no traceback)."""

from __future__ import annotations

from coupled_qk_jax import main_job
from coupled_qk_jax.data.corpora import CorpusSpec
from coupled_qk_jax.training.config import DataConfig
from test_training import write_corpus


def test_corpus_flags_reach_the_config(tmp_path):
    cfg = main_job.build_config("coupled_euler", 40, str(tmp_path), f"text_dir:{tmp_path}", "0.8,0.1,0.1", 512)
    assert DataConfig.from_dict(cfg.data).corpus_spec() == CorpusSpec("text_dir", path=str(tmp_path), split_fractions=(0.8, 0.1, 0.1))
    assert cfg.model.vocab_size == 512 and cfg.train.steps == 40 and cfg.data.cache_dir == str(tmp_path)
    assert main_job.build_config("standard", 40, None).data.corpus == "stdlib"


def test_too_small_split_is_one_line(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", bad_files=0)
    code = main_job.main(["--workdir", str(tmp_path / "run"), "--steps", "2", "--corpus", f"text_dir:{corpus}",
                          "--split_fractions", "1,0,0", "--vocab_size", "300", "--cache_dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: the validation split of text_dir:") and "split_fractions" in err[-1]
    assert "Traceback" not in "\n".join(err)
