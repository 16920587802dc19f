"""Attention-variant training-step benchmark: step time, tokens/s, compile time, memory, MFU, ratio to standard.

    python benchmarks/bench_attention.py --scales tiny --variants standard,coupled_euler --out FILE.json

Every record is one (variant, scale, options) point of the *full* training step (forward, backward, clipping, AdamW:
`training.steps.make_train_step` + `training.optimizer.make_optimizer`, jitted with the train state donated). All
variants of a scale are compiled first and then timed in interleaved rounds (A B C A B C ...), so that a change in
machine load hits every variant alike; the reported step time is the median over all timed steps, and the ratio to
`standard` is taken between medians measured in the same process. The load average is recorded with each record.

MFU. Model FLOPs per step = 6 · params · tokens + 12 · layers · T² · d_model · batch (the attention term, forward and
backward). On CPU the denominator is the machine's own matmul roofline: the fp32 FLOP/s of a 2048×2048 @ 2048×2048
`jnp.dot`, measured inside every round (so it sees the same load as the steps); on GPU/TPU pass `--peak_tflops`.

Scales are configs/lm.py's (tiny, small, 60m, ...) plus the two **peer shapes**, sized like a plain
PyTorch implementation's benchmark: `tiny-peer` and `small-peer` = 4 layers, d_model 128 / 256, 4 heads, T 256,
batch 8, vocab 8192, LayerNorm, MLP 4·d, f hidden 4·d_head (`--scales tiny-peer,small-peer`; `--batch`/`--seq` and
variant options still override them).

Variant specs may carry options after a colon, e.g. `coupled_euler:n_steps=7:scan_unroll=7` or
`standard:remat=dots`; any ModelConfig or RuntimeConfig field can be set this way (values are parsed as Python
literals; a runtime field such as remat, scan_unroll, attention_impl or dynamics_backward goes to the runtime block,
any other to the model's).

Memory. `peak_mem_mb` is XLA's own accounting of the compiled step (arguments + outputs + temporaries − aliased,
from `compiled.memory_analysis()`), which is per variant even when several share one process; the device's
`peak_bytes_in_use` (process-wide) and the process RSS high-water mark (`resource.getrusage`) are recorded beside it.

Seed-parallel training (S seeds as one vmapped program, `train.num_seeds`) is measured through the training loop itself
by `benchmarks/bench_seeds.py`, not here.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from coupled_qk_jax.config import RUNTIME_FIELD_NAMES, ModelConfig, RuntimeConfig
from coupled_qk_jax.configs import lm
from coupled_qk_jax.model import TransformerLM, count_params
from coupled_qk_jax.training.config import TrainConfig
from coupled_qk_jax.training.observe import model_flops_per_step  # noqa: E402  (the training loop's MFU too)
from coupled_qk_jax.training.optimizer import make_optimizer
from coupled_qk_jax.training.steps import init_train_state, make_train_step, split_model

# ---------------------------------------------------------------------------------------------------------- helpers
# name: (d_model, batch); every peer shape has 4 layers, 4 heads, T 256, vocab 8192, LayerNorm, MLP 4·d, f 4·d_head.
PEER_SHAPES = {"tiny-peer": (128, 8), "small-peer": (256, 8)}


def scale_config(variant: str, scale: str):
    """configs/lm.py's config of (variant, scale), or of a peer shape (built on `tiny`'s training settings)."""
    if scale not in PEER_SHAPES:
        return lm.get_config(f"{variant},{scale}")
    d_model, batch = PEER_SHAPES[scale]
    cfg = lm.get_config(f"{variant},tiny")
    cfg.scale = scale
    cfg.model.update(d_model=d_model, n_layers=4, n_heads=4, d_ff=4 * d_model, vocab_size=8192, max_len=256,
                     norm="layernorm", coupling_hidden=4 * (d_model // 4))
    cfg.train.batch_size = batch
    return cfg


def parse_variant_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """'coupled_euler:n_steps=7:scan_unroll=7' -> ('coupled_euler', {'n_steps': 7, 'scan_unroll': 7})."""
    name, *opts = spec.split(":")
    overrides: dict[str, Any] = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value  # a bare string such as remat=dots
    return name, overrides


def load() -> float:
    """1-minute load average (the machine is shared; every measurement carries it)."""
    return os.getloadavg()[0]


def rss_peak_mb() -> float:
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    scale = 1.0 if platform.system() == "Darwin" else 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def device_peak_mb() -> float | None:
    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


def compiled_mem_mb(compiled) -> float | None:
    """XLA's memory accounting for one compiled executable (per variant, unlike process-wide counters)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend/version implements it
        return None
    if m is None:
        return None
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - getattr(m, "alias_size_in_bytes", 0))
    return total / 2**20


class Roofline:
    """fp32 FLOP/s of an n×n @ n×n jnp.dot, sampled repeatedly so that it sees the same load as the steps."""

    def __init__(self, n: int = 2048, dtype=jnp.float32):
        self.n = n
        k1, k2 = jax.random.split(jax.random.key(0))
        self.a = jax.random.normal(k1, (n, n), dtype)
        self.b = jax.random.normal(k2, (n, n), dtype)
        self.dot = jax.jit(jnp.dot)
        self.dot(self.a, self.b).block_until_ready()  # compile + warm
        self.samples: list[float] = []

    def sample(self, reps: int = 2) -> None:
        for _ in range(reps):
            t0 = time.perf_counter()
            self.dot(self.a, self.b).block_until_ready()
            self.samples.append(2.0 * self.n**3 / (time.perf_counter() - t0))

    @property
    def flops(self) -> float:
        # The median, like the step time: both are sampled in the same interleaved rounds, so they see the same load.
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        # The best sample: the machine's capability under the least interference (a conservative MFU denominator).
        return max(self.samples)


# ----------------------------------------------------------------------------------------------------- one variant
class Case:
    """One compiled training step of one (variant, options) at one scale, with its own donated train state."""

    def __init__(self, spec: str, scale: str, args: argparse.Namespace):
        self.spec, self.scale = spec, scale
        variant, overrides = parse_variant_spec(spec)
        cfg = scale_config(variant, scale)
        model_fields, runtime_fields = dict(cfg.model), dict(cfg.runtime)
        for name in ("n_steps", "scan_unroll", "remat", "dtype", "attention_impl"):
            value = getattr(args, name)
            if value is not None:
                (runtime_fields if name in RUNTIME_FIELD_NAMES else model_fields)[name] = value
        for name, value in overrides.items():
            (runtime_fields if name in RUNTIME_FIELD_NAMES else model_fields)[name] = value
        self.batch = args.batch or cfg.train.batch_size
        self.seq = args.seq or cfg.model.max_len
        model_fields["max_len"] = max(model_fields["max_len"], self.seq)
        self.cfg = ModelConfig.from_dict(model_fields)
        self.runtime = RuntimeConfig.from_dict(runtime_fields)
        train_cfg = TrainConfig.from_dict(cfg.train)

        model = TransformerLM(self.cfg, 0, self.runtime)
        self.n_params = count_params(model)
        graphdef, params = split_model(model)
        del model
        tx = make_optimizer(params, train_cfg)
        step = make_train_step(graphdef, tx)

        rng = np.random.default_rng(0)
        tokens = rng.integers(0, self.cfg.vocab_size, size=(self.batch, self.seq + 1), dtype=np.int32)
        self.batch_arrays = {"inputs": jnp.asarray(tokens[..., :-1]), "targets": jnp.asarray(tokens[..., 1:])}
        self.state = init_train_state(params, tx)
        self.key = jax.random.key(0)
        self.tokens_per_step = self.batch * self.seq
        self.flops_per_step = model_flops_per_step(self.n_params, self.cfg, self.batch, self.seq)

        jitted = jax.jit(step, donate_argnums=0)
        t0 = time.perf_counter()
        lowered = jitted.lower(self.state, self.batch_arrays, self.key)
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        t2 = time.perf_counter()
        self.lower_s, self.compile_s = t1 - t0, t2 - t1
        self.mem_mb = compiled_mem_mb(self.compiled)
        self.times: list[float] = []
        self.loads: list[float] = []
        self.run(2, record=False)  # warm-up: first-touch allocations, thread-pool start

    def run(self, n: int, record: bool = True) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            self.state, metrics = self.compiled(self.state, self.batch_arrays, self.key)
            jax.block_until_ready((self.state, metrics))
            if record:
                self.times.append(time.perf_counter() - t0)
        if record:
            self.loads.append(load())
        self.last_loss = float(np.mean(np.asarray(metrics["loss"])))


# ------------------------------------------------------------------------------------------------------------ main
def bench_scale(scale: str, specs: list[str], args: argparse.Namespace, roof: Roofline | None,
                on_round: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Compile every variant of one scale, then time them in interleaved rounds; returns one record per variant.
    `on_round` receives the records computed so far after every round (so a long run leaves partial results)."""
    cases: dict[str, Case] = {}
    for spec in specs:
        print(f"[{scale}] compiling {spec} (load {load():.1f})", flush=True)
        cases[spec] = Case(spec, scale, args)

    order = list(cases)
    for r in range(args.rounds):
        # Rotate the order every round so that no variant always runs right after the roofline dot.
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            cases[name].run(args.steps_per_round)
        if roof is not None:
            roof.sample()
        print(f"[{scale}] round {r + 1}/{args.rounds} load {load():.1f} "
              + " ".join(f"{n}={1e3 * statistics.median(c.times):.0f}ms" for n, c in cases.items()), flush=True)
        if on_round is not None:
            on_round(make_records(scale, cases, args, roof))
    return make_records(scale, cases, args, roof)


def make_records(scale: str, cases: dict[str, Case], args: argparse.Namespace, roof: Roofline | None) -> list[dict]:
    order = list(cases)
    backend = jax.default_backend()
    peak_flops = roof.flops if roof is not None else args.peak_tflops * 1e12
    std_name = next((n for n in order if parse_variant_spec(n)[0] == "standard"), None)
    std_median = statistics.median(cases[std_name].times) if std_name else None
    std_min = min(cases[std_name].times) if std_name else None
    records = []
    for name in order:
        c = cases[name]
        med = statistics.median(c.times)
        ratio = med / std_median if std_median else None
        records.append({
            "variant": name, "scale": scale,
            "step_ms_median": 1e3 * med,
            "step_ms_min": 1e3 * min(c.times),
            "step_ms_iqr": 1e3 * (float(np.percentile(c.times, 75)) - float(np.percentile(c.times, 25))),
            "n_timed_steps": len(c.times),
            "tokens_per_s": c.tokens_per_step / med,
            "compile_s": c.compile_s, "lower_s": c.lower_s,
            "peak_mem_mb": c.mem_mb if c.mem_mb is not None else rss_peak_mb(),
            "peak_mem_source": "xla_memory_analysis" if c.mem_mb is not None else "rss_high_water",
            "device_peak_mb": device_peak_mb(), "rss_peak_mb": rss_peak_mb(),
            "mfu": c.flops_per_step / med / peak_flops,
            "model_flops_per_step": c.flops_per_step,
            "roofline_flops": peak_flops,
            "roofline_flops_best": roof.best if roof is not None else None,
            "mfu_vs_best_roofline": c.flops_per_step / med / roof.best if roof is not None else None,
            "ratio_vs_standard": ratio,
            # min/min: contention on a shared machine only ever adds time, so the minimum is the least-disturbed
            # step; recorded beside the median ratio as a robustness check.
            "ratio_vs_standard_min": (min(c.times) / std_min if std_min else None),
            "params": c.n_params, "batch": c.batch, "seq": c.seq,
            "n_steps": c.cfg.n_steps, "scan_unroll": c.runtime.scan_unroll, "remat": c.runtime.remat,
            "dtype": c.cfg.dtype,
            "dynamics_backward": c.runtime.dynamics_backward,
            "backend": backend, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "load_median": statistics.median(c.loads), "load_max": max(c.loads), "final_loss": c.last_loss,
        })
    return records


def markdown(records: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| scale | variant | step ms (median) | ×standard | ×standard (min/min) | tokens/s | compile s | mem MB "
             "| MFU | load |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        ratio = "" if r["ratio_vs_standard"] is None else f"{r['ratio_vs_standard']:.3f}"
        rmin = "" if r["ratio_vs_standard_min"] is None else f"{r['ratio_vs_standard_min']:.3f}"
        lines.append(f"| {r['scale']} | `{r['variant']}` | {r['step_ms_median']:.1f} | {ratio} | {rmin} | "
                     f"{r['tokens_per_s']:,.0f} | {r['compile_s']:.2f} | {r['peak_mem_mb']:.0f} | "
                     f"{100 * r['mfu']:.1f}% | {r['load_median']:.1f} |")
    rf = records[0]["roofline_flops"] if records else 0
    lines += ["", f"backend {records[0]['backend'] if records else '?'}, roofline {rf / 1e9:.1f} GFLOP/s, "
              f"jax {jax.__version__}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="tiny", help=f"configs/lm.py scales and/or {', '.join(PEER_SHAPES)}")
    ap.add_argument("--variants", default="standard,coupled_euler,coupled_leapfrog,mlp_only,differential")
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--md", default=None, help="Markdown output (default: --out with .md)")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds (A B C A B C ...)")
    ap.add_argument("--steps_per_round", type=int, default=1, help="timed steps per variant per round")
    ap.add_argument("--batch", type=int, default=None, help="override the scale's configured train batch")
    ap.add_argument("--seq", type=int, default=None, help="override the scale's configured context")
    ap.add_argument("--n_steps", type=int, default=None, help="dynamics steps n for every variant")
    ap.add_argument("--scan_unroll", type=int, default=None)
    ap.add_argument("--remat", default=None, choices=["none", "full", "dots", "nothing_saveable"])
    ap.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    ap.add_argument("--attention_impl", default=None, help="auto|xla|cudnn (default: cudnn on GPU, else auto)")
    ap.add_argument("--peak_tflops", type=float, default=None,
                    help="accelerator peak for MFU (default on CPU: the measured 2048^3 matmul roofline)")
    args = ap.parse_args()

    backend = jax.default_backend()
    if backend == "gpu":
        args.dtype = args.dtype or "bfloat16"
        args.attention_impl = args.attention_impl or "cudnn"
    roof = None
    if args.peak_tflops is None:
        roof = Roofline(dtype=jnp.float32 if (args.dtype or "float32") == "float32" else jnp.dtype(args.dtype))
        roof.sample(3)
        print(f"roofline {roof.flops / 1e9:.1f} GFLOP/s (load {load():.1f})", flush=True)

    command = "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:])

    def write(records: list[dict]) -> str:
        for r in records:
            r["command"] = command
        with open(args.out, "w") as fh:
            json.dump(records, fh, indent=1)
        md = markdown(records, command)
        with open(args.md or os.path.splitext(args.out)[0] + ".md", "w") as fh:
            fh.write(md)
        return md

    records: list[dict] = []
    specs = [s for s in args.variants.split(",") if s]
    for scale in args.scales.split(","):
        records += bench_scale(scale, specs, args, roof, on_round=lambda partial: write(records + partial))
    print(write(records))


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
