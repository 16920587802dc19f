"""Ahead-of-time compile for a TPU topology, before renting it: will this config fit and run there?

    python -m coupled_qk_jax.aot --config=configs/lm.py:coupled_euler,350m --topology=v5e:16x16 --mesh=fsdp:256 \
        --config.train.batch_size=256

With `libtpu` installed (`pip install "coupled-qk-jax[tpu]"`), jax can describe a TPU topology's devices without the
hardware (`jax.experimental.topologies`) and run the real TPU compiler, Mosaic kernels included, on any host. This
builds the mesh from those devices exactly as train.py would on that pod (the same `mesh` block, the same rules
table), then compiles the sharded train step, the evaluation step and the decode step (one token with a KV cache)
and prints, per chip: memory (arguments, temporaries, total) against the chip's HBM, compile time, FLOPs per step
(XLA's count beside the model's analytic count: XLA counts a `while` body once, so scanned layers read low), the
collectives, the attention kernels and how many of them sit inside a manual (shard_map) region, and the compiler's
own step-time estimate where it gives one. A config that does not fit is one line naming the overshoot and the
levers. Any config override works as in train.py. Installed, the same command is `coupled-qk-aot` (its command
line: coupled_qk_jax/cli/aot.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import Any

# Ahead-of-time compilation needs no accelerator: the host's CPU backend carries the process, libtpu the compiler.
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from coupled_qk_jax import sharding as shd  # noqa: E402
from coupled_qk_jax.errors import UserError  # noqa: E402

GIB = 1 << 30
# HBM per chip, GiB (Cloud TPU's published figures).
CHIP_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
# The Mosaic (Pallas TPU) kernels' custom-call target.
TPU_KERNEL_TARGET = "tpu_custom_call"


# ------------------------------------------------------------------------------------------------------- topologies
def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def topology_devices(topology: str, num_slices: int = 1) -> list:
    """The devices of a TPU topology such as "v5e:2x2", "v5e:16x16", "v4:4x4x4" or "v5p:4x4x4" (chip:shape), with
    their process (host) and, for several slices, slice indices, as libtpu describes them."""
    chip = topology.partition(":")[0]
    if chip not in CHIP_HBM_GIB or ":" not in topology:
        raise UserError(f"--topology={topology!r}: expected CHIP:SHAPE with CHIP one of {', '.join(CHIP_HBM_GIB)}, "
                        "e.g. v5e:16x16 or v4:4x4x4")
    if not libtpu_installed():
        raise UserError(f"compiling for {topology} needs libtpu: pip install \"jax[tpu]=={jax.__version__}\" (or "
                        "pip install \"coupled-qk-jax[tpu]\")")
    # A description claims no chip: another process holding libtpu (a training run, a second compile) is no conflict.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies  # noqa: PLC0415

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        return list(topologies.get_topology_desc(topology, platform="tpu", **kwargs).devices)
    except (RuntimeError, ValueError) as e:  # libtpu's words for a shape it does not know
        raise UserError(f"--topology={topology!r}: libtpu cannot describe it ({str(e).splitlines()[0]})") from None


def hbm_bytes(topology: str) -> int:
    return CHIP_HBM_GIB[topology.partition(":")[0]] * GIB


# ------------------------------------------------------------------------------------------------- manual regions
def kernel_calls(lowered: Any, target: str) -> tuple[int, int]:
    """(custom calls to `target` inside a manual region, all of them) in a lowered program, following calls
    between functions: a call made from inside an `sdy.manual_computation` (jax.shard_map) counts as inside.

    A kernel XLA cannot partition (a Mosaic or Triton custom call) must sit inside one on any mesh of several
    devices; this is how the tests and the report check it."""
    from jaxlib.mlir import ir  # noqa: PLC0415

    module = lowered.compiler_ir("stablehlo")
    functions = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                 if "sym_name" in op.attributes}
    events: dict[str, list[tuple[str, str, bool]]] = {}

    def walk(op, inside: bool, out: list) -> None:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    name = child.operation.name
                    here = inside or name == "sdy.manual_computation"
                    if name == "stablehlo.custom_call":
                        out.append(("kernel", ir.StringAttr(child.attributes["call_target_name"]).value, here))
                    elif name == "func.call":
                        out.append(("call", ir.FlatSymbolRefAttr(child.attributes["callee"]).value, here))
                    walk(child.operation, here, out)

    for name, op in functions.items():
        walk(op, False, events.setdefault(name, []))
    counts = [0, 0]

    def visit(name: str, inside: bool) -> None:
        for kind, what, here in events.get(name, []):
            if kind == "call":
                visit(what, inside or here)
            elif what == target:
                counts[0] += inside or here
                counts[1] += 1

    visit("main", False)
    return counts[0], counts[1]


# ------------------------------------------------------------------------------------------------------- the steps
@dataclasses.dataclass
class StepReport:
    """What the compiler says about one step on one chip."""

    step: str
    compile_s: float
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    alias_bytes: int
    code_bytes: int
    xla_flops: float
    bytes_accessed: float
    estimated_s: float | None
    collectives: dict[str, int]
    kernels_in_manual: int
    kernels: int

    @property
    def total_bytes(self) -> int:
        """Peak device memory: inputs, outputs not aliased to an input, temporaries and the program."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


def _compile(name: str, jitted: Any, *args: Any) -> StepReport:
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    estimate = cost.get("optimal_seconds")
    inside, total = kernel_calls(lowered, TPU_KERNEL_TARGET)
    report = StepReport(name, seconds, int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes),
                        int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes),
                        int(mem.generated_code_size_in_bytes), float(cost.get("flops", 0.0)),
                        float(cost.get("bytes accessed", 0.0)),
                        float(estimate) if estimate is not None and estimate > 0 else None,
                        shd.collective_counts(compiled.as_text()), inside, total)
    return report


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def compile_steps(cfg: Any, devices: list, steps: tuple[str, ...] = ("train", "eval", "decode")) -> dict[str, Any]:
    """Compile `steps` of the run config `cfg` (a ConfigDict or RunConfig) for `devices`, on the mesh train.py
    builds from the config's mesh block: {"mesh": sizes, "n_params", "analytic_flops", "steps": [StepReport]}."""
    from flax import nnx  # noqa: PLC0415

    from coupled_qk_jax.generate import Generator, Sampling, init_cache  # noqa: PLC0415
    from coupled_qk_jax.model import TransformerLM  # noqa: PLC0415
    from coupled_qk_jax.training import loop, observe, steps as steps_lib  # noqa: PLC0415
    from coupled_qk_jax.training.layout import state_layout  # noqa: PLC0415
    from coupled_qk_jax.training.config import RunConfig  # noqa: PLC0415

    run = cfg if isinstance(cfg, RunConfig) else RunConfig.from_configdict(cfg)
    try:
        mesh = shd.make_mesh(run.mesh.sizes(), devices)
    except ValueError as e:
        raise UserError(f"mesh: {e}") from None
    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    b, accum, seq = run.train.batch_size, run.train.grad_accum, run.data.seq_len
    if (b // accum) % batch_devices:
        raise UserError(f"the micro-batch train.batch_size/train.grad_accum={b // accum} is not divisible by the "
                        f"{batch_devices} data-parallel devices of this mesh; set --config.train.batch_size to a "
                        f"multiple of {batch_devices}")
    seeds = run.train.seeds
    layout = state_layout(run.model, run.train, seeds, mesh, runtime=run.runtime)
    setup = loop.Setup(run, mesh, None, None, seeds, layout.graphdef, layout.abstract_state, layout.tx,
                       layout.shardings, layout.n_params, None)
    rows = shd.batch_sharding(mesh, seed_axis=len(seeds) > 1)
    lead = (len(seeds),) if len(seeds) > 1 else ()
    tokens = jax.ShapeDtypeStruct(lead + (b, seq), jnp.int32, sharding=rows)
    out: dict[str, Any] = {"mesh": dict(mesh.shape), "n_params": layout.n_params,
                           "analytic_flops": observe.model_flops_per_step(layout.n_params, run.model, b, seq),
                           "steps": []}
    if "train" in steps:
        state = _with_shardings(layout.abstract_state, layout.shardings)
        report = _compile("train", loop.make_sharded_train_step(setup), state,
                             {"inputs": tokens, "targets": tokens})
        out["steps"].append(report)
    if "eval" in steps:
        eval_b = run.train.eval_batch_size or b
        eval_tokens = jax.ShapeDtypeStruct((eval_b, seq), jnp.int32, sharding=shd.batch_sharding(mesh))
        step = shd.jit_sharded(steps_lib.make_eval_step(layout.graphdef), mesh, layout.param_shardings)
        params = _with_shardings(jax.tree.map(lambda x: x[0] if lead else x, layout.abstract_state["params"]),
                                 layout.param_shardings)
        report = _compile("eval", step, params, {"inputs": eval_tokens, "targets": eval_tokens})
        out["steps"].append(report)
    if "decode" in steps:
        abstract_model = nnx.eval_shape(lambda: TransformerLM(run.model, seeds[0], run.runtime))
        gen = Generator.for_mesh(abstract_model, mesh)
        params = _with_shardings(nnx.to_pure_dict(nnx.state(abstract_model)), gen._param_shardings)
        rows_1d = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(shd.BATCH_AXES))
        rep = shd.replicated(mesh)
        n = batch_devices  # one sequence per data-parallel device: what generation pads a batch to
        cache = _with_shardings(jax.eval_shape(lambda: init_cache(run.model, n, run.model.max_len)),
                                gen.cache_shardings)
        token = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rows_1d)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
        report = _compile("decode", gen._decode, params, cache, token, token, scalar, key, Sampling())
        out["steps"].append(report)
    return out


# ------------------------------------------------------------------------------------------------------- the report
def fit_error(report: StepReport, hbm: int, chip: str) -> str | None:
    """One line naming the overshoot and the levers, or None when the step fits the chip."""
    if report.total_bytes <= hbm:
        return None
    over = (report.total_bytes - hbm) / GIB
    return (f"the {report.step} step needs {report.total_bytes / GIB:.2f} GiB per chip, {over:.2f} GiB more than a "
            f"{chip} chip's {hbm / GIB:.0f} GiB; shard more (--mesh=fsdp:N), recompute more "
            "(--config.runtime.remat=full), or lower --config.train.batch_size (or raise train.grad_accum)")


def format_report(result: dict[str, Any], topology: str) -> str:
    hbm = hbm_bytes(topology)
    mesh = ",".join(f"{k}:{v}" for k, v in result["mesh"].items())
    lines = [f"topology {topology} ({hbm / GIB:.0f} GiB HBM per chip), mesh {mesh}, {result['n_params'] / 1e6:.1f}M "
             f"parameters; train step analytic FLOPs (6·N·tokens + attention), all chips: "
             f"{result['analytic_flops']:.3e}",
             f"{'step':<7} {'compile s':>9} {'args GiB':>9} {'temp GiB':>9} {'total GiB':>10} {'of HBM':>7} "
             f"{'XLA GFLOP/chip':>15} {'GB accessed':>12} {'est. ms':>8} {'kernels':>9}  collectives"]
    for r in result["steps"]:
        coll = " ".join(f"{k}={v}" for k, v in r.collectives.items() if v) or "none"
        est = f"{r.estimated_s * 1e3:.2f}" if r.estimated_s else "n/a"
        lines.append(f"{r.step:<7} {r.compile_s:9.1f} {r.argument_bytes / GIB:9.3f} {r.temp_bytes / GIB:9.3f} "
                     f"{r.total_bytes / GIB:10.3f} {r.total_bytes / hbm:7.1%} {r.xla_flops / 1e9:15.1f} "
                     f"{r.bytes_accessed / 1e9:12.2f} {est:>8} {f'{r.kernels_in_manual}/{r.kernels}':>9}  {coll}")
    lines.append("kernels: Pallas TPU custom calls inside a shard_map region / all of them. XLA counts a while-loop "
                 "body once: with scanned layers its FLOPs are about one layer's.")
    return "\n".join(lines)


if __name__ == "__main__":
    from coupled_qk_jax.cli.aot import main

    main()
