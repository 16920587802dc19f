"""A real 2-process run on localhost: jax.distributed (gloo CPU collectives), 2 CPU devices per process, a
(data=1, fsdp=2, tensor=2) mesh whose fsdp axis spans the two processes. It trains 5 steps with an orbax multi-host
checkpoint at step 3; every loss must equal, bit for bit, the loss of a 1-process run on 4 devices with the same
mesh shape. The same processes first evaluate on a mesh whose tensor axis spans the processes, and then train again
on a data-parallel mesh whose rows interleave between the processes. train.py itself then stops on 2 processes and
resumes on 1 and on 2; eval.py, export.py and sample.py read a run on 2 processes as an older version did on one.

The processes are started with subprocess.Popen (tests/multihost_worker.py) and joined with a timeout; stragglers
are killed in `finally`. Plus the pure parts of coupled_qk_jax.distributed (argument / environment resolution).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from conftest import xla_flags

from coupled_qk_jax import distributed

# Processes with several CPU devices each: in the mesh lane (conftest.py), beside the main session.
pytestmark = pytest.mark.mesh
ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multihost_worker.py"
TIMEOUT_S = 900  # a hang guard: 74 s idle, 194 s on a loaded machine


def _env(local_devices: int, cluster: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COUPLED_QK_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(local_devices),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(cluster)
    return env


def launch(phase: str, workdir: pathlib.Path, n_processes: int, local_devices: int, mesh: str = "1,2,2",
           eval_mesh: str = "", extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """Start one run: n_processes workers (a coordinator on a free localhost port when n_processes > 1)."""
    procs = []
    port = None
    if n_processes > 1:
        portpicker = pytest.importorskip("portpicker")
        port = portpicker.pick_unused_port()
    for pid in range(n_processes):
        cluster = {}
        if n_processes > 1:
            cluster = {distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                       distributed.ENV_NUM_PROCESSES: str(n_processes), distributed.ENV_PROCESS_ID: str(pid)}
        cmd = [sys.executable, str(WORKER), "--phase", phase, "--workdir", str(workdir.absolute()),
               "--local-devices", str(local_devices), "--mesh", mesh, "--eval-mesh", eval_mesh, *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(local_devices, cluster), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def join(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for every worker; return their outputs (assert exit code 0, with the output on failure)."""
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outs.append(out)
            assert p.returncode == 0, f"worker exited with {p.returncode}:\n{out[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def losses(out: str, name: str) -> dict[int, str]:
    """The LOSS lines of the training named ``name`` (``<mesh>/<device order>``): step -> float.hex."""
    return {int(line.split()[2]): line.split()[3] for line in out.splitlines() if line.startswith(f"LOSS {name} ")}


def rows_of(out: str, name: str) -> list[str]:
    return [line.split()[3] for line in out.splitlines() if line.startswith(f"ROWS {name} ")]


def exported(out: str) -> tuple[str, str]:
    line = [x for x in out.splitlines() if x.startswith("EXPORT ")]
    assert line, out[-4000:]
    return tuple(line[-1].split()[1:])


def done(out: str) -> tuple[int, int, int]:
    line = [x for x in out.splitlines() if x.startswith("DONE ")]
    assert line, out[-4000:]
    return tuple(int(x) for x in line[-1].split()[1:])


def eval_result(out: str) -> tuple[float, int]:
    line = [x for x in out.splitlines() if x.startswith("EVAL ")]
    assert line, out[-4000:]
    loss, tokens = line[-1].split()[1:]
    return float.fromhex(loss), int(tokens)


def test_two_process_train_and_checkpoint_equal_one_process(tmp_path):
    """One start of 2 processes against one of 1 process x 4 devices (same mesh shapes), three programs each:

    - An evaluation on a (data=1, fsdp=1, tensor=4) mesh. There the tensor axis spans the processes, so both hold
      the same batch rows and must feed the same windows (sharding.host_batch_rows gives both every row). Handing
      windows out by process index instead would score each host's different windows as the same rows: a different
      loss and half the tokens.
    - Training on mesh 1,2,2 (fsdp across the processes) with a multi-host checkpoint (resumes: the train.py test
      below): losses and the exported final params bit for bit the 1-process run's.
    - Training on a (data=4) mesh over the devices of the two processes in turn (p0, p1, p0, p1), as a TPU pod's
      ICI order mixes hosts: each process holds two separate blocks of the batch of 8 (process 0 rows 0-1 and 4-5),
      loads just those, and the losses are the 1-process run's, bit for bit.

    Why two trainings rather than one: a mesh over 4 devices whose rows interleave between the processes needs
    data * fsdp = 4, and with fsdp > 1 there the 2-process losses leave the 1-process run's in the last bit
    (measured: interleaved meshes 2,2,1 at step 5 and 1,4,1 at step 4; presumably gloo sums a reduction over 4
    devices in another order than one process does), while fsdp = 2 in jax.make_mesh's order and pure data
    parallelism agree bit for bit. One start of the processes runs both trainings: a second start costs more than
    a second compiled train step."""
    extra = ("--then-mesh", "4,1,1")
    single = launch("train", tmp_path / "single", n_processes=1, local_devices=4, eval_mesh="1,1,4", extra=extra)
    try:
        two = join(launch("train", tmp_path / "multi", n_processes=2, local_devices=2, eval_mesh="1,1,4",
                          extra=extra))
    finally:
        one = join(single)[0]

    assert done(one) == (0, 1, 4)
    assert [done(o) for o in two] == [(0, 2, 4), (1, 2, 4)]
    # Several processes run without the persistent compilation cache: with it, a resume's process 0 would load its
    # cached train step and process 1 compile its own, and on jaxlib 0.12 the two deadlock in their first gloo
    # all-gather (distributed.symmetric_compilation_cache). The 1-process run is the positive control.
    assert "COMPILATION_CACHE True" in one
    assert all("COMPILATION_CACHE False" in o for o in two)

    ref_loss, ref_tokens = eval_result(one)
    assert ref_tokens == 1000  # every token of the stream scored exactly once (bos_id given)
    for out in two:
        loss, tokens = eval_result(out)
        assert tokens == ref_tokens
        assert loss == pytest.approx(ref_loss, rel=1e-6)

    fsdp = "1,2,2/make_mesh"
    reference = losses(one, fsdp)
    assert sorted(reference) == [1, 2, 3, 4, 5]
    assert len(set(reference.values())) == 5, "the loss must change from step to step (else nothing is trained)"
    for out in two:  # both processes see the same replicated loss, bit for bit the 1-process one
        assert losses(out, fsdp) == reference
    # export.flatten_params of the final params: on 2 processes (fsdp across them, so no process holds a whole
    # weight) every process gets the 1-process run's tensors, bit for bit.
    digest, whole = exported(one)
    assert whole == "True"
    for out in two:
        assert exported(out) == (digest, "False")
    assert (tmp_path / "multi" / "ckpt" / "3").is_dir()

    interleaved = "4,1,1/interleaved"
    assert [rows_of(out, interleaved) for out in (one, *two)] == [["0,1,2,3,4,5,6,7"], ["0,1,4,5"], ["2,3,6,7"]]
    reference = losses(one, interleaved)
    assert sorted(reference) == [1, 2, 3] and len(set(reference.values())) == 3
    for out in two:
        assert losses(out, interleaved) == reference

    assert distributed.initialize_distributed(num_processes=1) is False


# ------------------------------------------------------------------------------------------ train.py end to end
def _train_cmd(workdir: pathlib.Path, corpus: pathlib.Path, cache: pathlib.Path) -> list[str]:
    args = [str(ROOT / "train.py"), "--config=configs/lm.py:coupled_euler,tiny", f"--workdir={workdir}",
            "--config.model.vocab_size=264", "--config.model.d_model=32", "--config.model.n_layers=2",
            "--config.model.n_heads=4", "--config.model.d_ff=64", "--config.model.max_len=32",
            "--config.model.coupling_hidden=6", f"--config.data.corpus=text_dir:{corpus}",
            "--config.data.tokenizer=byte", "--config.data.seq_len=32", "--config.data.split_fractions=0.6,0.2,0.2",
            f"--config.data.cache_dir={cache}",
            "--config.train.steps=4", "--config.train.batch_size=8", "--config.train.warmup_steps=2",
            "--config.train.log_every=1", "--config.train.eval_every=0", "--config.train.eval_batches=1",
            "--config.checkpoint.every=2", "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.mesh.tensor=2"]
    return [sys.executable] + args  # train.py joins the cluster itself (distributed.initialize_distributed)


def _train_losses(workdir: pathlib.Path) -> dict[int, float]:
    import json

    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train_loss" in rec:
            out[int(rec["step"])] = float(rec["train_loss"])
    return out


def _start_train_py(workdir: pathlib.Path, corpus: pathlib.Path, cache: pathlib.Path, n_processes: int,
                    local_devices: int, extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """train.py in n_processes processes of local_devices CPU devices (a coordinator on a free port when > 1)."""
    cmd = _train_cmd(workdir, corpus, cache) + list(extra)
    if n_processes == 1:
        return [subprocess.Popen(cmd, cwd=ROOT, env=_env(local_devices, {}), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)]
    port = pytest.importorskip("portpicker").pick_unused_port()
    procs = []
    for pid in range(n_processes):
        cluster = {distributed.ENV_COORDINATOR: f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: str(n_processes),
                   distributed.ENV_PROCESS_ID: str(pid)}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(local_devices, cluster), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def test_train_py_two_processes_matches_one_process_and_resumes_on_any_host_count(tmp_path):
    """`train.py` itself: 2 processes x 2 CPU devices (mesh fsdp=2 across the processes, tensor=2) stop at step 2
    with a checkpoint, against an uninterrupted 1 process x 4 devices run to step 4. Each host reads its rows of the
    same global batches (sharding.host_batch_rows), so the batches are the 1-process run's; the losses are
    compared to fp32 summation order. The 2-process checkpoint then resumes on 1 process x 4 devices and on 2
    processes x 2 devices: the data position is the step, not per-process loader state, so both continue with the
    uninterrupted run's batches and losses. The two processes share one token cache directory: process 0 tokenises
    into it (and says so), process 1 waits and reads it; the 1-process run, with a cache of its own, is the positive
    control for the "tokenising" line."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words, size=300)) + "\n")
    procs = []
    try:
        procs += _start_train_py(tmp_path / "one", corpus, tmp_path / "cache_one", 1, 4)
        procs += _start_train_py(tmp_path / "two", corpus, tmp_path / "cache_two", 2, 2,
                                 ("--config.train.stop_after=2",))
    finally:
        outs = join(procs)
    one, two = _train_losses(tmp_path / "one"), _train_losses(tmp_path / "two")
    assert sorted(one) == [1, 2, 3, 4], outs[0][-3000:]
    assert sorted(two) == [1, 2], outs[1][-3000:]
    for step in two:
        assert two[step] == pytest.approx(one[step], rel=1e-5), (step, one, two)
    assert (tmp_path / "two" / "checkpoints" / "2").is_dir()
    tokenised = [[line for line in out.splitlines() if line.startswith("tokenising ")] for out in outs]
    assert len(tokenised[0]) == 1, outs[0][-3000:]  # the 1-process run tokenised into its own cache
    assert len(tokenised[1]) == 1 and tokenised[1][0].endswith("(process 0)"), outs[1][-3000:]
    assert tokenised[2] == [], outs[2][-3000:]  # process 1 read process 0's entry
    # One entry, the 1-process run's key, complete and nothing else (the shared-storage probe file is removed).
    entries = list((tmp_path / "cache_two" / "tokens").iterdir())
    assert [e.name for e in entries] == [e.name for e in (tmp_path / "cache_one" / "tokens").iterdir()], entries
    assert sorted(f.name for f in entries[0].iterdir()) == ["manifest.json", "test.bin", "train.bin", "validation.bin"]

    for name in ("on_one", "on_two"):
        shutil.copytree(tmp_path / "two", tmp_path / name)
    procs = []
    try:
        procs += _start_train_py(tmp_path / "on_one", corpus, tmp_path / "cache_two", 1, 4)
        procs += _start_train_py(tmp_path / "on_two", corpus, tmp_path / "cache_two", 2, 2)
    finally:
        outs = join(procs)
    for name, out in zip(("on_one", "on_two"), outs[:2]):
        assert "resuming from" in out and "at step 2" in out, out[-3000:]
        resumed = _train_losses(tmp_path / name)
        assert sorted(resumed) == [1, 2, 3, 4], out[-3000:]
        for step in (3, 4):
            assert resumed[step] == pytest.approx(one[step], rel=1e-5), (name, step, one, resumed)
    assert not [o for o in outs if "tokenising " in o]


# ------------------------------------------------------------------------------- eval.py, export.py, sample.py
FIXTURE = ROOT / "tests" / "fixtures" / "run_v1"
# The pieces of gloo's connection report ("[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected
# peer ranks is : 3"), removed piece by piece: two reports written at once by two threads interleave mid-line.
_GLOO_REPORT = re.compile(r"\[Gloo\] Rank |\d+ is connected to |\d+ peer ranks\. Expected number of connected peer "
                          r"ranks is : \d+\n?")


def _readers(script: str, args: list[str]) -> list[str]:
    """``script`` run as 2 processes x 2 CPU devices; returns their stdouts (one per process)."""
    port = pytest.importorskip("portpicker").pick_unused_port()
    procs = []
    try:
        for pid in range(2):
            cluster = {distributed.ENV_COORDINATOR: f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: "2",
                       distributed.ENV_PROCESS_ID: str(pid)}
            procs.append(subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=ROOT,
                                          env=_env(2, cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
    finally:
        results = []
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=TIMEOUT_S)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
            assert p.returncode == 0, f"{script} exited with {p.returncode}:\n{stderr[-4000:]}"
            # gloo reports its connections on stdout from C++ (unbuffered, so a report may be split); the script's
            # lines are the rest.
            results.append(_GLOO_REPORT.sub("", stdout))
    return results


def test_readers_on_two_processes_equal_one_process(tmp_path):
    """eval.py, export.py and sample.py launched on 2 processes (gloo collectives, 2 CPU devices each) on an
    (fsdp=4) mesh that splits every weight across the processes, so that no process holds a whole one: each gives
    the answers that the fixture's writing code gave on 1 process (tests/fixtures/README.md): the evaluation to
    float32 summation order, the exported weights (names, dtypes, shapes and bytes) and the greedy samples
    exactly. Process 0 alone prints and writes, and prints what the 1-process commands print. (The same commands
    on 1 process x 4 devices are not run beside them: the fixture's answers are that reference, and
    tests/test_run.py runs the readers' CLIs on 1 process against the same answers.)"""
    import hashlib
    import json
    import math

    import numpy as np

    from coupled_qk_jax import export

    expected = json.loads((ROOT / "tests" / "fixtures" / "run_v1_expected.json").read_text())
    run = tmp_path / "run_v1"

    shutil.copytree(FIXTURE, run)
    mesh = "--mesh=fsdp:4"

    evals = tmp_path / "eval"
    out = _readers("eval.py", [f"--workdir={run}", mesh, f"--out={evals}"])
    assert out[1] == "", out  # process 1 prints nothing
    path = evals / f"eval_validation_step{expected['step']}.json"
    result = json.loads(path.read_text())
    assert result["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert (result["step"], result["tokens"]) == (expected["step"], expected["validation"]["tokens"])
    # Each host reads windows k mod 2 of the split, so a batch holds the 1-process run's windows in another row
    # order: its float32 NLL sum differs in the last bits (every window is scored once either way: the tokens).
    assert result["loss"] == pytest.approx(expected["validation"]["loss"], rel=1e-6)
    assert result["ppl"] == pytest.approx(expected["validation"]["ppl"], rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(result["loss"]), rel=1e-6)
    # What eval.py prints on one process (eval.print_result): the result's line, then where it was written.
    assert out[0] == (f"step {expected['step']} validation: loss {result['loss']:.4f}, ppl {result['ppl']:.3f} over "
                      f"{expected['validation']['tokens']} tokens\n-> {path}\n"), out
    assert f"loss {result['loss']:.4f}," in out[0] and f"loss {expected['validation']['loss']:.4f}," in out[0]

    exported = tmp_path / "export"
    out = _readers("export.py", [f"--workdir={run}", mesh, f"--out={exported}"])
    assert out[1] == "" and out[0] == f"exported {run} -> {exported}\n", out
    data = (exported / "model.safetensors").read_bytes()
    # The JSON header, then the tensors' bytes: every tensor the fixture's has, with its dtype and shape, packed
    # end to end in name order (safetensors' layout for tensors of one dtype), and the format's metadata.
    header_end = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:header_end])
    assert header.pop("__metadata__") == {"format": export.FORMAT, "format_version": str(export.FORMAT_VERSION)}
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == \
        {k: ({"float32": "F32"}[v["dtype"]], v["shape"]) for k, v in expected["export"].items()}
    offsets = [header[k]["data_offsets"] for k in sorted(header)]
    assert [b for b, _ in offsets] == [0] + [e for _, e in offsets[:-1]] and offsets[-1][1] == len(data) - header_end
    from safetensors.numpy import load_file

    tensors = load_file(str(exported / "model.safetensors"))
    assert {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in tensors.items()} == \
        {k: v["sha256"] for k, v in expected["export"].items()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "export", "run_v1"]

    greedy = expected["greedy"]
    ids = [",".join(map(str, p)) for p in greedy["prompts"]]
    out = _readers("sample.py", [f"--workdir={run}", mesh, *(f"--ids={i}" for i in ids), "--temperature=0",
                                 "--nostop_at_eot", f"--max_new_tokens={greedy['new_tokens']}"])
    assert out[1] == "", out
    from coupled_qk_jax.data.tokenizer import ByteTokenizer

    texts = [ByteTokenizer().decode(np.asarray(p + t)) for p, t in zip(greedy["prompts"], greedy["tokens"])]
    # What sample.py prints on one process: a header per sample, then the prompt and its greedy continuation.
    assert out[0] == "".join(f"--- sample 1 of prompt ids {i}: {greedy['new_tokens']} new tokens\n{text}\n"
                             for i, text in zip(ids, texts)), out[0]
