"""Generation throughput: prefill and cached decode tokens/s of `generate.Generator`.

    python benchmarks/bench_generate.py [--scales tiny,small] [--variants standard,coupled_euler,coupled_leapfrog]
                                        [--batch 8] [--prompt_len 128] [--steps 64] [--repeats 3] [--out FILE.md]

For each scale and variant: a model of that config (random weights: speed does not depend on their values) and a
Generator whose KV cache has model.max_len slots. Prefill tokens/s = batch x prompt_len / time of one jitted prefill;
decode tokens/s = batch x steps / time of `steps` jitted decode steps (each feeds one token per row and samples the
next, here with temperature 1 and top-k 50). Both exclude compilation (one warm-up call each) and report the median
of `--repeats` timings plus the CPU seconds, and the machine's load average, which on a shared machine says how far
the wall-clock figures can be trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from coupled_qk_jax.config import RuntimeConfig
from coupled_qk_jax.configs.lm import get_config
from coupled_qk_jax.generate import Generator, Sampling, init_cache
from coupled_qk_jax.model import TransformerLM, count_params
from coupled_qk_jax.training.loop import model_config

SAMPLING = Sampling(temperature=1.0, top_k=50)


def bench(variant: str, scale: str, batch: int, prompt_len: int, steps: int, repeats: int) -> dict:
    config = get_config(f"{variant},{scale}")
    mcfg = model_config(config)
    if prompt_len + steps > mcfg.max_len:
        raise SystemExit(f"error: prompt_len + steps = {prompt_len + steps} exceeds model.max_len={mcfg.max_len}")
    model = TransformerLM(mcfg, 0, RuntimeConfig.from_dict(config.runtime.to_dict()))  # the preset's layout
    gen = Generator(model)
    key = jax.random.key(0)
    prompts = jax.random.randint(key, (batch, prompt_len), 0, mcfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)

    def prefill():
        return gen._prefill(gen.state, init_cache(mcfg, batch, gen.cache_size), prompts, lengths, key,
                            sampling=SAMPLING)

    def decode(tok, cache):
        for j in range(steps):
            tok, cache = gen._decode(gen.state, cache, tok, lengths + j, j + 1, key, sampling=SAMPLING)
        return jax.block_until_ready((tok, cache))

    jax.block_until_ready(prefill())  # compile
    decode(*prefill())  # compile the decode step (and warm it)
    pre_t, pre_cpu, dec_t, dec_cpu = [], [], [], []
    for _ in range(repeats):
        cache_in = init_cache(mcfg, batch, gen.cache_size)
        jax.block_until_ready(cache_in)
        c0, t0 = time.process_time(), time.perf_counter()
        tok, cache = jax.block_until_ready(
            gen._prefill(gen.state, cache_in, prompts, lengths, key, sampling=SAMPLING))
        pre_t.append(time.perf_counter() - t0)
        pre_cpu.append(time.process_time() - c0)
        c0, t0 = time.process_time(), time.perf_counter()
        decode(tok, cache)
        dec_t.append(time.perf_counter() - t0)
        dec_cpu.append(time.process_time() - c0)
    return {"variant": variant, "scale": scale, "n_params": count_params(model), "batch": batch,
            "prompt_len": prompt_len, "decode_steps": steps, "cache_size": gen.cache_size,
            "prefill_tokens_per_s": batch * prompt_len / statistics.median(pre_t),
            "prefill_cpu_s": statistics.median(pre_cpu),
            "decode_tokens_per_s": batch * steps / statistics.median(dec_t),
            "decode_ms_per_step": 1e3 * statistics.median(dec_t) / steps,
            "decode_cpu_s": statistics.median(dec_cpu)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="tiny,small")
    ap.add_argument("--variants", default="standard,coupled_euler,coupled_leapfrog")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="write a Markdown table here (and the rows as JSON beside it)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = [bench(v, s, args.batch, args.prompt_len, args.steps, args.repeats)
            for s in args.scales.split(",") for v in args.variants.split(",")]
    load_after = os.getloadavg()
    lines = [f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs, jax "
             f"{jax.__version__}; load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/"
             f"{load_before[2]:.1f}, after {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f}",
             f"batch {args.batch}, prompt {args.prompt_len} tokens, {args.steps} decode steps, median of "
             f"{args.repeats}", "",
             "| scale | variant | params | prefill tok/s | decode tok/s | decode ms/step | decode CPU s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['scale']} | {r['variant']} | {r['n_params']:,} | {r['prefill_tokens_per_s']:,.0f} | "
                     f"{r['decode_tokens_per_s']:,.0f} | {r['decode_ms_per_step']:.2f} | {r['decode_cpu_s']:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"`python benchmarks/bench_generate.py {' '.join(sys.argv[1:])}`\n\n{text}\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
            json.dump({"load_before": load_before, "load_after": load_after, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    sys.exit(main())
