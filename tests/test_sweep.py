"""The sweep driver: each cell is a run directory of the training loop. A 2-cell x 2-seed sweep stopped (SIGTERM
path) in the middle of its second cell and restarted does not rerun the first cell, resumes the second, and writes
the same tables as an uninterrupted sweep; the tables agree with the run directories' own numbers."""

from __future__ import annotations

import csv
import json
import math
import signal

import numpy as np
import pytest

from coupled_qk_jax import diagnostics_report
from coupled_qk_jax.training import loop
from experiments import paired, reports, sweep

TIMING = {"train_seconds", "tokens_per_s_all_seeds"}  # wall-clock columns: the only ones allowed to differ


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    d = root / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "query", "key", "value", "attention", "step", "flow"]
    for i in range(40):  # with split fractions 0.5/0.5/0 both train and validation get files
        (d / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, size=60)) + "\n")
    corpus = {"kind": "text_dir", "path": str(d), "split_fractions": [0.5, 0.5, 0.0]}
    small = {"d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64, "max_len": 32, "coupling_hidden": 8,
             "affine_hidden": 8}
    runs = [{"name": v, "variant": v, "corpus": corpus, "steps": 6, "seeds": 2, "tokenizer": "byte",
             "model": small, "train": {"batch_size": 8}} for v in ("standard", "coupled_euler")]
    path = root / "spec.json"
    path.write_text(json.dumps(runs))
    return root, ["--spec", str(path), "--cache-dir", str(root / "cache"), "--eval-points", "3"]


def _rows(path):
    with open(path) as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def test_stopped_sweep_resumes_and_matches_uninterrupted(spec, monkeypatch, capsys):
    root, argv = spec
    stopped, straight = root / "stopped", root / "straight"

    # First invocation: stop at step 3 of the second cell, as SIGTERM does (the handler sets this flag).
    batches = {"n": 0}
    real_batch = loop.next_batch

    def counting_batch(*args):
        batches["n"] += 1
        if batches["n"] == 6 + 3:  # the first cell has 6 steps
            loop._STOP_SIGNAL.append(signal.SIGTERM)
        return real_batch(*args)

    monkeypatch.setattr(loop, "next_batch", counting_batch)
    try:
        with pytest.raises(SystemExit) as info:
            sweep.main([*argv, "--out", str(stopped)])
    finally:
        loop._STOP_SIGNAL.clear()
    assert info.value.code == 128 + signal.SIGTERM  # 143: stopped, not finished (as train.py)
    monkeypatch.setattr(loop, "next_batch", real_batch)
    assert json.loads((stopped / "runs" / "standard" / "summary.json").read_text())["status"] == "completed"
    assert json.loads((stopped / "runs" / "coupled_euler" / "summary.json").read_text())["status"] == "interrupted"
    assert not (stopped / "results.csv").exists()

    # The uninterrupted reference: its first cell is the finished one copied (--reuse: identical training), its
    # second cell is trained in one go. Only its tables are compared, so it draws no figures (matplotlib is most of
    # a report's CPU time); the resumed sweep below draws its own.
    trained = []
    real_train = loop.train
    monkeypatch.setattr(loop, "train", lambda cfg, workdir, **kw: (trained.append(workdir), real_train(cfg, workdir,
                                                                                                       **kw))[1])
    with monkeypatch.context() as no_figures:
        no_figures.setattr(reports, "plot", lambda results, out: [])
        no_figures.setattr(diagnostics_report, "plot_diagnostics", lambda report, path, title="": path)
        sweep.main([*argv, "--out", str(straight), "--reuse", str(stopped / "runs")])
    assert [p.rsplit("/", 1)[-1] for p in trained] == ["coupled_euler"]

    # Second invocation: the first cell is not trained again, the second resumes from its step-3 checkpoint.
    trained.clear()
    capsys.readouterr()
    sweep.main([*argv, "--out", str(stopped)])
    assert [p.rsplit("/", 1)[-1] for p in trained] == ["coupled_euler"]
    assert "at step 3" in capsys.readouterr().out
    for name in ("results.csv",):
        assert _rows(stopped / name) == _rows(straight / name)
    curves = [[{k: v for k, v in r.items() if k != "wall_seconds"} for r in _rows(d / "curves.csv")]
              for d in (stopped, straight)]
    assert curves[0] == curves[1]

    # The table against the run directories' own numbers (mean and sample std over the two seeds).
    rows = _rows(stopped / "results.csv")
    assert [r["variant"] for r in rows] == ["standard", "coupled_euler"]
    for r in rows:
        summary = json.loads((stopped / "runs" / r["run"] / "summary.json").read_text())
        ppl = summary["val_ppl/seeds"]
        assert len(ppl) == 2 and all(math.isfinite(p) for p in ppl)
        assert float(r["val_ppl_mean"]) == pytest.approx(np.mean(ppl))
        assert float(r["val_ppl_std"]) == pytest.approx(np.std(ppl, ddof=1))
        assert int(r["tokens_per_seed"]) == 6 * 8 * 32
        diag = json.loads((stopped / "runs" / r["run"] / "diagnostics.json").read_text())
        assert len(diag) == 2
        assert float(r["diag_effective_rank"]) == pytest.approx(np.mean([d["model_mean"]["effective_rank"]
                                                                         for d in diag]))
        # the per-seed values committed beside the table, as experiments.paired pairs them, are the run's own
        assert paired.seed_values(f"{stopped / 'results.csv'}:{r['run']}", "effective_rank") == \
            [d["model_mean"]["effective_rank"] for d in diag]
        # mean |Δt| from the per-layer Δt lists (signs would cancel in the signed mean); standard has none
        abs_dt = [np.mean([abs(x) for lay in d["layers"] if lay["dt"] for x in lay["dt"]]) for d in diag] \
            if r["variant"] == "coupled_euler" else None
        if abs_dt is None:
            assert math.isnan(float(r["diag_dt_abs_mean"]))
        else:
            assert float(r["diag_dt_abs_mean"]) == pytest.approx(np.mean(abs_dt))
    md = (stopped / "results.md").read_text()
    assert "| run |" in md and "python -m experiments.sweep --spec" in md
    figures = ["loss_vs_tokens.png", "loss_vs_wall.png", *(f"diagnostics/{n}_seed0.png" for n in ("standard",
                                                                                                   "coupled_euler"))]
    assert all((stopped / f).stat().st_size > 0 for f in figures)  # the resumed sweep drew its figures
    with open(stopped / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert len([c for c in curves if c["split"] == "validation"]) == 2 * 2 * 3  # cells x seeds x evaluations

    # A cell directory trained with another configuration is refused with a one-line error.
    other = json.loads((root / "spec.json").read_text())
    other[0]["steps"] = 8
    (root / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit) as info:
        sweep.main(["--spec", str(root / "other.json"), *argv[2:], "--out", str(stopped)])
    assert info.value.code == 2 and "another configuration" in capsys.readouterr().err


def test_tokens_to_target_interpolates():
    r = {"tokens_per_step": 100, "eval_steps": [1, 2, 3], "eval_loss": [[3.0], [2.0], [1.0]]}
    assert reports.tokens_to_target(r, 0, 1.5) == pytest.approx(250.0)
    assert reports.tokens_to_target(r, 0, 3.5) == pytest.approx(100.0)
    assert reports.tokens_to_target(r, 0, 0.5) is None


def test_paired_interval_variance_ratio_and_jump_epoch_hand_values():
    # [1, 2, 3]: mean 2, sample std 1, t_0.975(2) = 4.302653 (tables)
    lo, hi = reports.t_interval([1.0, 2.0, 3.0])
    assert (lo, hi) == pytest.approx((2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)), rel=1e-6)
    # variances 1 and 4; F(2, 2) has cdf x / (1 + x), so its 0.975 quantile is 39 and its 0.025 quantile 1/39
    r, lo, hi = reports.variance_ratio([1.0, 2.0, 3.0], [0.0, 2.0, 4.0])
    assert (r, lo, hi) == pytest.approx((0.25, 0.25 / 39, 0.25 * 39), rel=1e-6)
    assert reports.jump_epoch([2, 4, 6], [0.25, 0.5, 0.9]) == 4 and reports.jump_epoch([2], [0.3]) is None


def test_progress_reads_unfinished_cells(tmp_path):
    from experiments import progress

    mq = tmp_path / "easy__standard"
    mq.mkdir()
    (mq / "cell.json").write_text(json.dumps({
        "run": {"name": "easy/standard", "variant": "standard", "task": "mqar"},
        "config": {"train": {"steps": 640, "num_seeds": 2, "lr": 3e-3}, "mqar": {"steps_per_epoch": 10}}}))
    (mq / "summary.json").write_text(json.dumps({"status": "interrupted", "step": 45}))
    rows = [{"step": 20, "valid/accuracy": 0.45, "valid/accuracy/seeds": [0.55, 0.35]},
            {"step": 40, "valid/accuracy": 0.7, "valid/accuracy/seeds": [0.9, 0.5]},
            {"step": 50, "train_loss": 1.0}]
    (mq / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lm = tmp_path / "standard"
    lm.mkdir()
    (lm / "cell.json").write_text(json.dumps({
        "run": {"name": "standard", "variant": "standard", "task": "lm"},
        "config": {"train": {"steps": 1000, "num_seeds": 1, "lr": 3e-3, "batch_size": 10}, "data": {"seq_len": 100}}}))
    (lm / "metrics.jsonl").write_text(json.dumps({"step": 500, "val_loss": math.log(80.0)}) + "\n")
    c = progress.cell_progress(mq)
    assert c["status"] == "interrupted" and c["progress"] == "50/640 steps (epoch 5.0 of 64)"
    assert c["evaluations"] == "2: 0.450 [0.550 0.350], 4: 0.700 [0.900 0.500]" and c["jump"] == "2 4"
    c = progress.cell_progress(lm)
    assert c["status"] == "started" and c["progress"] == "500/1000 steps (0.50M of 1.00M tokens per seed)"
    assert c["evaluations"] == "0.50M: 80.00"
    table = progress.progress_table([tmp_path])
    assert table.count("\n") == 4 and "| easy/standard | 2 | interrupted |" in table


@pytest.mark.parametrize("name", list("abcdeh"))
def test_recipes_build(name, tmp_path):
    runs = sweep.recipe(name, scale="mini", steps=100, seeds=3)
    assert len({r.name for r in runs}) == len(runs) >= 2
    for r in runs:
        cfg = sweep.make_config(r, str(tmp_path))
        assert cfg.train.steps == r.steps and cfg.data.seq_len == cfg.model.max_len == 128
        assert cfg.train.num_seeds == 3 and cfg.train.eval_every == r.steps // 10 == cfg.checkpoint.every
    if name == "e":
        assert [r.steps for r in runs] == [100, 100, 240]
    if name == "c":
        assert sorted(r.model.get("n_steps", 1) for r in runs) == [1, 1, 2, 3, 5, 7]


def test_recipe_g_mqar_configs_and_grid(tmp_path):
    runs = sweep.recipe("g", scale="mini", steps=0, seeds=3, levels=("easy", "hard"), epochs=2)
    runs = sweep.with_grid(runs, "train.lr", [1e-3, 3e-3])
    assert len(runs) == 2 * 4 * 2 and runs[0].name == "easy/standard/lr=0.001"
    for r in runs:
        cfg = sweep.make_config(r, str(tmp_path))
        spe = math.ceil(cfg.mqar.num_train / cfg.train.batch_size)
        assert cfg.task == "mqar" and cfg.model.d_ff == 0 and cfg.train.steps == 2 * spe
        assert cfg.train.lr == r.config["train.lr"] and cfg.train.num_seeds == 3
    with pytest.raises(ValueError, match="unknown config field"):
        sweep.make_config(sweep.Run("x", "standard", config={"train.lrr": 1.0}), str(tmp_path))


def test_a_cell_resumes_under_another_stopping_rule_but_not_another_setting(tmp_path):
    """cell.json written before train.early_stop existed (no such block, no --set for it) still names the same
    training as today's spec with a stopping rule; a different lr does not."""
    stop = {"train.early_stop.metric": "valid/accuracy", "train.early_stop.patience": 8}
    old_run = sweep.Run("easy/standard", "standard", task="mqar", epochs=2, seeds=1, config={"train.lr": 3e-3})
    new_run = sweep.Run("easy/standard", "standard", task="mqar", epochs=2, seeds=1,
                        config={"train.lr": 3e-3, **stop})
    old = sweep.cell_spec(old_run, sweep.make_config(old_run, str(tmp_path)))
    del old["config"]["train"]["early_stop"]
    new = sweep.cell_spec(new_run, sweep.make_config(new_run, str(tmp_path)))
    assert new["config"]["train"]["early_stop"]["patience"] == 8 and old != new
    assert sweep._same_training(old, new)
    other = sweep.Run("easy/standard", "standard", task="mqar", epochs=2, seeds=1, config={"train.lr": 1e-2, **stop})
    assert not sweep._same_training(old, sweep.cell_spec(other, sweep.make_config(other, str(tmp_path))))

    # A finished cell is reused only under its own stopping rule: stopped early, it is not a full-length run.
    done = tmp_path / "reuse" / "cell"
    done.mkdir(parents=True)
    (done / "cell.json").write_text(json.dumps(new))
    (done / "summary.json").write_text(json.dumps({"status": "completed"}))
    assert sweep._find_reusable(new, [tmp_path / "reuse"]) == done
    assert sweep._find_reusable(old, [tmp_path / "reuse"]) is None


def test_run_commits_keep_the_dirty_mark():
    head = "08cf6b069bfb" + "a" * 28
    history = "\n".join(json.dumps(e) for e in [
        {"event": "start", "commit": head + "+dirty"}, {"event": "save", "commit": "ffff"},
        {"event": "resume", "commit": head}, {"event": "resume"}])
    assert sweep.run_commits(history) == ["08cf6b069bfb", "08cf6b069bfb+dirty", "not recorded"]


def test_select_lr_reads_validation_only_by_hand():
    """The best-lr rule on validation: the first lr to reach 0.99 among those that do (ties: higher validation at
    the selected checkpoints), else the highest validation at the selected checkpoints. Test columns never decide:
    the lr with the best test accuracy is not chosen when its validation is worse."""
    def cell(lr, solved, valid, test, variant="standard"):
        return {"level": "easy", "protocol": "zoology", "variant": variant, "width": 64, "lr": lr,
                "solved_epoch_mean_curve": solved, "selected_validation_mean": valid, "test_accuracy_mean": test}

    rows = [cell(1e-4, None, 0.5, 0.9), cell(1e-3, 12, 0.995, 0.2), cell(1e-2, 8, 0.991, 0.1), cell(3e-2, 8, 0.999, 0.0),
            cell(1e-4, None, 0.30, 0.99, "coupled_euler"), cell(1e-3, None, 0.31, 0.10, "coupled_euler"),
            cell(1e-3, None, 0.9, 0.9, "mlp_only")]  # one lr only: nothing to choose
    chosen = {r["variant"]: r["lr"] for r in reports.select_lr(rows)}
    assert chosen == {"standard": 3e-2, "coupled_euler": 1e-3}


def test_mqar_records_hold_one_evaluation_per_step():
    """A run stopped at epoch 3 logs the periodic evaluation and the final whole-split one at the same step (as the
    committed zoology table at 7845f13 showed, lr=0.01's epoch 3 twice); the record keeps one, the later, and
    every other step as it is."""
    rows = [{"step": 196, "valid/accuracy": 0.20}, {"step": 392, "valid/accuracy": 0.35},
            {"step": 588, "valid/accuracy": 0.99, "n": 1}, {"step": 588, "valid/accuracy": 0.99, "n": 2}]
    assert reports.one_row_per_step(rows) == [rows[0], rows[1], rows[3]]
    assert reports.one_row_per_step(rows[:3]) == rows[:3]  # nothing repeated: nothing dropped
    assert reports.one_row_per_step([]) == []
