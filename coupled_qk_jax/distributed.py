"""Multi-host start-up: one call, before any other JAX work, that joins this process to JAX's distributed runtime.

    from coupled_qk_jax.distributed import initialize_distributed
    initialize_distributed()          # then build the mesh over jax.devices() (every process's devices)

Where the cluster description comes from, first match wins:

1. Arguments: `initialize_distributed(coordinator_address, num_processes, process_id)`.
2. This project's environment variables (the same names on every node; only the id differs):

       COUPLED_QK_COORDINATOR      host:port of process 0's coordinator, e.g. 10.0.0.1:1234
       COUPLED_QK_NUM_PROCESSES    total number of processes (one per host, or one per GPU)
       COUPLED_QK_PROCESS_ID       this process's id, 0 .. N-1
       COUPLED_QK_LOCAL_DEVICE_IDS optional, comma-separated local device ids this process drives (one-per-GPU runs)

3. JAX's own variables: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (JAX_LOCAL_DEVICE_IDS and
   JAX_COORDINATOR_PORT are read by jax.distributed.initialize itself).
4. Cluster auto-detection by `jax.distributed.initialize()` with no arguments, used when a multi-process cluster is
   visible: a Cloud TPU VM (libtpu installed and TPU chips present: pod slices are found through the TPU metadata),
   SLURM with more than one task, Open MPI with more than one rank, or COUPLED_QK_DISTRIBUTED=auto.

If none applies, or the process count is 1, nothing is initialised (a single-process run needs no coordinator).
COUPLED_QK_DISTRIBUTED=off disables everything.

On the CPU backend a multi-process run turns JAX's persistent compilation cache off (`symmetric_compilation_cache`):
there JAX keys an entry by a topology fingerprint that differs from process to process, and only process 0 writes,
so in a rerun (a resume) process 0 would load its cached programs while the others compile theirs afresh. On jaxlib
0.12 such a pair of programs deadlocks in its first gloo collective.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import logging
import os
from typing import Mapping, Sequence

import jax

ENV_COORDINATOR = "COUPLED_QK_COORDINATOR"
ENV_NUM_PROCESSES = "COUPLED_QK_NUM_PROCESSES"
ENV_PROCESS_ID = "COUPLED_QK_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "COUPLED_QK_LOCAL_DEVICE_IDS"
ENV_MODE = "COUPLED_QK_DISTRIBUTED"  # "auto" | "off" | unset
JAX_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
           "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class DistributedPlan:
    """What `initialize_distributed` will do: mode "none" (single process), "explicit" (coordinator, count and id
    known) or "auto" (let jax.distributed.initialize detect the cluster)."""

    mode: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    reason: str = ""


def _int_field(value: str | int | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _on_cloud_tpu() -> bool:
    """libtpu is installed and this machine has TPU chips (the test JAX itself uses before probing metadata)."""
    return importlib.util.find_spec("libtpu") is not None and bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/*"))


def _multi(env: Mapping[str, str], name: str) -> bool:
    try:
        return int(env.get(name, "1")) > 1
    except ValueError:
        return False


def plan_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
                     env: Mapping[str, str] | None = None) -> DistributedPlan:
    """Resolve arguments, environment and cluster detection into a plan (pure: touches no JAX state)."""
    env = os.environ if env is None else env
    mode = env.get(ENV_MODE, "").strip().lower()
    if mode not in ("", "auto", "off"):
        raise ValueError(f"{ENV_MODE} must be 'auto', 'off' or unset, got {env[ENV_MODE]!r}")
    if mode == "off":
        return DistributedPlan("none", reason=f"{ENV_MODE}=off")

    def pick(arg, ours: str, field: str):
        if arg is not None:
            return arg, "argument"
        if env.get(ours):
            return env[ours], ours
        if env.get(JAX_ENV[field]):
            return env[JAX_ENV[field]], JAX_ENV[field]
        return None, ""

    address, _ = pick(coordinator_address, ENV_COORDINATOR, "coordinator_address")
    count_raw, count_src = pick(num_processes, ENV_NUM_PROCESSES, "num_processes")
    pid_raw, pid_src = pick(process_id, ENV_PROCESS_ID, "process_id")
    count = _int_field(count_raw, count_src or "num_processes")
    pid = _int_field(pid_raw, pid_src or "process_id")
    ids = local_device_ids
    if ids is None and env.get(ENV_LOCAL_DEVICE_IDS):
        ids = [_int_field(x, ENV_LOCAL_DEVICE_IDS) for x in env[ENV_LOCAL_DEVICE_IDS].split(",")]
    ids = tuple(int(i) for i in ids) if ids is not None else None

    if count is not None:
        if count < 1:
            raise ValueError(f"num_processes must be >= 1, got {count}")
        if count == 1:
            return DistributedPlan("none", reason="num_processes=1")
        if not address:
            raise ValueError(f"num_processes={count} needs a coordinator address (argument or {ENV_COORDINATOR})")
        if pid is None:
            raise ValueError(f"num_processes={count} needs a process id (argument or {ENV_PROCESS_ID})")
        if not 0 <= pid < count:
            raise ValueError(f"process_id must be in [0, {count}), got {pid}")
        if ":" not in address:
            raise ValueError(f"coordinator address must be host:port, got {address!r}")
        return DistributedPlan("explicit", address, count, pid, ids, reason="explicit")
    if address or pid is not None:
        raise ValueError(f"a coordinator address or process id was given without the process count "
                         f"(argument or {ENV_NUM_PROCESSES})")
    if mode == "auto":
        return DistributedPlan("auto", local_device_ids=ids, reason=f"{ENV_MODE}=auto")
    if _on_cloud_tpu():
        return DistributedPlan("auto", local_device_ids=ids, reason="Cloud TPU VM")
    if "SLURM_JOB_ID" in env and "SLURM_STEP_NODELIST" in env and _multi(env, "SLURM_NTASKS"):
        return DistributedPlan("auto", local_device_ids=ids, reason="SLURM")
    if "OMPI_MCA_orte_hnp_uri" in env and _multi(env, "OMPI_COMM_WORLD_SIZE"):
        return DistributedPlan("auto", local_device_ids=ids, reason="Open MPI")
    return DistributedPlan("none", reason="no cluster configured")


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
                           initialization_timeout: int = 300) -> bool:
    """Join JAX's distributed runtime if this is a multi-process run; return whether it is (now) initialised.

    Call it first thing, before anything touches a JAX device: JAX fixes the device set when its backend starts.
    Safe to call twice (the second call is a no-op). See the module docstring for where the arguments come from.
    """
    if jax.distributed.is_initialized():
        return True
    plan = plan_distributed(coordinator_address, num_processes, process_id, local_device_ids)
    if plan.mode == "none":
        return False
    kwargs = {"initialization_timeout": initialization_timeout}
    if plan.local_device_ids is not None:
        kwargs["local_device_ids"] = list(plan.local_device_ids)
    if plan.mode == "explicit":
        jax.distributed.initialize(coordinator_address=plan.coordinator_address, num_processes=plan.num_processes,
                                   process_id=plan.process_id, **kwargs)
    else:
        jax.distributed.initialize(**kwargs)
    symmetric_compilation_cache()
    return True


def symmetric_compilation_cache() -> bool:
    """Turn JAX's persistent compilation cache off in a multi-process run on CPU; return whether it was turned off.

    Every process of a run must execute the same programs, and a program loaded from the cache is not the same as a
    freshly compiled one: on jaxlib 0.12 a process that runs a cached train step and one that runs a compiled one
    wait for each other forever in the step's first cross-process (gloo) all-gather. On CPU the two are mixed in
    every rerun that finds the cache, since JAX keys an entry by a topology fingerprint that differs from process to
    process (each one's local devices) while only process 0 writes entries: process 0 hits its own, the others always
    miss. (jaxlib 0.10 happened to run such a mix to the end.) Called by `initialize_distributed`, before the first
    compilation, where JAX decides once per process whether to use the cache.
    """
    if jax.process_count() == 1 or jax.default_backend() != "cpu" or not jax.config.jax_enable_compilation_cache:
        return False
    jax.config.update("jax_enable_compilation_cache", False)
    logging.getLogger(__name__).info("multi-process CPU run: persistent compilation cache off (its entries differ "
                                     "from process to process)")
    return True


def is_main_process() -> bool:
    """True on the process that writes logs, summaries and other single-writer files (process 0)."""
    return jax.process_index() == 0
