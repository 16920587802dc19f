"""The bridge from the QK/OV learning-speed study to the coupled-QK language models.

Question: does faster QK learning (the second seed paper's intervention, ``train.qk_lr_mult``) sharpen attention in
the coupled model too, and at what cost in validation perplexity?

    python -m experiments.qkov_lm_bridge --out results/qkov_lm --steps 90 --seeds 2

For every (variant, qk_lr_mult) cell the runner trains all seeds as one vmapped program in a run directory of the
training loop (``training.loop.train`` with ``train.num_seeds``, configured through ``experiments.sweep.make_config``
so the optimiser, schedule and data are exactly the sweep's; a stopped cell resumes from its checkpoint), measures
validation perplexity over the *whole* validation split, then reads the attention of every layer on held-out
validation windows
(``diagnostics.capture_layers``) and computes, per layer and averaged over layers:

* ``entropy``: mean row entropy of the attention (nats), over batch, heads and query rows;
* ``entropy_norm``: the same with row ``i`` divided by ``log(i+1)`` (uniform causal attention = 1, one-hot = 0);
* ``sink_mass``: mean attention on position 0;
* ``rel_mass``: induction-style relevant mass. For a query row ``t`` whose token occurred earlier, the relevant key
  is ``j = p(t) + 1`` where ``p(t)`` is the latest earlier position holding the same token
  (``coupled_qk_jax.diagnostics.previous_token_relevance_mask``): the token that followed the previous occurrence,
  i.e. what an induction head copies. ``rel_mass`` is ``A[t, j]`` averaged over valid (batch, head, row) samples;
* ``ac``: AC (project definition, spec §6) = % of valid (batch, head, row) samples with ``A[t, j] >= tau_att``;
* ``ac_best_head``: the largest per-head AC in the layer (induction is usually carried by few heads, which the
  head average dilutes);
* ``acmc``: % of valid samples with ``A[t, j] >= tau_att`` *and* the model's probability of the true next token at
  ``t`` ``>= tau_conf``.

Rows with no earlier occurrence of their token have no relevant position and are excluded from ``rel_mass``, AC and
ACMC (their count is reported as ``valid_rows``). Only the ``qk`` group (``W_Q``, ``W_K``) is sped up;
``qk_mult_coupling`` defaults to off, so the coupling network f and its Δt keep the base learning rate
(``--qk-mult-coupling`` turns it on).

Outputs in ``--out``: ``runs/<variant>_qk<m>/`` (the cell's run directory) and ``runs/<variant>_qk<m>.json`` (its
measurements, written as soon as the cell finishes; a rerun skips finished cells), ``per_seed.csv``, ``results.csv`` / ``results.md`` (mean ± sample std over seeds),
``per_layer.csv`` / ``per_layer.md`` and ``bridge.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coupled_qk_jax import diagnostics as diag
from coupled_qk_jax.qkov import metrics as qm
from coupled_qk_jax.reporting import code_commit
from coupled_qk_jax.reporting import log as _log
from coupled_qk_jax.reporting import mean_std as _ms
from coupled_qk_jax.reporting import write_csv

# Per-sample metrics the summary turns into per-layer numbers. ("entropy", "entropy_norm", "sink_mass" are means
# over every query row; the relevance metrics only over rows that have a relevant position.)
LAYER_METRICS = ("entropy", "entropy_norm", "sink_mass", "rel_mass", "ac", "ac_best_head", "acmc")


# ---------------------------------------------------------------------------------------------------------------
# Metric assembly (pure; tested on hand-made attention maps)
# ---------------------------------------------------------------------------------------------------------------


def layer_samples(attn: jax.Array, tokens: jax.Array, target_ok: jax.Array) -> dict[str, jax.Array]:
    """Per-sample attention statistics of one layer (jit/vmap friendly).

    Args:
      attn: ``[B, H, T, T]`` row-stochastic causal attention.
      tokens: int ``[B, T]`` the layer's input tokens.
      target_ok: bool ``[B, T]``: True where the row has a real next-token target (False on padding).

    Returns:
      ``entropy``, ``entropy_norm``, ``sink_mass``: ``[B, H]`` means over query rows; ``rel_mass``: ``[B, H, T]``
      attention on the induction target of each row; ``valid``: bool ``[B, T]`` rows with an earlier occurrence
      of their token and a real target.
    """
    mask, valid = diag.previous_token_relevance_mask(tokens)  # [B, T, T], [B, T]
    return {
        "entropy": diag.attention_entropy(attn),
        "entropy_norm": diag.attention_entropy(attn, normalized=True),
        "sink_mass": diag.sink_mass(attn),
        "rel_mass": jnp.sum(attn * mask[:, None].astype(attn.dtype), axis=-1),
        "valid": valid & target_ok,
    }


def summarize_layer(samples: Mapping[str, np.ndarray], prob: np.ndarray, tau_att: float = 0.5,
                    tau_conf: float = 0.5) -> dict[str, float]:
    """One layer's summary from :func:`layer_samples` outputs concatenated over batches.

    Args:
      samples: ``entropy``/``entropy_norm``/``sink_mass`` ``[N, H]``, ``rel_mass`` ``[N, H, T]``, ``valid``
        ``[N, T]`` (``N`` sequences).
      prob: ``[N, T]`` the model's probability of the true next token at each query row.
      tau_att, tau_conf: AC / ACMC thresholds (spec §6).

    Returns:
      ``{metric: float}`` for ``LAYER_METRICS`` plus ``valid_rows`` (per head). AC, ``ac_best_head`` and ACMC are
      percentages; they are NaN when no row is valid.
    """
    mass = np.asarray(samples["rel_mass"], np.float64)  # [N, H, T]
    valid = np.asarray(samples["valid"], bool)  # [N, T]
    prob = np.asarray(prob, np.float64)
    H = mass.shape[1]
    out = {k: float(np.mean(np.asarray(samples[k], np.float64))) for k in ("entropy", "entropy_norm", "sink_mass")}
    n_valid = int(valid.sum())
    out["valid_rows"] = float(n_valid)
    if n_valid == 0:
        out.update(rel_mass=math.nan, ac=math.nan, ac_best_head=math.nan, acmc=math.nan)
        return out
    # samples = (sequence, head, valid row); the probability belongs to the row, shared by its heads.
    per_head = [mass[:, h, :][valid] for h in range(H)]  # H x [n_valid]
    m = np.concatenate(per_head)
    p = np.tile(prob[valid], H)
    out["rel_mass"] = float(m.mean())
    out["ac"] = qm.attention_concentration(m, tau_att)
    out["ac_best_head"] = max(qm.attention_concentration(x, tau_att) for x in per_head)
    out["acmc"] = qm.acmc(m, p, tau_att, tau_conf)
    return out


def assemble(layers: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Per-layer summaries -> ``{"layers": [...], "mean": {metric: mean over layers}}``."""
    mean = {k: float(np.mean([l[k] for l in layers])) for k in LAYER_METRICS}
    mean["valid_rows"] = float(layers[0]["valid_rows"])
    return {"layers": [dict(l) for l in layers], "mean": mean}


def make_collect_fn(graphdef: Any):
    """A jitted ``(params, inputs, targets) -> (per-layer samples, true-token prob [B, T])`` for one seed.

    Only the per-sample reductions leave the device, not the ``[B, H, T, T]`` attention maps.
    """
    from flax import nnx  # noqa: PLC0415

    def fn(params, inputs, targets):
        model = nnx.merge(graphdef, params)
        logits, aux = diag.capture_layers(model, inputs)
        ok = targets >= 0
        prob = qm.true_label_prob(logits, jnp.where(ok, targets, 0))
        return [layer_samples(a["attn"], inputs, ok) for a in aux], prob

    return jax.jit(fn)


def attention_diagnostics(collect_fn, params: Any, batches: Iterable[Mapping[str, np.ndarray]],
                          tau_att: float = 0.5, tau_conf: float = 0.5) -> dict[str, Any]:
    """Run ``collect_fn`` over held-out batches and assemble the per-layer and averaged metrics of one model."""
    per_layer: list[dict[str, list[np.ndarray]]] | None = None
    probs = []
    for b in batches:
        samples, prob = jax.device_get(collect_fn(params, b["inputs"], b["targets"]))
        if per_layer is None:
            per_layer = [{k: [] for k in s} for s in samples]
        for acc, s in zip(per_layer, samples):
            for k, v in s.items():
                acc[k].append(np.asarray(v))
        probs.append(np.asarray(prob))
    if per_layer is None:
        raise ValueError("attention_diagnostics: no batches")
    prob = np.concatenate(probs)
    layers = [summarize_layer({k: np.concatenate(v) for k, v in acc.items()}, prob, tau_att, tau_conf)
              for acc in per_layer]
    return assemble(layers)


def diagnostic_batches(val_tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int,
                       eot_id: int | None) -> list[dict[str, np.ndarray]]:
    """The first ``n_batches`` *full* validation batches (no padded rows: entropy and sink mass average every query
    row, so padding would bias them)."""
    from coupled_qk_jax.data.pipeline import eval_batches  # noqa: PLC0415

    out = []
    for b in eval_batches(val_tokens, seq_len, batch_size, bos_id=eot_id):
        if len(out) >= n_batches:
            break
        if np.all(b["targets"] >= 0):
            out.append(b)
    return out


def uniform_reference(batches: Sequence[Mapping[str, np.ndarray]], tau_att: float = 0.5) -> dict[str, float]:
    """Chance levels of the relevance metrics on the same held-out windows: uniform causal attention (each row ``t``
    spreads ``1/(t+1)`` over its window), one head. Its normalised entropy is 1 by construction; ACMC is not
    defined for it (no model probability) and is left out."""
    rows = []
    for b in batches:
        tokens = jnp.asarray(b["inputs"])
        B, T = tokens.shape
        attn = jnp.broadcast_to(jnp.tril(jnp.ones((T, T))) / jnp.arange(1, T + 1)[:, None], (B, 1, T, T))
        rows.append(jax.device_get(layer_samples(attn, tokens, jnp.asarray(b["targets"]) >= 0)))
    samples = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    s = summarize_layer(samples, np.zeros(samples["valid"].shape), tau_att)
    return {k: s[k] for k in ("entropy", "entropy_norm", "sink_mass", "rel_mass", "ac", "valid_rows")}


# ---------------------------------------------------------------------------------------------------------------
# Running one cell and the grid
# ---------------------------------------------------------------------------------------------------------------


def cell_name(variant: str, qk_mult: float) -> str:
    return f"{variant}_qk{qk_mult:g}"


def run_cell(variant: str, qk_mult: float, *, workdir: str | Path, scale: str, steps: int, seeds: Sequence[int],
             corpus: Any, cache_dir: str, tokenizer: str = "bpe", qk_mult_coupling: bool = False,
             diag_batches: int = 4, tau_att: float = 0.5, tau_conf: float = 0.5, eval_points: int = 2,
             model_overrides: Mapping[str, Any] | None = None,
             train_overrides: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Train one (variant, qk_lr_mult) cell for all seeds in parallel in ``workdir`` (resumed if it holds a
    checkpoint) and measure it. Returns a JSON-able dict, or None when training was stopped (SIGTERM)."""
    commit = code_commit()  # taken before training: a checkout changed while the cell trains must not relabel it
    from coupled_qk_jax.training import loop  # noqa: PLC0415
    from coupled_qk_jax.training.run import Run as SavedRun  # noqa: PLC0415
    from experiments.sweep import Run, make_config  # noqa: PLC0415

    seeds = [int(x) for x in seeds]
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):
        raise ValueError(f"seeds must be consecutive (the loop trains train.seed .. train.seed + S - 1), got {seeds}")
    train = {"qk_lr_mult": float(qk_mult), "ov_lr_mult": 1.0, "qk_mult_coupling": bool(qk_mult_coupling),
             "log_every": max(1, steps // 10)}
    train.update(train_overrides or {})
    run = Run(cell_name(variant, qk_mult), variant, scale=scale, corpus=corpus, steps=steps, seeds=len(seeds),
              seed=seeds[0], model=dict(model_overrides or {}), train=train, tokenizer=tokenizer)
    cfg = make_config(run, cache_dir, eval_points)
    summary = loop.train(cfg, str(workdir), progress=False)
    if summary["status"] != "completed":
        return None
    saved = SavedRun.open(workdir, config=cfg, report=False)
    seq_len, batch = int(cfg.data.seq_len), int(cfg.train.batch_size)
    batches = diagnostic_batches(saved.data.tokens("validation"), seq_len, batch, diag_batches, saved.data.eot_id)
    collect = make_collect_fn(saved.graphdef)
    t0 = time.perf_counter()
    per_seed = [attention_diagnostics(collect, loop.host_params(saved.params(replica=i)), batches, tau_att, tau_conf)
                for i in range(len(seeds))]
    final_ppl = summary.get("val_ppl/seeds", [summary["val_ppl"]])
    _log(f"[{run.name}] diagnostics {time.perf_counter() - t0:.0f}s; ppl {np.round(final_ppl, 2)} "
         f"H_norm {[round(d['mean']['entropy_norm'], 3) for d in per_seed]}")
    training = {"tokens_per_step": batch * seq_len, "train_seconds": summary["train_seconds"],
                "eval_tokens": summary["val_tokens"], "seeds": seeds}
    return {"variant": variant, "qk_lr_mult": float(qk_mult), "ov_lr_mult": 1.0,
            "qk_mult_coupling": bool(qk_mult_coupling), "scale": scale, "steps": steps, "seeds": seeds,
            "corpus": summary["corpus"], "tokenizer": tokenizer, "seq_len": seq_len, "batch_size": batch,
            "tau_att": tau_att, "tau_conf": tau_conf, "diag_sequences": len(batches) * batch,
            "train_cfg": cfg.train.to_dict(), "training": training, "final_ppl": final_ppl, "diagnostics": per_seed,
            "commit": commit}


def per_seed_rows(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, qk_lr_mult, seed): perplexity and the layer-averaged diagnostics."""
    rows = []
    for c in cells:
        tokens = c["training"]["tokens_per_step"] * c["steps"]
        for i, seed in enumerate(c["seeds"]):
            d = c["diagnostics"][i]["mean"]
            rows.append({"variant": c["variant"], "qk_lr_mult": c["qk_lr_mult"], "ov_lr_mult": c["ov_lr_mult"],
                         "qk_mult_coupling": c["qk_mult_coupling"], "seed": seed, "steps": c["steps"],
                         "tokens_per_seed": tokens, "val_ppl": c["final_ppl"][i],
                         **{k: d[k] for k in LAYER_METRICS}, "valid_rows": d["valid_rows"]})
    return rows


def aggregate_rows(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, qk_lr_mult): mean and sample std over seeds of perplexity and every metric."""
    rows = []
    for c in cells:
        S = len(c["seeds"])
        row: dict[str, Any] = {"variant": c["variant"], "qk_lr_mult": c["qk_lr_mult"], "ov_lr_mult": c["ov_lr_mult"],
                               "qk_mult_coupling": c["qk_mult_coupling"], "seeds": S, "steps": c["steps"],
                               "tokens_per_seed": c["training"]["tokens_per_step"] * c["steps"],
                               "train_seconds": c["training"]["train_seconds"]}
        row["val_ppl_mean"], row["val_ppl_std"] = _ms(c["final_ppl"])
        for k in LAYER_METRICS:
            row[f"{k}_mean"], row[f"{k}_std"] = _ms([d["mean"][k] for d in c["diagnostics"]])
        rows.append(row)
    return rows


def per_layer_rows(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, qk_lr_mult, layer): mean and std over seeds."""
    rows = []
    for c in cells:
        for li in range(len(c["diagnostics"][0]["layers"])):
            row: dict[str, Any] = {"variant": c["variant"], "qk_lr_mult": c["qk_lr_mult"], "layer": li}
            for k in LAYER_METRICS:
                row[f"{k}_mean"], row[f"{k}_std"] = _ms([d["layers"][li][k] for d in c["diagnostics"]])
            rows.append(row)
    return rows


def _pm(row: Mapping[str, Any], key: str, fmt: str) -> str:
    return f"{row[key + '_mean']:{fmt}} ± {row[key + '_std']:{fmt}}"


def markdown_tables(agg: Sequence[Mapping[str, Any]], layers: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    head = ("| variant | qk_lr_mult | val ppl | entropy (nats) | entropy (norm.) | sink mass | rel. mass | AC % "
            "| AC best head % | ACMC % |")
    sep = "|" + "---|" * 10
    lines = [head, sep]
    for r in agg:
        lines.append(f"| {r['variant']} | {r['qk_lr_mult']:g} | {_pm(r, 'val_ppl', '.2f')} | "
                     f"{_pm(r, 'entropy', '.3f')} | {_pm(r, 'entropy_norm', '.3f')} | {_pm(r, 'sink_mass', '.3f')} | "
                     f"{_pm(r, 'rel_mass', '.3f')} | {_pm(r, 'ac', '.2f')} | {_pm(r, 'ac_best_head', '.2f')} | "
                     f"{_pm(r, 'acmc', '.2f')} |")
    lhead = ("| variant | qk_lr_mult | layer | entropy (norm.) | sink mass | rel. mass | AC % | AC best head % "
             "| ACMC % |")
    llines = [lhead, "|" + "---|" * 9]
    for r in layers:
        llines.append(f"| {r['variant']} | {r['qk_lr_mult']:g} | {r['layer']} | {_pm(r, 'entropy_norm', '.3f')} | "
                      f"{_pm(r, 'sink_mass', '.3f')} | {_pm(r, 'rel_mass', '.3f')} | {_pm(r, 'ac', '.2f')} | "
                      f"{_pm(r, 'ac_best_head', '.2f')} | {_pm(r, 'acmc', '.2f')} |")
    return "\n".join(lines), "\n".join(llines)


def plot(agg: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Four panels against qk_lr_mult (log x): val ppl, normalised entropy, relevant mass, AC; one line per variant,
    error bars = sample std over seeds."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = [("val_ppl", "validation perplexity"), ("entropy_norm", "attention entropy (normalised)"),
              ("rel_mass", "mass on induction target"), ("ac", "AC % (tau_att)")]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (key, title) in zip(axes, panels):
        for i, v in enumerate(dict.fromkeys(r["variant"] for r in agg)):
            rs = sorted((r for r in agg if r["variant"] == v), key=lambda r: r["qk_lr_mult"])
            x = [r["qk_lr_mult"] for r in rs]
            ax.errorbar(x, [r[f"{key}_mean"] for r in rs], yerr=[r[f"{key}_std"] for r in rs], marker="o",
                        capsize=3, color=f"C{i}", label=v)
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["qk_lr_mult"] for r in agg}))
        ax.set_xticklabels([f"{m:g}" for m in sorted({r["qk_lr_mult"] for r in agg})])
        ax.set_xlabel("qk_lr_mult")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(cells: Sequence[Mapping[str, Any]], out: Path, command: str,
           reference: Mapping[str, float] | None = None) -> None:
    """Write the CSV/Markdown tables and the PNG for finished cells (and the uniform-attention chance levels)."""
    agg = aggregate_rows(cells)
    layers = per_layer_rows(cells)
    write_csv(out / "per_seed.csv", per_seed_rows(cells))
    write_csv(out / "results.csv", agg)
    write_csv(out / "per_layer.csv", layers)
    main_md, layer_md = markdown_tables(agg, layers)
    c0 = cells[0]
    intro = [f"Produced by: `{command}`", "",
             f"Scale `{c0['scale']}`, corpus `{c0['corpus']}` ({c0['tokenizer']} tokenizer), {c0['steps']} steps x "
             f"{c0['training']['tokens_per_step']:,} tokens = {c0['training']['tokens_per_step'] * c0['steps']:,} "
             f"training tokens per seed; seeds {c0['seeds']}; ov_lr_mult 1; qk_mult_coupling "
             f"{'on' if c0['qk_mult_coupling'] else 'off'}. Validation perplexity over the whole validation split "
             f"({c0['training']['eval_tokens']:,} tokens). Attention diagnostics on {c0['diag_sequences']} held-out "
             f"validation windows, averaged over layers; tau_att {c0['tau_att']}, tau_conf {c0['tau_conf']}. "
             "Mean ± sample std over seeds.", "",
             "Code (each cell's commit, `+dirty` = uncommitted changes to the code): "
             + "; ".join(f"{c['variant']} ×{c['qk_lr_mult']:g}: {c.get('commit', 'not recorded')[:12]}"
                         for c in cells) + ".", ""]
    ref_md = []
    if reference is not None:
        ref_md = ["", f"Chance reference (uniform causal attention on the same windows; "
                      f"{int(reference['valid_rows']):,} valid rows of {c0['diag_sequences'] * c0['seq_len']:,}): "
                      f"entropy {reference['entropy']:.3f} nats, normalised 1, sink mass {reference['sink_mass']:.3f}, "
                      f"rel. mass {reference['rel_mass']:.4f}, AC {reference['ac']:.2f} %.", ""]
        (out / "uniform_reference.json").write_text(json.dumps(dict(reference), indent=1) + "\n")
    (out / "results.md").write_text("\n".join(intro + [main_md] + ref_md + [""]))
    (out / "per_layer.md").write_text("\n".join(intro + [layer_md, ""]))
    plot(agg, out / "bridge.png")
    (out / "command.txt").write_text(command + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="standard,coupled_euler")
    p.add_argument("--qk-mults", default="1,5,20")
    p.add_argument("--qk-mult-coupling", action="store_true",
                   help="also speed up the coupling network f and its dt (default off: only W_Q, W_K)")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--seeds", type=int, default=2, help="number of seeds (0..S-1), trained in parallel")
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--tokenizer", default="bpe")
    p.add_argument("--diag-batches", type=int, default=4, help="held-out validation batches for the diagnostics")
    p.add_argument("--tau-att", type=float, default=0.5)
    p.add_argument("--tau-conf", type=float, default=0.5)
    p.add_argument("--eval-points", type=int, default=2, help="validation evaluations per run (last = final)")
    p.add_argument("--model", default="{}", help="JSON model overrides (tests use a tiny shape)")
    p.add_argument("--train", default="{}", help="JSON train overrides (e.g. batch_size)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/coupled_qk_jax"))
    p.add_argument("--force", action="store_true", help="retrain cells already saved under OUT/runs")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the uniform-attention chance levels (they re-read the validation tokens)")
    args = p.parse_args(argv)

    from coupled_qk_jax.training import loop  # noqa: PLC0415

    loop.install_stop_handlers()  # SIGINT/SIGTERM: the running cell saves a checkpoint; the same command continues
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.qkov_lm_bridge " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--cache-dir"))
    seeds = list(range(args.seeds))
    cells = []
    # Multiplier-major order: a grid stopped early still holds both variants at the multipliers it reached.
    for m in (float(x) for x in args.qk_mults.split(",")):
        for variant in args.variants.split(","):
            path = out / "runs" / f"{cell_name(variant, m)}.json"
            workdir = out / "runs" / cell_name(variant, m)
            if path.is_file() and not args.force:
                saved = json.loads(path.read_text())
                # reuse only a cell trained exactly as asked (a changed flag must retrain, not silently reuse)
                same = (saved["steps"], saved["seeds"], saved["scale"], saved["qk_mult_coupling"],
                        saved["tokenizer"], saved["corpus"]) == (args.steps, seeds, args.scale,
                                                                 args.qk_mult_coupling, args.tokenizer, args.corpus)
                if same:
                    _log(f"[{cell_name(variant, m)}] already done, skipping")
                    cells.append(saved)
                    continue
            if (args.force or path.is_file()) and workdir.exists():  # retrain from scratch, not resume
                shutil.rmtree(workdir)
            cell = run_cell(variant, m, workdir=workdir, scale=args.scale, steps=args.steps, seeds=seeds,
                            corpus=args.corpus, cache_dir=args.cache_dir, tokenizer=args.tokenizer,
                            qk_mult_coupling=args.qk_mult_coupling, diag_batches=args.diag_batches,
                            tau_att=args.tau_att, tau_conf=args.tau_conf, eval_points=args.eval_points,
                            model_overrides=json.loads(args.model), train_overrides=json.loads(args.train))
            if cell is None:
                _log(f"[{cell_name(variant, m)}] stopped with a checkpoint; rerun the same command to continue")
                if loop.stop_signal():  # SIGINT / SIGTERM: exit 130 / 143, as train.py and the sweep do
                    raise SystemExit(128 + loop.stop_signal())
                return
            path.write_text(json.dumps(cell, indent=1))
            cells.append(cell)
            report(cells, out, command)  # tables after every cell, so partial grids are readable
    reference = None
    if args.reference:
        from coupled_qk_jax.data.token_cache import build_token_cache  # noqa: PLC0415
        from experiments.sweep import Run, make_config  # noqa: PLC0415

        c0 = cells[0]
        # the same tokenizer/vocabulary as the cells (resolved exactly as run_cell does)
        cfg = make_config(Run("ref", c0["variant"], scale=args.scale, tokenizer=args.tokenizer,
                              model=json.loads(args.model)), args.cache_dir)
        cache = build_token_cache(args.corpus, args.cache_dir, tokenizer=args.tokenizer,
                                  vocab_size=int(cfg.model.vocab_size))
        batches = diagnostic_batches(cache.tokens("validation"), c0["seq_len"], c0["batch_size"], args.diag_batches,
                                     cache.eot_id)
        reference = uniform_reference(batches, args.tau_att)
    report(cells, out, command, reference)
    _log(f"wrote {out}/results.md")


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
