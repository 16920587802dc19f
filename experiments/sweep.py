"""Sweeps: a thin driver over the training loop. Every cell of a sweep is an ordinary run directory.

    python -m experiments.sweep --recipe a --scale mini --steps 600 --seeds 3 --out results/paper1/a
    python -m experiments.sweep --recipe g --levels easy,medium,hard --epochs 32 --seeds 3 \
        --grid train.lr=1e-3,3e-3 --out OUT                              # MQAR: 3 levels x variants x 2 lrs
    python -m experiments.sweep --spec my_sweep.json --out OUT          # a list of cells from a JSON/YAML file

A cell is a :class:`Run` (name, variant, scale or MQAR level, corpus, steps or epochs, seeds, overrides). It becomes
one config (``configs/lm.py`` or ``configs/mqar.py`` plus the overrides, ``train.num_seeds`` = its seeds) and one run
directory ``RUNS/<cell>/`` (``RUNS`` = ``--runs-dir``, default ``OUT/runs``) trained by ``training.loop.train``: all
seeds of the cell as one vmapped program, checkpoints, metrics.jsonl, TensorBoard and summary.json as for
``train.py``. For each cell in order the driver

* skips it when its summary.json says completed (and computes its attention diagnostics if they are missing);
* resumes it from its latest checkpoint when it has one (exactly: the loop's resume is bitwise);
* starts it otherwise;
* for an MQAR cell, scores the test split once per seed at its validation-selected checkpoint
  (``experiments/select_test.py``; ``--prune-checkpoints`` then drops the other checkpoints).

SIGTERM or Ctrl-C stops the running cell at the next step boundary with a checkpoint and stops the sweep with exit
status 143 or 130 (as train.py; 0 means every cell finished and the tables are written); the same command later
continues it, recomputing no finished step (after a SIGKILL, the steps since the cell's last checkpoint,
``checkpoint.every`` = one evaluation interval, are trained again). A cell directory made for another
configuration is refused (``--force`` retrains it from scratch). When every cell is done, ``experiments.reports``
writes the tables and figures from the run directories into OUT (results.csv, results.md, curves.csv, plots).

Recipes (``--recipe``):

    a  every variant at one scale (standard, coupled Euler/leapfrog, MLP-only, affine, differential)
    b  Euler vs leapfrog (with standard as the reference)
    c  coupled Euler with n in {1, 2, 3, 5, 7} integration steps
    d  seed variance: standard, coupled Euler and MLP-only with more seeds (the std columns; recipe a reports them too)
    e  compute-matched: standard trained 2.4x longer than coupled Euler; target perplexity = coupled's final one
    f  corpus dependence: standard vs coupled Euler on a coherent corpus (stdlib code) and a heterogeneous mixture
       (needs ``--corpus-dir DIR`` prepared once by ``python -m experiments.corpora_prep DIR``)
    g  MQAR levels (easy/medium/hard; ``--levels``; ``--protocol cpu|zoology``), standard vs coupled Euler/leapfrog
       vs MLP-only
    h  coupled + differential vs coupled alone vs differential alone (and standard)

``--grid KEY=V1,V2,...`` multiplies every cell by the values of one config field (e.g. ``train.lr``);
``--set KEY=VALUE`` overrides a config field in every cell (e.g. ``--set mesh.data=1``).

Scales: ``configs/lm.py``'s (tiny, small, 60m, 150m, 350m) plus ``mini`` (tiny's vocabulary, width 64, 2 layers,
context 128): what fits 2 shared CPU cores at several million tokens per run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import ml_collections

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.reporting import log
from coupled_qk_jax.training import rundir
from coupled_qk_jax.training.config import DataConfig
from experiments import reports
from experiments.corpora_prep import heterogeneous_corpus

# Scales that are not in configs/lm.py: model overrides on top of `tiny` (and the batch size).
EXTRA_SCALES: dict[str, dict[str, Any]] = {
    "mini": dict(d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=128, coupling_hidden=12, affine_hidden=12),
}

MAIN_VARIANTS = ("standard", "coupled_euler", "coupled_leapfrog", "mlp_only", "differential", "affine")


@dataclasses.dataclass
class Run:
    """One sweep cell: one configuration trained for several seeds (one run directory).

    Attributes:
      name: unique within a sweep; names the run directory (``/`` and ``+`` are made file-safe).
      variant: a `coupled_qk_jax.config` variant name.
      scale: `configs/lm.py` scale or an `EXTRA_SCALES` key (LM cells); ignored for MQAR.
      corpus: corpus string or dict (`coupled_qk_jax.data.corpora.CorpusSpec`).
      steps: optimiser steps (LM): the cosine schedule spans exactly these.
      seeds: number of seeds, trained in parallel: ``seed, seed + 1, ...`` (``train.num_seeds``).
      seed: the first seed (``train.seed``).
      model: overrides of the `model` block (e.g. {"n_steps": 3}).
      train: overrides of the `train` block (e.g. {"lr": 1e-3}).
      config: overrides of any field by dotted name (e.g. {"checkpoint.every": 10, "mesh.data": 1}).
      task: "lm" or "mqar".
      level, protocol, epochs, num_train: MQAR only (`configs/mqar.py`; num_train 0 = the level's own).
      tokenizer, vocab_size: LM tokenizer ("bpe" with the scale's vocabulary unless set, or "byte").
      group: cells in one group share a target perplexity (tokens-to-target is compared within a group).
    """

    name: str
    variant: str
    scale: str = "tiny"
    corpus: Any = "stdlib"
    steps: int = 500
    seeds: int = 3
    seed: int = 0
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    task: str = "lm"
    level: str = "easy"
    protocol: str = "cpu"
    epochs: int = 16
    num_train: int = 0
    tokenizer: str = "bpe"
    vocab_size: int | None = None
    group: str = "main"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Run":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"run {d.get('name')!r}: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def set_dotted(cfg: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """``cfg.a.b = value`` for ``key = "a.b"``, refusing names the config does not have (a typo must not pass)."""
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        if p not in node:
            raise UserError(f"unknown config field {key!r}")
        node = node[p]
    if leaf not in node:
        raise UserError(f"unknown config field {key!r}")
    node[leaf] = value


def make_config(run: Run, cache_dir: str, eval_points: int = 10) -> ml_collections.ConfigDict:
    """The loop config of one cell: the task's config file, the cell's overrides, its seeds."""
    if run.task == "mqar":
        from configs import mqar as mqar_cfg  # noqa: PLC0415

        cfg = mqar_cfg.get_config(f"{run.variant},{run.level},{run.protocol}")
        cfg.mqar.epochs = int(run.epochs)  # train.steps etc. follow (FieldReferences)
        if run.num_train:
            cfg.mqar.num_train = int(run.num_train)
        cfg.model.update(run.model)
    elif run.task == "lm":
        from configs import lm  # noqa: PLC0415

        cfg = lm.get_config(f"{run.variant},{'tiny' if run.scale in EXTRA_SCALES else run.scale}")
        cfg.model.update(EXTRA_SCALES.get(run.scale, {}))
        if run.tokenizer == "byte":
            cfg.model.vocab_size = 257
        elif run.vocab_size:
            cfg.model.vocab_size = int(run.vocab_size)
        cfg.model.update(run.model)
        corpus = run.corpus if isinstance(run.corpus, str) else json.dumps(run.corpus, sort_keys=True)
        cfg.data.update(corpus=corpus, tokenizer=run.tokenizer, cache_dir=cache_dir,
                        seq_len=int(cfg.model.max_len))
        steps = int(run.steps)
        eval_every = max(1, steps // eval_points) if eval_points else 0
        # Short CPU runs: warm up over 5% of the run, never more than the scale's default. Every evaluation scores
        # the whole validation split; a checkpoint at every evaluation bounds what a SIGKILL loses.
        cfg.train.update(steps=steps, warmup_steps=max(1, min(int(cfg.train.warmup_steps), steps // 20)),
                         eval_every=eval_every, eval_batches=0, log_every=max(1, steps // 50))
        cfg.checkpoint.every = eval_every or steps
    else:
        raise UserError(f"run {run.name!r}: task must be 'lm' or 'mqar', got {run.task!r}")
    cfg.train.update(run.train)
    cfg.train.update(seed=int(run.seed), num_seeds=int(run.seeds))
    for key, value in run.config.items():
        set_dotted(cfg, key, value)
    return cfg


def recipe(name: str, *, scale: str, steps: int, seeds: int, corpus: Any = "stdlib",
           corpus_dir: str | None = None, levels: tuple[str, ...] = ("easy",), epochs: int = 16,
           variants: tuple[str, ...] | None = None, num_train: int = 0, protocol: str = "cpu") -> list[Run]:
    """The runs of one paper-claim recipe (see the module docstring)."""
    common = dict(scale=scale, corpus=corpus, steps=steps, seeds=seeds)
    if name == "a":
        return [Run(v, v, **common) for v in (variants or MAIN_VARIANTS)]
    if name == "b":
        return [Run(v, v, **common) for v in (variants or ("standard", "coupled_euler", "coupled_leapfrog"))]
    if name == "c":
        runs = [Run("standard", "standard", **common)]
        # n = 1 is the config default, left implicit so the run is recipe a's coupled_euler (reusable).
        runs += [Run(f"coupled_euler_n{n}", "coupled_euler", model={"n_steps": n} if n > 1 else {}, **common)
                 for n in (1, 2, 3, 5, 7)]
        return runs
    if name == "d":
        return [Run(v, v, **common) for v in (variants or ("standard", "coupled_euler", "mlp_only"))]
    if name == "e":
        long_steps = int(round(2.4 * steps))
        return [Run("coupled_euler", "coupled_euler", **common),
                Run("standard", "standard", **common),
                Run("standard_x2.4", "standard", scale=scale, corpus=corpus, steps=long_steps, seeds=seeds)]
    if name == "f":
        if not corpus_dir:
            raise UserError("recipe f needs --corpus-dir (prepare it with python -m experiments.corpora_prep DIR)")
        hetero = heterogeneous_corpus(corpus_dir)
        runs = []
        for tag, corp in (("coherent", "stdlib"), ("heterogeneous", hetero)):
            for v in (variants or ("standard", "coupled_euler")):
                runs.append(Run(f"{tag}/{v}", v, scale=scale, corpus=corp, steps=steps, seeds=seeds, group=tag))
        return runs
    if name == "g":
        return [Run(f"{lvl}/{v}", v, task="mqar", level=lvl, epochs=epochs, seeds=seeds, group=lvl,
                    num_train=num_train, protocol=protocol)
                for lvl in levels for v in (variants or ("standard", "coupled_euler", "coupled_leapfrog", "mlp_only"))]
    if name == "h":
        return [Run(v, v, **common) for v in
                (variants or ("standard", "differential", "coupled_euler", "coupled_euler+differential"))]
    raise UserError(f"unknown recipe {name!r}; expected one of a b c d e f g h")


def with_grid(runs: list[Run], key: str, values: list[Any]) -> list[Run]:
    """Every cell once per value of config field ``key``; the value joins the cell name (``NAME/lr=0.001``)."""
    leaf = key.split(".")[-1]
    return [dataclasses.replace(r, name=f"{r.name}/{leaf}={v:g}" if isinstance(v, float) else f"{r.name}/{leaf}={v}",
                                config={**r.config, key: v})
            for r in runs for v in values]


# ---------------------------------------------------------------------------------------------------------------
# Running: one run directory per cell
# ---------------------------------------------------------------------------------------------------------------


def cell_spec(run: Run, cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """What identifies a cell's training: its Run fields and the resolved config (JSON round-tripped)."""
    return json.loads(json.dumps({"run": dataclasses.asdict(run), "config": cfg.to_dict()}, sort_keys=True))


def cell_status(workdir: Path) -> str:
    """'done' (summary.json says completed), 'partial' (a checkpoint to resume from) or 'new'."""
    summary = workdir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("status") == "completed":
        return "done"
    ck = workdir / "checkpoints"
    if ck.is_dir() and any(p.name.isdigit() for p in ck.iterdir()):
        return "partial"
    return "new"


STOP_RULE = tuple(f for f in rundir.CHANGEABLE_FIELDS if f.startswith("train.early_stop."))


def _training(spec: dict[str, Any]) -> dict[str, Any]:
    """What a cell spec trains: its Run fields but name and group (they only organise the report) and the
    stopping rule (train.early_stop: a stopped run is a prefix of the full one, so a cell may resume under another
    rule), and its config with the fields added since a run started read as they were (rundir.ADDED_FIELDS)."""
    run = {k: v for k, v in spec["run"].items() if k not in ("name", "group")}
    run["config"] = {k: v for k, v in run.get("config", {}).items() if k not in STOP_RULE}
    config = {**rundir.ADDED_FIELDS, **rundir.flatten(spec["config"])}
    config = {k: v for k, v in config.items() if k not in STOP_RULE}
    return {"run": run, "config": config}


def _same_training(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two cell specs train the same thing (see :func:`_training`)."""
    return _training(a) == _training(b)


def _stop_rule(spec: dict[str, Any]) -> dict[str, Any]:
    """The cell's train.early_stop fields (off where the spec predates them). A finished cell is finished only under
    its own rule: under another it is resumed (the loop re-judges its logged evaluations) and never reused."""
    config = {**rundir.ADDED_FIELDS, **rundir.flatten(spec["config"])}
    return {k: config[k] for k in STOP_RULE}


def _find_reusable(spec: dict[str, Any], reuse: list[Path]) -> Path | None:
    for d in reuse:
        for path in sorted(d.glob("*/cell.json")):
            other = json.loads(path.read_text())
            if (_same_training(other, spec) and _stop_rule(other) == _stop_rule(spec)
                    and cell_status(path.parent) == "done"):
                return path.parent
    return None


def diagnose(cfg: ml_collections.ConfigDict, workdir: Path) -> list[dict[str, Any]]:
    """Attention diagnostics (coupled_qk_jax.diagnostics_report) of every seed's final params on the first
    ``reports.DIAG_WINDOWS`` full validation windows (LM) or validation examples (MQAR)."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from coupled_qk_jax.data.pipeline import eval_batches  # noqa: PLC0415
    from coupled_qk_jax.diagnostics_report import compute_diagnostics  # noqa: PLC0415
    from coupled_qk_jax.training.run import Run  # noqa: PLC0415

    run = Run.open(workdir, config=cfg, report=False)
    if run.data is not None:
        first = next(iter(eval_batches(run.data.tokens("validation"), int(cfg.data.seq_len), reports.DIAG_WINDOWS,
                                       bos_id=run.data.eot_id)))
        tokens = first["inputs"][(first["targets"] != -100).all(axis=1)]
    else:
        batch = run.task().valid[0]  # the test split is scored only at the selected checkpoint
        tokens = batch["inputs"][batch["mask"]][: reports.DIAG_WINDOWS]
    return [compute_diagnostics(nnx.merge(run.graphdef, jax.device_get(run.params(replica=i))), tokens)
            for i in range(run.num_replicas)]


def run_cell(run: Run, cfg: ml_collections.ConfigDict, workdir: Path, *, force: bool = False,
             reuse: list[Path] | None = None, prune: bool = False) -> str:
    """Bring one cell's run directory to 'done' (or stop with a checkpoint): returns the loop's status."""
    from coupled_qk_jax.training import loop  # noqa: PLC0415

    spec = cell_spec(run, cfg)
    if workdir.exists() and force:
        shutil.rmtree(workdir)
    saved = workdir / "cell.json"
    before = json.loads(saved.read_text()) if saved.is_file() else None
    if before is not None and not _same_training(before, spec):
        raise UserError(f"{workdir} holds cell {run.name!r} trained with another configuration; use another "
                         f"--out / --runs-dir, or --force to retrain it from scratch")
    status = cell_status(workdir)
    if status == "done" and before is not None and _stop_rule(before) != _stop_rule(spec):
        status = "partial"  # finished under another stopping rule: the loop decides under this one
    if status == "new" and not saved.is_file():
        found = _find_reusable(spec, reuse or [])
        if found is not None:
            log(f"[{run.name}] reusing {found}")
            shutil.copytree(found, workdir)
            status = "done"
    workdir.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
    if status == "done":
        log(f"[{run.name}] done, skipping")
    else:
        log(f"[{run.name}] {'resuming' if status == 'partial' else 'starting'} in {workdir}")
        summary = loop.train(cfg, str(workdir), progress=False, allow_change=STOP_RULE)
        if summary["status"] != "completed":
            return summary["status"]
    if run.task == "mqar":  # the test split, scored once per seed at its validation-selected checkpoint
        from experiments.select_test import select_test  # noqa: PLC0415

        select_test(workdir, prune=prune)
    diag = workdir / "diagnostics.json"
    if not diag.is_file():
        tmp = diag.with_suffix(".tmp")
        tmp.write_text(json.dumps(diagnose(cfg, workdir)))
        os.replace(tmp, diag)
    return "completed"


def _per_seed(row: dict[str, Any], key: str) -> list[float]:
    return [float(x) for x in row.get(f"{key}/seeds", [row[key]])]


def run_commits(history: str) -> list[str]:
    """The code of each start and resume in a history.jsonl text, short (12 characters) but keeping the
    ``+dirty`` mark of a tree that differed from its commit; "not recorded" for runs older than the field."""
    out = set()
    for e in map(json.loads, history.splitlines()):
        if e.get("event") in ("start", "resume"):
            c = e.get("commit", "not recorded")
            if c not in ("not recorded", "unknown"):
                c = c.split("+")[0][:12] + ("+dirty" if c.endswith("+dirty") else "")
            out.add(c)
    return sorted(out)


def load_cell(run: Run, workdir: Path) -> dict[str, Any]:
    """One finished cell's record for ``experiments.reports``, read from its run directory."""
    from coupled_qk_jax.training.writers import read_metrics  # noqa: PLC0415

    spec = json.loads((workdir / "cell.json").read_text())
    summary = json.loads((workdir / "summary.json").read_text())
    rows = read_metrics(str(workdir))
    train_rows = [r for r in rows if "train_loss" in r]

    def wall_at(step: int) -> float:  # training seconds (compilation and evaluation excluded) at `step`
        before = [r["train_seconds"] for r in train_rows if r["step"] <= step]
        return float(before[-1]) if before else 0.0

    rec: dict[str, Any] = {
        "run": json.loads(reports.scrub(json.dumps(dataclasses.asdict(run)))), "model": spec["config"]["model"],
        "seeds": summary["seeds"], "num_params": summary["n_params"], "train_seconds": summary["train_seconds"],
        "tokens_per_step": summary["batch_size"] * summary["seq_len"],
        "log_steps": [r["step"] for r in train_rows], "train_loss": [_per_seed(r, "train_loss") for r in train_rows],
        "log_wall": [float(r["train_seconds"]) for r in train_rows],
        "diagnostics": json.loads((workdir / "diagnostics.json").read_text()),
        "commits": run_commits((workdir / rundir.HISTORY).read_text()),
    }
    if run.task == "lm":
        evals = [r for r in rows if "val_loss" in r]
        rec.update(corpus_str=reports.scrub(summary["corpus"]), eval_tokens=summary["val_tokens"],
                   eval_steps=[r["step"] for r in evals], eval_loss=[_per_seed(r, "val_loss") for r in evals],
                   eval_wall=[wall_at(r["step"]) for r in evals])
    else:
        evals = reports.one_row_per_step([r for r in rows if "valid/accuracy" in r])
        spe = summary["steps_per_epoch"]
        selected = json.loads((workdir / "test_selected.json").read_text())
        rec.update(level=summary["level"], protocol=summary.get("protocol", "cpu"), width=spec["config"]["model"]["d_model"],
                   lr=spec["config"]["train"]["lr"], epochs=[r["step"] // spe for r in evals],
                   accuracy=[_per_seed(r, "valid/accuracy") for r in evals],
                   valid_loss=[_per_seed(r, "valid/loss") for r in evals],
                   selected_epoch=[st // spe for st in selected["selected_step"]],
                   selected_validation=selected["validation"], test_accuracy=selected["test"]["valid/accuracy"],
                   test_examples=summary.get("num_test"))
    return rec


def run_all(runs: list[Run], out: Path, runs_dir: Path, cache_dir: str, eval_points: int = 10, force: bool = False,
            reuse: list[Path] | None = None, prune: bool = False) -> dict[str, dict[str, Any]] | None:
    """Bring every cell to 'done' in order; the records by cell name, or None when a cell was stopped (SIGTERM /
    Ctrl-C): rerunning the same command continues from there."""
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise UserError(f"run names must be unique, got {names}")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for run in runs:
        workdir = runs_dir / reports.safe_name(run.name)
        cfg = make_config(run, cache_dir, eval_points)
        status = run_cell(run, cfg, workdir, force=force, reuse=reuse, prune=prune)
        if status != "completed":
            log(f"[{run.name}] {status} with a checkpoint; rerun the same command to continue")
            return None
        results[run.name] = load_cell(run, workdir)
    return results


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------


def load_spec(path: str) -> list[Run]:
    """A JSON or YAML file holding a list of runs (or {"runs": [...]}) in `Run`'s field names."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml  # noqa: PLC0415

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if isinstance(data, dict):
        data = data["runs"]
    return [Run.from_dict(d) for d in data]


def _value(text: str) -> Any:
    """A command-line value: a Python literal when it parses as one (1e-3, 4, True, 'x'), else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _key_value(text: str, flag: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise UserError(f"{flag} expects KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", help="paper-claim recipe a..h")
    p.add_argument("--spec", help="JSON/YAML list of runs instead of a recipe")
    p.add_argument("--out", help="output directory (tables, figures)")
    p.add_argument("--runs-dir", help="run directories of the cells (default OUT/runs; checkpoints live there, so "
                                      "keep it out of the repository for committed results)")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0..S-1), trained in parallel")
    p.add_argument("--corpus", default="stdlib", help="corpus string of docs/data.md, e.g. text_dir:DIR")
    p.add_argument("--split-fractions", default="", help="train,validation,test shares of a file corpus, e.g. "
                   "0.8,0.1,0.1 (a small folder needs larger held-out shares than the default 0.98,0.01,0.01)")
    p.add_argument("--corpus-dir", help="recipe f: directory prepared by python -m experiments.corpora_prep")
    p.add_argument("--levels", default="easy", help="recipe g: comma-separated MQAR levels")
    p.add_argument("--epochs", type=int, default=16, help="recipe g: MQAR epochs")
    p.add_argument("--mqar-num-train", type=int, default=0, help="recipe g: training examples (0 = the level's)")
    p.add_argument("--protocol", default="cpu", help="recipe g: MQAR protocol, cpu or zoology (configs/mqar.py)")
    p.add_argument("--prune-checkpoints", action="store_true", help="MQAR: once the test split is scored at the "
                   "selected checkpoints, delete the other checkpoints but the newest (disk for large grids)")
    p.add_argument("--variants", help="comma-separated variants overriding the recipe's list")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="train every cell once per value of a config field, e.g. train.lr=1e-3,3e-3")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field in every cell, e.g. mesh.data=1")
    p.add_argument("--target-ppl", type=float, help="perplexity for tokens-to-target (default: see reports.lm_rows)")
    p.add_argument("--eval-points", type=int, default=10, help="validation evaluations per LM cell")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/coupled_qk_jax"))
    p.add_argument("--force", action="store_true", help="retrain cells from scratch (their run dirs are deleted)")
    p.add_argument("--reuse", default="", help="comma-separated runs dirs of other sweeps whose finished identical "
                                               "cells are copied instead of retrained")
    args = p.parse_args(argv)
    if not args.out or not (args.recipe or args.spec):
        p.error("--out and one of --recipe/--spec are required")

    from coupled_qk_jax.training import cli, loop  # noqa: PLC0415

    loop.install_stop_handlers()
    if args.corpus_dir:
        reports.SCRUB.append((str(Path(args.corpus_dir).resolve()), "$CORPUS_DIR"))
        reports.SCRUB.append((args.corpus_dir, "$CORPUS_DIR"))
    command = "python -m experiments.sweep " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--cache-dir"))

    stopped: list[bool] = []  # set when a cell was stopped before the end (SIGINT/SIGTERM or train.stop_after)

    def sweep() -> None:
        if args.spec:
            runs = load_spec(args.spec)
        else:
            runs = recipe(args.recipe, scale=args.scale, steps=args.steps, seeds=args.seeds, corpus=args.corpus,
                          corpus_dir=args.corpus_dir, levels=tuple(args.levels.split(",")), epochs=args.epochs,
                          variants=tuple(args.variants.split(",")) if args.variants else None,
                          num_train=args.mqar_num_train, protocol=args.protocol)
        overrides = dict(_key_value(kv, "--set") for kv in args.set)
        runs = [dataclasses.replace(r, config={**r.config, **{k: _value(v) for k, v in overrides.items()}})
                for r in runs]
        if args.split_fractions:  # a string field: not parsed as a tuple literal like --set values
            DataConfig(split_fractions=args.split_fractions).corpus_spec()
            runs = [dataclasses.replace(r, config={**r.config, "data.split_fractions": args.split_fractions})
                    if r.task == "lm" else r for r in runs]
        for g in args.grid:
            key, values = _key_value(g, "--grid")
            runs = with_grid(runs, key, [_value(v) for v in values.split(",")])
        out = Path(args.out)
        runs_dir = Path(args.runs_dir) if args.runs_dir else out / "runs"
        reuse = [Path(d) for d in args.reuse.split(",") if d]
        results = run_all(runs, out, runs_dir, args.cache_dir, eval_points=args.eval_points, force=args.force,
                          reuse=reuse, prune=args.prune_checkpoints)
        if results is None:
            stopped.append(True)
            return
        targets = {"main": "coupled_euler"} if args.recipe == "e" else None
        reports.report(results, out, command, args.target_ppl, targets,
                       title=f"Recipe {args.recipe}" if args.recipe else f"Sweep {args.spec}")
        log(f"wrote {out}/results.csv and results.md")

    code = cli.run_guarded(sweep)  # a user's mistake: one line "error: ..." on stderr, exit status 2
    if code == 0 and stopped and loop.stop_signal():
        code = 128 + loop.stop_signal()  # stopped by SIGINT/SIGTERM (130/143), like train.py: rerun to continue
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
