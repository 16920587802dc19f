"""Throughput of the data-preparation job (python -m coupled_qk_jax.data.prepare) with 1..N worker processes, beside
the floor it is built on: the ``tokenizers`` library's own ``Tokenizer.encode_batch`` on the same text in one process.

    python benchmarks/bench_prepare.py --corpus stdlib --workers 1,2 --out benchmarks/results/prepare_cpu

One BPE (``--vocab_size``, trained once on the train split, or ``--tokenizer PATH``) is used by every measurement, so
the prepare figures time splitting, encoding, shard writing and hashing, not BPE training. The floor encodes every
split's documents in ``--chunk_bytes`` batches with the bare library on one thread (no <|endoftext|>, no writing),
the rate of one prepare worker's encoding alone, so prepare's figures divided by it show what the job itself costs;
N workers can reach at most N times it. Tokens/s counts the written token ids (document separators
included); MB/s counts UTF-8 text bytes read. Each figure is the best of ``--repeats`` runs (the least disturbed by
other work on the machine). OUT.json holds every figure, the exact command, the commit, the CPU count and the load
average before and after; OUT.md the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from coupled_qk_jax.data.corpora import SPLITS, CorpusSpec, iter_documents
from coupled_qk_jax.data.prepare import DEFAULT_CHUNK_BYTES, prepare
from coupled_qk_jax.data.tokenizer import BPETokenizer
from coupled_qk_jax.reporting import code_commit


def floor(tokenizer_path: str, spec: CorpusSpec, chunk_bytes: int) -> dict[str, float]:
    """The bare library's encode_batch over every split's documents, in ``chunk_bytes`` batches, in one process on
    one thread (a prepare worker's setting; the library's default would spread one call over every core)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    tk = Tokenizer.from_file(tokenizer_path)
    batches, buf, size, text_bytes = [], [], 0, 0
    for split in SPLITS:  # read first: the floor times encoding alone
        for d in iter_documents(spec, split):
            buf.append(d)
            size += len(d)
            text_bytes += len(d.encode("utf-8"))
            if size >= chunk_bytes:
                batches.append(buf)
                buf, size = [], 0
    if buf:
        batches.append(buf)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the library at every call
    try:
        t0 = time.perf_counter()
        tokens = sum(len(e.ids) for batch in batches for e in tk.encode_batch(batch))
        seconds = time.perf_counter() - t0
    finally:
        del os.environ["TOKENIZERS_PARALLELISM"]
    return {"seconds": seconds, "tokens": tokens, "text_bytes": text_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="stdlib", help="a corpus spec string (docs/data.md)")
    p.add_argument("--max_bytes", type=int, default=0, help="cap on the text per split (0 = all)")
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--tokenizer", default="", help="a tokenizer.json to use instead of training one")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--shard_tokens", type=int, default=1 << 20)
    p.add_argument("--chunk_bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", required=True, help="output path without suffix (OUT.json, OUT.md)")
    args = p.parse_args()

    load_before = os.getloadavg()
    spec = CorpusSpec.coerce(args.corpus)
    if args.max_bytes:
        spec = CorpusSpec.coerce({**spec.to_dict(), "max_bytes": args.max_bytes})
    rows = []
    with tempfile.TemporaryDirectory() as root:
        tok_path = args.tokenizer
        if not tok_path:
            t0 = time.perf_counter()
            tok = BPETokenizer.train((d for d in iter_documents(spec, "train")), args.vocab_size)
            tok_path = os.path.join(root, "tokenizer.json")
            tok.save(tok_path)
            print(f"trained a {args.vocab_size}-token BPE in {time.perf_counter() - t0:.1f} s", flush=True)
        best = min((floor(tok_path, spec, args.chunk_bytes) for _ in range(args.repeats)), key=lambda r: r["seconds"])
        rows.append({"what": "floor: tokenizers encode_batch, 1 process", "workers": 1, **best})
        for n in (int(x) for x in args.workers.split(",")):
            runs = []
            for rep in range(args.repeats):
                out = os.path.join(root, f"w{n}_{rep}")
                t0 = time.perf_counter()
                manifest = prepare(spec, out, tokenizer=tok_path, workers=n, shard_tokens=args.shard_tokens,
                                   chunk_bytes=args.chunk_bytes)
                runs.append({"seconds": time.perf_counter() - t0, "tokens": manifest["totals"]["tokens"],
                             "text_bytes": manifest["totals"]["bytes"]})
            rows.append({"what": f"prepare --workers={n}", "workers": n,
                         **min(runs, key=lambda r: r["seconds"])})
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["mb_per_s"] = r["text_bytes"] / 1e6 / r["seconds"]
        print(f"{r['what']}: {r['tokens_per_s']:,.0f} tokens/s, {r['mb_per_s']:.1f} MB/s ({r['seconds']:.2f} s)",
              flush=True)
    import tokenizers  # noqa: PLC0415

    result = {"command": "python benchmarks/bench_prepare.py " + " ".join(sys.argv[1:]), "commit": code_commit(),
              "corpus": str(spec), "max_bytes": args.max_bytes, "vocab_size": args.vocab_size,
              "chunk_bytes": args.chunk_bytes, "shard_tokens": args.shard_tokens, "repeats": args.repeats,
              "cpus": os.cpu_count(), "tokenizers": tokenizers.__version__, "load_before": load_before,
              "load_after": os.getloadavg(), "rows": rows}
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Data preparation throughput ({spec})", "",
             f"`{result['command']}` at {result['commit']}; {result['cpus']} CPUs, tokenizers "
             f"{result['tokenizers']}; load average before {load_before[0]:.1f}, after "
             f"{result['load_after'][0]:.1f}. Best of {args.repeats} runs each.", "",
             "| what | tokens/s | MB/s of text | seconds | tokens |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['tokens_per_s']:,.0f} | {r['mb_per_s']:.1f} | {r['seconds']:.2f} | "
              f"{r['tokens']:,} |" for r in rows]
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
