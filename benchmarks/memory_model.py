"""Memory and throughput on paper for the 60m / 150m / 350m scales, from the real configs and the real sharding rules.

    python benchmarks/memory_model.py [--variant coupled_euler] [--dtype bf16] [--scales 60m,150m,350m]
    python benchmarks/memory_model.py --xla [--scales 350m] [--dtype fp32]    # the model against XLA's figure

Nothing is run on an accelerator: parameter counts come from `abstract_param_count` / `nnx.eval_shape` (no memory
is allocated), per-device state sizes from applying `sharding.logical_to_spec` (the rules the trainer uses) to every
parameter on each mesh shape, and everything else from the formulas below. docs/scaling.md reproduces the output.

Train state (fp32 everywhere; sharded like the parameters, so over fsdp × tensor where a dim divides):
    parameters 4N, gradients 4N, AdamW moments 2 × 4N          -> 16N bytes in total

Activations: what the code saves for the backward pass, counted residual by residual from its structure
(`layer_residuals`; tests/test_memory_model.py checks the count against `jax.ad_checkpoint.print_saved_residuals` of
a scanned model, term by term in total). Per layer and sequence of T tokens, b = bytes of the compute dtype, d =
d_model, a = heads, ff = d_ff; "/t" = split over the tensor axis:
    each of the two RMSNorms: its input in fp32 (4d), the normalised value (4d), its output (b·d), 2 fp32 row
        statistics; plus its broadcast scale (4d, once per layer)
    attention, explicit causal query blocks (the CPU path; n blocks, block i = queries [lo_i, hi_i) against keys
        [0, hi_i)): each block's query slice (together b·d), its key and value *prefixes* (Σ hi_i / T = (n+1)/2
        copies of K and of V), the fp32 exponentials of its scores (4 bytes per score element, Σ (hi_i−lo_i)·hi_i
        per head, i.e. (n+1)/(2n)·T² instead of T²) and in bf16 their cast to bf16 (2 more), two fp32 row scalars
        (1/Σ and its derivative), the un-normalised fp32 output (4d), then the per-head output before W_O (b·d);
        all /t. The causal mask's residuals are the same in every layer: the layer scan keeps them once.
    attention, fused kernel (Pallas flash / cuDNN, accelerators): q, k, v, o (4·b·d) and two fp32 statistics per
        head and token (the Pallas kernel's l, m); /t
    coupled dynamics, reversible backward (the default): the integrator's inputs q_0, k_0 (2·b·d; leapfrog also
        keeps q_n, k_n for its drift check: 4·b·d); autodiff backward, per step and f evaluation, f's hidden
        activations (4 per hidden unit) and its in/out states (fp32-counted, verified in fp32 only); /t
    MLP: the pre-activation, the tanh-GELU's intermediates (four; three from jax 0.11, whose tanh derivative saves
        1 − tanh² as one tensor, not tanh and 1 − tanh) and its output (6·b·ff; 5·b·ff from jax 0.11); /t
    weights: in bf16 the compute-dtype cast of every block weight (2 bytes per parameter, once per layer; after
        the FSDP gather, so *not* split over fsdp); in fp32 the weights are the step's own arguments
    -> 24m fp32: ~221 kB per token and layer (Korthikanti et al.'s 34·d + 5·a·s bytes, which assumes one softmax
       copy, two MLP tensors and no block prefixes, gives about half of that)
The head adds the final norm, the fp32 exponentials of the logits (optax's cross-entropy, 4V bytes per token) and,
at the peak of the backward pass, the logits' cotangent (4V). With full remat (runtime.remat=full) each layer keeps
only its input (b·d) and one layer's residuals live while it is recomputed. `--xla` adds the rest of XLA's figure:
the gradients (4N, sharded like the parameters) and under fsdp the gathered embedding and its full-size gradient.

Model FLOPs per token: 6N + 12·L·s·d (Kaplan/PaLM-style; N includes the tied embedding, which is the head matmul);
tokens/s = MFU × peak / FLOPs-per-token, at an assumed 40% MFU on bf16 peaks of 197 TFLOP/s (TPU v5e) and
989 TFLOP/s (H100 SXM, dense).

`--xla` checks the memory part against the compiler: it compiles the real train step (sharding.jit_sharded, the
config's global batch, state donated) for 8 fake CPU devices on a data=8 and an fsdp=8 mesh, from ShapeDtypeStructs,
and prints `compiled.memory_analysis()` (arguments + outputs − aliased + temporaries) next to the model's total. It
compiles with LLVM's optimisations off (FAST_COMPILE): buffer assignment is an HLO pass, and the figures are the same
with and without (checked at d_model 256 on both meshes), in a fraction of the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla" in sys.argv:  # before jax starts: the fake CPU devices of the compiled check
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from coupled_qk_jax import sharding as shd  # noqa: E402
from coupled_qk_jax.config import DYNAMICS_METHOD, ModelConfig, RuntimeConfig  # noqa: E402
from coupled_qk_jax.configs import lm  # noqa: E402
from coupled_qk_jax.kernels import auto_chunks  # noqa: E402
from coupled_qk_jax.model import TransformerLM, abstract_param_count  # noqa: E402
from coupled_qk_jax.training.config import TrainConfig  # noqa: E402

# The tanh-GELU's saved intermediates: jax 0.11 changed tanh's derivative to save 1 − tanh² (one tensor) where
# earlier versions saved tanh and 1 − tanh (tests/test_memory_model.py checks the count on the installed jax).
GELU_SAVED = 3 if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11) else 4

GIB = 2 ** 30
MESHES = {8: [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)], 32: [(4, 8, 1), (2, 8, 2)], 64: [(8, 8, 1), (4, 8, 2)]}
PEAKS = {"TPU v5e": 197e12, "H100": 989e12}
MFU = 0.4


def model_config(scale: str, variant: str) -> tuple[ModelConfig, RuntimeConfig, int, int]:
    cfg = lm.get_config(f"{variant},{scale}")
    return (ModelConfig.from_dict(cfg.model.to_dict()), RuntimeConfig.from_dict(cfg.runtime.to_dict()),
            int(cfg.data.seq_len), int(cfg.train.batch_size))


def sharded_state_bytes(cfg: ModelConfig, mesh_shape: tuple[int, int, int],
                        runtime: RuntimeConfig = RuntimeConfig()) -> float:
    """Bytes of (params + grads + AdamW moments) on one device: 16 bytes per locally held parameter element."""
    mesh = types.SimpleNamespace(shape=dict(zip(shd.MESH_AXES, mesh_shape)))  # logical_to_spec reads only .shape
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, 0, runtime))
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


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _query_blocks(runtime: RuntimeConfig, seq: int) -> list[tuple[int, int]]:
    """The explicit kernel's causal query blocks [lo, hi) (attention._explicit_attention's bounds)."""
    n = max(1, min(runtime.attention_chunks or auto_chunks(seq), seq))
    bounds = [seq * i // n for i in range(n + 1)]
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def saved_policy(runtime: RuntimeConfig) -> str:
    """Which residuals a layer keeps (model.py): "dots" (the weight matmuls' outputs) for remat=dots and for the
    scanned layers' remat=none (TransformerLM._through_layers), "everything" for the Python loop's remat=none, "input"
    for remat=full / nothing_saveable."""
    if runtime.remat in ("full", "nothing_saveable"):
        return "input"
    return "dots" if runtime.remat == "dots" or runtime.scan_layers else "everything"


def layer_residuals(cfg: ModelConfig, runtime: RuntimeConfig, seq: int, bytes_per: int, tensor: int = 1,
                    kernel: str = "explicit", policy: str = "everything") -> tuple[dict[str, float], dict[str, float]]:
    """What one block saves for its backward pass on one device, as (bytes per sequence, bytes per layer) by name.

    Counted from the code (see the module docstring); RMSNorm, softmax scoring. `policy`: "everything" (every
    residual autodiff needs) or "dots" (the outputs of the weight matmuls, and the block input; the rest is
    recomputed in the backward pass). `kernel` ("everything" only): "explicit" (the CPU path, which `--xla`
    compiles) or "fused" (Pallas flash / cuDNN). Tensor-split terms are divided by `tensor`; the per-layer terms are
    the bf16 weight casts and the norms' broadcast scales.
    """
    if cfg.scoring != "softmax" or cfg.norm != "rmsnorm":
        raise ValueError(f"memory_model counts softmax scoring with RMSNorm; got scoring={cfg.scoring!r}, "
                         f"norm={cfg.norm!r}")
    d, a, ff, t, b = cfg.d_model, cfg.n_heads, cfg.d_ff, seq, bytes_per
    method = DYNAMICS_METHOD.get(cfg.qk_transform)
    if policy == "dots":  # x, the attention output (W_O's), and q, k, v, the MLP's first matmul, f's two matmuls
        evals = 0
        if method is not None and runtime.dynamics_backward == "autodiff":
            evals = {"euler": cfg.n_steps, "leapfrog": cfg.n_steps + 1, "uncoupled": 2 * cfg.n_steps}[method]
        split = b * t * (3 * d + ff + evals * (a * cfg.coupling_hidden + d))
        return {"block input, attention output": 2 * b * t * d, "q, k, v, MLP hidden, f": split / tensor}, {}
    if policy != "everything":
        raise ValueError(f"policy must be 'everything' or 'dots', got {policy!r}")
    seqs: dict[str, float] = {"norms": 2 * t * ((8 + b) * d + 8)}
    split: dict[str, float] = {}
    if kernel == "explicit":
        blocks = _query_blocks(runtime, seq)
        scores = a * sum((hi - lo) * hi for lo, hi in blocks)  # score elements per sequence
        prefix = sum(hi for _, hi in blocks) * d  # key (and value) prefix elements per sequence
        split["attention q blocks, K and V prefixes"] = b * (t * d + 2 * prefix)
        split["attention exp(scores)"] = (4 + (b if b != 4 else 0)) * scores
        split["attention row scalars, output"] = 8 * a * t + 4 * t * d + b * t * d
    elif kernel == "fused":
        split["attention q, k, v, o, statistics"] = 4 * b * t * d + 8 * a * t
    else:
        raise ValueError(f"kernel must be 'explicit' or 'fused', got {kernel!r}")
    if method is not None:
        n, ah = cfg.n_steps, a * cfg.coupling_hidden
        if runtime.dynamics_backward == "reversible":
            split["dynamics"] = b * t * (4 if method == "leapfrog" else 2) * d
        else:  # per step (and f evaluation) of the plain scan, verified in fp32
            per = {"euler": (2 * d, n * (4 * ah + 3 * d)), "leapfrog": (2 * d + 4 * ah, n * (4 * ah + 3 * d)),
                   "uncoupled": (2 * d, n * (8 * ah + 4 * d))}[method]
            split["dynamics"] = b * t * sum(per)
    split["MLP"] = (2 + GELU_SAVED) * b * t * ff
    seqs.update({k: v / tensor for k, v in split.items()})
    layer = {"norm scales": 2 * 4 * d}
    if method is not None:
        copies = 1 if runtime.dynamics_backward == "reversible" else 3 if method == "leapfrog" else 2  # Δt, Δt/2 [H, 1]
        layer["dt"] = 4 * a * copies
    if b != 4:  # the compute-dtype casts of the block's weights (fp32: the weights themselves, already arguments)
        weights = 4 * d * d + 2 * d * ff
        if cfg.qk_transform in DYNAMICS_METHOD:
            weights += 2 * cfg.head_dim * cfg.coupling_hidden * (a if cfg.per_head_params else 1)
        layer["weight casts"] = b * weights / tensor
    return seqs, layer


def activation_bytes(cfg: ModelConfig, runtime: RuntimeConfig, seq: int, sequences: float, bytes_per: int,
                     tensor: int = 1, kernel: str = "explicit", cpu_upcast: bool = False) -> float:
    """Bytes of activations on one device holding `sequences` sequences at the peak (the start of the backward pass),
    for the policy model.py runs (`saved_policy`): every layer's residuals, plus the larger of the head's residuals
    with the logits' cotangent and, where the backward pass recomputes a layer ("dots", "input"), that one layer's
    full residuals.

    cpu_upcast: XLA:CPU computes bf16 in float32, so for the backward pass it converts the layer-stacked bf16
    residuals to float32 copies, hoisted out of the layer loop (`wrapped_convert` buffers of shape [L, ...] in the
    buffer assignment); each replaces its bf16 stack, so a residual's 2 bytes become 4. TPUs and GPUs compute in bf16
    and make no such copies."""
    policy = saved_policy(runtime)

    def layer_bytes(b: int, pol: str) -> float:
        if pol == "input":
            return sequences * seq * b * cfg.d_model
        per_seq, per_layer = layer_residuals(cfg, runtime, seq, b, tensor, kernel, pol)
        return sequences * sum(per_seq.values()) + sum(per_layer.values())

    saved = layer_bytes(bytes_per, policy)
    if cpu_upcast and bytes_per != 4:  # every term is linear in b: the compute-dtype part is f(b) - f(0)
        saved += (4 - bytes_per) / bytes_per * (saved - layer_bytes(0, policy))
    # The head's residuals and the logits' cotangent die before the layers' backward pass starts, and the one
    # layer being recomputed lives only inside it: the peak holds the larger of the two.
    recomputed = layer_bytes(bytes_per, "everything") if policy != "everything" else 0.0
    head = sequences * seq * ((8 + bytes_per) * cfg.d_model + 8 + 2 * 4 * cfg.vocab_size / tensor)
    return cfg.n_layers * saved + max(recomputed, head)


def flops_per_token(cfg: ModelConfig, n_params: int, seq: int) -> float:
    return 6.0 * n_params + 12.0 * cfg.n_layers * seq * cfg.d_model


def embedding_extra_bytes(cfg: ModelConfig, mesh_shape: tuple[int, int, int], bytes_per: int) -> float:
    """The embedding tables' copies beyond the state: under fsdp the gathered (fp32) tables, kept from the lookup to
    the tied head's backward, and their gradient, all-reduced at full size before it is sliced to the shard; in bf16
    the head's compute-dtype cast. Split over tensor (vocab)."""
    _, fsdp, tensor = mesh_shape
    elements = (cfg.vocab_size + (cfg.max_len if cfg.positions == "learned" else 0)) * cfg.d_model / tensor
    return elements * ((8 if fsdp > 1 else 0) + (bytes_per if bytes_per != 4 else 0))


def report(variant: str, scales: list[str], bytes_per: int, kernel: str = "fused") -> str:
    lines = [f"variant {variant}, activations at {bytes_per} bytes/element ({kernel} attention kernel), state fp32 "
             "(16 bytes/param)", ""]
    lines += ["| scale | N (standard) | N (variant) | params | grads | AdamW | activations/token | "
              "activations/token (remat) | FLOPs/token | tok/s/device v5e @40% | tok/s/device H100 @40% |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    per_mesh = []
    for scale in scales:
        cfg, runtime, seq, batch = model_config(scale, variant)
        n = abstract_param_count(cfg)
        n_std = abstract_param_count(dataclasses.replace(cfg, variant="standard"))
        cfg = dataclasses.replace(cfg, dtype="bfloat16" if bytes_per == 2 else "float32")
        full = dataclasses.replace(runtime, remat="full")
        act = activation_bytes(cfg, runtime, seq, batch, bytes_per, kernel=kernel) / (batch * seq)
        act_r = activation_bytes(cfg, full, seq, batch, bytes_per, kernel=kernel) / (batch * seq)
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
                sequences = batch / (data * fsdp)
                tokens = sequences * seq
                state = sharded_state_bytes(cfg, shape, runtime) + embedding_extra_bytes(cfg, shape, bytes_per)
                a_full = activation_bytes(cfg, runtime, seq, sequences, bytes_per, tensor, kernel=kernel)
                a_remat = activation_bytes(cfg, full, seq, sequences, bytes_per, tensor, kernel=kernel)
                per_mesh.append(f"| {scale} | {n_dev} | {data}×{fsdp}×{tensor} | {batch}×{seq} | {tokens:,.0f} | "
                                f"{state / GIB:.2f} | {a_full / GIB:.2f} | {(state + a_full) / GIB:.2f} | "
                                f"{a_remat / GIB:.2f} | {(state + a_remat) / GIB:.2f} |")
    lines += ["", "Per device, GiB (mesh data×fsdp×tensor; global batch sequences×length from the config):", "",
              "| scale | devices | mesh | batch | tokens/device | state (+ embedding copies) | activations | total | "
              "activations (remat) "
              "| total (remat) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    return "\n".join(lines + per_mesh)


def xla_memory(cfg: ModelConfig, runtime: RuntimeConfig, mesh_shape: tuple[int, int, int], batch: int, seq: int,
               train_cfg) -> dict:
    """Per-device bytes of the compiled train step on `mesh_shape` (8 fake CPU devices), from memory_analysis()."""
    import jax.numpy as jnp  # noqa: PLC0415

    from coupled_qk_jax.training import optimizer, steps  # noqa: PLC0415

    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, 0, runtime))
    graphdef, params = steps.split_model(abstract)
    tx = optimizer.make_optimizer(params, train_cfg)
    state = jax.eval_shape(lambda p: steps.init_train_state(p, tx), params)
    mesh = shd.make_mesh(dict(zip(shd.MESH_AXES, mesh_shape)))
    shardings = shd.train_state_shardings(abstract, tx, state, mesh)
    train_step = steps.make_train_step(graphdef, tx)
    step = shd.jit_sharded(lambda s, b: train_step(s, b, jax.random.key(0)), mesh, shardings, donate=True)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    m = step.lower(state, {"inputs": tokens, "targets": tokens}).compile(FAST_COMPILE).memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes, "total": total}


def xla_report(variant: str, scales: list[str], bytes_per: int, layers: int = 0) -> str:
    lines = [f"variant {variant}, compute dtype {'bfloat16' if bytes_per == 2 else 'float32'}, compiled for 8 CPU "
             f"devices; GiB per device", "",
             "| scale | mesh | layout | XLA args | XLA temp | XLA total | model state (+ embedding copies) | "
             "model activations | "
             "model total | model / XLA |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for scale in scales:
        cfg, runtime, seq, batch = model_config(scale, variant)
        cfg = dataclasses.replace(cfg, dtype="bfloat16" if bytes_per == 2 else "float32",
                                  n_layers=layers or cfg.n_layers)
        train_cfg = TrainConfig.from_dict(lm.get_config(f"{variant},{scale}").train)
        for shape in ((8, 1, 1), (1, 8, 1)):
            x = xla_memory(cfg, runtime, shape, batch, seq, train_cfg)
            sequences = batch / (shape[0] * shape[1])
            state = sharded_state_bytes(cfg, shape, runtime) + embedding_extra_bytes(cfg, shape, bytes_per)
            act = activation_bytes(cfg, runtime, seq, sequences, bytes_per, shape[2], kernel="explicit",
                                   cpu_upcast=True)
            model = state + act
            lines.append(f"| {scale} | {'×'.join(map(str, shape))} | {'scanned' if runtime.scan_layers else 'loop'} | "
                         f"{x['arguments'] / GIB:.2f} | {x['temp'] / GIB:.2f} | {x['total'] / GIB:.2f} | "
                         f"{state / GIB:.2f} | {act / GIB:.2f} | {model / GIB:.2f} | {model / x['total']:.3f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Memory and throughput on paper (see the module docstring).")
    p.add_argument("--variant", default="coupled_euler")
    p.add_argument("--scales", default="60m,150m,350m")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation dtype")
    p.add_argument("--kernel", choices=("fused", "explicit"), default="fused",
                   help="attention kernel of the on-paper table: fused (Pallas / cuDNN) or explicit (CPU)")
    p.add_argument("--layers", type=int, default=0, help="--xla: override the layer count (quicker checks)")
    p.add_argument("--xla", action="store_true", help="compare with compiled.memory_analysis() on 8 CPU devices")
    args = p.parse_args(argv)
    bytes_per = 2 if args.dtype == "bf16" else 4
    if args.xla:
        print(xla_report(args.variant, args.scales.split(","), bytes_per, args.layers))
        return 0
    print(report(args.variant, args.scales.split(","), bytes_per, args.kernel))
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    sys.exit(main())
