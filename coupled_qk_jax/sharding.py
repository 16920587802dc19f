"""Meshes, logical-axis rules, placement of train states and batches, sharded jit, and HLO collective accounting.

One table maps the logical names that parameters and activations carry to mesh axes, MaxText style. Parameters
carry theirs as `logical_axes` metadata (attention.py / model.py); activations get them from `constrain` calls at
the block boundaries of model.py.

    batch             -> ("data", "fsdp")   batches split over every data-parallel axis
    embed             -> "fsdp"             FSDP: params and optimiser state sharded over fsdp (stored layout)
    vocab, heads, mlp -> "tensor"           tensor parallelism: vocab, heads and the MLP split over tensor
    layers            -> None               the stacked layer axis of scanned layers (runtime.scan_layers)
    activation_embed, length, head_dim, coupling -> None (replicated)

Loud: a dimension that its mesh axis does not divide is an error naming the parameter, the axis and a fix (e.g.
150m's 12 heads on tensor=8); nothing is replicated unless the table says so (a mesh axis of size 1 is simply
dropped from the spec).

FSDP (ZeRO-3): a weight is stored split over fsdp and used whole. `gather_weights(module)` constrains a module's
weights to their stored layout and then to the compute layout (`compute_spec`: fsdp dropped), so XLA all-gathers
them where the module runs and reduce-scatters their gradients there in the backward pass. The model applies it
per block, so inside the layer scan one layer's weights are gathered at a time.

`constrain` and `gather_weights` act only while a mesh is in context (`under_mesh`, which `jit_sharded` applies): without one (a single device, tests of the maths) they are the identity.

Multi-host: `host_batch_rows` says which rows of the global batch a host must load (any set of rows, not only
one block), and `global_batch` turns each host's rows into one global `jax.Array` (see docs/scaling.md).
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from coupled_qk_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES: dict[str, Any] = {
    # parameters (and the batch dim of activations)
    "batch": BATCH_AXES,
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    "head_dim": None,
    "coupling": None,
    # activations only: the residual stream [B, T, d_model] is whole along T and d_model on every device
    "length": None,
    "activation_embed": None,
}

# checkpoint_name of every FSDP-gathered weight: remat policies re-gather it in the backward pass instead of saving it.
GATHERED = "fsdp_gathered"

# The collective HLO ops XLA's SPMD partitioner can insert (async forms end in "-start").
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


# --------------------------------------------------------------------------------------------------------------- mesh
DCN_AXES = ("dcn_data", "dcn_fsdp")  # the multi-slice factors of data and fsdp (config keys; default 1)


def dcn_shape(mesh_cfg: Mapping[str, int]) -> tuple[int, int, int]:
    """(dcn_data, dcn_fsdp, 1): how many slices the data and fsdp axes span (`mesh.dcn_data/dcn_fsdp`, default 1;
    tensor never crosses the data-centre network)."""
    sizes = []
    for axis in DCN_AXES:
        value = mesh_cfg.get(axis, 1)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise UserError(f"mesh.{axis} must be an integer >= 1 (the slices that axis spans), got {value!r}")
        sizes.append(int(value))
    return sizes[0], sizes[1], 1


def mesh_shape(mesh_cfg: Mapping[str, int], n_devices: int | None = None) -> tuple[int, int, int]:
    """Resolve the (data, fsdp, tensor) mesh shape from `mesh.data/fsdp/tensor`; one of them may be -1 (fill).

    With `mesh.dcn_data/dcn_fsdp` > 1 (a multi-slice run) data/fsdp/tensor are the sizes within one slice, -1
    fills one slice's devices, and the result is the whole mesh: (dcn_data*data, dcn_fsdp*fsdp, tensor).
    """
    n = n_devices or jax.device_count()
    dcn = dcn_shape(mesh_cfg)
    slices = dcn[0] * dcn[1]
    if n % slices:
        raise UserError(f"mesh: {n} devices cannot form mesh.dcn_data*mesh.dcn_fsdp = {slices} equal slices")
    n //= slices
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
    per_slice = " per slice" if slices > 1 else ""
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if n % known:
            raise ValueError(f"mesh: {n} devices{per_slice} are not divisible by the fixed axes' product {known}")
        sizes[sizes.index(-1)] = n // known
    if int(np.prod(sizes)) != n:
        raise ValueError(f"mesh: data*fsdp*tensor = {int(np.prod(sizes))} but there are {n} devices{per_slice}")
    return tuple(d * s for d, s in zip(dcn, sizes))


def make_mesh(mesh_cfg: Mapping[str, int], devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all, every process's) with Auto axis types.

    jax.make_mesh defaults to Explicit axes on jax >= 0.10, where gathers and einsums need `out_sharding=`; Auto lets
    XLA propagate shardings through the unannotated model. jax.make_mesh also orders devices so that the last
    (tensor) axis is the fastest-varying, i.e. tensor groups sit inside one host / one ICI neighbourhood.

    Multi-slice (`mesh.dcn_data` or `mesh.dcn_fsdp` > 1): the devices are grouped by their `slice_index` with
    mesh_utils.create_hybrid_device_mesh, MaxText style: the slice is the outer factor of the data (fsdp) axis, so
    data index i lies in slice i // data, and only the gradient reduction of those axes crosses the data-centre
    network. The axes keep their names, so the rules table and the batch sharding are the same as on one slice.
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(mesh_cfg, len(devices))
    dcn = dcn_shape(mesh_cfg)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if dcn == (1, 1, 1):
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    from jax.experimental import mesh_utils  # noqa: PLC0415 - multi-slice runs only

    slices = sorted({getattr(d, "slice_index", None) for d in devices}, key=str)
    if None in slices:
        raise UserError(f"mesh.dcn_data*mesh.dcn_fsdp = {dcn[0] * dcn[1]} slices, but the devices carry no "
                        "slice_index (not a multi-slice TPU run); leave mesh.dcn_data and mesh.dcn_fsdp at 1")
    if len(slices) != dcn[0] * dcn[1]:
        raise UserError(f"mesh.dcn_data*mesh.dcn_fsdp = {dcn[0] * dcn[1]} but the devices span {len(slices)} "
                        f"slice(s); set them so that their product is {len(slices)}")
    per_slice = tuple(s // d for s, d in zip(shape, dcn))
    grid = mesh_utils.create_hybrid_device_mesh(per_slice, dcn, devices=devices)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------------------------------------- parameters
def logical_to_spec(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, Any] = LOGICAL_RULES, name: str = "an array") -> P:
    """Map one array's logical axis names to a PartitionSpec under `rules`.

    A mesh axis is used at most once per array (the first logical dim that claims it wins) and axes of size 1 are
    dropped, so the same rules give clean specs on every mesh shape. A dimension that its mesh axes do not divide
    is a UserError naming `name`, the axis and a fix: silent replication would quietly undo tensor parallelism.
    `mesh` may be a Mesh or an AbstractMesh (only `.shape` is read).
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical_axes {logical_axes} do not match an array of rank {len(shape)}")
    spec, used = [], set()
    for logical, dim in zip(logical_axes, shape):
        if logical is not None and logical not in rules:
            raise ValueError(f"logical axis {logical!r} has no entry in the sharding rules {sorted(rules)}")
        target = rules.get(logical) if logical is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        if not axes:
            spec.append(None)
            continue
        size = int(np.prod([mesh.shape[a] for a in axes]))
        if dim % size:
            sizes = "*".join(f"mesh.{a}={mesh.shape[a]}" for a in axes)
            fits = [n for n in range(1, size) if dim % n == 0]
            raise UserError(f"sharding: {name} has {logical}={dim}, which {sizes} does not divide; use a mesh whose "
                             f"{'/'.join(axes)} size divides {dim} (e.g. {fits[-1]}), or change the model shape")
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def param_specs(model: nnx.Module, mesh: Mesh) -> dict:
    """PartitionSpecs for `nnx.to_pure_dict(nnx.state(model))`, read from each Param's `logical_axes` metadata.

    Works on a real model or an abstract one (`nnx.eval_shape`), so 350m-sized specs cost no memory.
    """
    state = nnx.state(model)

    def spec_of(path, var):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * value.ndim
        return logical_to_spec(tuple(axes), value.shape, mesh, name=_path_name(path))

    specs = jax.tree_util.tree_map_with_path(spec_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs)


def _path_name(path) -> str:
    """A parameter's path as 'blocks/0/attn/wq' (for error messages)."""
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


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


def context_mesh():
    """The mesh in context (`under_mesh`, jax.set_mesh) if it is one of ours, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
    """with_sharding_constraint of an activation to its logical axes (e.g. ("batch", "length",
    "activation_embed") for the residual stream) under the mesh in context; the identity without one."""
    mesh = context_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(tuple(logical_axes), x.shape, mesh))


def fsdp_gathers() -> bool:
    """Whether the mesh in context splits weights over fsdp, i.e. whether `gather_weight` gathers anything."""
    mesh = context_mesh()
    return mesh is not None and mesh.shape["fsdp"] > 1


def gather_weight(var: nnx.Variable, name: str = "a parameter") -> jax.Array:
    """The value of one Param, all-gathered over fsdp where it is read (ZeRO-3), under the mesh in context.

    The value is constrained to its stored spec and then to `compute_spec` (fsdp dropped): in the forward pass XLA
    all-gathers it there, and the transpose of the two constraints reduce-scatters its gradient at the same point
    of the backward pass. Metadata that names a leading "layers" axis the value no longer has (one layer's slice of
    the stacked blocks, inside the layer scan) drops it. The plain value without a mesh or with mesh.fsdp == 1.
    """
    value = var.get_value()
    if not fsdp_gathers():
        return value
    mesh = context_mesh()
    axes = tuple(var.get_metadata().get("logical_axes") or (None,) * value.ndim)
    if len(axes) == value.ndim + 1 and axes[0] == "layers":
        axes = axes[1:]
    stored = logical_to_spec(axes, value.shape, mesh, name=name)
    used = compute_spec(stored)
    if used == stored:
        return value
    gathered = jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(value, stored), used)
    return checkpoint_name(gathered, GATHERED)  # not saved for the backward pass (model.REMAT_POLICIES)


def gather_weights(module: nnx.Module) -> nnx.Module:
    """A copy of `module` whose Params are `gather_weight`ed: the model applies it to one block at a time, so inside
    the layer scan one layer's weights are gathered per iteration instead of the whole model at the start of the
    step. `module` itself is not modified; without a mesh (or with mesh.fsdp == 1) it is returned as is."""
    if not fsdp_gathers():
        return module
    graphdef, state = nnx.split(module)

    def gather(path, var):
        if not isinstance(var, nnx.Param):
            return var
        return var.replace(value=gather_weight(var, _path_name(path)))

    state = jax.tree_util.tree_map_with_path(gather, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def under_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` traced with `mesh` in context, so that the model's `constrain` / `gather_weights` take effect. Wrap the
    function given to jax.jit (the context is read at trace time)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        abstract = mesh.abstract_mesh
        # An abstract mesh of the same axes in context is kept, with its device: a program traced for another
        # device kind than this host's (kernels.gpu.abstract_gpu: a GPU's Triton kernels lowered on a CPU host).
        outer = jax.sharding.get_abstract_mesh()
        if (getattr(outer, "abstract_device", None) is not None and outer.axis_names == abstract.axis_names
                and outer.axis_sizes == abstract.axis_sizes and outer.axis_types == abstract.axis_types):
            abstract = outer
        with jax.sharding.use_abstract_mesh(abstract):
            return fn(*args, **kwargs)

    return wrapped


def mesh_of(tree: Any) -> Mesh | None:
    """The (data, fsdp, tensor) mesh that the jax.Arrays of `tree` live on, or None when they are on one device
    (host arrays, a single-device array, or a mesh of size 1: all the same program as no mesh).

    This is how a reader finds the mesh of a restored model (Run.open(dir, mesh=...)) without being told it twice.
    Arrays on several meshes, or on devices without a NamedSharding, are a UserError."""
    meshes, other = set(), False
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array) or len(x.sharding.device_set) == 1:
            continue
        if isinstance(x.sharding, NamedSharding):
            meshes.add(x.sharding.mesh)
        else:
            other = True
    if other or len(meshes) > 1:
        raise UserError("the parameters are spread over several meshes (or devices without a NamedSharding); place "
                        "them on one (data, fsdp, tensor) mesh, e.g. Run.open(DIR, mesh='data:2,tensor:2')")
    if not meshes:
        return None
    mesh = meshes.pop()
    if tuple(mesh.axis_names) != MESH_AXES:
        raise UserError(f"the parameters are on a mesh with axes {tuple(mesh.axis_names)}; expected {MESH_AXES} "
                        "(sharding.make_mesh)")
    return mesh


def to_host(x: jax.Array | np.ndarray) -> np.ndarray:
    """The whole value of `x` as a numpy array, on every process.

    A fully addressable array (one host, however many devices) is read directly; an array with shards on other
    hosts (a multi-host mesh) is all-gathered first (multihost_utils.process_allgather, a collective: every process
    must call it for the same arrays in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415 - only multi-host readers need it

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


# ---------------------------------------------------------------------------------------------------------- batches
def batch_sharding(mesh: Mesh, seed_axis: bool = False) -> NamedSharding:
    """[B, ...] batches: B split over (data, fsdp), every later axis replicated ([B, T] tokens, and [B] labels of a
    sentence task alike). With ``seed_axis``, [S, B, ...] batches of a seed-parallel run (one batch per seed): S
    replicated, each seed's batch split as a single run's."""
    return NamedSharding(mesh, P(*((None,) if seed_axis else ()), BATCH_AXES))


def host_batch_rows(mesh: Mesh, process_index: int, global_batch_size: int) -> np.ndarray:
    """The rows of a [global_batch_size, ...] batch in :func:`batch_sharding` that process `process_index`'s devices
    hold: int64 [n], ascending, each row once (devices that replicate a row, over tensor, share it).

    This is what that process's data loader must read, and the order :func:`global_batch` expects its rows in. On a
    TPU pod a host's rows need not be one block (jax.make_mesh orders devices by their ICI position, not by host):
    on v5e-16 with a pure data-parallel mesh, two of the four hosts hold several blocks. Works for any process of
    the mesh, not only this one (device by device, from each device's process_index). A batch that the mesh's
    data*fsdp devices cannot split evenly is a UserError.
    """
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    if global_batch_size < 1 or global_batch_size % n_batch:
        raise UserError(f"the batch of {global_batch_size} rows is not divisible by the mesh's {n_batch} "
                        "data-parallel devices (mesh.data * mesh.fsdp); change the batch size or the mesh")
    return np.asarray(_host_rows(mesh, int(process_index), int(global_batch_size)), dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _host_rows(mesh: Mesh, process_index: int, global_batch_size: int) -> tuple[int, ...]:
    """host_batch_rows' rows as a tuple, cached: global_batch asks for them at every step."""
    rows: set[int] = set()
    for device, index in batch_sharding(mesh).devices_indices_map((global_batch_size, 1)).items():
        if device.process_index == process_index:
            rows.update(range(*index[0].indices(global_batch_size)))
    if not rows:
        raise ValueError(f"process {process_index} has no device in the mesh")
    return tuple(sorted(rows))


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh, seed_axis: bool = False) -> dict:
    """Assemble each host's rows ([n, ...] per field; [S, n, ...] with ``seed_axis``) into one global jax.Array per
    field ([B, ...] / [S, B, ...]) in :func:`batch_sharding`.

    Every process passes the rows that :func:`host_batch_rows` names for it, in that (ascending) order; with one
    process that is the whole batch. Each local device gets its row range, found by position among the host's
    rows, so hosts whose rows are not one block (TPU pods) are placed correctly; the same code runs on one
    process and on many.
    """
    sharding = batch_sharding(mesh, seed_axis)
    axis = 1 if seed_axis else 0  # the axis that holds the batch rows
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    # One row per row-block: how many of the n_batch blocks this host holds fixes the global batch size.
    blocks = host_batch_rows(mesh, jax.process_index(), n_batch).size
    out = {}
    for name, value in local_batch.items():
        value = np.asarray(value)
        n_local = value.shape[axis]
        if n_local % blocks:
            raise ValueError(f"global_batch: {name} has {n_local} rows here, not a multiple of this host's {blocks} "
                             "row blocks (pass the rows sharding.host_batch_rows names)")
        b = n_local // blocks * n_batch
        global_shape = value.shape[:axis] + (b,) + value.shape[axis + 1:]
        rows = host_batch_rows(mesh, jax.process_index(), b)
        devices, pieces = [], []
        for device, index in sharding.addressable_devices_indices_map(global_shape).items():
            start, stop, _ = index[axis].indices(b)
            at = int(np.searchsorted(rows, start))
            devices.append(device)
            pieces.append(value[(slice(None),) * axis + (slice(at, at + stop - start),)])
        arrays = jax.device_put(pieces, devices)
        out[name] = jax.make_array_from_single_device_arrays(global_shape, sharding, arrays)
    return out


# -------------------------------------------------------------------------------------------------------- sharded jit
def jit_sharded(fn: Callable, mesh: Mesh, shardings: Any, *, seed_axis: bool = False,
                donate: bool = False) -> Callable:
    """jax.jit of ``fn(x, batch)`` with explicit shardings, traced under the mesh (the model's per-layer FSDP
    gathers and activation constraints, :func:`under_mesh`). The one sharded jit of training and evaluation.

    ``x`` (a train state, or params) comes in ``shardings``; the batch in :func:`batch_sharding` (``seed_axis``:
    [S, B, T]). ``donate=True`` is a train step, ``(state, batch) -> (state, metrics)``: the state is donated
    (updated in place) and comes back in ``shardings``, the metrics replicated. Fixing the out shardings matters:
    left to XLA, an updated parameter may come back in another layout and force a recompile (or a reshard) on the
    next step. ``donate=False`` (evaluation): every output replicated.
    """
    rep = replicated(mesh)
    return jax.jit(under_mesh(fn, mesh), in_shardings=(shardings, batch_sharding(mesh, seed_axis)),
                   out_shardings=(shardings, rep) if donate else rep, donate_argnums=(0,) if donate else ())


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
