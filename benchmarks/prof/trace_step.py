"""Where a compiled train step spends its time: a `jax.profiler` (perfetto) trace of bench_attention's step, with every
XLA op's time attributed to the Python function that emitted it (profile before optimising).

    python benchmarks/prof/trace_step.py --scale tiny-peer --variants standard,coupled_euler,coupled_euler:n_steps=7 \
        --steps 6 --out DIR

For each variant it compiles bench_attention's `Case` (the same donated train step that bench_attention times),
warms it up, traces `--steps` steps, and reads the trace's per-op events (XLA:CPU's thunk executor names each event by
its HLO instruction, `args.hlo_op`). The optimised HLO text names, for every instruction, the stack frame that
emitted it; the innermost frame's function name sorts it into one of the GROUPS below. Times are summed over every
thread, so they are CPU time of XLA's ops (the 2-core pool runs some of them side by side), reported per step and as
shares of the attributed total. Writes DIR/trace_<scale>.json (per variant: groups, top functions, top op kinds) and
keeps each trace under DIR/<variant>/ (open it in perfetto / TensorBoard).

Timings are only meaningful on an idle machine (record the load; the JSON has it).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from coupled_qk_jax.startup import configure_process  # noqa: E402

# Innermost emitting function -> group. Functions not listed fall into "other" and are listed by name in the JSON.
GROUPS = {
    "coupling: f (the MLP) and the q/k updates": ("euler_step", "leapfrog_step", "_axpy", "coupling_mlp", "add_bias",
                                                 "integrate", "_recompute", "_recompute_fwd", "_scan",
                                                 "_scan.<locals>.body", "evolve_heads_batched",
                                                 "CausalSelfAttention.transform_qk"),
    "attention: scores, mask, softmax, values": ("CausalSelfAttention.score", "causal_attention", "_explicit_attention",
                                                 "_exp_and_norm"),
    "projections q/k/v/o": ("CausalSelfAttention.__call__",),
    "block MLP": ("MLP.__call__",),
    "norms": ("Norm.__call__",),
    "head, embeddings, loss": ("TransformerLM.__call__", "masked_cross_entropy",
                               "softmax_cross_entropy_with_integer_labels", "make_loss_fn.<locals>.loss_fn"),
}
OPTIMISER_FILES = ("optax",)


def frame_functions(hlo_text: str) -> dict[int, tuple[str, str]]:
    """stack_frame_id -> (file name, function name) of that frame, from the tables XLA prints before the module."""
    tables: dict[str, dict[int, str]] = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    current = None
    for line in hlo_text.splitlines():
        if line.strip() in tables:
            current = line.strip()
            continue
        if current is None:
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if not m:
            if line.startswith("HloModule") or line.startswith("ENTRY") or line.startswith("%"):
                current = None
            continue
        tables[current][int(m.group(1))] = m.group(2)
    out = {}
    for frame_id, text in tables["StackFrames"].items():
        loc = int(re.search(r"file_location_id=(\d+)", text).group(1))
        loc_text = tables["FileLocations"].get(loc, "")
        file_id = re.search(r"file_name_id=(\d+)", loc_text)
        fn_id = re.search(r"function_name_id=(\d+)", loc_text)
        file_name = tables["FileNames"].get(int(file_id.group(1)), "").strip('"') if file_id else ""
        function = tables["FunctionNames"].get(int(fn_id.group(1)), "").strip('"') if fn_id else ""
        out[frame_id] = (file_name, function)
    return out


def instruction_frames(hlo_text: str) -> dict[str, int]:
    """HLO instruction name -> its stack_frame_id (0 when it has none)."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = [^\n]*", hlo_text, re.M):
        f = re.search(r"stack_frame_id=(\d+)", m.group(0))
        out[m.group(1)] = int(f.group(1)) if f else 0
    return out


def group_of(file_name: str, function: str) -> str:
    if any(tag in file_name for tag in OPTIMISER_FILES) or "train_step" in function:
        return "optimiser and update"
    for group, functions in GROUPS.items():
        if function in functions:
            return group
    return "other"


def attribute(trace_file: str, hlo_text: str, steps: int) -> dict:
    frames = frame_functions(hlo_text)
    instr = instruction_frames(hlo_text)
    events = json.load(gzip.open(trace_file))["traceEvents"]
    by_group: collections.Counter = collections.Counter()
    by_function: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    unattributed = 0.0
    for e in events:
        op = e.get("args", {}).get("hlo_op") if e.get("ph") == "X" else None
        if not op or e.get("args", {}).get("hlo_module") != "jit_train_step":
            continue
        dur_ms = e["dur"] / 1e3 / steps
        by_kind[re.sub(r"[.\d]+$", "", op)] += dur_ms
        frame = instr.get(op)
        if frame is None:
            unattributed += dur_ms
            continue
        file_name, function = frames.get(frame, ("", "(no source)"))
        by_group[group_of(file_name, function)] += dur_ms
        by_function[f"{os.path.basename(file_name)}:{function}"] += dur_ms
    total = sum(by_group.values()) + unattributed
    return {
        "op_cpu_ms_per_step": total,
        "groups_ms": dict(by_group.most_common()),
        "groups_share": {g: v / total for g, v in by_group.most_common()},
        "unattributed_ms": unattributed,
        "top_functions_ms": dict(by_function.most_common(15)),
        "top_op_kinds_ms": dict(by_kind.most_common(12)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="tiny-peer")
    ap.add_argument("--variants", default="standard,coupled_euler,coupled_euler:n_steps=7")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    configure_process()
    import jax

    import bench_attention as bench

    case_args = argparse.Namespace(n_steps=None, scan_unroll=None, remat=None, dtype=None, attention_impl=None,
                                   batch=None, seq=None)
    results = {"command": "python " + " ".join(sys.argv), "jax": jax.__version__, "scale": args.scale, "variants": {}}
    for spec in args.variants.split(","):
        case = bench.Case(spec, args.scale, case_args)
        case.run(2, record=False)
        log_dir = os.path.join(args.out, re.sub(r"[^\w]+", "_", spec))
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python frames would add their own overhead to every step
        with jax.profiler.trace(log_dir, profiler_options=options):
            case.run(args.steps)
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
        trace_file = sorted(glob.glob(os.path.join(log_dir, "plugins/profile/*/*.trace.json.gz")))[-1]
        row = attribute(trace_file, case.compiled.as_text(), args.steps)
        row.update(wall_ms_per_step_traced=wall_ms, load_before=load_before, load_after=os.getloadavg()[0])
        results["variants"][spec] = row
        print(f"{spec}: {wall_ms:.0f} ms/step traced, {row['op_cpu_ms_per_step']:.0f} op-CPU-ms/step")
        for group, share in row["groups_share"].items():
            print(f"  {share:6.1%}  {row['groups_ms'][group]:7.1f} ms  {group}")
        del case
    path = os.path.join(args.out, f"trace_{args.scale}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
