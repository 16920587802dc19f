"""Seed-parallel training: S seeds of one model configuration trained as one compiled program.

Every seed owns a full train state (params from ``TransformerLM(cfg, seed=s)``, its AdamW state, its step counter)
and its own data stream; the S states are stacked on a leading seed axis and ``jax.vmap`` maps the ordinary
single-seed ``steps.make_train_step`` over that axis. On a small model this turns S tiny kernels into S-times
larger ones, which is what makes several seeds per variant affordable on a CPU (and keeps an accelerator busy).

Because the vmapped step is the same pure function applied per seed, a seed-parallel run equals S separate runs with
the same seeds up to float reassociation (``tests/test_seeds.py`` checks this).

Two trainers share the machinery:

* :func:`train_lm_seeds` — language modelling on a token stream (``data.pipeline``): per-seed shuffled windows,
  periodic and final evaluation over the *whole* validation split, tokens-to-target-perplexity, wall-clock.
* :func:`train_mqar_seeds` — MQAR (``data.mqar``): zoology's fixed batch order for every seed (the seed changes the
  initialisation only, as in zoology), accuracy by ``mqar.MQARAccuracy``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.model import TransformerLM, count_params
from coupled_qk_jax.training.optimizer import make_optimizer
from coupled_qk_jax.training.steps import init_train_state, make_eval_step, make_train_step, split_model

Batch = Mapping[str, np.ndarray]


def stack_trees(trees: Sequence[Any]) -> Any:
    """Stack a list of identically structured pytrees on a new leading axis (the seed axis)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack_tree(tree: Any, index: int) -> Any:
    """Select seed ``index`` from a stacked pytree."""
    return jax.tree.map(lambda x: x[index], tree)


class SeedParallel:
    """S train states of one configuration, stacked, with vmapped/jitted train and eval steps.

    Args:
      model_cfg: the model (identical for every seed).
      train_cfg: a ``configs/lm.py``-style ``train`` block (lr, steps, warmup_steps, ... see ``make_optimizer``).
      seeds: one model seed per replica; ``TransformerLM(model_cfg, seed=s)`` gives its initial params.
    """

    def __init__(self, model_cfg: ModelConfig, train_cfg: Mapping[str, Any], seeds: Sequence[int]):
        if not seeds:
            raise ValueError("seeds must be a non-empty list")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct, got {list(seeds)}")
        self.model_cfg = model_cfg
        self.seeds = [int(s) for s in seeds]
        params = []
        graphdef = None
        for s in self.seeds:
            model = TransformerLM(model_cfg, seed=s)
            if graphdef is None:
                self.num_params = count_params(model)
            graphdef, p = split_model(model)
            params.append(p)
        self.graphdef = graphdef
        # The optimiser depends on the params only through their tree structure (decay mask, lr groups), which is
        # the same for every seed, so one transformation serves the whole stack.
        self.tx = make_optimizer(params[0], train_cfg)
        self.state = stack_trees([init_train_state(p, self.tx) for p in params])
        self._base_keys = jnp.stack([jax.random.key(s) for s in self.seeds])
        single_step = make_train_step(graphdef, self.tx, int(train_cfg.get("grad_accum", 1)))
        # donate the stacked state: the update is in place, so S states cost S (not 2S) copies of memory.
        self._train_step = jax.jit(jax.vmap(single_step), donate_argnums=0)
        # eval: one batch shared by every seed (in_axes None), per-seed params.
        self._eval_step = jax.jit(jax.vmap(make_eval_step(graphdef), in_axes=(0, None)))
        self._logits = jax.jit(jax.vmap(self._forward, in_axes=(0, None)))

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def _forward(self, params: Any, inputs: jax.Array) -> jax.Array:
        return nnx.merge(self.graphdef, params)(inputs)

    def step_keys(self, step: int) -> jax.Array:
        """Per-seed keys for one step (only used by dropout): fold the step into each seed's key."""
        return jax.vmap(lambda k: jax.random.fold_in(k, step))(self._base_keys)

    def train_step(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One optimiser step for every seed. ``batch`` leaves are ``[S, B, T]``. Returns per-seed metrics [S]."""
        step = int(self.state["step"][0])
        self.state, metrics = self._train_step(self.state, dict(batch), self.step_keys(step))
        return metrics

    def eval_sums(self, batches: Iterable[Mapping[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """Summed NLL and token count per seed ([S] float64, [S] int) over batches of ``inputs``/``targets``."""
        nll = np.zeros(self.num_seeds, np.float64)
        count = np.zeros(self.num_seeds, np.int64)
        for b in batches:
            s, c = self._eval_step(self.state["params"], {"inputs": b["inputs"], "targets": b["targets"]})
            nll += np.asarray(s, np.float64)
            count += np.asarray(c, np.int64)
        return nll, count

    def logits(self, inputs: np.ndarray) -> jax.Array:
        """Per-seed logits ``[S, B, T, V]`` of one shared input batch ``[B, T]``."""
        return self._logits(self.state["params"], inputs)

    def params_of(self, index: int) -> Any:
        return unstack_tree(self.state["params"], index)

    def model_of(self, index: int) -> TransformerLM:
        """The NNX model of seed ``index`` (a copy of its current params)."""
        return nnx.merge(self.graphdef, self.params_of(index))


def _stack_batches(batches: Sequence[Batch]) -> dict[str, np.ndarray]:
    return {k: np.stack([b[k] for b in batches]) for k in ("inputs", "targets")}


def mean_std(x: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value) of a list of floats."""
    a = np.asarray(x, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


@dataclasses.dataclass
class LMRunResult:
    """Everything a seed-parallel language-model run measured. Per-seed arrays have a trailing seed axis."""

    seeds: list[int]
    num_params: int
    tokens_per_step: int  # per seed
    log_steps: list[int]  # steps (1-based, after the update) at which train_loss was recorded
    train_loss: list[list[float]]  # [n_log][S] mean train loss over the steps since the previous log point
    log_wall: list[float]  # seconds since training started (compile excluded), at each log point
    eval_steps: list[int]
    eval_loss: list[list[float]]  # [n_eval][S] validation NLL per token over the whole split
    eval_wall: list[float]
    train_seconds: float  # training wall-clock, compile and evaluation excluded
    compile_seconds: float
    eval_tokens: int

    @property
    def final_eval_loss(self) -> list[float]:
        return self.eval_loss[-1]

    @property
    def final_ppl(self) -> list[float]:
        return [math.exp(x) for x in self.final_eval_loss]

    def tokens_to_ppl(self, target: float) -> list[float | None]:
        """Per seed, the tokens seen at the first evaluation whose perplexity is <= target (None if never)."""
        out: list[float | None] = []
        for s in range(len(self.seeds)):
            hit = None
            for step, losses in zip(self.eval_steps, self.eval_loss):
                if math.exp(losses[s]) <= target:
                    hit = float(step * self.tokens_per_step)
                    break
            out.append(hit)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def train_lm_seeds(model_cfg: ModelConfig, train_cfg: Mapping[str, Any], seeds: Sequence[int],
                   train_tokens: np.ndarray, val_tokens: np.ndarray, *, seq_len: int, batch_size: int,
                   steps: int, eval_every: int = 0, log_every: int = 25, eot_id: int | None = None,
                   max_eval_batches: int = 0, data_seed_offset: int = 0,
                   progress: Callable[[str], None] | None = None) -> tuple[LMRunResult, SeedParallel]:
    """Train ``len(seeds)`` replicas as one vmapped program and evaluate them on the whole validation split.

    Seed ``s`` initialises its params with ``TransformerLM(model_cfg, seed=s)`` and draws its training windows from
    ``make_train_iterator(train_tokens, seq_len, batch_size, seed=s + data_seed_offset)``, so replica ``i`` is
    exactly the single run with seed ``seeds[i]``; two variants run with the same seeds see the same data in the
    same order and share the initial values of every weight they have in common (the model keys each weight by
    its path).

    Args:
      train_cfg: optimiser block; ``train_cfg["steps"]`` sets the cosine schedule and should equal ``steps``.
      eval_every: evaluate every this many steps (0: only at the end). The last step is always evaluated.
      eot_id: the document separator, prepended to the validation stream so every token is scored.
      max_eval_batches: cap on validation batches (0 = the whole split).

    Returns:
      ``(LMRunResult, SeedParallel)``; the second holds the trained stacked state.
    """
    from coupled_qk_jax.data.pipeline import eval_batches, make_train_iterator  # noqa: PLC0415

    say = progress or (lambda msg: None)
    sp = SeedParallel(model_cfg, train_cfg, seeds)
    iters = [make_train_iterator(train_tokens, seq_len, batch_size, seed=s + data_seed_offset, num_threads=1,
                                 prefetch_buffer_size=4) for s in sp.seeds]

    def val_batches() -> Iterator[Batch]:
        for i, b in enumerate(eval_batches(val_tokens, seq_len, batch_size, bos_id=eot_id)):
            if max_eval_batches and i >= max_eval_batches:
                return
            yield b

    eval_tokens = sum(int((b["targets"] != -100).sum()) for b in val_batches())

    def evaluate() -> list[float]:
        nll, count = sp.eval_sums(val_batches())
        return (nll / np.maximum(count, 1)).tolist()

    # Compile outside the clock: one step on a real batch would change the state, so lower and compile instead.
    t0 = time.perf_counter()
    first = _stack_batches([next(it) for it in iters])
    sp._train_step.lower(sp.state, first, sp.step_keys(0)).compile()
    evaluate_compiled = sp._eval_step.lower(sp.state["params"], next(iter(val_batches()))).compile()
    del evaluate_compiled
    compile_seconds = time.perf_counter() - t0

    res = LMRunResult(seeds=sp.seeds, num_params=sp.num_params, tokens_per_step=batch_size * seq_len,
                      log_steps=[], train_loss=[], log_wall=[], eval_steps=[], eval_loss=[], eval_wall=[],
                      train_seconds=0.0, compile_seconds=compile_seconds, eval_tokens=eval_tokens)
    train_time = 0.0
    acc = np.zeros(sp.num_seeds)
    n_acc = 0
    batch = first
    for step in range(1, steps + 1):
        if step > 1:
            batch = _stack_batches([next(it) for it in iters])
        t = time.perf_counter()
        metrics = sp.train_step(batch)
        loss = np.asarray(metrics["loss"])  # blocks: the step is timed to completion
        train_time += time.perf_counter() - t
        acc += loss
        n_acc += 1
        if step % log_every == 0 or step == steps:
            res.log_steps.append(step)
            res.train_loss.append((acc / n_acc).tolist())
            res.log_wall.append(train_time)
            say(f"step {step}/{steps} train_loss {np.array2string(acc / n_acc, precision=4)} "
                f"{step * batch_size * seq_len * sp.num_seeds / max(train_time, 1e-9):.0f} tok/s")
            acc[:] = 0
            n_acc = 0
        if (eval_every and step % eval_every == 0) or step == steps:
            losses = evaluate()
            res.eval_steps.append(step)
            res.eval_loss.append(losses)
            res.eval_wall.append(train_time)
            say(f"step {step} eval ppl {np.array2string(np.exp(losses), precision=2)}")
    res.train_seconds = train_time
    return res, sp


# ---------------------------------------------------------------------------------------------------------------
# MQAR
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MQARRunResult:
    """A seed-parallel MQAR run: accuracy per seed after each evaluated epoch."""

    seeds: list[int]
    num_params: int
    level: str
    epochs: list[int]
    accuracy: list[list[float]]  # [n_eval][S] valid/accuracy
    per_kv: list[dict[str, list[float]]]  # [n_eval] {"valid/num_kv_pairs/accuracy-N": [S]}
    train_loss: list[list[float]]  # [n_eval][S] mean train loss over the epoch
    valid_loss: list[list[float]]  # [n_eval][S] zoology's valid/loss (mean over test batches of the masked CE)
    train_seconds: float

    @property
    def final_accuracy(self) -> list[float]:
        return self.accuracy[-1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def mqar_batches_as_lm(batches: Sequence[Batch]) -> list[dict[str, np.ndarray]]:
    """MQAR batches (``inputs``, ``labels``) -> LM batches (``inputs``, ``targets``): the label at position t is the
    answer to the key *at* t, i.e. exactly the next-token target the LM loss expects."""
    return [{"inputs": b["inputs"].astype(np.int32), "targets": b["labels"].astype(np.int32),
             "num_kv_pairs": b["num_kv_pairs"]} for b in batches]


def evaluate_mqar(sp: SeedParallel, test: Sequence[Batch]) -> tuple[list[dict[str, float]], list[float]]:
    """Per-seed MQAR metrics (``mqar.MQARAccuracy``) and valid/loss over the test batches."""
    from coupled_qk_jax.data.mqar import MQARAccuracy  # noqa: PLC0415

    meters = [MQARAccuracy() for _ in sp.seeds]
    losses = np.zeros(sp.num_seeds)
    for b in test:
        # argmax on device: only [S, B, T] predictions leave it.
        preds = np.asarray(jnp.argmax(sp.logits(b["inputs"]), axis=-1))
        nll, count = sp.eval_sums([b])
        losses += nll / np.maximum(count, 1)
        for i, m in enumerate(meters):
            m.update(preds[i], b["targets"], b["num_kv_pairs"])
    return [m.compute() for m in meters], (losses / max(len(test), 1)).tolist()


def train_mqar_seeds(model_cfg: ModelConfig, train_cfg: Mapping[str, Any], seeds: Sequence[int], level: str, *,
                     epochs: int, eval_every_epochs: int = 1, num_train: int | None = None,
                     progress: Callable[[str], None] | None = None) -> tuple[MQARRunResult, SeedParallel]:
    """Train an MQAR level for ``epochs`` epochs, S seeds in parallel; evaluate on the level's test segment.

    Every seed sees zoology's fixed batch order (no shuffling, each epoch replays the same batches); the seed only
    changes the initialisation. ``train_cfg["steps"]`` must equal ``epochs * batches_per_epoch`` for the schedule
    (``configs/mqar.py`` sets it).
    """
    from coupled_qk_jax.data import mqar  # noqa: PLC0415

    say = progress or (lambda msg: None)
    lvl = mqar.LEVELS[level]
    if num_train is not None:
        lvl = dataclasses.replace(lvl, num_train=int(num_train))
    train_segs, test_segs = lvl.mix().segments()
    train = mqar_batches_as_lm(mqar.make_batches(train_segs, lvl.train_batch_size))
    test = mqar_batches_as_lm(mqar.make_batches(test_segs, lvl.test_batch_size))
    sp = SeedParallel(model_cfg, train_cfg, seeds)
    S = sp.num_seeds
    res = MQARRunResult(seeds=sp.seeds, num_params=sp.num_params, level=level, epochs=[], accuracy=[], per_kv=[],
                        train_loss=[], valid_loss=[], train_seconds=0.0)
    # the seed axis: every replica gets the same batch (broadcast, not copied per seed in host memory).
    stacked = [{k: np.broadcast_to(b[k], (S,) + b[k].shape) for k in ("inputs", "targets")} for b in train]
    t_train = 0.0
    for epoch in range(1, epochs + 1):
        acc = np.zeros(S)
        t = time.perf_counter()
        for b in stacked:
            acc += np.asarray(sp.train_step(b)["loss"])
        t_train += time.perf_counter() - t
        if epoch % eval_every_epochs == 0 or epoch == epochs:
            metrics, vloss = evaluate_mqar(sp, test)
            res.epochs.append(epoch)
            res.accuracy.append([m["valid/accuracy"] for m in metrics])
            res.per_kv.append({k: [m[k] for m in metrics] for k in metrics[0] if "num_kv_pairs" in k})
            res.train_loss.append((acc / len(stacked)).tolist())
            res.valid_loss.append(vloss)
            say(f"epoch {epoch}/{epochs} train_loss {np.array2string(acc / len(stacked), precision=3)} "
                f"acc {np.array2string(np.asarray(res.accuracy[-1]), precision=3)}")
    res.train_seconds = t_train
    return res, sp
