"""The parts of benchmarks/accelerator_check.sh, one per process; each writes a JSON file, `report` joins them.

    python benchmarks/accelerator_check.py grads      [--small] --json OUT.json
    python benchmarks/accelerator_check.py attention  [--small] --json OUT.json
    python benchmarks/accelerator_check.py pallas     [--small] --json OUT.json
    python benchmarks/accelerator_check.py step --scale 60m --variant coupled_euler [--small] --json OUT.json
    python benchmarks/accelerator_check.py report --parts DIR --out benchmarks/results/gpu_DATE

grads:     bf16 against fp32 gradients of every variant (same params and batch): per parameter leaf the cosine
           similarity and the norm ratio; a leaf fails below cosine 0.99 or off by more than 5% in norm.
attention: kernels.attend with impl="cudnn" against impl="explicit", bf16, forward and gradients
           (softmax and the differential mix); on a machine without cuDNN it records that and compares "xla".
pallas:    the Pallas GPU (Triton) kernel (impl="pallas") timed against cuDNN and the explicit path:
           forward + backward median ms and the error against the explicit path, for bf16 softmax (cuDNN's case),
           float32 softmax and the differential mix from bf16 inputs (float32 per-head outputs; cuDNN cannot).
           With --small on a CPU the kernel runs in Pallas' interpreter and cuDNN is left out.
step:      the real train step (sharding.jit_sharded, AdamW, bf16, the config's model with scanned layers)
           on random tokens: median step time over 10 steps after 3 warm-up steps, tokens/s, MFU against the
           device's bf16 peak (6N + 12·L·T·d FLOPs per token, benchmarks/memory_model.flops_per_token), the device's
           peak memory (memory_stats) and compiled.memory_analysis().
--small shrinks every shape so that the parts run on a CPU in seconds (what the repository checks; no numbers from
it are results).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from coupled_qk_jax import kernels, sharding as shd  # noqa: E402
from coupled_qk_jax.kernels import attend as causal_attention  # noqa: E402
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig, RuntimeConfig  # noqa: E402
from coupled_qk_jax.model import TransformerLM  # noqa: E402
from coupled_qk_jax.training import steps  # noqa: E402
from coupled_qk_jax.training.config import TrainConfig  # noqa: E402

# Dense bf16 peaks (FLOP/s) by device kind substring; MFU is left out for an unknown device.
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def device_info() -> dict:
    d = jax.devices()[0]
    return {"platform": d.platform, "device": d.device_kind, "jax": jax.__version__}


def part_grads(small: bool) -> dict:
    shape = dict(vocab_size=512, max_len=256, d_model=256, n_layers=4, n_heads=8, d_ff=1024, coupling_hidden=24,
                 affine_hidden=24)
    b, t = 8, 256
    if small:
        shape, b, t = dict(vocab_size=64, max_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64, coupling_hidden=8,
                           affine_hidden=8), 2, 32
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape["vocab_size"], (b, t + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    out = {}
    for variant in ALL_VARIANTS:
        grads = {}
        params = None
        for dtype in ("float32", "bfloat16"):
            graphdef, p = steps.split_model(TransformerLM(ModelConfig(variant=variant, dtype=dtype, **shape), 0))
            if params is None:  # off init, so that every transform acts (f's output layer starts at zero)
                params = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(1), x.shape), p)
            loss_fn = steps.make_loss_fn(graphdef)
            grads[dtype] = jax.jit(jax.grad(lambda q: loss_fn(q, batch)[0]))(params)
        leaves = []
        for (path, g32), g16 in zip(jax.tree_util.tree_flatten_with_path(grads["float32"])[0],
                                    jax.tree.leaves(grads["bfloat16"])):
            a, c = np.asarray(g32, np.float64).ravel(), np.asarray(g16, np.float64).ravel()
            na, nc = np.linalg.norm(a), np.linalg.norm(c)
            cos = float(a @ c / (na * nc)) if na > 0 and nc > 0 else float(na == nc)
            leaves.append({"leaf": jax.tree_util.keystr(path), "cosine": cos,
                           "norm_ratio": float(nc / na) if na > 0 else float("nan")})
        bad = [x for x in leaves if x["cosine"] < 0.99 or not abs(x["norm_ratio"] - 1) <= 0.05]
        out[variant] = {"min_cosine": min(x["cosine"] for x in leaves),
                        "max_norm_error": max(abs(x["norm_ratio"] - 1) for x in leaves), "failing": bad}
    return {"part": "grads", "status": "ok", "shape": {**shape, "batch": b, "seq": t}, "variants": out}


def part_attention(small: bool) -> dict:
    b, t, h, d = (4, 1024, 8, 64) if not small else (1, 64, 2, 16)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, co = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys)
    lam = jnp.float32(0.3)
    mix = jnp.tile(jnp.stack([jnp.ones_like(lam), -lam]), h // 2)
    fused = "cudnn" if jax.default_backend() == "gpu" else "xla"
    out = {"fused": fused, "shape": [b, t, h, d]}
    for name, m, vv, cot in (("softmax", None, v, co), ("differential", mix, v.reshape(b, t, h // 2, 2 * d),
                                                        co.reshape(b, t, h // 2, 2 * d))):
        def loss(q, k, v, impl, m=m, cot=cot):
            return jnp.sum(causal_attention(q, k, v, m, impl).astype(jnp.float32) * cot.astype(jnp.float32))

        res = {}
        for impl in ("explicit", fused):
            o = jax.jit(lambda q, k, v, impl=impl, m=m: causal_attention(q, k, v, m, impl))(q, k, vv)
            g = jax.jit(jax.grad(lambda q, k, v, impl=impl: loss(q, k, v, impl), argnums=(0, 1, 2)))(q, k, vv)
            res[impl] = (np.asarray(o, np.float32), [np.asarray(x, np.float32) for x in g])
        (o1, g1), (o2, g2) = res["explicit"], res[fused]
        scale = float(np.max(np.abs(o1)))
        out[name] = {"forward_max_abs_err": float(np.max(np.abs(o1 - o2))), "forward_max_abs": scale,
                     "grad_rel_err": [float(np.linalg.norm(a - c) / np.linalg.norm(a)) for a, c in zip(g1, g2)]}
    return {"part": "attention", "status": "ok", **out}


def part_pallas(small: bool) -> dict:

    b, t, h, d = (4, 1024, 8, 64) if not small else (1, 64, 2, 16)
    on_gpu = jax.default_backend() == "gpu"
    kernels.gpu.INTERPRET = not on_gpu  # on a CPU (--small): the same kernel, interpreted
    keys = jax.random.split(jax.random.key(0), 4)
    lam = jnp.float32(0.3)
    mix = jnp.tile(jnp.stack([jnp.ones_like(lam), -lam]), h // 2)
    out = {"shape": [b, t, h, d], "interpreted": not on_gpu}
    cases = (("softmax_bf16", jnp.bfloat16, None, ("explicit", "cudnn", "pallas")),
             ("softmax_fp32", jnp.float32, None, ("explicit", "pallas")),
             ("differential_bf16", jnp.bfloat16, mix, ("explicit", "pallas")))
    for name, dtype, m, impls in cases:
        q, k, v, co = (jax.random.normal(kk, (b, t, h, d), dtype) for kk in keys)
        if m is not None:
            v, co = v.reshape(b, t, h // 2, 2 * d), co.reshape(b, t, h // 2, 2 * d)
        res = {}
        for impl in impls:
            if impl == "cudnn" and not on_gpu:
                continue
            fn = jax.jit(jax.value_and_grad(
                lambda q, k, v, impl=impl, m=m, co=co: jnp.sum(
                    causal_attention(q, k, v, m, impl).astype(jnp.float32) * co.astype(jnp.float32)),
                argnums=(0, 1, 2)))
            try:
                loss, grads = jax.block_until_ready(fn(q, k, v))  # compile and first run
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v))
                    times.append(time.perf_counter() - t0)
                o = jax.jit(lambda q, k, v, impl=impl, m=m: causal_attention(q, k, v, m, impl))(q, k, v)
                res[impl] = {"ms": 1e3 * statistics.median(times), "out_dtype": str(o.dtype),
                             "o": np.asarray(o, np.float32), "g": [np.asarray(x, np.float32) for x in grads]}
            except Exception as e:  # noqa: BLE001 - a kernel that fails is reported, the others still run
                res[impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
        ref = res.get("explicit", {})
        row = {}
        for impl, r in res.items():
            if "error" in r or "o" not in ref:
                row[impl] = {"error": r.get("error", "no explicit reference")}
                continue
            row[impl] = {"fwd_bwd_ms": r["ms"], "out_dtype": r["out_dtype"],
                         "forward_max_abs_err": float(np.max(np.abs(r["o"] - ref["o"]))),
                         "grad_rel_err": [float(np.linalg.norm(a - c) / np.linalg.norm(a))
                                          for a, c in zip(ref["g"], r["g"])]}
        out[name] = row
    return {"part": "pallas", "status": "ok", **out}


def part_step(scale: str, variant: str, small: bool) -> dict:
    from benchmarks.memory_model import flops_per_token  # noqa: PLC0415
    from coupled_qk_jax.configs import lm  # noqa: PLC0415  (ml_collections: from the carried wheels)
    from coupled_qk_jax.training import optimizer  # noqa: PLC0415

    base = lm.get_config(f"{variant},{scale}")
    cfg = dataclasses.replace(ModelConfig.from_dict(base.model.to_dict()), dtype="bfloat16")
    runtime = RuntimeConfig.from_dict(base.runtime.to_dict())  # the preset's layout, remat and kernel
    batch, seq = 16, int(base.data.seq_len)
    if small:
        cfg, batch, seq = dataclasses.replace(cfg, n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=256,
                                              max_len=64, coupling_hidden=12, affine_hidden=12), 2, 64
    graphdef, params = steps.split_model(TransformerLM(cfg, 0, runtime))
    tx = optimizer.make_optimizer(params, TrainConfig.from_dict(base.train))
    mesh = shd.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    state = steps.init_train_state(params, tx)
    shardings = shd.train_state_shardings(TransformerLM(cfg, 0, runtime), tx, state, mesh)
    state = jax.device_put(state, shardings)
    train_step = steps.make_train_step(graphdef, tx)
    step = shd.jit_sharded(lambda s, b: train_step(s, b, jax.random.key(0)), mesh, shardings, donate=True)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = shd.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    t0 = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    times = []
    for i in range(13):
        t0 = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics["loss"])
        if i >= 3:
            times.append(time.perf_counter() - t0)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    step_s = statistics.median(times)
    tps = batch * seq / step_s
    flops = flops_per_token(cfg, n_params, seq) * tps
    kind = jax.devices()[0].device_kind
    peak = next((v for name, v in PEAKS.items() if name in kind), None)
    stats = jax.devices()[0].memory_stats() or {}
    return {"part": "step", "status": "ok", "scale": scale, "variant": variant, "batch": batch, "seq": seq,
            "n_params": n_params, "compile_s": compile_s, "step_ms": 1e3 * step_s, "tokens_per_s": tps,
            "mfu": flops / peak if peak else None, "peak_flops": peak,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "xla_temp_bytes": mem.temp_size_in_bytes if mem else None,
            "xla_argument_bytes": mem.argument_size_in_bytes if mem else None,
            "final_loss": float(metrics["loss"])}


def report(parts_dir: str, out: str) -> None:
    parts = []
    for path in sorted(glob.glob(os.path.join(parts_dir, "*.json"))):
        with open(path, encoding="utf-8") as f:
            parts.append(json.load(f))
    info = next((p["device"] for p in parts if "device" in p), {})
    lines = [f"# Accelerator check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Device: {info}. Command: `bash benchmarks/accelerator_check.sh`.", ""]
    by = {p.get("part"): p for p in parts}
    g = by.get("grads", {})
    lines += ["## bf16 vs fp32 gradients", "", f"status: {g.get('status')}; shape {g.get('shape')}", "",
              "| variant | min cosine | max norm error | failing leaves |", "| --- | --- | --- | --- |"]
    for v, r in (g.get("variants") or {}).items():
        lines.append(f"| {v} | {r['min_cosine']:.4f} | {100 * r['max_norm_error']:.1f}% | "
                     f"{', '.join(x['leaf'] for x in r['failing']) or 'none'} |")
    a = by.get("attention", {})
    lines += ["", f"## {a.get('fused', 'cudnn')} vs explicit attention (bf16)", "", f"status: {a.get('status')}; "
              f"[B, T, H, D] = {a.get('shape')}", "", "| scoring | forward max abs err (max abs) | grad rel err q, k, v |",
              "| --- | --- | --- |"]
    for name in ("softmax", "differential"):
        if name in a:
            r = a[name]
            lines.append(f"| {name} | {r['forward_max_abs_err']:.2e} ({r['forward_max_abs']:.2f}) | "
                         f"{', '.join(f'{x:.2e}' for x in r['grad_rel_err'])} |")
    pp = by.get("pallas", {})
    lines += ["", "## Pallas GPU kernel vs cuDNN and explicit (forward + backward)", "",
              f"status: {pp.get('status')}; [B, T, H, D] = {pp.get('shape')}"
              f"{' (interpreted: not a timing)' if pp.get('interpreted') else ''}", "",
              "| case | kernel | fwd+bwd ms | output dtype | forward max abs err | grad rel err q, k, v |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name in ("softmax_bf16", "softmax_fp32", "differential_bf16"):
        for impl, r in (pp.get(name) or {}).items():
            if "error" in r:
                lines.append(f"| {name} | {impl} | {r['error']} | | | |")
            else:
                lines.append(f"| {name} | {impl} | {r['fwd_bwd_ms']:.2f} | {r['out_dtype']} | "
                             f"{r['forward_max_abs_err']:.2e} | {', '.join(f'{x:.2e}' for x in r['grad_rel_err'])} |")
    lines += ["", "## Train step (bf16, scanned layers, AdamW, batch 16 x 1024 on one device)", "",
              "| scale | variant | status | step ms | tokens/s | MFU | peak memory GiB | compile s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in parts:
        if p.get("part", "").startswith("step"):
            name = p.get("part")
            if p.get("status") != "ok":
                lines.append(f"| {name} | | {p.get('status')} | | | | | |")
                continue
            mfu = f"{100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "n/a"
            peak = f"{p['peak_bytes_in_use'] / 2**30:.2f}" if p.get("peak_bytes_in_use") else "n/a"
            lines.append(f"| {p['scale']} | {p['variant']} | ok | {p['step_ms']:.1f} | {p['tokens_per_s']:,.0f} | "
                         f"{mfu} | {peak} | {p['compile_s']:.1f} |")
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(parts, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("grads", "attention", "pallas", "step", "report"))
    p.add_argument("--scale", default="60m")
    p.add_argument("--variant", default="standard")
    p.add_argument("--small", action="store_true")
    p.add_argument("--json", default="")
    p.add_argument("--parts", default="")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.part == "report":
        report(args.parts, args.out)
        return 0
    if args.part == "grads":
        result = part_grads(args.small)
    elif args.part == "attention":
        result = part_attention(args.small)
    elif args.part == "pallas":
        result = part_pallas(args.small)
    else:
        result = part_step(args.scale, args.variant, args.small)
        result["part"] = f"step_{args.scale}_{args.variant}"
    result["device"] = device_info()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    sys.exit(main())
