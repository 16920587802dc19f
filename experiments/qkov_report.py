"""Tables and verdicts of the QK/OV paper-budget runs (experiments/qkov_paper.py), from the finished result files.

Reads ``<out>/runs/<cell>/seed<S>.json`` (experiments/qkov_synthetic.py), ``<out>/runs/fixed/<ov>.json|csv``
(experiments/qkov_fixed_attention.py) and ``<out>/paper_reference.json`` (the outputs saved in the authors'
notebooks), and writes under ``<out>``:

* ``synthetic.md`` / ``synthetic.csv``: one row per Figure-2 cell, what the paper reports, ours, a verdict;
* ``comparisons.md``: the paper's claims that compare cells (faster QK vs equal rates), with 95% intervals;
* ``fixed_attention.md``: Figure 3, final losses and sensitivity peaks, ours vs the notebooks';
* ``dtap_<cell>.png`` (mean over finished seeds), ``curves.png`` (training distinct mass and QK-circuit norm);
* ``README.md``: the verdicts in one table, what is finished and what is not, the compute spent per study.

Cells with no finished seed are listed as queued or running, with the command that resumes them. Verdict rules are
stated in each table's header and in :data:`RULES`.

Usage: python experiments/qkov_report.py --out results/qkov [--work runs/qkov]
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys
import time

import numpy as np
from scipy import stats

from coupled_qk_jax.qkov import metrics as qm
from coupled_qk_jax.qkov import train as qtrain
from coupled_qk_jax.training.checkpoint import DamagedCheckpoint

# A sibling experiment: `experiments.` when imported as a package module (python -m experiments.X, the tests), by its
# bare name when run as a script (python experiments/X.py puts this folder first on the path).
if __package__:
    from experiments import qkov_synthetic as synth
else:
    import qkov_synthetic as synth

RESUME = "nice -n 19 python experiments/qkov_paper.py"
EDGES = [0, 0.2, 0.4, 0.6, 0.8, 1.0]

# What the paper (summary in shared/seeds, notebooks' outputs in paper_reference.json) says per cell:
# "weak" = attention stays near the distinct-token mass of uniform attention (FAFO in row 1),
# "concentrated" = most samples put >= 0.6 of the attention on distinct tokens (FACO/CACO; faster-QK FAFO).
CLAIMS = {
    "fafo_r1": ("weak", "FAFO places its mass on correct predictions with weak attention"),
    "faco_r1": ("concentrated", "collapsed OV (FACO) concentrates attention on distinct tokens"),
    "cafo_r1": (None, "not described in the available material; the released cell has no output"),
    "caco_r1": ("concentrated", "collapsed OV (CACO) concentrates attention on distinct tokens (no released number)"),
    "caco_r1_x2": ("concentrated", "as caco_r1, trained for twice the notebook's budget (project)"),
    "fafo_eye_r1": (None, "project baseline for fafo_r20 (same init, equal rates)"),
    "fafo_r20": ("concentrated", "faster QK makes FAFO resemble FACO: mass on distinct tokens (no released number)"),
    "caco128_r1": (None, "project baseline for the seq_len-128 CACO cells (equal rates)"),
    "caco128_r2": (None, "rate listed as tried in the notebook, not reported"),
    "caco128_r3": (None, "rate listed as tried in the notebook, not reported"),
    "caco128_r4": (None, "rate listed as tried in the notebook, not reported"),
    "caco128_r5": ("concentrated", "increased QK rate: CACO attention concentrates on distinct tokens"),
    "caco128_r10": (None, "rate listed as tried in the notebook, not reported"),
    "fafo_incr40": ("concentrated", "increasing QK rate: FAFO attention concentrates (no released number)"),
    "caco128_incr10": ("concentrated", "increasing QK rate: CACO attention concentrates on distinct tokens"),
}
RULES = """Verdict rules (fixed before the runs finished):
* A cell whose notebook output includes a DTAP heatmap (fafo_r1, faco_r1, caco128_r5, caco128_incr10)
  **reproduces** if our seed-mean DTAP heatmap has its largest cell in the same (mass bin, probability bin) as the
  notebook's and test accuracy is >= 99% (the notebooks: 100%); otherwise it **does not reproduce**. The total
  variation distance between the two heatmaps (half the L1 distance, in %) is given beside it.
* A cell with only a qualitative statement reproduces if its largest DTAP cell lies in the mass bins the statement
  implies ("concentrated": mass >= 0.6; "weak": mass < 0.6) and accuracy is >= 99%.
* Cells without a paper statement (project baselines, rates not reported) get no verdict of their own; they enter the
  comparisons in comparisons.md."""


def load_runs(out: str) -> dict[str, list[dict]]:
    runs = {}
    for cell in synth.CELLS:
        files = sorted(glob.glob(os.path.join(out, "runs", cell, "seed*.json")))
        runs[cell] = [json.load(open(f)) for f in files]
    return runs


def checkpoint_state(path: str, legacy_path: str) -> str | None:
    """'epoch E/N' of the in-job checkpoint directory ``path`` (None when it holds no checkpoint), or a note that it
    cannot be read, or that ``legacy_path`` holds an earlier version's .npz checkpoint, which no job resumes."""
    if os.path.isfile(legacy_path):
        return f"old-format checkpoint {os.path.basename(legacy_path)} (not resumable: delete it to restart the job)"
    try:
        progress = qtrain.checkpoint_progress(path)
    except (OSError, ValueError, KeyError, DamagedCheckpoint):
        return f"unreadable checkpoint {os.path.basename(path)}"
    return None if progress is None else f"epoch {progress[0]}/{progress[1]}"


def ckpt_epoch(work: str, cell: str) -> list[str]:
    """'epoch E/N (seeds ...)' for each in-job checkpoint of a cell (see :func:`checkpoint_state`)."""
    found = []
    tags = {os.path.basename(f)[len(cell) + 2:-len(suffix)]
            for suffix in ("_ckpt", ".npz") for f in glob.glob(os.path.join(work, f"{cell}_s*{suffix}"))}
    for tag in sorted(tags):
        if not tag.replace("-", "").isdigit():
            continue  # another cell whose name starts with this one
        state = checkpoint_state(os.path.join(work, f"{cell}_s{tag}_ckpt"), os.path.join(work, f"{cell}_s{tag}.npz"))
        if state is not None:
            found.append(f"{state} (seeds {tag.replace('-', ', ')})")
    return found


def modal(p: np.ndarray) -> tuple[int, int]:
    i = int(np.argmax(p))
    return divmod(i, p.shape[1])


def bin_name(i: int) -> str:
    return f"[{EDGES[i]:g},{EDGES[i + 1]:g}{']' if i == len(EDGES) - 2 else ')'}"


def fmt_modal(p: np.ndarray) -> str:
    i, j = modal(p)
    return f"{p[i, j]:.1f}% at mass {bin_name(i)}, p {bin_name(j)}"


def mean_std(rows: list[dict], key: str) -> tuple[float, float]:
    v = np.array([r[key] for r in rows], np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else float("nan")


def commits_by_seed(rows: list[dict]) -> str:
    """The code of each seed: "475a9af (1234); 2a0d859+dirty (1235, 1236)", commits in order of first seed."""
    groups: dict[str, list[str]] = {}
    for x in rows:
        c = x["commit"][:7] + ("+dirty" if "dirty" in x["commit"] else "")
        groups.setdefault(c, []).append(str(x["seed"]))
    return "; ".join(f"{c} ({', '.join(seeds)})" for c, seeds in groups.items())


def pm(m: float, s: float, f: str = "{:.3f}") -> str:
    return f.format(m) + ("" if np.isnan(s) else " ± " + f.format(s))


def verdict(cell: str, rows: list[dict], ref: dict) -> tuple[str, str]:
    """(verdict, paper-reports text) of a cell with finished seeds."""
    claim, text = CLAIMS[cell]
    r = ref["cells"].get(cell, {})
    ours = np.mean([np.array(x["dtap_percent"]) for x in rows], axis=0)
    acc = np.mean([x["acc"] for x in rows])
    paper = []
    if "dtap_percent" in r:
        paper.append("DTAP " + fmt_modal(np.array(r["dtap_percent"])))
    for k, lab in (("test_loss", "test loss"), ("test_loss_last_seed", "test loss (last seed)"),
                   ("separability", "separability"), ("stopped_epoch", "stopped at epoch")):
        if k in r:
            paper.append(f"{lab} {r[k]:g}")
    if "note" in r:
        paper.append(r["note"])
    if r.get("block100_train_loss"):
        # The notebooks' printed 100-epoch mean training losses vs ours (seed means over the common blocks).
        theirs = [np.array([v for _, v in run]) for run in r["block100_train_loss"]]
        n = min(min(len(t) for t in theirs), min(len(x["block100_train_loss"]) for x in rows))
        t = np.mean([x[:n] for x in theirs], axis=0)
        o = np.mean([x["block100_train_loss"][:n] for x in rows], axis=0)
        k = int(np.argmax(np.abs(o - t)))
        paper.append(f"100-epoch mean train loss vs ours over {n} blocks: largest gap {o[k] - t[k]:+.3f} at block "
                     f"{k + 1} ({t[k]:.3f} vs {o[k]:.3f}); first block {t[0]:.3f} vs {o[0]:.3f}, last {t[-1]:.3f} vs "
                     f"{o[-1]:.3f}")
    paper_text = text + (" — notebook: " + "; ".join(paper) if paper else "")
    if "dtap_percent" in r:
        P = np.array(r["dtap_percent"])
        tv = 0.5 * np.abs(ours - P).sum()
        ok = modal(ours) == modal(P) and acc >= 99.0
        return (("**reproduces**" if ok else "**does not reproduce**") + f" (TV {tv:.1f}%)", paper_text)
    if claim is None:
        return "no paper statement", paper_text
    i, _ = modal(ours)
    ok = (i >= 3 if claim == "concentrated" else i < 3) and acc >= 99.0
    return ("**reproduces** (claim)" if ok else "**does not reproduce** (claim)"), paper_text


def synthetic_table(out: str, work: str, runs: dict, ref: dict) -> list[dict]:
    table = []
    for cell, (arg, overrides) in synth.CELLS.items():
        cfg = synth.cell_config(cell)
        rows = runs[cell]
        sched = (f"x{cfg.qk_ratio:g}" if cfg.qk_schedule == "constant"
                 else f"x1->x{cfg.qk_final_multiplier:g} ramp")
        base = {"cell": cell, "config": arg + (f" {json.dumps(overrides)}" if overrides else ""),
                "param": cfg.parametrisation, "init": cfg.init, "lr_ov": cfg.lr_ov, "qk_rate": sched,
                "seq_len": cfg.seq_len, "budget": f"{cfg.n_epochs} x {cfg.batches_per_epoch}",
                "stop": "1e-3/100 ep" if cfg.stop_loss is not None else "no",
                "paper_seeds": len(cfg.seeds), "seeds_done": len(rows)}
        running = ckpt_epoch(work, cell)
        status = "; ".join(running)
        if len(rows) < len(cfg.seeds):
            status = ("running or interrupted at " + status if running else "queued") + f" (resume with: `{RESUME}`)"
        else:
            status = "finished"
        base["status"] = status
        base["setup"] = (f"{cfg.parametrisation.upper()}, init {cfg.init}, QK {sched}, T {cfg.seq_len}, "
                         f"{base['budget']}, stop {base['stop']}")
        if rows:
            dt = np.mean([np.array(x["dtap_percent"]) for x in rows], axis=0)
            qm.plot_dtap(dt, os.path.join(out, f"dtap_{cell}.png"),
                         title=f"{cell}: {len(rows)} seed(s), steps {rows[0]['steps']}..{rows[-1]['steps']}")
            v, paper_text = verdict(cell, rows, ref)
            base.update({
                "seeds": ",".join(str(x["seed"]) for x in rows),
                "steps": ",".join(str(x["steps"]) for x in rows),
                "loss": pm(*mean_std(rows, "loss"), "{:.4f}"), "acc": pm(*mean_std(rows, "acc"), "{:.1f}"),
                "distinct_mass": pm(*mean_std(rows, "distinct_mass")),
                "separability": pm(*mean_std(rows, "separability"), "{:.4f}"),
                "AC": pm(*mean_std(rows, "AC"), "{:.1f}"), "dtap_modal": fmt_modal(dt),
                "final_qk_norm": pm(*mean_std(rows, "final_qk_norm"), "{:.3g}"),
                "commit": commits_by_seed(rows),
                "paper_reports": paper_text, "verdict": v})
        else:
            base.update({"paper_reports": CLAIMS[cell][1], "verdict": f"undetermined: {status}"})
        table.append(base)
    return table


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean difference a - b and its 95% Welch interval (nan when either side has < 2 values)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = a.mean() - b.mean()
    if len(a) < 2 or len(b) < 2:
        return float(d), float("nan"), float("nan")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = np.sqrt(va + vb)
    if se == 0:
        return float(d), float(d), float(d)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    h = stats.t.ppf(0.975, dof) * se
    return float(d), float(d - h), float(d + h)


COMPARISONS = [
    ("faster QK sharpens FAFO attention (x20 vs x1, same 1e-6 I init)", "fafo_r20", "fafo_eye_r1"),
    ("increasing QK rate sharpens FAFO attention (x1->x40 ramp vs x1)", "fafo_incr40", "fafo_eye_r1"),
    ("faster QK sharpens CACO attention (x5 vs x1, seq_len 128)", "caco128_r5", "caco128_r1"),
    ("increasing QK rate sharpens CACO attention (x1->x10 ramp vs x1, seq_len 128)", "caco128_incr10", "caco128_r1"),
    ("collapsed OV concentrates more than factorised OV (FACO vs FAFO, row 1)", "faco_r1", "fafo_r1"),
    ("collapsed OV concentrates more than factorised OV (CACO vs CAFO, row 1)", "caco_r1", "cafo_r1"),
    # Contribution 2 of the summary: at identical rates factorised attention can be sharper than collapsed attention
    # (row 1, each cell with the paper's own init).
    ("factorised attention concentrates more than collapsed attention (FACO vs CACO, row 1)", "faco_r1", "caco_r1"),
    ("factorised attention concentrates more than collapsed attention (FAFO vs CAFO, row 1)", "fafo_r1", "cafo_r1"),
]


def comparisons_table(runs: dict) -> list[dict]:
    out = []
    for claim, a, b in COMPARISONS:
        ra, rb = runs[a], runs[b]
        row = {"claim": claim, "cells": f"{a} vs {b}", "seeds": f"{len(ra)} vs {len(rb)}"}
        if not ra or not rb:
            row.update({"difference": "-", "verdict": "undetermined: a cell has no finished seed yet"})
        else:
            d, lo, hi = welch([x["distinct_mass"] for x in ra], [x["distinct_mass"] for x in rb])
            row["difference"] = f"{d:+.3f}" + ("" if np.isnan(lo) else f" [{lo:+.3f}, {hi:+.3f}]")
            if np.isnan(lo):
                row["verdict"] = ("undetermined: one seed per cell gives no interval (needs >= 2 seeds each; "
                                  f"single-seed difference {d:+.3f})")
            elif lo > 0:
                row["verdict"] = "**reproduces** (95% interval above 0)"
            elif hi < 0:
                row["verdict"] = "**does not reproduce** (95% interval below 0)"
            else:
                row["verdict"] = "undetermined: the 95% interval contains 0 (more seeds would decide)"
        out.append(row)
    return out


def fixed_table(out: str, work: str, ref: dict) -> tuple[list[dict], list[str]]:
    fr = ref["fixed_attention"]
    rows, notes = [], []
    for ov in ("factorised", "collapsed"):
        mpath = os.path.join(out, "runs", "fixed", f"{ov}.json")
        if not os.path.exists(mpath):
            ck = checkpoint_state(os.path.join(work, f"fixed_{ov}_ckpt"), os.path.join(work, f"fixed_{ov}.npz"))
            state = "queued" if ck is None else f"running or interrupted at {ck}"
            notes.append(f"{ov}: {state} (resume with: `{RESUME}`)")
            continue
        meta = json.load(open(mpath))
        with open(os.path.join(out, "runs", "fixed", f"{ov}.csv")) as fh:
            data = list(csv.DictReader(fh))
        psens = fr["sensitivity_read_off_plots"][ov]
        for a in ("0.2", "0.4", "0.6", "0.8", "1.0"):
            sel = [r for r in data if float(r["alpha"]) == float(a)]
            sens = np.array([float(r["sensitivity"]) for r in sel])
            ours_final = float(sel[-1]["loss"])
            paper_final = fr["final_loss"][ov][a]
            row = {"ov": ov, "alpha": a, "epochs": int(sel[-1]["epoch"]), "final_loss": f"{ours_final:.4g}",
                   "paper_final_loss": f"{paper_final:.4g}", "ratio": round(ours_final / paper_final, 2),
                   "_final": ours_final}
            if a != "1.0":
                k = int(np.nanargmax(sens))
                pk = psens["peak"][a]
                row.update({"sens_peak": f"{sens[k]:.2f} at epoch {int(sel[k]['epoch'])}",
                            "paper_sens_peak": f"~{pk[1]:g} at epoch ~{pk[0]}",
                            "sens_500": f"{sens[-1]:.2f}", "paper_sens_500": f"~{psens['at_500'][a]:g}"})
            rows.append(row)
        notes.append(f"{ov}: finished, commit {meta['commit'][:7]}, {meta['eval_sequences']} evaluation sequences, "
                     f"{meta['job_seconds']:.0f} s wall" + (f", {meta['job_cpu_seconds']:.0f} CPU-s"
                                                           if "job_cpu_seconds" in meta else ""))
    return rows, notes


def fixed_verdict(frows: list[dict], ov: str) -> str:
    """'reproduces** (...)' / 'does not reproduce** (...)' for one OV type of Figure 3 (rule in fixed_attention.md)."""
    sel = [r for r in frows if r["ov"] == ov]
    within = all(0.5 <= r["ratio"] <= 2.0 for r in sel)
    mono = all(sel[i]["_final"] > sel[i + 1]["_final"] for i in range(len(sel) - 1))
    return (f"{'reproduces' if within and mono else 'does not reproduce'}** (final losses within x2: {within}; "
            f"loss falls with alpha: {mono})")


def plot_curves(out: str, runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for cell, rows in runs.items():
        for k, r in enumerate(rows[:1]):  # first finished seed of each cell
            with open(synth.seed_file(out, cell, r["seed"], "_curves.csv")) as fh:
                c = list(csv.DictReader(fh))
            step = np.array([float(x["step"]) for x in c[1:]])
            axes[0].plot(step, [float(x["train_distinct_mass"]) for x in c[1:]], label=f"{cell} s{r['seed']}")
            axes[1].plot([float(x["step"]) for x in c], [float(x["qk_norm"]) for x in c], label=cell)
    axes[0].set_ylabel("distinct-token attention mass (training batches, epoch mean)")
    axes[1].set_ylabel("||QK bilinear form||_F")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_xscale("log")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=110)
    plt.close(fig)


RAMP_CELLS = ("fafo_incr40", "caco128_incr10")


def compute_spent(out: str, runs: dict) -> dict[str, tuple[float, bool]]:
    """CPU-minutes per study from the finished jobs: (minutes, complete) where complete is False if some job has
    no CPU record (the first jobs of the queue: their wall time is used) or was resumed (only its last part counts)."""
    spent = {"Figure 2, constant rates": [0.0, True], "Figure 2, rate ramps": [0.0, True],
             "Figure 3, fixed attention": [0.0, True]}
    seen = set()
    for cell, rows in runs.items():
        study = "Figure 2, rate ramps" if cell in RAMP_CELLS else "Figure 2, constant rates"
        for r in rows:
            job = (cell, tuple(r["job_seeds"]))
            if job in seen:
                continue
            seen.add(job)
            if "job_cpu_seconds" in r:
                spent[study][0] += r["job_cpu_seconds"] / 60
                spent[study][1] &= not r.get("job_resumed", True)
            else:
                spent[study][0] += r["job_seconds"] / 60
                spent[study][1] = False
    for f in glob.glob(os.path.join(out, "runs", "fixed", "*.json")):
        m = json.load(open(f))
        spent["Figure 3, fixed attention"][0] += m.get("job_cpu_seconds", m["job_seconds"]) / 60
    return {k: (v[0], v[1]) for k, v in spent.items()}


def remaining_estimate(runs: dict) -> str:
    """CPU-minutes still to spend, from the measured CPU time per seed-step of the finished jobs (seq_len 128 steps
    are scaled by the measured ratio if available, else counted as 2 seq_len-64 steps). Upper bound: every seed
    is counted at its full budget although the early stop may end it sooner."""
    rate = {}
    for cell, rows in runs.items():
        for r in rows:
            if "job_cpu_seconds" in r and not r.get("job_resumed", True):
                T = r["train_config"]["seq_len"]
                steps = max(x["steps"] for x in rows if x["job_seeds"] == r["job_seeds"])
                rate.setdefault(T, []).append(r["job_cpu_seconds"] / (steps * len(r["job_seeds"])))
    if 64 not in rate:
        return "no finished job with a complete CPU record yet"
    r64 = float(np.median(rate[64]))
    r128 = float(np.median(rate[128])) if 128 in rate else 2 * r64
    todo = 0.0
    for cell in synth.CELLS:
        cfg = synth.cell_config(cell)
        n_left = len(cfg.seeds) - len(runs[cell])
        todo += n_left * cfg.n_epochs * cfg.batches_per_epoch * (r128 if cfg.seq_len == 128 else r64)
    return (f"measured {1e3 * r64:.2f} ms CPU per seed-step at seq_len 64"
            + (f" and {1e3 * r128:.2f} at 128" if 128 in rate else "")
            + f"; the unfinished Figure-2 seeds need at most {todo / 60:.0f} CPU-minutes more")


def md_table(rows: list[dict], cols: list[str]) -> str:
    s = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r in rows:
        s += "| " + " | ".join(str(r.get(c, "-")).replace("|", "/") for c in cols) + " |\n"
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/qkov")
    ap.add_argument("--work", default="runs/qkov")
    args = ap.parse_args(argv)
    ref_path = os.path.join(args.out, "paper_reference.json")
    if not os.path.exists(ref_path):
        print(f"error: {ref_path} not found; --out must be the directory holding paper_reference.json",
              file=sys.stderr)
        return 2
    ref = json.load(open(ref_path))
    runs = load_runs(args.out)
    head = (f"Command: `{RESUME}` (runs every study below; in the background: `mkdir -p runs/qkov && nohup "
            f"{RESUME} > runs/qkov/queue.log 2>&1 &`; rerunning it resumes the queue and skips finished seeds). Tables: `python experiments/qkov_report.py --out {args.out}`. Each row gives its commit.\n\n")

    table = synthetic_table(args.out, args.work, runs, ref)
    cols = ["cell", "config", "param", "init", "qk_rate", "seq_len", "budget", "stop", "paper_seeds", "seeds",
            "steps", "loss", "acc", "distinct_mass", "separability", "AC", "dtap_modal", "final_qk_norm",
            "paper_reports", "verdict", "status", "commit"]
    with open(os.path.join(args.out, "synthetic.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    with open(os.path.join(args.out, "synthetic.md"), "w") as fh:
        fh.write("# Figure 2 (synthetic) at the paper's budgets\n\n" + head)
        fh.write("Budget = epochs x batches of 32 (the paper's). `stop`: the notebooks' early break (epoch-mean loss "
                 "<= 1e-3 at the first epoch of a 100-epoch block). `steps`: steps each seed ran. SGD, lr_OV 0.01. "
                 "Test set: 500 fresh batches x 32 per seed (RandomState(seed + 1e6)); mean ± std over seeds. "
                 "`dtap_modal`: the largest cell of the seed-mean DTAP heatmap (`dtap_<cell>.png`). AC at "
                 "tau_att = 0.5. `final_qk_norm` = ||W_Q^T W_K||_F or ||W_QK||_F at the end. Uniform attention "
                 "gives a distinct mass of about 0.35.\n\n" + RULES + "\n\n")
        for r in table:
            r["seeds done"] = f"{r['seeds_done']}/{r['paper_seeds']}" + (f" ({r['seeds']})" if r.get("seeds") else "")
            if r["status"] != "finished" and r["seeds_done"]:
                r["verdict"] += f"; more seeds {r['status']}"
        fh.write(md_table(table, ["cell", "setup", "seeds done", "steps", "loss", "acc", "distinct_mass",
                                  "separability", "AC", "dtap_modal", "final_qk_norm", "paper_reports", "verdict",
                                  "commit"]))
    comp = comparisons_table(runs)
    with open(os.path.join(args.out, "comparisons.md"), "w") as fh:
        fh.write("# Claims that compare cells\n\n" + head)
        fh.write("Difference of the seed-mean test distinct-token attention mass, with its 95% Welch t interval "
                 "over seeds. Reproduces if the interval lies above 0.\n\n")
        fh.write(md_table(comp, ["claim", "cells", "seeds", "difference", "verdict"]))
    frows, notes = fixed_table(args.out, args.work, ref)
    with open(os.path.join(args.out, "fixed_attention.md"), "w") as fh:
        fh.write("# Figure 3 (fixed attention, OV only) at the paper's budget\n\n" + head)
        fh.write("500 epochs x 250 batches of 4 x 32, SGD lr 0.01, seed 1234, PyTorch-default init. L_t(alpha) "
                 "on one fixed set of class-balanced evaluation batches (the notebooks: 1000 fresh batches per "
                 "evaluation). Sensitivity = (L_t(alpha) - L_t(alpha + 0.005)) / 0.005. Paper values: "
                 "final losses printed in the notebooks; sensitivity peaks read off their plots (approximate).\n\n"
                 "Verdict rule: reproduces if for every alpha the final loss is within a factor 2 of the "
                 "notebook's and the loss falls with alpha.\n\n")
        fh.write("\n".join(f"- {n}" for n in notes) + "\n\n")
        if frows:
            fh.write(md_table(frows, ["ov", "alpha", "epochs", "final_loss", "paper_final_loss", "ratio",
                                      "sens_peak", "paper_sens_peak", "sens_500", "paper_sens_500"]))
            for ov in ("factorised", "collapsed"):
                sel = [r for r in frows if r["ov"] == ov]
                if sel:
                    fh.write(f"\n**{ov}: {fixed_verdict(frows, ov)}\n")
                    pk = [(r["alpha"], r["sens_peak"]) for r in sel if "sens_peak" in r]
                    ours_ep = [int(p.split("epoch ")[1]) for _, p in pk]
                    theirs_ep = [ref["fixed_attention"]["sensitivity_read_off_plots"][ov]["peak"][a][0] for a, _ in pk]
                    fh.write(f"Sensitivity (not part of the verdict; the plot values are approximate): the peak "
                             f"comes later for smaller alpha in ours: {all(np.diff(ours_ep) <= 0)} (epochs "
                             f"{ours_ep}), in the notebook's plot: {all(np.diff(theirs_ep) <= 0)} (epochs "
                             f"{theirs_ep}).\n")
    if any(runs.values()):
        plot_curves(args.out, runs)
    with open(os.path.join(args.out, "README.md"), "w") as fh:
        fh.write("# QK/OV paper (Vashisht & Ramaswamy): synthetic studies at the paper's budgets\n\n" + head)
        fh.write("Tables: [synthetic.md](synthetic.md) (Figure 2, every cell), [comparisons.md](comparisons.md) "
                 "(claims across cells, 95% intervals), [fixed_attention.md](fixed_attention.md) (Figure 3); "
                 "the paper's values: [paper_reference.json](paper_reference.json) (outputs saved in the authors' "
                 "notebooks); raw per-seed results: `runs/<cell>/seed<S>.json` and `_curves.csv`. The reduced "
                 "gradient-flow ODE (Figure 4) is `ode.csv` / `ode.png` (docs/qkov.md); its growth law, read off "
                 "`ode.csv` and the curves: [growth_law.md](growth_law.md) (`python -m experiments.growth_law`).\n\n"
                 "These runs replace the scaled-down ones (10-25% of the paper's steps) of commit 1254204, "
                 "whose tables are in that commit's docs/results/qkov/synthetic.md and fixed_attention.md.\n\n")
        fh.write(f"## State of the queue ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n")
        done = [f"{r['cell']} ({r['seeds']})" for r in table if r["seeds_done"]]
        live = [f"{r['cell']}: {'; '.join(ckpt_epoch(args.work, r['cell']))}" for r in table
                if ckpt_epoch(args.work, r["cell"])]
        live += [n for n in notes if "running" in n]
        todo = [f"{r['cell']} ({r['paper_seeds'] - r['seeds_done']} seed(s))" for r in table
                if r["seeds_done"] < r["paper_seeds"]]
        fh.write(f"- Finished (result files under `runs/`): {', '.join(done) or 'none'}; Figure 3: "
                 f"{', '.join(n.split(':')[0] for n in notes if 'finished' in n) or 'none'}.\n"
                 f"- Running or interrupted (checkpoint in `runs/qkov/`, not in git): {'; '.join(live) or 'none'}.\n"
                 f"- Not finished: {', '.join(todo) or 'none'}"
                 f"{'' if all('finished' in n for n in notes) else '; Figure 3 ' + ', '.join(n.split(':')[0] for n in notes if 'finished' not in n)}.\n"
                 f"- Resume everything, keeping all finished work: `mkdir -p runs/qkov && nohup {RESUME} > "
                 f"runs/qkov/queue.log 2>&1 &` from the repository root (a job with a checkpoint in runs/qkov/ "
                 f"continues from it; without one it restarts).\n\n")
        fh.write("## Verdicts\n\nEvery cell is one command: `python experiments/qkov_synthetic.py --cells CELL "
                 "--seeds first` then `--seeds rest` (the queue above runs them all in that order). Budget = epochs "
                 "x batches of 32 per seed (the paper's, from the notebooks); `paper reports` = the paper summary's "
                 "statement "
                 "(`shared/seeds`) and the released notebook's saved output; `ours` = seed-mean test distinct-token "
                 "mass (uniform attention: 0.35), the largest DTAP cell and test accuracy. Rules: synthetic.md.\n\n")
        fh.write(md_table([{"cell": r["cell"], "setup (budget)": r["setup"],
                            "seeds": f"{r['seeds_done']}/{r['paper_seeds']}"
                                     + (f" ({r['seeds']})" if r.get("seeds") else ""),
                            "paper reports": r["paper_reports"],
                            "ours": (f"mass {r['distinct_mass']}; {r['dtap_modal']}; acc {r['acc']}"
                                     if r["seeds_done"] else "-"),
                            "verdict": r["verdict"], "commit": r.get("commit", "-")} for r in table],
                          ["cell", "setup (budget)", "seeds", "paper reports", "ours", "verdict", "commit"]))
        if any("+dirty" in r.get("commit", "") for r in table):
            fh.write("\n`+dirty`: those seeds ran with uncommitted changes to `coupled_qk_jax`, `configs` or "
                     "`experiments`, and what changed was not recorded; their provenance is not clean, and a rerun "
                     "of those seeds is needed to make it so.\n")
        fh.write("\nClaims that compare cells (difference of seed-mean test distinct-token mass, 95% Welch "
                 "interval; commits and budgets as in the rows above):\n\n")
        fh.write(md_table(comp, ["claim", "seeds", "difference", "verdict"]))
        fh.write("\nFigure 3 (fixed attention, OV only; 500 epochs x 250 batches of 4 x 32, seed 1234, command "
                 "`python experiments/qkov_fixed_attention.py --ov OV --eval-batches 200`; the paper: the "
                 "notebooks' printed final losses): " + "; ".join(notes) + ".\n")
        for ov in ("factorised", "collapsed"):
            if any(r["ov"] == ov for r in frows):
                fh.write(f"- {ov}: **{fixed_verdict(frows, ov)}; final loss at alpha 0.2 / 1.0: "
                         + " / ".join(f"{r['final_loss']} vs {r['paper_final_loss']}" for r in frows
                                      if r["ov"] == ov and r["alpha"] in ("0.2", "1.0")) + " (ours vs notebook)\n")
        fh.write("\n")
        fh.write("## Compute spent\n\nCPU-minutes (user + sys, all threads) of the finished jobs, at nice 19 on a "
                 "shared 2-core machine; a job marked * lacks part of its record (wall minutes used, or resumed "
                 "after a kill), so its figure is approximate.\n\n")
        for k, (m, complete) in compute_spent(args.out, runs).items():
            fh.write(f"- {k}: {m:.1f}{'' if complete else ' *'}\n")
        fh.write(f"\nStill to run: {remaining_estimate(runs)} (Figure 3 not included).\n")
    print(f"wrote {args.out}/synthetic.md, comparisons.md, fixed_attention.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
