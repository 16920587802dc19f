"""Test set-up, done at import, before any test module imports jax (JAX reads XLA_FLAGS once, when its CPU backend
starts, and its compilation-cache settings when it is imported).

- One CPU device for the session. Tests that need a device mesh carry the ``mesh`` marker; they run in ONE pytest
  subprocess with :data:`MESH_DEVICES` fake CPU devices, started as soon as collection ends so it overlaps the rest
  of the session (2 cores: the main session compiles on one, the mesh subprocess on the other). In the main session
  each mesh test waits for its own result from the subprocess and reports it (pass, fail with the subprocess's
  traceback, or skip), so ``pytest -k``, ``-x`` and the durations table treat mesh tests like any other.
- Two compile-time switches, FAST_COMPILE_FLAGS, for every program the session builds. They change LLVM's code
  generation only: the HLO passes, sharding, collectives and buffer assignment (hence memory_analysis) are those of
  a default compile, and every comparison inside a test is between programs compiled alike.
- The persistent compilation cache goes to a fresh temporary directory for the session, never the user's
  ~/.cache/coupled_qk_jax/xla, and keeps every program (minimum compile time 0, where JAX's default of 1 s would
  keep almost none of the tests' small programs): equal programs built by different jit objects (every
  ``loop.train`` builds its own) and by subprocesses (train.py, sample.py, ...; they inherit the variables) compile
  once. It is removed when the session ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
MESH_DEVICES = 8
# Set in the mesh subprocess: where it appends one JSON line per finished test.
_MESH_RESULTS_ENV = "COUPLED_QK_JAX_TEST_MESH_RESULTS"
IN_MESH_SUBPROCESS = _MESH_RESULTS_ENV in os.environ


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess that needs ``devices`` CPU devices, with the session's compile-time switches."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}"


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = xla_flags(MESH_DEVICES if IN_MESH_SUBPROCESS else 1)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ or not IN_MESH_SUBPROCESS:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="coupled_qk_jax_test_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
else:  # the mesh subprocess shares the session's directory (its programs differ: 8 devices)
    _COMPILATION_CACHE = None
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_configure(config):
    config.addinivalue_line("markers", f"mesh: needs several devices (a mesh in-process, or processes that each run "
                                       f"on several); runs in the session's one subprocess with {MESH_DEVICES} CPU "
                                       "devices (tests/conftest.py)")


def runs_in_mesh_subprocess(request) -> bool:
    """True in the main session for a fixture whose tests run in the mesh subprocess: an expensive fixture returns
    None there instead of doing work that only the subprocess uses."""
    return not IN_MESH_SUBPROCESS and request.node.get_closest_marker("mesh") is not None


# ------------------------------------------------------------------------------------------ the mesh subprocess
class _MeshRun:
    """The subprocess that runs the session's mesh tests, and the results it has written so far."""

    def __init__(self, nodeids: list[str], rootdir: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="coupled_qk_jax_test_mesh_")
        self.results_path = os.path.join(self.directory, "results.jsonl")
        self.log_path = os.path.join(self.directory, "log.txt")
        env = {**os.environ, _MESH_RESULTS_ENV: self.results_path}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *nodeids],
                cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.results: dict[str, dict] = {}

    def result(self, nodeid: str, timeout: float = 1800) -> dict | None:
        """The subprocess's record of ``nodeid`` (waits for it), or None when the subprocess ended without one."""
        deadline = time.monotonic() + timeout
        while True:
            self._read()
            if nodeid in self.results and self.results[nodeid].get("done"):
                return self.results[nodeid]
            if self.proc.poll() is not None:
                self._read()
                return self.results.get(nodeid)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    def _read(self) -> None:
        if not os.path.exists(self.results_path):
            return
        with open(self.results_path) as f:
            for line in f:
                if line.endswith("\n"):
                    row = json.loads(line)
                    merged = self.results.setdefault(row["nodeid"], {})
                    merged.update(row)

    def log_tail(self, chars: int = 6000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


_MESH_RUN: list[_MeshRun] = []


def pytest_collection_modifyitems(session, config, items):
    mesh = [item for item in items if item.get_closest_marker("mesh")]
    if IN_MESH_SUBPROCESS:  # run only the mesh tests it was given
        return
    if not mesh:
        return
    # Mesh tests last in the main session: by the time it reaches them the subprocess has had the whole session.
    items[:] = [item for item in items if not item.get_closest_marker("mesh")] + mesh
    _MESH_RUN.append(_MeshRun([item.nodeid for item in mesh], str(config.rootpath)))


def pytest_runtest_logreport(report):
    """In the mesh subprocess: one line per phase, appended as it finishes."""
    if not IN_MESH_SUBPROCESS:
        return
    row = {"nodeid": report.nodeid}
    if report.failed:
        row.update(outcome="failed", phase=report.when, text=report.longreprtext[-8000:], done=True)
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        row.update(outcome="skipped", reason=reason, done=True)
    elif report.when == "call":
        row.update(outcome="passed", seconds=report.duration)
    if report.when == "teardown":
        row["done"] = True
    if len(row) > 1:
        with open(os.environ[_MESH_RESULTS_ENV], "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """In the main session a mesh test's body is its result from the subprocess (its fixtures are cheap: tmp_path
    at most; a mesh test must not take an expensive fixture, which would run here for nothing)."""
    if not (_MESH_RUN and pyfuncitem.get_closest_marker("mesh")):
        return None
    run = _MESH_RUN[0]
    res = run.result(pyfuncitem.nodeid)
    if res is None:
        pytest.fail(f"the mesh subprocess (exit {run.proc.poll()}) reported nothing for {pyfuncitem.nodeid}; its "
                    f"log:\n{run.log_tail()}", pytrace=False)
    if res.get("outcome") == "failed":
        pytest.fail(f"[{MESH_DEVICES}-device subprocess, {res.get('phase')}]\n{res.get('text', '')}", pytrace=False)
    if res.get("outcome") == "skipped":
        pytest.skip(res.get("reason", ""))
    return True


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest hook signature
    for run in _MESH_RUN:
        run.close()
    if _COMPILATION_CACHE is not None and not IN_MESH_SUBPROCESS:
        shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)
