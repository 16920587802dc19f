"""Sample text from a run (coupled_qk_jax/cli/sample.py; installed as coupled-qk-sample): python sample.py --help."""

from coupled_qk_jax.cli.sample import main

if __name__ == "__main__":
    main()
