"""Collective traffic of one training step (loss + gradients) at a real width, from compiled HLO on fake CPU devices.

    python benchmarks/collectives.py [--scale 60m] [--layers 2] [--batch 16] [--variants standard,coupled_euler]

Nothing runs: each program is only lowered from ShapeDtypeStructs and compiled for 8 CPU devices, and the compiled HLO
is parsed with `sharding.collective_ops`. The width, heads, vocabulary and sequence length are the scale's; the layer
count is cut (default 2) to keep compile time short; the per-layer traffic is what matters. For meshes with fsdp > 1
it shows the step traced with and without the mesh in context (`sharding.under_mesh`, which the trainer uses): with
it, each block all-gathers its own weights where it runs (`sharding.gather_weights`) and the residual stream is
pinned to the batch layout; without it XLA's propagation alone decides. Element counts are per device program,
summed over ops; bf16 activations.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from coupled_qk_jax import sharding as shd  # noqa: E402
from coupled_qk_jax.config import ModelConfig, RuntimeConfig  # noqa: E402
from coupled_qk_jax.configs import lm  # noqa: E402
from coupled_qk_jax.model import TransformerLM  # noqa: E402
from coupled_qk_jax.training import steps  # noqa: E402

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2), (2, 1, 4)]
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def step_traffic(cfg: ModelConfig, runtime: RuntimeConfig, shape: tuple[int, int, int], batch: int, seq: int,
                 gather: bool) -> dict:
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, 0, runtime))
    graphdef, state = nnx.split(abstract)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    mesh = shd.make_mesh(dict(zip(shd.MESH_AXES, shape)))
    p_sh = shd.named_shardings(shd.param_specs(abstract, mesh), mesh)
    loss_fn = steps.make_loss_fn(graphdef)
    fn = jax.value_and_grad(lambda p, b: loss_fn(p, b)[0])
    fn = shd.under_mesh(fn, mesh) if gather else fn
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    text = jax.jit(fn, in_shardings=(p_sh, shd.batch_sharding(mesh)), out_shardings=(shd.replicated(mesh), p_sh)) \
        .lower(params, {"inputs": tokens, "targets": tokens}).compile(FAST_COMPILE).as_text()
    out = collections.defaultdict(lambda: [0, 0])
    for kind, n in shd.collective_ops(text):
        out[kind][0] += 1
        out[kind][1] += n
    return dict(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="60m")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--variants", default="standard,coupled_euler")
    p.add_argument("--scan", action="store_true", help="scanned layers (runtime.scan_layers)")
    p.add_argument("--meshes", default=",".join("x".join(map(str, m)) for m in MESHES), help="e.g. 1x8x1,1x4x2")
    args = p.parse_args(argv)
    print(f"scale {args.scale} width, {args.layers} layers, batch {args.batch}; "
          "collective: ops / million elements (per device program)\n")
    print("| variant | mesh | under_mesh | all-gather | all-reduce | all-to-all | other | total M elements |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for variant in args.variants.split(","):
        c = lm.get_config(f"{variant},{args.scale}")
        cfg = dataclasses.replace(ModelConfig.from_dict(c.model.to_dict()), n_layers=args.layers, dtype="bfloat16")
        runtime = dataclasses.replace(RuntimeConfig.from_dict(c.runtime.to_dict()), scan_layers=args.scan)
        seq = int(c.data.seq_len)
        for shape in [tuple(int(n) for n in m.split("x")) for m in args.meshes.split(",")]:
            for gather in ([False, True] if shape[1] > 1 else [False]):
                tr = step_traffic(cfg, runtime, shape, args.batch, seq, gather)
                cell = lambda k: f"{tr[k][0]} / {tr[k][1] / 1e6:.1f}" if k in tr else "0"  # noqa: E731
                other = sum(v[1] for k, v in tr.items() if k not in ("all-gather", "all-reduce", "all-to-all"))
                total = sum(v[1] for v in tr.values()) / 1e6
                print(f"| {variant} | {'×'.join(map(str, shape))} | {'yes' if gather else 'no'} | "
                      f"{cell('all-gather')} | {cell('all-reduce')} | {cell('all-to-all')} | {other / 1e6:.1f} | "
                      f"{total:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    sys.exit(main())
