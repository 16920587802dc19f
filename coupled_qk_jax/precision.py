"""The mixed-precision policy, stated once (attention.py, dynamics.py, model.py and training/steps.py follow it).

Parameters are always float32 and so is the optimiser. `model.dtype` is the compute dtype: float32 (the default,
and what CPU runs use) or bfloat16 (accelerators). Under bfloat16:

- **Matmuls run in the compute dtype**: weights are cast (`w.astype(dtype)`) where they are used, activations stay
  in it, and the gradient of a weight comes back through the cast's transpose as float32. TPU MXUs and GPU tensor
  cores accumulate bf16 products in float32.
- **Float32 wherever a gradient is a reduction over tokens**, because a bf16 sum of B·T terms keeps ~3 significant
  bits (measured: the Δt gradient off by 7–230% and f's output bias by up to 31%):
  - Δt·k and every other x + Δt·y update of the dynamics (`dynamics._axpy`): Δt's gradient sums B·T·d_head products.
  - the biases (`add_bias`: the MLP's, f's, the affine nets'): a bias' gradient is its output's cotangent summed
    over every token.
  - the norms (`attention.rms_norm`, `model.Norm`): statistics, scale and shift in float32.
  - Differential Attention's λ: computed in float32 and applied to float32 attention probabilities; the mixed
    probabilities' value product and the output up to the head norm stay float32, because A1 − λ·A2 cancels and
    the head norm removes the output's own direction: λ's gradient is a small difference of large terms, and
    rounding the output, its cotangent or the two half-heads' outputs to bf16 put it off by up to 5×. Fused kernels
    return their operands' dtype, so under a mix the XLA and Pallas kernels get float32 operands (exact upcasts of
    the bf16 q, k, v) and cuDNN, which takes only bf16/fp16, gives way to the explicit path (attention.py).
  - the affine coupling's nets (invertible.py): their matmuls return float32 (`preferred_element_type`), the SiLU,
    exp(log-scale) and the half-step q·exp(s) + t run in float32 and round once, because the log-scale multiplies
    q and k through exp; f's bf16 form there put a gradient leaf at cosine 0.96 on jax 0.12 (0.999 on jax 0.10).
  - the softmax: scores accumulate in float32 (`preferred_element_type`), exp and row sums in float32.
  - the loss: the tied head returns float32 logits (`preferred_element_type`) and the cross-entropy is float32.
- **float16 is refused** (`model.dtype`): its 5-bit exponent needs dynamic loss scaling, which is not implemented
  (the JAX library for it, `jmp`, has had no release since 2023). bfloat16 has float32's exponent range and needs
  none.

Checked by `tests/test_precision.py`: for every variant (and scanned layers, and the fused kernels' form), the
bf16 gradient of every parameter leaf against the float32 one: cosine ≥ 0.99 and norm within 5%, or within 3σ of
the fp32 gradient's own scatter under 2^-9 relative perturbations of the parameters where that is larger (one leaf:
a near-zero λ gradient, see the test); and λ's gradient through every kernel against float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def add_bias(y: jax.Array, b: jax.Array) -> jax.Array:
    """y + b computed in float32 (at least) and rounded once to y's dtype.

    y: [..., n] in the compute dtype (a matmul's output), b: [n] float32. Under autodiff the gradient of b is y's
    cotangent summed over every leading position in float32, not in bf16."""
    acc = jnp.promote_types(y.dtype, jnp.float32)
    return (y.astype(acc) + b.astype(acc)).astype(y.dtype)
