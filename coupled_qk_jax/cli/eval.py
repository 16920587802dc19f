"""Evaluate a run's checkpoint on a whole held-out split:
`coupled-qk-eval --workdir=DIR [--split=validation|test] [--step=N] [--replica=K|all] [--mesh=data:D,fsdp:F,tensor:T]
[--out=OUT] [--diagnostics]` (in a checkout also `python eval.py ...`).

Needs nothing but the run directory: the config (DIR/config.json), the tokenizer and the held-out token ids are the
run's own, so a run directory moved or copied elsewhere, to any machine, evaluates as it is (training/run.py): one
device by default, or the --mesh given, whatever mesh trained it. --step picks a checkpoint (default: the newest
intact one); --replica one seed of a seed-parallel run (default all: one row per seed plus mean ± std). Launched on
several processes (as a multi-host train.py, coupled_qk_jax/distributed.py) it joins them and --mesh spans every
process's devices (default: all of them on the data axis); process 0 prints and writes. `--config` is
only a confirmation: one that disagrees with the run in what is evaluated (model, data, task) is refused with the
differing fields; other differences are ignored with a note, and its `runtime` block is how the model is computed
here, as is --runtime=FIELD=VALUE,... (e.g. --runtime=attention_impl=explicit; over --config's; one note per change
from the run's own). Every token of the split is scored exactly once. The result is printed first, then written to
OUT/eval_<split>_step<step>[_replica<K>].json (OUT defaults to DIR/eval);
the training summary is never touched, and a read-only DIR works with --out elsewhere. A GLUE run's test labels
are not public: --split=test writes GLUE's submission files (OUT/SST-2.tsv, ...) from one replica (0, or --replica)
instead. See docs/training.md.
"""

from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from coupled_qk_jax.training import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (importing this module adds nothing to absl's flags)."""
    config_flags.DEFINE_config_file("config", None, "Optional: a config that must agree with the run's own "
                                    "(DIR/config.json is used either way).", lock_config=True)
    flags.DEFINE_string("workdir", None, "Run directory written by train.py.")
    flags.DEFINE_enum("split", "validation", ["validation", "test"], "Split to evaluate.")
    flags.DEFINE_string("out", None, "Where to write the results (default: WORKDIR/eval).")
    flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the newest intact one).")
    flags.DEFINE_string("replica", "all", "Which seed replica of a seed-parallel run: K (0-based) or all.")
    flags.DEFINE_string("mesh", "", "Devices to evaluate on, e.g. data:2,fsdp:1,tensor:1 (default: one device).")
    flags.DEFINE_bool("diagnostics", False, "Also write attention diagnostics of the checkpoint on the split's first "
                      "windows to OUT/diagnostics_<split>_step<step>.{json,png} (coupled_qk_jax.diagnostics_report).")
    flags.DEFINE_string("runtime", "", "runtime.* fields to compute the model with, FIELD=VALUE[,...], e.g. "
                        "attention_impl=explicit,scan_layers=false (over --config's; default: the run's own).")
    flags.mark_flags_as_required(["workdir"])


def main() -> None:
    """The `coupled-qk-eval` console script and `python eval.py`."""
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    define_flags()
    cli.run_command(cli.reader_command(_eval), __name__, __doc__, flags_parser=cli.parse_flags)


def _eval() -> None:
    import jax

    from coupled_qk_jax import paths
    from coupled_qk_jax.training import rundir
    from coupled_qk_jax.training.run import Run

    workdir = paths.resolve(FLAGS.workdir)  # local paths made absolute; gs:// URLs as given
    out = paths.resolve(FLAGS.out) if FLAGS.out else os.path.join(workdir, "eval")
    run = Run.open(workdir, mesh=FLAGS.mesh or None, config=FLAGS.config, runtime=cli.parse_runtime_flag(FLAGS.runtime))
    replica = cli.parse_replica(FLAGS.replica)
    if replica != "all":
        run.check_replica(replica)
    if run.config.task == "glue" and FLAGS.split == "test":  # no public labels: GLUE's submission files instead
        files = run.write_glue_predictions(out, FLAGS.step, 0 if replica == "all" else replica)
        for path in files:
            print(f"test predictions -> {path}", flush=True)
        return
    result = run.evaluate(FLAGS.split, FLAGS.step, replica)
    # Every process evaluates (the mesh spans them); one prints and writes, the others hold the same result.
    main_process = jax.process_index() == 0
    if main_process:
        print_result(result, FLAGS.split)  # printed before anything is written: a failed write loses nothing
        path = rundir.write_eval_result(out, result)
        print(f"-> {path}", flush=True)
    if FLAGS.diagnostics:
        from coupled_qk_jax.diagnostics_report import report_from_checkpoint

        for r in (range(run.num_replicas) if replica == "all" else [replica]):
            report = report_from_checkpoint(run, FLAGS.split, out_dir=out, step=result["step"], replica=r)
            if report is None:  # another process's: process 0 writes and prints the report
                continue
            means = report["model_mean"]
            which = f" replica {r}" if run.num_replicas > 1 else ""
            print(f"diagnostics{which}: effective rank {means['effective_rank']:.3f}, normalised entropy "
                  f"{means['entropy_normalized']:.3f}, sink mass {means['sink_mass']:.3f} -> "
                  f"{report['files']['json']}, {report['files']['png']}", flush=True)


def print_result(result: dict, split: str) -> None:
    """One line for one model; with several replicas a row per seed, then their mean ± std (sample std)."""
    lm = "ppl" in result
    names = ("loss", "ppl") if lm else tuple(k for k, v in result.items() if k.startswith("valid/")
                                             and "/seeds" not in k and "/std" not in k and isinstance(v, float))
    # MQAR's metric keys are zoology's "valid/..." whichever split was asked; print them without the prefix, so a
    # test evaluation does not read as a validation one (the split is named at the start of the line).
    label = {k: k.split("/", 1)[-1] for k in names}
    which = f" replica {result['replica']} (seed {result['seeds'][0]})" if "replica" in result else ""
    if f"{names[0]}/seeds" not in result:
        scores = (f"loss {result['loss']:.4f}, ppl {result['ppl']:.3f} over {result['tokens']} tokens" if lm
                  else ", ".join(f"{label[k]} {result[k]:.4f}" for k in names))
        print(f"step {result['step']} {split}{which}: {scores}", flush=True)
        return
    tokens = f" over {result['tokens']} tokens" if lm else ""
    print(f"step {result['step']} {split}, {len(result['seeds'])} replicas{tokens}:", flush=True)
    print("  replica  seed  " + "  ".join(f"{label[k]:>14}" for k in names), flush=True)
    for i, seed in enumerate(result["seeds"]):
        print(f"  {i:>7}  {seed:>4}  " + "  ".join(f"{result[k + '/seeds'][i]:>14.4f}" for k in names), flush=True)
    print("  mean ± std    " + "  ".join(f"{result[k]:>7.4f} ± {result[k + '/std']:.4f}" for k in names),
          flush=True)


if __name__ == "__main__":
    main()
