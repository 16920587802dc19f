"""Export and load (coupled_qk_jax/export.py, export.py) and vocabulary padding, on one tiny trained run.

The run uses a BPE tokenizer *file* of 300 tokens with a model vocabulary of 320 (20 padding ids), so the same
fixture checks that a tokenizer smaller than model.vocab_size trains and that its run exports and loads exactly.
The reference for the round trip is the checkpoint itself, restored by orbax; the weight names are read back with
safetensors' own reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from coupled_qk_jax.data.corpora import CorpusSpec, iter_documents
from coupled_qk_jax.data.tokenizer import BPETokenizer
from coupled_qk_jax.export import ExportError, export_run, flatten_params, load_exported
from coupled_qk_jax.training import loop
from coupled_qk_jax.training.run import Run
from coupled_qk_jax.training.config import RunConfig
from test_training import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_VOCAB, MODEL_VOCAB = 300, 320


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(tmp dir, config, workdir, export dir): 3 steps of coupled_euler with a padded vocabulary, then exported."""
    tmp = tmp_path_factory.mktemp("export")
    cfg = tiny_config(tmp, steps=3)
    tok = BPETokenizer.train(iter_documents(CorpusSpec("text_dir", path=str(tmp / "corpus"),
                                                       split_fractions=(0.6, 0.2, 0.2)), "train"), TOKENIZER_VOCAB)
    tok.save(tmp / "pretrained.json")
    cfg.model.vocab_size = MODEL_VOCAB
    cfg.data.update(tokenizer="bpe", tokenizer_path=str(tmp / "pretrained.json"))
    workdir = tmp / "run"
    summary = loop.train(cfg, str(workdir), progress=False)
    assert summary["status"] == "completed"
    # export.py's own command line is run on the old-version fixture run (test_run.py, the readers' CLI test)
    export_run(workdir, tmp / "exported")
    return tmp, cfg, workdir, tmp / "exported", summary


def test_tokenizer_smaller_than_vocab_trains(run):
    _, cfg, _, _, summary = run
    assert np.isfinite(summary["train_loss"]) and np.isfinite(summary["val_loss"])
    cache = loop.load_data(RunConfig.from_configdict(cfg))
    assert cache.vocab_size == TOKENIZER_VOCAB < MODEL_VOCAB
    for split in ("train", "validation"):  # the padding ids 300..319 never occur in the data
        assert int(np.max(cache.tokens(split))) < TOKENIZER_VOCAB


def test_export_then_load_gives_identical_logits(run):
    tmp, cfg, workdir, exported, _ = run
    run = Run.open(str(workdir), config=cfg)
    step, state = run.state()
    reference = run.model()
    model, tokenizer, manifest = load_exported(exported)

    from safetensors import safe_open

    with safe_open(str(exported / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        saved = {k: f.get_tensor(k) for k in names}
    assert {"embed", "pos_embed", "final_norm.scale", "blocks.0.attn.wq", "blocks.1.attn.coupling.w1",
            "blocks.1.mlp.w_out"} <= names
    expected = flatten_params(loop.host_params(state["params"]))
    assert names == set(expected)
    for k, v in expected.items():
        assert saved[k].dtype == v.dtype and np.array_equal(saved[k], v), k
    assert manifest["step"] == step == 3 and manifest["parameters"]["count"] == run.layout.n_params
    assert manifest["config"]["model"] == cfg.model.to_dict()

    tokens = np.asarray(tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta iota kappa")[None, :24])
    forward = nnx.jit(lambda m, t: m(t))  # jitted: cheaper than op by op
    np.testing.assert_array_equal(np.asarray(forward(model, tokens)), np.asarray(forward(reference, tokens)))
    original = BPETokenizer.load(tmp / "pretrained.json")
    text = "omega psi chi phi\n# file 3\n"
    assert tokenizer.vocab_size == TOKENIZER_VOCAB and list(tokenizer.encode(text)) == list(original.encode(text))


def test_corrupt_or_mismatched_export_is_one_clear_error(run, tmp_path):
    _, _, _, exported, _ = run
    with pytest.raises(ExportError, match="does not exist"):
        load_exported(tmp_path / "nowhere")

    bad = tmp_path / "flipped"
    shutil.copytree(exported, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"model\.safetensors is corrupt"):
        load_exported(bad)

    truncated = tmp_path / "truncated"
    shutil.copytree(exported, truncated)
    (truncated / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match=r"tokenizer\.json is missing"):
        load_exported(truncated)
    (truncated / "export.json").unlink()
    with pytest.raises(ExportError, match="not an export folder"):
        load_exported(truncated)

    # A config that no longer fits the weights (edited by hand, checksum updated to match): named, not loaded.
    other = tmp_path / "mismatch"
    shutil.copytree(exported, other)
    config = json.loads((other / "config.json").read_text())
    config["model"]["n_layers"] = 3
    (other / "config.json").write_text(json.dumps(config))
    manifest = json.loads((other / "export.json").read_text())
    manifest["sha256"]["config.json"] = hashlib.sha256((other / "config.json").read_bytes()).hexdigest()
    (other / "export.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"does not match the model in config\.json \(missing blocks\.2\."):
        load_exported(other)
