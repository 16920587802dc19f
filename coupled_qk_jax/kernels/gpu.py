"""The GPU attention kernels, on one device's shard: cuDNN's fused attention (bf16/fp16, no mix) and a Pallas flash
kernel for float32 and for Differential Attention's mix (whose per-head outputs must stay float32, which cuDNN cannot
return). Custom calls that XLA cannot partition: kernels.attend runs them under shard_map.

The Pallas kernel is jax's Triton one (jax.experimental.pallas.ops.gpu.attention) where the installed jax ships it.
"""

from __future__ import annotations

import warnings

import jax

Array = jax.Array

# The Pallas GPU (Triton) kernel's query and key block here, half its default 128: with a mix it runs on float32
# tiles, twice the bytes of bf16 ones. T must be a multiple of it, or a power of two below it (one block).
PALLAS_BLOCK = 64
# Run the Pallas GPU kernel in Pallas' interpreter on any backend: how the GPU path is tested on CPU. Read while
# tracing, so set it before a function is first traced.
INTERPRET = False


def pallas_module():
    """jax.experimental.pallas.ops.gpu.attention, or None where this jax has none. jax 0.11 deprecated it (with the
    Pallas Triton backend), so its DeprecationWarning is silenced here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as pallas_gpu  # noqa: PLC0415
    except ImportError:
        return None
    return pallas_gpu


def pallas_supports(head_dim: int, seq_len: int) -> bool:
    """Shapes the Pallas GPU kernel takes: T in whole blocks (or one power-of-two block of at least 16), and a head
    dim of 16..128 (Triton's dots need 16; the float32 tiles of wider heads outgrow shared memory)."""
    one_block = 16 <= seq_len < PALLAS_BLOCK and seq_len & (seq_len - 1) == 0
    return ((seq_len % PALLAS_BLOCK == 0 or one_block) and 16 <= head_dim <= 128
            and pallas_module() is not None)


def pallas_attention(q: Array, k: Array, v: Array) -> Array:
    """The Pallas GPU (Triton) flash kernel on [B, T, H, D], its own layout. It accumulates in float32 and writes
    q's dtype, so float32 operands (a mix) give float32 per-head outputs. Its float32 dots run as TF32 on GPUs that
    have it, the default precision of XLA's float32 matmuls there too (the explicit path's)."""
    pallas_gpu = pallas_module()
    t = q.shape[1]
    block = min(PALLAS_BLOCK, t)
    sizes = pallas_gpu.BlockSizes(block_q=block, block_k=block, block_q_dkv=min(32, t), block_kv_dkv=min(32, t),
                                  block_q_dq=min(32, t), block_kv_dq=min(32, t))
    return pallas_gpu.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True, block_sizes=sizes,
                          interpret=INTERPRET)


def cudnn_attention(q: Array, k: Array, v: Array) -> Array:
    """cuDNN's fused causal attention on [B, T, H, D] (bf16/fp16)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
