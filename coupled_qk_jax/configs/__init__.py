"""The experiments' presets, each a module with ``get_config(arg)`` (ml_collections' config-file convention).

    lm    language models: ``VARIANT,SCALE``, e.g. ``coupled_euler,tiny``
    mqar  multi-query associative recall: ``VARIANT,LEVEL[,PROTOCOL]``, e.g. ``coupled_euler,easy``
    glue  GLUE fine-tuning: ``VARIANT,SCALE,TASK``, e.g. ``coupled_euler,60m,sst2``
    qkov  the QK/OV learning-rate experiments: ``PARAM,RATIO``, e.g. ``fafo,20``

They live in the package so that an installed wheel carries them; the repository's ``configs/*.py`` are thin files
over them, and ``--config=configs/lm.py:ARG`` finds the packaged file when no such file exists where the command
runs (coupled_qk_jax/training/cli.py).
"""
