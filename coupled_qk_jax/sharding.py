"""Meshes, logical-axis rules and placement of train states and batches (jax.sharding).

One table maps the logical names that parameters carry (`logical_axes` metadata, set in attention.py / model.py)
to mesh axes, MaxText style:

    batch     -> ("data", "fsdp")     batches split over every data-parallel axis
    embed     -> "fsdp"               FSDP: params and optimiser state sharded over fsdp
    vocab     -> "tensor"             tensor parallelism: vocab, heads and the MLP split over tensor
    heads     -> "tensor"
    mlp       -> "tensor"
    head_dim, coupling, None -> replicated

A dimension that the mesh axis does not divide is replicated instead (e.g. the 4 heads of `tiny` on tensor=8).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "coupling": None,
}


def mesh_shape(mesh_cfg: Mapping[str, int], n_devices: int | None = None) -> tuple[int, int, int]:
    """Resolve (data, fsdp, tensor) sizes; one of them may be -1 (fill with the remaining devices)."""
    n = n_devices or jax.device_count()
    sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
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
    """A (data, fsdp, tensor) mesh with Auto axis types (jax.make_mesh defaults to Explicit on jax >= 0.10)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, Any] = LOGICAL_RULES) -> P:
    """Map one array's logical axis names to a PartitionSpec, replicating dims the mesh does not divide."""
    spec, used = [], set()
    for name, dim in zip(logical_axes, shape):
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
    """PartitionSpecs for `nnx.to_pure_dict(nnx.state(model))`, read from each Param's `logical_axes` metadata."""
    state = nnx.state(model)

    def spec_of(var):
        axes = var.get_metadata().get("logical_axes") or (None,) * var.get_value().ndim
        return logical_to_spec(tuple(axes), var.get_value().shape, mesh)

    specs = jax.tree.map(spec_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs)


def train_state_shardings(model: nnx.Module, tx, state: dict, mesh: Mesh) -> dict:
    """NamedShardings for a train state {"params", "opt_state", "step"}: optimiser moments follow their params."""
    p_specs = param_specs(model, mesh)
    named = jax.tree.map(lambda s: NamedSharding(mesh, s), p_specs, is_leaf=lambda x: isinstance(x, P))
    replicated = NamedSharding(mesh, P())
    import optax  # local: keep this module importable without the optimiser stack

    opt = optax.tree_utils.tree_map_params(tx, lambda _, s: s, state["opt_state"], named,
                                           transform_non_params=lambda _: replicated,
                                           is_leaf=lambda x: isinstance(x, NamedSharding))
    return {"params": named, "opt_state": opt, "step": replicated}


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, T] batches: B split over (data, fsdp), T replicated."""
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict:
    """Assemble each host's slice into one global jax.Array per field (multi-host safe)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
