"""The ahead-of-time compile's command line: `coupled-qk-aot` and `python -m coupled_qk_jax.aot` (what it does and
prints: coupled_qk_jax/aot.py).

It does not apply the CPU malloc settings (coupled_qk_jax/startup.py): the compile's work is the TPU compiler's, and
the process sets JAX_PLATFORMS=cpu only when coupled_qk_jax.aot is imported.
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags
from ml_collections import config_flags

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (importing this module adds nothing to absl's flags)."""
    config_flags.DEFINE_config_file("config", None, "Config file and argument, e.g. configs/lm.py:coupled_euler,350m.",
                                    lock_config=True)
    flags.DEFINE_string("topology", None, "TPU topology CHIP:SHAPE, e.g. v5e:16x16 (v5e-256), v4:4x4x4 (v4-128), "
                        "v5p:4x4x4 (v5p-128).")
    flags.DEFINE_string("mesh", "", "Mesh sizes, e.g. fsdp:256 or data:16,fsdp:16 (axes not named are 1; one may "
                        "be -1); default: the config's mesh block.")
    flags.DEFINE_integer("num_slices", 1, "Slices of the topology (a multi-slice run).")
    flags.DEFINE_list("steps", ["train", "eval", "decode"], "Which steps to compile.")
    flags.DEFINE_string("json", "", "Also write the report as JSON here.")
    flags.mark_flags_as_required(["config", "topology"])


def main() -> None:
    """The `coupled-qk-aot` console script and `python -m coupled_qk_jax.aot`."""
    from coupled_qk_jax import aot

    define_flags()
    cli.run_command(lambda argv: cli.exit_process(cli.run_guarded(lambda: aot_command(argv))), __name__,
                    aot.__doc__ or "", flags_parser=cli.parse_flags)


def aot_command(argv: list[str]) -> None:
    """Compile the config's steps for the topology, print the report (and write --json); a step that does not fit
    the chip's memory is a UserError."""
    from coupled_qk_jax import aot
    from coupled_qk_jax.training import layout

    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    cfg = FLAGS.config
    if FLAGS.mesh:
        sizes = layout.parse_mesh(FLAGS.mesh)
        with cfg.unlocked():
            for axis, size in sizes.items():
                cfg.mesh[axis] = size
    devices = aot.topology_devices(FLAGS.topology, FLAGS.num_slices)
    result = aot.compile_steps(cfg, devices, tuple(FLAGS.steps))
    print(aot.format_report(result, FLAGS.topology), flush=True)
    if FLAGS.json:
        rows = [{**dataclasses.asdict(r), "total_bytes": r.total_bytes} for r in result["steps"]]
        with open(FLAGS.json, "w") as f:
            json.dump({"topology": FLAGS.topology, **{k: v for k, v in result.items() if k != "steps"},
                       "steps": rows}, f, indent=1)
    for r in result["steps"]:
        if message := aot.fit_error(r, aot.hbm_bytes(FLAGS.topology), FLAGS.topology.partition(":")[0]):
            raise UserError(message)


if __name__ == "__main__":
    main()
