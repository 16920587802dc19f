"""The TPU compiler's view of the configs, without a TPU: coupled_qk_jax.aot over a grid of variants, scales and
topologies, written as JSON and a Markdown table (docs/scaling.md, "Before you rent the pod").

    python benchmarks/aot_report.py --variants coupled_euler --scales 60m,150m,350m \
        --topologies v5e:16x16,v4:4x4x4,v5p:4x4x4 --out benchmarks/results/aot_pods.json
    python benchmarks/aot_report.py --variants all --scales 350m --topologies v5e:16x16 \
        --out benchmarks/results/aot_350m_v5e256.json

Each cell compiles the train, eval and decode steps with the default attention_impl ("auto": splash attention under
shard_map on TPU) on a pure FSDP mesh over every chip, with one sequence of model.max_len tokens per chip
(train.batch_size = the chip count), in one process. Needs libtpu (pip install "jax[tpu]==<jax version>").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def config(variant: str, scale: str, chips: int):
    """configs/lm.py's config for VARIANT,SCALE on a pure FSDP mesh of `chips`, one sequence per chip."""
    from coupled_qk_jax.configs import lm  # noqa: PLC0415

    cfg = lm.get_config(f"{variant},{scale}")
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, chips, 1
    cfg.train.batch_size = chips
    return cfg


def main() -> None:
    import jax  # noqa: PLC0415 - after configure_process

    from coupled_qk_jax import aot  # noqa: PLC0415
    from coupled_qk_jax.config import ALL_VARIANTS  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="coupled_euler", help="comma-separated, or 'all'")
    parser.add_argument("--scales", default="60m,150m,350m")
    parser.add_argument("--topologies", default="v5e:16x16,v4:4x4x4,v5p:4x4x4")
    parser.add_argument("--out", required=True, help="JSON file; a Markdown table is written beside it")
    args = parser.parse_args()
    variants = ALL_VARIANTS if args.variants == "all" else tuple(args.variants.split(","))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    if os.path.exists(args.out):  # resumable: cells already written are kept
        with open(args.out) as f:
            rows = json.load(f)["rows"]
    done = {(r["variant"], r["scale"], r["topology"]) for r in rows}
    for topology in args.topologies.split(","):
        devices = aot.topology_devices(topology)
        for scale in args.scales.split(","):
            for variant in variants:
                if (variant, scale, topology) in done:
                    continue
                t0 = time.perf_counter()
                try:
                    result = aot.compile_steps(config(variant, scale, len(devices)), devices)
                except Exception as e:  # a cell that fails is recorded as failed, with its error
                    rows.append({"variant": variant, "scale": scale, "topology": topology, "chips": len(devices),
                                 "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
                else:
                    rows.append({"variant": variant, "scale": scale, "topology": topology, "chips": len(devices),
                                 "n_params": result["n_params"], "analytic_flops": result["analytic_flops"],
                                 "hbm_bytes": aot.hbm_bytes(topology),
                                 "steps": [{**vars(r), "total_bytes": r.total_bytes} for r in result["steps"]]})
                print(f"{variant} {scale} {topology}: {time.perf_counter() - t0:.0f} s"
                      f"{' FAILED ' + rows[-1]['error'] if 'error' in rows[-1] else ''}", flush=True)
                with open(args.out, "w") as f:
                    json.dump({"command": " ".join(sys.argv), "commit": commit, "jax": jax.__version__,
                               "rows": rows}, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table(rows, " ".join(sys.argv), commit))


def table(rows: list[dict], command: str, commit: str) -> str:
    import jax  # noqa: PLC0415

    from coupled_qk_jax import aot  # noqa: PLC0415

    lines = [f"`{command}` at {commit}, jax {jax.__version__} with libtpu's compiler, on a CPU host. Per chip; "
             "train = one optimiser step (forward, backward, AdamW) on one sequence per chip. est. ms: the TPU "
             "compiler's own step-time estimate. kernels: Pallas custom calls inside a shard_map region / all.", "",
             "| variant | scale | topology | chips | step | compile s | args GiB | temp GiB | total GiB | of HBM | "
             "est. ms | kernels | collectives |", "|" + " --- |" * 13]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['variant']}` | {r['scale']} | {r['topology']} | {r['chips']} | — | failed: "
                         f"{r['error']} | | | | | | | |")
            continue
        for s in r["steps"]:
            coll = ", ".join(f"{k} {v}" for k, v in s["collectives"].items() if v) or "none"
            est = f"{s['estimated_s'] * 1e3:.1f}" if s["estimated_s"] else "n/a"
            lines.append(f"| `{r['variant']}` | {r['scale']} | {r['topology']} | {r['chips']} | {s['step']} | "
                         f"{s['compile_s']:.0f} | {s['argument_bytes'] / aot.GIB:.2f} | {s['temp_bytes'] / aot.GIB:.2f} "
                         f"| {s['total_bytes'] / aot.GIB:.2f} | {s['total_bytes'] / r['hbm_bytes']:.0%} | {est} | "
                         f"{s['kernels_in_manual']}/{s['kernels']} | {coll} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()  # the CPU malloc settings, before JAX starts (coupled_qk_jax/startup.py)
    main()
