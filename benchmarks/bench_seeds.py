"""Seed-parallel vs sequential training throughput through the real training loop (`training/loop.py`).

    python benchmarks/bench_seeds.py --seeds 1,3,5 --steps 40 --repeats 2 --out benchmarks/results/cpu_tiny_seed_axis

For each S it trains, at the `tiny` scale of configs/lm.py (or --scale):

* one seed-parallel run, `train.num_seeds = S` (seeds 0..S-1 vmapped in one program);
* S sequential single runs, seeds 0..S-1, one after the other.

and reports tokens/s over all seeds: the loop's own `tokens_per_second` (every step after the first, so compilation
is excluded; the loop reads the loss back every step, as in any run). The sequential figure is total tokens over
total time of the S runs. The claim under test (issue 11): a seed-parallel step of S tiny seeds is not slower per
token than S sequential runs, i.e. ratio = parallel / sequential >= 1.

Wall-clock: run it on an otherwise idle machine (the script records the load average before and after). Outputs
OUT.json (every figure, the config, jax version, devices, load) and OUT.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

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
    cfg.checkpoint.update(every=args.steps, async_save=False)
    return cfg


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
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--tokenizer", default="bpe")
    p.add_argument("--cache-dir", default="~/.cache/coupled_qk_jax")
    p.add_argument("--repeats", type=int, default=2, help="measurements per side, order alternated (A B B A)")
    p.add_argument("--out", required=True, help="output path without suffix")
    args = p.parse_args()

    import jax

    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for S in (int(x) for x in args.seeds.split(",")):
            # Order-balanced (A B B A ...): whichever side runs first in a process pays more of its warm-up (at S=1
            # both sides are the same program, so their ratio shows that bias). Each side's figure is the median
            # over --repeats measurements.
            pars, seqs = [], []
            for rep in range(args.repeats):
                order = ("par", "seq") if rep % 2 == 0 else ("seq", "par")
                for side in order:
                    if side == "par":
                        pars.append(run(bench_config(args, S, 0), root, f"par{S}_{rep}"))
                    else:
                        seq = [run(bench_config(args, 1, i), root, f"seq{S}_{rep}_{i}") for i in range(S)]
                        # total tokens / total time over the S sequential runs (each timed like the parallel one)
                        tokens = sum(r["tokens_per_second"] * r["train_seconds"] for r in seq)
                        seqs.append({"tokens_per_second": tokens / sum(r["train_seconds"] for r in seq), "runs": seq})
            par_tps = statistics.median(r["tokens_per_second"] for r in pars)
            seq_tps = statistics.median(r["tokens_per_second"] for r in seqs)
            rows.append({"S": S, "parallel_tokens_per_s": par_tps, "sequential_tokens_per_s": seq_tps,
                         "ratio": par_tps / seq_tps, "parallel": pars, "sequential": seqs})
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
             "| S | seed-parallel tok/s | S sequential runs tok/s | ratio |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['S']} | {r['parallel_tokens_per_s']:,.0f} | {r['sequential_tokens_per_s']:,.0f} | "
              f"{r['ratio']:.2f} |" for r in rows]
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
