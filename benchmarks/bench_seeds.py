"""Seed-parallel vs sequential training throughput through the real training loop (`training/loop.py`).

    python benchmarks/bench_seeds.py --seeds 1,3,5 --steps 40 --repeats 2 --out benchmarks/results/cpu_tiny_seed_axis

For each S it trains, at the `tiny` scale of configs/lm.py (or --scale):

* one seed-parallel run, `train.num_seeds = S` (seeds 0..S-1 vmapped in one program);
* S sequential single runs, seeds 0..S-1, one after the other.

and reports tokens/s over all seeds: the loop's own `tokens_per_second` (every step after the first, so compilation
is excluded; the loop reads the loss back every step, as in any run). The sequential figure is total tokens over
total time of the S runs. The claim under test: a seed-parallel step of S tiny seeds is not slower per
token than S sequential runs, i.e. ratio = parallel / sequential >= 1.

Wall-clock: run it on an otherwise idle machine (the script records the load average before and after). Outputs
OUT.json (every figure, the config, jax version, devices, load) and OUT.md (the table).

Leapfrog's drift fallback. `--per-seed-fallback` adds a third side to every S > 1: the seed-parallel run
with the fallback decided per seed, as the code once did (a batched predicate: the `lax.cond` of
`dynamics._leapfrog_reversible_bwd` becomes a select that runs the rebuild and the full recompute), timed in the
same process, order-rotated with the other two. `--compiled` trains nothing: it compiles the train step of S = 1 and
of every S and reports XLA's cost analysis, HLO op counts and temporary memory for three predicates: "shared" (the
shipped one), "per_seed" (before 25.3) and "trusted" (always the rebuild: XLA drops the fallback, so its cost is
what the shared program executes while no seed drifts). XLA's cost analysis adds up both branches of a conditional
and counts a while loop's body once, so its FLOPs are those of the compiled program, not of the executed path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_config(args: argparse.Namespace, num_seeds: int, seed: int):
    from configs.lm import get_config

    cfg = get_config(f"{args.variant},{args.scale}")
    cfg.data.update(corpus=args.corpus, tokenizer=args.tokenizer, cache_dir=os.path.expanduser(args.cache_dir))
    if args.tokenizer == "byte":
        cfg.model.vocab_size = 257
    # Only training is timed: one final evaluation batch, one checkpoint at the end, one log line.
    cfg.train.update(steps=args.steps, seed=seed, num_seeds=num_seeds, log_every=args.steps, eval_every=0,
                     eval_batches=1, warmup_steps=min(10, args.steps // 4))
    if args.batch:
        cfg.train.batch_size = args.batch
    if args.n_steps:
        cfg.model.n_steps = args.n_steps
    cfg.checkpoint.update(every=args.steps, async_save=False)
    return cfg


FALLBACKS = {  # leapfrog's rebuild-trusted predicate, dynamics._rebuild_trusted, as each mode replaces it
    # the old behaviour: trusted per seed, a batched predicate under the seed vmap (the cond becomes a select)
    "per_seed": lambda drift: drift <= 4.0,
    # the rebuild always trusted: XLA drops the fallback branch, leaving the work of a step where no seed drifts
    "trusted": lambda drift: np.bool_(True),
}


@contextlib.contextmanager
def fallback(mode: str):
    """dynamics._rebuild_trusted replaced by FALLBACKS[mode] ("shared": the shipped one, one decision for all seeds)."""
    from coupled_qk_jax import dynamics

    assert dynamics.REBUILD_DRIFT_BOUND == 4.0, "update FALLBACKS"
    shared = dynamics._rebuild_trusted
    dynamics._rebuild_trusted = FALLBACKS.get(mode, shared)
    try:
        yield
    finally:
        dynamics._rebuild_trusted = shared


def compiled_figures(cfg, root: str) -> dict:
    """The loop's train step for cfg, compiled from abstract shapes: cost analysis, op counts and memory."""
    import re

    import jax

    from coupled_qk_jax.training import loop
    from coupled_qk_jax.training.config import RunConfig

    s = loop.setup(RunConfig.from_configdict(cfg), root)
    n_seeds, batch, seq = len(s.seeds), int(cfg.train.batch_size), int(cfg.data.seq_len)
    tokens = jax.ShapeDtypeStruct(((n_seeds,) if n_seeds > 1 else ()) + (batch, seq), jax.numpy.int32)
    compiled = loop.make_sharded_train_step(s).lower(s.abstract_state, {"inputs": tokens, "targets": tokens}).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list of one dict on older jax
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    return {"flops": cost.get("flops"), "transcendentals": cost.get("transcendentals"),
            "bytes_accessed": cost.get("bytes accessed"),
            "hlo_instructions": sum(1 for line in text.splitlines() if " = " in line),
            "conditionals": text.count(" conditional("), "while_loops": len(re.findall(r" while\(", text)),
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None)}


def compiled_main(args: argparse.Namespace, seeds: list[int]) -> dict:
    """--compiled: the figures of the S = 1 step and of every S-seed step, under each fallback mode."""
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for S in [1] + [S for S in seeds if S > 1]:
            row = {"S": S}
            for mode in ("shared", "per_seed", "trusted"):
                with fallback(mode):
                    row[mode] = compiled_figures(bench_config(args, S, 0), os.path.join(root, f"{mode}{S}"))
                print(f"S={S} {mode}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row[mode].items() if v is not None),
                      flush=True)
            rows.append(row)
    return {"rows": rows}


def run(cfg, root: str, name: str) -> dict:
    from coupled_qk_jax.training import loop

    t0 = time.perf_counter()
    summary = loop.train(cfg, os.path.join(root, name), progress=False)
    return {"tokens_per_second": summary["tokens_per_second"], "train_seconds": summary["train_seconds"],
            "wall_seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,3,5", help="comma-separated S values")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--scale", default="tiny")
    p.add_argument("--variant", default="coupled_euler")
    p.add_argument("--batch", type=int, default=0, help="override the scale's batch size (0 = keep)")
    p.add_argument("--n-steps", type=int, default=0, help="override model.n_steps (0 = keep)")
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--tokenizer", default="bpe")
    p.add_argument("--cache-dir", default="~/.cache/coupled_qk_jax")
    p.add_argument("--repeats", type=int, default=2, help="measurements per side, order alternated (A B B A)")
    p.add_argument("--out", required=True, help="output path without suffix")
    p.add_argument("--per-seed-fallback", action="store_true",
                   help="also time the seed-parallel run with leapfrog's fallback decided per seed (before 25.3)")
    p.add_argument("--compiled", action="store_true", help="compile the steps and report their cost; train nothing")
    args = p.parse_args()

    import jax

    load_before = os.getloadavg()
    if args.compiled:
        result = compiled_main(args, [int(x) for x in args.seeds.split(",")])
        result.update(command="python benchmarks/bench_seeds.py " + " ".join(sys.argv[1:]), jax=jax.__version__,
                      variant=args.variant, scale=args.scale)
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        return
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for S in (int(x) for x in args.seeds.split(",")):
            # Order-balanced (A B B A ...; with a third side, rotated): whichever side runs first in a process pays
            # more of its warm-up (at S=1 both sides are the same program, so their ratio shows that bias). Each
            # side's figure is the median over --repeats measurements.
            sides = ["par", "seq"] + (["par_per_seed"] if args.per_seed_fallback and S > 1 else [])
            pars, seqs, olds = [], [], []
            for rep in range(args.repeats):
                order = sides[rep % len(sides):] + sides[:rep % len(sides)]
                order = order if rep % 2 == 0 else order[::-1]
                for side in order:
                    if side == "par":
                        pars.append(run(bench_config(args, S, 0), root, f"par{S}_{rep}"))
                    elif side == "par_per_seed":
                        with fallback("per_seed"):
                            olds.append(run(bench_config(args, S, 0), root, f"old{S}_{rep}"))
                    else:
                        seq = [run(bench_config(args, 1, i), root, f"seq{S}_{rep}_{i}") for i in range(S)]
                        # total tokens / total time over the S sequential runs (each timed like the parallel one)
                        tokens = sum(r["tokens_per_second"] * r["train_seconds"] for r in seq)
                        seqs.append({"tokens_per_second": tokens / sum(r["train_seconds"] for r in seq), "runs": seq})
            par_tps = statistics.median(r["tokens_per_second"] for r in pars)
            seq_tps = statistics.median(r["tokens_per_second"] for r in seqs)
            rows.append({"S": S, "parallel_tokens_per_s": par_tps, "sequential_tokens_per_s": seq_tps,
                         "ratio": par_tps / seq_tps, "parallel": pars, "sequential": seqs})
            if olds:
                old_tps = statistics.median(r["tokens_per_second"] for r in olds)
                rows[-1].update(per_seed_fallback_tokens_per_s=old_tps, per_seed_fallback_ratio=old_tps / seq_tps,
                                per_seed_fallback=olds)
                print(f"S={S}: seed-parallel with the per-seed fallback (before 25.3) {old_tps:,.0f} tok/s, ratio "
                      f"{old_tps / seq_tps:.2f}", flush=True)
            print(f"S={S}: parallel {par_tps:,.0f} tok/s, sequential {seq_tps:,.0f} tok/s, "
                  f"ratio {rows[-1]['ratio']:.2f} (per repeat: parallel "
                  f"{', '.join(format(r['tokens_per_second'], ',.0f') for r in pars)}; sequential "
                  f"{', '.join(format(r['tokens_per_second'], ',.0f') for r in seqs)})", flush=True)
    result = {"command": "python benchmarks/bench_seeds.py " + " ".join(sys.argv[1:]), "scale": args.scale,
              "variant": args.variant, "steps": args.steps, "corpus": args.corpus, "tokenizer": args.tokenizer,
              "jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "load_before": load_before,
              "load_after": os.getloadavg(), "rows": rows}
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Seed-parallel vs sequential ({args.scale}, {args.variant}, {args.steps} steps)", "",
             f"`{result['command']}`; jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} "
             f"device(s); load average before {load_before[0]:.1f}, after {result['load_after'][0]:.1f}.", "",
             "Each figure is the median of --repeats order-balanced measurements (A B B A).", "",
             "| S | seed-parallel tok/s | S sequential runs tok/s | ratio | per-seed fallback tok/s | ratio |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['S']} | {r['parallel_tokens_per_s']:,.0f} | {r['sequential_tokens_per_s']:,.0f} | "
              f"{r['ratio']:.2f} | " + (f"{r['per_seed_fallback_tokens_per_s']:,.0f} | "
                                        f"{r['per_seed_fallback_ratio']:.2f} |"
                                        if "per_seed_fallback_ratio" in r else "- | - |") for r in rows]
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
