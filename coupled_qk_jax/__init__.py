"""coupled_qk_jax: attention whose queries and keys evolve together before scoring (JAX / Flax NNX)."""

__version__ = "0.1.0"
