"""GPT-2 checkpoints in and out (coupled_qk_jax/convert.py), against what Hugging Face `transformers` computed.

Reference: tests/fixtures/gpt2_tiny, a random 2-layer GPT-2 (d 64, vocab 512) saved by `transformers` with its
float32 logits and greedy tokens for fixed inputs (tests/fixtures/make_gpt2_fixture.py; versions in its
versions.json). Nothing here imports torch or transformers.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from coupled_qk_jax import convert
from coupled_qk_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(ROOT, "tests", "fixtures", "gpt2_tiny")
REF = np.load(os.path.join(GPT2, "reference.npz"))


@pytest.fixture(scope="module")
def standard(tmp_path_factory):
    """The fixture imported as a standard model, as an export folder, and the model loaded back from it."""
    from coupled_qk_jax.export import load_exported

    out = tmp_path_factory.mktemp("import") / "standard"
    assert convert.convert_from_hf(GPT2, str(out)) == 0.0
    model, tokenizer, manifest = load_exported(out)
    return out, model, tokenizer, manifest


def test_imported_logits_and_greedy_tokens_are_transformers(standard):
    from coupled_qk_jax.generate import Generator, Sampling

    _, model, tokenizer, manifest = standard
    assert manifest["config"]["model"]["attn_bias"] is True and manifest["step"] == 0
    logits = np.asarray(model(REF["input_ids"]))
    np.testing.assert_allclose(logits, REF["logits"], rtol=1e-5, atol=1e-5 * np.abs(REF["logits"]).max())
    new = Generator(model).generate(list(REF["prompt"]), int(REF["greedy"].shape[1]), Sampling(temperature=0.0))
    assert np.array_equal(np.stack(new), REF["greedy"])
    assert tokenizer.encode(str(REF["text"])).tolist() == REF["text_ids"].tolist()
    assert tokenizer.eot_id == 511 and tokenizer.decode(REF["text_ids"]) == str(REF["text"])


@pytest.mark.parametrize("variant", ["coupled_euler", "coupled_leapfrog"])
def test_a_coupled_import_at_dt_zero_has_gpt2s_logits(variant):
    """Δt = 0 with f ≡ 0: the coupled model is GPT-2's function (that Δt then learns: the init_from test below)."""
    mcfg, params = convert.import_hf(GPT2, variant, dt_init=0.0)
    logits = convert.logits_of(mcfg, params, REF["input_ids"])
    np.testing.assert_allclose(logits, REF["logits"], rtol=1e-5, atol=1e-5 * np.abs(REF["logits"]).max())
    assert all(float(np.abs(params["blocks"][i]["attn"]["dt"]).max()) == 0.0 for i in range(mcfg.n_layers))


def test_one_training_step_on_the_import_starts_from_transformers_loss(standard):
    """The first step's loss is the cross-entropy of transformers' logits (numpy float64), and the step moves the
    parameters."""
    import jax

    from coupled_qk_jax.training import optimizer, steps
    from coupled_qk_jax.training.config import TrainConfig

    _, model, _, _ = standard
    graphdef, params = steps.split_model(model)
    tx = optimizer.make_optimizer(params, TrainConfig(steps=2, warmup_steps=0, lr=1e-3))
    state = steps.init_train_state(params, tx)
    batch = {"inputs": REF["input_ids"][:, :-1], "targets": REF["input_ids"][:, 1:]}
    new_state, metrics = jax.jit(steps.make_train_step(graphdef, tx))(state, batch, jax.random.key(0))
    z = REF["logits"][:, :-1].astype(np.float64)
    logp = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-5)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), new_state["params"], params)
    assert max(jax.tree.leaves(moved)) > 0


def test_export_to_hugging_face_is_the_fixture_bit_for_bit(standard, tmp_path):
    from safetensors.numpy import load_file

    out, _, _, _ = standard
    assert convert.main(["--to_hf", str(tmp_path / "hf"), "--exported", str(out)]) == 0
    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    original = {k.removeprefix("transformer."): v for k, v in load_file(os.path.join(GPT2, "model.safetensors")).items()
                if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
    assert sorted(back) == sorted(original)
    for k, v in original.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    with open(os.path.join(GPT2, "config.json")) as f:
        ref = json.load(f)
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon",
                "bos_token_id", "eos_token_id"):
        assert hf[key] == ref[key], key
    assert hf["n_inner"] == 4 * ref["n_embd"] and ref.get("n_inner") is None
    # ...and the written folder imports again to the same logits.
    mcfg, params = convert.import_hf(tmp_path / "hf")
    np.testing.assert_allclose(convert.logits_of(mcfg, params, REF["input_ids"]), REF["logits"], rtol=1e-5,
                               atol=1e-5 * np.abs(REF["logits"]).max())


def test_gpt2s_vocab_and_merges_files_give_the_same_tokenizer(tmp_path):
    import shutil

    for name in ("config.json", "vocab.json", "merges.txt"):  # no tokenizer.json: the older file pair
        shutil.copy(os.path.join(GPT2, name), tmp_path / name)
    tokenizer = convert.read_hf_tokenizer(tmp_path)
    assert tokenizer.encode(str(REF["text"])).tolist() == REF["text_ids"].tolist()
    assert tokenizer.eot_id == 511 and tokenizer.vocab_size == 512
    assert tokenizer.encode("<|endoftext|>").tolist() == [511]


def test_mistakes_are_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="differential scoring"):
        convert.import_hf(GPT2, "coupled_euler+differential")
    with pytest.raises(UserError, match="config.json is missing"):
        convert.import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="only GPT-2"):
        convert.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "activation_function": "relu"}))
    with pytest.raises(UserError, match="activation_function='relu'"):
        convert.read_hf_config(tmp_path)
    assert convert.main(["--from_hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert convert.main(["--to_hf", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    missing = (f"error: {tmp_path / 'nowhere' / 'config.json'} is missing: --from_hf takes a folder written by "
               "GPT2LMHeadModel.save_pretrained")
    assert err == [missing, "error: --to_hf needs --exported=EXPORT_FOLDER"]


def _continue_config(tmp_path, exported, **model):
    from test_training import write_corpus

    from coupled_qk_jax.configs.lm import get_config

    cfg = get_config("coupled_euler,tiny")
    cfg.model.update({"vocab_size": 512, "max_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256,
                      "norm": "layernorm", "positions": "learned", "attn_bias": True, "dt_init": 0.0, "dropout": 0.0,
                      "coupling_hidden": 8, **model})
    cfg.data.update(corpus=f"text_dir:{write_corpus(tmp_path / 'corpus')}", tokenizer="bpe",
                    tokenizer_path=os.path.join(GPT2, "tokenizer.json"), seq_len=32, split_fractions="0.6,0.2,0.2",
                    cache_dir=str(tmp_path / "cache"), num_threads=1)
    # Step 1 runs at the warm-up's learning rate 0, so its checkpoint holds the parameters as they started.
    cfg.train.update(steps=2, batch_size=4, warmup_steps=1, lr=1e-3, log_every=1, eval_every=0, eval_batches=1,
                     init_from=str(exported))
    cfg.checkpoint.update(every=1, keep_last=2)
    return cfg


def test_training_starts_from_the_import_with_the_coupling_added(standard, tmp_path, capsys):
    """train.init_from=<the standard import>, trained as coupled_euler with Δt = 0: after step 1 (learning rate 0)
    GPT-2's tensors bitwise and f at the coupled model's own initialisation; step 2 moves Δt off 0, since it gets a
    gradient at 0 (∂q/∂Δt = k)."""
    from safetensors.numpy import load_file

    from coupled_qk_jax.model import TransformerLM
    from coupled_qk_jax.training import loop
    from coupled_qk_jax.training.run import Run

    out, _, _, _ = standard
    cfg = _continue_config(tmp_path, out)
    summary, state = loop.train(cfg, str(tmp_path / "run"), progress=False, return_state=True)
    assert summary["step"] == 2 and np.isfinite(summary["train_loss"])
    assert "init_from" in capsys.readouterr().out
    assert all(float(np.abs(state["params"]["blocks"][i]["attn"]["dt"]).min()) > 0 for i in range(2))
    params = jax.tree.map(np.asarray, Run.open(tmp_path / "run", report=False).params(step=1))
    hf = load_file(os.path.join(GPT2, "model.safetensors"))
    assert np.array_equal(params["embed"], hf["transformer.wte.weight"])
    assert np.array_equal(params["blocks"][1]["attn"]["wk"].reshape(64, 64),
                          hf["transformer.h.1.attn.c_attn.weight"][:, 64:128])
    assert np.array_equal(params["blocks"][0]["mlp"]["b_out"], hf["transformer.h.0.mlp.c_proj.bias"])
    assert float(np.abs(params["blocks"][0]["attn"]["dt"]).max()) == 0.0
    fresh = TransformerLM(loop.model_config(cfg), 0).blocks[0].attn.coupling.w1[...]
    assert np.array_equal(params["blocks"][0]["attn"]["coupling"]["w1"], np.asarray(fresh))


def test_a_source_that_does_not_fit_the_model_is_one_line(standard, tmp_path):
    from coupled_qk_jax.training import loop

    out, _, _, _ = standard
    with pytest.raises(UserError, match=r"does not fit model\.\*: no parameter for blocks\.0\.attn\.bk"):
        loop.train(_continue_config(tmp_path, out, attn_bias=False), str(tmp_path / "run"), progress=False)
    with pytest.raises(UserError, match="neither an export folder"):
        loop.train(_continue_config(tmp_path, tmp_path), str(tmp_path / "run2"), progress=False)


# ------------------------------------------------------------------------------------------ GLUE from the import
def _write_sst2(root):
    """A tiny SST-2 folder in GLUE's layout: a sentence is positive exactly when it holds "good"."""
    rng = np.random.default_rng(0)
    words = ["the", "film", "was", "plot", "actors", "very", "quite", "rather", "and", "but", "story"]

    def sentence(positive: bool) -> str:
        w = list(rng.choice(words, 5))
        w.insert(int(rng.integers(0, 5)), "good" if positive else "bad")
        return " ".join(w)

    root.mkdir()
    labels = {"train": rng.integers(0, 2, 40), "dev": rng.integers(0, 2, 13)}
    for name, y in labels.items():
        (root / f"{name}.tsv").write_text("sentence\tlabel\n" + "".join(f"{sentence(v)}\t{v}\n" for v in y))
    (root / "test.tsv").write_text("index\tsentence\n" + "".join(f"{i}\t{sentence(i % 2 == 0)}\n" for i in range(7)))
    return labels


def test_glue_fine_tuning_from_the_import_scores_and_submits(standard, tmp_path):
    """configs/glue.py on a tiny SST-2 folder, from the GPT-2 import (its tokenizer found through init_from): the
    validation accuracy in summary.json is the one computed here from the restored model's head on the whole dev
    set in one batch (the evaluator batches 13 examples by 4, padding the last batch), and eval.py --split=test's
    SST-2.tsv holds that model's argmax for every test row, in GLUE's format."""
    from coupled_qk_jax.configs.glue import get_config
    from coupled_qk_jax.data import glue
    from coupled_qk_jax.training import loop
    from coupled_qk_jax.training.run import Run

    out, _, tokenizer, _ = standard
    labels = _write_sst2(tmp_path / "SST-2")
    cfg = get_config("standard,tiny,sst2")
    cfg.model.update({"vocab_size": 512, "max_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256,
                      "norm": "layernorm", "attn_bias": True, "dtype": "float32"})
    cfg.runtime.scan_layers = False
    cfg.data.update(corpus=f"glue:sst2:{tmp_path / 'SST-2'}", seq_len=32)
    cfg.train.update(steps=6, batch_size=8, eval_batch_size=4, warmup_steps=1, lr=1e-3, log_every=3, eval_every=3,
                     init_from=str(out))
    cfg.checkpoint.update(every=3)
    summary = loop.train(cfg, str(tmp_path / "run"), progress=False)
    assert summary["step"] == 6 and summary["task"] == "glue"

    run = Run.open(tmp_path / "run", report=False)
    model = run.model(step=6)
    dev = glue.encode(glue.load_examples(f"glue:sst2:{tmp_path / 'SST-2'}", "validation"), tokenizer, 32)
    assert dev["labels"].tolist() == labels["dev"].tolist()
    predicted = np.asarray(model.classify(dev["inputs"], dev["positions"])).argmax(-1)
    accuracy = float(np.mean(predicted == labels["dev"]))
    assert summary["valid/accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert run.evaluate("validation", step=6)["valid/examples"] == 13

    written = run.write_glue_predictions(str(tmp_path / "submit"))
    assert [os.path.basename(p) for p in written] == ["SST-2.tsv"]
    test = glue.encode(glue.load_examples(f"glue:sst2:{tmp_path / 'SST-2'}", "test"), tokenizer, 32)
    expected = np.asarray(model.classify(test["inputs"], test["positions"])).argmax(-1)
    rows = (tmp_path / "submit" / "SST-2.tsv").read_text().splitlines()
    assert rows == ["index\tprediction"] + [f"{i}\t{int(p)}" for i, p in enumerate(expected)]


def test_a_stopped_glue_run_resumes_to_the_uninterrupted_params(tmp_path):
    """A GLUE run of a byte-level model stopped at step 2 resumes from its checkpoint (data.json, which records the
    tokenizer, is the fingerprint its checkpoints hold) and ends with the params of one uninterrupted run."""
    from configs.glue import get_config
    from coupled_qk_jax.training import loop

    _write_sst2(tmp_path / "SST-2")
    cfg = get_config("standard,tiny,sst2")
    cfg.model.update({"vocab_size": 512, "max_len": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
                      "dtype": "float32"})
    cfg.data.update(corpus=f"glue:sst2:{tmp_path / 'SST-2'}", seq_len=32, tokenizer="byte")
    cfg.train.update(steps=4, batch_size=8, eval_batch_size=4, warmup_steps=1, lr=1e-3, log_every=2, eval_every=2)
    cfg.checkpoint.update(every=2)
    whole, whole_params = loop.train(cfg, str(tmp_path / "whole"), progress=False, return_state=True)
    cfg.train.stop_after = 2
    assert loop.train(cfg, str(tmp_path / "run"), progress=False)["status"] == "stopped"
    cfg.train.stop_after = 0
    resumed, resumed_params = loop.train(cfg, str(tmp_path / "run"), progress=False, return_state=True)
    assert resumed["status"] == whole["status"] == "completed" and resumed["step"] == 4
    assert resumed["valid/accuracy"] == whole["valid/accuracy"]
    for a, b in zip(jax.tree.leaves(whole_params), jax.tree.leaves(resumed_params)):
        np.testing.assert_array_equal(a, b)


def test_glue_configs_and_their_mistakes(tmp_path):
    from coupled_qk_jax.configs.glue import get_config
    from coupled_qk_jax.data.tokenizer import ByteTokenizer
    from coupled_qk_jax.training import tasks
    from coupled_qk_jax.training.config import RunConfig

    assert [get_config(f"standard,tiny,{t}").model.num_labels for t in ("sst2", "mnli", "stsb")] == [2, 3, 1]
    sst2 = get_config("coupled_euler,tiny,sst2")
    assert sst2.train.steps == 6314  # ceil(3 epochs x 67,349 examples / 32) = ceil(6313.97)
    assert sst2.train.warmup_steps == 379 and sst2.checkpoint.keep_best == "validation_loss"
    with pytest.raises(UserError, match="VARIANT,SCALE,TASK"):
        get_config("standard,tiny")
    with pytest.raises(UserError, match="did you mean"):
        get_config("standard,tiny,sst")
    sst2.data.corpus = "stdlib"
    with pytest.raises(UserError, match="task='glue' reads data.corpus='glue:TASK"):
        RunConfig.from_configdict(sst2)
    _write_sst2(tmp_path / "SST-2")
    sst2.data.corpus, sst2.model.num_labels = f"glue:sst2:{tmp_path / 'SST-2'}", 3
    with pytest.raises(UserError, match=r"model.num_labels=3, but GLUE sst2 needs 2"):
        tasks.GlueTask(RunConfig.from_configdict(sst2), 1, ByteTokenizer())
    sst2.model.num_labels = 2
    with pytest.raises(UserError, match="needs the model's tokenizer"):
        tasks.sentence_tokenizer(RunConfig.from_configdict(sst2))
