"""Evaluate a run's checkpoint (coupled_qk_jax/cli/eval.py; installed as coupled-qk-eval): python eval.py --help."""

from coupled_qk_jax.cli.eval import main

if __name__ == "__main__":
    main()
