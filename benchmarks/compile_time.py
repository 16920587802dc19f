"""Compile time and program size of the train step against depth, scanned (runtime.scan_layers) and unscanned.

    python benchmarks/compile_time.py [--variant coupled_euler] [--layers 4,24] [--width 1024 --heads 16 --vocab 50304
                                       --seq 1024 --batch 2] [--out benchmarks/results/compile_time.md]

For each (layers, layout) it lowers the whole train step (forward, backward, AdamW; sharding.jit_sharded on one
device, from ShapeDtypeStructs: nothing is allocated) and compiles it for CPU, and records the wall-clock seconds of
tracing + lowering and of compilation, and the size of the optimised HLO (instructions). The headline is the ratio
deep / shallow, per layout, measured in the same process one after another: compile time is wall-clock, so only the
ratio within one run means something, and the machine load (`uptime`) is printed beside it. The defaults are
350m's width, heads, d_ff, vocabulary and context at 4 and 24 layers; `--width 256 --vocab 4096 --seq 256` gives a
reduced shape for a loaded machine (the ratio is about depth, not width).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from coupled_qk_jax import sharding as shd  # noqa: E402
from coupled_qk_jax.config import ModelConfig, RuntimeConfig  # noqa: E402
from coupled_qk_jax.configs import lm  # noqa: E402
from coupled_qk_jax.model import TransformerLM  # noqa: E402
from coupled_qk_jax.training import optimizer, steps  # noqa: E402
from coupled_qk_jax.training.config import TrainConfig  # noqa: E402


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uptime unavailable"


def abstract_step(cfg: ModelConfig, runtime: RuntimeConfig, batch: int, seq: int, train_cfg):
    """(jitted train step, abstract state, abstract batch) on a 1-device mesh."""
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, 0, runtime))
    graphdef, params = steps.split_model(abstract)
    tx = optimizer.make_optimizer(params, train_cfg)
    state = jax.eval_shape(lambda p: steps.init_train_state(p, tx), params)
    mesh = shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    shardings = shd.train_state_shardings(abstract, tx, state, mesh)
    train_step = steps.make_train_step(graphdef, tx)
    step = shd.jit_sharded(lambda s, b: train_step(s, b, jax.random.key(0)), mesh, shardings, donate=True)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return step, state, {"inputs": tokens, "targets": tokens}


def measure(cfg: ModelConfig, runtime: RuntimeConfig, batch: int, seq: int, train_cfg) -> dict:
    t0 = time.perf_counter()
    step, state, tokens = abstract_step(cfg, runtime, batch, seq, train_cfg)
    lowered = step.lower(state, tokens)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    instructions = sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith("//"))
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "hlo_instructions": instructions}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="coupled_euler")
    p.add_argument("--layers", default="4,24", help="shallow,deep")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="", help="also write the table (markdown) here")
    args = p.parse_args(argv)
    base = lm.get_config(f"{args.variant},350m")
    head_dim = args.width // args.heads
    cfg = dataclasses.replace(
        ModelConfig.from_dict(base.model.to_dict()), d_model=args.width, n_heads=args.heads, d_ff=4 * args.width,
        vocab_size=args.vocab, max_len=args.seq, coupling_hidden=3 * head_dim // 4, affine_hidden=3 * head_dim // 4,
        dtype=args.dtype)
    runtime = RuntimeConfig.from_dict(base.runtime.to_dict())
    shallow, deep = (int(x) for x in args.layers.split(","))
    load_before = uptime()
    rows = {}
    for scan in (True, False):
        for layers in (shallow, deep):
            rows[scan, layers] = measure(dataclasses.replace(cfg, n_layers=layers),
                                         dataclasses.replace(runtime, scan_layers=scan), args.batch, args.seq,
                                         TrainConfig.from_dict(base.train))
            print(f"scan={scan} layers={layers}: {rows[scan, layers]}", flush=True)
    load_after = uptime()
    lines = [f"variant {args.variant}, d_model {args.width}, heads {args.heads}, d_ff {4 * args.width}, vocab "
             f"{args.vocab}, T {args.seq}, batch {args.batch}, {args.dtype}; train step (fwd + bwd + AdamW), CPU, "
             f"jax {jax.__version__}", f"load before: {load_before}", f"load after:  {load_after}", "",
             "| layout | layers | trace+lower s | compile s | HLO instructions |", "| --- | --- | --- | --- | --- |"]
    for (scan, layers), r in rows.items():
        lines.append(f"| {'scanned' if scan else 'unscanned'} | {layers} | {r['lower_s']:.2f} | {r['compile_s']:.2f} "
                     f"| {r['hlo_instructions']:,} |")
    lines += ["", f"| layout | compile {deep}/{shallow} | trace+lower {deep}/{shallow} | HLO {deep}/{shallow} |",
              "| --- | --- | --- | --- |"]
    for scan in (True, False):
        a, b = rows[scan, shallow], rows[scan, deep]
        lines.append(f"| {'scanned' if scan else 'unscanned'} | {b['compile_s'] / a['compile_s']:.2f}x | "
                     f"{b['lower_s'] / a['lower_s']:.2f}x | {b['hlo_instructions'] / a['hlo_instructions']:.2f}x |")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    sys.exit(main())
