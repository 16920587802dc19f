"""Train a language model (coupled_qk_jax/cli/train.py; installed as coupled-qk-train): python train.py --help."""

from coupled_qk_jax.cli.train import main

if __name__ == "__main__":
    main()
