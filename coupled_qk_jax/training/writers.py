"""Run outputs: metrics.jsonl and TensorBoard event files (tensorboardX). Only process 0 writes. (summary.json and
every other JSON file: rundir.write_json.)"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import jax

from coupled_qk_jax.errors import UserError


def _jsonable(value: Any) -> Any:
    """Python scalars for JSON; NaN/inf become strings so the file stays strict JSON."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All lines of WORKDIR/metrics.jsonl (an empty list if there is none).

    A torn last line (a process killed while appending it) is dropped with a one-line warning; a damaged line
    anywhere else is a UserError naming the file and line."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().split("\n")]
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


class MetricsWriter:
    """Appends one JSON line per logging step to WORKDIR/metrics.jsonl and mirrors scalars to TensorBoard.

    ``resume_step``: lines logged after this step by an earlier, killed process are dropped first (and TensorBoard
    purges its events after it), so after a resume the file reads as if the run had never been interrupted.
    To log more quantities, pass them to :meth:`write`: every key becomes a JSON field and a TensorBoard scalar.

    ``seeds``: the run's seeds. A seed-parallel run logs ``name`` (the mean over seeds) and ``name/seeds`` (the list,
    in seed order); TensorBoard gets the mean as ``name`` and each seed as ``name/seed_<seed>``.
    """

    def __init__(self, workdir: str, resume_step: int | None = None, tensorboard: bool = True,
                 seeds: list[int] | None = None) -> None:
        self.enabled = jax.process_index() == 0
        self.seeds = list(seeds or [])
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not self.enabled:
            return
        if resume_step is not None and os.path.exists(self.path):
            kept = [r for r in read_metrics(workdir) if r.get("step", 0) <= resume_step]
            with open(self.path + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.path + ".tmp", self.path)
        if tensorboard:
            from tensorboardX import SummaryWriter  # local: importing it is slow-ish and only process 0 needs it

            purge = {"purge_step": resume_step + 1} if resume_step is not None else {}
            self._tb = SummaryWriter(os.path.join(workdir, "tb"), **purge)

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{f"{prefix}{k}": _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
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

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
