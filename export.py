"""Export a run's checkpoint (coupled_qk_jax/cli/export.py; installed as coupled-qk-export): python export.py --help."""

from coupled_qk_jax.cli.export import main

if __name__ == "__main__":
    main()
