"""Test set-up, done at import, before any test module imports jax (JAX reads XLA_FLAGS once, when its CPU backend
starts, and its compilation-cache settings when it is imported).

- Eight CPU devices let the sharding tests build (8,1,1), (2,2,2) and (1,4,2) meshes in one process; single-device
  tests simply run on device 0.
- Two compile-time switches, FAST_COMPILE_FLAGS, for every program the session builds. They change LLVM's code
  generation only: the HLO passes, sharding, collectives and buffer assignment (hence memory_analysis) are those of
  a default compile, and every comparison inside a test is between programs compiled alike. Compilation dominates
  the suite; measured on test_training.py + test_observe.py, they cut its CPU time by 37% (89 s -> 56 s).
- The persistent compilation cache (training/observe.py, on in every training run) goes to a fresh temporary
  directory for the session, never the user's ~/.cache/coupled_qk_jax/xla: a test run neither reads programs that
  an earlier version of the code left there nor fills it. Subprocesses the tests start (train.py, sample.py, ...)
  inherit the variable and share the directory; it is removed when the session ends.
"""

import os
import shutil
import tempfile

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess that needs ``devices`` CPU devices, with the session's compile-time switches."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}"


os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " " + FAST_COMPILE_FLAGS
os.environ["XLA_FLAGS"] = _flags.strip()

_COMPILATION_CACHE = tempfile.mkdtemp(prefix="coupled_qk_jax_test_xla_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest hook signature
    shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)
