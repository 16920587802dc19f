"""Forward and backward pass of every variant at a config's scale; prints parameter counts and the initial loss.

    python -m coupled_qk_jax.smoke [--scale tiny] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig
from coupled_qk_jax.configs import lm
from coupled_qk_jax.model import TransformerLM, count_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", default="tiny", choices=sorted(lm.SCALES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seq_len", type=int, default=64)
    args = parser.parse_args()

    def loss_fn(model, tokens):
        logp = jax.nn.log_softmax(model(tokens[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    base = None
    print(f"{'variant':32s} {'params':>12s} {'extra':>8s} {'loss':>7s} {'|grad|':>9s} {'secs':>6s}")
    for variant in ALL_VARIANTS:
        fields = dict(lm.get_config(f"{variant},{args.scale}").model)
        cfg = ModelConfig.from_dict({**fields, "dtype": args.dtype})
        model = TransformerLM(cfg, seed=0)
        tokens = jax.random.randint(jax.random.key(1), (2, args.seq_len + 1), 0, cfg.vocab_size)
        start = time.perf_counter()
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
        gnorm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))))
        n = count_params(model)
        base = base or n
        print(f"{variant:32s} {n:12,d} {100 * (n - base) / base:7.3f}% {float(loss):7.3f} {gnorm:9.3e} "
              f"{time.perf_counter() - start:6.2f}")


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
