"""Stop a run at the end of learning: a plateau (patience) or a target (threshold) on a validation metric.

Configured by ``train.early_stop`` (training/config.py's EarlyStopConfig, which checks the settings), with Lightning's EarlyStopping semantics:

    metric     the periodic evaluation's metric to watch ("" = off): e.g. "valid/accuracy" (MQAR) or "val_loss" (LM)
    mode       "max" (accuracy) or "min" (loss, perplexity)
    patience   stop after this many evaluations in a row without an improvement of more than min_delta (0 = off)
    min_delta  the smallest change that counts as an improvement
    threshold  stop as soon as the metric reaches this value (None = off)

A seed-parallel run (``train.num_seeds`` > 1) trains its seeds as one program, so it cannot stop one seed alone: each
seed is judged on its own trajectory and the run stops when every seed has met a rule. The decision is a function of
the logged evaluations only, so a resumed run replays metrics.jsonl and stops at the step an uninterrupted run
would have. The learning-rate schedule still spans ``train.steps``: a stopped run is the prefix of the full run.

:func:`selected_steps` picks each seed's checkpoint from the same logged evaluations: the best value of the watched
metric up to that seed's stop (MQAR scores its test split there, once: experiments/select_test.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import numpy as np

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training.config import EarlyStopConfig


@dataclasses.dataclass
class EarlyStop:
    """Per-seed early-stopping state. ``best``/``waited``/``reason`` are [S] (S = the run's seeds)."""

    metric: str
    mode: str
    patience: int
    min_delta: float
    threshold: float | None
    best: np.ndarray
    waited: np.ndarray
    reason: list[str]
    stopped_step: int | None = None
    seed_steps: list[int | None] = dataclasses.field(default_factory=list)  # the step at which each seed stopped

    @classmethod
    def from_config(cls, rule: EarlyStopConfig, num_seeds: int, metric_names: Iterable[str]) -> "EarlyStop | None":
        """None when the rule is off (no metric); a UserError when its metric is not one of this task's."""
        if not rule.metric:
            return None
        names = sorted(metric_names)
        if rule.metric not in names:
            raise UserError(f"train.early_stop.metric={rule.metric!r} is not a metric of this task's evaluation; "
                            f"use one of {', '.join(names)}")
        start = -math.inf if rule.mode == "max" else math.inf
        return cls(rule.metric, rule.mode, rule.patience, rule.min_delta, rule.threshold,
                   np.full(num_seeds, start), np.zeros(num_seeds, np.int64), [""] * num_seeds,
                   seed_steps=[None] * num_seeds)

    @property
    def done(self) -> bool:
        return all(self.reason)

    def update(self, step: int, values: Any) -> bool:
        """Take one evaluation's per-seed values [S]; True once every seed has met a rule (the run stops)."""
        values = np.asarray(values, np.float64).reshape(self.best.shape)
        sign = 1.0 if self.mode == "max" else -1.0
        for i, v in enumerate(values):
            if self.reason[i]:
                continue  # this seed is judged; the others keep training
            if not math.isfinite(v):
                continue  # the loop's non-finite check owns that case
            if sign * (v - self.best[i]) > self.min_delta:
                self.best[i], self.waited[i] = v, 0
            else:
                self.waited[i] += 1
            if self.threshold is not None and sign * (v - self.threshold) >= 0:
                self.reason[i] = f"reached {self.metric} {v:.6g} (threshold {self.threshold:g}) at step {step}"
            elif self.patience and self.waited[i] >= self.patience:
                self.reason[i] = (f"plateau: {self.metric} no better than {self.best[i]:.6g} by more than "
                                  f"{self.min_delta:g} for {self.patience} evaluations, at step {step}")
            if self.reason[i]:
                self.seed_steps[i] = step
        if self.done and self.stopped_step is None:
            self.stopped_step = step
        return self.done

    def replay(self, rows: Iterable[dict[str, Any]], up_to_step: int) -> bool:
        """Feed the logged periodic evaluations (metrics.jsonl rows) up to ``up_to_step``; True if already done.
        A second row at the same step (the final whole-split evaluation of a run that stopped there) is skipped."""
        seen = set()
        for r in rows:
            step = int(r.get("step", 0))
            if self.metric in r and step <= up_to_step and step not in seen and not self.done:
                seen.add(step)
                self.update(step, r.get(f"{self.metric}/seeds", r[self.metric]))
        return self.done

    def summary(self) -> dict[str, Any]:
        """summary.json's ``early_stop`` entry."""
        return {"metric": self.metric, "mode": self.mode, "stopped_step": self.stopped_step,
                "seeds": list(self.reason) if self.done else [r or "still learning" for r in self.reason],
                "seed_steps": list(self.seed_steps)}


def selected_steps(rows: Iterable[dict[str, Any]], metric: str, mode: str, num_seeds: int,
                   stop_steps: list[int | None] | None = None) -> list[tuple[int, float]]:
    """Each seed's selected checkpoint: the logged evaluation with the best ``metric`` (the earliest on a tie), among
    those at or before the step where that seed stopped (``stop_steps[i]``, None = every evaluation). A seed of a
    seed-parallel run trains on after it stops, until every seed has; what a single run of that seed would have
    selected is therefore judged on its own evaluations up to its stop.

    Args:
      rows: metrics.jsonl rows; those holding ``metric`` (a value, or ``metric/seeds`` [S]) are the evaluations. A
        second row at the same step (the final whole-split evaluation) is the same checkpoint and is skipped.
      metric, mode: what is selected on and whether higher ("max") or lower ("min") is better.
      num_seeds: S.
      stop_steps: [S] per-seed stop steps (summary.json's ``early_stop.seed_steps``), or None.

    Returns:
      ``[(step, value)] * S``, seed order.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    sign = 1.0 if mode == "max" else -1.0
    stop_steps = stop_steps or [None] * num_seeds
    best: list[tuple[int, float] | None] = [None] * num_seeds
    seen = set()
    for r in rows:
        step = int(r.get("step", 0))
        if metric not in r or step in seen:
            continue
        seen.add(step)
        values = np.asarray(r.get(f"{metric}/seeds", r[metric]), np.float64).reshape(-1)
        if values.size != num_seeds:
            raise ValueError(f"{metric} at step {step} has {values.size} values, expected {num_seeds}")
        for i, v in enumerate(values):
            if stop_steps[i] is not None and step > stop_steps[i]:
                continue
            if math.isfinite(v) and (best[i] is None or sign * (v - best[i][1]) > 0):
                best[i] = (step, float(v))
    if any(b is None for b in best):
        raise ValueError(f"no finite evaluation of {metric} for seed(s) {[i for i, b in enumerate(best) if b is None]}")
    return best  # type: ignore[return-value]
