"""Figure-2 synthetic experiments of the QK/OV learning-rate paper (spec §4), scaled down for CPU.

Cells (config arg of configs/qkov.py, epochs used here vs the paper's):

row 1, equal LR 1e-2 (seq_len 64):  fafo,1  faco,1  cafo,1  caco,1
row 2, faster QK:                   fafo,20 (all factors 1e-6 I) with its equal-LR baseline fafo_eye,1;
                                    fafo,increasing (QK x1 -> x40);
                                    caco,5 (seq_len 128) with its equal-LR baseline caco128,1; caco,increasing (x1 -> x10)

Every cell is trained with the paper's seeds and batches per epoch but fewer epochs (column ``epochs`` vs
``paper_epochs`` of the output table). Outputs under --out: synthetic.csv / synthetic.md (one row per cell),
dtap_<cell>.png (DTAP heatmap averaged over seeds), curves_<cell>.csv (per-epoch loss and distinct-token mass),
mass_curves.png.

Usage:  python experiments/qkov_synthetic.py --out docs/results/qkov [--cells fafo_r20,fafo_eye_r1] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs.qkov import get_config, to_train_config  # noqa: E402
from coupled_qk_jax.qkov import data as qdata  # noqa: E402
from coupled_qk_jax.qkov import metrics as qm  # noqa: E402
from coupled_qk_jax.qkov import model as qmodel  # noqa: E402
from coupled_qk_jax.qkov import train as qtrain  # noqa: E402

# name -> (config arg, overrides, epochs used here). Paper epochs come from the config.
CELLS = {
    "fafo_r1": ("fafo,1", {}, 500),
    "faco_r1": ("faco,1", {}, 500),
    "cafo_r1": ("cafo,1", {}, 500),
    "caco_r1": ("caco,1", {}, 500),
    "fafo_eye_r1": ("fafo,20", {"qk_ratio": 1.0}, 1000),
    "fafo_r20": ("fafo,20", {}, 1000),
    "fafo_incr40": ("fafo,increasing", {}, 1000),
    "caco128_r1": ("caco,5", {"qk_ratio": 1.0}, 1000),
    "caco128_r5": ("caco,5", {}, 1000),
    "caco128_incr10": ("caco,increasing", {}, 1000),
}
N_ERASURE = 256  # samples per seed for comprehensiveness / sufficiency


def erasure(params_one, tokens: np.ndarray, attn: np.ndarray, targets: np.ndarray, k_frac: float = 0.05):
    """Mean comprehensiveness / sufficiency of one run (params without run axis) over the given samples.

    ŷ is the predicted class (argmax of the full-input probabilities), as in the spec.
    """
    fwd = jax.jit(lambda p, t: jax.nn.softmax(qmodel.forward(p, t)[0], -1))

    def prob_fn(seq):
        return np.asarray(fwd(params_one, jnp.asarray(seq)[None]))[0]

    return qm.erasure_scores(prob_fn, list(tokens), list(attn), k_frac)


def run_cell(name: str, out_dir: str, scale: float) -> dict:
    arg, overrides, epochs = CELLS[name]
    base = get_config(arg)
    n_ep = max(1, int(round(epochs * scale)))
    cfg = to_train_config(base, **overrides, n_epochs=n_ep)
    print(f"[{name}] {arg} {overrides} -> {cfg.n_epochs} x {cfg.batches_per_epoch} batches, seeds {cfg.seeds}",
          flush=True)
    res = qtrain.train(cfg, log_every=max(1, n_ep // 5))
    ev = qtrain.evaluate(res.params, cfg.seeds, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
    summ = qtrain.summarise(ev)
    pct = qm.dtap_percent(ev["mass"], ev["prob"])
    qm.plot_dtap(pct, os.path.join(out_dir, f"dtap_{name}.png"),
                 title=f"{name}: {cfg.n_epochs}x{cfg.batches_per_epoch} steps, {len(cfg.seeds)} seed(s)")
    comp, suff = [], []
    for i in range(len(cfg.seeds)):
        p_i = jax.tree.map(lambda v: v[i], res.params)
        c, s = erasure(p_i, ev["tokens"][i, :N_ERASURE], ev["attn"][i, :N_ERASURE], None)
        comp.append(c)
        suff.append(s)
    deltas = {}
    P = res.params
    if "W_V" in P:
        deltas["delta_ov"] = float(np.mean([qm.balancedness(P["W_O"][i], P["W_V"][i]) for i in range(len(cfg.seeds))]))
    if "W_Q" in P:
        deltas["delta_qk"] = float(np.mean([qm.balancedness(P["W_Q"][i].T, P["W_K"][i])
                                            for i in range(len(cfg.seeds))]))
    with open(os.path.join(out_dir, f"curves_{name}.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["epoch", "step"] + [f"loss_s{s}" for s in cfg.seeds] + [f"mass_s{s}" for s in cfg.seeds])
        for e in range(res.epoch_loss.shape[1]):
            w.writerow([e + 1, (e + 1) * cfg.batches_per_epoch] + [f"{v:.6g}" for v in res.epoch_loss[:, e]]
                       + [f"{v:.6g}" for v in res.epoch_mass[:, e]])
    row = {
        "cell": name, "config": arg, "overrides": json.dumps(overrides), "param": cfg.parametrisation,
        "init": cfg.init, "lr_qk": cfg.lr_ov * cfg.qk_ratio, "lr_ov": cfg.lr_ov, "schedule": cfg.qk_schedule
        + (f" x1->x{cfg.qk_final_multiplier:g}" if cfg.qk_schedule == "increasing" else ""),
        "seq_len": cfg.seq_len, "seeds": len(cfg.seeds), "epochs": cfg.n_epochs,
        "paper_epochs": base.n_epochs, "batches_per_epoch": cfg.batches_per_epoch, "steps": cfg.total_steps,
        "final_train_loss": float(np.nanmean(res.epoch_loss[:, -1])),
        **{k: v for k, v in summ.items()}, "comprehensiveness": float(np.mean(comp)),
        "sufficiency": float(np.mean(suff)), **deltas, "seconds": res.seconds,
    }
    print(f"[{name}] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)
    return row, res


MD_COLS = [("cell", "{}"), ("param", "{}"), ("lr_qk", "{:g}"), ("lr_ov", "{:g}"), ("schedule", "{}"),
           ("seq_len", "{}"), ("seeds", "{}"), ("steps", "{}"), ("paper_epochs", "{}"), ("loss", "{:.3f}"),
           ("acc", "{:.1f}"), ("distinct_mass", "{:.3f}"), ("distinct_mass_std", "{:.3f}"),
           ("separability", "{:.4f}"), ("AC", "{:.1f}"), ("ACMC", "{:.1f}"), ("comprehensiveness", "{:.3f}"),
           ("sufficiency", "{:.3f}"), ("delta_ov", "{:.3f}"), ("delta_qk", "{:.3f}"), ("seconds", "{:.0f}")]


def write_tables(rows: list[dict], out_dir: str, command: str) -> None:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(os.path.join(out_dir, "synthetic.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, keys)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "synthetic.md"), "w") as fh:
        fh.write("# Synthetic QK/OV experiments (Figure 2, scaled down)\n\n")
        fh.write(f"Command: `{command}`\n\n")
        fh.write("Test metrics over 200 fresh batches x 32 per seed (RandomState(seed + 1e6)); mean over seeds "
                 "(`distinct_mass_std` = std over seeds). AC / ACMC use tau_att = 0.5, tau_conf = 0.5. "
                 "Comprehensiveness / sufficiency: top-5% (k = 4 of 63 or 7 of 127) attention positions deleted / "
                 "kept, 256 samples per seed. delta = balancedness of the factorised circuit(s). `steps` = epochs "
                 "x batches per epoch actually run; `paper_epochs` = the paper's epoch count.\n\n")
        fh.write("| " + " | ".join(c for c, _ in MD_COLS) + " |\n")
        fh.write("|" + "---|" * len(MD_COLS) + "\n")
        for r in rows:
            cells = [fmt.format(r[c]) if c in r else "-" for c, fmt in MD_COLS]
            fh.write("| " + " | ".join(cells) + " |\n")


def plot_curves(results: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, res in results.items():
        steps = (np.arange(res.epoch_mass.shape[1]) + 1) * res.config.batches_per_epoch
        axes[0].plot(steps, np.nanmean(res.epoch_mass, 0), label=name)
        axes[1].plot(steps, np.nanmean(res.epoch_loss, 0), label=name)
    axes[0].set_ylabel("distinct-token attention mass (train batches)")
    axes[1].set_ylabel("train loss")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "mass_curves.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/qkov")
    ap.add_argument("--cells", default="all", help="comma-separated cell names or 'all': " + ",".join(CELLS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply this script's epoch counts")
    args = ap.parse_args(argv)
    names = list(CELLS) if args.cells == "all" else [c.strip() for c in args.cells.split(",")]
    for n in names:
        if n not in CELLS:
            raise ValueError(f"--cells: unknown cell {n!r}; known: {', '.join(CELLS)}")
    if not args.scale > 0:
        raise ValueError(f"--scale: must be > 0, got {args.scale}")
    os.makedirs(args.out, exist_ok=True)
    command = "python experiments/qkov_synthetic.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.time()
    rows, results = [], {}
    for n in names:
        row, res = run_cell(n, args.out, args.scale)
        rows.append(row)
        results[n] = res
        write_tables(rows, args.out, command)  # rewrite after every cell so partial runs leave results
    plot_curves(results, args.out)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
