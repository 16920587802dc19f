"""Training throughput vs data-pipeline throughput.

    python benchmarks/bench_train.py [--variants standard,coupled_euler] [--scale tiny] [--steps 20]
                                     [--corpus stdlib] [--cache_dir DIR] [--seconds 3]

Prints, per variant, the training tokens/s of the real sharded train step (compiled once, timed over `--steps` steps
on real batches from the token cache, after two warm-up steps) and the CPU seconds per step (on a shared machine
CPU time is the steadier number), then the grain training iterator's tokens/s at the same (T, B), and checks that
the pipeline delivers at least 10x what the model consumes (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks.bench_data import bench_iterator  # noqa: E402
from coupled_qk_jax import sharding as shd  # noqa: E402
from coupled_qk_jax.configs.lm import get_config  # noqa: E402
from coupled_qk_jax.data.pipeline import make_train_iterator  # noqa: E402
from coupled_qk_jax.training import loop  # noqa: E402
from coupled_qk_jax.training.config import RunConfig  # noqa: E402


def bench_model(variant: str, scale: str, steps: int, corpus: str, cache_dir: str | None) -> tuple[float, float]:
    """(tokens/s, CPU seconds per step) of the jitted, sharded train step on real batches."""
    cfg = get_config(f"{variant},{scale}")
    cfg.data.corpus = corpus
    if cache_dir:
        cfg.data.cache_dir = cache_dir
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:  # no checkpoints are written; the manager just needs a dir
        s = loop.setup(RunConfig.from_configdict(cfg), workdir)
        s.checkpointer.close()
    state = s.init_state()
    step_fn = loop.make_sharded_train_step(s)
    it = make_train_iterator(s.cache.tokens("train"), int(cfg.data.seq_len), int(cfg.train.batch_size), 0)
    for _ in range(2):  # compile + one warm step
        state, metrics = step_fn(state, shd.global_batch(next(it), s.mesh))
    jax.block_until_ready(metrics)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        state, metrics = step_fn(state, shd.global_batch(next(it), s.mesh))
    jax.block_until_ready(metrics)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = steps * int(cfg.train.batch_size) * int(cfg.data.seq_len)
    return tokens / wall, cpu / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="standard,coupled_euler")
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--cache_dir", default=None, help="token cache root (default: the config's data.cache_dir)")
    ap.add_argument("--seconds", type=float, default=3.0, help="time for the iterator measurement")
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s), {os.cpu_count()} cpus")
    cfg = get_config(f"standard,{args.scale}")
    cfg.data.corpus = args.corpus
    t, b = int(cfg.data.seq_len), int(cfg.train.batch_size)
    model_rate = 0.0
    for variant in args.variants.split(","):
        rate, cpu_per_step = bench_model(variant, args.scale, args.steps, args.corpus, args.cache_dir)
        model_rate = max(model_rate, rate)
        print(f"train {variant:>16s} {args.scale}: {rate:10,.0f} tokens/s  ({cpu_per_step:.3f} CPU s/step, "
              f"T={t} B={b})")
    data_cfg = cfg if args.cache_dir is None else _with_cache(cfg, args.cache_dir)
    cache = loop.load_data(RunConfig.from_configdict(data_cfg))
    pipe = bench_iterator(cache.tokens("train"), t, b, threads=2, seconds=args.seconds)
    ratio = pipe / model_rate
    print(f"data pipeline (grain, T={t} B={b}): {pipe:,.0f} tokens/s = {ratio:,.0f}x the fastest model above")
    ok = ratio >= 10
    print("OK: pipeline >= 10x model consumption" if ok else "FAIL: pipeline < 10x model consumption")
    return 0 if ok else 1


def _with_cache(cfg, cache_dir: str):
    cfg = cfg.copy_and_resolve_references()
    cfg.data.cache_dir = cache_dir
    return cfg


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    sys.exit(main())
