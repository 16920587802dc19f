"""Causal multi-head attention with a pluggable QK transform and scoring rule (Flax NNX).

    x --W_Q,W_K,W_V--> q, k, v  [B, T, H, d_head]
    (q, k) <- QK transform      none | coupled dynamics (dynamics.py) | affine coupling (invertible.py)
    (q, k) <- RoPE              only with positions="rope": the transform runs *before* the rotation
    o      <- causal_attention  softmax, or differential (specs/diffattn.md) as the mix A1 − λ·A2 of half-heads;
                                kernel: cuDNN (GPU, bf16) | Pallas flash (TPU; GPU with a mix or in float32) |
                                explicit causal query blocks (CPU)
    y      =  o W_O

With differential scoring the H = n_heads projections are read as H/2 differential heads, each made of two
half-heads (q1, k1), (q2, k2) of the baseline head dim and a value of twice that width; the QK transform then runs
on the H half-heads, so a coupled+differential layer has exactly the coupled layer's parameters plus DiffAttn's
λ vectors and head-norm scale.

Parameters carry logical axis names (metadata `logical_axes`) that `sharding.py` maps to mesh axes. Precision follows
precision.py: softmax, λ, norms and biases in float32, matmuls in the compute dtype.
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from coupled_qk_jax import dynamics, invertible
from coupled_qk_jax.config import DYNAMICS_METHOD, ModelConfig

Array = jax.Array


# ----------------------------------------------------------------------------------------------------- init helpers
def named_key(key: Array, path: str) -> Array:
    """An init key derived from a parameter's path, so that variants which share a weight draw it identically."""
    return jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def normal_param(key: Array, path: str, shape: tuple[int, ...], std: float, axes: tuple) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(named_key(key, path), shape, jnp.float32), logical_axes=axes)


def const_param(shape: tuple[int, ...], value: float, axes: tuple) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, jnp.float32), logical_axes=axes)


def lambda_init(depth: int | Array) -> Array:
    """DiffAttn's λ_init for a 0-based layer index: 0.8 − 0.6·exp(−0.3·depth), fp32. `depth` may be traced (the
    layer index of a scanned stack of layers, model.scan_layers)."""
    return 0.8 - 0.6 * jnp.exp(-0.3 * jnp.asarray(depth, jnp.float32))


# ----------------------------------------------------------------------------------------------- shared functions
def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm over the last axis with fp32 statistics."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def apply_rope(x: Array, base: float, positions: Array | None = None) -> Array:
    """Rotary position embedding (rotate-half form) on [B, T, H, d], at positions 0..T-1 or at the absolute
    `positions` [B, T] (cached decoding)."""
    t, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    pos = jnp.arange(t, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)  # [T] or [B, T]
    angles = (pos[..., None] * inv_freq)[..., None, :]  # [T, 1, d/2] or [B, T, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


# -------------------------------------------------------------------------------------------- the attention kernel
IMPLEMENTATIONS = ("explicit", "xla", "cudnn", "pallas")
PALLAS_BLOCK = 128  # the Pallas TPU flash kernel's default block: T must be a multiple of it
# The Pallas GPU (Triton) kernel's query and key block here, half its default 128: with a mix it runs on float32
# tiles, twice the bytes of bf16 ones. T must be a multiple of it, or a power of two below it (one block).
PALLAS_GPU_BLOCK = 64
# Run impl="pallas" as the Pallas GPU kernel in Pallas' interpreter on any backend (where its shapes allow, a
# "pallas" request is then honoured there): how the GPU path is tested on CPU (tests/test_attention.py). Read while
# tracing, so set it before a function is first traced.
PALLAS_GPU_INTERPRET = False


def pallas_gpu_attention_module():
    """jax.experimental.pallas.ops.gpu.attention, or None where this jax has none. jax 0.11 deprecated it (with the
    Pallas Triton backend; tokamax.dot_product_attention is its successor), so its DeprecationWarning is silenced
    here and a jax that has removed it makes choose_implementation fall back."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as pallas_gpu  # noqa: PLC0415
    except ImportError:
        return None
    return pallas_gpu


def _pallas_gpu_ok(head_dim: int, seq_len: int) -> bool:
    """Shapes the Pallas GPU kernel takes: T in whole blocks (or one power-of-two block of at least 16), and a head
    dim of 16..128 (Triton's dots need 16; the float32 tiles of wider heads outgrow shared memory)."""
    one_block = 16 <= seq_len < PALLAS_GPU_BLOCK and seq_len & (seq_len - 1) == 0
    return ((seq_len % PALLAS_GPU_BLOCK == 0 or one_block) and 16 <= head_dim <= 128
            and pallas_gpu_attention_module() is not None)


def choose_implementation(requested: str, dtype, head_dim: int, seq_len: int, platform: str | None = None,
                          mix: bool = False) -> str:
    """The kernel `causal_attention` runs: "auto" picks cuDNN on GPU in bf16/fp16 without a mix (head dim a multiple
    of 8, at most 128), else on GPU the Pallas GPU (Triton) kernel (with a mix or in float32: cuDNN returns only
    bf16/fp16; T in blocks of 64, head dim 16..128), the Pallas flash kernel on TPU (T a multiple of 128), and the
    explicit query-block path otherwise (CPU). `mix`: the scoring has a mix (Differential Attention). An explicit
    request is honoured where it can run; a cuDNN or Pallas request that cannot falls back to "explicit" with a
    warning. `platform` defaults to `jax.default_backend()`."""
    platform = platform or jax.default_backend()
    cudnn_ok = (platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and not mix
                and head_dim % 8 == 0 and head_dim <= 128)
    pallas_ok = ((platform == "tpu" and seq_len % PALLAS_BLOCK == 0)
                 or ((platform == "gpu" or PALLAS_GPU_INTERPRET) and _pallas_gpu_ok(head_dim, seq_len)))
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


def auto_chunks(t: int) -> int:
    """Query blocks for the explicit causal path: blocks of about 64 queries, at most 8 of them.

    Block i only scores keys [0, end_i), so the upper-triangle work skipped is (1 - (n+1)/(2n)) of a full T×T (25% at
    n=2, 37.5% at n=4, 44% at n=8); more blocks mean more, smaller matmuls and more HLO, hence the cap (NOTES.md).
    """
    return max(1, min(8, t // 64))


def _exp_and_norm(s: Array) -> tuple[Array, Array]:
    """Unnormalised softmax numerators exp(s - max) and the reciprocal of their row sums (fp32).

    The max is a constant shift (stop_gradient), so autodiff differentiates only exp and the sum: the same gradient
    as jax.nn.softmax with fewer ops in the backward pass. One reciprocal per row replaces a divide per element."""
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - m)
    return e, 1.0 / jnp.sum(e, axis=-1, keepdims=True)


def causal_attention(q: Array, k: Array, v: Array, mix: Array | None = None, impl: str = "explicit",
                     n_chunks: int = 0, return_weights: bool = False,
                     visible: Array | None = None) -> Array | tuple[Array, Array]:
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

    impl: "explicit" (einsums in causal query blocks, `n_chunks` of them, 0 = auto_chunks), "xla" / "cudnn"
    (jax.nn.dot_product_attention), "pallas" (the Pallas flash kernel: TPU's, or the GPU (Triton) one in a program
    lowered for CUDA) or "auto" (choose_implementation, per lowering platform). return_weights=True (explicit only)
    also returns the mixed attention matrices [B, G, T, T] in fp32: the diagnostics read them from this same kernel.

    visible: bool [B, T, S] replaces the causal mask for cached decoding (explicit only, one block): k and v then
    hold a KV cache of S slots, [B, S, H, D] and [B, S, G, Dv], and query t sees the slots where visible[:, t].
    """
    b, t, h, d = q.shape
    g, dv = v.shape[2:]
    if h % g or (mix is None and g != h):
        raise ValueError(f"causal_attention: value heads G={g} must divide query heads H={h} (and equal H without "
                         "a mix)")
    if mix is not None and mix.shape != (h,):
        raise ValueError(f"causal_attention: mix must have shape [H]=({h},), got {mix.shape}")
    if (return_weights or visible is not None) and impl != "explicit":
        raise ValueError("causal_attention: return_weights and visible need impl='explicit'")
    if impl == "auto":
        # The kernel for this process's backend, except that a program lowered for TPU takes the Pallas kernel where
        # T allows, and one lowered for CUDA the Pallas GPU kernel where auto picks it there: jax.lax.platform_dependent
        # picks per lowering platform, so a step compiled on the device's host or exported for it from any host
        # (jax.export) gets it, and XLA drops the branches a platform does not take. cuDNN is left to a GPU host:
        # jax checks the cuDNN version while tracing it.
        here = choose_implementation("auto", q.dtype, d, t, mix=mix is not None)
        chosen = {p: choose_implementation("auto", q.dtype, d, t, platform=p, mix=mix is not None)
                  for p in ("tpu", "gpu")}
        branches = {"tpu": chosen["tpu"], "cuda": chosen["gpu"] if chosen["gpu"] != "cudnn" else here}
        branches = {p: name for p, name in branches.items() if name != here}
        if not branches:
            return causal_attention(q, k, v, mix, here, n_chunks)
        kernel = {name: functools.partial(causal_attention, mix=mix, impl=name, n_chunks=n_chunks)
                  for name in {here, *branches.values()}}
        return jax.lax.platform_dependent(q, k, v, default=kernel[here],
                                          **{p: kernel[name] for p, name in branches.items()})
    # A mix needs each head's output in float32. λ's gradient is −Σ⟨g, o2⟩ with g ⊥ o1 − λ·o2 (the caller's head
    # norm), and o1, o2 rounded to bf16 independently carry an error as large as the part of o2 that counts: through
    # bf16 kernel outputs λ's gradient was off by up to 5× (docs/scaling.md). The XLA and Pallas kernels return
    # their operands' dtype, so they get float32 operands below (exact upcasts of bf16 q, k, v); cuDNN takes only
    # bf16/fp16, so under cuDNN a mix runs on the explicit path.
    if mix is not None and impl == "cudnn":
        impl = "explicit"
    if impl == "explicit":
        return _explicit_attention(q, k, v, mix, n_chunks, return_weights, visible)
    if mix is not None:
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    # Fused kernels take one value per query head of width D: repeat each group's value over its heads, and split a
    # value wider than D into r = Dv/D "virtual heads" that repeat q and k (specs/diffattn.md §6, form 2).
    if dv % d:
        raise ValueError(f"causal_attention: value width {dv} must be a multiple of the head dim {d} for {impl!r}")
    r = dv // d
    vh = jnp.repeat(v, h // g, axis=2).reshape(b, t, h * r, d)
    qh, kh = (jnp.repeat(a, r, axis=2) if r > 1 else a for a in (q, k))
    o = _fused_attention(qh, kh, vh, impl).reshape(b, t, h, dv)
    if mix is None:
        return o
    return (o * mix[:, None]).reshape(b, t, g, h // g, dv).sum(axis=3)


def _explicit_attention(q: Array, k: Array, v: Array, mix: Array | None, n_chunks: int, return_weights: bool,
                        visible: Array | None = None):
    """The explicit path: causal query blocks, each scored against only the keys it can see (or one block under
    the `visible` mask of cached decoding).

    Why not jax.nn.dot_product_attention(implementation="xla")? On CPU its fwd+bwd was ~2× slower than this
    (benchmarks/NOTES.md): it scores the full T×T square, and this path also skips the masked upper-triangle blocks.
    Peak [*, T, T]-sized memory is the same as one full score tensor (the blocks partition it).
    """
    b, t, h, d = q.shape
    g, s_kv = v.shape[2], k.shape[1]
    n = 1 if visible is not None else max(1, min(n_chunks or auto_chunks(t), t))
    # Heads-major inside the kernel: every matmul below is a plain batch over (B, H) with contiguous [T, d] operands
    # (what XLA:CPU's dot emitter wants); the transposes stay here, the layer sees [B, T, H, D].
    qt = jnp.swapaxes(q * jnp.asarray(d ** -0.5, q.dtype), 1, 2)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    bounds = [t * i // n for i in range(n + 1)]
    outs, weights = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        if visible is None:  # block [lo, hi) of queries sees keys [0, hi)
            keys, mask = hi, (lo + jnp.arange(hi - lo))[:, None] >= jnp.arange(hi)[None, :]
        else:
            keys, mask = s_kv, visible[:, None]
        s = jnp.einsum("bhqd,bhkd->bhqk", qt[:, :, lo:hi], kt[:, :, :keys], preferred_element_type=jnp.float32)
        e, inv_sum = _exp_and_norm(jnp.where(mask, s, jnp.finfo(jnp.float32).min))
        if mix is None and not return_weights:
            # Deferred normalisation: scale the [c, dv] output rows instead of the [c, S] probabilities (S/dv times
            # fewer multiplies, forward and backward); the same softmax(s)·v up to rounding.
            o = jnp.einsum("bhqk,bhkd->bhqd", e.astype(v.dtype), vt[:, :, :keys], preferred_element_type=jnp.float32)
            outs.append((o * inv_sum).astype(v.dtype))
            continue
        p = e * inv_sum
        if mix is not None:  # [B, H, c, S] -> [B, G, c, S]
            p = (p * mix[:, None, None]).reshape((b, g, h // g) + p.shape[2:]).sum(axis=2)
        if return_weights:
            weights.append(jnp.pad(p, ((0, 0), (0, 0), (0, 0), (0, s_kv - keys))))
        if mix is None:
            o = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vt[:, :, :keys], preferred_element_type=jnp.float32)
            outs.append(o.astype(v.dtype))
        else:
            # float32 value product and output (precision.py): the mixed weights' cotangent, from which λ's gradient
            # is summed over T×T entries, is then not rounded to bf16 (that put λ's gradient off by up to 2×).
            outs.append(jnp.einsum("bhqk,bhkd->bhqd", p, vt[:, :, :keys].astype(jnp.float32)))
    o = jnp.swapaxes(jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0], 1, 2)
    if not return_weights:
        return o
    return o, (jnp.concatenate(weights, axis=2) if len(weights) > 1 else weights[0])


def _fused_attention(q: Array, k: Array, v: Array, impl: str) -> Array:
    """One fused causal kernel on [B, T, H, D] (scale D**-0.5), returning q's dtype: jax.nn.dot_product_attention,
    or a Pallas flash kernel: the GPU one where the program is lowered for CUDA (PALLAS_GPU_INTERPRET: everywhere,
    interpreted) and the TPU one otherwise (on CPU under pltpu.force_tpu_interpret_mode). Each is traced only where
    T and D suit it (a kernel can refuse its shapes while tracing)."""
    if impl in ("xla", "cudnn"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    if impl != "pallas":
        raise ValueError(f"unknown attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    if PALLAS_GPU_INTERPRET:
        return _pallas_gpu_attention(q, k, v, interpret=True)
    t, d = q.shape[1], q.shape[-1]
    kernels = {}
    if _pallas_gpu_ok(d, t):
        kernels["cuda"] = _pallas_gpu_attention
    if t % PALLAS_BLOCK == 0:
        kernels["default"] = _pallas_tpu_attention
    if not kernels:
        raise ValueError(f"causal_attention: no Pallas kernel takes T={t}, head dim {d} (choose_implementation)")
    if list(kernels) == ["default"]:
        return _pallas_tpu_attention(q, k, v)
    return jax.lax.platform_dependent(q, k, v, **kernels)


def _pallas_tpu_attention(q: Array, k: Array, v: Array) -> Array:
    """The Pallas TPU flash kernel, which takes [B, H, T, D] (its transposes stay here)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash  # noqa: PLC0415

    qt, kt, vt = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    o = pallas_flash.flash_attention(qt, kt, vt, causal=True, sm_scale=q.shape[-1] ** -0.5)
    return jnp.swapaxes(o, 1, 2)


def _pallas_gpu_attention(q: Array, k: Array, v: Array, interpret: bool = False) -> Array:
    """The Pallas GPU (Triton) flash kernel on [B, T, H, D], its own layout. It accumulates in float32 and writes
    q's dtype, so float32 operands (a mix) give float32 per-head outputs. Its float32 dots run as TF32 on GPUs that
    have it, the default precision of XLA's float32 matmuls there too (the explicit path's)."""
    pallas_gpu = pallas_gpu_attention_module()
    t = q.shape[1]
    block = min(PALLAS_GPU_BLOCK, t)
    sizes = pallas_gpu.BlockSizes(block_q=block, block_k=block, block_q_dkv=min(32, t), block_kv_dkv=min(32, t),
                                  block_q_dq=min(32, t), block_kv_dq=min(32, t))
    return pallas_gpu.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True, block_sizes=sizes,
                          interpret=interpret)


# ---------------------------------------------------------------------------------------------------- QK transforms
class CouplingMLP(nnx.Module):
    """f: R^d_head -> R^d_head, a two-layer SiLU MLP (dynamics.coupling_mlp); shared by heads unless per-head."""

    def __init__(self, cfg: ModelConfig, key: Array, path: str):
        d, h = cfg.head_dim, cfg.coupling_hidden
        lead = (cfg.n_heads,) if cfg.per_head_params else ()
        lead_axes = ("heads",) if cfg.per_head_params else ()
        self.w1 = nnx.Param(jax.random.normal(named_key(key, path + "/w1"), lead + (d, h)) / math.sqrt(d),
                            logical_axes=lead_axes + ("head_dim", "coupling"))
        self.b1 = const_param(lead + (h,), 0.0, lead_axes + ("coupling",))
        # Zero output layer: f ≡ 0 at init, so the k-update starts as the identity while the q-drift (q += Δt·k)
        # already couples the pair; the gradient reaching w2 is non-zero from the first step.
        self.w2 = const_param(lead + (h, d), 0.0, lead_axes + ("coupling", "head_dim"))
        self.b2 = const_param(lead + (d,), 0.0, lead_axes + ("head_dim",))

    def params(self, dtype) -> dict[str, Array]:
        """Weights in the compute dtype, biases in float32 (precision.py)."""
        return {"w1": self.w1[...].astype(dtype), "b1": self.b1[...], "w2": self.w2[...].astype(dtype),
                "b2": self.b2[...]}


class AffineCouplingNets(nnx.Module):
    """The s/t nets of the invertible affine coupling (invertible.py), one set per layer, shared by heads."""

    def __init__(self, cfg: ModelConfig, key: Array, path: str):
        d, h, p = cfg.head_dim, cfg.affine_hidden, cfg.affine_pairs
        for net in ("q_net", "k_net"):
            w1 = jax.random.normal(named_key(key, f"{path}/{net}/w1"), (p, d, h)) / math.sqrt(d)
            setattr(self, f"{net}_w1", nnx.Param(w1, logical_axes=(None, "head_dim", "coupling")))
            setattr(self, f"{net}_b1", const_param((p, h), 0.0, (None, "coupling")))
            setattr(self, f"{net}_w2", const_param((p, h, 2 * d), 0.0, (None, "coupling", "head_dim")))
            setattr(self, f"{net}_b2", const_param((p, 2 * d), 0.0, (None, "head_dim")))

    def params(self, dtype) -> dict[str, dict[str, Array]]:
        """Weights in the compute dtype, biases in float32 (precision.py)."""
        cast = {"w1": dtype, "b1": jnp.float32, "w2": dtype, "b2": jnp.float32}
        return {net: {leaf: getattr(self, f"{net}_{leaf}")[...].astype(cast[leaf]) for leaf in cast}
                for net in ("q_net", "k_net")}


# -------------------------------------------------------------------------------------------------------- attention
class CausalSelfAttention(nnx.Module):
    """One causal attention layer. Input and output [B, T, d_model]."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, key: Array):
        self.cfg = cfg
        d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        path = f"layers/{layer_idx}/attn"
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = normal_param(key, path + "/wq", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wk = normal_param(key, path + "/wk", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wv = normal_param(key, path + "/wv", (d, h, dh), std, ("embed", "heads", "head_dim"))
        self.wo = normal_param(key, path + "/wo", (h, dh, d), out_std, ("heads", "head_dim", "embed"))

        transform = cfg.qk_transform
        if transform in DYNAMICS_METHOD:
            # Δt per head (per half-head under differential scoring: H values either way).
            self.dt = const_param((h,), cfg.dt_init, ("heads",))
            if cfg.coupling_scope == "layer":
                self.coupling = CouplingMLP(cfg, key, path + "/coupling")
        elif transform == "affine":
            self.affine = AffineCouplingNets(cfg, key, path + "/affine")

        if cfg.scoring == "differential":
            # λ_init depends on the depth: the layer index is kept (a Python int, not a parameter) and can be
            # overridden per call, which is how a scanned stack of layers (model.scan_layers) passes its index.
            self.layer_idx = layer_idx
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, normal_param(key, f"{path}/{name}", (dh,), 0.1, ("head_dim",)))
            self.subln_scale = const_param((2 * dh,), 1.0, ("head_dim",))

    # -- the QK transform -------------------------------------------------------------------------------------------
    def transform_qk(self, q: Array, k: Array, shared_coupling: CouplingMLP | None = None) -> tuple[Array, Array]:
        """(q, k) [B, T, H, d] -> the transformed pair, same shape."""
        cfg = self.cfg
        transform = cfg.qk_transform
        if transform in DYNAMICS_METHOD:
            mlp = self.coupling if cfg.coupling_scope == "layer" else shared_coupling
            if mlp is None:
                raise ValueError("model.coupling_scope='shared' needs the model's shared coupling MLP")
            # Δt stays float32: dynamics.py forms Δt·k in float32 (issue 12).
            return dynamics.evolve_heads_batched(q, k, self.dt[...], mlp.params(q.dtype), cfg.n_steps,
                                                 DYNAMICS_METHOD[transform], unroll=cfg.scan_unroll,
                                                 per_head_params=cfg.per_head_params, backward=cfg.dynamics_backward)
        if transform == "affine":
            return invertible.affine_forward(self.affine.params(q.dtype), q, k)
        return q, k

    def lambda_value(self, depth: int | Array | None = None) -> Array:
        """DiffAttn's scalar λ = exp(<λq1,λk1>) − exp(<λq2,λk2>) + λ_init(depth), in fp32 (depth: this layer's
        index unless given)."""
        depth = self.layer_idx if depth is None else depth
        dot1 = jnp.sum(self.lambda_q1[...] * self.lambda_k1[...])
        dot2 = jnp.sum(self.lambda_q2[...] * self.lambda_k2[...])
        return jnp.exp(dot1) - jnp.exp(dot2) + lambda_init(depth)

    # -- scoring ----------------------------------------------------------------------------------------------------
    def score(self, q: Array, k: Array, v: Array, impl: str, return_weights: bool = False,
              visible: Array | None = None, depth: int | Array | None = None):
        """q, k, v [B, T, H, d] -> the per-head output [B, T, H, d] before W_O (and the attention weights: softmax
        A [B, H, T, T], or A1 − λ·A2 [B, H/2, T, T] under differential scoring, with return_weights). With
        `visible` [B, T, S], k and v are a KV cache [B, S, H, d] (causal_attention).

        Differential scoring reads the H heads as H/2 pairs of half-heads; each pair shares the value of width 2d
        made of both halves' values, and mixes its two attention matrices as A1 − λ·A2 (specs/diffattn.md). `depth`:
        the layer index for λ_init (default: the one the layer was built with)."""
        chunks = self.cfg.attention_chunks
        if self.cfg.scoring != "differential":
            return causal_attention(q, k, v, None, impl, chunks, return_weights, visible)
        b, t, h, dh = q.shape
        depth = self.layer_idx if depth is None else depth
        lam = self.lambda_value(depth)
        mix = jnp.tile(jnp.stack([jnp.ones_like(lam), -lam]), h // 2)  # [1, −λ, 1, −λ, ...]
        v = v.reshape(v.shape[:2] + (h // 2, 2 * dh))
        out = causal_attention(q, k, v, mix, impl, chunks, return_weights, visible)
        o, weights = out if return_weights else (out, None)
        o = (rms_norm(o, self.subln_scale[...], eps=1e-5) * (1.0 - lambda_init(depth))).astype(q.dtype)
        o = o.reshape(b, t, h, dh)
        return (o, weights) if return_weights else o

    # -- forward ----------------------------------------------------------------------------------------------------
    def __call__(self, x: Array, shared_coupling: CouplingMLP | None = None, collect: bool = False,
                 layer_idx: int | Array | None = None):
        """x: [B, T, d_model] in the compute dtype -> [B, T, d_model] (and a dict of intermediates if collect).
        layer_idx: this layer's depth (default: the index it was built with; a scanned stack passes its own).

        Activations are [B, T, H, d] from the projections on (the layout jax.nn.dot_product_attention and cuDNN
        take). collect=True runs the explicit kernel, which also returns the attention weights."""
        cfg, dtype = self.cfg, x.dtype
        impl = "explicit" if collect else cfg.attention_impl
        if impl not in ("auto", "explicit"):  # a named kernel: honoured where it can run (choose_implementation)
            impl = choose_implementation(impl, dtype, cfg.head_dim, x.shape[1], mix=cfg.scoring == "differential")
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dtype))
        k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dtype))
        v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dtype))
        q0, k0 = q, k
        q, k = self.transform_qk(q, k, shared_coupling)
        q1, k1 = q, k
        if cfg.positions == "rope":
            q, k = apply_rope(q, cfg.rope_base), apply_rope(k, cfg.rope_base)
        o = self.score(q, k, v, impl, return_weights=collect, depth=layer_idx)
        if collect:
            o, weights = o
        y = jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(dtype))
        if not collect:
            return y
        aux = {"q_before": q0, "k_before": k0, "q_after": q1, "k_after": k1, "attn": weights}
        if hasattr(self, "dt"):
            aux["dt"] = self.dt[...]
        return y, aux

    # -- cached decoding (generate.py) ------------------------------------------------------------------------------
    def decode(self, x: Array, cache: dict[str, Array], positions: Array,
               shared_coupling: CouplingMLP | None = None,
               layer_idx: int | Array | None = None) -> tuple[Array, dict[str, Array]]:
        """The layer on T new tokens with a KV cache: x [B, T, d_model] at absolute `positions` [B, T] (consecutive
        in each row) -> (y [B, T, d_model], the updated cache).

        cache: {"k", "v"}, each [B, S, H, d_head] in the compute dtype. It holds keys *after* the QK transform (and
        after RoPE): every transform acts on each token's own (q, k), so a token's evolved key never changes once
        computed. The new keys and values are written at slots positions[b, 0] + 0..T-1 and query (b, t) sees slots
        <= positions[b, t]. Slots above a row's position may hold stale entries (a shorter prompt's padding); they
        stay masked until that row overwrites them.
        """
        cfg, dtype = self.cfg, x.dtype
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dtype))
        k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dtype))
        v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dtype))
        q, k = self.transform_qk(q, k, shared_coupling)
        if cfg.positions == "rope":  # the transform runs before the rotation, as in __call__
            q = apply_rope(q, cfg.rope_base, positions=positions)
            k = apply_rope(k, cfg.rope_base, positions=positions)
        write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), at, axis=0))
        cache = {"k": write(cache["k"], k, positions[:, 0]), "v": write(cache["v"], v, positions[:, 0])}
        visible = jnp.arange(cache["k"].shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
        o = self.score(q, cache["k"], cache["v"], "explicit", visible=visible, depth=layer_idx)
        return jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(dtype)), cache
