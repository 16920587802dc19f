"""Run outputs: metrics.jsonl and TensorBoard event files (tensorboardX). Only process 0 writes. (summary.json and
every other JSON file: paths.write_json.) The per-seed form of metrics that metrics.jsonl, summary.json and a saved
run's evaluation share: :func:`per_seed`, :func:`summary_metrics`.

A gs:// workdir works as a local one: metrics.jsonl is rewritten whole at each log line (Cloud Storage objects
cannot be appended to; see paths.append_text), and the TensorBoard event file is uploaded whole at each of
tensorboardX's flushes (:class:`_ObjectEventFile`)."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from coupled_qk_jax import paths
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.reporting import mean_std


def _jsonable(value: Any) -> Any:
    """Python scalars for JSON; NaN/inf become strings so the file stays strict JSON."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def per_seed(metrics: dict[str, Any], num_seeds: int) -> dict[str, Any]:
    """Per-seed arrays [S] -> the metrics.jsonl / summary form: ``name`` = the mean over seeds (the value itself for
    a single run) and, with several seeds, ``name/seeds`` = the list in seed order. Other values pass through."""
    arrays = {k: v.reshape(-1) for k, v in metrics.items() if isinstance(v, np.ndarray)}
    # One reduction over a [K, S] table instead of K calls of np.mean: a 350m log line has ~460 per-seed values
    # (a Δt per layer and head), and K small reductions took ~10 ms of host time while the devices waited.
    means: dict[str, float] = {}
    for size in {v.size for v in arrays.values()}:
        names = [k for k, v in arrays.items() if v.size == size]
        table = np.stack([arrays[k] for k in names])
        means.update(zip(names, table.mean(axis=1).tolist()))
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if k in arrays:
            out[k] = means[k]
            if num_seeds > 1:
                out[f"{k}/seeds"] = arrays[k].tolist()
        else:
            out[k] = v
    return out


def summary_metrics(metrics: dict[str, Any], num_seeds: int) -> dict[str, Any]:
    """summary.json's form of per-seed metrics: ``name`` = the mean over seeds and, with several seeds,
    ``name/seeds`` (the list) and ``name/std`` (sample standard deviation, ddof 1)."""
    out = per_seed(metrics, num_seeds)
    for k, v in metrics.items():
        if isinstance(v, np.ndarray) and num_seeds > 1:
            out[f"{k}/std"] = mean_std(v)[1]
    return out


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All lines of WORKDIR/metrics.jsonl (an empty list if there is none).

    A torn last line (a process killed while appending it) is dropped with a one-line warning; a damaged line
    anywhere else is a UserError naming the file and line."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not paths.exists(path):
        return []
    with paths.epath_of(path).open("rb") as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    rows: list[dict[str, Any]] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == last:
                if jax.process_index() == 0:
                    print(f"warning: dropped the torn last line of {path} (a process was killed while writing it)",
                          file=sys.stderr, flush=True)
                continue
            raise UserError(f"{path} line {i + 1} is not valid JSON; fix or remove that line") from None
    return rows


class _ObjectEventFile:
    """A tensorboardX record writer for a URL: the event file grows in memory and is uploaded whole (epath, so the
    one Cloud Storage client of every run output) at each flush, which tensorboardX does every ``flush_secs`` and at
    close. tensorboardX's own gs:// writer does the same through google-cloud-storage, but uploads once more when
    garbage-collected after its close, and so can block a process that is exiting on a retry loop."""

    def __init__(self, path: str) -> None:
        self.path, self.buffer, self.uploaded = path, io.BytesIO(), 0

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        if self.buffer.tell() != self.uploaded:
            paths.write_bytes(self.path, self.buffer.getvalue())
            self.uploaded = self.buffer.tell()

    def close(self) -> None:
        self.flush()


class _ObjectEventFiles:
    """tensorboardX's factory interface (record_writer.register_writer_factory) for :class:`_ObjectEventFile`."""

    def open(self, path: str) -> _ObjectEventFile:
        return _ObjectEventFile(path)

    def directory_check(self, path: str) -> None:
        pass  # no directories in Cloud Storage


class MetricsWriter:
    """Appends one JSON line per logging step to WORKDIR/metrics.jsonl and mirrors scalars to TensorBoard.

    ``resume_step``: lines logged after this step by an earlier, killed process are dropped first (and TensorBoard
    purges its events after it), so after a resume the file reads as if the run had never been interrupted.
    To log more quantities, pass them to :meth:`write`: every key becomes a JSON field and a TensorBoard scalar.

    ``seeds``: the run's seeds. A seed-parallel run logs ``name`` (the mean over seeds) and ``name/seeds`` (the list,
    in seed order); TensorBoard gets the mean as ``name`` and each seed as ``name/seed_<seed>``.
    """

    UPLOAD_SECONDS = 30.0

    def __init__(self, workdir: str, resume_step: int | None = None, tensorboard: bool = True,
                 seeds: list[int] | None = None) -> None:
        self.enabled = jax.process_index() == 0
        self.seeds = list(seeds or [])
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        # In Cloud Storage, where an object cannot be appended to, the file's text is kept here and uploaded whole
        # at most every UPLOAD_SECONDS and at every flush (the loop flushes before each checkpoint, so the lines up
        # to a checkpoint are durable with it): one upload per log line would hold every device for a round trip.
        self._remote: list[str] | None = None
        self._uploaded_at = time.monotonic()
        self._dirty = False
        if not self.enabled:
            return
        if paths.is_remote(self.path):
            kept = [r for r in read_metrics(workdir) if resume_step is None or r.get("step", 0) <= resume_step]
            self._remote = [json.dumps(r) + "\n" for r in kept]
            self._dirty = resume_step is not None
        elif resume_step is not None and paths.exists(self.path):
            kept = [r for r in read_metrics(workdir) if r.get("step", 0) <= resume_step]
            self._rewrite("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            from tensorboardX import SummaryWriter  # local: importing it is slow-ish and only process 0 needs it

            purge = {"purge_step": resume_step + 1} if resume_step is not None else {}
            if paths.is_remote(workdir):  # tensorboardX picks the writer by the path's protocol, process-wide
                from tensorboardX import record_writer  # noqa: PLC0415

                record_writer.register_writer_factory(workdir.split("://", 1)[0], _ObjectEventFiles())
            self._tb = SummaryWriter(os.path.join(workdir, "tb"), **purge)

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{f"{prefix}{k}": _jsonable(v) for k, v in metrics.items()}}
        text = json.dumps(row) + "\n"
        if self._remote is not None:
            self._remote.append(text)
            self._dirty = True
            if time.monotonic() - self._uploaded_at >= self.UPLOAD_SECONDS:
                self._upload()
        else:
            try:
                paths.append_text(self.path, text)
            except paths.io_errors(self.path) as e:
                raise UserError(f"cannot write {self.path}: {paths.cause(e)}") from None
        if self._tb is not None:
            scalars = []
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    scalars.append((k, v))
                elif k.endswith("/seeds") and isinstance(v, list):
                    scalars += [(f"{k[:-len('/seeds')]}/seed_{seed}", x) for seed, x in zip(self.seeds, v)
                                if isinstance(x, (int, float))]
            # One event holding every scalar of the line: add_scalar per key costs an event and an inter-process
            # queue put each, ~10 us apiece, which at 350m (a Δt per layer and head: 460 keys) held every device
            # idle for milliseconds per log line.
            from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415 - with the writer's own import

            event = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars])
            self._tb._get_file_writer().add_summary(event, step)

    def _upload(self) -> None:
        if self._remote is None or not self._dirty:
            return
        try:
            paths.write_text(self.path, "".join(self._remote))
        except paths.io_errors(self.path) as e:
            raise UserError(f"cannot write {self.path}: {paths.cause(e)}") from None
        self._uploaded_at, self._dirty = time.monotonic(), False

    def flush(self) -> None:
        """Make every line written so far durable (locally they already are: each is appended as it comes)."""
        self._upload()
        if self._tb is not None:
            self._tb.flush()

    def _rewrite(self, text: str) -> None:
        if paths.is_remote(self.path):  # an object is replaced whole when its upload completes
            paths.write_text(self.path, text)
            return
        with open(self.path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(self.path + ".tmp", self.path)

    def close(self) -> None:
        self._upload()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
