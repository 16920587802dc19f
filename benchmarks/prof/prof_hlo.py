"""Compile-level profile of the bench_attention train step: no timing, only XLA's own accounting.

    PYTHONPATH=ROOT nice -n 10 python prof_hlo.py --root ROOT --label old --out DIR [--variants a,b,...]

ROOT is a checkout of any commit; its own benchmarks/bench_attention.py builds the step (its Case class), with the
warm-up steps skipped. Commits whose bench script has no `tiny-peer` scale get the peer config built the way later
commits' `scale_config` builds it (lm tiny + d_model 128, 4 layers, 4 heads, d_ff 512, vocab 8192, T 256, LayerNorm,
coupling_hidden 4*d_head, batch 8). For each variant: cost_analysis (flops, bytes accessed, transcendentals),
memory_analysis (temp), and counts from compiled.as_text() (fusions, custom calls, whiles, copies, transposes,
instructions, dots + their FLOPs, and per-source-file attribution from the instructions' metadata).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import sys


def load_bench(root):
    sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(root, "benchmarks/bench_attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def patch_peer(bench):
    """Old bench scripts: make lm.get_config understand 'VARIANT,tiny-peer' like later scale_config."""
    if hasattr(bench, "PEER_SHAPES"):
        return
    lm = bench.lm
    orig = lm.get_config

    def get_config(arg):
        variant, _, scale = arg.partition(",")
        if scale != "tiny-peer":
            return orig(arg)
        d_model, batch = 128, 8
        cfg = orig(f"{variant},tiny")
        cfg.scale = scale
        cfg.model.update(d_model=d_model, n_layers=4, n_heads=4, d_ff=4 * d_model, vocab_size=8192, max_len=256,
                         norm="layernorm", coupling_hidden=4 * (d_model // 4))
        cfg.train.batch_size = batch
        return cfg

    lm.get_config = get_config


# The HLO-text parsing helpers are hlo_ops.py's (this file's folder is on sys.path when it runs as a script).
from hlo_ops import INSTR_RE, dims, nbytes  # noqa: E402


def src_tag(line):
    m = re.search(r'source_file="([^"]+)"', line)
    if not m:
        return "-"
    f = m.group(1)
    if "coupled_qk_jax" in f:
        return f.split("coupled_qk_jax/")[-1]
    if "optax" in f:
        return "optax"
    if "flax" in f:
        return "flax"
    if "jax/" in f:
        return "jax-internal"
    return os.path.basename(f)


def analyse_hlo(text):
    """Counts over the optimised module; 'top' = instructions of non-fused computations (entry, while bodies...)."""
    comps = []  # (name, is_fused, lines)
    cur = None
    for line in text.splitlines():
        if re.match(r"^(ENTRY\s+)?%?[\w.\-]+\s.*\{\s*$", line) and not line.startswith(" "):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            cur = [name.lstrip("%"), None, []]
            comps.append(cur)
            continue
        if cur is not None and line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            cur[2].append(line)
    # fused computations are those called via calls= from a fusion instruction
    fused_names = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", text))
    res = collections.Counter()
    by_src = collections.defaultdict(collections.Counter)
    opcodes_top = collections.Counter()
    opcodes_fused = collections.Counter()
    dot_flops_by_src = collections.Counter()
    for name, _, lines in comps:
        fused = name in fused_names
        res["computations"] += 1
        res["fused_computations"] += int(fused)
        for line in lines:
            m = INSTR_RE.match(line)
            if not m:
                continue
            _, out_shape, op, rest = m.groups()
            res["instructions"] += 1
            src = src_tag(line)
            (opcodes_fused if fused else opcodes_top)[op] += 1
            if not fused:
                res["top_instructions"] += 1
                by_src[src]["top_ops"] += 1
                if op not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                    by_src[src]["top_bytes_out"] += nbytes(out_shape)
                    res["top_bytes_out"] += nbytes(out_shape)
            by_src[src]["all_ops"] += 1
            if op == "dot":
                out = dims(out_shape)
                lhs = dims(rest)
                mc = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
                contract = 1
                if mc and lhs:
                    for d in mc.group(1).split(","):
                        if d:
                            contract *= lhs[int(d)]
                n = 1
                for d in out:
                    n *= d
                fl = 2 * n * contract
                dot_flops_by_src[src] += fl
                res["dot_flops"] += fl
                res["dots"] += 1
                by_src[src]["dots"] += 1
    res["fusion_calls"] = opcodes_top["fusion"]
    res["custom_calls"] = opcodes_top["custom-call"] + opcodes_fused["custom-call"]
    res["whiles"] = opcodes_top["while"]
    res["copies_top"] = opcodes_top["copy"]
    res["copies_in_fusions"] = opcodes_fused["copy"]
    res["transposes_top"] = opcodes_top["transpose"]
    res["transposes_in_fusions"] = opcodes_fused["transpose"]
    res["opt_barriers"] = opcodes_top["opt-barrier"]
    return dict(res), {k: dict(v) for k, v in by_src.items()}, dict(opcodes_top), dict(opcodes_fused), \
        dict(dot_flops_by_src)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="standard,coupled_euler,coupled_euler:n_steps=7,coupled_leapfrog")
    ap.add_argument("--scale", default="tiny-peer")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bench = load_bench(os.path.abspath(args.root))
    patch_peer(bench)
    bench.Case.run = lambda self, n, record=True: None  # no warm-up steps: nothing is executed
    ns = argparse.Namespace(n_steps=None, scan_unroll=None, remat=None, dtype=None, attention_impl=None,
                            batch=None, seq=None)
    import jax
    records = []
    for spec in args.variants.split(","):
        case = bench.Case(spec, args.scale, ns)
        c = case.compiled
        ca = c.cost_analysis()
        if isinstance(ca, list):
            ca = ca[0]
        ma = c.memory_analysis()
        text = c.as_text()
        fname = os.path.join(args.out, f"{args.label}_{spec.replace(':', '_').replace('=', '')}.hlo.txt")
        with open(fname, "w") as fh:
            fh.write(text)
        counts, by_src, op_top, op_fused, dot_src = analyse_hlo(text)
        rec = {"label": args.label, "variant": spec, "jax": jax.__version__, "params": case.n_params,
               "batch": case.batch, "seq": case.seq,
               "flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed"),
               "transcendentals": ca.get("transcendentals"),
               "temp_bytes": ma.temp_size_in_bytes, "arg_bytes": ma.argument_size_in_bytes,
               "out_bytes": ma.output_size_in_bytes, "alias_bytes": getattr(ma, "alias_size_in_bytes", 0),
               "compile_s": case.compile_s, **counts, "by_src": by_src, "dot_flops_by_src": dot_src,
               "opcodes_top": op_top, "opcodes_fused": op_fused, "hlo_file": os.path.basename(fname),  # beside the JSON
               "model_cfg": {k: v for k, v in vars(case.cfg).items()} if hasattr(case.cfg, "__dict__") else None,
               # the runtime block (remat, scan_unroll, ...); a checkout from before it kept them in model_cfg
               "runtime_cfg": dict(vars(case.runtime)) if hasattr(case, "runtime") else None}
        records.append(rec)
        print(json.dumps({k: rec[k] for k in ("label", "variant", "flops", "bytes_accessed", "transcendentals",
                                               "temp_bytes", "fusion_calls", "instructions", "whiles",
                                               "copies_top", "transposes_top", "custom_calls", "dots")}), flush=True)
        del case
    with open(os.path.join(args.out, f"{args.label}.json"), "w") as fh:
        json.dump(records, fh, indent=1, default=str)


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
