"""Meshes, logical-axis rules, placement of train states and batches, sharded jit, and HLO collective accounting.

One table maps the logical names that parameters carry (`logical_axes` metadata, set in attention.py / model.py)
to mesh axes, MaxText style:

    batch     -> ("data", "fsdp")     batches split over every data-parallel axis
    embed     -> "fsdp"               FSDP: params and optimiser state sharded over fsdp (gathered per layer by XLA)
    vocab     -> "tensor"             tensor parallelism: vocab, heads and the MLP split over tensor
    heads     -> "tensor"
    mlp       -> "tensor"
    head_dim, coupling, None -> replicated

A dimension that the mesh axis does not divide is replicated instead (e.g. the 4 heads of `tiny` on tensor=8).

Activations are not annotated: with parameters and batches placed as above and Auto mesh axes, XLA's sharding
propagation keeps q, k, v in [B, T, H, d_head] split over (batch -> data×fsdp, heads -> tensor), and the coupled
dynamics, vmapped over the head axis, run on each device's own heads. `tests/test_sharding.py` checks this on the
compiled HLO (`collective_ops`): the coupled variants add no collective to the forward pass.

Multi-host: `global_batch` turns each host's slice of the batch into one global `jax.Array`;
`process_batch_slice` says which slice a host must load (see docs/scaling.md).
"""

from __future__ import annotations

import collections
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES: dict[str, Any] = {
    "batch": BATCH_AXES,
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "coupling": None,
}

# The collective HLO ops XLA's SPMD partitioner can insert (async forms end in "-start").
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


# --------------------------------------------------------------------------------------------------------------- mesh
def mesh_shape(mesh_cfg: Mapping[str, int], n_devices: int | None = None) -> tuple[int, int, int]:
    """Resolve (data, fsdp, tensor) sizes from `mesh.data/fsdp/tensor`; one of them may be -1 (fill)."""
    n = n_devices or jax.device_count()
    sizes = []
    for axis in MESH_AXES:
        if axis not in mesh_cfg:
            raise ValueError(f"mesh.{axis} is missing; the mesh block needs data, fsdp and tensor")
        value = mesh_cfg[axis]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"mesh.{axis} must be an integer (>= 1, or -1 to fill), got {value!r}")
        sizes.append(int(value))
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"mesh: at most one of mesh.data/fsdp/tensor may be -1, got {dict(zip(MESH_AXES, sizes))}")
    for axis, s in zip(MESH_AXES, sizes):
        if s == 0 or s < -1:
            raise ValueError(f"mesh.{axis} must be >= 1 or -1, got {s}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if n % known:
            raise ValueError(f"mesh: {n} devices are not divisible by the fixed axes' product {known}")
        sizes[sizes.index(-1)] = n // known
    if int(np.prod(sizes)) != n:
        raise ValueError(f"mesh: data*fsdp*tensor = {int(np.prod(sizes))} but there are {n} devices")
    return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all, every process's) with Auto axis types.

    jax.make_mesh defaults to Explicit axes on jax >= 0.10, where gathers and einsums need `out_sharding=`; Auto lets
    XLA propagate shardings through the unannotated model. jax.make_mesh also orders devices so that the last
    (tensor) axis is the fastest-varying, i.e. tensor groups sit inside one host / one ICI neighbourhood.
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------------------------------------- parameters
def logical_to_spec(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, Any] = LOGICAL_RULES) -> P:
    """Map one array's logical axis names to a PartitionSpec, replicating dims the mesh does not divide.

    A mesh axis is used at most once per array (the first logical dim that claims it wins) and axes of size 1 are
    dropped, so the same rules give clean specs on every mesh shape.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical_axes {logical_axes} do not match an array of rank {len(shape)}")
    spec, used = [], set()
    for name, dim in zip(logical_axes, shape):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no entry in the sharding rules {sorted(rules)}")
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or dim % size:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def param_specs(model: nnx.Module, mesh: Mesh) -> dict:
    """PartitionSpecs for `nnx.to_pure_dict(nnx.state(model))`, read from each Param's `logical_axes` metadata.

    Works on a real model or an abstract one (`nnx.eval_shape`), so 350m-sized specs cost no memory.
    """
    state = nnx.state(model)

    def spec_of(var):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * value.ndim
        return logical_to_spec(tuple(axes), value.shape, mesh)

    specs = jax.tree.map(spec_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs)


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """A tree of PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def train_state_shardings(model: nnx.Module, tx, state: dict, mesh: Mesh) -> dict:
    """NamedShardings for a train state {"params", "opt_state", "step"}: optimiser moments follow their params
    (so FSDP shards AdamW's mu and nu exactly like the weights); counts and other scalars are replicated."""
    import optax  # local: keep this module importable without the optimiser stack

    named = named_shardings(param_specs(model, mesh), mesh)
    rep = replicated(mesh)
    opt = optax.tree_utils.tree_map_params(tx, lambda _, s: s, state["opt_state"], named,
                                           transform_non_params=lambda _: rep,
                                           is_leaf=lambda x: isinstance(x, NamedSharding))
    return {"params": named, "opt_state": opt, "step": rep}


def compute_spec(spec: P, gathered: tuple[str, ...] = ("fsdp",)) -> P:
    """`spec` with the `gathered` mesh axes removed: the layout in which a weight is *used* under FSDP (whole along
    its embed dim, still split over tensor)."""
    out = []
    for entry in spec:
        names = tuple(n for n in ((entry,) if isinstance(entry, str) else tuple(entry or ())) if n not in gathered)
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*out)


def fsdp_gather(model: nnx.Module, mesh: Mesh) -> Callable[[Any], Any]:
    """A function params -> params that all-gathers the FSDP-sharded weights at the start of the forward pass
    (`with_sharding_constraint` to `compute_spec`), i.e. ZeRO-3 semantics made explicit.

    Why: without it XLA's propagation sees batch-split activations meeting embed-split weights and often reshards
    the *activations* instead (all-to-alls, and [B, T, vocab]-sized all-reduces at the tied head). Measured on the
    60m width (`python benchmarks/collectives.py`), it cuts a step's collective traffic 8-22x on fsdp meshes. Apply
    it to the params inside the loss (before `nnx.merge`); the gradients come back to the sharded layout through the
    step's out shardings (a reduce-scatter). A no-op when mesh.fsdp == 1.
    """
    specs = param_specs(model, mesh)
    if mesh.shape["fsdp"] == 1:
        return lambda params: params
    target = jax.tree.map(lambda s: NamedSharding(mesh, compute_spec(s)), specs, is_leaf=lambda x: isinstance(x, P))
    return lambda params: jax.lax.with_sharding_constraint(params, target)


def abstract_state(state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying `shardings`: an orbax StandardRestore target that lands arrays directly in the
    (possibly different) mesh's shardings, without touching device memory first."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


# ---------------------------------------------------------------------------------------------------------- batches
def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, T] batches: B split over (data, fsdp), T replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def process_batch_slice(mesh: Mesh, global_batch_size: int | None = None) -> tuple[int, int]:
    """(slice index, slice count): this process must load rows [index·B/count, (index+1)·B/count) of the batch.

    Usually (jax.process_index(), jax.process_count()). They differ when the batch axes do not span the processes
    one-to-one, e.g. a tensor axis across hosts: processes that hold the same batch rows get the same index and must
    load the same data (pass them to the data layer's make_train_iterator as process_index / process_count).
    """
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    b = global_batch_size or n_batch
    if b % n_batch:
        raise ValueError(f"batch size {b} is not divisible by mesh.data*mesh.fsdp = {n_batch}")
    rows = set()
    for idx in batch_sharding(mesh).addressable_devices_indices_map((b, 1)).values():
        rows.update(range(*idx[0].indices(b)))
    start, stop = min(rows), max(rows) + 1
    if len(rows) != stop - start or b % (stop - start):
        raise ValueError(f"this process's batch rows {sorted(rows)} are not one contiguous equal slice; "
                         "choose a mesh whose data/fsdp axes split evenly across hosts")
    return start // (stop - start), b // (stop - start)


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict:
    """Assemble each host's slice ([B_local, ...] per field) into one global jax.Array per field ([B, ...]).

    Single process: the local batch is the global batch. Multi-host: every process passes the rows that
    `process_batch_slice` assigns it; jax.make_array_from_process_local_data places them on the local devices.
    """
    sharding = batch_sharding(mesh)
    _, count = process_batch_slice(mesh)  # the number of distinct row slices does not depend on the batch size
    out = {}
    for name, value in local_batch.items():
        value = np.asarray(value)
        global_shape = (value.shape[0] * count,) + value.shape[1:]
        out[name] = jax.make_array_from_process_local_data(sharding, value, global_shape)
    return out


# -------------------------------------------------------------------------------------------------------- sharded jit
def jit_train_step(train_step: Callable, state_shardings: Any, mesh: Mesh, *, with_key: bool = True,
                   donate: bool = True) -> Callable:
    """jax.jit(train_step) with explicit shardings: (state, batch[, key]) -> (state, metrics).

    The state goes in and comes out in `state_shardings` (donated: updated in place), batch fields are split over
    (data, fsdp), the key and the metrics are replicated. Fixing the out shardings matters: left to XLA, an
    updated parameter may come back with a different layout and force a recompile (or a reshard) on the next step.
    """
    b, rep = batch_sharding(mesh), replicated(mesh)
    in_sh = (state_shardings, b, rep) if with_key else (state_shardings, b)
    return jax.jit(train_step, in_shardings=in_sh, out_shardings=(state_shardings, rep),
                   donate_argnums=(0,) if donate else ())


def jit_eval_step(eval_step: Callable, param_shardings: Any, mesh: Mesh) -> Callable:
    """jax.jit(eval_step) with explicit shardings: (params, batch) -> replicated outputs."""
    return jax.jit(eval_step, in_shardings=(param_shardings, batch_sharding(mesh)), out_shardings=replicated(mesh))


# ------------------------------------------------------------------------------------------------- HLO accounting
_COMMENT_RE = re.compile(r"/\*.*?\*/")  # e.g. the /*index=5*/ markers inside long tuple shapes
_COLLECTIVE_RE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE_RE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def collective_ops(hlo_text: str) -> list[tuple[str, int]]:
    """Every collective in compiled HLO text (`jit(f).lower(...).compile().as_text()`) as (kind, result elements).

    Async pairs (`all-gather-start` / `-done`) count once, at the start (whose tuple result also holds the operand,
    so compare sizes between programs, not against hand counts); a combined (tuple) collective counts once with
    the elements of all its results.
    """
    ops = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE_RE.match(_COMMENT_RE.sub("", line))
        if match is None:
            continue
        shape, kind = match.groups()
        elements = sum(int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                       for _, dims in _SHAPE_RE.findall(shape))
        ops.append((kind, elements))
    return ops


def collective_counts(hlo_text: str) -> dict[str, int]:
    """{kind: number of ops} for every kind in COLLECTIVES (zeros included)."""
    counts = collections.Counter(kind for kind, _ in collective_ops(hlo_text))
    return {kind: counts.get(kind, 0) for kind in COLLECTIVES}
