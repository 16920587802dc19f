"""The run directory as the source of truth (training/rundir.py, training/checkpoint.py integrity), in-process.

One module-scoped run (6 steps, checkpoints at 3 and 6, log every 2 steps so that the checkpoint at 3 falls inside a
logging window) is trained once; every test works on a copy of it. Refusals happen before anything is compiled,
so most tests cost milliseconds.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training import loop, rundir
from coupled_qk_jax.training.checkpoint import CheckpointSaveError
from coupled_qk_jax.training.run import Run
from coupled_qk_jax.training.writers import MetricsWriter, read_metrics
from test_training import leaves_with_names, tiny_config, write_corpus

TIMING = {"tokens_per_second", "train_seconds", "model_tflops_per_second", "mfu"}  # wall-clock rates and totals


def _config(root, **train):
    cfg = tiny_config(root, **train)
    cfg.train.log_every = 2
    return cfg


def _rows(workdir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(str(workdir))]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("rundir")
    cfg = _config(root)
    summary, state = loop.train(cfg, str(root / "run"), progress=False, return_state=True)
    assert summary["status"] == "completed" and summary["step"] == 6
    return root, summary, leaves_with_names(state)


@pytest.fixture
def run(base, tmp_path):
    """A private copy of the base run (same corpus and token cache)."""
    root, _, _ = base
    shutil.copytree(root / "run", tmp_path / "run")
    return root, tmp_path / "run"


def test_run_directory_holds_config_data_and_tokens(base):
    root, summary, _ = base
    wd = root / "run"
    saved = json.loads((wd / "config.json").read_text())
    assert saved == rundir.config_with_schema(_config(root).to_dict())  # every field, defaults included, and the schema
    fp = json.loads((wd / "data.json").read_text())
    corpus = root / "corpus"
    files = {f[0]: f for f in fp["sources"]["files"]}
    assert set(files) == {p.name for p in corpus.iterdir()}  # the bad (non-UTF-8) file is listed too
    name = "doc00.txt"
    import hashlib

    assert files[name][1:3] == [(corpus / name).stat().st_size, hashlib.sha256((corpus / name).read_bytes()).hexdigest()]
    assert fp["tokenizer"]["kind"] == "byte" and fp["tokenizer"]["eot_id"] == 256
    for split in ("validation", "test"):  # the held-out tokens travel with the run, byte-identical to the cache's
        held = np.fromfile(wd / "heldout" / f"{split}.bin", dtype=fp["dtype"])
        assert held.size == fp["splits"][split]["tokens"] > 0
        assert hashlib.sha256(held.tobytes()).hexdigest() == fp["splits"][split]["tokens_sha256"]
    history = [json.loads(x) for x in (wd / "history.jsonl").read_text().splitlines()]
    assert [h["event"] for h in history] == ["start", "end"] and history[1]["status"] == "completed"


@pytest.mark.parametrize("change, message", [
    (dict(train={"batch_size": 16}), r"train.batch_size: run 8, now 16; use a new --workdir"),
    (dict(data={"seq_len": 16}), r"data.seq_len: run 32, now 16"),
    (dict(train={"seed": 1}), r"train.seed: run 0, now 1"),
    (dict(data={"tokenizer": "bpe"}), r"data.tokenizer: run 'byte', now 'bpe'"),
    (dict(train={"lr": 1e-3, "warmup_steps": 3}), r"train.lr: run 0.003, now 0.001; train.warmup_steps: run 2, now 3"),
    (dict(train={"steps": 9}), r"train.steps: run 6, now 9; to change it pass --allow_change=train.steps"),
])
def test_resume_refuses_a_changed_config_naming_each_field(run, change, message):
    root, wd = run
    cfg = _config(root)
    for block, values in change.items():
        cfg[block].update(values)
    before = sorted(os.listdir(wd / "checkpoints"))
    with pytest.raises(UserError, match=message):
        loop.train(cfg, str(wd), progress=False)
    assert sorted(os.listdir(wd / "checkpoints")) == before


def test_allow_change_must_name_a_changeable_field(run):
    root, wd = run
    with pytest.raises(UserError, match=r'--allow_change=train.sed: not a field .*did you mean "train.steps"'):
        loop.train(_config(root), str(wd), progress=False, allow_change=("train.sed",))


def test_resume_refuses_another_corpus_and_an_added_file(run, tmp_path):
    root, wd = run
    other = write_corpus(tmp_path / "other", n_files=5)
    cfg = _config(root)
    cfg.data.corpus = f"text_dir:{other}"
    with pytest.raises(UserError, match=r"the data differs from the run .*file\(s\) removed"):
        loop.train(cfg, str(wd), progress=False)
    moved = tmp_path / "moved"
    shutil.copytree(root / "corpus", moved)
    (moved / "new.txt").write_text("one more file " * 50)
    cfg.data.corpus = f"text_dir:{moved}"
    with pytest.raises(UserError, match=r"1 file\(s\) added \(e.g. new.txt\)"):
        loop.train(cfg, str(wd), progress=False)
    (moved / "new.txt").unlink()
    (moved / "doc03.txt").write_text("changed")
    with pytest.raises(UserError, match=r"1 file\(s\) changed \(e.g. doc03.txt\)"):
        loop.train(cfg, str(wd), progress=False)


def test_moved_corpus_with_matching_files_resumes_and_allowed_change_is_recorded(run, tmp_path, base):
    """The corpus copied elsewhere (same files) is accepted; more train.steps needs --allow_change and lands in
    history.jsonl. Tokenised with the run's own tokenizer into a new cache entry."""
    root, wd = run
    moved = tmp_path / "moved"
    shutil.copytree(root / "corpus", moved)
    cfg = _config(root, steps=8)
    cfg.data.update(corpus=f"text_dir:{moved}", cache_dir=str(tmp_path / "cache2"))
    summary = loop.train(cfg, str(wd), progress=False, allow_change=("train.steps",))
    assert summary["step"] == 8 and summary["status"] == "completed"
    history = [json.loads(x) for x in (wd / "history.jsonl").read_text().splitlines()]
    assert history[2]["event"] == "resume" and history[2]["changes"] == {"train.steps": {"run": 6, "now": 8}}
    assert json.loads((wd / "config.json").read_text())["train"]["steps"] == 8


def test_eval_refuses_a_disagreeing_config_and_needs_only_the_run_directory(run, tmp_path, base):
    root, wd = run
    _, summary, _ = base
    other = _config(root)
    other.model.n_steps = 2
    other.data.corpus = "stdlib"
    with pytest.raises(UserError, match=r"--config disagrees with the run .*data.corpus: run '.*', --config "
                                        r"'stdlib'; model.n_steps: run 1, --config 2"):
        Run.open(str(wd), config=other)
    # Moved: the copy evaluates with the corpus and the token cache gone.
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(wd, moved)
    hidden = [root / "corpus", root / "cache"]
    for p in hidden:
        os.rename(p, f"{p}.hidden")
    try:
        snapshot = {str(p): p.stat().st_mtime_ns for p in moved.rglob("*")}
        # On the training's mesh (every device): the same batch split, so the loss equals the training's bitwise.
        result = Run.open(str(moved), mesh="data:-1").evaluate("validation")
    finally:
        for p in hidden:
            os.rename(f"{p}.hidden", p)
    assert {str(p): p.stat().st_mtime_ns for p in moved.rglob("*")} == snapshot  # evaluation wrote nothing
    assert result["step"] == 6 and result["tokens"] == summary["val_tokens"]
    assert result["loss"] == summary["val_loss"]  # the training's final whole-split evaluation, exactly
    path = rundir.write_eval_result(str(tmp_path / "out"), result)
    assert path.endswith("eval_validation_step6.json") and json.loads(open(path).read())["ppl"] == result["ppl"]


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint damage: the newest step is named in a warning and the older one is used.
# ---------------------------------------------------------------------------------------------------------------------


def _largest_file(directory):
    files = [p for p in directory.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _damage(wd, how: str) -> None:
    step_dir = wd / "checkpoints" / "6"
    if how == "flip_4k":  # 4 KiB overwritten in the middle of the array database's data file
        f = _largest_file(step_dir / "state" / "d")
        data = bytearray(f.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 4096] = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        f.write_bytes(bytes(data))
    elif how == "other_arrays":  # complete, readable arrays with other values: only the checksums notice
        shutil.rmtree(step_dir / "state")
        shutil.copytree(wd / "checkpoints" / "3" / "state", step_dir / "state")
    elif how == "truncate":  # the array database's data file (state/d/; ocdbt.process_0/ holds a per-process copy)
        f = _largest_file(step_dir / "state" / "d")
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "no_array_metadata":
        (step_dir / "state" / "_METADATA").unlink()
    elif how == "no_meta":
        shutil.rmtree(step_dir / "meta")


@pytest.mark.parametrize("how", ["flip_4k", "other_arrays", "truncate", "no_array_metadata", "no_meta"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(run, how, capfd):
    _, wd = run
    _damage(wd, how)
    capfd.readouterr()
    step, state = Run.open(str(wd)).state()  # the path eval.py, sample.py, diagnostics and export take
    assert step == 3 and set(state) == {"params"}  # a reader restores the parameters only
    err = capfd.readouterr().err
    assert f"warning: checkpoint step 6 in {wd / 'checkpoints'} is damaged (" in err and "trying step 3" in err
    assert len([line for line in err.splitlines() if line.startswith("warning:")]) == 1
    assert sorted(os.listdir(wd / "checkpoints")) == ["3", "6"]  # evaluation moves or deletes nothing


def test_every_checkpoint_damaged_is_one_line_error(run):
    _, wd = run
    for step in ("3", "6"):
        f = _largest_file(wd / "checkpoints" / step / "state" / "d")
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(UserError, match=r"no intact checkpoint in .*step 6: .*; step 3: "):
        Run.open(str(wd)).state()


def test_resume_from_older_checkpoint_after_damage_matches_the_straight_run(run, base):
    """The newest checkpoint truncated: training falls back to step 3, moves step 6 aside (not deleted), retrains
    4..6 and ends bitwise where the straight run ended; its metrics.jsonl equals the straight run's (the train-loss
    window open at step 3 travelled with the checkpoint)."""
    root, wd = run
    _, _, straight = base
    _damage(wd, "truncate")
    summary, state = loop.train(_config(root), str(wd), progress=False, return_state=True)
    assert summary["step"] == 6
    resumed = leaves_with_names(state)
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)
    assert _rows(wd) == _rows(root / "run")
    assert os.listdir(wd / "damaged_checkpoints") == ["6"]


# ---------------------------------------------------------------------------------------------------------------------
# Lock, failed saves, torn logs.
# ---------------------------------------------------------------------------------------------------------------------


def test_workdir_lock_refuses_a_second_run_and_ignores_a_stale_lock(run):
    root, wd = run
    (wd / "lock").write_text("999999999\n")  # left by a killed process: no flock is held, so it does not block
    held = rundir.WorkdirLock(str(wd))
    try:
        assert (wd / "lock").read_text().strip() == str(os.getpid())
        with pytest.raises(UserError, match=rf"workdir {wd} is in use by another train.py \(pid {os.getpid()}\)"):
            loop.train(_config(root), str(wd), progress=False)
    finally:
        held.release()
    rundir.WorkdirLock(str(wd)).release()  # free again


def _small_tmpfs(path, size_bytes: int) -> bool:
    """Mount a tmpfs of ``size_bytes`` at ``path`` when this process may (root, a mount namespace); else False."""
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_full_disk_stops_the_run_in_one_line_and_keeps_the_last_good_checkpoint(run, tmp_path, monkeypatch):
    """Resume with more steps on a disk that fills up: the next save fails, the run stops with one line naming
    ENOSPC and the last good checkpoint, no temporary directory is left. A real small tmpfs where it can be
    mounted, else a simulated write error from the checkpoint manager."""
    root, wd = run
    mnt = tmp_path / "disk"
    size = sum(p.stat().st_size for p in wd.rglob("*") if p.is_file())
    mounted = _small_tmpfs(mnt, size + (8 << 20))
    try:
        target = mnt / "run"
        shutil.copytree(wd, target)
        if mounted:  # leave ~256 KiB: room for the logs, not for a checkpoint (~1 MB)
            st = os.statvfs(mnt)
            with open(mnt / "filler", "wb") as f:
                f.write(b"\0" * max(st.f_bavail * st.f_frsize - (256 << 10), 0))
        else:
            from coupled_qk_jax.training import checkpoint as ck_lib

            def no_space(self, step, *args, **kwargs):
                os.makedirs(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp-1"), exist_ok=True)
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(ck_lib.ocp.CheckpointManager, "save", no_space)
        cfg = _config(root, steps=9)
        cfg.checkpoint.async_save = False
        with pytest.raises(CheckpointSaveError, match=r"saving checkpoint step \d+ to .* failed: .*No space left "
                                                      r"on device.*the last good checkpoint is step 6"):
            loop.train(cfg, str(target), progress=False, allow_change=("train.steps",))
        names = os.listdir(target / "checkpoints")
        assert sorted(names) == ["3", "6"]  # nothing half-written left behind
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], capture_output=True, timeout=10)


def test_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capfd):
    rows = [{"step": 1, "train_loss": 2.5}, {"step": 2, "train_loss": 2.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "train_lo')
    assert read_metrics(str(tmp_path)) == rows
    assert "dropped the torn last line of" in capfd.readouterr().err
    MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False).close()  # a resume rewrites the file cleanly
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1\n' + json.dumps(rows[1]) + "\n")
    with pytest.raises(UserError, match=r"metrics.jsonl line 1 is not valid JSON"):
        read_metrics(str(tmp_path))
