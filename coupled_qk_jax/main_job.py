"""The README's main job: train `standard` and `coupled_euler` at `tiny` scale on the `stdlib` corpus, then compare.

    python -m coupled_qk_jax.main_job [--workdir runs/main_job] [--steps 300] [--variants standard,coupled_euler]
                                      [--corpus text_dir:DIR] [--split_fractions 0.8,0.1,0.1] [--vocab_size N]

`--corpus` takes any corpus string of docs/data.md (a text folder, WikiText-103, an `hf:` dataset, a mixture), so
the same comparison runs on your own text; `--split_fractions` sets the train/validation/test shares of a file
corpus (a small folder needs larger held-out shares than the default 0.98/0.01/0.01), and `--vocab_size` the BPE's size
(a corpus of a few hundred kB cannot fill the default 2048).

Each variant is an ordinary train.py run (same loop, checkpoints and summary.json) in WORKDIR/<variant>; both share
one token cache, so the 2048-token BPE is trained and the corpus tokenised once. Sized for 2 CPU cores: 300 steps of
16 x 256 tokens (1.2M tokens) per variant, about 1.5-3 minutes each. Afterwards it prints a table of validation
perplexity (the whole validation split, every token once) and saves WORKDIR/loss_curves.png and
WORKDIR/results.json. Re-running resumes or, when both runs are complete, only re-evaluates and re-plots.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from coupled_qk_jax import paths


def build_config(variant: str, steps: int, cache_dir: str | None, corpus: str = "stdlib",
                 split_fractions: str = "", vocab_size: int = 0):
    from coupled_qk_jax.configs.lm import get_config

    cfg = get_config(f"{variant},tiny")
    cfg.data.corpus = corpus
    cfg.data.split_fractions = split_fractions
    if vocab_size:
        cfg.model.vocab_size = vocab_size
    cfg.train.steps = steps
    cfg.train.warmup_steps = max(1, steps // 10)
    cfg.train.log_every = 10
    cfg.train.eval_every = 0  # one full validation pass at the end
    cfg.checkpoint.every = max(50, steps // 4)
    if cache_dir:
        cfg.data.cache_dir = cache_dir
    return cfg


def plot(runs: dict[str, list[dict]], path: str, corpus: str = "stdlib", vocab: int = 2048) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant, rows in runs.items():
        train = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
        line = ax.plot(*zip(*train), label=f"{variant} (train)")[0]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o", color=line.get_color(), label=f"{variant} (validation)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(("tiny LM on the Python stdlib" if corpus == "stdlib" else f"tiny LM on {corpus}")
                 + f" ({vocab}-token BPE)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="runs/main_job")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--variants", default="standard,coupled_euler")
    ap.add_argument("--cache_dir", default=None, help="token cache root (default: configs/lm.py's data.cache_dir)")
    ap.add_argument("--corpus", default="stdlib", help="corpus string (docs/data.md), e.g. text_dir:DIR")
    ap.add_argument("--split_fractions", default="", help="train,validation,test shares of a file corpus, e.g. "
                    "0.8,0.1,0.1 (default 0.98,0.01,0.01)")
    ap.add_argument("--vocab_size", type=int, default=0, help="BPE / model vocabulary (default: the tiny scale's "
                    "2048); a small corpus may need fewer")
    args = ap.parse_args(argv)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO

    from coupled_qk_jax.training import cli, loop
    from coupled_qk_jax.training.rundir import write_json
    from coupled_qk_jax.training.writers import read_metrics

    t0 = time.time()
    workdir = paths.resolve(args.workdir)  # a local path made absolute; a gs:// URL as given
    summaries: dict[str, dict] = {}

    def run_all() -> None:
        for variant in args.variants.split(","):
            print(f"== {variant}, tiny, {args.corpus}, {args.steps} steps -> {os.path.join(args.workdir, variant)}",
                  flush=True)
            cfg = build_config(variant, args.steps, args.cache_dir, args.corpus, args.split_fractions,
                               args.vocab_size)
            summaries[variant] = loop.train(cfg, os.path.join(workdir, variant))
            if summaries[variant]["status"] != "completed":
                return

    loop.install_stop_handlers()
    code = cli.run_guarded(run_all)
    if code:
        return code

    unfinished = [v for v, s in summaries.items() if s["status"] != "completed"]
    if unfinished:  # e.g. SIGTERM: the runs are checkpointed; rerunning the same command resumes them
        print(f"stopped before the end ({', '.join(unfinished)}); rerun the same command to resume", flush=True)
        signum = loop.stop_signal()
        return 128 + signum if signum else 0  # 130 / 143 after SIGINT / SIGTERM, as train.py; 0 after stop_after
    rows = [("variant", "params", "steps", "tokens", "train loss", "val loss", "val ppl", "val tokens", "tok/s")]
    for v, s in summaries.items():
        tps = f"{s['tokens_per_second']:,.0f}" if s["tokens_per_second"] else "-"
        rows.append((v, f"{s['n_params']:,}", str(s["step"]), f"{s['tokens_seen']:,}", f"{s['train_loss']:.4f}",
                     f"{s['val_loss']:.4f}", f"{s['val_ppl']:.2f}", f"{s['val_tokens']:,}", tps))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for i, r in enumerate(rows):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    png = os.path.join(workdir, "loss_curves.png")
    plot({v: read_metrics(os.path.join(workdir, v)) for v in summaries}, png, args.corpus,
         args.vocab_size or build_config("standard", 1, None).model.vocab_size)
    write_json(os.path.join(workdir, "results.json"), {"runs": summaries, "wall_seconds": time.time() - t0})
    print(f"\nloss curves: {os.path.join(args.workdir, 'loss_curves.png')}   total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    sys.exit(main())
