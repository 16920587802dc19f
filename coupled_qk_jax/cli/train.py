"""Train a language model: `coupled-qk-train --config=configs/lm.py:VARIANT,SCALE --workdir=DIR [--config.x=y ...]`
(in a checkout also `python train.py ...`).

Resumes from the newest intact checkpoint in DIR by itself, after checking that the config, data and tokenizer are
the run's own (a field that may change on resume must be named, e.g. --allow_change=train.steps). Writes
DIR/config.json, DIR/data.json, DIR/tokenizer.json, DIR/checkpoints/, DIR/metrics.jsonl, DIR/history.jsonl,
DIR/tb/ and DIR/summary.json. SIGINT (Ctrl-C) and SIGTERM finish the step, save and exit 130 / 143.
`--print_config` prints every config field with its resolved value and exits. A `--config=configs/NAME.py` that
does not exist where the command runs is the packaged preset of that name (coupled_qk_jax/configs/; see
coupled_qk_jax/training/cli.py). See docs/training.md.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from coupled_qk_jax.config import ALL_VARIANTS
from coupled_qk_jax.configs.lm import SCALES
from coupled_qk_jax.training import cli

__doc__ += f"""
VARIANT: {', '.join(ALL_VARIANTS)}
SCALE:   {', '.join(SCALES)}
"""

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (importing this module adds nothing to absl's flags)."""
    config_flags.DEFINE_config_file("config", None, "Config file and argument, e.g. "
                                    "configs/lm.py:coupled_euler,tiny.", lock_config=True)
    flags.DEFINE_string("workdir", None, "Run directory: config, data fingerprint, tokenizer, checkpoints, logs. "
                        "Reused to resume.")
    flags.DEFINE_bool("print_config", False, "Print the resolved config (every field, defaults included) as JSON "
                      "and exit.")
    flags.DEFINE_list("allow_change", [], "Config fields allowed to differ from the run's on resume, e.g. "
                      "train.steps,train.eval_every (each recorded in DIR/history.jsonl).")
    flags.mark_flags_as_required(["config"])


def main() -> None:
    """The `coupled-qk-train` console script and `python train.py`."""
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    define_flags()
    cli.run_command(train_command, __name__, __doc__, flags_parser=cli.parse_flags)


def train_command(argv: list[str]) -> None:
    """absl's main: ``argv`` is what flag parsing left."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.print_config:
        print(cli.config_json(FLAGS.config))
        sys.exit(0)
    if not FLAGS.workdir:
        cli.fail("--workdir is required (the run directory, e.g. --workdir=runs/my_run)")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    # Join a multi-process run (TPU pod, GPU/CPU cluster) before anything touches a device; a no-op otherwise.
    from coupled_qk_jax.distributed import initialize_distributed

    initialize_distributed()
    from coupled_qk_jax.training import loop  # imported after flag parsing: --help and flag errors stay fast

    loop.install_stop_handlers()
    result: dict = {}
    code = cli.run_guarded(lambda: result.update(_train(loop)))
    if code == 0 and result.get("status") == "interrupted":
        code = 128 + int(result["signal_number"])
    cli.exit_process(code)


def _train(loop) -> dict:
    summary = loop.train(FLAGS.config, FLAGS.workdir, allow_change=tuple(FLAGS.allow_change))
    if summary.get("valid/accuracy") is not None:  # MQAR
        score = f"valid/accuracy {summary['valid/accuracy']:.4f}"
    else:
        score = f"val_ppl {summary['val_ppl']:.3f}" if summary.get("val_ppl") is not None else "val_ppl n/a"
    print(f"{summary['status']} at step {summary['step']}: train_loss {summary['train_loss']:.4f}, {score}, "
          f"summary in {FLAGS.workdir}/summary.json", flush=True)
    return summary


if __name__ == "__main__":
    main()
