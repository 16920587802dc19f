"""The TPU compiler's view of the coupling's cost: FLOPs, bytes accessed, peak memory and the compiler's step-time
estimate of the train step, per variant, as ratios to `standard` of the same scale, checked against an analytic count.

    python benchmarks/tpu_cost.py --scales 60m,150m --topology v5e:2x2 \
        --variants standard,coupled_euler,coupled_leapfrog,coupled_euler:n_steps=7,coupled_leapfrog:n_steps=7 \
        --out benchmarks/results/tpu_cost_v5e4.json
    python benchmarks/tpu_cost.py --scales tiny --out tpu_cost_tiny.json        # a quick check (4 minutes)

Each cell compiles one optimiser step (forward, backward, AdamW) ahead of time for a TPU topology (default v5e:2x2,
4 chips) with libtpu's compiler on this host (coupled_qk_jax/aot.py), on benchmarks/aot_report.py's config: a pure
FSDP mesh over every chip, one sequence of model.max_len tokens per chip, attention_impl "auto" (splash attention
under shard_map), here in bfloat16 (--dtype). Variant specs may set any model or runtime field after a colon:
`coupled_euler:n_steps=7`, `coupled_leapfrog:n_steps=7:dynamics_backward=autodiff`.

The counting trap. XLA's cost analysis counts a `while` loop's body once, not trip-count times, and two loops hold
most of the work: the scanned layer stack (runtime.scan_layers) and the dynamics' `lax.scan` over the n integration
steps (and the scans of its custom-VJP backward passes). So each cell is compiled in mode "unrolled"
(runtime.scan_layers=False, runtime.scan_unroll=n: no loop is left around a layer or a dynamics step) and, for the
undercount side by side, in mode "scanned" (scan_layers=True, scan_unroll=1, how 60m and up train). The unrolled
count is checked against an analytic one computed from the config (`analytic_flops`): the weight matmuls
6·(non-embedding matmul params + the tied head)·tokens, the coupling's f evaluations as dynamics.py writes them for
the variant's integrator, n and runtime.dynamics_backward, and the causal attention term 6·L·T²·d_model·B only
where attention is no Pallas kernel: XLA counts a splash custom call as 0 FLOPs (standard at tiny: +0.27 GFLOP/chip with
runtime.attention_impl=explicit), so with splash every FLOP ratio leaves attention out. Cells whose count fits no
reading of the analytic one are flagged IMPLAUSIBLE. Two readings besides the code as written, both seen at tiny:
- Euler's recomputing backward (n >= 2) evaluates each f(q_i) twice after one barrier (3n forward evaluations of f
  in all, with n VJPs); unrolled, XLA merges the two (2n): at 60m, n = 7 the coupling's extra is 0.89x the count as
  written and 1.12x the merged one, where autodiff cells run 1.2x from f's elementwise work. The scanned program,
  which is what trains, cannot merge them.
- leapfrog's reversible backward (n >= 2) ends in a lax.cond whose fallback branch (_recompute_bwd) runs only when
  the rebuild drifts; the cost analysis charges the conditional its costlier branch: leapfrog n = 7's extra over
  standard is 2.1x the analytic FLOPs of the path it runs, 1.0x those of the fallback. Its FLOP and bytes figures
  (and the compiler's estimate) overstate what it runs.
The compiler's step-time estimate is cost_analysis()["optimal_seconds"]; libtpu returns it negative (no estimate)
for some programs (the 60m train step), reported as n/a.

Compile time per cell on a shared 2-core host under nice (unrolled / scanned): tiny 20-40 s / 15-26 s; 60m
standard 120 s / 65 s, coupled_euler:n_steps=7 165 s / 46 s (2.6 GB resident). The unrolled program grows with
layers and n, so budget about an hour for the default 60m + 150m grid; --modes unrolled halves the scanned side.

Writes the JSON (command, jax version, commit of the measured checkout, topology, dtype, a row per cell and mode)
and a Markdown table beside it. Resumable: cells already in --out are kept. The script runs from any checkout of
the repository (`cd OTHER && PYTHONPATH=$PWD python /path/to/tpu_cost.py ...`): the package measured is the one on
PYTHONPATH, whose commit is recorded. Needs libtpu (pip install "jax[tpu]==<jax version>").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODES = ("unrolled", "scanned")
DEFAULT_VARIANTS = "standard,coupled_euler,coupled_leapfrog,coupled_euler:n_steps=7,coupled_leapfrog:n_steps=7"
# A cell's unrolled count is flagged when the coupling's extra FLOPs over standard are off the analytic extra by more
# than this factor (either way), or the whole step's count off the analytic one by more than WHOLE_TOLERANCE.
EXTRA_TOLERANCE = 1.5
WHOLE_TOLERANCE = 1.25


# ----------------------------------------------------------------------------------------------------- configs
def cell_config(spec: str, scale: str, chips: int, dtype: str, mode: str) -> Any:
    """aot_report's config of (variant, scale) on `chips` (pure FSDP, one sequence per chip) with the spec's
    overrides, `dtype`, and the layer and dynamics loops of `mode`."""
    from aot_report import config  # noqa: PLC0415 - this script's siblings (the script's own folder is on sys.path)
    from bench_attention import parse_variant_spec  # noqa: PLC0415

    from coupled_qk_jax.config import RUNTIME_FIELD_NAMES  # noqa: PLC0415

    variant, overrides = parse_variant_spec(spec)
    cfg = config(variant, scale, chips)
    cfg.model.dtype = dtype
    for key, value in overrides.items():
        block = cfg.runtime if key in RUNTIME_FIELD_NAMES else cfg.model
        if key not in block:
            raise ValueError(f"{spec}: {key!r} is neither a model nor a runtime field")
        block[key] = value
    if mode == "unrolled":
        # No while loop left around a layer or a dynamics step: every f evaluation is in the straight-line program.
        cfg.runtime.scan_layers = False
        cfg.runtime.scan_unroll = cfg.model.n_steps
    else:
        cfg.runtime.scan_layers = True
        cfg.runtime.scan_unroll = overrides.get("scan_unroll", 1)
    return cfg


# ------------------------------------------------------------------------------------------------ analytic count
def n1_uses_autodiff() -> bool:
    """Whether the measured checkout's "reversible" backward is plain autodiff at n = 1 (newer dynamics.py) rather
    than the custom VJP (older): the two evaluate f a different number of times. Read off a traced gradient rather
    than the source, so any checkout answers for itself."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from coupled_qk_jax import dynamics  # noqa: PLC0415

    x = jnp.ones((2, 4))
    loss = lambda q: jnp.sum(dynamics.integrate(q, x, 0.1, jnp.tanh, 1, "euler", backward="reversible")[0])
    return "custom_vjp" not in str(jax.make_jaxpr(loss)(x))


def f_counts(method: str, n: int, backward: str, n1_autodiff: bool) -> dict[str, int]:
    """f evaluations (forward) and f VJPs per token-head of one train step, as dynamics.py writes them.

    forward: the primal map; backward_forward: f's forward evaluations in the backward pass (recomputed states,
    the f(q_i) inside each step's VJP); vjps: pullbacks of f (an input and a weight gradient each). Two other counts
    where the compiled program may differ from the code as written: `cse_backward_forward` (Euler and the ablation's
    recomputing backward evaluates each f(q_i) twice after one barrier: unrolled, XLA may merge the two) and, for
    leapfrog's reversible backward, `fallback_*`: the lax.cond branch taken only when the rebuild drifts
    (_recompute_bwd), which a cost analysis may charge in place of the rebuild as the conditional's costlier branch."""
    per_step = 2 if method == "uncoupled" else 1  # the ablation applies f to q and to k
    autodiff = backward == "autodiff" or (n == 1 and n1_autodiff)
    if method == "leapfrog":
        forward = n + 1  # the closing half-kick's f(q_{i+1}) is carried into the next step (dynamics._scan)
        if autodiff:
            return {"forward": forward, "backward_forward": 0, "vjps": forward}
        # F_n = f(q_n) once, then one f and one VJP per step walking back (_leapfrog_reversible_bwd). The fallback
        # re-runs leapfrog_step (2 f per step) and pulls back through each step (2 f and 2 VJPs); F_n's f and VJP
        # sit before the conditional, so they count in both.
        return {"forward": forward, "backward_forward": n + 1, "vjps": n + 1,
                "fallback_backward_forward": 1 + 4 * n, "fallback_vjps": 1 + 2 * n}
    forward = per_step * n
    if autodiff:
        return {"forward": forward, "backward_forward": 0, "vjps": forward}
    # _recompute_bwd: the steps re-run from the inputs (n f), then each step's jax.vjp evaluates its f again.
    return {"forward": forward, "backward_forward": 2 * forward, "vjps": forward, "cse_backward_forward": forward}


def analytic_flops(model: Any, runtime: Any, batch: int, seq: int, n1_autodiff: bool,
                   attention_visible: bool) -> dict[str, Any]:
    """Matmul FLOPs of one train step, all chips together, by term, and `total`: what the cost analysis should count.

    Elementwise work (norms, softmax, the loss, AdamW, the dynamics' axpys and SiLU) is left out: XLA counts it too,
    so measured/analytic sits a little above 1 (the coupling's own elementwise work adds 10-30% to its matmuls at
    these widths). `attention_visible`: False where attention runs in a Pallas kernel (splash), a custom call whose
    FLOPs XLA's cost analysis does not see (measured: it counts 0), so `total` leaves the attention term out."""
    from coupled_qk_jax.config import DYNAMICS_METHOD  # noqa: PLC0415

    d, layers, tokens = model.d_model, model.n_layers, batch * seq
    # Forward 2 FLOPs per weight and token, backward 4 (input and weight gradients). q, k, v, o: 4·d²; the MLP:
    # 2·d·d_ff; the tied head: vocab·d (the token embedding's own lookup and its scatter-add are no matmul).
    matmul_params = layers * (4 * d * d + 2 * d * model.d_ff) + model.vocab_size * d
    out: dict[str, Any] = {"dense": 6.0 * matmul_params * tokens,
                           # QKᵀ and AV: 4·T²·d per sequence and layer forward, twice that backward.
                           "attention_full": 12.0 * layers * seq * seq * d * batch}
    out["attention_causal"] = out["attention_full"] / 2  # splash skips the causal mask's empty blocks
    out["coupling"] = 0.0
    method = DYNAMICS_METHOD.get(model.qk_transform)
    if method is not None:
        counts = f_counts(method, model.n_steps, runtime.dynamics_backward, n1_autodiff)
        rows = float(tokens * model.n_heads * layers)  # f runs on every token's every head in every layer
        f_fwd = 2 * 2 * model.head_dim * model.coupling_hidden  # d_head -> hidden -> d_head
        f_vjp = 2 * f_fwd  # the input gradient and the weight gradient
        cost = lambda fwd, vjps: rows * (fwd * f_fwd + vjps * f_vjp)
        out["coupling"] = cost(counts["forward"] + counts["backward_forward"], counts["vjps"])
        if "cse_backward_forward" in counts:
            out["coupling_cse"] = cost(counts["forward"] + counts["cse_backward_forward"], counts["vjps"])
        if "fallback_vjps" in counts:
            out["coupling_fallback"] = cost(counts["forward"] + counts["fallback_backward_forward"],
                                            counts["fallback_vjps"])
        out["f_counts"] = counts
    out["attention_counted"] = attention_visible
    out["total"] = out["dense"] + out["coupling"] + (out["attention_causal"] if attention_visible else 0.0)
    return out


# -------------------------------------------------------------------------------------------------- compiling
class _KeepCompiled:
    """A jitted function whose lower().compile() keeps the compiled executable. aot._compile keeps only a summary
    (StepReport) of the cost analysis; this keeps the executable for the whole dict, without a second compile."""

    def __init__(self, jitted: Any):
        self.jitted, self.compiled = jitted, None

    def lower(self, *args: Any) -> Any:
        lowered, keeper = self.jitted.lower(*args), self

        class Lowered:
            def compile(self) -> Any:
                keeper.compiled = lowered.compile()
                return keeper.compiled

            def __getattr__(self, name: str) -> Any:  # compiler_ir etc., for aot.kernel_calls
                return getattr(lowered, name)

        return Lowered()


def compile_train(cfg: Any, devices: list) -> tuple[dict[str, Any], Any, Any]:
    """aot.compile_steps' train step of `cfg` on `devices`: (its result, the StepReport, the compiled executable)."""
    from coupled_qk_jax import aot  # noqa: PLC0415

    kept: list[_KeepCompiled] = []
    original = aot._compile

    def keeping(name: str, jitted: Any, *args: Any) -> Any:
        kept.append(_KeepCompiled(jitted))
        return original(name, kept[-1], *args)

    aot._compile = keeping
    try:
        result = aot.compile_steps(cfg, devices, steps=("train",))
    finally:
        aot._compile = original
    return result, result["steps"][0], kept[0].compiled


def cost_dict(compiled: Any) -> dict[str, float]:
    """compiled.cost_analysis() as one flat dict (a list of one dict per program in some jax versions)."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return {str(k): float(v) for k, v in cost.items() if isinstance(v, (int, float))}


def cost_summary(cost: dict[str, float]) -> dict[str, Any]:
    """The whole-program entries of a cost dict, and how many per-operand entries each indexed family holds
    (libtpu adds "bytes accessed0{}", "bytes accessedout{1}", "utilization17{}", ... per operand and per unit)."""
    families: dict[str, int] = {}
    for key in cost:
        if "{" in key:
            family = key[:key.index("{")].rstrip("0123456789").removesuffix("out")
            families[family] = families.get(family, 0) + 1
    return {"totals": {k: v for k, v in cost.items() if "{" not in k}, "indexed_families": families}


def estimated_seconds(cost: dict[str, float]) -> tuple[str | None, float | None]:
    """The compiler's own step-time estimate, where the cost analysis gives one: (its key, seconds)."""
    for key in ("optimal_seconds", "estimated_seconds", "seconds"):
        if cost.get(key, 0.0) > 0:
            return key, cost[key]
    return None, None


def measure(spec: str, scale: str, mode: str, topology: str, devices: list, dtype: str,
            n1_autodiff: bool) -> dict[str, Any]:
    from coupled_qk_jax.training.config import RunConfig  # noqa: PLC0415

    cfg = cell_config(spec, scale, len(devices), dtype, mode)
    run = RunConfig.from_configdict(cfg)
    t0 = time.perf_counter()
    result, report, compiled = compile_train(cfg, devices)
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = cost_dict(compiled)
    estimate_key, estimate = estimated_seconds(cost)
    analytic = analytic_flops(run.model, run.runtime, run.train.batch_size, run.data.seq_len, n1_autodiff,
                              attention_visible=report.kernels == 0)
    return {"variant": spec, "scale": scale, "mode": mode, "topology": topology, "chips": len(devices),
            "n_steps": run.model.n_steps, "scan_layers": run.runtime.scan_layers,
            "scan_unroll": run.runtime.scan_unroll, "dynamics_backward": run.runtime.dynamics_backward,
            "n_params": result["n_params"], "cell_s": seconds, "compile_s": report.compile_s,
            "flops": cost.get("flops", 0.0), "bytes_accessed": cost.get("bytes accessed", 0.0),
            "transcendentals": cost.get("transcendentals", 0.0),
            # Per device: inputs + outputs + temporaries, less the outputs that reuse a donated input's buffer.
            "peak_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                              - mem.alias_size_in_bytes),
            "argument_bytes": report.argument_bytes, "output_bytes": report.output_bytes,
            "temp_bytes": report.temp_bytes, "alias_bytes": report.alias_bytes, "code_bytes": report.code_bytes,
            "estimate_key": estimate_key, "estimated_s": estimate,
            "analytic": {k: v / len(devices) if isinstance(v, float) else v for k, v in analytic.items()},
            "collectives": report.collectives, "kernels": report.kernels,
            "kernels_in_manual": report.kernels_in_manual, "cost": cost_summary(cost)}


# ------------------------------------------------------------------------------------------------ ratios, flags
FIGURES = ("flops", "bytes_accessed", "peak_bytes", "estimated_s")


def add_ratios(rows: list[dict]) -> None:
    """Each figure over `standard`'s of the same scale, topology and mode; the unrolled count over the analytic one;
    the coupling's measured extra over its analytic extra; and a flag where the count cannot be right, or matches
    the program only as the compiler transformed it (CSE'd recomputation, a conditional's costlier branch)."""
    base = {(r["scale"], r["topology"], r["mode"]): r for r in rows if r["variant"] == "standard" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        std = base.get((r["scale"], r["topology"], r["mode"]))
        r["ratio"] = {k: (r[k] / std[k] if std and r.get(k) and std.get(k) else None) for k in FIGURES}
        a = r["analytic"]
        r["flops_over_analytic"] = r["flops"] / a["total"] if a["total"] else None
        extra = r["flops"] - std["flops"] if std else None
        r["extra_over_analytic"] = {k: extra / a[k] for k in ("coupling", "coupling_cse", "coupling_fallback")
                                    if extra is not None and a.get(k)}
        flags = []
        if r["mode"] == "scanned":
            flags.append("scanned: loop bodies counted once")
        else:
            # The step's count against the analytic total with the coupling counted either way (as written, or as
            # the compiler may have transformed it): implausible only where no reading fits.
            totals = [a["total"] - a["coupling"] + a[k] for k in ("coupling", "coupling_cse", "coupling_fallback")
                      if k in a]
            if a["total"] and not any(1 / WHOLE_TOLERANCE <= r["flops"] / t <= WHOLE_TOLERANCE for t in totals):
                flags.append(f"IMPLAUSIBLE: step count {r['flops_over_analytic']:.2f}x analytic")
            fits = {k: v for k, v in r["extra_over_analytic"].items() if 1 / EXTRA_TOLERANCE <= v <= EXTRA_TOLERANCE}
            if r["extra_over_analytic"] and not fits:
                flags.append(f"IMPLAUSIBLE: coupling extra {r['extra_over_analytic']['coupling']:.2f}x analytic")
            elif r["extra_over_analytic"] and "coupling" not in fits:
                why = {"coupling_cse": "XLA merged the recomputing backward's duplicate f evaluations",
                       "coupling_fallback": "the lax.cond is charged its costlier (fallback) branch"}
                best = min(fits, key=lambda k: abs(fits[k] - 1))
                flags.append(f"extra {fits[best]:.2f}x the count if {why[best]}")
        r["flags"] = flags


# ------------------------------------------------------------------------------------------------------ output
def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    legend = (f"`{doc['command']}` at {doc['commit']}, jax {doc['jax']} with libtpu's compiler on a CPU host; "
              f"{doc['topology']}, {doc['dtype']}, one sequence per chip, pure FSDP. Figures are per chip for one "
              "train step (forward, backward, AdamW); × std: over `standard` of the same scale and mode. unrolled: "
              "runtime.scan_layers=False and scan_unroll=n (every f evaluation counted); scanned: "
              "scan_layers=True, scan_unroll=1 (XLA counts each while body once, so FLOPs read low). analytic: "
              "matmul FLOPs, weights + coupling as dynamics.py writes it (+ causal attention where no Pallas kernel "
              "hides it: XLA counts a splash custom call as 0 FLOPs, so FLOP ratios leave attention out); "
              "extra/analytic: (FLOPs − standard's) over the coupling's analytic FLOPs. peak: arguments + outputs + "
              "temporaries − aliased. est. ms: cost_analysis()['optimal_seconds'], n/a where libtpu gives none "
              "(a negative value).")
    header = ("| variant | scale | mode | compile s | GFLOP | × std | analytic GFLOP | meas/analytic | extra/analytic "
              "| GB accessed | × std | peak GiB | × std | est. ms | × std | flags |")
    lines = [legend, "", header, "|" + " --- |" * 16]
    scales = list(dict.fromkeys(r["scale"] for r in rows))  # in the order they ran
    order = {m: i for i, m in enumerate(MODES)}
    for r in sorted(rows, key=lambda r: (scales.index(r["scale"]), order.get(r["mode"], 9))):
        head = f"| `{r['variant']}` | {r['scale']} | {r['mode']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} |" + " |" * 13)
            continue
        q = r["ratio"]
        est = r["estimated_s"] * 1e3 if r["estimated_s"] else None
        lines.append(f"{head} {r['compile_s']:.0f} | {r['flops'] / 1e9:.1f} | {_fmt(q['flops'], '.3f')} | "
                     f"{r['analytic']['total'] / 1e9:.1f} | {_fmt(r['flops_over_analytic'], '.3f')} | "
                     f"{_fmt(r['extra_over_analytic'].get('coupling'), '.2f')} | {r['bytes_accessed'] / 1e9:.2f} | "
                     f"{_fmt(q['bytes_accessed'], '.3f')} | {r['peak_bytes'] / 2**30:.3f} | "
                     f"{_fmt(q['peak_bytes'], '.3f')} | {_fmt(est, '.2f')} | {_fmt(q['estimated_s'], '.3f')} | "
                     f"{'; '.join(r['flags'])} |")
    return "\n".join(lines) + "\n"


def checkout_commit() -> str:
    """The commit of the checkout whose coupled_qk_jax is measured (the one on PYTHONPATH), '+dirty' if edited."""
    import coupled_qk_jax  # noqa: PLC0415

    where = os.path.dirname(os.path.dirname(os.path.abspath(coupled_qk_jax.__file__)))
    git = lambda *a: subprocess.run(["git", "-C", where, *a], capture_output=True, text=True,
                                      check=False).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", "coupled_qk_jax")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if dirty else "")


def main() -> None:
    import jax  # noqa: PLC0415 - after configure_process

    from coupled_qk_jax import aot  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated variant specs")
    parser.add_argument("--scales", default="60m,150m")
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--modes", default=",".join(MODES), help="unrolled, scanned or both")
    parser.add_argument("--out", required=True, help="JSON file; a Markdown table is written beside it")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        parser.error(f"--modes: expected some of {MODES}, got {args.modes!r}")
    variants = args.variants.split(",")
    if "standard" not in variants:  # every ratio is to standard
        variants.insert(0, "standard")
    doc = {"command": " ".join(sys.argv), "jax": jax.__version__, "commit": checkout_commit(),
           "topology": args.topology, "dtype": args.dtype, "rows": []}
    if os.path.exists(args.out):  # resumable: cells already written are kept
        with open(args.out) as f:
            doc["rows"] = json.load(f)["rows"]
    done = {(r["variant"], r["scale"], r["mode"], r["topology"]) for r in doc["rows"]}
    devices = aot.topology_devices(args.topology)
    n1_autodiff = n1_uses_autodiff()
    doc["n1_reversible_is_autodiff"] = n1_autodiff
    keys_shown = False
    for scale in args.scales.split(","):
        for mode in modes:
            for spec in variants:
                if (spec, scale, mode, args.topology) in done:
                    continue
                try:
                    row = measure(spec, scale, mode, args.topology, devices, args.dtype, n1_autodiff)
                except Exception as e:  # a cell that fails (memory, a compiler error) is recorded, the rest run
                    row = {"variant": spec, "scale": scale, "mode": mode, "topology": args.topology,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                    print(f"{spec} {scale} {mode}: FAILED {row['error']}", flush=True)
                else:
                    if not keys_shown:  # what this libtpu's cost analysis returns, once
                        print("cost_analysis keys:", ", ".join(sorted(row["cost"]["totals"])),
                              "and per-operand families", row["cost"]["indexed_families"], flush=True)
                        keys_shown = True
                    print(f"{spec} {scale} {mode}: compile {row['compile_s']:.0f} s, {row['flops'] / 1e9:.1f} "
                          f"GFLOP/chip ({row['flops'] / row['analytic']['total']:.3f}x analytic), "
                          f"{row['bytes_accessed'] / 1e9:.2f} GB accessed, peak {row['peak_bytes'] / 2**30:.3f} GiB, "
                          f"estimate {row['estimated_s']}", flush=True)
                doc["rows"].append(row)
                add_ratios(doc["rows"])
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table(doc))


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
