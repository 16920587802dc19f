"""Evaluate a run's newest intact checkpoint on a whole held-out split:
`python eval.py --workdir=DIR [--split=validation|test] [--out=OUT] [--diagnostics]`.

Needs nothing but the run directory: the config (DIR/config.json), the tokenizer and the held-out token ids are the
run's own, so a run directory moved or copied elsewhere evaluates as it is. `--config` is only a confirmation: one
that disagrees with the run is refused with the differing fields. Every token of the split is scored exactly once.
The result is printed first, then written to OUT/eval_<split>_step<step>.json (OUT defaults to DIR/eval); the
training summary is never touched, and a read-only DIR works with --out elsewhere. See docs/training.md.
"""

from __future__ import annotations

import os

from absl import app, flags, logging
from ml_collections import config_flags

from coupled_qk_jax.training import cli

config_flags.DEFINE_config_file("config", None, "Optional: a config that must agree with the run's own "
                                "(DIR/config.json is used either way).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory written by train.py.")
flags.DEFINE_enum("split", "validation", ["validation", "test"], "Split to evaluate.")
flags.DEFINE_string("out", None, "Where to write the results (default: WORKDIR/eval).")
flags.DEFINE_bool("diagnostics", False, "Also write attention diagnostics of the checkpoint on the split's first "
                  "windows to OUT/diagnostics_<split>_step<step>.{json,png} (coupled_qk_jax.diagnostics_report).")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    cli.exit_process(cli.run_guarded(_eval))


def _eval() -> None:
    from coupled_qk_jax.training import loop, rundir

    workdir = os.path.abspath(FLAGS.workdir)
    out = os.path.abspath(FLAGS.out) if FLAGS.out else os.path.join(workdir, "eval")
    cfg = loop.saved_run_config(workdir, FLAGS.config)
    result = loop.evaluate_run(workdir, FLAGS.split, cfg)
    # Printed before anything is written: a failed write loses nothing.
    if "ppl" in result:
        print(f"step {result['step']} {FLAGS.split}: loss {result['loss']:.4f}, ppl {result['ppl']:.3f} "
              f"over {result['tokens']} tokens", flush=True)
    else:  # MQAR: its metrics
        scores = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith("valid/") and "/seeds" not in k
                           and isinstance(v, float))
        print(f"step {result['step']}: {scores}", flush=True)
    path = rundir.write_eval_result(out, result)
    print(f"-> {path}", flush=True)
    if FLAGS.diagnostics:
        from coupled_qk_jax.diagnostics_report import report_from_checkpoint

        report = report_from_checkpoint(cfg, workdir, FLAGS.split, out_dir=out)
        means = report["model_mean"]
        print(f"diagnostics: effective rank {means['effective_rank']:.3f}, normalised entropy "
              f"{means['entropy_normalized']:.3f}, sink mass {means['sink_mass']:.3f} -> "
              f"{report['files']['json']}, {report['files']['png']}", flush=True)


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    app.run(main, flags_parser=cli.parse_flags)
