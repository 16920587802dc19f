"""Export a run's checkpoint to a portable folder: `coupled-qk-export --workdir=RUN --out=DIR [--step=N]
[--replica=K] [--mesh=data:D,fsdp:F,tensor:T]` (in a checkout also `python export.py ...`).

The newest intact checkpoint (or --step), replica 0 (or --replica: one seed of a seed-parallel run), restored on one
device (or --mesh) whatever machine trained it. Writes DIR/model.safetensors (float32 weights named by dotted paths,
always per layer: blocks.0.attn.wq, with or without runtime.scan_layers), DIR/config.json (the run's config),
DIR/tokenizer.json (BPE runs) and DIR/export.json (checksums). Load it with
`coupled_qk_jax.export.load_exported(DIR)`. Launched on several processes (as a multi-host train.py) it joins them
and --mesh spans every process's devices (default: all of them on the data axis); each process gathers the weights,
process 0 writes the folder. --runtime=FIELD=VALUE,... (e.g. --runtime=scan_layers=true) restores the
checkpoint with other runtime.* fields, one note each; the folder is the same. See coupled_qk_jax/export.py.
"""

from __future__ import annotations

from absl import flags

from coupled_qk_jax.training import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (importing this module adds nothing to absl's flags)."""
    flags.DEFINE_string("workdir", None, "Run directory written by train.py.")
    flags.DEFINE_string("out", None, "Export folder to write (new, empty, or an earlier export, which is replaced).")
    flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest intact one).")
    flags.DEFINE_integer("replica", 0, "Which seed replica of a seed-parallel run (train.num_seeds > 1).")
    flags.DEFINE_string("mesh", "", "Devices to restore the run onto, e.g. data:2 (default: one device).")
    flags.DEFINE_string("runtime", "", "runtime.* fields to restore with, FIELD=VALUE[,...], e.g. scan_layers=true "
                        "(default: the run's own).")
    flags.mark_flags_as_required(["workdir", "out"])


def main() -> None:
    """The `coupled-qk-export` console script and `python export.py`."""
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    define_flags()
    cli.run_command(cli.reader_command(_export), __name__, __doc__)


def _export() -> None:
    import jax

    from coupled_qk_jax.export import export_run

    out = export_run(FLAGS.workdir, FLAGS.out, step=FLAGS.step, replica=FLAGS.replica, mesh=FLAGS.mesh or None,
                     runtime=cli.parse_runtime_flag(FLAGS.runtime))
    if jax.process_index() == 0:  # the process that wrote the folder
        print(f"exported {FLAGS.workdir} -> {out}", flush=True)


if __name__ == "__main__":
    main()
