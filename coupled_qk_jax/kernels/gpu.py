"""The GPU attention kernels, on one device's shard: cuDNN's fused attention (bf16/fp16, no mix) and a Pallas flash
kernel for float32 and for Differential Attention's mix (whose per-head outputs must stay float32, which cuDNN cannot
return). Custom calls that XLA cannot partition: kernels.attend runs them under shard_map.

The Pallas kernel is jax's Triton one (jax.experimental.pallas.ops.gpu.attention) where the installed jax ships it
(up to 0.11), else tokamax's (`pip install tokamax`, the `gpu` extra; jax 0.12 removed jax's): its Pallas Triton
flash attention, on jax's Pallas Triton backend, which jax 0.12 still has. Neither: `pallas_supports` is False and
choose_implementation falls back to the explicit path.

jax 0.12 needs a GPU to lower a Pallas Triton call, or an abstract one in context while a program is traced for
CUDA on another host (`abstract_gpu`): the lowering reads the GPU's compute capability.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

Array = jax.Array

# The Pallas GPU (Triton) kernel's query and key block here, half its default 128: with a mix it runs on float32
# tiles, twice the bytes of bf16 ones. T must be a multiple of it, or a power of two below it (one block).
PALLAS_BLOCK = 64
# tokamax's backward runs its causal diagonal in key (query) blocks of half its query (key) block; Triton's dots need
# 16 rows, so its query block there is at least 32, and so is T.
TOKAMAX_MIN_SEQ = 32
# Run the Pallas GPU kernel in Pallas' interpreter on any backend: how the GPU path is tested on CPU. Read while
# tracing, so set it before a function is first traced. tokamax's kernel: its forward only (jax 0.12's interpreter
# cannot run tokamax's causal backward kernel: a program_id is left for the CPU to lower).
INTERPRET = False


def pallas_module():
    """jax.experimental.pallas.ops.gpu.attention, or None where this jax has none (0.12 on). jax 0.11 deprecated it
    (with the Pallas Triton backend), so its DeprecationWarning is silenced here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as pallas_gpu  # noqa: PLC0415
    except ImportError:
        return None
    return pallas_gpu


@functools.cache
def _tokamax():
    """tokamax's Pallas Triton attention modules (forward, backward), or None where tokamax is missing, cannot
    import on this jax, or predates `bypass_device_check` (needed to trace the kernel on a host without a GPU: a
    program lowered for CUDA elsewhere, or the CUDA branch of impl="auto", which jax traces on every platform)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from tokamax._src.ops.attention import pallas_triton, pallas_triton_vjp  # noqa: PLC0415
    except Exception:  # noqa: BLE001 -- ImportError, or a tokamax written for another jax failing as it imports
        return None
    fields = {f.name for f in dataclasses.fields(pallas_triton.PallasTritonFlashAttention)}
    return (pallas_triton, pallas_triton_vjp) if "bypass_device_check" in fields else None


def backend() -> str | None:
    """Which Pallas GPU flash kernel this install has: "jax" (jax <= 0.11), "tokamax" (jax's removed, tokamax
    installed), or None."""
    if pallas_module() is not None:
        return "jax"
    return "tokamax" if _tokamax() is not None else None


def interpreted_gradient_missing() -> str | None:
    """Why the Pallas GPU kernel's gradient cannot run in Pallas' interpreter (INTERPRET) with this install, or None
    where it can (jax's own kernel)."""
    which = backend()
    if which == "jax":
        return None
    if which is None:
        return (f"jax {jax.__version__} has no Pallas GPU attention (jax.experimental.pallas.ops.gpu.attention, "
                "removed in jax 0.12) and tokamax is not installed (the `gpu` extra)")
    return (f"jax {jax.__version__} has no Pallas GPU attention of its own and tokamax's Pallas Triton kernel runs "
            "in Pallas' interpreter forward only: its causal backward kernel leaves a program_id that the "
            "interpreter does not replace (no MLIR rule for 'program_id' on CPU)")


def pallas_supports(head_dim: int, seq_len: int) -> bool:
    """Shapes the Pallas GPU kernel takes: T in whole blocks (or one power-of-two block of at least 16; 32 for
    tokamax's), and a head dim of 16..128 (Triton's dots need 16; the float32 tiles of wider heads outgrow shared
    memory). tokamax's kernel pads a head dim to a power of two and masks a partial last block, but is held to the
    same blocks here (its block sizes are fixed below, not tuned per device)."""
    which = backend()
    if which is None:
        return False
    smallest = 16 if which == "jax" else TOKAMAX_MIN_SEQ
    one_block = smallest <= seq_len < PALLAS_BLOCK and seq_len & (seq_len - 1) == 0
    return (seq_len % PALLAS_BLOCK == 0 or one_block) and 16 <= head_dim <= 128


def pallas_attention(q: Array, k: Array, v: Array) -> Array:
    """The Pallas GPU (Triton) flash kernel on [B, T, H, D], its own layout. It accumulates in float32 and writes
    q's dtype, so float32 operands (a mix) give float32 per-head outputs. Its float32 dots run as TF32 on GPUs that
    have it, the default precision of XLA's float32 matmuls there too (the explicit path's)."""
    if backend() == "tokamax":
        return _tokamax_attention(q, k, v)
    pallas_gpu = pallas_module()
    t = q.shape[1]
    block = min(PALLAS_BLOCK, t)
    sizes = pallas_gpu.BlockSizes(block_q=block, block_k=block, block_q_dkv=min(32, t), block_kv_dkv=min(32, t),
                                  block_q_dq=min(32, t), block_kv_dq=min(32, t))
    return pallas_gpu.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True, block_sizes=sizes,
                          interpret=INTERPRET)


def _tokamax_attention(q: Array, k: Array, v: Array) -> Array:
    """tokamax's Pallas Triton flash attention, causal, with its blocks and dot precision fixed here rather than
    from the host's device (tokamax's heuristics and its default precision read the default device while tracing,
    which a program lowered for CUDA on a CPU host does not have): the forward's blocks are jax's kernel's above,
    the backward's tokamax's defaults (32/64), bounded by T. The float32 dots are TF32, bf16 ones accumulate in
    float32, and a device check that would refuse a CPU host is skipped (the kernel only runs where a program is
    lowered for CUDA)."""
    pallas_triton, pallas_triton_vjp = _tokamax()
    t = q.shape[1]
    block = min(PALLAS_BLOCK, t)
    vjp = pallas_triton_vjp.PallasTritonFlashAttentionVjp(
        config=pallas_triton_vjp.Config(block_m1=32, block_n1=block, block_m2=block, block_n2=32, num_warps=4,
                                        num_stages=2),
        bypass_device_check=True)
    op = pallas_triton.PallasTritonFlashAttention(
        config=pallas_triton.Config(block_q=block, block_k=block, num_warps=4, num_stages=2),
        bypass_device_check=True, vjp=vjp)
    presets = jax.lax.DotAlgorithmPreset
    # The interpreter runs the dots on the host, whose XLA has no TF32: full float32 there.
    precision = {jnp.dtype(jnp.float32): presets.F32_F32_F32 if INTERPRET else presets.TF32_TF32_F32,
                 jnp.dtype(jnp.bfloat16): presets.BF16_BF16_F32,
                 jnp.dtype(jnp.float16): presets.F16_F16_F32}[jnp.dtype(q.dtype)]
    call = functools.partial(op, is_causal=True, logits_scale=q.shape[-1] ** -0.5, precision=precision)
    if not INTERPRET:
        return call(q, k, v)
    from jax._src import config as jax_config  # noqa: PLC0415 -- the only switch into Pallas' generic interpreter

    prev = jax_config.pallas_tpu_interpret_mode_context_manager.swap_local(True)
    try:
        return call(q, k, v)
    finally:
        jax_config.pallas_tpu_interpret_mode_context_manager.set_local(prev)


def abstract_gpu(device_kind: str = "NVIDIA H100"):
    """An abstract mesh with one abstract GPU of `device_kind`: trace a program for CUDA under it
    (`with jax.sharding.use_abstract_mesh(abstract_gpu()):`) to lower its Pallas Triton calls on a host without a
    GPU (jax 0.12 reads the target's compute capability from it). None on a jax without abstract devices."""
    device = getattr(jax.sharding, "AbstractDevice", None)
    if device is None:
        return None
    return jax.sharding.AbstractMesh((), (), abstract_device=device(device_kind=device_kind, num_cores=None,
                                                                     platform="gpu"))


def cudnn_attention(q: Array, k: Array, v: Array) -> Array:
    """cuDNN's fused causal attention on [B, T, H, D] (bf16/fp16)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
