"""Seeds as an axis of the training loop (`train.num_seeds`): with dropout on, replica i of a seed-parallel run is
the single run with seed i (checked for i = 1 of seeds {0, 1}), also with scanned layers (`runtime.scan_layers`);
a seed-parallel run killed with SIGKILL and resumed is bitwise the uninterrupted run.

The independent reference of the first test is the ordinary single-seed loop (no seed axis, no vmap). Tolerance:
the two programs are the same maths but not the same XLA program (vmap turns each matmul into a batched one, which
XLA may tile and reduce in a different order), so they agree to float32 rounding, amplified a little by a few AdamW
steps: rtol 1e-5 on the losses, atol 1e-6 on the params (lr 3e-3 x a few steps moves a weight by ~1e-2, so a
mis-keyed dropout mask or a mixed-up data stream shows up five orders of magnitude above this).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from test_training import leaves_with_names, tiny_config

from coupled_qk_jax.model import to_unscanned
from coupled_qk_jax.training import loop
from coupled_qk_jax.training.writers import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6


def _cfg(root, checkpoint_every: int = 3, **train):
    cfg = tiny_config(root, steps=STEPS, **train)
    cfg.model.dropout = 0.1  # the per-seed dropout keys must follow the single run's derivation
    # Every step only where a kill must find checkpoints mid-run: each save costs CPU and none enters the maths.
    cfg.checkpoint.every = checkpoint_every
    return cfg


def _losses(workdir) -> np.ndarray:
    """[steps, S] training losses from metrics.jsonl (one column for a single run)."""
    rows = [r for r in read_metrics(str(workdir)) if "train_loss" in r]
    return np.array([r.get("train_loss/seeds", [r["train_loss"]]) for r in rows])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    par = loop.train(_cfg(root, num_seeds=2), str(root / "par"), progress=False, return_state=True)
    # The single run of seed 1 (replica 1 is the case a wrong seed offset or a shared key would break).
    single = loop.train(_cfg(root, seed=1), str(root / "seed1"), progress=False, return_state=True)
    return root, par, single


def test_replica_i_is_the_single_run_with_seed_i(runs):
    root, (par_summary, par_state), (summary, state) = runs
    assert par_summary["seeds"] == [0, 1] and par_summary["step"] == STEPS
    par_losses = _losses(root / "par")
    assert par_losses.shape == (STEPS, 2)
    par_leaves = leaves_with_names(par_state)
    np.testing.assert_allclose(par_losses[:, 1], _losses(root / "seed1")[:, 0], rtol=1e-5)
    np.testing.assert_allclose(par_summary["val_loss/seeds"][1], summary["val_loss"], rtol=1e-5)
    single_leaves = leaves_with_names(state)
    assert single_leaves.keys() == par_leaves.keys()
    for name, value in single_leaves.items():
        np.testing.assert_allclose(par_leaves[name][1], value, rtol=0, atol=1e-6, err_msg=name)
    # The seeds are different runs (not one state broadcast twice), and the summary's statistics are theirs.
    assert not np.allclose(par_losses[:, 0], par_losses[:, 1])
    weights = [k for k in par_leaves if k.startswith("['params']") and par_leaves[k].ndim > 2]  # [S, ...]
    assert any(not np.allclose(par_leaves[k][0], par_leaves[k][1]) for k in weights)
    vals = np.array(par_summary["val_loss/seeds"])
    assert par_summary["val_loss"] == pytest.approx(vals.mean())
    assert par_summary["val_loss/std"] == pytest.approx(vals.std(ddof=1))


@pytest.mark.mesh
def test_replica_i_is_the_single_run_with_seed_i_on_a_mesh(tmp_path):
    """The seed axis on a (data=2, fsdp=2, tensor=2) mesh: each seed's batch and params are split over the mesh
    exactly as a single run's, so replica 1 is the single run with seed 1 on the same mesh (the mesh subprocess's 8
    CPU devices). One layer: the layers' params are alike and split alike, so one shows every kind of leaf (and
    compiles in about two thirds of the time). Tolerance as above."""
    steps = 3
    par_cfg = tiny_config(tmp_path, steps=steps, num_seeds=2)
    single_cfg = tiny_config(tmp_path, steps=steps, seed=1)
    for cfg in (par_cfg, single_cfg):
        cfg.mesh.update(data=2, fsdp=2, tensor=2)
        cfg.model.n_layers = 1
        cfg.model.vocab_size = 258  # the byte tokenizer's 257 + one padding id, so tensor=2 splits the vocabulary
    par_summary, par_state = loop.train(par_cfg, str(tmp_path / "par"), progress=False, return_state=True)
    summary, state = loop.train(single_cfg, str(tmp_path / "seed1"), progress=False, return_state=True)
    assert par_summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} == summary["mesh"]
    np.testing.assert_allclose(_losses(tmp_path / "par")[:, 1], _losses(tmp_path / "seed1")[:, 0], rtol=1e-5)
    par_leaves, single = leaves_with_names(par_state), leaves_with_names(state)
    assert single.keys() == par_leaves.keys()
    for name, value in single.items():
        np.testing.assert_allclose(par_leaves[name][1], value, rtol=0, atol=1e-6, err_msg=name)
    assert not np.allclose(_losses(tmp_path / "par")[:, 0], _losses(tmp_path / "par")[:, 1])


def test_seed_parallel_with_scanned_layers(runs):
    """train.num_seeds=2 with runtime.scan_layers=True (the default from 60m up): jax.vmap over the seed axis of the
    lax.scan over stacked layers, each layer under jax.checkpoint, dropout on. Replica 1 is the single run with seed
    1; the reference is the module's *unscanned* single run, so the check also crosses the layer layouts (the
    scanned state is converted back with model.to_unscanned). Tolerance as above: the layouts agree to float32
    rounding (tests/test_scan.py), which a few AdamW steps leave far below a wrong key or data stream."""
    root, _, (summary, state) = runs
    cfg = _cfg(root, num_seeds=2)
    cfg.runtime.scan_layers = True
    par_summary, par_state = loop.train(cfg, str(root / "par_scan"), progress=False, return_state=True)
    assert par_summary["seeds"] == [0, 1] and par_summary["step"] == STEPS
    losses = _losses(root / "par_scan")
    np.testing.assert_allclose(losses[:, 1], _losses(root / "seed1")[:, 0], rtol=1e-5)
    np.testing.assert_allclose(par_summary["val_loss/seeds"][1], summary["val_loss"], rtol=1e-5)
    assert not np.allclose(losses[:, 0], losses[:, 1])
    replica = leaves_with_names(to_unscanned(jax.tree.map(lambda a: np.asarray(a)[1], par_state)))
    single = leaves_with_names(state)
    assert replica.keys() == single.keys()
    for name, value in single.items():
        np.testing.assert_allclose(replica[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_sigkill_mid_run_then_resume_is_bitwise(runs):
    """A seed-parallel run SIGKILLed between steps (checkpoints every step, async) and resumed in a new process
    reproduces the uninterrupted run's losses and final state exactly (the module's run, which checkpoints every
    third step: where the checkpoints fall must not change the maths either)."""
    root, (_, par_state), _ = runs
    workdir = root / "killed"
    # Each step waits 0.3 s for its batch (the maths is untouched), so the kill lands mid-run on any machine.
    script = (
        "import sys, time, pathlib\n"
        f"sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]\n"
        "from coupled_qk_jax.training import loop\n"
        "from test_seed_parallel import _cfg\n"
        "batch = loop.next_batch\n"
        "loop.next_batch = lambda *a: (time.sleep(0.3), batch(*a))[1]\n"
        f"loop.train(_cfg(pathlib.Path({str(root)!r}), 1, num_seeds=2), {str(workdir)!r}, progress=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and len(_losses(workdir) if (workdir / "metrics.jsonl").exists() else []) < 3:
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (workdir / "summary.json").exists(), "the run finished before the kill"
    done = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    assert done and 0 < done[-1] < STEPS, done

    summary, state = loop.train(_cfg(root, 1, num_seeds=2), str(workdir), progress=False, return_state=True)
    assert summary["status"] == "completed" and summary["step"] == STEPS
    np.testing.assert_array_equal(_losses(workdir), _losses(root / "par"))  # exact float equality
    a, b = leaves_with_names(par_state), leaves_with_names(state)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_resume_with_other_seeds_is_refused(runs):
    root, _, _ = runs
    with pytest.raises(ValueError, match="other settings: train.num_seeds: run 2, now 3"):
        loop.train(_cfg(root, num_seeds=3), str(root / "par"), progress=False)
