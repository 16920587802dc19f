"""Host time of one training log line at 350m: building the metrics.jsonl row (with every layer's and head's Δt)
and handing it to the writer (metrics.jsonl and TensorBoard), on process 0, while the devices wait for the next step.

    python benchmarks/bench_log_row.py [--scale 350m] [--variant coupled_euler] [--lines 200] [--json OUT]

Prints the median and 90th percentile of the loop-side seconds per log line (``loop._log_row`` then
``MetricsWriter.write``; the writer's close, which waits for everything to be on disk, is timed apart), the number of
keys per line, and the per-step share at ``train.log_every``. Nothing is compiled: the metrics are the host copies
the loop would have after its sync (float32 scalars, Δt [L, H]). Compare two versions by running this file from each
checkout in alternation (farm-bench), as the figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import types

import numpy as np

from coupled_qk_jax.configs import lm
from coupled_qk_jax.training import loop
from coupled_qk_jax.training.config import RunConfig
from coupled_qk_jax.training.loop_parts import LossWindow, ThroughputMeter
from coupled_qk_jax.training.writers import MetricsWriter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="350m")
    ap.add_argument("--variant", default="coupled_euler")
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    run = RunConfig.from_configdict(lm.get_config(f"{args.variant},{args.scale}"))
    mcfg = loop.model_config(lm.get_config(f"{args.variant},{args.scale}"))
    # What _log_row reads of the loop's Setup.
    setup = types.SimpleNamespace(config=run, seeds=[0], n_params=355_000_000, mcfg=mcfg)
    rng = np.random.default_rng(0)
    last = {"loss": np.float32(3.0), "grad_norm": np.float32(1.0), "param_norm": np.float32(100.0),
            "lr": np.float32(3e-4), "dt": rng.uniform(0.05, 0.2, (mcfg.n_layers, mcfg.n_heads)).astype(np.float32)}
    times = []
    with tempfile.TemporaryDirectory() as workdir:
        writer = MetricsWriter(workdir, seeds=[0])
        meter = ThroughputMeter(0.0, time.perf_counter())
        meter.step_done(time.perf_counter())
        keys = 0
        for i in range(args.lines):
            window = LossWindow.empty(1)
            for _ in range(run.train.log_every):
                window.add(last["loss"])
            step = (i + 1) * run.train.log_every
            t0 = time.perf_counter()
            row = loop._log_row(setup, step, window, last, meter, time.perf_counter())
            writer.write(step, row)
            times.append(time.perf_counter() - t0)
            keys = len(row) + 1
        t0 = time.perf_counter()
        writer.close()
        close_s = time.perf_counter() - t0
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            lines = sum(1 for _ in f)
    assert lines == args.lines, (lines, args.lines)
    t = np.asarray(times)
    result = {"scale": args.scale, "variant": args.variant, "keys_per_line": keys, "lines": args.lines,
              "median_ms": float(np.median(t) * 1e3), "p90_ms": float(np.percentile(t, 90) * 1e3),
              "log_every": run.train.log_every,
              "per_step_ms": float(np.median(t) * 1e3 / run.train.log_every), "close_ms": close_s * 1e3,
              "load_avg": os.getloadavg()[0]}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
