"""The TPU attention kernels, on one device's shard: splash attention where it takes the shapes, Pallas flash
otherwise. Both are Mosaic custom calls, which XLA cannot partition: kernels.attend runs them under shard_map.

Splash attention (block-sparse: the causal mask's empty blocks are skipped, not computed and masked) is what MaxText
runs; flash is jax's reference Pallas kernel and takes any T that is a multiple of its 128 block. On CPU both run in
Pallas' TPU interpreter under `pltpu.force_tpu_interpret_mode()` (how the tests check their numerics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

FLASH_BLOCK = 128  # the flash kernel's default block: T must be a multiple of it
SPLASH_MAX_BLOCK = 512  # MaxText's default splash block; a smaller T is one block
# Which kernel the TPU path prefers where both take the shapes. Read while tracing; benchmarks/tpu_kernels.py sets it
# to compare the two in the TPU compiler's cost model.
PREFERRED = "splash"
# Run the splash kernel in Pallas' generic interpreter (plain HLO) on any backend: how its numerics are tested on a
# CPU mesh, where the TPU interpreter (pltpu.force_tpu_interpret_mode) would run each device's program op by op.
INTERPRET = False


def supports(seq_len: int) -> bool:
    """Whether a TPU kernel takes a sequence of length `seq_len` (both need whole 128-blocks)."""
    return seq_len % FLASH_BLOCK == 0


def _splash_block(seq_len: int) -> int | None:
    """The largest splash block (a multiple of 128 up to 512) that divides T, or None."""
    for block in range(SPLASH_MAX_BLOCK, FLASH_BLOCK - 1, -FLASH_BLOCK):
        if seq_len % block == 0:
            return block
    return None


def attention(q: Array, k: Array, v: Array) -> Array:
    """Causal softmax attention on [B, T, H, D] (scale D**-0.5), returning q's dtype: one device's shard."""
    if not supports(q.shape[1]):
        raise ValueError(f"the TPU attention kernels need T in blocks of {FLASH_BLOCK}, got T={q.shape[1]}")
    if PREFERRED == "splash" and _splash_block(q.shape[1]) is not None:
        return splash(q, k, v)
    return flash(q, k, v)


def flash(q: Array, k: Array, v: Array) -> Array:
    """The Pallas TPU flash kernel, which takes [B, H, T, D] (its transposes stay here)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash  # noqa: PLC0415

    qt, kt, vt = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    o = pallas_flash.flash_attention(qt, kt, vt, causal=True, sm_scale=q.shape[-1] ** -0.5)
    return jnp.swapaxes(o, 1, 2)


@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, seq_len: int, interpret: bool):
    """A causal splash kernel for `heads` heads of length `seq_len` (its mask tables are built once, in numpy)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # noqa: PLC0415
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # noqa: PLC0415

    block = _splash_block(seq_len)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len)) for _ in range(heads)])
    # Built outside any trace (it is cached across programs), and its mask tables kept as numpy, not jax.Arrays:
    # they then enter each program as literals rather than as captured device arrays, which jax.export (a CUDA
    # export traces this TPU branch too) cannot account for.
    with jax.ensure_compile_time_eval():
        kernel = sk.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)
    return jax.tree.map(np.asarray, kernel)


def splash(q: Array, k: Array, v: Array) -> Array:
    """Causal splash attention on [B, T, H, D]. The kernel takes one sequence's [H, T, D] and does not scale the
    scores, so q is scaled here and the batch is vmapped."""
    b, t, h, d = q.shape
    kernel = _splash_kernel(h, t, INTERPRET)
    qt = jnp.swapaxes(q * jnp.asarray(d ** -0.5, q.dtype), 1, 2)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    return jnp.swapaxes(jax.vmap(kernel)(qt, kt, vt), 1, 2)
