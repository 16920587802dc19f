"""Memory and throughput on paper for the 60m / 150m / 350m scales, from the real configs and the real sharding rules.

    python benchmarks/memory_model.py [--variant coupled_euler] [--dtype bf16] [--scales 60m,150m,350m]
    python benchmarks/memory_model.py --xla [--scales 350m] [--dtype fp32]    # the model against XLA's figure

Nothing is run on an accelerator: parameter counts come from `abstract_param_count` / `nnx.eval_shape` (no memory
is allocated), per-device state sizes from applying `sharding.logical_to_spec` (the rules the trainer uses) to every
parameter on each mesh shape, and everything else from the formulas below. docs/scaling.md reproduces the output.

Train state (fp32 everywhere; sharded like the parameters, so over fsdp × tensor where a dim divides):
    parameters 4N, gradients 4N, AdamW moments 2 × 4N          -> 16N bytes in total

Activations saved for the backward pass, bytes per token per layer (Korthikanti et al. 2022, "Reducing Activation
Recomputation", §4.1, adapted; b = bytes per activation element, d = d_model, a = heads, s = sequence length):
    Korthikanti (with dropout):        34·d + 5·a·s          at b = 2
    this model (dropout 0, so no masks and no dropout outputs):
        replicated across tensor:  norm inputs 2d, attention input d, MLP input d           =  4d   elements
        split over tensor:          q, k, v 3d, attention output d, MLP hidden 2·d_ff,
                                    softmax probabilities a·s                                 = 4d + 2·d_ff + a·s
        coupled dynamics extra:     per step and per f evaluation, f's hidden pre-activation and output
                                    (2·a·hidden) plus the evolved q, k (2d)  [euler: 1 eval, leapfrog: 2, mlp_only: 2]
    -> per layer  b · (4d + (4d + 2·d_ff + a·s + coupled)/t)         (t = tensor size; 34d-equivalent at d_ff = 4d)
    With full remat (model.remat=full) only each block's input (b·d) is kept, plus one layer's activations while it is
    recomputed. The head adds fp32 logits and their softmax, 8·V bytes per token (not split; V is vocab).

Model FLOPs per token: 6N + 12·L·s·d (Kaplan/PaLM-style; N includes the tied embedding, which is the head matmul);
tokens/s = MFU × peak / FLOPs-per-token, at an assumed 40% MFU on bf16 peaks of 197 TFLOP/s (TPU v5e) and
989 TFLOP/s (H100 SXM, dense).

`--xla` checks the memory part against the compiler: it compiles the real train step (sharding.jit_train_step, the
config's global batch, state donated) for 8 fake CPU devices on a data=8 and an fsdp=8 mesh, from ShapeDtypeStructs,
and prints `compiled.memory_analysis()` (arguments + outputs − aliased + temporaries) next to the model's total.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla" in sys.argv:  # before jax starts: the fake CPU devices of the compiled check
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import lm  # noqa: E402
from coupled_qk_jax import sharding as shd  # noqa: E402
from coupled_qk_jax.config import DYNAMICS_METHOD, ModelConfig  # noqa: E402
from coupled_qk_jax.model import TransformerLM, abstract_param_count  # noqa: E402

GIB = 2 ** 30
MESHES = {8: [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)], 32: [(4, 8, 1), (2, 8, 2)], 64: [(8, 8, 1), (4, 8, 2)]}
PEAKS = {"TPU v5e": 197e12, "H100": 989e12}
MFU = 0.4
F_EVALS = {"euler": 1, "leapfrog": 2, "uncoupled": 2}


def model_config(scale: str, variant: str) -> tuple[ModelConfig, int, int]:
    cfg = lm.get_config(f"{variant},{scale}")
    return ModelConfig.from_dict(cfg.model.to_dict()), int(cfg.data.seq_len), int(cfg.train.batch_size)


def sharded_state_bytes(cfg: ModelConfig, mesh_shape: tuple[int, int, int]) -> float:
    """Bytes of (params + grads + AdamW moments) on one device: 16 bytes per locally held parameter element."""
    mesh = types.SimpleNamespace(shape=dict(zip(shd.MESH_AXES, mesh_shape)))  # logical_to_spec reads only .shape
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, 0))
    total = 0
    for var in jax.tree.leaves(nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * value.ndim
        spec = shd.logical_to_spec(tuple(axes), value.shape, mesh)
        local = 1
        for dim, entry in zip(value.shape, tuple(spec) + (None,) * (value.ndim - len(spec))):
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            local *= dim // int(np.prod([mesh.shape[n] for n in names] or [1]))
        total += local
    return 16.0 * total


def activation_bytes_per_token(cfg: ModelConfig, seq: int, bytes_per: int, tensor: int = 1,
                               remat: bool = False) -> float:
    """Saved activations per token for the whole model (see the module docstring for the formula)."""
    d, a, ff, layers = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_layers
    coupled = 0.0
    if cfg.qk_transform in DYNAMICS_METHOD:
        evals = F_EVALS[DYNAMICS_METHOD[cfg.qk_transform]]
        coupled = cfg.n_steps * (evals * 2 * a * cfg.coupling_hidden + 2 * d)
    per_layer = bytes_per * (4 * d + (4 * d + 2 * ff + a * seq + coupled) / tensor)
    head = 8.0 * cfg.vocab_size
    if remat:
        return layers * bytes_per * d + per_layer + head
    return layers * per_layer + head


def flops_per_token(cfg: ModelConfig, n_params: int, seq: int) -> float:
    return 6.0 * n_params + 12.0 * cfg.n_layers * seq * cfg.d_model


def report(variant: str, scales: list[str], bytes_per: int) -> str:
    lines = [f"variant {variant}, activations at {bytes_per} bytes/element, state fp32 (16 bytes/param)", ""]
    lines += ["| scale | N (standard) | N (variant) | params | grads | AdamW | activations/token | "
              "activations/token (remat) | FLOPs/token | tok/s/device v5e @40% | tok/s/device H100 @40% |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    per_mesh = []
    for scale in scales:
        cfg, seq, batch = model_config(scale, variant)
        n = abstract_param_count(cfg)
        n_std = abstract_param_count(dataclasses.replace(cfg, variant="standard"))
        act = activation_bytes_per_token(cfg, seq, bytes_per)
        act_r = activation_bytes_per_token(cfg, seq, bytes_per, remat=True)
        fl = flops_per_token(cfg, n, seq)
        tps = [MFU * peak / fl for peak in PEAKS.values()]
        lines.append(f"| {scale} | {n_std:,} | {n:,} | {4 * n / GIB:.2f} GiB | {4 * n / GIB:.2f} GiB | "
                     f"{8 * n / GIB:.2f} GiB | {act / 2**20:.2f} MiB | {act_r / 2**20:.2f} MiB | {fl / 1e9:.2f} G | "
                     f"{tps[0]:,.0f} | {tps[1]:,.0f} |")
        for n_dev, shapes in MESHES.items():
            for shape in shapes:
                data, fsdp, tensor = shape
                if batch % (data * fsdp):
                    continue
                tokens = batch * seq / (data * fsdp)
                state = sharded_state_bytes(cfg, shape)
                a_full = tokens * activation_bytes_per_token(cfg, seq, bytes_per, tensor)
                a_remat = tokens * activation_bytes_per_token(cfg, seq, bytes_per, tensor, remat=True)
                per_mesh.append(f"| {scale} | {n_dev} | {data}×{fsdp}×{tensor} | {batch}×{seq} | {tokens:,.0f} | "
                                f"{state / GIB:.2f} | {a_full / GIB:.2f} | {(state + a_full) / GIB:.2f} | "
                                f"{a_remat / GIB:.2f} | {(state + a_remat) / GIB:.2f} |")
    lines += ["", "Per device, GiB (mesh data×fsdp×tensor; global batch sequences×length from the config):", "",
              "| scale | devices | mesh | batch | tokens/device | state | activations | total | activations (remat) "
              "| total (remat) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    return "\n".join(lines + per_mesh)


def xla_memory(cfg: ModelConfig, mesh_shape: tuple[int, int, int], batch: int, seq: int, train_cfg) -> dict:
    """Per-device bytes of the compiled train step on `mesh_shape` (8 fake CPU devices), from memory_analysis()."""
    import jax.numpy as jnp  # noqa: PLC0415

    from coupled_qk_jax.training import optimizer, steps  # noqa: PLC0415

    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, 0))
    graphdef, params = steps.split_model(abstract)
    tx = optimizer.make_optimizer(params, train_cfg)
    state = jax.eval_shape(lambda p: steps.init_train_state(p, tx), params)
    mesh = shd.make_mesh(dict(zip(shd.MESH_AXES, mesh_shape)))
    shardings = shd.train_state_shardings(abstract, tx, state, mesh)
    step = shd.jit_train_step(steps.make_train_step(graphdef, tx), shardings, mesh)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    m = step.lower(state, {"inputs": tokens, "targets": tokens}, key).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes, "total": total}


def xla_report(variant: str, scales: list[str], bytes_per: int) -> str:
    lines = [f"variant {variant}, compute dtype {'bfloat16' if bytes_per == 2 else 'float32'}, compiled for 8 CPU "
             f"devices; GiB per device", "",
             "| scale | mesh | layout | XLA args | XLA temp | XLA total | model state | model activations | "
             "model total | model / XLA |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for scale in scales:
        cfg, seq, batch = model_config(scale, variant)
        cfg = dataclasses.replace(cfg, dtype="bfloat16" if bytes_per == 2 else "float32")
        train_cfg = lm.get_config(f"{variant},{scale}").train
        for shape in ((8, 1, 1), (1, 8, 1)):
            x = xla_memory(cfg, shape, batch, seq, train_cfg)
            tokens = batch * seq / (shape[0] * shape[1])
            state = sharded_state_bytes(cfg, shape)
            act = tokens * activation_bytes_per_token(cfg, seq, bytes_per, shape[2])
            model = state + act
            lines.append(f"| {scale} | {'×'.join(map(str, shape))} | {'scanned' if cfg.scan_layers else 'loop'} | "
                         f"{x['arguments'] / GIB:.2f} | {x['temp'] / GIB:.2f} | {x['total'] / GIB:.2f} | "
                         f"{state / GIB:.2f} | {act / GIB:.2f} | {model / GIB:.2f} | {model / x['total']:.3f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Memory and throughput on paper (see the module docstring).")
    p.add_argument("--variant", default="coupled_euler")
    p.add_argument("--scales", default="60m,150m,350m")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation dtype")
    p.add_argument("--xla", action="store_true", help="compare with compiled.memory_analysis() on 8 CPU devices")
    args = p.parse_args(argv)
    bytes_per = 2 if args.dtype == "bf16" else 4
    if args.xla:
        print(xla_report(args.variant, args.scales.split(","), bytes_per))
        return 0
    print(report(args.variant, args.scales.split(","), bytes_per))
    return 0


if __name__ == "__main__":
    sys.exit(main())
