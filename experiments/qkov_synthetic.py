"""Figure-2 synthetic experiments of the QK/OV learning-rate paper (spec §4) at the paper's budgets, resumable.

Cells (config arg of configs/qkov.py; budgets, seeds and the early-stop rule are the paper's, from the config):

row 1, equal LR 1e-2 (seq_len 64):  fafo_r1  faco_r1  cafo_r1  caco_r1  (caco_r1_x2: caco_r1 at twice its budget)
row 2, faster QK (seq_len 64):      fafo_r20 (all factors 1e-6 I), with its equal-LR baseline fafo_eye_r1 (project)
row 2, faster QK (seq_len 128):     caco128_r5 (the paper's cell), caco128_r2/r3/r4/r10 (the other rates the notebook
                                    lists as tried) and the equal-LR baseline caco128_r1 (project)
learning-rate ramps:                fafo_incr40 (QK x1 -> x40), caco128_incr10 (QK x1 -> x10)

A job trains one cell for a group of seeds as one vmapped program. When it ends, every seed gets its own result
file ``<out>/runs/<cell>/seed<S>.json`` (test metrics, DTAP percentages, stop epoch, ...) and
``seed<S>_curves.csv`` (per-epoch training loss, distinct-token mass and circuit norms). A restart skips the seeds
whose result file exists. Inside a job, the state is checkpointed to the directory ``<work>/<cell>_s<seeds>_ckpt/``
(an orbax checkpoint directory, as the main trainer's) every ``--ckpt-every`` epochs, so a killed job resumes from
its last checkpoint; an old-format ``<work>/<cell>_s<seeds>.npz`` of an earlier version stops the job with a hint
(delete it to restart the job). The tables are written by experiments/qkov_report.py.

Usage:  python experiments/qkov_synthetic.py --out results/qkov --cells fafo_r20 --seeds first|rest|all
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from coupled_qk_jax.configs.qkov import get_config, to_train_config
from coupled_qk_jax.qkov import metrics as qm
from coupled_qk_jax.qkov import model as qmodel
from coupled_qk_jax.qkov import train as qtrain
from coupled_qk_jax.reporting import code_commit

# name -> (config arg, overrides of the config's fields)
# The notebooks ran row 1's FAFO and FACO with one seed; we add two (as CACO's 3), so that the row-1 comparisons
# across parametrisations (experiments/qkov_report.py, comparisons.md) have a seed interval.
ROW1_SEEDS = (1234, 1235, 1236)
CELLS = {
    "fafo_r1": ("fafo,1", {"seeds": ROW1_SEEDS}),
    "faco_r1": ("faco,1", {"seeds": ROW1_SEEDS}),
    "cafo_r1": ("cafo,1", {}),
    "caco_r1": ("caco,1", {}),
    # row 1's CACO at twice its budget (5000 x 200 steps): at 2500 epochs it had not concentrated
    "caco_r1_x2": ("caco,1", {"n_epochs": 5000}),
    "fafo_eye_r1": ("fafo,20", {"qk_ratio": 1.0}),
    "fafo_r20": ("fafo,20", {}),
    "caco128_r1": ("caco,5", {"qk_ratio": 1.0}),
    "caco128_r2": ("caco,2", {}),
    "caco128_r3": ("caco,3", {}),
    "caco128_r4": ("caco,4", {}),
    "caco128_r5": ("caco,5", {}),
    "caco128_r10": ("caco,10", {}),
    "fafo_incr40": ("fafo,increasing", {}),
    "caco128_incr10": ("caco,increasing", {}),
}
N_ERASURE = 256  # samples per seed for comprehensiveness / sufficiency


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


COMMIT = code_commit()  # taken once, when the queue starts: later checkouts of the tree do not change it


def cell_config(name: str) -> qtrain.TrainConfig:
    """The cell's TrainConfig with all of the paper's seeds."""
    arg, overrides = CELLS[name]
    return to_train_config(get_config(arg), **overrides)


def seed_file(out: str, cell: str, seed: int, suffix: str = ".json") -> str:
    return os.path.join(out, "runs", cell, f"seed{seed}{suffix}")


def done_seeds(out: str, cell: str) -> list[int]:
    return [s for s in cell_config(cell).seeds if os.path.exists(seed_file(out, cell, s))]


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def erasure(params_one, tokens: np.ndarray, attn: np.ndarray, k_frac: float = 0.05):
    """Mean comprehensiveness / sufficiency of one run (params without run axis); ŷ is the predicted class."""
    fwd = jax.jit(lambda p, t: jax.nn.softmax(qmodel.forward(p, t)[0], -1))

    def prob_fn(seq):
        return np.asarray(fwd(params_one, jnp.asarray(seq)[None]))[0]

    return qm.erasure_scores(prob_fn, list(tokens), list(attn), k_frac)


def run_job(cell: str, seeds: tuple[int, ...], out: str, work: str, ckpt_every: int = 10,
            log=print) -> list[dict]:
    """Train ``cell`` for ``seeds`` (one vmapped program), evaluate, write one result file per seed."""
    cfg = dataclasses.replace(cell_config(cell), seeds=tuple(seeds)).validate()
    arg, overrides = CELLS[cell]
    os.makedirs(os.path.join(out, "runs", cell), exist_ok=True)
    os.makedirs(work, exist_ok=True)
    tag = f"{cell}_s{'-'.join(map(str, seeds))}"
    ckpt = os.path.join(work, f"{tag}_ckpt")
    qtrain.refuse_legacy_checkpoint(os.path.join(work, f"{tag}.npz"), ckpt)
    norms_path = os.path.join(work, f"{tag}_norms.npy")
    # Circuit norms per epoch: ||QK bilinear form||_F and ||OV matrix||_F, [epochs + 1, R, 2]. Written every epoch so
    # that a resumed job keeps the history before its checkpoint (epochs after it are recomputed identically).
    norms = np.full((cfg.n_epochs + 1, len(seeds), 2), np.nan)
    if qtrain.has_checkpoint(ckpt) and os.path.exists(norms_path):
        norms = np.load(norms_path)
    norm_fn = jax.jit(jax.vmap(lambda p: jnp.stack([jnp.linalg.norm(qmodel.qk_matrix(p)),
                                                    jnp.linalg.norm(qmodel.ov_matrix(p))])))

    def cb(ep, params):
        norms[ep] = np.asarray(norm_fn(params))
        if ep % ckpt_every == 0:
            np.save(norms_path + ".tmp.npy", norms)
            os.replace(norms_path + ".tmp.npy", norms_path)

    log(f"[{cell}] {arg} {overrides}: {cfg.n_epochs} x {cfg.batches_per_epoch} steps, seeds {seeds}, "
        f"stop_loss {cfg.stop_loss} every {cfg.stop_check_every} epochs")
    resumed = qtrain.has_checkpoint(ckpt)
    cpu0 = cpu_seconds()
    res = qtrain.train(cfg, log_every=max(1, cfg.n_epochs // 10), log=log, callback=cb, ckpt_path=ckpt,
                       ckpt_every=ckpt_every)
    cpu_train = cpu_seconds() - cpu0
    ev = qtrain.evaluate(res.params, cfg.seeds, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
    rows = []
    for i, seed in enumerate(seeds):
        one = {k: v[i:i + 1] for k, v in ev.items()}
        p_i = jax.tree.map(lambda v: v[i], res.params)
        comp, suff = erasure(p_i, one["tokens"][0, :N_ERASURE], one["attn"][0, :N_ERASURE])
        summ = {k: v for k, v in qtrain.summarise(one).items() if not k.endswith("_std")}
        stop = int(res.stopped_epoch[i])
        deltas = {}
        if "W_V" in p_i:
            deltas["delta_ov"] = float(qm.balancedness(p_i["W_O"], p_i["W_V"]))
        if "W_Q" in p_i:
            deltas["delta_qk"] = float(qm.balancedness(p_i["W_Q"].T, p_i["W_K"]))
        loss = res.epoch_loss[i, :stop]
        row = {
            "cell": cell, "config": arg, "overrides": overrides, "seed": seed,
            "train_config": {**dataclasses.asdict(cfg), "seeds": [seed]},
            "stopped_epoch": stop, "steps": stop * cfg.batches_per_epoch,
            "paper_steps": cfg.n_epochs * cfg.batches_per_epoch,
            "final_train_loss": float(loss[-1]),
            # The notebooks print the mean training loss of each 100-epoch block: the same numbers, for comparison.
            "block100_train_loss": [float(loss[b:b + 100].mean()) for b in range(0, stop, 100)],
            **summ,
            "dtap_percent": qm.dtap_percent(one["mass"], one["prob"]).tolist(),
            "comprehensiveness": float(comp), "sufficiency": float(suff), **deltas,
            "final_qk_norm": float(norms[stop, i, 0]), "final_ov_norm": float(norms[stop, i, 1]),
            "job_seconds": res.seconds, "job_seeds": list(seeds), "commit": COMMIT,
            # CPU seconds (user + sys, all threads) of this job's training since its last (re)start, shared by
            # its seeds; a resumed job counts only the part after the resume.
            "job_cpu_seconds": cpu_train, "job_resumed": resumed,
        }
        with open(seed_file(out, cell, seed, "_curves.csv.tmp"), "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["epoch", "step", "train_loss", "train_distinct_mass", "qk_norm", "ov_norm"])
            w.writerow([0, 0, "", "", f"{norms[0, i, 0]:.6g}", f"{norms[0, i, 1]:.6g}"])
            for e in range(stop):
                w.writerow([e + 1, (e + 1) * cfg.batches_per_epoch, f"{res.epoch_loss[i, e]:.6g}",
                            f"{res.epoch_mass[i, e]:.6g}", f"{norms[e + 1, i, 0]:.6g}", f"{norms[e + 1, i, 1]:.6g}"])
        os.replace(seed_file(out, cell, seed, "_curves.csv.tmp"), seed_file(out, cell, seed, "_curves.csv"))
        _atomic_write(seed_file(out, cell, seed), json.dumps(row, indent=1) + "\n")
        rows.append(row)
        log(f"[{cell}] seed {seed}: stopped at epoch {stop}, loss {summ['loss']:.4g}, acc {summ['acc']:.1f}, "
            f"distinct mass {summ['distinct_mass']:.3f}, AC {summ['AC']:.1f} ({res.seconds:.0f}s)")
    qtrain.remove_checkpoint(ckpt)
    if os.path.exists(norms_path):
        os.remove(norms_path)
    return rows


def run_cells(cells: list[str], which: str, out: str, work: str, ckpt_every: int = 10, log=print) -> bool:
    """Run the missing seeds of each cell. which: 'first' (the cell's first seed), 'rest' (the others), 'all'.
    Returns whether any job ran (False: every picked seed already had its result file)."""
    ran = False
    for cell in cells:
        seeds = cell_config(cell).seeds
        pick = {"first": seeds[:1], "rest": seeds[1:], "all": seeds}[which]
        todo = tuple(s for s in pick if s not in done_seeds(out, cell))
        if todo:
            t0 = time.time()
            run_job(cell, todo, out, work, ckpt_every, log)
            log(f"[{cell}] job done in {time.time() - t0:.0f}s")
            ran = True
    return ran


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/qkov", help="result files go to OUT/runs/<cell>/")
    ap.add_argument("--work", default="runs/qkov", help="in-job checkpoints (deleted when a job ends)")
    ap.add_argument("--cells", default="all", help="comma-separated cell names or 'all': " + ",".join(CELLS))
    ap.add_argument("--seeds", default="all", choices=("first", "rest", "all"))
    ap.add_argument("--ckpt-every", type=int, default=10, help="epochs between in-job checkpoints")
    args = ap.parse_args(argv)
    names = list(CELLS) if args.cells == "all" else [c.strip() for c in args.cells.split(",")]
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        print(f"error: --cells: unknown cell(s) {', '.join(unknown)}; known: {', '.join(CELLS)}", file=sys.stderr)
        return 2
    if args.ckpt_every < 1:
        print(f"error: --ckpt-every must be >= 1, got {args.ckpt_every}", file=sys.stderr)
        return 2
    run_cells(names, args.seeds, args.out, args.work, args.ckpt_every, log=lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    raise SystemExit(main())
