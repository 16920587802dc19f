"""A run directory in Cloud Storage: train, resume, evaluate, sample and export with ``gs://`` paths, against a local
Cloud Storage emulator (gcp-storage-emulator, in memory, on 127.0.0.1) that each test starts and stops.

Every client is pointed at the emulator by its own setting: gcsfs (epath's gs:// backend) and google-cloud-storage
(tensorboardX's) by STORAGE_EMULATOR_HOST; tensorstore (orbax's checkpoint arrays) by TENSORSTORE_GCS_HTTP_URL, with
GOOGLE_AUTH_TOKEN_FOR_TESTING as its credentials.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gcsfs", reason="gs:// paths need gcsfs (pip install 'coupled-qk-jax[gcs]')")
emulator = pytest.importorskip("gcp_storage_emulator.server", reason="needs gcp-storage-emulator (requirements.txt)")

import portpicker  # noqa: E402

from coupled_qk_jax.errors import UserError  # noqa: E402
from coupled_qk_jax.export import load_exported  # noqa: E402
from coupled_qk_jax.training import loop, rundir  # noqa: E402
from coupled_qk_jax.training.writers import read_metrics  # noqa: E402
from test_training import tiny_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "bucket"


def _with_generation_headers(download):
    """An emulator's object GET (download or metadata), plus the x-goog-generation / x-goog-metageneration headers that Cloud Storage
    sends with every object it serves and that the emulator leaves out: tensorstore reads an object's generation
    from them (its conditional writes of the checkpoint's OCDBT manifest depend on it) and refuses a response
    without them ("Malformed StorageGeneration")."""
    def handler(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # noqa: BLE001 - a missing object: the 404 stands as it is
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])

    return handler


@pytest.fixture
def gcs(monkeypatch):
    """The emulator, serving one empty bucket; yields a gcsfs file system that reads it directly."""
    import gcsfs  # noqa: PLC0415

    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # it logs every 404 a probe gets
    for _, methods in emulator.HANDLERS:
        if methods.get("GET") in (emulator.objects.download, emulator.objects.get):
            monkeypatch.setitem(methods, "GET", _with_generation_headers(methods["GET"]))
    port = portpicker.pick_unused_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_VERSION", "1")  # the emulator speaks HTTP/1.1 only
    gcsfs.GCSFileSystem.clear_instance_cache()  # fsspec caches file systems with the endpoint they were made for
    try:
        yield gcsfs.GCSFileSystem()
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
        server.stop()


def _objects(fs, prefix: str) -> set[str]:
    """Every object name under gs://PREFIX, relative to it (read from the emulator, not through our code)."""
    fs.invalidate_cache()
    return {name[len(prefix) + 1:] for name in fs.find(prefix)}


class _Cli:
    """One of the repository's scripts in a subprocess (it inherits the emulator's settings), its output in files
    (several run at once, and a full pipe would stall one)."""

    def __init__(self, logs, script: str, *args: str) -> None:
        self.out, self.err = logs / f"{script}.out", logs / f"{script}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdout=out, stderr=err,
                                         env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})

    def wait(self) -> tuple[int, str, str]:
        """(exit status, stdout, stderr)."""
        code = self.proc.wait(timeout=300)
        return code, self.out.read_text(), self.err.read_text()


def test_gs_run_trains_resumes_evaluates_samples_and_exports(tmp_path, gcs, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path would appear here, as ./gs:/bucket/run
    workdir = f"gs://{BUCKET}/run"

    first = tiny_config(tmp_path, steps=4, stop_after=2)
    first.checkpoint.every = 2
    part = loop.train(first, workdir, progress=False)
    assert part["status"] == "stopped" and part["step"] == 2 and part["checkpoint_step"] == 2
    assert part["workdir"] == "run"
    stored = _objects(gcs, f"{BUCKET}/run")
    for name in ("config.json", "data.json", "history.jsonl", "lock", "metrics.jsonl", "summary.json",
                 "heldout/validation.bin", "heldout/test.bin", "checkpoints/2/meta/metadata"):
        assert name in stored, (name, sorted(stored))
    assert any(n.startswith("checkpoints/2/state/") for n in stored)  # the arrays, written by tensorstore
    assert any(n.startswith("tb/events.out.tfevents") for n in stored)
    assert not os.path.exists(tmp_path / "gs:")

    again = tiny_config(tmp_path, steps=4)
    again.checkpoint.every = 2
    done = loop.train(again, workdir, progress=False)
    assert done["status"] == "completed" and done["step"] == 4
    history = [json.loads(line) for line in gcs.cat(f"{BUCKET}/run/history.jsonl").decode().splitlines()]
    assert [(h["event"], h["step"]) for h in history] == [("start", 0), ("end", 2), ("resume", 2), ("end", 4)]
    assert [r["step"] for r in read_metrics(workdir) if "train_loss" in r] == [1, 2, 3, 4]
    assert json.loads(gcs.cat(f"{BUCKET}/run/summary.json"))["step"] == 4
    assert {n.split("/")[1] for n in _objects(gcs, f"{BUCKET}/run") if n.startswith("checkpoints/")} == {"2", "4"}

    # eval.py, sample.py and export.py on the gs:// run, as a user runs them (subprocesses inherit the emulator's
    # settings; all three at once, as they only read the run), then what they wrote, read straight from the bucket.
    procs = {script: _Cli(tmp_path, script, f"--workdir={workdir}", *args) for script, *args in (
        ("eval.py", "--split=test"),
        ("sample.py", "--ids=1,2,3", "--max_new_tokens=4", "--temperature=0"),
        ("export.py", f"--out=gs://{BUCKET}/exported"))}
    for script, proc in procs.items():
        code, stdout, stderr = proc.wait()
        assert code == 0, (script, stderr[-2000:])
        if script == "sample.py":
            assert "--- sample 1 of prompt ids 1,2,3: 4 new tokens" in stdout
    result = json.loads(gcs.cat(f"{BUCKET}/run/eval/eval_test_step4.json"))
    assert result["step"] == 4 and result["tokens"] > 0 and np.isfinite(result["loss"])

    assert _objects(gcs, f"{BUCKET}/exported") == {"model.safetensors", "config.json", "export.json"}
    model, tokenizer, manifest = load_exported(f"gs://{BUCKET}/exported")  # checks every file's SHA-256
    assert manifest["step"] == 4 and tokenizer.kind == "byte"
    assert model(np.array([[1, 2, 3]])).shape == (1, 3, manifest["config"]["model"]["vocab_size"])


def test_unwritable_paths_are_one_line_errors(tmp_path, gcs):
    cfg = tiny_config(tmp_path, steps=2)
    with pytest.raises(UserError, match=r"^cannot write to workdir gs://no-such-bucket/run: ") as e:
        loop.train(cfg, "gs://no-such-bucket/run", progress=False)
    assert "\n" not in str(e.value)
    assert not gcs.exists("no-such-bucket")  # a mistyped bucket is never created
    with pytest.raises(UserError, match=r"^cannot write gs://no-such-bucket/eval/eval_test_step1.json: .*--out="):
        rundir.write_eval_result("gs://no-such-bucket/eval", {"split": "test", "step": 1})

    # A local path that cannot be a directory (under a file: refused even to root, unlike a read-only one).
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match=rf"^cannot create workdir {tmp_path}/a_file/run: Not a directory$"):
        loop.train(cfg, str(tmp_path / "a_file" / "run"), progress=False)

    # train.py prints it as one line and exits 2.
    code, _, stderr = _Cli(tmp_path, "train.py", "--config=configs/lm.py:coupled_euler,tiny",
                           "--workdir=gs://no-such-bucket/run").wait()
    assert code == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: cannot write to workdir gs://no-such-bucket/run: ")
