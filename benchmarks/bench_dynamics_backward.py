"""The dynamics' backward pass (`runtime.dynamics_backward`): compiled memory, FLOPs and reconstruction drift.

    python benchmarks/bench_dynamics_backward.py --scale tiny --out benchmarks/results/cpu_dynamics_backward.md
    python benchmarks/bench_dynamics_backward.py --scale tiny-peer --backwards reversible --skip_drift   # a peer shape

No wall-clock timing (that is bench_attention.py's job, on an idle machine). Three measurements:

1. **Memory.** XLA's accounting of the full compiled train step (forward, backward, clipping, AdamW), the same
   figure as bench_attention.py's `mem MB`: arguments + outputs + temporaries − aliased, from
   `compiled.memory_analysis()`; with the temporaries alone, and the step's FLOPs and bytes accessed from
   `compiled.cost_analysis()`. For every dynamics variant at n = 1 and n = 7 (`--n_steps`), autodiff and reversible.
2. **Drift.** Leapfrog's reversible backward rebuilds (q_i, k_i) by integrating backwards with the same ops as the
   forward and −Δt. The drift is the error of the rebuilt (q_0, k_0) after n steps forward and n back, relative to the
   states' RMS, for float32 and bfloat16 at the layer's shape with a non-zero f (w2 LeCun-normal, as after training),
   Δt 0.1 (the init) and 0.5, n = 1, 7, 32. (Euler's rebuilt k_i drifts the same way: the same axpy.)
3. **Gradient error of the reconstruction** in both dtypes: the rebuilt-state gradients of a random linear loss
   against autodiff of the same forward (float32) or against float64 (bfloat16), relative to the gradient's norm.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import scale_config
from coupled_qk_jax import dynamics
from coupled_qk_jax.config import ModelConfig, RuntimeConfig
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training.config import TrainConfig
from coupled_qk_jax.training.optimizer import make_optimizer
from coupled_qk_jax.training.steps import init_train_state, make_train_step, split_model


def compiled_step(cfg: ModelConfig, runtime: RuntimeConfig, train_cfg: TrainConfig, batch: int, seq: int):
    """The jitted, donated train step of bench_attention.py, lowered and compiled on abstract inputs."""
    graphdef, params = split_model(TransformerLM(cfg, 0, runtime))
    tx = make_optimizer(params, train_cfg)
    state = jax.eval_shape(lambda p: init_train_state(p, tx), params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    step = jax.jit(make_train_step(graphdef, tx), donate_argnums=0)
    return step.lower(state, {"inputs": tokens, "targets": tokens}, jax.random.key(0)).compile()


def memory_row(variant: str, n_steps: int, backward: str, args) -> dict:
    cfg = scale_config(variant, args.scale)  # configs/lm.py's scales and bench_attention's peer shapes
    fields = dict(cfg.model, n_steps=n_steps, dtype=args.dtype)
    runtime = RuntimeConfig.from_dict(dict(cfg.runtime, dynamics_backward=backward))
    batch, seq = args.batch or cfg.train.batch_size, cfg.model.max_len
    compiled = compiled_step(ModelConfig.from_dict(fields), runtime, TrainConfig.from_dict(cfg.train), batch, seq)
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list of dicts on older jax
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {"variant": variant, "n": n_steps, "backward": backward, "peak_mb": total / 2**20,
            "temp_mb": m.temp_size_in_bytes / 2**20, "gflops": cost.get("flops", float("nan")) / 1e9,
            "gbytes": cost.get("bytes accessed", float("nan")) / 1e9}


def layer_case(dtype, dt: float, seed: int = 0):
    """q, k, Δt and a non-zero f at the tiny layer's shape (B 16, T 256, H 4, d_head 32, hidden 24)."""
    b, t, h, d, hidden = 16, 256, 4, 32, 24
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, h, d)).astype(dtype)
    k = jax.random.normal(keys[1], (b, t, h, d)).astype(dtype)
    k1, k2 = jax.random.split(keys[2])
    params = {"w1": jax.random.normal(k1, (d, hidden)) / jnp.sqrt(d), "b1": jnp.zeros(hidden),
              "w2": jax.random.normal(k2, (hidden, d)) / jnp.sqrt(hidden), "b2": jnp.zeros(d)}
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    dt = jnp.full((h, 1), dt, jnp.float32)
    return q, k, dt, functools.partial(dynamics.coupling_mlp, params), params


def drift(dtype, n_steps: int, dt: float) -> tuple[float, float]:
    """(RMS, max) of |rebuilt − original| / RMS(original) over (q_0, k_0), in units of the dtype's epsilon (2^-23
    for float32, 2^-7 for bfloat16); the backward's rebuild is leapfrog with −Δt."""
    q, k, dt, f, _ = layer_case(dtype, dt)
    run = jax.jit(lambda q, k, dt: dynamics._scan(q, k, dt, f, n_steps, "leapfrog", 1))
    q_back, k_back = run(*run(q, k, dt), -dt)
    err = jnp.stack([a.astype(jnp.float32) - b.astype(jnp.float32) for a, b in ((q_back, q), (k_back, k))])
    scale = float(jnp.sqrt(jnp.mean(jnp.square(q.astype(jnp.float32))))) * float(jnp.finfo(dtype).eps)
    return float(jnp.sqrt(jnp.mean(jnp.square(err)))) / scale, float(jnp.max(jnp.abs(err))) / scale


def gradient_error(dtype, n_steps: int, dt: float) -> dict:
    """Relative error (‖g − g_ref‖ / ‖g_ref‖) of Δt's and q's gradients, rebuilt states vs stored states.

    The reference is autodiff of the same forward in float32 (rebuild error only), or in float64 for bfloat16 (the
    dtype's own rounding plus the rebuild's), beside autodiff in bfloat16 against the same float64 reference."""
    q, k, dt, _, params = layer_case(dtype, dt)
    rng = np.random.default_rng(1)
    rq, rk = (jnp.asarray(rng.normal(size=q.shape), jnp.float32) for _ in range(2))

    def loss(rebuild, q, k, dt, params, rq, rk):
        f = functools.partial(dynamics.coupling_mlp, params)
        backward = "reversible" if rebuild else "autodiff"
        qn, kn = dynamics.integrate(q, k, dt, f, n_steps, "leapfrog", backward=backward)
        return jnp.sum(qn.astype(rq.dtype) * rq) + jnp.sum(kn.astype(rk.dtype) * rk)

    grad = jax.jit(jax.grad(loss, argnums=(1, 3)), static_argnums=0)
    rebuilt, stored = grad(True, q, k, dt, params, rq, rk), grad(False, q, k, dt, params, rq, rk)
    if dtype == jnp.float32:
        ref = stored
    else:
        with jax.enable_x64(True):
            up = lambda a: jnp.asarray(np.asarray(a, np.float64))
            ref = jax.jit(jax.grad(loss, argnums=(1, 3)), static_argnums=0)(
                False, up(q), up(k), up(dt), jax.tree.map(up, params), up(rq), up(rk))
            ref = jax.tree.map(np.asarray, ref)
    rel = lambda g, r: float(np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r))
    out = {"dq_rebuilt": rel(rebuilt[0], np.asarray(ref[0], np.float64)),
           "ddt_rebuilt": rel(rebuilt[1], np.asarray(ref[1], np.float64)),
           "dq_added": rel(rebuilt[0], np.asarray(stored[0], np.float64)),
           "ddt_added": rel(rebuilt[1], np.asarray(stored[1], np.float64))}
    if dtype != jnp.float32:
        out["dq_stored"] = rel(stored[0], np.asarray(ref[0], np.float64))
        out["ddt_stored"] = rel(stored[1], np.asarray(ref[1], np.float64))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--variants", default="coupled_euler,coupled_leapfrog,mlp_only")
    ap.add_argument("--n_steps", default="1,7")
    ap.add_argument("--batch", type=int, default=None, help="override the scale's train batch")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backwards", default="autodiff,reversible")
    ap.add_argument("--skip_memory", action="store_true")
    ap.add_argument("--skip_drift", action="store_true")
    ap.add_argument("--out", default=None, help="write the Markdown tables here too")
    args = ap.parse_args()
    command = "python benchmarks/bench_dynamics_backward.py " + " ".join(sys.argv[1:])
    lines = [f"`{command}` (jax {jax.__version__}, {jax.default_backend()})", ""]

    if not args.skip_memory:
        ns = [int(n) for n in args.n_steps.split(",")]
        rows = [memory_row("standard", 1, "autodiff", args)]
        for variant in args.variants.split(","):
            for backward in args.backwards.split(","):
                rows += [memory_row(variant, n, backward, args) for n in ns]
        lines += [f"{args.scale}, {args.dtype}: XLA memory of the train step", "",
                  f"| variant | backward | n | peak MB | temp MB | ×(n={ns[0]}) | GFLOP | GB accessed |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            base = next(b for b in rows if (b["variant"], b["backward"], b["n"]) == (r["variant"], r["backward"],
                                                                                        ns[0]))
            lines.append(f"| {r['variant']} | {r['backward']} | {r['n']} | {r['peak_mb']:.1f} | {r['temp_mb']:.1f} | "
                         f"{r['peak_mb'] / base['peak_mb']:.3f} | {r['gflops']:.2f} | {r['gbytes']:.2f} |")
            print(lines[-1], flush=True)
        lines.append("")

    if not args.skip_drift:
        lines += ["leapfrog reconstruction at B16 T256 H4 d32 (rebuilt (q_0, k_0) after n steps and n back)", "",
                  "Drift: |rebuilt − original| / RMS(original) in units of the dtype's epsilon. Gradient errors "
                  "‖g − g_ref‖/‖g_ref‖ of a random linear loss; the reference is float32 autodiff (float32 rows) or "
                  "float64 autodiff (bfloat16 rows); 'rebuilt vs stored' is the error the rebuild adds.", "",
                  "| dtype | Δt | n | drift RMS (eps) | drift max (eps) | dq: rebuilt | dq: stored "
                  "| dq: rebuilt vs stored | dΔt: rebuilt | dΔt: stored | dΔt: rebuilt vs stored |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for dtype, dt, n in [(d, dt, n) for d in (jnp.float32, jnp.bfloat16) for dt in (0.1, 0.5) for n in (1, 7, 32)]:
            g = gradient_error(dtype, n, dt)
            rms, worst = drift(dtype, n, dt)
            stored = lambda key: f"{g[key]:.1e}" if key in g else "(ref)"
            lines.append(f"| {jnp.dtype(dtype).name} | {dt} | {n} | {rms:.2f} | {worst:.1f} | {g['dq_rebuilt']:.1e} | "
                         f"{stored('dq_stored')} | {g['dq_added']:.1e} | {g['ddt_rebuilt']:.1e} | "
                         f"{stored('ddt_stored')} | {g['ddt_added']:.1e} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
