"""Attention diagnostics report for a trained model: JSON + PNG, per layer and head.

    from coupled_qk_jax.diagnostics_report import diagnostics_report
    report = diagnostics_report(model, tokens, out_dir="diag", name="coupled_euler")   # writes diag/*.json, *.png

From one diagnostic forward (``diagnostics.capture_layers``) it computes, per layer and head (averaged over the batch):

* attention entropy (mean over query rows, nats) and its normalised form (each row divided by the log of its causal
  length; 1 = uniform causal attention, 0 = one-hot);
* effective rank of the attention matrix (Roy & Vetterli);
* spectral gap ``σ1 − σ2`` and ``σ2/σ1`` of the attention matrix's singular values;
* attention-sink mass on position 0;
* induction mass (attention on the token after the previous occurrence of the current token);
* q and k norms and the cosine of each token's own (q, k), before and after the QK transform (the coupled dynamics),
  and the relative change the transform makes;
* the learned Δt per head (dynamics variants only).

The matrix metrics come from :mod:`coupled_qk_jax.diagnostics` (their definitions and tests live there). For
Differential Attention the "attention matrix" is ``A1 − λ·A2`` per differential head (H/2 of them): it is not
row-stochastic (it has negative entries), so its entropy and sink mass are not those of a distribution; the report
marks such layers with ``"attention_kind": "differential"``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from coupled_qk_jax import diagnostics, paths

ATTN_METRICS = ("entropy", "entropy_normalized", "effective_rank", "spectral_gap", "sigma2_over_sigma1", "sink_mass",
                "induction_mass")
QK_METRICS = ("q_norm_before", "q_norm_after", "k_norm_before", "k_norm_after", "qk_cos_before", "qk_cos_after",
              "q_rel_change", "k_rel_change")


# Compiled once: run op by op, one forward with its per-layer attention matrices compiles and dispatches hundreds of
# small programs.
_capture_layers = nnx.jit(diagnostics.capture_layers)


_qk_stats = jax.jit(diagnostics.qk_stats)


def compute_diagnostics(model: Any, tokens: Any, mask: Any | None = None) -> dict[str, Any]:
    """All diagnostics of ``model`` on ``tokens`` [B, T] as a JSON-friendly dict (Python floats only).

    Args:
      model: a ``TransformerLM`` (its per-layer values come from ``diagnostics.capture_layers``).
      tokens: int [B, T]; use unpadded windows (padded query rows would be averaged into the attention metrics).
      mask: optional bool [B, T] selecting tokens for the q/k statistics.

    Returns:
      ``{"variant", "tokens_shape", "layers": [{"layer", "attention_kind", "heads": [{metric: value}], "mean":
      {...}, "qk_heads": [{...}], "qk_mean": {...}, "dt": [...] | None}], "model_mean": {metric: value}}``.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    _, aux = _capture_layers(model, tokens)
    cfg = getattr(model, "cfg", None)
    differential = cfg is not None and cfg.scoring == "differential"
    attn_summary = diagnostics.summarize_attention([a["attn"] for a in aux], tokens=tokens)
    layers = []
    for i, (layer_aux, attn_layer) in enumerate(zip(aux, attn_summary["layers"])):
        qk = _qk_stats(layer_aux["q_before"], layer_aux["k_before"], layer_aux["q_after"],
                                  layer_aux["k_after"], mask=mask)
        qk = {k: np.asarray(jax.device_get(v), np.float64) for k, v in qk.items()}
        H = next(iter(qk.values())).shape[0]
        dt = layer_aux.get("dt")
        layers.append({
            "layer": i,
            "attention_kind": "differential" if differential else "softmax",
            "heads": attn_layer["heads"],
            "mean": attn_layer["mean"],
            "qk_heads": [{"head": h, **{k: float(v[h]) for k, v in qk.items()}} for h in range(H)],
            "qk_mean": {k: float(v.mean()) for k, v in qk.items()},
            "dt": None if dt is None else [float(x) for x in np.asarray(jax.device_get(dt)).reshape(-1)],
        })
    model_mean: dict[str, float] = {}
    for key in ATTN_METRICS:
        vals = [lay["mean"][key] for lay in layers if key in lay["mean"]]
        if vals:
            model_mean[key] = float(np.mean(vals))
    for key in QK_METRICS:
        model_mean[key] = float(np.mean([lay["qk_mean"][key] for lay in layers]))
    dts = [x for lay in layers if lay["dt"] for x in lay["dt"]]
    if dts:
        model_mean["dt_mean"] = float(np.mean(dts))
        model_mean["dt_abs_mean"] = float(np.mean(np.abs(dts)))
    return {"variant": getattr(cfg, "variant", None), "tokens_shape": list(tokens.shape), "layers": layers,
            "model_mean": model_mean}


def _grid(layers: list[dict[str, Any]], key: str, field: str = "heads") -> np.ndarray:
    """[layers, heads] array of one metric (NaN where absent)."""
    H = max(len(lay[field]) for lay in layers)
    out = np.full((len(layers), H), np.nan)
    for i, lay in enumerate(layers):
        for h, head in enumerate(lay[field]):
            out[i, h] = head.get(key, np.nan)
    return out


# Panels of the figure, in order, each (metric, field of the layer dict, colour group). A group is one colour scale:
# metrics with natural bounds use them (so figures of different runs, splits and steps read alike), and related
# panels (q/k norms before and after the transform, the two relative changes) share one range, so equal values have
# equal colours wherever they appear.
PANELS: tuple[tuple[str, str, str], ...] = (
    ("entropy", "heads", "entropy"), ("entropy_normalized", "heads", "unit"), ("effective_rank", "heads", "rank"),
    ("spectral_gap", "heads", "gap"), ("sigma2_over_sigma1", "heads", "unit"), ("sink_mass", "heads", "unit"),
    ("induction_mass", "heads", "unit"),
    ("q_norm_before", "qk_heads", "norm"), ("q_norm_after", "qk_heads", "norm"), ("k_norm_before", "qk_heads", "norm"),
    ("k_norm_after", "qk_heads", "norm"), ("qk_cos_before", "qk_heads", "cos"), ("qk_cos_after", "qk_heads", "cos"),
    ("q_rel_change", "qk_heads", "change"), ("k_rel_change", "qk_heads", "change"),
)
# Natural bounds; a group without one takes the min..max of its panels. Differential attention's A1 - λ·A2 can leave
# [0, 1], so a bound widens to the data rather than clipping it.
GROUP_BOUNDS: dict[str, tuple[float, float]] = {"unit": (0.0, 1.0), "cos": (-1.0, 1.0)}
GROUP_CMAPS: dict[str, str] = {"cos": "RdBu_r"}


def colour_limits(grids: dict[str, np.ndarray], groups: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(vmin, vmax) per group from the [layers, heads] grids of its metrics (NaN ignored)."""
    limits: dict[str, tuple[float, float]] = {}
    for group in set(groups.values()):
        vals = np.concatenate([g[np.isfinite(g)] for k, g in grids.items() if groups[k] == group] or [np.zeros(0)])
        lo, hi = GROUP_BOUNDS.get(group, (np.inf, -np.inf))
        if vals.size:
            lo, hi = min(lo, float(vals.min())), max(hi, float(vals.max()))
        if not np.isfinite(lo) or not np.isfinite(hi):
            lo, hi = 0.0, 1.0
        if hi - lo < 1e-12:  # a constant metric (e.g. no change under the standard variant): a visible range
            lo, hi = lo - 0.5, hi + 0.5
        limits[group] = (lo, hi)
    return limits


def plot_diagnostics(report: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Per-layer x per-head heatmaps of every metric (one panel each, one colour scale per metric group, see
    :data:`PANELS`), plus the learned Δt per head when the model has it."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    layers = report["layers"]
    panels = [(k, f, g) for k, f, g in PANELS if k in layers[0][f][0]]
    grids = {k: _grid(layers, k, f) for k, f, _ in panels}
    limits = colour_limits(grids, {k: g for k, _, g in panels})
    has_dt = any(lay["dt"] for lay in layers)
    n = len(panels) + (1 if has_dt else 0)
    cols = 4
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, (key, _, group) in zip(axes.flat, panels):
        g = grids[key]
        vmin, vmax = limits[group]
        cmap = plt.get_cmap(GROUP_CMAPS.get(group, "viridis"))
        im = ax.imshow(g, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
        for (i, h), v in np.ndenumerate(g):
            if np.isfinite(v):
                r, gr, b, _ = cmap((v - vmin) / (vmax - vmin))
                dark = 0.299 * r + 0.587 * gr + 0.114 * b < 0.5  # white text on dark cells, black on light ones
                ax.text(h, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if dark else "k")
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.set_xticks(range(g.shape[1]))
        ax.set_yticks(range(g.shape[0]))
        ax.tick_params(labelsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046).ax.tick_params(labelsize=6)
    used = len(panels)
    if has_dt:
        ax = axes.flat[used]
        dt = np.array([lay["dt"] or [np.nan] for lay in layers], dtype=float)
        width = 0.8 / len(dt)
        for i, row in enumerate(dt):  # one bar per layer, grouped around each head's tick
            ax.bar(np.arange(len(row)) + (i - (len(dt) - 1) / 2) * width, row, width=width, label=f"layer {i}")
        ax.set_title("learned Δt per head", fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.set_xticks(range(dt.shape[1]))
        top = np.nanmax(np.abs(dt)) if np.isfinite(dt).any() else 1.0
        ax.set_ylim(min(0.0, float(np.nanmin(dt)) * 1.1), 1.35 * top)  # headroom for the legend
        ax.axhline(0.0, color="k", lw=0.5)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5, ncol=min(len(dt), 4), loc="upper center")
        used += 1
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(title or f"attention diagnostics: {report.get('variant')}", fontsize=10)
    fig.tight_layout()
    path = paths.as_path(path)
    paths.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def diagnostics_report(model: Any, tokens: Any, out_dir: str | Path | None = None, name: str = "diagnostics",
                       mask: Any | None = None, extra: dict[str, Any] | None = None, title: str = "") -> dict[str, Any]:
    """Compute the diagnostics (plus the ``extra`` provenance fields) and, with ``out_dir``, write ``NAME.json``
    and ``NAME.png`` there."""
    report = {**compute_diagnostics(model, tokens, mask=mask), **(extra or {})}
    if out_dir is not None:
        out = paths.as_path(out_dir)
        if not paths.is_remote(out):  # a URL needs no directory (paths.makedirs)
            out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
        plot_diagnostics(report, out / f"{name}.png", title=title)
    return report


def report_name(split: str, step: int, replica: int | None = None) -> str:
    """``diagnostics_<split>_step<step>[_replica<K>]``: one pair of files per split, checkpoint and replica (the
    replica named only for seed-parallel runs), so none overwrites another."""
    return f"diagnostics_{split}_step{int(step)}" + (f"_replica{replica}" if replica is not None else "")


def report_from_checkpoint(run: Any, split: str = "validation", windows: int = 8,
                           out_dir: str | Path | None = None, step: int | None = None,
                           replica: int = 0) -> dict[str, Any] | None:
    """Diagnostics of one replica of checkpoint ``step`` (default: the newest intact one) of ``run`` (a
    training.run.Run, or a run directory to open) on the first ``windows`` full windows of ``split``; writes
    :func:`report_name`'s ``.json`` and ``.png`` to ``out_dir`` (default the run directory). The report carries
    ``checkpoint_step``, ``replica``, ``split`` and ``files`` (the two paths).

    This is what ``eval.py --diagnostics`` calls, once per replica it evaluates. The params are gathered to the
    host: the diagnostics are small (a few windows) and run unsharded. On several processes every one must call
    this (the gather is a collective); process 0 computes and writes the report, the others return None.
    """

    from coupled_qk_jax.data.pipeline import eval_batches  # noqa: PLC0415
    from coupled_qk_jax.errors import UserError  # noqa: PLC0415
    from coupled_qk_jax.training.run import Run  # noqa: PLC0415

    run = run if isinstance(run, Run) else Run.open(run)
    if run.data is None:
        raise UserError(f"--diagnostics reads a token split; {run.workdir} is a {run.cfg.task} run (the sweep driver "
                        f"computes MQAR diagnostics on the test examples)")
    step, _ = run.state(step)
    from coupled_qk_jax.sharding import to_host  # noqa: PLC0415

    params = jax.tree.map(to_host, run.params(step, replica))  # all-gathered where shards are on other processes
    if jax.process_index() != 0:
        return None
    model = nnx.merge(run.graphdef, params)
    seq_len = int(run.cfg.data.seq_len)
    batch = next(iter(eval_batches(run.data.tokens(split), seq_len, windows, bos_id=run.data.eot_id)))
    tokens = batch["inputs"][(batch["targets"] != -100).all(axis=1)]
    if len(tokens) == 0:
        raise ValueError(f"the {split} split has no full window of {seq_len} tokens")
    out = paths.as_path(out_dir or run.workdir)
    name = report_name(split, step, replica if run.num_replicas > 1 else None)
    files = {"json": str(out / f"{name}.json"), "png": str(out / f"{name}.png")}
    which = f", replica {replica} (seed {run.seeds[replica]})" if run.num_replicas > 1 else ""
    return diagnostics_report(model, tokens, out_dir=out, name=name,
                              extra={"checkpoint_step": step, "replica": replica, "seed": run.seeds[replica],
                                     "split": split, "files": files},
                              title=f"attention diagnostics: {run.mcfg.variant}{which}, {split} split, step {step} "
                                    f"({len(tokens)} windows of {seq_len} tokens)")
