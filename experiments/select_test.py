"""Score an MQAR run's test split once per seed, at the checkpoint that validation selected.

    python -m experiments.select_test RUN_DIR [RUN_DIR ...] [--prune]

Selection never reads the test split: each seed's checkpoint is its best validation accuracy (zoology's
``valid/accuracy`` on the validation segment; the earliest on a tie) among the evaluations logged in metrics.jsonl up
to the step where that seed stopped (``training.early_stop.selected_steps``). Only then is the test segment scored,
once per selected checkpoint, and the result written to ``RUN_DIR/test_selected.json``; a run that already has it is
not scored again. The sweep (``experiments/sweep.py``) calls this for every finished MQAR cell and its tables report
these test numbers.

Every evaluated checkpoint is kept while a run trains (``configs/mqar.py``: ``checkpoint.keep_every =
train.eval_every``), so the selected one exists. ``--prune`` (the sweep's ``--prune-checkpoints``) then deletes every
checkpoint but the selected ones and the newest, which a GPU grid of large widths needs for its disk.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from coupled_qk_jax.errors import UserError
from coupled_qk_jax.training.early_stop import selected_steps

RESULT = "test_selected.json"
METRIC = "valid/accuracy"  # the validation split's accuracy: what selection reads


def select_test(workdir: str | os.PathLike[str], prune: bool = False) -> dict[str, Any]:
    """``RUN_DIR/test_selected.json`` (computed once): per seed, the selected step, its validation accuracy and the
    test split's metrics at that checkpoint.

    Returns:
      ``{"metric", "selected_step" [S], "validation" [S], "test": {name: [S]}, "seeds" [S]}``; ``test`` holds the
      evaluator's names (``valid/accuracy``, ``valid/num_kv_pairs/accuracy-N``, ``valid/loss``) scored on test.
    """
    from coupled_qk_jax.training import rundir  # noqa: PLC0415
    from coupled_qk_jax.training.run import Run  # noqa: PLC0415
    from coupled_qk_jax.training.writers import read_metrics  # noqa: PLC0415

    workdir = os.path.abspath(workdir)
    path = os.path.join(workdir, RESULT)
    if os.path.isfile(path):
        result = json.loads(Path(path).read_text())
    else:
        summary_path = os.path.join(workdir, "summary.json")
        summary = json.loads(Path(summary_path).read_text()) if os.path.isfile(summary_path) else {}
        if summary.get("status") != "completed" or summary.get("task") != "mqar":
            raise UserError(f"{workdir}: not a completed MQAR run (summary.json status {summary.get('status')!r}, "
                            f"task {summary.get('task')!r}); train it to the end first")
        seeds = list(summary["seeds"])
        stops = (summary.get("early_stop") or {}).get("seed_steps")
        picks = selected_steps(read_metrics(workdir), METRIC, "max", len(seeds), stops)
        run = Run.open(workdir, report=False)
        evaluator = run.task().make_evaluator(run.graphdef, run.layout.shardings["params"], run.mesh,
                                              run.num_replicas)
        test: dict[str, list[float]] = {}
        for step in sorted({p[0] for p in picks}):
            if step not in run.steps:
                raise UserError(f"{workdir}: the selected checkpoint step {step} was not kept (checkpoints: "
                                f"{run.steps}); keep every evaluated one "
                                f"(checkpoint.keep_every = train.eval_every, as configs/mqar.py sets)")
            # the test split's only evaluation at this step
            scores = evaluator(run.params(step, replica=None), split="test")
            for i, (picked, _) in enumerate(picks):
                if picked != step:
                    continue
                for name, value in scores.items():
                    if isinstance(value, np.ndarray):
                        test.setdefault(name, [float("nan")] * len(seeds))[i] = float(value.reshape(-1)[i])
        result = {"metric": METRIC, "seeds": seeds, "selected_step": [p[0] for p in picks],
                  "validation": [p[1] for p in picks], "test": test,
                  "test_examples": int(summary.get("num_test", 0))}
        rundir.write_json(path, result)
    if prune:
        prune_checkpoints(workdir, set(result["selected_step"]))
    return result


def prune_checkpoints(workdir: str, keep: set[int]) -> list[int]:
    """Delete every checkpoint of ``workdir`` but the steps in ``keep`` and the newest; the deleted steps."""
    from coupled_qk_jax.training.checkpoint import Checkpointer  # noqa: PLC0415

    ck = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        steps = ck.all_steps()
        gone = [s for s in steps if s not in keep and s != max(steps)]
        for step in gone:
            ck.manager.delete(step)
    finally:
        ck.close()
    return gone


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdirs", nargs="+")
    p.add_argument("--prune", action="store_true", help="delete the checkpoints that were not selected")
    args = p.parse_args(argv)
    from coupled_qk_jax.training import cli  # noqa: PLC0415

    def run() -> None:
        for d in args.workdirs:
            r = select_test(d, prune=args.prune)
            acc = r["test"][METRIC]
            print(f"{d}: selected steps {r['selected_step']}, validation "
                  f"{' '.join(f'{v:.4f}' for v in r['validation'])}, test {' '.join(f'{v:.4f}' for v in acc)}")

    code = cli.run_guarded(run)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
