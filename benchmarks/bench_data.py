"""Data pipeline throughput: corpus reading, BPE training, tokenisation, training iterator and eval batches.

    python benchmarks/bench_data.py [--corpus stdlib] [--vocab_size 8192] [--cache_dir DIR] [--seconds 3]

The issue's requirement is that the pipeline deliver >= 10x what the tiny CPU model consumes (~10-15k tokens/s on
2 cores), i.e. >= ~150k tokens/s; the training iterator is expected to give well over 1M tokens/s.
Without --cache_dir the cache goes to a temporary directory, so tokenisation is timed from scratch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from coupled_qk_jax.data.corpora import CorpusSpec, ReadStats, iter_documents
from coupled_qk_jax.data.pipeline import eval_batches, make_train_iterator
from coupled_qk_jax.data.token_cache import build_token_cache
from coupled_qk_jax.data.tokenizer import BPETokenizer


def _rate(n: float, seconds: float) -> str:
    return f"{n / seconds / 1e6:8.2f} M/s"


def bench_iterator(tokens: np.ndarray, seq_len: int, batch: int, threads: int, seconds: float) -> float:
    it = make_train_iterator(tokens, seq_len, batch, seed=0, num_threads=threads)
    next(it)  # start the prefetch threads outside the timed region
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = next(it)
        n += b["inputs"].size
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--vocab_size", type=int, default=8192)
    ap.add_argument("--cache_dir", default=None)
    ap.add_argument("--seconds", type=float, default=3.0, help="time per iterator configuration")
    args = ap.parse_args()
    spec = CorpusSpec.coerce(args.corpus)
    print(f"corpus {spec}, vocab {args.vocab_size}, cpus {os.cpu_count()}")

    t0 = time.perf_counter()
    stats = ReadStats()
    docs = list(iter_documents(spec, "train", stats=stats))
    dt = time.perf_counter() - t0
    print(f"read train split:   {stats.documents} docs, {stats.bytes / 1e6:.1f} MB in {dt:.2f} s "
          f"({stats.bytes / dt / 1e6:.0f} MB/s)")

    t0 = time.perf_counter()
    tok = BPETokenizer.train(iter(docs), args.vocab_size)
    print(f"BPE training:       {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    n_tok = sum(len(x) for x in tok.encode_batch(docs))
    dt = time.perf_counter() - t0
    print(f"encode_batch:       {n_tok} tokens in {dt:.2f} s = {_rate(n_tok, dt)} tokens "
          f"({stats.bytes / dt / 1e6:.1f} MB/s)")

    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or tmp
        t0 = time.perf_counter()
        cache = build_token_cache(spec, cache_dir, tokenizer="bpe", vocab_size=args.vocab_size)
        print(f"token cache:        {time.perf_counter() - t0:.2f} s (build or reuse) -> {cache.directory.name}, "
              + ", ".join(f"{s} {v['tokens']}" for s, v in cache.manifest["splits"].items()))
        train = cache.tokens("train")
        for seq_len, batch, threads in [(256, 8, 1), (256, 8, 2), (256, 64, 2), (1024, 16, 2)]:
            r = bench_iterator(train, seq_len, batch, threads, args.seconds)
            print(f"train iterator T={seq_len:5d} B={batch:3d} threads={threads}: {_rate(r, 1)} tokens")
        val = cache.tokens("validation")
        t0, n = time.perf_counter(), 0
        for _ in range(20):
            for b in eval_batches(val, 256, 8, bos_id=cache.eot_id):
                n += b["inputs"].size
        dt = time.perf_counter() - t0
        print(f"eval batches T=256 B=8: {_rate(n, dt)} tokens")


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
