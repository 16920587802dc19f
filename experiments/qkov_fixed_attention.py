"""Figure-3 fixed-attention experiment (spec §4) at the paper's budget, resumable: with attention frozen at mass
alpha on the distinct tokens, train only the OV circuit and measure how the loss L_t(alpha) and its sensitivity
depend on alpha.

* Factorised OV ``W_O W_V`` (no bias) vs collapsed ``W_OV`` (with bias), PyTorch-default init, SGD lr 1e-2,
  class-balanced batches of 4 x 32, seq_len 64, seed 1234, 500 epochs x 250 batches; alpha in
  {0.2, 0.4, 0.6, 0.8, 1.0}, all five alphas trained as one vmapped program on the same data stream (the reference
  re-seeds torch per alpha, and its numpy data stream is not seeded).
* Before training and after every epoch the model is evaluated on one fixed evaluation set (``--eval-batches``
  class-balanced batches from RandomState(1234 + 1e6); the reference draws 1000 fresh batches per evaluation) at
  alpha and at alpha + 0.005: sensitivity = (L_t(alpha) - L_t(alpha + 0.005)) / 0.005. One fixed set for both
  terms removes sampling noise from the finite difference. For alpha = 1, alpha + 0.005 is clipped to 1 and the
  sensitivity is reported nan (the reference plots 0).
* The fixed attention makes the pooled input linear in alpha, alpha * P_rel + (1 - alpha) * P_rest, with P_rel and
  P_rest the per-sequence token histograms of the distinct and the other positions; they are computed once, so an
  evaluation costs two 50 x 50 matmuls per sequence.

Each OV type is a job: checkpointed every ``--ckpt-every`` epochs to the orbax checkpoint directory
``<work>/fixed_<ov>_ckpt/`` (its evaluation history beside it; an old-format ``<work>/fixed_<ov>.npz`` of an earlier
version stops the job with a hint), finished into ``<out>/runs/fixed/<ov>.csv`` (rows ov, alpha, epoch, step, loss,
loss_alpha_plus, sensitivity) and ``<ov>.json``; a restart skips finished jobs. Tables: experiments/qkov_report.py.

Usage: python experiments/qkov_fixed_attention.py --out results/qkov [--eval-batches 1000]
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

from coupled_qk_jax.configs.qkov import get_config, to_train_config
from coupled_qk_jax.qkov import data as qdata
from coupled_qk_jax.qkov import model as qmodel
from coupled_qk_jax.qkov import train as qtrain

# A sibling experiment: `experiments.` when imported as a package module (python -m experiments.X, the tests), by its
# bare name when run as a script (python experiments/X.py puts this folder first on the path).
if __package__:
    from experiments import qkov_synthetic as synth
else:
    import qkov_synthetic as synth

DA = 0.005
OV_TYPES = {"factorised": "fafo,fixed", "collapsed": "caco,fixed"}


def pooled_parts(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P_rel, P_rest) [N, 50] float32: token histograms of the distinct (id > 9) and the other positions of each
    input row [N, T], each normalised to sum 1; an empty set takes the other's histogram, as fixed_attention does."""
    n = tokens.shape[0]
    flat = (np.arange(n)[:, None] * qmodel.D + tokens).ravel()  # row-major (row, token) bins
    rel = (tokens > 9).ravel()
    h_rel = np.bincount(flat[rel], minlength=n * qmodel.D).reshape(n, qmodel.D).astype(np.float64)
    h_rest = np.bincount(flat[~rel], minlength=n * qmodel.D).reshape(n, qmodel.D).astype(np.float64)
    n_rel, n_rest = h_rel.sum(-1, keepdims=True), h_rest.sum(-1, keepdims=True)
    p_rel = np.where(n_rel > 0, h_rel / np.maximum(n_rel, 1), h_rest / np.maximum(n_rest, 1))
    p_rest = np.where(n_rest > 0, h_rest / np.maximum(n_rest, 1), p_rel)
    return p_rel.astype(np.float32), p_rest.astype(np.float32)


def job_paths(out: str, work: str, ov: str) -> dict[str, str]:
    return {"csv": os.path.join(out, "runs", "fixed", f"{ov}.csv"),
            "json": os.path.join(out, "runs", "fixed", f"{ov}.json"),
            "ckpt": os.path.join(work, f"fixed_{ov}_ckpt"), "legacy_ckpt": os.path.join(work, f"fixed_{ov}.npz"),
            "hist": os.path.join(work, f"fixed_{ov}_eval.json")}


def run_job(ov: str, out: str, work: str, eval_batches: int, ckpt_every: int = 10, log=print) -> bool:
    """Train and evaluate one OV type unless its result file exists; returns whether it ran."""
    paths = job_paths(out, work, ov)
    if os.path.exists(paths["json"]):
        return False
    os.makedirs(os.path.dirname(paths["csv"]), exist_ok=True)
    os.makedirs(work, exist_ok=True)
    qtrain.refuse_legacy_checkpoint(paths["legacy_ckpt"], paths["ckpt"])
    cfg = to_train_config(get_config(OV_TYPES[ov]))
    ev = qdata.generate_batches(np.random.RandomState(cfg.seeds[0] + 1_000_000), eval_batches, cfg.batch_size,
                                cfg.seq_len, fixed_attention=True)
    x, y = qdata.split(ev.reshape(-1, cfg.seq_len))
    p_rel, p_rest = (jnp.asarray(a) for a in pooled_parts(x))
    y = jnp.asarray(y)
    alphas = jnp.asarray(cfg.fixed_alpha, jnp.float32)

    def loss_at(params, a):
        logits = qmodel.readout_pooled(params, a * p_rel + (1.0 - a) * p_rest)
        return qmodel.cross_entropy(logits, y)

    losses = jax.jit(jax.vmap(loss_at))
    hist = {}  # epoch -> (losses at alpha, at alpha + DA); kept beside the checkpoint
    if qtrain.has_checkpoint(paths["ckpt"]) and os.path.exists(paths["hist"]):
        with open(paths["hist"]) as fh:
            hist = {int(k): v for k, v in json.load(fh).items()}

    def cb(ep, params):
        hist[ep] = (np.asarray(losses(params, alphas)).tolist(),
                    np.asarray(losses(params, jnp.minimum(alphas + DA, 1.0))).tolist())
        if ep % ckpt_every == 0:
            tmp = paths["hist"] + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(hist, fh)
            os.replace(tmp, paths["hist"])

    log(f"[fixed {ov}] {cfg.n_epochs} x {cfg.batches_per_epoch} steps of 4x{cfg.batch_size}, alphas {cfg.fixed_alpha}, "
        f"evaluation on {eval_batches} batches")
    cpu0 = synth.cpu_seconds()
    res = qtrain.train(cfg, log_every=max(1, cfg.n_epochs // 10), log=log, callback=cb, ckpt_path=paths["ckpt"],
                       ckpt_every=ckpt_every)
    cpu_train = synth.cpu_seconds() - cpu0
    rows = []
    for ep in range(cfg.n_epochs + 1):
        l0, l1 = hist[ep]
        for i, a in enumerate(cfg.fixed_alpha):
            sens = (l0[i] - l1[i]) / DA if a + DA <= 1.0 else float("nan")
            rows.append({"ov": ov, "alpha": a, "epoch": ep, "step": ep * cfg.batches_per_epoch, "loss": l0[i],
                         "loss_alpha_plus": l1[i], "sensitivity": sens})
    with open(paths["csv"] + ".tmp", "w", newline="") as fh:
        w = csv.DictWriter(fh, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(paths["csv"] + ".tmp", paths["csv"])
    meta = {"ov": ov, "config": OV_TYPES[ov], "train_config": {k: v for k, v in vars(cfg).items()},
            "eval_batches": eval_batches, "eval_sequences": int(len(y)), "final_loss": dict(
                zip(map(str, cfg.fixed_alpha), hist[cfg.n_epochs][0])), "job_seconds": res.seconds,
            "job_cpu_seconds": cpu_train, "commit": synth.COMMIT}
    with open(paths["json"] + ".tmp", "w") as fh:
        json.dump(meta, fh, indent=1)
    os.replace(paths["json"] + ".tmp", paths["json"])
    qtrain.remove_checkpoint(paths["ckpt"])
    if os.path.exists(paths["hist"]):
        os.remove(paths["hist"])
    log(f"[fixed {ov}] done in {res.seconds:.0f}s; final losses {meta['final_loss']}")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/qkov")
    ap.add_argument("--work", default="runs/qkov")
    ap.add_argument("--ov", default="factorised,collapsed", help="comma-separated: factorised, collapsed")
    ap.add_argument("--eval-batches", type=int, default=1000, help="evaluation batches of 4x32 (paper: 1000, fresh)")
    ap.add_argument("--ckpt-every", type=int, default=10)
    args = ap.parse_args(argv)
    ovs = [o.strip() for o in args.ov.split(",")]
    bad = [o for o in ovs if o not in OV_TYPES]
    if bad:
        print(f"error: --ov: unknown {', '.join(bad)}; known: {', '.join(OV_TYPES)}", file=sys.stderr)
        return 2
    if args.eval_batches < 1 or args.ckpt_every < 1:
        print("error: --eval-batches and --ckpt-every must be >= 1", file=sys.stderr)
        return 2
    for ov in ovs:
        t0 = time.time()
        run_job(ov, args.out, args.work, args.eval_batches, args.ckpt_every, log=lambda m: print(m, flush=True))
        print(f"[fixed {ov}] {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    raise SystemExit(main())
