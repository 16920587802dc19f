"""Process start-up (coupled_qk_jax/startup.py): glibc malloc's settings applied once, by the entry points only.

The effect is read from glibc itself in fresh processes (this test process keeps its allocator): ``mallinfo2`` for
where a 64 MB block came from (mmap by default, the heap once mmap is off, kept after free once trimming is off) and
``malloc_info`` for the arenas a new thread's malloc creates (one per thread by default, none once one arena is the
limit). Each check that something is NOT applied has its positive control in the same test.
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import json
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

from coupled_qk_jax import startup

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Every command line that starts a process (the benchmark scripts found, so that a new one cannot be missed).
# bench_torch_peer.py is the PyTorch peer: it runs with PyTorch's default allocator, which is what its user gets.
ENTRY_POINTS = sorted({"train.py", "eval.py", "sample.py", "export.py", "coupled_qk_jax/main_job.py",
                       "coupled_qk_jax/smoke.py", "experiments/sweep.py", "experiments/qkov_paper.py",
                       "experiments/qkov_fixed_attention.py", "experiments/qkov_synthetic.py",
                       "experiments/qkov_lm_bridge.py",
                       *(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py"))}
                      - {"benchmarks/bench_torch_peer.py"})
# The console scripts (pyproject.toml's [project.scripts], "module:function"); each function configures the process
# first, as an entry point's main block does. Not these: the ahead-of-time compile's work is the TPU compiler's (and
# it sets JAX_PLATFORMS=cpu only on import), and prepare tokenises text without JAX.
CONSOLE_SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
UNCONFIGURED_CONSOLE_SCRIPTS = {"coupled-qk-aot", "coupled-qk-prepare"}

# Runs in a fresh interpreter: optional imports (argv[1], comma-separated), then configure_process() unless argv[2] is
# "no", twice with the opt-out set in between, then glibc's own view of a 64 MB malloc and of a new thread's arena.
PROBE = r"""
import ctypes, importlib, json, os, sys, threading
for name in filter(None, sys.argv[1].split(",")):
    importlib.import_module(name)
from coupled_qk_jax import startup
before = startup._REPORT
report = again = None
if sys.argv[2] != "no":
    report = startup.configure_process()
    os.environ[startup.ENV_VAR] = "default"  # a later call must neither re-decide nor undo
    again = startup.configure_process()
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                                               "keepcost").split()]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
m0 = libc.mallinfo2()
block = libc.malloc(64 << 20)
m1 = libc.mallinfo2()
libc.free(block)
m2 = libc.mallinfo2()
def thread_malloc():
    libc.free(libc.malloc(1000))
t = threading.Thread(target=thread_malloc); t.start(); t.join()
path = os.path.join(sys.argv[3], "malloc_info.xml")
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
fp = libc.fopen(path.encode(), b"w"); libc.malloc_info(0, fp); libc.fclose(fp)
print(json.dumps({
    "before": before is not None,
    "report": report and {"applied": report.applied, "reason": report.reason},
    "same_report": again is report,
    "mmapped_delta": m1.hblkhd - m0.hblkhd,   # bytes of the 64 MB block served by mmap
    "heap_delta": m1.uordblks - m0.uordblks,  # bytes of it served from the arenas' heaps
    "trimmed": m1.arena - m2.arena,           # heap bytes returned to the kernel by the free
    "arenas": open(path).read().count("<heap nr="),
}))
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(),
                                reason="glibc >= 2.33 (mallinfo2) on Linux")


def _env(**extra: str) -> dict[str, str]:
    """This environment without anything that configures malloc, JAX on the CPU, the checkout on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in (startup.ENV_VAR, "LD_PRELOAD", "GLIBC_TUNABLES", *startup.GLIBC_MALLOC_ENV)}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def probe(tmp_path: pathlib.Path, imports: str = "", configure: bool = True, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, imports, "yes" if configure else "no", str(tmp_path)],
                         cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


BLOCK = 64 << 20


def test_applied_once_with_glibcs_own_effect_and_not_under_the_opt_out(tmp_path):
    tuned = probe(tmp_path)
    assert tuned["report"]["applied"] == {"M_ARENA_MAX": 1, "M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**31 - 1}
    # Once per process: the second call (made with the opt-out set) returns the first report unchanged.
    assert tuned["same_report"] and not tuned["before"]
    # The effect, measured by glibc: the block comes from the heap, stays there after free, and a new thread's
    # malloc creates no arena of its own.
    assert tuned["mmapped_delta"] == 0 and tuned["heap_delta"] >= BLOCK and tuned["trimmed"] == 0
    assert tuned["arenas"] == 1

    # Positive control and the opt-out: glibc's defaults mmap the block (and unmap it) and give the thread an arena.
    default = probe(tmp_path, **{startup.ENV_VAR: "default"})
    assert default["report"] == {"applied": {}, "reason": f"{startup.ENV_VAR}=default"}
    assert default["mmapped_delta"] >= BLOCK and default["heap_delta"] < BLOCK
    assert default["arenas"] >= 2


def test_not_applied_when_another_allocator_is_preloaded(tmp_path):
    libs = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
                        "/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                        "/usr/lib64/libtcmalloc.so.4", "/usr/lib64/libjemalloc.so.2") if os.path.exists(p)]
    if not libs:
        pytest.skip("neither tcmalloc nor jemalloc is installed (Debian: libgoogle-perftools4, libjemalloc2)")
    for lib in libs[:2]:
        preloaded = probe(tmp_path, LD_PRELOAD=lib)
        assert preloaded["report"] == {"applied": {}, "reason": f"malloc is not glibc's (LD_PRELOAD={lib})"}
    # Positive control: a preload that is not a malloc (here: glibc's libm) is not mistaken for one.
    libm = ctypes.util.find_library("m")
    control = probe(tmp_path, LD_PRELOAD=libm)
    assert control["report"]["applied"] and control["mmapped_delta"] == 0


def test_importing_the_library_changes_nothing(tmp_path):
    imports = ("coupled_qk_jax,coupled_qk_jax.training.loop,coupled_qk_jax.main_job,coupled_qk_jax.generate,"
               "coupled_qk_jax.export,coupled_qk_jax.cli.train,coupled_qk_jax.cli.eval,experiments.sweep")
    untouched = probe(tmp_path, imports, configure=False)
    assert not untouched["before"]  # nothing called configure_process
    assert untouched["mmapped_delta"] >= BLOCK and untouched["arenas"] >= 2  # glibc's defaults in force
    # Positive control, same imports: the explicit call still takes effect afterwards.
    called = probe(tmp_path, imports)
    assert called["report"]["applied"] and called["mmapped_delta"] == 0


def test_decision_from_the_detected_facts():
    assert startup.skip_reason("tuned", "cpu", None, None) is None
    assert startup.skip_reason("default", "cpu", None, None) == f"{startup.ENV_VAR}=default"
    assert startup.skip_reason("tuned", "cuda", None, None) == "JAX will run on cuda, not the CPU"
    assert startup.skip_reason("tuned", "cpu", "LD_PRELOAD=libtcmalloc.so.4", None) == \
        "malloc is not glibc's (LD_PRELOAD=libtcmalloc.so.4)"
    assert startup.skip_reason("tuned", "cpu", None, "MALLOC_ARENA_MAX") == \
        "the environment configures glibc's malloc (MALLOC_ARENA_MAX)"
    # The platform JAX will pick, without starting it: JAX_PLATFORMS' first entry, else any installed plugin.
    assert startup.jax_platform({}, []) == "cpu"
    assert startup.jax_platform({}, ["xla_cuda12"]) == "xla_cuda12"
    assert startup.jax_platform({"JAX_PLATFORMS": "cpu"}, ["xla_cuda12"]) == "cpu"
    assert startup.jax_platform({"JAX_PLATFORMS": "cuda,cpu"}, []) == "cuda"
    assert startup.user_malloc_env({"MALLOC_MMAP_MAX_": "0"}) == "MALLOC_MMAP_MAX_"
    assert startup.user_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == "GLIBC_TUNABLES"
    assert startup.user_malloc_env({"GLIBC_TUNABLES": "glibc.rtld.nns=2", "PATH": "/bin"}) is None
    # This test process: glibc's malloc (nothing preloaded by the test runner) on the CPU.
    if "LD_PRELOAD" not in os.environ:
        assert startup.foreign_malloc(os.environ) is None


def test_a_mistyped_opt_out_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from coupled_qk_jax import startup; startup.configure_process()"],
                         cwd=ROOT, env=_env(**{startup.ENV_VAR: "off"}), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: {startup.ENV_VAR}='off'")
    assert "default" in out.stderr


def _calls_configure_first(source: str) -> bool:
    """True when the ``if __name__ == "__main__":`` block calls configure_process() before anything else runs."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'"):
            for stmt in node.body:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    continue
                return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                        and ast.unparse(stmt.value.func).endswith("configure_process"))
    return False


def _function_configures_first(source: str, name: str) -> bool:
    """True when function ``name`` calls configure_process() before anything else (its docstring and imports
    aside)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            for stmt in node.body:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)) or (
                        isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                    continue
                return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                        and ast.unparse(stmt.value.func).endswith("configure_process"))
    return False


def _console_script_target(source: str) -> str | None:
    """``module:function`` of a console script when the ``__main__`` block's first statement calls it, imported
    with ``from module import function`` (a thin top-level file such as train.py), else None."""
    imported = {alias.asname or alias.name: f"{node.module}:{alias.name}" for node in ast.parse(source).body
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'"):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call):
                target = imported.get(ast.unparse(first.value.func))
                return target if target in CONSOLE_SCRIPTS.values() else None
    return None


def _configures_first(target: str) -> bool:
    module, _, function = target.partition(":")
    return _function_configures_first((ROOT / (module.replace(".", "/") + ".py")).read_text(), function)


def test_every_console_script_configures_the_process_first():
    assert {"coupled-qk-train", "coupled-qk-eval", "coupled-qk-sample", "coupled-qk-export"} <= set(CONSOLE_SCRIPTS)
    missing = [name for name, target in CONSOLE_SCRIPTS.items()
               if name not in UNCONFIGURED_CONSOLE_SCRIPTS and not _configures_first(target)]
    assert not missing, f"call coupled_qk_jax.startup.configure_process() first in the function of {missing}"
    # Positive control: a function that starts work first is caught; a docstring and imports may come first.
    assert not _function_configures_first("def main():\n    run()\n    configure_process()\n", "main")
    assert _function_configures_first('def main():\n    """Doc."""\n    from x import configure_process\n'
                                      "    configure_process()\n", "main")


def test_every_entry_point_configures_the_process_first():
    assert len(ENTRY_POINTS) >= 21

    def configured(path: str) -> bool:
        source = (ROOT / path).read_text()
        target = _console_script_target(source)  # train.py etc.: the console script's function, checked above
        return _calls_configure_first(source) or (target is not None and _configures_first(target))

    missing = [p for p in ENTRY_POINTS if not configured(p)]
    assert not missing, f"call coupled_qk_jax.startup.configure_process() first in the __main__ block of {missing}"
    # Positive control: a main block that starts work first, or lacks the call, is caught.
    assert not _calls_configure_first('if __name__ == "__main__":\n    main()\n    configure_process()\n')
    assert not _calls_configure_first("def main():\n    configure_process()\n")
    assert _calls_configure_first('if __name__ == "__main__":\n    from x import configure_process\n'
                                  '    configure_process()\n    main()\n')
    # A thin file counts through the console script it calls, and only through one.
    thin = 'from coupled_qk_jax.cli.train import main\n\nif __name__ == "__main__":\n    main()\n'
    assert _console_script_target(thin) == "coupled_qk_jax.cli.train:main"
    assert _console_script_target(thin.replace("coupled_qk_jax.cli.train", "elsewhere")) is None
