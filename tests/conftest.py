"""Test set-up, done at import, before any test module imports jax (JAX reads XLA_FLAGS once, when its CPU backend
starts, and its compilation-cache settings when it is imported).

- Three lanes, one process each, started as soon as collection ends so that they overlap (2 cores): the main
  session (one CPU device); a subprocess with :data:`MESH_DEVICES` fake CPU devices for the tests that carry the
  ``mesh`` marker; and a second one-device subprocess for the modules of :data:`SECOND_LANE_MODULES`. In the main
  session a lane's test is the lane's reports of it, replayed (pass, fail with the lane's traceback, skip, and its
  durations), and none of its fixtures run there, so ``pytest -k``, ``-x`` and the durations table treat lane tests
  like any other.
- Compile-time switches, FAST_COMPILE_FLAGS, for every program the session builds (compilation is most of the
  suite's CPU time). LLVM's optimisations off, and on jaxlib 0.10 the CPU compiler's legacy loop emitters instead
  of its MLIR fusion emitters (3.5x less compile CPU for the tests' gradient programs; jaxlib 0.11 removed the
  switch, and an unknown flag in XLA_FLAGS aborts the process, hence the version test). The legacy emitters fuse
  a little differently (tests/programs.py's coupled_leapfrog+differential gradient program: 480 fusions against 522; temp buffers
  within 1.5%), so no test reads
  memory_analysis; sharding and collectives are the partitioner's, unchanged, and every comparison inside a test
  is between programs compiled alike.
- The persistent compilation cache goes to a fresh temporary directory for the session, never the user's
  ~/.cache/coupled_qk_jax/xla, and keeps every program (minimum compile time 0, where JAX's default of 1 s would
  keep almost none of the tests' small programs): equal programs built by different jit objects (every
  ``loop.train`` builds its own) and by subprocesses (train.py, sample.py, ...; they inherit the variables) compile
  once. It is removed when the session ends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest


def _jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import version  # noqa: PLC0415 - jax itself must not be imported yet

    return tuple(int(part) for part in re.findall(r"\d+", version("jaxlib"))[:2])


FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" + (
    " --xla_cpu_use_fusion_emitters=false" if _jaxlib_version() < (0, 11) else "")
MESH_DEVICES = 8
# The second one-device lane: whole modules, so that their module- and session-scoped fixtures (the shared all-variant
# gradient programs of test_model, test_scan, test_precision) are built once, in that lane. Chosen by measured time
# (last: an idle in-tree run with the fusion-emitter switch, main session 314 s against 265 s and 244 s for the
# lanes, so test_early_stop and test_qkov moved): these take about as long as what stays in the main session beside
# the mesh lane. (Moving test_gcs here measured worse: 739 / 666 / 683 s against 672 / 586 / 568 s.)
SECOND_LANE_MODULES = ("test_attention.py", "test_convert.py", "test_dynamics.py", "test_early_stop.py", "test_generate.py",
                       "test_lowering.py", "test_model.py", "test_precision.py", "test_qkov.py", "test_qkov_bridge.py",
                       "test_scan.py")
# Set in a lane subprocess: where it appends one JSON line per finished test, and its device count.
_LANE_RESULTS_ENV = "COUPLED_QK_JAX_TEST_LANE_RESULTS"
_LANE_DEVICES_ENV = "COUPLED_QK_JAX_TEST_LANE_DEVICES"
IN_LANE_SUBPROCESS = _LANE_RESULTS_ENV in os.environ


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess that needs ``devices`` CPU devices, with the session's compile-time switches."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}"


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = xla_flags(int(os.environ.get(_LANE_DEVICES_ENV, "1")))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ or not IN_LANE_SUBPROCESS:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="coupled_qk_jax_test_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
else:  # a lane shares the session's directory
    _COMPILATION_CACHE = None
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_configure(config):
    config.addinivalue_line("markers", f"mesh: needs several devices (a mesh in-process, or processes that each run "
                                       f"on several); runs in the session's subprocess with {MESH_DEVICES} CPU "
                                       "devices (tests/conftest.py)")


# ------------------------------------------------------------------------------------------ the lane subprocesses
class _Lane:
    """A pytest subprocess that runs some of the session's tests on ``devices`` CPU devices, and the results it has
    written so far."""

    def __init__(self, nodeids: list[str], rootdir: str, devices: int) -> None:
        self.devices = devices
        self.directory = tempfile.mkdtemp(prefix=f"coupled_qk_jax_test_lane{devices}_")
        self.results_path = os.path.join(self.directory, "results.jsonl")
        self.log_path = os.path.join(self.directory, "log.txt")
        env = {**os.environ, _LANE_RESULTS_ENV: self.results_path, _LANE_DEVICES_ENV: str(devices)}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *nodeids],
                cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.results: dict[str, list[dict]] = {}  # nodeid -> its phases' reports, in order
        self.done: set[str] = set()
        self._offset = 0

    def result(self, nodeid: str, timeout: float = 1800) -> list[dict] | None:
        """The lane's reports of ``nodeid``'s phases (waits for its last), or None when the lane ended without them."""
        deadline = time.monotonic() + timeout
        while True:
            self._read()
            if nodeid in self.done:
                return self.results[nodeid]
            if self.proc.poll() is not None:
                self._read()
                return self.results.get(nodeid) if nodeid in self.done else None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _read(self) -> None:
        if not os.path.exists(self.results_path):
            return
        with open(self.results_path, "rb") as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith(b"\n"):  # a line being written: read it next time
                    break
                self._offset += len(line)
                row = json.loads(line)
                self.results.setdefault(row["nodeid"], []).append(row)
                if row["done"]:
                    self.done.add(row["nodeid"])

    def log_tail(self, chars: int = 6000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


_LANE_OF: dict[str, _Lane] = {}  # nodeid -> the lane that runs it (main session only)


def _lane_devices(item) -> int:
    """0 = the main session; else the device count of the lane that runs ``item``."""
    if item.get_closest_marker("mesh"):
        return MESH_DEVICES
    return 1 if item.path.name in SECOND_LANE_MODULES else 0


def pytest_collection_modifyitems(session, config, items):
    if IN_LANE_SUBPROCESS:  # run only the tests it was given
        return
    lanes = {}
    for item in items:
        if devices := _lane_devices(item):
            lanes.setdefault(devices, []).append(item)
    if not lanes:
        return
    # Lane tests last in the main session: by the time it reaches them their lanes have had the whole session.
    items[:] = [item for item in items if not _lane_devices(item)] + [i for d in sorted(lanes) for i in lanes[d]]
    for devices, lane_items in sorted(lanes.items(), reverse=True):  # the mesh lane first: it holds the longest tests
        lane = _Lane([item.nodeid for item in lane_items], str(config.rootpath), devices)
        _LANE_OF.update(dict.fromkeys((item.nodeid for item in lane_items), lane))


def pytest_runtest_logreport(report):
    """In a lane subprocess: one line per phase, appended as it finishes."""
    if not IN_LANE_SUBPROCESS:
        return
    row = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "duration": report.duration}
    if report.failed:
        row["text"] = report.longreprtext[-8000:]
    elif report.skipped:
        row["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    row["done"] = report.when == "teardown" or (report.when == "setup" and not report.passed)
    with open(os.environ[_LANE_RESULTS_ENV], "a") as f:
        f.write(json.dumps(row) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 - pytest hook signature
    """In the main session a lane test is its lane's reports, replayed: none of its fixtures run here, and its
    failures, skips and durations are reported (and count for -x and --durations) as if it had run here."""
    lane = _LANE_OF.get(item.nodeid)
    if lane is None:
        return None
    from _pytest.reports import TestReport  # noqa: PLC0415

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    phases = lane.result(item.nodeid)
    keywords = {k: 1 for k in item.keywords}
    if not phases:
        text = (f"the {lane.devices}-device lane subprocess (exit {lane.proc.poll()}) reported nothing for "
                f"{item.nodeid}; its log:\n{lane.log_tail()}")
        phases = [{"when": "call", "outcome": "failed", "text": text, "duration": 0.0}]
    for row in phases:
        longrepr = None
        if row["outcome"] == "failed":
            longrepr = f"[{lane.devices}-device lane, {row['when']}]\n{row.get('text', '')}"
        elif row["outcome"] == "skipped":
            path, line, _ = item.location
            longrepr = (str(item.path), (line or 0) + 1, row.get("reason", ""))
        report = TestReport(item.nodeid, item.location, keywords, row["outcome"], longrepr, row["when"],
                            duration=row.get("duration", 0.0))
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


_SESSION = {"started": time.monotonic(), "main_done": None}
_LANE_TIME = "<lane time>"  # the row a lane writes last: its session's seconds


def pytest_runtest_logfinish(nodeid, location):  # noqa: ARG001 - pytest hook signature
    if not IN_LANE_SUBPROCESS and nodeid not in _LANE_OF:
        _SESSION["main_done"] = time.monotonic()


def _lane_times() -> list[str]:
    """How long each lane took: the main session's own tests, and each subprocess's session."""
    parts = []
    if _SESSION["main_done"] is not None:
        parts.append(f"main session {_SESSION['main_done'] - _SESSION['started']:.0f} s")
    for lane in sorted(set(_LANE_OF.values()), key=lambda lane: -lane.devices):
        try:
            lane.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            continue
        lane._read()
        if _LANE_TIME in lane.results:
            parts.append(f"{lane.devices}-device lane {lane.results[_LANE_TIME][0]['seconds']:.0f} s")
    return parts


def pytest_terminal_summary(terminalreporter):
    """The lanes' times, for balancing SECOND_LANE_MODULES (collected by pytest_sessionfinish, which runs first)."""
    if _SESSION.get("lanes"):
        terminalreporter.write_line("lanes: " + ", ".join(_SESSION["lanes"]))


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest hook signature
    if IN_LANE_SUBPROCESS:
        with open(os.environ[_LANE_RESULTS_ENV], "a") as f:
            f.write(json.dumps({"nodeid": _LANE_TIME, "seconds": time.monotonic() - _SESSION["started"],
                                "done": True}) + "\n")
    elif _LANE_OF and not (session.shouldfail or session.shouldstop) and exitstatus != pytest.ExitCode.INTERRUPTED:
        _SESSION["lanes"] = _lane_times()
    for lane in set(_LANE_OF.values()):
        lane.close()
    if _COMPILATION_CACHE is not None and not IN_LANE_SUBPROCESS:
        shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)
