"""Train a language model: `python train.py --config=configs/lm.py:VARIANT,SCALE --workdir=DIR [--config.x=y ...]`.

Resumes from the latest checkpoint in DIR by itself. Writes DIR/checkpoints/, DIR/metrics.jsonl, DIR/tb/ (TensorBoard)
and DIR/summary.json. See docs/training.md.
"""

from __future__ import annotations


from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file and argument, e.g. configs/lm.py:coupled_euler,tiny.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, logs, summary.json. Reused to resume.")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    # Join a multi-process run (TPU pod, GPU/CPU cluster) before anything touches a device; a no-op otherwise.
    from coupled_qk_jax.distributed import initialize_distributed

    initialize_distributed()
    # Imported after flag parsing so that `--help` and flag errors stay fast.
    from coupled_qk_jax.training import cli, loop

    loop.install_sigterm_handler()
    code = cli.run_guarded(lambda: _train(loop))
    cli.exit_process(code)


def _train(loop) -> None:
    summary = loop.train(FLAGS.config, FLAGS.workdir)
    val = f"{summary['val_ppl']:.3f}" if summary["val_ppl"] is not None else "n/a"
    print(f"{summary['status']} at step {summary['step']}: train_loss {summary['train_loss']:.4f}, val_ppl {val}, "
          f"summary in {FLAGS.workdir}/summary.json", flush=True)


if __name__ == "__main__":
    app.run(main)
