"""train.py / eval.py as a user runs them: subprocesses on 2 CPU devices, a byte-tokenised text_dir fixture."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import xla_flags
from test_training import write_corpus

# Subprocesses on 2 CPU devices each: in the mesh lane (conftest.py), beside the main session.
pytestmark = pytest.mark.mesh
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {"variant", "scale", "n_params", "step", "tokens_seen", "train_loss", "val_loss", "val_ppl",
                "wall_seconds", "tokens_per_second"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2), PYTHONPATH=ROOT)
    return env


def _flags(tmp_path, steps: int, **extra) -> list[str]:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    flags = {
        "model.vocab_size": 257, "model.d_model": 32, "model.n_layers": 2, "model.d_ff": 64, "model.max_len": 32,
        "model.coupling_hidden": 6, "data.corpus": f"text_dir:{corpus}", "data.tokenizer": "byte",
        "data.seq_len": 32, "data.split_fractions": "0.6,0.2,0.2", "data.cache_dir": str(tmp_path / "cache"),
        "train.steps": steps, "train.batch_size": 4, "train.warmup_steps": 2, "train.log_every": 1,
        "train.eval_every": 0, "checkpoint.every": 1000, **extra}
    return [f"--config.{k}={v}" for k, v in flags.items()]


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_cli_train_then_eval_end_to_end(tmp_path):
    workdir = tmp_path / "run"
    out = _run(["train.py", "--config=configs/lm.py:coupled_euler,tiny", f"--workdir={workdir}",
                *_flags(tmp_path, steps=4)])
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["variant"] == "coupled_euler" and summary["scale"] == "tiny" and summary["step"] == 4
    assert summary["tokens_seen"] == 4 * 4 * 32
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train_loss" in r] == [1, 2, 3, 4]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir / "tb"))

    before = (workdir / "summary.json").read_text()
    out = _run(["eval.py", f"--workdir={workdir}", "--split=test"])  # the run's own config
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((workdir / "eval" / "eval_test_step4.json").read_text())
    assert result["tokens"] > 0 and result["step"] == 4 and result["split"] == "test"
    assert abs(result["ppl"] - 2.718281828459045 ** result["loss"]) < 1e-6 * result["ppl"]
    assert f"step 4 test: loss {result['loss']:.4f}" in out.stdout
    assert (workdir / "summary.json").read_text() == before  # evaluation never overwrites the training summary


def test_cli_bad_input_is_one_line(tmp_path):
    out = _run(["train.py", "--config=configs/lm.py:standard,tiny", f"--workdir={tmp_path / 'run'}",
                *_flags(tmp_path, steps=2, **{"data.seq_len": 64})])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "error: data.seq_len=64 exceeds model.max_len=32"
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("bad", ["missing", "empty"])
def test_cli_missing_or_empty_corpus(tmp_path, bad):
    corpus = tmp_path / bad
    if bad == "empty":
        corpus.mkdir()
    out = _run(["train.py", "--config=configs/lm.py:standard,tiny", f"--workdir={tmp_path / 'run'}",
                *_flags(tmp_path, steps=2, **{"data.corpus": f"text_dir:{corpus}"})])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(corpus) in last


# ---------------------------------------------------------------------------------------------------------------------
# Signals and kills mid-run: the resumed run logs exactly what an uninterrupted one logs.
# ---------------------------------------------------------------------------------------------------------------------

# Every run below has the same schedule (train.steps) and stops at STOP; signals arrive after a few logged steps.
STOP = 60
RUN_ARGS = ["train.py", "--config=configs/lm.py:standard,tiny"]


def _losses(workdir) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train_loss"], r["grad_norm"], r["lr"]) for r in rows if "train_loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run to STOP (shared by the tests of this section)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = _run([*RUN_ARGS, f"--workdir={tmp / 'run'}", *_flags(tmp, steps=100000, **{"train.stop_after": STOP})])
    assert out.returncode == 0, out.stderr[-2000:]
    return tmp, _losses(tmp / "run")


def _start(tmp_path, **extra) -> tuple[subprocess.Popen, list[str]]:
    flags = _flags(tmp_path, steps=100000, **{"train.stop_after": STOP, **extra})
    args = [*RUN_ARGS, f"--workdir={tmp_path / 'run'}", *flags]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, args


def _wait_for_lines(proc, metrics, n: int) -> None:
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.02)
    assert proc.poll() is None and metrics.exists(), "training ended or never logged before the signal"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_exits_128_plus_signal_and_resumes_bitwise(tmp_path, reference, sig):
    ref_tmp, ref_losses = reference
    proc, args = _start(tmp_path)
    try:
        _wait_for_lines(proc, tmp_path / "run" / "metrics.jsonl", 3)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]  # 130 (SIGINT) / 143 (SIGTERM): saved, resumable
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    reached = summary["step"]
    assert summary["status"] == "interrupted" and summary["signal"] == signal.Signals(sig).name
    assert 3 <= reached < STOP and summary["checkpoint_step"] == reached
    assert str(reached) in os.listdir(tmp_path / "run" / "checkpoints")
    if sig == signal.SIGINT:  # the checkpoint and summary are SIGTERM's (above); its resume is compared below
        return

    out = _run(args)  # the same command resumes
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"at step {reached}" in out.stdout
    assert _losses(tmp_path / "run") == ref_losses  # every logged loss bitwise equal to the uninterrupted run's
    history = [json.loads(x) for x in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [h["event"] for h in history] == ["start", "end", "resume", "end"]
    assert history[1]["status"] == "interrupted" and history[2]["step"] == reached


def test_sigkill_mid_run_resumes_with_the_uninterrupted_metrics(tmp_path, reference):
    """SIGKILL while checkpoints are written every step (async): the rerun resumes from the newest *completed*
    checkpoint (a half-written one is invisible), drops the lines logged after it, and its metrics.jsonl equals
    the uninterrupted run's."""
    _, ref_losses = reference
    proc, args = _start(tmp_path, **{"checkpoint.every": 1})
    try:
        _wait_for_lines(proc, tmp_path / "run" / "metrics.jsonl", 4)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = sorted(int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit())
    assert done, "no completed checkpoint before the kill"
    # The rerun saves rarely (a changeable field): a save per step to STOP would add nothing but time.
    out = _run([*args, "--config.checkpoint.every=1000", "--allow_change=checkpoint.every"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resuming" in out.stdout
    assert _losses(tmp_path / "run") == ref_losses
    assert not [d for d in os.listdir(tmp_path / "run" / "checkpoints") if "tmp" in d]  # no debris


# ---------------------------------------------------------------------------------------------------------------------
# Errors: a user's mistake is one line and exit 2; a bug keeps its traceback.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    (["--config=configs/lm.py:standard,tiny", "--config.model.n_stepz=3"],
     'error: unknown config field --config.model.n_stepz (did you mean "model.n_steps"?)'),
    (["--config=configs/lm.py:standard,tyni"], "error: configs/lm.py: unknown scale 'tyni'"),
    (["--config=configs/lm.py:standrd,tiny"], "error: configs/lm.py: unknown variant 'standrd' (did you mean"),
    (["--config=configs/lm.py:standard,tiny", "--config.train.steps=abc"], "error: flag --config.train.steps=abc"),
])
def test_cli_config_mistakes_are_one_line(tmp_path, args, expected):
    out = _run(["train.py", f"--workdir={tmp_path / 'run'}", *args], timeout=900)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert not (tmp_path / "run").exists()


def test_print_config_lists_every_field_and_exits(tmp_path):
    out = _run(["train.py", "--config=configs/lm.py:coupled_euler,small", "--config.train.steps=7", "--print_config"],
               timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = json.loads(out.stdout)
    assert printed["train"]["steps"] == 7 and printed["model"]["d_model"] == 256  # override and scale applied
    assert printed["model"]["variant"] == "coupled_euler" and printed["checkpoint"]["every_seconds"] == 600
    help_text = _run(["train.py", "--help"], timeout=900).stdout
    assert "coupled_euler+differential" in help_text and "350m" in help_text


def test_run_guarded_maps_user_errors_and_keeps_bugs(capsys):
    from coupled_qk_jax.errors import UserError
    from coupled_qk_jax.training import cli

    def user_mistake():
        raise UserError("data.seq_len=64 exceeds model.max_len=32")

    assert cli.run_guarded(user_mistake) == cli.EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: data.seq_len=64 exceeds model.max_len=32\n"

    def bug():
        raise ValueError("Incompatible shapes for broadcasting: (3,) and (4,)")  # e.g. a JAX shape error

    with pytest.raises(ValueError, match="Incompatible shapes"):  # not turned into an error line: traceback kept
        cli.run_guarded(bug)
