"""The commands, each a module whose ``main()`` is its console script ([project.scripts] in pyproject.toml):

    coupled-qk-train    train.py    train (or resume) a run
    coupled-qk-eval     eval.py     evaluate a run's checkpoint on a whole held-out split
    coupled-qk-sample   sample.py   sample text from a run or an export folder
    coupled-qk-export   export.py   export a run's checkpoint to a portable folder
    coupled-qk-aot      aot.py      compile a config for a TPU topology ahead of time (python -m coupled_qk_jax.aot)

``coupled-qk-prepare`` is coupled_qk_jax.data.prepare's own ``main`` (python -m coupled_qk_jax.data.prepare). In a
checkout the top-level train.py, eval.py, sample.py and export.py run the same ``main()``. Flag parsing, config
files (``--config=configs/lm.py:ARG`` finds the packaged preset from any directory) and exit statuses:
coupled_qk_jax/training/cli.py.
"""
