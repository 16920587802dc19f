"""Process start-up for the command lines: glibc malloc told to keep its buffers when JAX will run on the CPU.

XLA:CPU allocates every step's temporaries (hundreds of MB at the peer shapes) afresh. glibc's default malloc serves
the large ones with mmap and returns them with munmap, and trims its heaps, so every step page-faults them in again;
threads also get arenas of their own. One arena, no mmap and no trimming keep the freed buffers mapped: the tiny-peer
standard train step took 299 ms instead of 370-442 ms on an idle 2-core CPU (tcmalloc: 271-281
ms). Either half alone changed nothing. The price is memory: freed memory stays with the process (its peak RSS is
what it keeps, 1.6-1.9x glibc's default for the main job).

:func:`configure_process` applies this with ``mallopt`` through ctypes, once per process, when all of these hold:

- ``COUPLED_QK_JAX_MALLOC`` is unset or ``tuned`` (``default`` leaves glibc's malloc as it is);
- JAX will run on the CPU: ``JAX_PLATFORMS`` names ``cpu`` first, or is unset and no accelerator plugin is installed
  (a CUDA/ROCm/TPU host keeps glibc's defaults; host memory is not its step's bottleneck);
- the process's ``malloc`` is glibc's: not tcmalloc, jemalloc or any other allocator preloaded (``LD_PRELOAD``);
- the environment does not configure glibc's malloc itself (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_MAX_``, ...,
  ``GLIBC_TUNABLES=glibc.malloc...``): whoever set those chose.

The entry points (train.py, eval.py, sample.py, export.py, ``python -m coupled_qk_jax.main_job``,
``python -m experiments.sweep`` and the benchmarks) call it first, before JAX starts its backend. Importing
``coupled_qk_jax`` changes nothing: a library user's process keeps its allocator. Nothing here imports JAX.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Mapping

# The opt-out: COUPLED_QK_JAX_MALLOC=default leaves glibc's malloc at its own settings.
ENV_VAR = "COUPLED_QK_JAX_MALLOC"
ENV_VALUES = ("tuned", "default")

# (name, mallopt parameter from glibc's <malloc.h>, value). The trim threshold is the largest int mallopt takes.
MALLOPT_SETTINGS = (("M_ARENA_MAX", -8, 1), ("M_MMAP_MAX", -4, 0), ("M_TRIM_THRESHOLD", -1, 2**31 - 1))

# Environment variables through which a user configures glibc's malloc directly.
GLIBC_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                    "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """What :func:`configure_process` did: ``applied`` maps each mallopt setting set to its value (empty when it
    changed nothing) and ``reason`` says why, in words."""

    applied: dict[str, int]
    reason: str


_REPORT: StartupReport | None = None


def configure_process() -> StartupReport:
    """Applies the CPU malloc settings (module docstring) the first time it is called in a process; every later call
    returns the first call's report and changes nothing. Call it before JAX starts its backend (before the first
    array or device query): arenas that XLA's threads already own are not merged afterwards.

    A value of ``COUPLED_QK_JAX_MALLOC`` other than ``tuned`` or ``default`` prints one ``error:`` line and exits 2.
    """
    global _REPORT
    if _REPORT is None:
        _REPORT = _configure(os.environ)
    return _REPORT


def _configure(env: Mapping[str, str]) -> StartupReport:
    choice = env.get(ENV_VAR, "").strip().lower() or "tuned"
    if choice not in ENV_VALUES:
        print(f"error: {ENV_VAR}={env[ENV_VAR]!r} is not one of {', '.join(ENV_VALUES)}; unset it for the tuned "
              f"CPU malloc or set {ENV_VAR}=default to keep glibc's own settings", file=sys.stderr, flush=True)
        raise SystemExit(2)
    skip = skip_reason(choice, jax_platform(env, accelerator_plugins()), foreign_malloc(env), user_malloc_env(env))
    if skip:
        return StartupReport({}, skip)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = {}
    for name, param, value in MALLOPT_SETTINGS:
        if libc.mallopt(param, value) != 1:  # glibc returns 1 on success; a refusal is a bug to see, not to skip
            raise RuntimeError(f"mallopt({name}, {value}) failed after applying {applied}")
        applied[name] = value
    return StartupReport(applied, "CPU with glibc malloc: one arena, no mmap, no trim")


def skip_reason(choice: str, platform: str, foreign: str | None, user_env: str | None) -> str | None:
    """Why the settings are not applied (None: apply them), from the detected facts: ``choice`` ("tuned" or
    "default"), ``platform`` ("cpu" or an accelerator), ``foreign`` (a non-glibc malloc in use, or None) and
    ``user_env`` (a glibc malloc variable the environment sets, or None)."""
    if choice == "default":
        return f"{ENV_VAR}=default"
    if platform != "cpu":
        return f"JAX will run on {platform}, not the CPU"
    if foreign:
        return f"malloc is not glibc's ({foreign})"
    if user_env:
        return f"the environment configures glibc's malloc ({user_env})"
    return None


def jax_platform(env: Mapping[str, str], plugins: list[str]) -> str:
    """The platform JAX will pick, decided without starting it: the first of ``JAX_PLATFORMS`` when set, else "cpu"
    when no accelerator plugin is installed, else the plugins' names (JAX tries them before the CPU)."""
    named = env.get("JAX_PLATFORMS", "") or env.get("JAX_PLATFORM_NAME", "")
    first = named.split(",")[0].strip().lower()
    if first:
        return first
    return ",".join(plugins) if plugins else "cpu"


def accelerator_plugins() -> list[str]:
    """The PJRT plugins JAX would load (CUDA, ROCm, TPU), found without importing them: the ``jax_plugins``
    namespace package, the ``jax_plugins`` entry points and ``libtpu``."""
    names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    if importlib.util.find_spec("libtpu") is not None:
        names.append("libtpu")
    return sorted(set(names))


def foreign_malloc(env: Mapping[str, str]) -> str | None:
    """A description of the non-glibc ``malloc`` this process uses, or None when it is glibc's.

    The symbol the process resolves ``malloc`` to (the global search order, where LD_PRELOAD comes first) is compared
    with glibc's own; that covers tcmalloc, jemalloc, mimalloc and any other interposer, preloaded or linked in.
    Not glibc at all (no libc.so.6, e.g. musl or macOS) counts as foreign too."""
    try:
        glibc = ctypes.CDLL("libc.so.6")
        glibc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return f"no glibc ({sys.platform})"
    in_use = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    if in_use == ctypes.cast(glibc.malloc, ctypes.c_void_p).value:
        return None
    return f"LD_PRELOAD={env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else "an interposed malloc"


def user_malloc_env(env: Mapping[str, str]) -> str | None:
    """The first glibc malloc setting the environment makes (e.g. "MALLOC_ARENA_MAX"), or None."""
    for name in GLIBC_MALLOC_ENV:
        if name in env:
            return name
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None
