"""train.py / eval.py as a user runs them: subprocesses on 2 CPU devices (two error paths run train.py's steps in
this process), a byte-tokenised text_dir fixture."""

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
    return subprocess.run([sys.executable, *args], check=False, cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _parsed_config(spec: str, flag_args: list[str]):
    """The ConfigDict train.py builds from ``--config=SPEC`` and ``flag_args`` (its config flag, defined alike on a
    private FlagValues, so nothing is added to the process's absl flags)."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["train.py", f"--config={os.path.join(ROOT, spec)}", *flag_args]
    values = flags.FlagValues()
    # sys_argv: the overrides it defines flags for (by default the process's own sys.argv: pytest's)
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


def test_cli_bad_input_is_one_line(tmp_path):
    out = _run(["train.py", "--config=configs/lm.py:standard,tiny", f"--workdir={tmp_path / 'run'}",
                *_flags(tmp_path, steps=2, **{"data.seq_len": 64})])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "error: data.seq_len=64 exceeds model.max_len=32"
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("bad", ["missing", "empty"])
def test_cli_missing_or_empty_corpus(tmp_path, capfd, bad):
    """train.py's own steps in this process (its flags parsed as it parses them, then run_guarded around
    loop.train): test_cli_bad_input_is_one_line checks the same path through a real process and its exit status."""
    from coupled_qk_jax.training import cli, loop

    corpus = tmp_path / bad
    if bad == "empty":
        corpus.mkdir()
    # a batch this process's devices divide (the mesh lane's 8, where train.py's subprocesses have 2)
    cfg = _parsed_config("configs/lm.py:standard,tiny",
                         _flags(tmp_path, steps=2, **{"data.corpus": f"text_dir:{corpus}", "train.batch_size": 8}))
    capfd.readouterr()
    code = cli.run_guarded(lambda: loop.train(cfg, str(tmp_path / "run"), progress=False))
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
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
    """An uninterrupted run to STOP (shared by the tests of this section; test_cli_train_then_eval_end_to_end reads
    and evaluates it)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = _run([*RUN_ARGS, f"--workdir={tmp / 'run'}", *_flags(tmp, steps=100000, **{"train.stop_after": STOP})])
    assert out.returncode == 0, out.stderr[-2000:]
    return tmp, _losses(tmp / "run")


def test_cli_train_then_eval_end_to_end(reference):
    """train.py's run directory (the reference run: train.py as a user runs it), then eval.py on it."""
    workdir = reference[0] / "run"
    summary = json.loads((workdir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["variant"] == "standard" and summary["scale"] == "tiny" and summary["step"] == STOP
    assert summary["tokens_seen"] == STOP * 4 * 32
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train_loss" in r] == list(range(1, STOP + 1))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir / "tb"))

    before = (workdir / "summary.json").read_text()
    out = _run(["eval.py", f"--workdir={workdir}", "--split=test"])  # the run's own config
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((workdir / "eval" / f"eval_test_step{STOP}.json").read_text())
    assert result["tokens"] > 0 and result["step"] == STOP and result["split"] == "test"
    assert abs(result["ppl"] - 2.718281828459045 ** result["loss"]) < 1e-6 * result["ppl"]
    assert f"step {STOP} test: loss {result['loss']:.4f}" in out.stdout
    assert (workdir / "summary.json").read_text() == before  # evaluation never overwrites the training summary


def _start(tmp_path, **extra) -> tuple[subprocess.Popen, list[str]]:
    flags = _flags(tmp_path, steps=100000, **{"train.stop_after": STOP, **extra})
    args = [*RUN_ARGS, f"--workdir={tmp_path / 'run'}", *flags]
    return _popen(args), args


def _popen(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_lines(proc, metrics, n: int) -> None:
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.02)
    assert proc.poll() is None and metrics.exists(), "training ended or never logged before the signal"


def _interrupt(proc, metrics, lines: int, sig) -> tuple[str, str]:
    """Send ``sig`` once ``metrics`` has ``lines`` lines; (stdout, stderr) of the process, which has ended."""
    try:
        _wait_for_lines(proc, metrics, lines)
        proc.send_signal(sig)
        return proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_signals_save_exit_128_plus_signal_and_resume_bitwise(tmp_path, reference):
    """SIGINT after a few logged steps, the same command again (it resumes), SIGTERM after a few more, the same
    command to the end: each signal finishes its step, saves, summarises and exits 130 / 143, and every logged loss
    of the twice-interrupted run is bitwise the uninterrupted run's."""
    _, ref_losses = reference
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc, args = _start(tmp_path)
    reached = []
    for sig, lines in ((signal.SIGINT, 3), (signal.SIGTERM, None)):
        if lines is None:  # the same command resumes; signalled a few steps after the first signal's step
            proc, lines = _popen(args), reached[0] + 3
        out, err = _interrupt(proc, metrics, lines, sig)
        assert proc.returncode == 128 + sig, err[-2000:]  # 130 (SIGINT) / 143 (SIGTERM): saved, resumable
        assert "Traceback" not in err and "KeyboardInterrupt" not in err
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        reached.append(summary["step"])
        assert summary["status"] == "interrupted" and summary["signal"] == signal.Signals(sig).name
        assert summary["checkpoint_step"] == reached[-1] < STOP
        assert str(reached[-1]) in os.listdir(tmp_path / "run" / "checkpoints")
    assert 3 <= reached[0] < reached[1]
    assert f"at step {reached[0]}" in out  # the SIGTERM run resumed from SIGINT's checkpoint

    out = _run(args)  # the same command resumes
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"at step {reached[1]}" in out.stdout
    assert _losses(tmp_path / "run") == ref_losses  # every logged loss bitwise equal to the uninterrupted run's
    history = [json.loads(x) for x in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [h["event"] for h in history] == ["start", "end", "resume", "end", "resume", "end"]
    assert history[1]["status"] == history[3]["status"] == "interrupted"
    assert history[2]["step"] == reached[0] and history[4]["step"] == reached[1]


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
    (["--config=configs/nope.py:standard,tiny"], "error: --config: no config file 'configs/nope.py'"),
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


def test_a_preset_path_is_the_packaged_preset_where_no_such_file_exists(tmp_path, monkeypatch):
    """--config=configs/NAME.py where the command runs has no configs/ (an installed package's user): the packaged
    preset of that name; a file at that path, where there is one, is loaded as given; anything else is refused."""
    from coupled_qk_jax.errors import UserError
    from coupled_qk_jax.training import cli

    monkeypatch.chdir(tmp_path)
    packaged = os.path.join(cli.PRESETS_DIR, "lm.py")
    assert cli.resolve_config_spec("configs/lm.py:coupled_euler,tiny") == packaged + ":coupled_euler,tiny"
    assert cli.resolve_config_argv(["train.py", "--config", "./configs/lm.py"]) == ["train.py", "--config", packaged]
    assert cli.load_config_file("configs/mqar.py:standard,easy").task == "mqar"
    for spec in ("configs/nope.py", str(tmp_path / "configs" / "lm.py"), "other/lm.py", "configs/__init__.py"):
        with pytest.raises(UserError, match="no config file"):
            cli.resolve_config_spec(spec)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "lm.py").write_text("def get_config(arg=None):\n    return arg\n")
    assert cli.resolve_config_spec("configs/lm.py:mine") == "configs/lm.py:mine"
    assert cli.load_config_file("configs/lm.py:mine") == "mine"


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


RUNTIME_FIELDS_LINE = ("the runtime fields are remat (str), scan_layers (bool), attention_impl (str), attention_chunks "
                       "(int), scan_unroll (int), dynamics_backward (str)")


def test_runtime_flag_is_typed_by_the_runtime_fields_and_a_mistake_is_one_line():
    """The readers' --runtime=FIELD=VALUE,... (cli.parse_runtime_flag): values typed by RuntimeConfig's fields and
    checked by it; each mistake one line that names the fields."""
    from coupled_qk_jax.errors import UserError
    from coupled_qk_jax.training import cli

    assert cli.parse_runtime_flag("") == {}
    assert cli.parse_runtime_flag("attention_impl=explicit,scan_layers=false") == {"attention_impl": "explicit",
                                                                                   "scan_layers": False}
    assert cli.parse_runtime_flag(" scan_unroll=7, remat=dots,scan_layers=True,attention_chunks=0,") == {
        "scan_unroll": 7, "remat": "dots", "scan_layers": True, "attention_chunks": 0}
    assert cli.parse_runtime_flag("dynamics_backward=autodiff") == {"dynamics_backward": "autodiff"}
    for bad, says in [("scan_layer=true", "unknown field 'scan_layer' (did you mean \"scan_layers\"?)"),
                      ("scan_layers", "'scan_layers' is not FIELD=VALUE"),
                      ("scan_layers=yes", "scan_layers=yes: expected true or false"),
                      ("scan_unroll=two", "scan_unroll=two: expected an integer"),
                      ("attention_impl=flash", "runtime.attention_impl must be one of"),
                      ("attention_chunks=-1", "runtime.attention_chunks must be an integer >= 0"),
                      ("remat=full,remat=dots", "remat is given twice"),
                      ("model.n_steps=3", "unknown field 'model.n_steps'")]:
        with pytest.raises(UserError) as raised:
            cli.parse_runtime_flag(bad)
        message = str(raised.value)
        assert message.startswith(f"--runtime: {says}") and message.endswith(RUNTIME_FIELDS_LINE), message
        assert len(message.splitlines()) == 1


def test_every_reader_refuses_a_bad_runtime_flag_in_one_line(tmp_path):
    """eval.py, sample.py and export.py read --runtime before anything else: a mistake is one line, exit 2."""
    workdir = f"--workdir={tmp_path / 'no_run'}"
    for args in (["eval.py", workdir], ["sample.py", workdir], ["export.py", workdir, f"--out={tmp_path / 'x'}"]):
        out = _run([*args, "--runtime=scan_layer=true"], timeout=300)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines() == [
            f"error: --runtime: unknown field 'scan_layer' (did you mean \"scan_layers\"?); {RUNTIME_FIELDS_LINE}"]
