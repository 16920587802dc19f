"""Sweep reports: tables, curves and plots built from the run directories of a sweep (experiments/sweep.py).

Each finished cell is read into one record (``experiments.sweep.load_cell``): the cell's spec (``run``), its seeds,
parameter count, tokens per step, the logged training curve and evaluations from metrics.jsonl (per seed), the
training wall-clock, and the per-seed attention diagnostics. From the records :func:`report` writes

    results.csv / mqar_results.csv   one row per cell (mean ± sample std over seeds, per-seed values)
    results.md                       the same as Markdown tables, with the exact command
    curves.csv                       every logged point: cell, seed, split, step, tokens, wall-clock, loss
    loss_vs_tokens.png, loss_vs_wall.png, mqar_accuracy.png, diagnostics/CELL_seed<s>.png
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np

from coupled_qk_jax.reporting import fmt, markdown_table, mean_std, write_csv
from coupled_qk_jax.training import rundir

# Absolute paths of this machine that must not reach the committed results (e.g. --corpus-dir), with the
# placeholder written instead. The sweep's main() fills it.
SCRUB: list[tuple[str, str]] = []


def scrub(text: str) -> str:
    for path, placeholder in SCRUB:
        text = text.replace(path, placeholder)
    return text


def safe_name(name: str) -> str:
    """A cell name as a file or directory name."""
    return name.replace("/", "__").replace("+", "_plus_")


DIAG_WINDOWS = 8  # windows of the validation split (LM) or test examples (MQAR) the diagnostics are computed on


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
        finals = {n: mean_std([math.exp(x) for x in lm[n]["eval_loss"][-1]])[0] for n in names}
        if target_ppl is not None:
            target = float(target_ppl)
        elif targets and group in targets and targets[group] in finals:
            target = finals[targets[group]]
        else:
            target = max(finals.values())
        for n in names:
            r = lm[n]
            ppl = [math.exp(x) for x in r["eval_loss"][-1]]
            m, s = mean_std(ppl)
            S = len(r["seeds"])
            tok_per_seed = r["tokens_per_step"] * r["run"]["steps"]
            # tokens at the first evaluation at or below target (the curve is interpolated between evaluations
            # in log-loss so the number is not quantised to the evaluation interval)
            hits = []
            for s_i in range(S):
                hits.append(tokens_to_target(r, s_i, math.log(target)))
            reached = [h for h in hits if h is not None]
            tm, ts = mean_std(reached) if reached else (float("nan"), float("nan"))
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
        row["paired_rel_pct_ci_lo"] = row["paired_rel_pct_ci_hi"] = float("nan")
        if base:
            row["rel_to_standard_pct"] = 100.0 * (row["val_ppl_mean"] / base[0]["val_ppl_mean"] - 1.0)
            # Paired by seed: seed s of both runs saw the same data in the same order and shared initial weights,
            # so the per-seed ratio removes most of the seed-to-seed spread that the plain std columns carry.
            mine = [float(x) for x in row["val_ppl_seeds"].split()]
            ref = [float(x) for x in base[0]["val_ppl_seeds"].split()]
            if len(mine) == len(ref) and lm[row["run"]]["seeds"] == lm[base[0]["run"]]["seeds"]:
                rel = [100.0 * (a / b - 1.0) for a, b in zip(mine, ref)]
                row["paired_rel_pct_mean"], row["paired_rel_pct_std"] = mean_std(rel)
                if row["run"] != base[0]["run"]:
                    row["paired_rel_pct_ci_lo"], row["paired_rel_pct_ci_hi"] = t_interval(rel)
    # Seed variance against coupled Euler's in the same group (the paper: MLP-only has 8x coupled's), with the 95%
    # interval of a ratio of two normal variances (F distribution).
    for row in rows:
        row["var_ratio_vs_coupled"] = row["var_ratio_ci_lo"] = row["var_ratio_ci_hi"] = float("nan")
        ref = [b for b in rows if b["group"] == row["group"] and b["variant"] == "coupled_euler"
               and b["steps"] == row["steps"] and b["run"] != row["run"]]
        if ref and row["seeds"] > 1 and ref[0]["seeds"] > 1:
            row["var_ratio_vs_coupled"], row["var_ratio_ci_lo"], row["var_ratio_ci_hi"] = variance_ratio(
                [float(x) for x in row["val_ppl_seeds"].split()], [float(x) for x in ref[0]["val_ppl_seeds"].split()])
    return rows


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The two-sided Student-t confidence interval of the mean of `values` (nan for fewer than 2 values)."""
    from scipy import stats  # noqa: PLC0415

    a = np.asarray(values, np.float64)
    if a.size < 2:
        return float("nan"), float("nan")
    h = stats.t.ppf(0.5 + level / 2, a.size - 1) * a.std(ddof=1) / math.sqrt(a.size)
    return float(a.mean() - h), float(a.mean() + h)


def variance_ratio(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """var(a) / var(b) (sample variances) and its confidence interval: ratio / F(1-q; na-1, nb-1) ..
    ratio / F(q; na-1, nb-1) with q = (1 - level) / 2 (normal samples)."""
    from scipy import stats  # noqa: PLC0415

    va, vb = np.var(a, ddof=1), np.var(b, ddof=1)
    if vb == 0:
        return float("nan"), float("nan"), float("nan")
    r, q, da, db = float(va / vb), (1 - level) / 2, len(a) - 1, len(b) - 1
    return r, r / float(stats.f.ppf(1 - q, da, db)), r / float(stats.f.ppf(q, da, db))


def tokens_to_target(r: dict[str, Any], seed_index: int, log_target: float) -> float | None:
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
             "dt_mean", "dt_abs_mean")


def _diag_means(r: dict[str, Any]) -> dict[str, float]:
    """Model-mean attention diagnostics averaged over seeds (NaN when the run has none, e.g. an older save)."""
    reps = r.get("diagnostics") or []
    return {f"diag_{k}": (float(np.mean([d["model_mean"][k] for d in reps]))
                          if reps and all(k in d["model_mean"] for d in reps) else float("nan")) for k in DIAG_KEYS}


JUMP_LEVEL = 0.5  # MQAR: accuracy that marks the recall transition (the plateau before it: ~0.25 at easy)
SOLVED_LEVEL = 0.99  # MQAR: accuracy counted as solving the level


def mqar_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for n, r in results.items():
        if r["run"]["task"] != "mqar":
            continue
        m, s = mean_std(r["accuracy"][-1])
        best = [max(a[i] for a in r["accuracy"]) for i in range(len(r["seeds"]))]
        jumps = [jump_epoch(r["epochs"], [a[i] for a in r["accuracy"]]) for i in range(len(r["seeds"]))]
        solved = [jump_epoch(r["epochs"], [a[i] for a in r["accuracy"]], SOLVED_LEVEL) for i in range(len(r["seeds"]))]
        # plateau check: the change of seed-mean accuracy over the last quarter of the evaluated epochs
        k = next(j for j, ep in enumerate(r["epochs"]) if ep >= 0.75 * r["epochs"][-1])
        bm, bs = mean_std(best)
        tm, ts = mean_std(r["test_accuracy"])
        mean_curve = [float(np.mean(a)) for a in r["accuracy"]]
        rows.append({"level": r["level"], "protocol": r.get("protocol", "cpu"), "width": r.get("width"),
                     "lr": r.get("lr"), "run": n, "variant": r["run"]["variant"], "epochs": r["epochs"][-1],
                     "test_accuracy_mean": tm, "test_accuracy_std": ts,
                     "test_accuracy_seeds": " ".join(f"{a:.3f}" for a in r["test_accuracy"]),
                     "selected_epoch_seeds": " ".join(str(e) for e in r["selected_epoch"]),
                     "selected_validation_mean": float(np.mean(r["selected_validation"])),
                     "solved_epoch_mean_curve": jump_epoch(r["epochs"], mean_curve, SOLVED_LEVEL),
                     "seeds": len(r["seeds"]), "params": r["num_params"], "accuracy_mean": m, "accuracy_std": s,
                     "accuracy_seeds": " ".join(f"{a:.3f}" for a in r["accuracy"][-1]),
                     "best_accuracy_mean": bm, "best_accuracy_std": bs,
                     "jump_epoch_seeds": " ".join("-" if j is None else str(j) for j in jumps),
                     "solved_epoch_seeds": " ".join("-" if j is None else str(j) for j in solved),
                     "last_quarter_change": m - float(np.mean(r["accuracy"][k])),
                     "valid_loss_mean": mean_std(r["valid_loss"][-1])[0], "train_seconds": r["train_seconds"],
                     **_diag_means(r)})
    return rows


def select_lr(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep's best-lr rule, on validation only: for each (level, protocol, variant, width) with several lrs,
    among the cells whose seed-mean validation accuracy reaches 0.99, the one that reaches it first (ties: the higher
    validation accuracy at the selected checkpoints); if none does, the highest validation accuracy at the selected
    checkpoints. The returned rows are the chosen cells; their test columns are what a table reports."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["level"], r["protocol"], r["variant"], r["width"]), []).append(r)
    chosen = []
    for cells in groups.values():
        if len({c["lr"] for c in cells}) < 2:
            continue
        solved = [c for c in cells if c["solved_epoch_mean_curve"] is not None]
        if solved:
            best = min(solved, key=lambda c: (c["solved_epoch_mean_curve"], -c["selected_validation_mean"]))
        else:
            best = max(cells, key=lambda c: c["selected_validation_mean"])
        chosen.append(best)
    return chosen


def jump_epoch(epochs: list[int], accuracy: list[float], level: float = JUMP_LEVEL) -> int | None:
    """The first evaluated epoch whose accuracy is at least `level` (None if none is)."""
    return next((int(e) for e, a in zip(epochs, accuracy) if a >= level), None)


LM_COLUMNS = [("run", "run"), ("variant", "variant"), ("steps", "steps"), ("seeds", "seeds"), ("params", "params"),
              ("val_ppl_mean", "val ppl (mean)"), ("val_ppl_std", "± std"), ("rel_to_standard_pct", "vs standard %"),
              ("paired_rel_pct_mean", "paired Δ% vs std. (mean"), ("paired_rel_pct_std", "std over seeds)"),
              ("paired_rel_pct_ci_lo", "paired Δ% 95% CI (lo"), ("paired_rel_pct_ci_hi", "hi)"),
              ("var_ratio_vs_coupled", "seed var / coupled's"), ("var_ratio_ci_lo", "95% CI (lo"),
              ("var_ratio_ci_hi", "hi)"),
              ("target_ppl", "target ppl"), ("tokens_to_target_mean", "tokens to target (mean)"),
              ("seeds_reaching_target", "seeds reaching"), ("train_seconds", "wall s (all seeds)"),
              ("tokens_per_s_all_seeds", "tok/s (all seeds)")]
DIAG_COLUMNS = [("run", "run"), ("diag_effective_rank", "attn eff. rank"),
                ("diag_entropy_normalized", "attn entropy (norm.)"), ("diag_sink_mass", "sink mass"),
                ("diag_sigma2_over_sigma1", "σ2/σ1"), ("diag_induction_mass", "induction mass"),
                ("diag_dt_mean", "mean Δt"), ("diag_dt_abs_mean", "mean abs(Δt)")]  # signs cancel in the mean
MQAR_COLUMNS = [("level", "level"), ("run", "run"), ("variant", "variant"), ("epochs", "epochs"), ("seeds", "seeds"),
                ("params", "params"), ("test_accuracy_mean", "test acc at selected (mean)"),
                ("test_accuracy_std", "± std"), ("test_accuracy_seeds", "test per seed"),
                ("selected_epoch_seeds", "selected epoch (per seed)"),
                ("selected_validation_mean", "valid acc at selected (mean)"),
                ("accuracy_mean", "valid acc, last eval (mean)"), ("accuracy_std", "± std"),
                ("accuracy_seeds", "per seed"), ("best_accuracy_mean", "best-epoch valid acc (mean)"),
                ("jump_epoch_seeds", "epoch reaching 0.5 (per seed)"),
                ("solved_epoch_seeds", "epoch reaching 0.99 (per seed)"),
                ("last_quarter_change", "Δ acc over last quarter"),
                ("valid_loss_mean", "valid loss"), ("train_seconds", "wall s (all seeds)")]


def one_row_per_step(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation rows of an MQAR run, one per step: a run that stops early (solved, or a plateau) evaluates the
    whole validation split again at its last step, which the periodic evaluation at that step has just scored, so
    metrics.jsonl holds that point twice. The later row is kept."""
    return [r for i, r in enumerate(evals) if i + 1 == len(evals) or evals[i + 1]["step"] != r["step"]]


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
            # Every seed's diagnostics, committed beside the table (the run directories are not kept), so that
            # `python -m experiments.paired --metric effective_rank TABLE:RUN ...` can pair them by seed.
            (out / "runs").mkdir(exist_ok=True)
            rundir.write_json(out / "runs" / f"{safe_name(name)}.json",
                              {"run": name, "seeds": r["seeds"], "commits": r.get("commits"),
                               "diagnostics": r["diagnostics"]})
            (out / "diagnostics").mkdir(exist_ok=True)
            plot_diagnostics(r["diagnostics"][0], out / "diagnostics" / f"{safe_name(name)}_seed{r['seeds'][0]}.png",
                             title=f"{name}, seed {r['seeds'][0]}")
    md = [f"# {title or 'Sweep results'}", "", "Produced by:", "", "```bash", command, "```", ""]
    if lmr:
        md += ["Validation perplexity over the whole validation split (size and corpus under each table), mean ± "
               "sample std over seeds; 'paired Δ%' is the per-seed change against standard attention trained with the "
               "same seed (same data order, same shared initial weights), with its 95% paired-t interval over seeds; "
               "'seed var / coupled's' is the ratio of the sample variances of final perplexity against coupled "
               "Euler's, with its 95% F interval; 'tokens to target' is per seed, "
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
        md += ["## MQAR", "", "Accuracy = zoology's metric (mean over examples of the per-example fraction of "
               "correctly recalled values). Every evaluation during training, the stopping rule and the selection "
               "read the validation split; each seed's checkpoint is its best validation accuracy up to its stop "
               "('selected epoch'), and the test split is scored once there ('test acc at selected', the number to "
               "report; experiments/select_test.py). The other accuracy columns are validation; 'epoch "
               f"reaching {JUMP_LEVEL:g}': the first evaluated epoch at or above it (the recall jump; '-' = never), and "
               f"likewise for {SOLVED_LEVEL:g} (solved); 'epochs': the last evaluated epoch (a run stopped by "
               "train.early_stop ends before the cap); "
               "'Δ acc over last quarter': last minus the evaluation at 75% of the epochs (near 0 = plateau).", "",
               markdown_table(mqr, MQAR_COLUMNS), ""]
        chosen = select_lr(mqr)
        if chosen:
            md += ["### The lr chosen on validation", "", "Per (level, variant, width): among the lrs whose seed-mean "
                   f"validation accuracy reaches {SOLVED_LEVEL:g}, the first to reach it, else the highest validation "
                   "accuracy at the selected checkpoints (experiments.reports.select_lr); its test accuracy at the "
                   "selected checkpoints is the cell's result.", "",
                   # lr as %g: the table's 3 decimals would print zoology's 1e-4 and 4.6e-4 both as 0.000
                   markdown_table([dict(c, lr=f"{c['lr']:g}") for c in chosen], [("level", "level"), ("protocol", "protocol"), ("variant", "variant"),
                                           ("width", "width"), ("lr", "lr chosen"),
                                           ("selected_validation_mean", "valid acc at selected (mean)"),
                                           ("test_accuracy_mean", "test acc (mean)"), ("test_accuracy_std", "± std"),
                                           ("test_accuracy_seeds", "test per seed")]), ""]
        if any(not math.isnan(r["diag_effective_rank"]) for r in mqr):
            md += [f"Attention diagnostics after training (first {DIAG_WINDOWS} validation examples, averaged over seeds; "
                   "induction mass = attention on the value following the earlier occurrence of the query key):", "",
                   markdown_table(mqr, DIAG_COLUMNS), ""]
    md += ["Code (git commits of each run's starts and resumes, from its history.jsonl): "
           + "; ".join(f"{n}: {', '.join(r.get('commits') or ['not recorded'])}" for n, r in results.items()) + ".",
           ""]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (out / "results.md").write_text(scrub("\n".join(md) + "\n"))
    (out / "command.txt").write_text(scrub(command) + "\n")
