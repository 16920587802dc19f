"""Test set-up. JAX reads XLA_FLAGS once, when its CPU backend starts, so the device count is fixed here, at import,
before any test module imports jax. Eight CPU devices let the sharding tests build (8,1,1), (2,2,2) and (1,4,2)
meshes in one process; single-device tests simply run on device 0."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
