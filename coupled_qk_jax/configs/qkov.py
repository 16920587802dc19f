"""ml_collections configs for the QK/OV learning-rate experiments (coupled_qk_jax.qkov, spec qk_ov_rates.md §4).

``get_config("PARAM,RATIO")``:

* PARAM: ``fafo`` | ``faco`` | ``cafo`` | ``caco``.
* RATIO: a number r >= 0 (QK rate = r * OV rate, constant), ``increasing`` (QK multiplier ramps linearly
  1 -> m over training), or ``fixed`` (Figure 3: attention fixed, OV only; ``fafo,fixed`` = factorised W_O W_V,
  ``caco,fixed`` = collapsed W_OV with bias).

Defaults are the paper's cells (spec §4, checked against the released notebooks), budgets included:

==================  =========  ===========  =======  =================  ======  =====  =========================
arg                 init       lr QK / OV   seq_len  epochs x batches   seeds   stop   source
==================  =========  ===========  =======  =================  ======  =====  =========================
fafo,1              fig2       .01 / .01    64       2500 x 250         1       yes    Fig 2 row 1
faco,1              fig2       .01 / .01    64       2500 x 250         1       yes    Fig 2 row 1
cafo,1              fig2       .01 / .01    64       5000 x 200         5       yes    Fig 2 row 1
caco,1              fig2       .01 / .01    64       2500 x 200         3       yes    Fig 2 row 1
fafo,R (R != 1)     eye        R*.01 / .01  64       1000 x 100         5       yes    Fig 2 row 2 (paper R = 20)
caco,R (R != 1)     default    R*.01 / .01  128      2000 x 100         5       no     Fig 2 row 2 (paper R = 5)
faco|cafo,R         fig2       R*.01 / .01  64       1000 x 100         5       no     project extension
fafo,increasing     eye        .01*(1->40)  64       2000 x 100         5       no     Fig 2 row 2
caco,increasing     default    .01*(1->10)  128      2000 x 100         5       no     Fig 2 row 2
faco|cafo,incr.     fig2       .01*(1->10)  64       2000 x 100         5       no     project extension
fafo|caco,fixed     default    - / .01      64       500 x 250 (4x32)   1       no     Fig 3
==================  =========  ===========  =======  =================  ======  =====  =========================

"stop": ``stop_loss = 1e-3`` with ``stop_check_every = 100``, the notebooks' early break (see
:func:`coupled_qk_jax.qkov.train.train`).

*(interpretation)* The spec does not give the init of the FAFO increasing-LR run; we use the all-1e-6 I init of
the FAFO increased-LR run it is paired with. Fields mirror :class:`coupled_qk_jax.qkov.train.TrainConfig`; convert
with :func:`to_train_config`.
"""

from __future__ import annotations

import ml_collections

PARAMS = ("fafo", "faco", "cafo", "caco")
SEEDS5 = (1234, 1235, 1236, 1237, 1238)
ALPHAS = (0.2, 0.4, 0.6, 0.8, 1.0)


def _parse(arg: str | None) -> tuple[str, str]:
    if arg is None:
        arg = "caco,1"
    parts = [p.strip().lower() for p in str(arg).split(",")]
    if len(parts) != 2:
        raise ValueError(f"config arg: expected 'PARAM,RATIO' (e.g. 'fafo,20'), got {arg!r}")
    param, ratio = parts
    if param not in PARAMS:
        raise ValueError(f"config arg PARAM: expected one of {PARAMS}, got {param!r}")
    if ratio not in ("increasing", "fixed"):
        try:
            r = float(ratio)
        except ValueError:
            raise ValueError(f"config arg RATIO: expected a number, 'increasing' or 'fixed', got {ratio!r}") from None
        if not r >= 0:
            raise ValueError(f"config arg RATIO: must be >= 0, got {ratio!r}")
    if ratio == "fixed" and param not in ("fafo", "caco"):
        raise ValueError(f"config arg PARAM: 'fixed' (Figure 3) takes fafo (factorised OV) or caco (collapsed OV), "
                         f"got {param!r}")
    return param, ratio


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """ConfigDict for one training cell; see the module docstring for the arg grammar and defaults."""
    param, ratio = _parse(arg)
    c = ml_collections.ConfigDict()
    c.name = f"{param}_{ratio}"
    c.parametrisation = param
    c.init = "fig2"
    c.lr_ov = 1e-2
    c.qk_ratio = 1.0
    c.qk_schedule = "constant"
    c.qk_final_multiplier = 1.0
    c.optimizer = "sgd"
    c.weight_decay = 0.0
    c.batch_size = 32
    c.seq_len = 64
    c.n_epochs = 1000
    c.batches_per_epoch = 100
    c.seeds = SEEDS5
    c.stop_loss = ml_collections.config_dict.placeholder(float)
    c.stop_check_every = 1
    c.fixed_alpha = ml_collections.config_dict.placeholder(tuple)
    c.ov_bias = False
    c.eval_batches = 500  # the notebooks' test heatmaps: 500 fresh batches of 32

    if ratio == "fixed":
        c.init = "default"
        c.ov_bias = param == "caco"
        c.n_epochs, c.batches_per_epoch = 500, 250
        c.seeds = (1234,)
        c.fixed_alpha = ALPHAS
        return c
    if ratio == "increasing":
        c.qk_schedule = "increasing"
        c.qk_final_multiplier = 40.0 if param == "fafo" else 10.0
        c.n_epochs, c.batches_per_epoch = 2000, 100
        c.init = {"fafo": "eye", "caco": "default"}.get(param, "fig2")
        c.seq_len = 128 if param == "caco" else 64
        return c
    r = float(ratio)
    c.qk_ratio = r
    if param == "fafo" or r == 1.0:
        # The row-1 and FAFO-increased-LR notebooks break once running_loss / n_batches <= 1e-3, running_loss being
        # reset every 100 epochs: see TrainConfig.stop_check_every. The CACO seq_len-128 and ramp cells never stop.
        c.stop_loss, c.stop_check_every = 1e-3, 100
    if r == 1.0:
        c.n_epochs, c.batches_per_epoch, c.seeds = {
            "fafo": (2500, 250, (1234,)), "faco": (2500, 250, (1234,)),
            "cafo": (5000, 200, SEEDS5), "caco": (2500, 200, SEEDS5[:3])}[param]
        return c
    if param == "fafo":
        c.init, c.n_epochs, c.batches_per_epoch = "eye", 1000, 100
    elif param == "caco":
        c.init, c.seq_len, c.n_epochs, c.batches_per_epoch = "default", 128, 2000, 100
    return c


def to_train_config(c: ml_collections.ConfigDict, **overrides):
    """Build a validated TrainConfig from a ConfigDict (optionally overriding fields)."""
    from coupled_qk_jax.qkov.train import TrainConfig

    fields = {k: c[k] for k in TrainConfig.__dataclass_fields__ if k in c}
    fields["seeds"] = tuple(fields["seeds"])
    if fields.get("fixed_alpha") is not None:
        fields["fixed_alpha"] = tuple(fields["fixed_alpha"])
    fields.update(overrides)
    return TrainConfig(**fields).validate()
