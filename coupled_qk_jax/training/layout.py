"""The one set-up that the trainer (training/loop.py) and the reader of saved runs (training/run.py) share: the
device mesh, the optimiser and the train state's abstract shapes and shardings on that mesh.

    mesh = make_mesh(run)                               # training: the config's mesh block, checked against the run
    mesh = reader_mesh("data:2")                        # reading: any mesh over this process's (or every) device
    layout = state_layout(run.model, run.train, run.train.seeds, mesh, runtime=run.runtime)

Each is built once per start and handed down; nothing here holds device memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.config import ModelConfig, RuntimeConfig
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.model import TransformerLM, to_scanned, to_unscanned
from coupled_qk_jax.training import optimizer as opt_lib
from coupled_qk_jax.training import rundir, tasks
from coupled_qk_jax.training.checkpoint import abstract_target
from coupled_qk_jax.training.config import RunConfig, TrainConfig
from coupled_qk_jax.training.early_stop import EarlyStop
from coupled_qk_jax.training.steps import init_train_state, split_model

# --------------------------------------------------------------------------------------------------------------------
# The training mesh.
# --------------------------------------------------------------------------------------------------------------------


def validate_on_mesh(run: RunConfig, mesh_batch_devices: int) -> None:
    """The checks that need the processes and the mesh (RunConfig checked everything else); one-line UserErrors."""
    b, accum = run.train.batch_size, run.train.grad_accum
    if (b // accum) % mesh_batch_devices:
        raise UserError(f"the micro-batch train.batch_size/train.grad_accum={b // accum} is not divisible by the "
                        f"{mesh_batch_devices} data-parallel devices (mesh.data * mesh.fsdp); change the batch "
                        f"size or --config.mesh.data")
    EarlyStop.from_config(run.train.early_stop, 1, tasks.task_class(run.task).metric_names)  # the metric is this task's


def make_mesh(run: RunConfig) -> Mesh:
    """The run's training mesh, after the checks that need it (:func:`validate_on_mesh`); every mistake is a
    UserError."""
    try:
        shd.mesh_shape(run.mesh.sizes())  # the mesh block's own checks (sizes, -1) are the user's config mistakes
    except ValueError as e:
        raise UserError(str(e)) from None
    mesh = shd.make_mesh(run.mesh.sizes())
    validate_on_mesh(run, mesh.shape["data"] * mesh.shape["fsdp"])
    return mesh


# --------------------------------------------------------------------------------------------------------------------
# The reader's mesh.
# --------------------------------------------------------------------------------------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
    """``"data:2,fsdp:1,tensor:1"`` -> ``{"data": 2, "fsdp": 1, "tensor": 1}``; an axis not named is 1, and one
    axis may be -1 (every device, of every process). Raises UserError naming the flag's form."""
    sizes = dict.fromkeys(shd.MESH_AXES, 1)
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        axis, _, value = part.partition(":")
        axis = axis.strip()
        try:
            size = int(value)
        except ValueError:
            size = 0
        if axis not in sizes or size == 0 or size < -1:
            raise UserError(f"--mesh={text!r}: expected AXIS:SIZE pairs of {', '.join(shd.MESH_AXES)}, e.g. "
                            f"--mesh=data:2,fsdp:1,tensor:1 (-1 = every device)")
        sizes[axis] = size
    return sizes


def reader_mesh(mesh: str | Mapping[str, int] | Mesh | None = None) -> Mesh:
    """The mesh a reader restores onto: the given Mesh, or a ``parse_mesh`` string or mapping over the first devices
    of ``jax.devices()``, or (None) one device.

    On several processes (a reader launched like a multi-host train.py) ``jax.devices()`` holds every process's
    devices and the mesh must use all of them: each process runs every program of the mesh, so one without devices
    in it would have nothing to run them on. None there means every device on the data axis."""
    if isinstance(mesh, Mesh):
        return mesh
    devices = jax.devices()
    multi = jax.process_count() > 1
    if mesh is None and multi:
        mesh = {**dict.fromkeys(shd.MESH_AXES, 1), "data": -1}
    sizes = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh or dict.fromkeys(shd.MESH_AXES, 1))
    n = len(devices) if -1 in sizes.values() else int(np.prod(list(sizes.values())))
    where = f"the {jax.process_count()} processes have" if multi else "this process has"
    if n > len(devices) or (multi and n != len(devices)):
        raise UserError(f"--mesh {sizes} needs {n} devices, {where} {len(devices)}"
                        + (" (on several processes the mesh uses every device)" if multi else ""))
    try:
        return shd.make_mesh(sizes, devices[:n])
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None


# --------------------------------------------------------------------------------------------------------------------
# The train state's shapes and shardings on a mesh.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a train state of this model looks like on a mesh. Nothing here holds device memory."""

    graphdef: Any
    abstract_state: dict  # ShapeDtypeStructs of {"params", "opt_state", "step"}; a leading seed axis when S > 1
    shardings: dict  # NamedShardings of the train state (the seed axis replicated)
    param_shardings: Any  # one replica's params' NamedShardings (no seed axis)
    tx: Any
    n_params: int  # of one replica


def state_layout(mcfg: ModelConfig, train_cfg: TrainConfig, seeds: list[int], mesh: Mesh,
                 lr_extensions: tuple[tuple[int, int], ...] = (), *,
                 runtime: RuntimeConfig = RuntimeConfig()) -> StateLayout:
    """The abstract model, optimiser and shardings of a run with ``seeds`` on ``mesh``, its layers laid out as
    ``runtime`` says. With several seeds every leaf gets a leading seed axis [S, ...], replicated over the mesh: each
    seed is sharded as a single run."""
    abstract_model = nnx.eval_shape(lambda: TransformerLM(mcfg, seeds[0], runtime))
    graphdef, abstract_params = split_model(abstract_model)
    tx = opt_lib.make_optimizer(abstract_params, train_cfg, lr_extensions)
    abstract_state = jax.eval_shape(lambda p: init_train_state(p, tx), abstract_params)
    shardings = shd.train_state_shardings(abstract_model, tx, abstract_state, mesh)
    param_shardings = shardings["params"]
    if len(seeds) > 1:
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((len(seeds),) + x.shape, x.dtype),
                                      abstract_state)
        shardings = jax.tree.map(lambda sh: NamedSharding(mesh, P(None, *sh.spec)), shardings)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))
    return StateLayout(graphdef, abstract_state, shardings, param_shardings, tx, n_params)


def restore_target(abstract_state: dict, shardings: dict, mcfg: ModelConfig, runtime: RuntimeConfig,
                   train_cfg: TrainConfig, seeds: list[int], mesh: Mesh,
                   entries: tuple[str, ...] = ("params", "opt_state", "step"),
                   ) -> Callable[[dict[str, Any]], tuple[dict, Callable[[dict], dict]]]:
    """What Checkpointer.restore reads a checkpoint into, for a state wanted as ``abstract_state`` in ``shardings``
    (a StateLayout's, of ``runtime``), as a function of the checkpoint's meta record: its config says which layer
    layout it was saved in. A checkpoint of the other layout (runtime.scan_layers changed since) is read in its own
    and converted (model.to_scanned / to_unscanned, AdamW's moments alike) into ``shardings``. ``entries``: the
    state's top-level entries to read (a reader's ``("params",)``)."""
    def pick(tree: dict) -> dict:
        return {k: tree[k] for k in entries}

    def target_for(meta: dict[str, Any]) -> tuple[dict, Callable[[dict], dict]]:
        saved_runtime = rundir.upgrade_config(meta["config"])[0].get("runtime", {})
        saved_scanned = bool(saved_runtime.get("scan_layers", False))
        if saved_scanned == runtime.scan_layers:
            return abstract_target(pick(abstract_state), pick(shardings)), lambda state: state
        saved = state_layout(mcfg, train_cfg, seeds, mesh,
                             runtime=dataclasses.replace(runtime, scan_layers=saved_scanned))
        convert = to_scanned if runtime.scan_layers else to_unscanned
        if len(seeds) > 1:  # each seed's state is converted alone (the leading axis is the seed's, not a layer's)
            convert = jax.vmap(convert)
        return (abstract_target(pick(saved.abstract_state), pick(saved.shardings)),
                jax.jit(convert, out_shardings=pick(shardings)))

    return target_for
