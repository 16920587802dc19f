"""Evaluate a run's latest checkpoint on a whole split:
`python eval.py --workdir=DIR [--config=configs/lm.py:VARIANT,SCALE ...] [--split=validation|test]`.

Without --config the config saved with the checkpoint is used. Every token of the split is scored exactly once;
the result (loss, perplexity, token count) goes to DIR/summary.json and DIR/metrics.jsonl. See docs/training.md.
"""

from __future__ import annotations


from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file and argument (default: the checkpoint's own config).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory written by train.py.")
flags.DEFINE_enum("split", "validation", ["validation", "test"], "Split to evaluate.")
flags.DEFINE_bool("diagnostics", False, "Also write attention diagnostics of the checkpoint on the split's first "
                  "windows to WORKDIR/diagnostics_<split>_step<step>.{json,png} (coupled_qk_jax.diagnostics_report).")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from coupled_qk_jax.training import cli

    cli.exit_process(cli.run_guarded(_eval))


def _eval() -> None:
    from coupled_qk_jax.training import loop

    cfg = FLAGS.config if FLAGS.config is not None else loop.saved_run_config(FLAGS.workdir)
    summary = loop.evaluate_checkpoint(cfg, FLAGS.workdir, FLAGS.split)
    key = "val" if FLAGS.split == "validation" else "test"
    print(f"step {summary['step']} {FLAGS.split}: loss {summary[key + '_loss']:.4f}, ppl {summary[key + '_ppl']:.3f} "
          f"over {summary[key + '_tokens']} tokens", flush=True)
    if FLAGS.diagnostics:
        from coupled_qk_jax.diagnostics_report import report_from_checkpoint

        report = report_from_checkpoint(cfg, FLAGS.workdir, FLAGS.split)
        means = report["model_mean"]
        print(f"diagnostics: effective rank {means['effective_rank']:.3f}, normalised entropy "
              f"{means['entropy_normalized']:.3f}, sink mass {means['sink_mass']:.3f} -> "
              f"{report['files']['json']}, {report['files']['png']}", flush=True)


if __name__ == "__main__":
    app.run(main)
