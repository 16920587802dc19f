"""What sharding does to one decode step of `generate.Generator`: per-device compiled memory, collectives, HLO size.

    python benchmarks/generate_sharded.py [--scale 60m] [--variant coupled_euler] [--batch 8]
                                          [--meshes 1,1,1 8,1,1 1,1,8 2,1,4 2,2,2 1,4,2] [--unscanned]
                                          [--out FILE.json]

Nothing is timed and no token is generated: for each (data, fsdp, tensor) mesh the decode step of a Generator on
a model placed on that mesh (1,1,1: one device, the unsharded program) is lowered and compiled for 8 fake CPU
devices, with a KV cache of model.max_len slots given as a ShapeDtypeStruct in the Generator's cache sharding
(no cache is allocated). It reports `compiled.memory_analysis()` per device (arguments = parameters + cache +
inputs, temporaries), the collectives of the compiled HLO (`sharding.collective_counts`; with runtime.scan_layers,
as at 60m, the layer loop's body is one copy in the text, so its collectives count once and run n_layers times:
--unscanned unrolls the layers so that every executed collective is in the text) and the HLO's size. The model has
random weights (shapes are all that matter here). The two compile-time switches change LLVM code generation only,
not buffer assignment or the partitioner's collectives (tests/conftest.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from coupled_qk_jax import sharding as shd  # noqa: E402
from coupled_qk_jax.config import RuntimeConfig
from coupled_qk_jax.configs.lm import get_config  # noqa: E402
from coupled_qk_jax.generate import Generator, Sampling, cache_sharding  # noqa: E402
from coupled_qk_jax.model import TransformerLM, count_params  # noqa: E402
from coupled_qk_jax.training.loop import model_config  # noqa: E402

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
GREEDY = Sampling(temperature=0)
MB = 2 ** 20


def decode_step(model: TransformerLM, shape: tuple[int, int, int], batch: int) -> dict:
    """Compile the Generator's decode step for `batch` rows on a (data, fsdp, tensor) = `shape` mesh."""
    cfg = model.cfg
    cache_shape = (cfg.n_layers, batch, cfg.max_len, cfg.n_heads, cfg.head_dim)
    if shape == (1, 1, 1):
        gen = Generator(model)
        cache_sh = rows = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        mesh = shd.make_mesh(dict(zip(shd.MESH_AXES, shape)), jax.devices()[:int(np.prod(shape))])
        graphdef, state = nnx.split(model)
        placed = jax.device_put(nnx.to_pure_dict(state), shd.named_shardings(shd.param_specs(model, mesh), mesh))
        gen = Generator(nnx.merge(graphdef, placed))
        cache_sh, rows = cache_sharding(cfg, mesh), NamedSharding(mesh, P(shd.BATCH_AXES))
    cache = dict.fromkeys(("k", "v"), jax.ShapeDtypeStruct(cache_shape, jnp.dtype(cfg.dtype), sharding=cache_sh))
    row = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    compiled = gen._decode.lower(gen.state, cache, row, row, 1, jax.random.key(0), GREEDY).compile(FAST_COMPILE)
    mem, text = compiled.memory_analysis(), compiled.as_text()
    return {"mesh": dict(zip(shd.MESH_AXES, shape)), "devices": int(np.prod(shape)),
            "argument_mb": round(mem.argument_size_in_bytes / MB, 2),
            "output_mb": round(mem.output_size_in_bytes / MB, 2),
            "alias_mb": round(mem.alias_size_in_bytes / MB, 2),
            "temp_mb": round(mem.temp_size_in_bytes / MB, 2),
            "collectives": {k: v for k, v in shd.collective_counts(text).items() if v},
            "collective_elements": sum(n for _, n in shd.collective_ops(text)),
            "hlo_lines": text.count("\n"), "hlo_kb": round(len(text) / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="60m")
    p.add_argument("--variant", default="coupled_euler")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--meshes", nargs="+", default=["1,1,1", "8,1,1", "1,1,8", "2,1,4", "2,2,2", "1,4,2"])
    p.add_argument("--unscanned", action="store_true",
                   help="runtime.scan_layers=False: every layer's collectives appear in the HLO text, as executed")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    config = get_config(f"{args.variant},{args.scale}")
    cfg, runtime = model_config(config), RuntimeConfig.from_dict(config.runtime.to_dict())
    if args.unscanned:
        runtime = dataclasses.replace(runtime, scan_layers=False)
    model = TransformerLM(cfg, 0, runtime)
    cache_mb = 2 * cfg.n_layers * args.batch * cfg.max_len * cfg.n_heads * cfg.head_dim \
        * jnp.dtype(cfg.dtype).itemsize / MB
    head = {"scale": args.scale, "variant": args.variant, "batch": args.batch, "cache_slots": cfg.max_len,
            "dtype": cfg.dtype, "scan_layers": runtime.scan_layers, "params": count_params(model),
            "cache_mb": round(cache_mb, 2), "jax": jax.__version__}
    print(json.dumps(head), flush=True)
    rows = []
    for text in args.meshes:
        rows.append(decode_step(model, tuple(int(x) for x in text.split(",")), args.batch))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**head, "decode_step": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process  # noqa: E402

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
