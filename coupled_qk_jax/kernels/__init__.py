"""Attention kernels: one call, `attend(q, k, v, mix)`, for every layer, device and mesh.

    attend          causal softmax attention, optionally with Differential Attention's mix of head pairs
    explicit.py     einsums over causal query blocks (CPU; the reference; attention weights; cached decoding)
    tpu.py          splash attention, Pallas flash where splash cannot take the shapes (Mosaic custom calls)
    gpu.py          cuDNN (bf16, no mix) and the Pallas Triton flash kernel (float32, a mix)

The kernel is chosen here, per lowering platform, and nowhere else. XLA cannot partition a custom call, so under a
mesh (sharding.under_mesh) every fused kernel runs inside `jax.shard_map`: each device attends over its own batch
rows (split over data and fsdp) and its own heads (split over tensor), which needs no communication at all, since
attention mixes neither rows nor heads. A Differential pair's two half-heads always sit on one device, so the mix
is applied inside the same region. Without a mesh (one device) the kernels are called directly.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coupled_qk_jax import sharding
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.kernels import gpu, tpu
from coupled_qk_jax.kernels.explicit import auto_chunks, explicit_attention

Array = jax.Array

IMPLEMENTATIONS = ("explicit", "xla", "cudnn", "pallas")

__all__ = ["IMPLEMENTATIONS", "attend", "auto_chunks", "choose_implementation", "explicit_attention"]


def choose_implementation(requested: str, dtype, head_dim: int, seq_len: int, platform: str | None = None,
                          mix: bool = False) -> str:
    """The kernel `attend` runs. "auto" picks cuDNN on GPU in bf16/fp16 without a mix (head dim a multiple of 8, at
    most 128), else on GPU the Pallas GPU kernel (with a mix or in float32: cuDNN returns only bf16/fp16; T in blocks
    of 64, head dim 16..128), the Pallas TPU kernels on TPU (T a multiple of 128), and the explicit query-block path
    otherwise (CPU). `mix`: the scoring has a mix (Differential Attention). An explicit request is honoured where it
    can run; a cuDNN or Pallas request that cannot falls back to "explicit" with a warning. `platform` defaults to
    `jax.default_backend()`."""
    platform = platform or jax.default_backend()
    cudnn_ok = (platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and not mix
                and head_dim % 8 == 0 and head_dim <= 128)
    pallas_ok = ((platform == "tpu" and tpu.supports(seq_len))
                 or ((platform == "gpu" or gpu.INTERPRET) and gpu.pallas_supports(head_dim, seq_len)))
    if requested in ("xla", "explicit"):
        return requested
    if requested == "auto":
        return "cudnn" if cudnn_ok else "pallas" if pallas_ok else "explicit"
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl must be 'auto' or one of {IMPLEMENTATIONS}, got {requested!r}")
    if not (cudnn_ok if requested == "cudnn" else pallas_ok):
        warnings.warn(f"attention_impl={requested!r} unavailable (platform={platform}, dtype={jnp.dtype(dtype)}, "
                      f"head_dim={head_dim}, seq_len={seq_len}{', with a mix' if mix else ''}); falling back to "
                      "'explicit'", stacklevel=2)
        return "explicit"
    return requested


def attend(q: Array, k: Array, v: Array, mix: Array | None = None, impl: str = "explicit", n_chunks: int = 0,
           return_weights: bool = False, visible: Array | None = None) -> Array | tuple[Array, Array]:
    """Causal softmax attention with an optional linear mix of the heads' attention matrices.

    q, k: [B, T, H, D]; v: [B, T, G, Dv] with G dividing H; returns [B, T, G, Dv]. Scores are scaled by D**-0.5.
    Head h belongs to value group g = h // (H/G), and

        out[:, :, g] = Σ_{h in g} mix[h] · softmax(q_h k_hᵀ / √D + causal mask) · v_g

    With mix=None, G must equal H (plain multi-head attention). Differential attention is mix = [1, −λ, 1, −λ, ...]
    over pairs of half-heads with G = H/2 values of width 2D (specs/diffattn.md). The mix is linear, so it is applied
    to the probabilities before the value product where the probabilities exist (the explicit path: the FLOPs of
    plain attention) and to the per-head outputs where a fused kernel hides them. The output has v's dtype, or
    float32 with a mix: A1 − λ·A2 cancels, and rounding it, its cotangent or the per-head outputs it is made of to
    bf16 before the caller's norm puts λ's gradient off by up to 5× (precision.py). So with a mix the XLA and Pallas
    kernels run on float32 operands and cuDNN (bf16/fp16 only) gives way to the explicit path.

    impl: "auto" (choose_implementation, per lowering platform), "explicit" (einsums in causal query blocks,
    `n_chunks` of them, 0 = auto_chunks), "xla" / "cudnn" (jax.nn.dot_product_attention), or "pallas" (TPU: splash,
    or flash; a program lowered for CUDA: the Triton kernel). return_weights=True (explicit only) also returns the
    mixed attention matrices [B, G, T, T] in fp32: the diagnostics read them from this same kernel.

    visible: bool [B, T, S] replaces the causal mask for cached decoding (explicit only, one block): k and v then
    hold a KV cache of S slots, [B, S, H, D] and [B, S, G, Dv], and query t sees the slots where visible[:, t].
    """
    b, t, h, d = q.shape
    g, dv = v.shape[2:]
    if h % g or (mix is None and g != h):
        raise ValueError(f"attend: value heads G={g} must divide query heads H={h} (and equal H without a mix)")
    if mix is not None and mix.shape != (h,):
        raise ValueError(f"attend: mix must have shape [H]=({h},), got {mix.shape}")
    if (return_weights or visible is not None) and impl != "explicit":
        raise ValueError("attend: return_weights and visible need impl='explicit'")
    if impl == "auto":
        # The kernel for this process's backend, except that a program lowered for TPU takes the Pallas kernels
        # where T allows, and one lowered for CUDA the Pallas GPU kernel where auto picks it there:
        # jax.lax.platform_dependent picks per lowering platform, so a step compiled on the device's host, or
        # compiled or exported for it from any host (aot.py, jax.export), gets it, and XLA drops the branches a
        # platform does not take. cuDNN is left to a GPU host: jax checks the cuDNN version while tracing it.
        here = choose_implementation("auto", q.dtype, d, t, mix=mix is not None)
        chosen = {p: choose_implementation("auto", q.dtype, d, t, platform=p, mix=mix is not None)
                  for p in ("tpu", "gpu")}
        branches = {"tpu": chosen["tpu"], "cuda": chosen["gpu"] if chosen["gpu"] != "cudnn" else here}
        branches = {p: name for p, name in branches.items() if name != here}
        if not branches:
            return attend(q, k, v, mix, here, n_chunks)
        kernel = {name: functools.partial(attend, mix=mix, impl=name, n_chunks=n_chunks)
                  for name in {here, *branches.values()}}
        return jax.lax.platform_dependent(q, k, v, default=kernel[here],
                                          **{p: kernel[name] for p, name in branches.items()})
    if mix is not None and impl == "cudnn":
        impl = "explicit"
    if impl == "explicit":
        return explicit_attention(q, k, v, mix, n_chunks, return_weights, visible)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    # A mix needs each head's output in float32 (see above); the XLA and Pallas kernels return their operands'
    # dtype, so they get float32 operands (exact upcasts of bf16 q, k, v).
    if mix is not None:
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    if dv % d:
        raise ValueError(f"attend: value width {dv} must be a multiple of the head dim {d} for {impl!r}")
    kernel = _kernel(impl, d, t)
    if impl == "xla":  # plain HLO: XLA partitions it by itself
        return _heads(kernel, q, k, v, mix)
    return _per_shard(functools.partial(_heads, kernel), q, k, v, mix)


def _kernel(impl: str, head_dim: int, seq_len: int):
    """The fused kernel [B, T, H, D] -> [B, T, H, D] for `impl`. "pallas" is the GPU kernel in a program lowered for
    CUDA (gpu.INTERPRET: everywhere, interpreted) and the TPU one otherwise (on CPU under
    pltpu.force_tpu_interpret_mode). Each is traced only where T and D suit it (a kernel can refuse its shapes while
    tracing)."""
    if impl == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    if impl == "cudnn":
        return gpu.cudnn_attention
    if gpu.INTERPRET:
        return gpu.pallas_attention
    kernels = {}
    if gpu.pallas_supports(head_dim, seq_len):
        kernels["cuda"] = gpu.pallas_attention
    if tpu.supports(seq_len):
        kernels["default"] = tpu.attention
    if not kernels:
        raise ValueError(f"attend: no Pallas kernel takes T={seq_len}, head dim {head_dim} (choose_implementation)")
    if list(kernels) == ["default"]:
        return tpu.attention
    return lambda q, k, v: jax.lax.platform_dependent(q, k, v, **kernels)


def _heads(kernel, q: Array, k: Array, v: Array, mix: Array | None) -> Array:
    """A fused kernel that takes one value per query head of width D, applied to q, k [B, T, H, D] and v
    [B, T, G, Dv]: each group's value is repeated over its heads, and a value wider than D split into r = Dv/D
    "virtual heads" that repeat q and k (specs/diffattn.md §6, form 2); the mix then sums each group's heads."""
    b, t, h, d = q.shape
    g, dv = v.shape[2:]
    r = dv // d
    vh = jnp.repeat(v, h // g, axis=2).reshape(b, t, h * r, d)
    qh, kh = (jnp.repeat(a, r, axis=2) if r > 1 else a for a in (q, k))
    o = kernel(qh, kh, vh).reshape(b, t, h, dv)
    if mix is None:
        return o
    return (o * mix[:, None]).reshape(b, t, g, h // g, dv).sum(axis=3)


def _per_shard(fn, q: Array, k: Array, v: Array, mix: Array | None) -> Array:
    """`fn(q, k, v, mix)` on each device's rows and heads under the mesh in context (jax.shard_map), or directly
    without one. q, k: [B, T, H, D]; v: [B, T, G, Dv]; mix: [H] or None -> [B, T, G, Dv]."""
    mesh = sharding.context_mesh()
    if mesh is None or math.prod(mesh.shape.values()) == 1:
        return fn(q, k, v, mix)
    b, h, g = q.shape[0], q.shape[2], v.shape[2]
    rows = tuple(a for a in sharding.BATCH_AXES if mesh.shape[a] > 1)
    n_rows = math.prod(mesh.shape[a] for a in rows)
    tensor = mesh.shape["tensor"]
    if b % n_rows:
        raise UserError(f"attention: a batch of {b} rows does not split over mesh.data*mesh.fsdp = {n_rows}; use a "
                        "batch size that the data-parallel devices divide")
    if g % tensor:
        what = (f"Differential Attention's {g} head pairs (a pair's two half-heads must sit on one device)"
                if mix is not None else f"{h} heads")
        raise UserError(f"attention: mesh.tensor={tensor} would split {what}; use a tensor size that divides {g}")
    heads = "tensor" if tensor > 1 else None
    spec = P(rows or None, None, heads, None)
    if mix is None:
        body, args, in_specs = (lambda q, k, v: fn(q, k, v, None)), (q, k, v), (spec, spec, spec)
    else:
        body, args, in_specs = fn, (q, k, v, mix), (spec, spec, spec, P(heads))
    # check_vma off: a Pallas call has no rule for the varying-manual-axes check, and the region is per-device by
    # construction (no collective inside).
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(*args)
