"""What a researcher watches during training: model FLOPs and MFU, Δt per layer and head, parameter norms, the
learning rate, a profiler trace and the persistent compilation cache. (The CPU malloc settings are made at process
start-up: coupled_qk_jax/startup.py.)

The device-side numbers (:func:`step_observables`) are computed inside the jitted train step and returned with its
loss, so they cost no extra pass over the parameters and no extra host transfer beyond the logged values. MFU is host
arithmetic on the step time:

    model FLOPs per step = 6 · N · B · T  +  12 · L · T² · d_model · B       (:func:`model_flops_per_step`)
    MFU = model FLOPs per step · steps / seconds / (train.peak_tflops · 1e12 · devices)

with N the parameter count, B the global batch (sequences), T the sequence length and L the layers: 6·N per token is
the forward and backward matmuls of every weight (the tied embedding counted once, as the output head), the second
term the attention scores and their backward pass (QKᵀ and AV, full T² as is conventional, not the causal half). The
QK transforms' small per-head MLPs are inside 6·N only once per token, not once per head and integration step, so
MFU slightly undercounts the coupled variants' work. benchmarks/bench_attention.py uses the same formula.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from coupled_qk_jax.config import ModelConfig

# Where the persistent compilation cache goes unless JAX_COMPILATION_CACHE_DIR names another place.
DEFAULT_COMPILATION_CACHE = "~/.cache/coupled_qk_jax/xla"

def model_flops_per_step(n_params: int, cfg: ModelConfig, batch: int, seq: int) -> float:
    """Training FLOPs of one step on ``batch`` sequences of ``seq`` tokens (forward + backward; module docstring)."""
    return 6.0 * n_params * batch * seq + 12.0 * cfg.n_layers * seq * seq * cfg.d_model * batch


def dt_table(params: Any) -> jax.Array | None:
    """The learned Δt of every layer, [layers, heads] float32 (None for variants without one).

    Found by name: every parameter called ``dt`` (one per layer, in layer order), so it follows model.py's layout
    whether layers are a list (``blocks.<i>.attn.dt`` [H]) or stacked (``... .dt`` [L, H])."""
    leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if getattr(p[-1], "key", None) == "dt"]
    if not leaves:
        return None
    # keystr of list indices sorts lexicographically ("10" < "2"): order by the integer keys in the path instead.
    def layer_of(path: str) -> tuple[int, ...]:
        return tuple(int(t) for t in path.replace("[", " ").replace("]", " ").split() if t.isdigit())

    leaves.sort(key=lambda kv: layer_of(kv[0]))
    return jnp.concatenate([jnp.atleast_2d(x.astype(jnp.float32)) for _, x in leaves], axis=0)


def step_observables(params: Any, step: jax.Array, schedule: optax.Schedule) -> dict[str, jax.Array]:
    """Inside the jitted step, after the update: ``param_norm`` (global L2 norm), ``lr`` (the learning rate the update
    used, ``schedule(step)`` of the step before it), and ``dt`` [L, H] for dynamics variants."""
    out = {"param_norm": optax.tree.norm(params), "lr": jnp.asarray(schedule(step), jnp.float32)}
    dt = dt_table(params)
    if dt is not None:
        out["dt"] = dt
    return out


def dt_scalars(dt: np.ndarray) -> dict[str, np.ndarray]:
    """``dt`` [..., L, H] (a leading seed axis allowed) -> flat log entries, each [...]: per layer ``dt/layer<i>/
    mean|min|max`` and per head ``dt/layer<i>/head<h>``."""
    out: dict[str, np.ndarray] = {}
    for i in range(dt.shape[-2]):
        row = dt[..., i, :]
        out[f"dt/layer{i}/mean"] = row.mean(-1)
        out[f"dt/layer{i}/min"] = row.min(-1)
        out[f"dt/layer{i}/max"] = row.max(-1)
        for h in range(dt.shape[-1]):
            out[f"dt/layer{i}/head{h}"] = row[..., h]
    return out


def mfu(flops_per_step: float, steps: int, seconds: float, peak_tflops: float, devices: int) -> float | None:
    """Model FLOPs utilisation of ``steps`` steps in ``seconds`` (None without a peak, e.g. on CPU)."""
    if peak_tflops <= 0 or seconds <= 0:
        return None
    return flops_per_step * steps / seconds / (peak_tflops * 1e12 * devices)


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache (compiled programs reused across processes) unless it is off.

    The directory is ``JAX_COMPILATION_CACHE_DIR`` when set, else :data:`DEFAULT_COMPILATION_CACHE`;
    ``JAX_ENABLE_COMPILATION_CACHE=false`` turns it off. Only programs that took at least JAX's
    ``jax_persistent_cache_min_compile_time_secs`` (1 s by default) to compile are stored. Returns the directory in
    use, or None when off.
    """
    if not jax.config.jax_enable_compilation_cache:
        return None
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        directory = os.path.expanduser(DEFAULT_COMPILATION_CACHE)
        os.makedirs(directory, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", directory)
    return directory


class Profiler:
    """``train.profile_steps = N`` traces this process's steps 2..N+1 (the first compiles) with ``jax.profiler``
    into ``WORKDIR/profile`` (open with TensorBoard's profile plugin or Perfetto: ``*.trace.json.gz``)."""

    def __init__(self, workdir: str, steps: int) -> None:
        self.directory = os.path.join(workdir, "profile")
        self.steps, self.seen, self.active = int(steps), 0, False
        if self.steps < 0:
            raise ValueError(f"train.profile_steps must be >= 0, got {steps}")

    def before_step(self) -> None:
        if self.steps and self.seen == 1 and not self.active:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after_step(self, outputs: Any) -> None:
        self.seen += 1
        if self.active and self.seen == self.steps + 1:
            jax.block_until_ready(outputs)  # the trace must contain the device work, not only its dispatch
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
