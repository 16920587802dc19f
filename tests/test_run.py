"""Reading saved runs (training/run.py): one loader for every reader, replicas, any mesh, runs written by
an older version (tests/fixtures/run_v1, with that version's answers), stable export names, --step, keep_best.

References: the fixture's expected values were computed by the code that wrote it (tests/fixtures/README.md); the
2-seed run's by the training loop itself (its final params and whole-split evaluation); checkpoint contents by
orbax's own reader; losses by a float64 numpy cross-entropy of the model's logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import xla_flags
from coupled_qk_jax import generate
from coupled_qk_jax.config import ModelConfig, RuntimeConfig
from coupled_qk_jax.data.tokenizer import ByteTokenizer
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.export import export_run, load_exported, write_export
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training import cli, loop, rundir
from coupled_qk_jax.training.checkpoint import Checkpointer
from coupled_qk_jax.training.layout import parse_mesh
from coupled_qk_jax.training.run import Run
from test_training import leaves_with_names, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "run_v1")
EXPECTED = json.load(open(os.path.join(ROOT, "tests", "fixtures", "run_v1_expected.json"), encoding="utf-8"))
# The fields added since the fixture was written, each at the default that means what the run did.
ADDED_NOTES = ["checkpoint.keep_best: not in this run, using default ''",
               "train.schedule_every: not in this run, using default 1",
               "model.attn_bias: not in this run, using default False",
               "train.init_from: not in this run, using default ''",
               "model.num_labels: not in this run, using default 0"]


def _cli(script: str, *args: str, devices: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(devices))
    # A guard against hangs, not a speed bound: loaded CI machines run these several times slower than idle (the
    # 8-device portability script: 89 s idle, over 300 s beside two training jobs).
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)


@pytest.fixture
def fixture_run(tmp_path):
    """A copy of the old-version run directory (readers write nothing there, but a test may edit or damage it)."""
    dest = tmp_path / "run_v1"
    shutil.copytree(FIXTURE, dest)
    return dest


def _greedy(model, tokenizer) -> list[list[int]]:
    prompts = [np.asarray(p, np.int32) for p in EXPECTED["greedy"]["prompts"]]
    out = generate.Generator(model, vocab_limit=tokenizer.vocab_size).generate(
        prompts, EXPECTED["greedy"]["new_tokens"], generate.Sampling(temperature=0))
    return [o.tolist() for o in out]


def _tensor_sha256(directory) -> dict[str, str]:
    from safetensors.numpy import load_file

    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
            for k, v in load_file(str(directory / "model.safetensors")).items()}


# ---------------------------------------------------------------------------------------------------------------------
# A run written by an older version (24.1, 24.4).
# ---------------------------------------------------------------------------------------------------------------------


def test_old_version_run_evaluates_samples_and_exports_as_then(fixture_run, tmp_path):
    run = Run.open(fixture_run)
    assert run.notes == ADDED_NOTES
    assert run.steps == [3, 6] and run.num_replicas == 1 and run.seeds == [0] and run.tokenizer.kind == "byte"
    assert run.fingerprint["tokenizer"]["kind"] == "byte"
    for split in ("validation", "test"):
        result = run.evaluate(split)
        assert result["step"] == EXPECTED["step"]
        # float32 sums: their last bits follow XLA's code generation for the host CPU (CI's differs in the 8th
        # digit from the machine that wrote the fixture), so losses agree to float32 rounding, tokens exactly.
        assert result["tokens"] == EXPECTED[split]["tokens"]
        assert np.isfinite(result["loss"]) and result["loss"] == pytest.approx(EXPECTED[split]["loss"], rel=1e-6)
        assert result["ppl"] == pytest.approx(EXPECTED[split]["ppl"], rel=1e-5)
    assert _greedy(run.model(), run.tokenizer) == EXPECTED["greedy"]["tokens"]
    out = export_run(fixture_run, tmp_path / "exported")
    assert _tensor_sha256(out) == {k: v["sha256"] for k, v in EXPECTED["export"].items()}
    model, tokenizer, manifest = load_exported(out)
    assert manifest["step"] == 6 and manifest["replica"] == 0 and manifest["seed"] == 0
    assert _greedy(model, tokenizer) == EXPECTED["greedy"]["tokens"]


def test_readers_take_runtime_changes_and_read_as_then(fixture_run, tmp_path, capfd):
    """--runtime=scan_layers=true (cli.parse_runtime_flag, as eval.py, sample.py and export.py pass it on): the run's
    per-layer checkpoint restored as a scanned stack exports the fixture's tensors and the run's own config, with one
    note; the export loaded with scanned layers samples the fixture's tokens."""
    runtime = cli.parse_runtime_flag("scan_layers=true")
    out = export_run(fixture_run, tmp_path / "exported", runtime=runtime)
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note: runtime.")]
    assert notes == [("note: runtime.scan_layers: the run's False, now True (how the model is computed, not what it "
                      "computes)")]
    assert _tensor_sha256(out) == {k: v["sha256"] for k, v in EXPECTED["export"].items()}
    own = rundir.upgrade_config(json.loads((fixture_run / "config.json").read_text()))[0]
    model, tokenizer, manifest = load_exported(out, runtime=runtime)  # over the export's own runtime block
    assert manifest["config"] == own  # the run's own config, its runtime block included
    assert model.runtime == dataclasses.replace(RuntimeConfig.from_dict(own["runtime"]), scan_layers=True)
    assert _greedy(model, tokenizer) == EXPECTED["greedy"]["tokens"]


def _edit_config(workdir, edit) -> None:
    path = workdir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_removed_and_added_fields_follow_the_upgrade_table(fixture_run):
    """A run from before model.coupling_lowering was removed and model.attention_chunks added: read with one note
    for the removed field (the added one is a runtime field: its default, silently), and evaluated exactly as the
    run that has neither; a non-default removed value and a newer schema are one
    line each. Resume compares the configs in the same schema."""
    current = json.loads((fixture_run / "config.json").read_text())
    as_is = Run.open(fixture_run).evaluate("validation")["loss"]
    assert as_is == pytest.approx(EXPECTED["validation"]["loss"], rel=1e-6)

    def older(cfg):
        cfg["model"]["coupling_lowering"] = "batched"
        del cfg["model"]["attention_chunks"]

    _edit_config(fixture_run, older)
    run = Run.open(fixture_run)
    assert run.notes == ["model.coupling_lowering: removed from this version; the run used its last default "
                         "'batched', dropped",
                         *ADDED_NOTES]
    assert run.config.runtime.attention_chunks == 0
    assert run.evaluate("validation")["loss"] == as_is  # the same program on the same params: bitwise
    saved = json.loads((fixture_run / "config.json").read_text())
    assert rundir.resume_changes(saved, current, (), str(fixture_run)) == {}  # train.py would resume it

    _edit_config(fixture_run, lambda cfg: cfg["model"].update(coupling_lowering="vmap"))
    with pytest.raises(UserError, match=r"^model\.coupling_lowering='vmap': this run set a field that this version "
                                        r"no longer has \(its last default was 'batched'\)"):
        Run.open(fixture_run)
    with pytest.raises(UserError, match="coupling_lowering='vmap'"):
        rundir.resume_changes(json.loads((fixture_run / "config.json").read_text()), current, (), str(fixture_run))
    _edit_config(fixture_run, lambda cfg: cfg.update(schema_version=rundir.SCHEMA_VERSION + 1))
    with pytest.raises(UserError, match=r"schema version 4; this code reads up to 3: the run was written by a newer"):
        Run.open(fixture_run)


def test_new_runs_record_the_schema_version_and_resume_without_notes(two_seed):
    cfg, workdir, _, _ = two_seed
    saved = json.loads(open(os.path.join(workdir, "config.json")).read())
    assert saved["schema_version"] == rundir.SCHEMA_VERSION
    assert rundir.upgrade_config(saved) == (rundir.jsonable(cfg.to_dict()), [])


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints by step (24.6) and what readers print (24.8).
# ---------------------------------------------------------------------------------------------------------------------


def _orbax_params(step_dir) -> dict[str, np.ndarray]:
    """The params of a checkpoint step read with orbax's own reader (no target, no checksums, host numpy)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        restored = ck.restore(os.path.join(step_dir, "state"))
    return _by_name(restored["params"])


def _by_name(tree) -> dict[str, np.ndarray]:
    """``{"blocks.0.attn.wq": array}`` (orbax's reader gives list indices back as string keys)."""
    return dict(zip(_names(tree), (np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree)))))


def _nll_reference(model, tokens: np.ndarray, eot: int, seq_len: int) -> float:
    """Mean next-token NLL of ``[eot] + tokens`` in windows of seq_len, every token a target once, in float64. The
    windows go through the model as one batch, the last one right-padded: causal attention keeps padding out of the
    logits of the positions before it, and padded positions are not counted."""
    stream = np.concatenate([[eot], tokens]).astype(np.int32)
    starts = range(0, len(stream) - 1, seq_len)
    x = np.zeros((len(starts), seq_len), np.int32)
    y = np.full((len(starts), seq_len), -1, np.int64)
    for row, start in enumerate(starts):
        window = stream[start:start + seq_len + 1]
        x[row, :len(window) - 1], y[row, :len(window) - 1] = window[:-1], window[1:]
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, x), np.float64)  # jitted: cheaper than op by op
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    valid = y >= 0
    return float(-np.take_along_axis(logp, np.where(valid, y, 0)[..., None], -1)[..., 0][valid].sum() / valid.sum())


def test_step_picks_a_checkpoint(fixture_run):
    run = Run.open(fixture_run, report=False)
    old = _orbax_params(fixture_run / "checkpoints" / "3")
    mine = _by_name(run.params(step=3))
    assert mine.keys() == old.keys()
    for k in old:
        np.testing.assert_array_equal(mine[k], old[k], err_msg=k)
    result = run.evaluate("validation", step=3)
    reference = _nll_reference(run.model(step=3), np.asarray(run.data.tokens("validation")), run.data.eot_id, 32)
    assert result["step"] == 3 and result["loss"] == pytest.approx(reference, rel=1e-5)
    assert result["loss"] != EXPECTED["validation"]["loss"]  # another checkpoint than the newest
    with pytest.raises(UserError, match=r"^--step=4: .*checkpoints has checkpoints at steps 3, 6$"):
        run.state(4)


def _state_of_step(step_dir) -> dict:
    """The whole train state of a checkpoint step as orbax's own reader gives it (host numpy, no checksums)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        return ck.restore(os.path.join(step_dir, "state"))


def test_readers_restore_the_params_only_and_verify_what_they_read(fixture_run, capfd):
    """A reader reads the parameters, not the optimiser's moments: the restored tree is ``{"params"}`` alone, its
    bytes those of the params of orbax's full restore (itself over three times as many: AdamW's two moments), and
    bitwise equal to them. The saved checksums still guard what is read: a params checksum that no longer matches
    makes the step damaged (the reader falls back to step 3), one of the optimiser's state (not read) does not."""
    full = _state_of_step(fixture_run / "checkpoints" / "6")
    params_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(full["params"]))
    assert sum(np.asarray(x).nbytes for x in jax.tree.leaves(full)) > 3 * params_bytes  # what was read before

    at, state = Run.open(fixture_run, report=False).state()
    assert at == 6 and list(state) == ["params"]
    assert sum(x.nbytes for x in jax.tree.leaves(state)) == params_bytes
    mine, reference = _by_name(state["params"]), _by_name(full["params"])
    assert mine.keys() == reference.keys()
    for k in reference:
        assert mine[k].dtype == reference[k].dtype and mine[k].tobytes() == reference[k].tobytes(), k

    meta_path = fixture_run / "checkpoints" / "6" / "meta" / "metadata"
    saved = meta_path.read_text()

    def with_checksum(prefix: str) -> None:
        meta = json.loads(saved)
        name = next(k for k in meta["checksums"] if k.startswith(prefix))
        meta["checksums"][name] = [(meta["checksums"][name][0] + 1) % 2**32, meta["checksums"][name][1]]
        meta_path.write_text(json.dumps(meta))

    with_checksum("['opt_state']")
    capfd.readouterr()
    at, state = Run.open(fixture_run, report=False).state()
    assert at == 6 and capfd.readouterr().err == ""
    with_checksum("['params']['blocks']")
    at, state = Run.open(fixture_run, report=False).state()
    err = capfd.readouterr().err
    assert at == 3 and "step 6" in err and "differ from their saved checksums" in err, err


def test_keep_best_keeps_the_lowest_validation_loss_besides_the_last(tmp_path):
    import jax.numpy as jnp

    ck = Checkpointer(tmp_path / "ck", keep_last=1, keep_best="validation_loss", async_save=False)
    for step, loss in zip((1, 2, 3, 4, 5), (3.0, 1.0, 2.0, 0.5, None)):
        state = {"params": {"w": jnp.full(3, float(step))}, "step": jnp.asarray(step)}
        ck.save(step, state, {"config": {}}, None if loss is None else {"validation_loss": loss})
    assert ck.all_steps() == [4, 5]  # step 4 the best, step 5 the last (saved without an evaluation)
    ck.close()
    plain = Checkpointer(tmp_path / "plain", keep_last=1, async_save=False)  # positive control: without it, one
    for step in (1, 2):
        plain.save(step, {"w": jnp.ones(2)}, {"config": {}}, {"validation_loss": 3.0 - step})
    assert plain.all_steps() == [2]
    plain.close()
    with pytest.raises(UserError, match="checkpoint.keep_best must be one of"):
        Checkpointer(tmp_path / "bad", keep_best="val_ppl")


def test_readers_print_one_line_per_damaged_step_and_no_library_warnings(fixture_run, tmp_path):
    """eval.py, export.py and sample.py --exported through their CLIs: stdout says what they did, stderr holds the
    upgrade note and, with the newest step damaged, exactly one warning line (orbax says nothing)."""
    exported = tmp_path / "exported"
    out = _cli("export.py", f"--workdir={fixture_run}", f"--out={exported}", "--step=6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.splitlines() == [f"note: {n}" for n in ADDED_NOTES]
    assert out.stdout.splitlines() == [f"exported {fixture_run} -> {exported}"]
    ids = ",".join(map(str, EXPECTED["greedy"]["prompts"][0]))
    out = _cli("sample.py", f"--exported={exported}", f"--ids={ids}", "--temperature=0",
               f"--max_new_tokens={EXPECTED['greedy']['new_tokens']}", "--nostop_at_eot")
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
    text = ByteTokenizer().decode(np.asarray(EXPECTED["greedy"]["prompts"][0] + EXPECTED["greedy"]["tokens"][0]))
    assert out.stdout.split("\n", 1)[1].rstrip("\n") == text

    f = max((p for p in (fixture_run / "checkpoints" / "6" / "state" / "d").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes()
    f.write_bytes(bytes(data))
    out = _cli("eval.py", f"--workdir={fixture_run}", f"--out={tmp_path / 'eval'}")
    assert out.returncode == 0, out.stderr[-3000:]
    err = out.stderr.splitlines()
    assert err[:-1] == [f"note: {n}" for n in ADDED_NOTES], out.stderr[-3000:]
    assert err[-1].startswith(f"warning: checkpoint step 6 in {fixture_run / 'checkpoints'} is damaged (")
    assert err[-1].endswith("; trying step 3")
    assert out.stdout.splitlines()[0].startswith("step 3 validation: loss ")
    assert sorted(os.listdir(fixture_run / "checkpoints")) == ["3", "6"]  # readers move and delete nothing


# ---------------------------------------------------------------------------------------------------------------------
# Seed replicas (24.2).
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_seed(tmp_path_factory):
    """(cfg, workdir, summary, final state): 4 steps of a 2-seed run, evaluated at step 2 with keep_best on."""
    tmp = tmp_path_factory.mktemp("two_seed")
    cfg = tiny_config(tmp, steps=4, num_seeds=2, eval_every=2)
    cfg.checkpoint.update(every=2, keep_last=1, keep_best="validation_loss", async_save=False)
    workdir = str(tmp / "run")
    summary, state = loop.train(cfg, workdir, progress=False, return_state=True)
    return cfg, workdir, summary, state


def test_keep_best_in_training_keeps_the_evaluated_step(two_seed):
    _, workdir, _, _ = two_seed
    # keep_last=1 alone would leave [4]; step 2 is the only step ranked by a periodic validation loss
    assert Run.open(workdir).steps == [2, 4]


def test_every_reader_takes_a_replica(two_seed, tmp_path):
    cfg, workdir, summary, state = two_seed
    run = Run.open(workdir, mesh="data:-1")  # the training's mesh: the training's evaluation order
    assert run.num_replicas == 2 and run.seeds == [0, 1]
    both = run.evaluate("validation")
    assert both["loss/seeds"] == summary["val_loss/seeds"] and both["loss"] == summary["val_loss"]
    assert both["loss/std"] == pytest.approx(float(np.std(summary["val_loss/seeds"], ddof=1)), rel=1e-12)
    for r in (0, 1):
        one = run.evaluate("validation", replica=r)
        assert one["replica"] == r and one["seeds"] == [r] and "loss/seeds" not in one
        assert one["loss"] == pytest.approx(summary["val_loss/seeds"][r], rel=1e-6)
        trained = leaves_with_names(loop.seed_slice(state["params"], r))
        out = export_run(workdir, tmp_path / f"replica{r}", replica=r)
        model, _, manifest = load_exported(out)
        exported = leaves_with_names(nnx.to_pure_dict(nnx.state(model)))
        assert manifest["replica"] == r and manifest["seed"] == r and exported.keys() == trained.keys()
        for k in trained:
            np.testing.assert_array_equal(np.asarray(exported[k]), trained[k], err_msg=k)
    for r in (0, 1):  # the model sample.py and diagnostics build: the trained replica's exact parameters
        restored = leaves_with_names(nnx.to_pure_dict(nnx.state(run.model(replica=r))))
        trained = leaves_with_names(loop.seed_slice(state["params"], r))
        assert restored.keys() == trained.keys()
        for k in trained:
            np.testing.assert_array_equal(restored[k], trained[k], err_msg=k)
    with pytest.raises(UserError, match="--replica=2: the run has 2 seed replica"):
        run.model(replica=2)
    with pytest.raises(UserError, match=r"^--replica=2: the run has 2 seed replica\(s\), 0\.\.1 \(seeds \[0, 1\]\)$"):
        export_run(workdir, tmp_path / "nope", replica=2)
    assert not (tmp_path / "nope").exists()

    from coupled_qk_jax.diagnostics_report import compute_diagnostics, report_from_checkpoint

    rep = report_from_checkpoint(run, "validation", windows=4, out_dir=tmp_path / "diag", replica=1)
    # eval.py --diagnostics' path (a run directory); the second split does not overwrite the first's files
    test_rep = report_from_checkpoint(workdir, "test", windows=4, out_dir=tmp_path / "diag", replica=1)
    for split, r in (("validation", rep), ("test", test_rep)):
        assert r["files"] == {ext: str(tmp_path / "diag" / f"diagnostics_{split}_step4_replica1.{ext}")
                              for ext in ("json", "png")}
        assert all(os.path.isfile(f) for f in r["files"].values())
        assert json.loads(open(r["files"]["json"]).read())["split"] == split
    assert rep["replica"] == 1 and rep["checkpoint_step"] == 4 and len(rep["layers"]) == cfg.model.n_layers
    saved = json.loads(open(rep["files"]["json"]).read())["model_mean"]
    direct = compute_diagnostics(nnx.merge(run.graphdef, loop.seed_slice(state["params"], 1)),
                                 _first_windows(run, 4))  # the same windows through the trained in-memory params
    assert saved.keys() == direct["model_mean"].keys()
    for k, v in direct["model_mean"].items():
        assert saved[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def _first_windows(run, n):
    from coupled_qk_jax.data.pipeline import eval_batches

    batch = next(iter(eval_batches(run.data.tokens("validation"), 32, n, bos_id=run.data.eot_id)))
    return batch["inputs"][(batch["targets"] != -100).all(axis=1)]


def test_eval_cli_prints_a_row_per_replica(two_seed, tmp_path):
    _, workdir, summary, _ = two_seed
    out = _cli("eval.py", f"--workdir={workdir}", f"--out={tmp_path}", "--replica=all", "--step=2")
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step 2 validation, 2 replicas over ") and lines[1].split() == [
        "replica", "seed", "loss", "ppl"]
    rows = [line.split() for line in lines[2:4]]
    assert [r[:2] for r in rows] == [["0", "0"], ["1", "1"]]
    result = json.loads(open(tmp_path / "eval_validation_step2.json").read())
    assert [float(r[2]) for r in rows] == [round(x, 4) for x in result["loss/seeds"]]
    assert lines[4].split()[:5] == ["mean", "±", "std", f"{result['loss']:.4f}", "±"]
    bad = _cli("eval.py", f"--workdir={workdir}", "--replica=x")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: --replica=x: expected a replica index 0, 1, ... or all"]
    bad = _cli("sample.py", f"--workdir={workdir}", "--num_samples=0")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: --num_samples=0: samples per prompt must be at least 1"]
    bad = _cli("sample.py", f"--workdir={workdir}", "--top_p=2")  # refused before anything is loaded
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: top_p must be in (0, 1] (1 = off), got 2.0"]

    # sample.py decodes greedily the tokens of the Generator in this process (replica 0, its default): a text
    # prompt and an --ids prompt of another length
    from coupled_qk_jax import generate

    run = Run.open(workdir)
    tokenizer = run.tokenizer
    assert tokenizer.kind == "byte" and tokenizer.vocab_size == 257
    prompts = generate.encode_prompts(tokenizer, ["def f"]) + [np.array([100, 101], np.int32)]
    expected = generate.Generator(run.model(), vocab_limit=tokenizer.vocab_size).generate(
        prompts, 5, generate.Sampling(temperature=0))
    out = _cli("sample.py", f"--workdir={workdir}", "--prompt=def f", "--ids=100,101", "--temperature=0",
               "--max_new_tokens=5", "--nostop_at_eot")
    assert out.returncode == 0, out.stderr[-2000:]
    texts = out.stdout.split("--- sample ")[1:]
    assert len(texts) == 2
    for text, prompt, new in zip(texts, prompts, expected):
        assert text.split("\n", 1)[1].rstrip("\n") == tokenizer.decode(np.concatenate([prompt, new]))


# ---------------------------------------------------------------------------------------------------------------------
# Any machine (24.3): runs trained on 8 devices, read on 1 and 2 (in the mesh lane's process, conftest.py).
# ---------------------------------------------------------------------------------------------------------------------
PROMPTS = [np.array([256, 97, 98], np.int32), np.array([256, 32], np.int32)]


@pytest.mark.mesh
def test_runs_trained_on_8_devices_read_alike_on_1_and_2(tmp_path):
    """Runs trained on a (8, 1, 1) and on a (1, 4, 2) mesh are read back on one device and on two (Run, as eval.py,
    sample.py and export.py read them) with the same results: the very trained bits, eval loss to float32 summation
    order, greedy tokens and exported tensors equal; the (1, 4, 2) run also generates the same greedy tokens opened
    on a (2, 2, 2) mesh (sample.py's path on a mesh)."""
    assert jax.device_count() == 8, jax.device_count()
    for name, mesh in (("data8", dict(data=8, fsdp=1, tensor=1)), ("fsdp4_tensor2", dict(data=1, fsdp=4, tensor=2))):
        cfg = tiny_config(tmp_path, steps=2, eval_batches=1)
        cfg.model.vocab_size = 264  # divisible by fsdp=4 (the byte tokenizer's 257 ids, the rest padding)
        cfg.mesh.update(**mesh)
        cfg.checkpoint.update(every=2, async_save=False)
        workdir = str(tmp_path / name)
        summary, state = loop.train(cfg, workdir, progress=False, return_state=True)
        assert summary["mesh"] == mesh, summary["mesh"]
        trained = leaves_with_names(state["params"])
        results = {}
        for reader in ("data:1", "data:2"):
            run = Run.open(workdir, mesh=reader)
            assert run.mesh.size == int(reader.split(":")[1]) and run.steps == [2]
            restored = leaves_with_names(jax.device_get(run.params()))
            assert restored.keys() == trained.keys()
            for k in trained:  # the very bits that were trained, on any mesh
                np.testing.assert_array_equal(restored[k], trained[k], err_msg=f"{name} {reader} {k}")
            loss = run.evaluate("validation")["loss"]
            generator = generate.Generator(run.model(), vocab_limit=run.tokenizer.vocab_size)
            if reader == "data:1":  # one device: the plain, unsharded program
                assert generator.mesh is None, generator.mesh
            else:
                assert generator.mesh.size == 2, generator.mesh
            greedy = [g.tolist() for g in generator.generate(PROMPTS, 6, generate.Sampling(temperature=0))]
            out = export_run(workdir, str(tmp_path / f"{name}_export_{reader.replace(':', '')}"), mesh=reader)
            exported = leaves_with_names(jax.device_get(nnx.to_pure_dict(nnx.state(load_exported(out)[0]))))
            results[reader] = (loss, greedy, exported)
        (loss1, tok1, exp1), (loss2, tok2, exp2) = results["data:1"], results["data:2"]
        # the training's own final whole-split evaluation ran on 8 devices: the same sum in another order
        assert np.isfinite(loss1) and abs(loss1 - summary["val_loss"]) <= 1e-6 * abs(loss1), (loss1, summary)
        assert abs(loss2 - loss1) <= 1e-6 * abs(loss1), (name, loss2, loss1)
        assert tok2 == tok1, (name, tok2, tok1)
        assert exp2.keys() == exp1.keys() == trained.keys()
        for k in exp1:
            np.testing.assert_array_equal(exp2[k], exp1[k], err_msg=f"{name} export {k}")
        if name == "fsdp4_tensor2":
            # Run.open(mesh=...) then Generator(run.model()), which finds the mesh on the restored parameters;
            # 2 prompts on data x fsdp = 4 rows: two are padding
            sharded = generate.Generator(Run.open(workdir, mesh="data:2,fsdp:2,tensor:2").model(),
                                         vocab_limit=run.tokenizer.vocab_size)
            assert dict(sharded.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}, sharded.mesh
            tokens = [g.tolist() for g in sharded.generate(PROMPTS, 6, generate.Sampling(temperature=0))]
            assert tokens == tok1, (tokens, tok1)


def test_parse_mesh():
    assert parse_mesh("data:2") == {"data": 2, "fsdp": 1, "tensor": 1}
    assert parse_mesh("fsdp:4, tensor:2") == {"data": 1, "fsdp": 4, "tensor": 2}
    for bad in ("data=2", "pipeline:2", "data:0", "data:x"):
        with pytest.raises(UserError, match=r"expected AXIS:SIZE pairs"):
            parse_mesh(bad)


# ---------------------------------------------------------------------------------------------------------------------
# Stable export names (24.5).
# ---------------------------------------------------------------------------------------------------------------------


def test_export_names_are_per_layer_whatever_the_layout(tmp_path):
    """A scanned model exports the unscanned model's names; the folder loads back bitwise as scanned (its config)
    and, with the config switched, as the unscanned model with each layer's slice."""
    mcfg = ModelConfig(variant="coupled_euler", vocab_size=257, max_len=16, d_model=16, n_layers=3, n_heads=2,
                       d_ff=32, coupling_hidden=4)
    scan = RuntimeConfig(scan_layers=True)
    scanned = leaves_with_names(nnx.to_pure_dict(nnx.state(TransformerLM(mcfg, 0, scan))))
    unscanned_names = set(_names(nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: TransformerLM(mcfg, 0))))))
    params = nnx.to_pure_dict(nnx.state(TransformerLM(mcfg, 0, scan)))
    out = write_export(tmp_path / "scanned", params,
                       {"model": dataclasses.asdict(mcfg), "runtime": dataclasses.asdict(scan)}, ByteTokenizer(),
                       step=1)
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == unscanned_names and "blocks.2.attn.wq" in tensors
    np.testing.assert_array_equal(tensors["blocks.1.attn.wq"], scanned["['blocks']['attn']['wq']"][1])
    model, _, _ = load_exported(out)
    back = leaves_with_names(nnx.to_pure_dict(nnx.state(model)))
    assert back.keys() == scanned.keys()
    for k in scanned:
        np.testing.assert_array_equal(np.asarray(back[k]), scanned[k], err_msg=k)

    config = json.loads((out / "config.json").read_text())
    config["runtime"]["scan_layers"] = False
    (out / "config.json").write_text(json.dumps(config))
    manifest = json.loads((out / "export.json").read_text())
    manifest["sha256"]["config.json"] = hashlib.sha256((out / "config.json").read_bytes()).hexdigest()
    (out / "export.json").write_text(json.dumps(manifest))
    per_layer, _, _ = load_exported(out)
    flat = leaves_with_names(nnx.to_pure_dict(nnx.state(per_layer)))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(flat[f"['blocks'][{i}]['attn']['wq']"]),
                                      scanned["['blocks']['attn']['wq']"][i])


def _names(tree) -> list[str]:
    return [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]



# ---------------------------------------------------------------------------------------------------------------------
# A finished run rerun (24.8).
# ---------------------------------------------------------------------------------------------------------------------


def test_rerunning_a_finished_run_is_a_no_op_that_says_so(two_seed, capfd):
    cfg, workdir, summary, _ = two_seed
    metrics = open(os.path.join(workdir, "metrics.jsonl")).read()
    assert metrics.count('"val_loss"') == 2  # the periodic evaluation at step 2 and the final one
    capfd.readouterr()
    again = loop.train(cfg, workdir, progress=False)
    out = capfd.readouterr().out
    assert f"{workdir} already finished at step 4 (summary.json); nothing to do" in out
    assert again == json.loads(open(os.path.join(workdir, "summary.json")).read())
    assert again["val_loss"] == summary["val_loss"]
    assert open(os.path.join(workdir, "metrics.jsonl")).read() == metrics  # no second final row


def test_only_asyncios_reports_of_orphaned_tensorstore_reads_are_dropped():
    """The asyncio log filter that keeps a damaged step to one line drops exactly asyncio's "never retrieved" report
    of a failed tensorstore read; the same report of any other error, and every other record, pass."""
    import logging

    from coupled_qk_jax.training.checkpoint import _drop_orphaned_tensorstore_futures

    def record(message: str, exc: BaseException | None) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None,
                                 (type(exc), exc, None) if exc is not None else None)

    read = ValueError("Error reading ... [tensorstore_spec='{\"driver\":\"zarr\"}']")
    assert not _drop_orphaned_tensorstore_futures(record("Future exception was never retrieved\nfuture: <F>", read))
    assert not _drop_orphaned_tensorstore_futures(record("Task exception was never retrieved\ntask: <T>", read))
    assert _drop_orphaned_tensorstore_futures(record("Future exception was never retrieved\nfuture: <F>",
                                                     ValueError("a bug of ours")))
    assert _drop_orphaned_tensorstore_futures(record("Executing <Task> took 2.1 seconds", read))
    assert _drop_orphaned_tensorstore_futures(record("Future exception was never retrieved", None))


def test_an_mqar_run_from_before_the_validation_split_upgrades_with_notes():
    """An MQAR config.json of 4544e54's shape (its mqar block had no protocol, shuffle or num_valid): each new field
    takes the value that means what the run did (CPU levels, one fixed training order), noted once; an LM run, which
    has no mqar block, gains none of them."""
    old_mqar = {"task": "mqar", "mqar": {"level": "easy", "epochs": 16, "num_train": 10000, "num_test": 1000,
                                         "eval_every_epochs": 2, "steps_per_epoch": 157}}
    upgraded, notes = rundir.upgrade_config(old_mqar)
    assert {k: upgraded["mqar"][k] for k in ("protocol", "shuffle", "num_valid")} == {
        "protocol": "cpu", "shuffle": False, "num_valid": 0}
    assert [n for n in notes if n.startswith("mqar.")] == [
        "mqar.protocol: not in this run, using default 'cpu'", "mqar.shuffle: not in this run, using default False",
        "mqar.num_valid: not in this run, using default 0"]
    lm, lm_notes = rundir.upgrade_config({"task": "lm", "train": {"steps": 6}})
    assert "mqar" not in lm and not any(n.startswith("mqar.") for n in lm_notes)
