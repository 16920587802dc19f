"""The training loop's bookkeeping, one small piece per job, each owning its own state (training/loop.py drives them):

    Cadence          which steps log, evaluate and wait for the device (a pure function of the step)
    LossWindow       the per-seed training losses since the last log line; it travels with the checkpoint
    SavePolicy       when to save: every N steps, at the end, on a stop request, every_seconds of wall clock
    ThroughputMeter  training time and tokens/s, compilation and evaluations taken out
    first_nonfinite  the first step whose loss or gradient norm is NaN/inf

None of them touches the device, the train state or another piece.

The device is waited for only at sync steps (``Cadence.sync``): the first step, log and evaluation steps, saves,
and every ``log_every`` steps (100 without logging), so a step's dispatch overlaps the previous step's compute.
The wall-clock save rule is read only at the clock steps (every ``log_every`` steps, which sync anyway); with
several processes process 0's reading is broadcast to the others (their collective save must start at the same
step), which is one collective per log interval instead of one per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

# Without log lines (train.log_every = 0) the loop still waits for the device, reads the save clock and checks
# the losses every this many steps.
SYNC_EVERY_WITHOUT_LOGS = 100


@dataclasses.dataclass(frozen=True)
class Cadence:
    """Which steps do what. ``steps`` is train.steps (the schedule's end, always logged)."""

    steps: int
    log_every: int
    eval_every: int

    @property
    def clock_every(self) -> int:
        """The sync cadence: every log line, or every SYNC_EVERY_WITHOUT_LOGS steps without logging."""
        return self.log_every or SYNC_EVERY_WITHOUT_LOGS

    def log(self, step: int) -> bool:
        return bool(self.log_every) and (step % self.log_every == 0 or step == self.steps)

    def eval(self, step: int) -> bool:
        """A periodic evaluation; the last step's is the final whole-split one, done after the loop."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.steps

    def clock(self, step: int) -> bool:
        return step % self.clock_every == 0


@dataclasses.dataclass
class LossWindow:
    """The per-seed training losses since the last log line: their float64 sum [S] and the number of steps."""

    loss_sum: np.ndarray
    steps: int = 0

    @classmethod
    def empty(cls, num_seeds: int) -> "LossWindow":
        return cls(np.zeros(num_seeds), 0)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], num_seeds: int) -> "LossWindow":
        """The window saved with a checkpoint (:meth:`meta`), so that a resumed run logs the losses of an
        uninterrupted one; empty for a fresh start."""
        saved = meta.get("train_window", {})
        loss_sum = np.asarray(saved.get("loss_sum", np.zeros(num_seeds)), np.float64).reshape(num_seeds)
        return cls(loss_sum, int(saved.get("steps", 0)))

    def add(self, loss: np.ndarray) -> None:
        """One step's per-seed losses [S]."""
        self.loss_sum += np.asarray(loss, np.float64).reshape(self.loss_sum.shape)
        self.steps += 1

    def mean(self) -> np.ndarray:
        """[S] mean loss of the window (NaN for an empty one)."""
        return self.loss_sum / self.steps if self.steps else np.full(self.loss_sum.shape, np.nan)

    def meta(self) -> dict[str, Any]:
        """The checkpoint's ``train_window`` entry."""
        return {"loss_sum": [float(x) for x in self.loss_sum], "steps": self.steps}


def first_nonfinite(metrics: list[dict[str, Any]]) -> int | None:
    """The index of the first of ``metrics`` (host copies of consecutive steps' metrics, each with per-seed
    ``loss`` and ``grad_norm``) whose loss or gradient norm is not finite for some seed; None if all are."""
    for i, m in enumerate(metrics):
        if not (np.all(np.isfinite(np.asarray(m["loss"], np.float64)))
                and np.all(np.isfinite(np.asarray(m["grad_norm"], np.float64)))):
            return i
    return None


def agree_across_processes(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (one broadcast when there are several; ``flag`` itself with one)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


class SavePolicy:
    """When to save a checkpoint: every ``every`` steps, at ``stop_at`` (the end of this start), when a stop was
    requested (signal / preemption), and when ``every_seconds`` (0 = off) passed since the last save (or the
    start). The clock is read only at the cadence's clock steps, through ``agree`` (:func:`agree_across_processes`):
    processes whose clocks differ still save at the same step."""

    def __init__(self, every: int, every_seconds: float, stop_at: int, cadence: Cadence, now: float,
                 agree: Callable[[bool], bool]) -> None:
        self.every, self.every_seconds, self.stop_at, self.cadence = every, every_seconds, stop_at, cadence
        self.agree = agree
        self.saved_at = now  # time.monotonic() of the last save

    def due(self, step: int, stop_requested: bool, now: float) -> bool:
        """Save after ``step``? ``now`` is time.monotonic(); every process calls this at the same steps."""
        if step % self.every == 0 or step == self.stop_at or stop_requested:
            return True
        if not self.every_seconds or not self.cadence.clock(step):
            return False
        return self.agree(now - self.saved_at >= self.every_seconds)

    def saved(self, now: float) -> None:
        """A save (of any cause) finished at ``now``: the wall-clock rule counts from here."""
        self.saved_at = now


class ThroughputMeter:
    """This process's training time, from the end of its first step (compilation plus one step, reported apart
    as ``first_step_seconds``), with evaluations taken out; and each log window's seconds.
    ``seconds_before``: the training time of earlier starts of the run (its last logged ``train_seconds``)."""

    def __init__(self, seconds_before: float, now: float) -> None:
        self.seconds_before = seconds_before
        self.started = self.window_start = now
        self.first_done: float | None = None  # when the first step of this start had finished
        self.first_step_seconds: float | None = None
        self.steps_timed = 0  # steps after the first
        self.eval_seconds = 0.0

    def step_done(self, now: float) -> None:
        """A step finished and was synced (the first one always is)."""
        if self.first_done is None:
            self.first_done, self.first_step_seconds = now, now - self.started
        else:
            self.steps_timed += 1

    def evaluated(self, seconds: float) -> None:
        """An evaluation took ``seconds``: not training time, and not part of the open window."""
        self.eval_seconds += seconds
        self.window_start += seconds

    def window_seconds(self, now: float) -> float:
        return max(now - self.window_start, 1e-9)

    def new_window(self, now: float) -> None:
        self.window_start = now

    def train_seconds(self, now: float) -> float:
        """Training time of this start so far (0 before the first step finished)."""
        return (now - self.first_done - self.eval_seconds) if self.first_done is not None else 0.0

    def total_seconds(self, now: float) -> float:
        """Training time of the whole run: earlier starts plus this one."""
        return self.seconds_before + self.train_seconds(now)

    def tokens_per_second(self, tokens_per_step: float, now: float) -> float | None:
        """Throughput of this start's steps after the first; None when there were none."""
        seconds = self.train_seconds(now)
        return self.steps_timed * tokens_per_step / seconds if self.steps_timed and seconds > 0 else None
