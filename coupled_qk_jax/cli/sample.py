"""Sample text from a trained run: `coupled-qk-sample --workdir=DIR [--prompt=TEXT ...] [--ids=1,2,3 ...]`, or from
an export folder: `coupled-qk-sample --exported=DIR ...` (in a checkout also `python sample.py ...`).

The model, its config and its tokenizer all come from the run directory (the newest intact checkpoint, or --step),
restored onto one device (or --mesh=data:D,fsdp:F,tensor:T, where it is also generated on: parameters in the
training layout, the KV cache split over batch and heads) whatever machine trained it; --replica picks a seed of
a seed-parallel run. Launched on several processes (as a multi-host train.py) it joins them: --mesh spans every
process's devices (default: all of them on the data axis) and process 0 prints. Several --prompt and --ids flags make
one batch; prompts may differ in length. Decoding is
greedy with --temperature=0, otherwise sampled with --temperature, --top_k and --top_p from --seed. Text prompts
start a new document (they are preceded by <|endoftext|>); with neither flag, one empty prompt samples a document
from scratch. --runtime=FIELD=VALUE,... computes the model otherwise than the run did (e.g.
--runtime=attention_impl=explicit,scan_layers=false: any runtime.* field, one note each; the tokens do not depend
on it beyond float rounding). See coupled_qk_jax/generate.py.
"""

from __future__ import annotations

from absl import flags

from coupled_qk_jax.training import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (importing this module adds nothing to absl's flags)."""
    flags.DEFINE_string("workdir", None, "Run directory written by train.py.")
    flags.DEFINE_string("exported", None, "An export folder (export.py) to sample from instead of a run directory.")
    flags.DEFINE_integer("step", None, "Checkpoint step of the run (default: the newest intact one).")
    flags.DEFINE_string("mesh", "", "Devices to restore the run onto and generate on, e.g. data:2,tensor:2 "
                        "(default: one device).")
    flags.DEFINE_multi_string("prompt", [], "A text prompt (repeat the flag for a batch).")
    flags.DEFINE_multi_string("ids", [], "A prompt as comma-separated token ids, used as given (repeatable).")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate per prompt.")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy decoding.")
    flags.DEFINE_integer("top_k", 200, "Sample among the k most likely tokens (0 = all).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set of tokens holding this probability (1 = off).")
    flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed, prompts and flags give the same text.")
    flags.DEFINE_integer("num_samples", 1, "Samples per prompt (each prompt is repeated in the batch).")
    flags.DEFINE_integer("replica", 0, "Which seed's model of a seed-parallel run (train.num_seeds > 1).")
    flags.DEFINE_bool("stop_at_eot", True, "End a sample at its first <|endoftext|>.")
    flags.DEFINE_string("runtime", "", "runtime.* fields to compute the model with, FIELD=VALUE[,...], e.g. "
                        "attention_impl=explicit,scan_layers=false (default: the run's own).")
    flags.mark_flags_as_mutual_exclusive(["workdir", "exported"], required=True)


def main() -> None:
    """The `coupled-qk-sample` console script and `python sample.py`."""
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    define_flags()
    cli.run_command(cli.reader_command(_sample), __name__, __doc__)


def _sample() -> None:
    import numpy as np

    from coupled_qk_jax import generate
    from coupled_qk_jax.errors import UserError

    if FLAGS.num_samples < 1:
        raise UserError(f"--num_samples={FLAGS.num_samples}: samples per prompt must be at least 1")
    sampling = generate.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    runtime = cli.parse_runtime_flag(FLAGS.runtime)
    if FLAGS.exported is not None:
        from coupled_qk_jax.export import load_exported

        given = [f"--{n}" for n in ("step", "mesh") if FLAGS[n].present] + (["--replica"] if FLAGS.replica else [])
        if given:
            raise UserError(f"{', '.join(given)}: an export folder holds one model; these pick it from a run "
                            f"directory (--workdir)")

        model, tokenizer, manifest = load_exported(FLAGS.exported, runtime=runtime)
        if runtime:  # one note per change, as a run directory's reader prints them
            import sys

            from coupled_qk_jax.training.rundir import runtime_notes

            own = manifest["config"]
            for note in runtime_notes(own, {**own, "runtime": {**own.get("runtime", {}), **runtime}}):
                print(f"note: {note}", file=sys.stderr, flush=True)
    else:
        from coupled_qk_jax.training.run import Run

        run = Run.open(FLAGS.workdir, mesh=FLAGS.mesh or None, runtime=runtime)
        model, tokenizer = run.model(FLAGS.step, FLAGS.replica), run.tokenizer
        if tokenizer is None:
            raise UserError(f"{FLAGS.workdir} is a {run.cfg.task} run: it has no tokenizer to sample text with")
    texts = list(FLAGS.prompt) if FLAGS.prompt or FLAGS.ids else [""]
    prompts = generate.encode_prompts(tokenizer, texts)
    prompts += [generate.parse_token_ids(s, tokenizer.vocab_size) for s in FLAGS.ids]
    labels = [repr(t) for t in texts] + [f"ids {s}" for s in FLAGS.ids]
    batch = [p for p in prompts for _ in range(FLAGS.num_samples)]
    gen = generate.Generator(model, vocab_limit=tokenizer.vocab_size)
    import jax  # noqa: PLC0415

    # Every process generates (the mesh spans them, and each gets every row back); process 0 prints.
    main_process = jax.process_index() == 0
    if gen.mesh is not None and main_process:
        import sys  # noqa: PLC0415

        print(f"note: generating on a {' x '.join(f'{a}={n}' for a, n in gen.mesh.shape.items())} mesh",
              file=sys.stderr, flush=True)
    outputs = gen.generate(batch, FLAGS.max_new_tokens, sampling, FLAGS.seed,
                           eot_id=tokenizer.eot_id if FLAGS.stop_at_eot else None)
    for i, (prompt, new) in enumerate(zip(batch, outputs) if main_process else ()):
        label = labels[i // FLAGS.num_samples]
        print(f"--- sample {i % FLAGS.num_samples + 1} of prompt {label}: {len(new)} new tokens", flush=True)
        print(tokenizer.decode(np.concatenate([prompt, new])), flush=True)


if __name__ == "__main__":
    main()
