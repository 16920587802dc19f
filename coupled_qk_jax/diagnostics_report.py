"""Attention diagnostics report for a trained model: JSON + PNG, per layer and head.

    from coupled_qk_jax.diagnostics_report import diagnostics_report
    report = diagnostics_report(model, tokens, out_dir="diag", name="coupled_euler")   # writes diag/*.json, *.png

From one forward pass with ``model(tokens, collect=True)`` it computes, per layer and head (averaged over the batch):

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
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from coupled_qk_jax import diagnostics

ATTN_METRICS = ("entropy", "entropy_normalized", "effective_rank", "spectral_gap", "sigma2_over_sigma1", "sink_mass",
                "induction_mass")
QK_METRICS = ("q_norm_before", "q_norm_after", "k_norm_before", "k_norm_after", "qk_cos_before", "qk_cos_after",
              "q_rel_change", "k_rel_change")


def compute_diagnostics(model: Any, tokens: Any, mask: Any | None = None) -> dict[str, Any]:
    """All diagnostics of ``model`` on ``tokens`` [B, T] as a JSON-friendly dict (Python floats only).

    Args:
      model: a ``TransformerLM`` (anything whose ``__call__(tokens, collect=True)`` returns ``(logits, aux)`` with
        the per-layer dicts described in the module docstring).
      tokens: int [B, T]; use unpadded windows (padded query rows would be averaged into the attention metrics).
      mask: optional bool [B, T] selecting tokens for the q/k statistics.

    Returns:
      ``{"variant", "tokens_shape", "layers": [{"layer", "attention_kind", "heads": [{metric: value}], "mean":
      {...}, "qk_heads": [{...}], "qk_mean": {...}, "dt": [...] | None}], "model_mean": {metric: value}}``.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    _, aux = model(tokens, collect=True)
    cfg = getattr(model, "cfg", None)
    differential = cfg is not None and cfg.scoring == "differential"
    attn_summary = diagnostics.summarize_attention([a["attn"] for a in aux], tokens=tokens)
    layers = []
    for i, (layer_aux, attn_layer) in enumerate(zip(aux, attn_summary["layers"])):
        qk = diagnostics.qk_stats(layer_aux["q_before"], layer_aux["k_before"], layer_aux["q_after"],
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


def plot_diagnostics(report: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Per-layer x per-head heatmaps of every metric (one panel each), plus Δt when the model has it."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    layers = report["layers"]
    panels = [(k, "heads") for k in ATTN_METRICS if k in layers[0]["heads"][0]]
    panels += [(k, "qk_heads") for k in ("q_norm_before", "q_norm_after", "k_norm_before", "k_norm_after",
                                         "qk_cos_before", "qk_cos_after")]
    has_dt = any(lay["dt"] for lay in layers)
    n = len(panels) + (1 if has_dt else 0)
    cols = 4
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, (key, field) in zip(axes.flat, panels):
        g = _grid(layers, key, field)
        im = ax.imshow(g, aspect="auto", cmap="viridis")
        for (i, h), v in np.ndenumerate(g):
            if np.isfinite(v):
                ax.text(h, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w")
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.set_xticks(range(g.shape[1]))
        ax.set_yticks(range(g.shape[0]))
        ax.tick_params(labelsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046)
    used = len(panels)
    if has_dt:
        ax = axes.flat[used]
        dt = np.array([lay["dt"] or [np.nan] for lay in layers], dtype=float)
        for i, row in enumerate(dt):
            ax.bar(np.arange(len(row)) + i * (0.8 / len(dt)), row, width=0.8 / len(dt), label=f"layer {i}")
        ax.set_title("learned Δt per head", fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5)
        used += 1
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(title or f"attention diagnostics: {report.get('variant')}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def diagnostics_report(model: Any, tokens: Any, out_dir: str | Path | None = None, name: str = "diagnostics",
                       mask: Any | None = None) -> dict[str, Any]:
    """Compute the diagnostics and, with ``out_dir``, write ``NAME.json`` and ``NAME.png`` there."""
    report = compute_diagnostics(model, tokens, mask=mask)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
        plot_diagnostics(report, out / f"{name}.png")
    return report


def report_from_checkpoint(cfg: Any, workdir: str, split: str = "validation", windows: int = 8,
                           out_dir: str | Path | None = None) -> dict[str, Any]:
    """Diagnostics of the latest checkpoint in ``workdir`` (a train.py run) on the first ``windows`` full windows
    of ``split``; writes ``diagnostics.json`` and ``diagnostics.png`` to ``out_dir`` (default ``workdir``).

    This is what ``eval.py --diagnostics`` calls. The checkpoint is restored exactly as eval.py's evaluation
    restores it (``training.loop.restore_latest``), then gathered to the host: the diagnostics
    are small (a few windows) and run unsharded.
    """
    from flax import nnx  # noqa: PLC0415

    from coupled_qk_jax.data.pipeline import eval_batches  # noqa: PLC0415
    from coupled_qk_jax.training import loop  # noqa: PLC0415

    workdir = os.path.abspath(workdir)
    s, state = loop.restore_latest(cfg, workdir)
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state["params"])
    model = nnx.merge(s.graphdef, params)
    seq_len = int(cfg.data.seq_len)
    batch = next(iter(eval_batches(s.cache.tokens(split), seq_len, windows, bos_id=s.cache.eot_id)))
    tokens = batch["inputs"][(batch["targets"] != -100).all(axis=1)]
    if len(tokens) == 0:
        raise ValueError(f"the {split} split has no full window of {seq_len} tokens")
    report = diagnostics_report(model, tokens, out_dir=out_dir or workdir, name="diagnostics")
    # rewrite the JSON with the provenance fields added
    report["checkpoint_step"] = int(s.latest)
    report["split"] = split
    (Path(out_dir or workdir) / "diagnostics.json").write_text(json.dumps(report, indent=1))
    return report
