"""Pure train and eval steps over (graphdef, params) — the functional NNX loop.

A train state is a plain dict {"params", "opt_state", "step"}: params are `nnx.to_pure_dict` of the model's Params
(the model has no other state: dropout keys are explicit), so orbax, jax.sharding and jax.vmap all see ordinary
pytrees. `nnx.merge(graphdef, params)` rebuilds the module inside the jitted function.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from coupled_qk_jax.data import IGNORE_INDEX
from coupled_qk_jax.model import TransformerLM


def masked_cross_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed token NLL and token count, ignoring targets == -100. logits [B, T, V] fp32, targets [B, T]."""
    valid = targets != IGNORE_INDEX
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.where(valid, targets, 0))
    return jnp.sum(nll * valid), jnp.sum(valid)


def label_loss(outputs: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed loss and example count of a classification head's outputs [B, N] (model.classify): softmax cross-entropy
    over N classes with int labels [B] (< 0: not scored, a padding row), or with N = 1 the squared error against
    float labels [B] (NaN: not scored)."""
    if outputs.shape[-1] == 1:
        valid = ~jnp.isnan(labels)
        err = jnp.square(outputs[:, 0] - jnp.where(valid, labels, 0.0).astype(jnp.float32))
        return jnp.sum(err * valid), jnp.sum(valid)
    valid = labels >= 0
    nll = optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), jnp.where(valid, labels, 0))
    return jnp.sum(nll * valid), jnp.sum(valid)


def answer_logits(model: TransformerLM, inputs: jax.Array, positions: jax.Array,
                  dropout_key: jax.Array | None = None) -> jax.Array:
    """MQAR's logits at its answer positions only: inputs int [B, T], positions int [B, K] -> float32 [B, K, V].

    The head runs on the K gathered hidden states instead of all T: at zoology's vocabulary 8192 the [B, T, V] head,
    spent on targets MQAR ignores, is most of a step (as nanoGPT computes the head at the last position alone when
    generating). The logits there equal those of the full forward."""
    hidden = model.features(inputs, dropout_key=dropout_key)
    return model.head(jnp.take_along_axis(hidden, positions[..., None].astype(jnp.int32), axis=1))


def split_model(model: TransformerLM) -> tuple[nnx.GraphDef, dict]:
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def init_train_state(params: dict, tx: optax.GradientTransformation) -> dict:
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable:
    """loss_fn(params, batch, dropout_key=None) -> (mean NLL, (summed NLL, token count)).

    batch: {"inputs", "targets"} int [B, T], and optionally "answer_positions" int [B, K]: the only positions whose
    targets may be scored (MQAR's answers, data.mqar.pad_batch); the logits are then computed there alone and the
    loss equals the masked loss over all T positions, at a fraction of the head's cost. A sentence task's batch
    is {"inputs" [B, T], "positions" int [B] (each row's last real token), "labels" [B]} instead: the loss of the
    classification head there (:func:`label_loss`; "count" is then examples, not tokens).

    Under a mesh (sharding.under_mesh, applied by the sharded jits) the model gathers each layer's FSDP-sharded
    weights where that layer runs (sharding.gather_weights).
    """
    def loss_fn(params, batch, dropout_key=None):
        model = nnx.merge(graphdef, params)
        if "labels" in batch:
            loss_sum, count = label_loss(model.classify(batch["inputs"], batch["positions"], dropout_key=dropout_key),
                                         batch["labels"])
            return loss_sum / jnp.maximum(count, 1), (loss_sum, count)
        positions, targets = batch.get("answer_positions"), batch["targets"]
        if positions is not None:
            targets = jnp.take_along_axis(targets, positions, axis=1)
        if positions is None:
            logits = model(batch["inputs"], dropout_key=dropout_key)
        else:
            logits = answer_logits(model, batch["inputs"], positions, dropout_key)
        nll_sum, count = masked_cross_entropy(logits, targets)
        return nll_sum / jnp.maximum(count, 1), (nll_sum, count)

    return loss_fn


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, grad_accum: int = 1,
                    use_dropout: bool = False) -> Callable:
    """train_step(state, batch, key) -> (state, metrics). batch: {"inputs", "targets"} [grad_accum * B, T].

    With grad_accum > 1 the batch is split into that many micro-batches, scanned, and their token-weighted gradients
    averaged before one optimiser update (so the update equals the one of the full batch).
    """
    loss_fn = make_loss_fn(graphdef)

    def sum_loss(params, batch, key):
        loss, (nll_sum, count) = loss_fn(params, batch, key if use_dropout else None)
        return nll_sum, count

    def grads_and_loss(params, batch, key):
        (nll_sum, count), grads = jax.value_and_grad(sum_loss, has_aux=True)(params, batch, key)
        return grads, count, nll_sum

    def train_step(state, batch, key):
        params = state["params"]
        if grad_accum == 1:
            grads, count, nll_sum = grads_and_loss(params, batch, key)
        else:
            micro = jax.tree.map(lambda x: x.reshape((grad_accum, -1) + x.shape[1:]), batch)

            def body(carry, xs):
                g, c, l = grads_and_loss(params, *xs)
                return jax.tree.map(jnp.add, carry, (g, c, l)), None

            zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))
            (grads, count, nll_sum), _ = jax.lax.scan(body, zeros, (micro, jax.random.split(key, grad_accum)))
        denom = jnp.maximum(count, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": nll_sum / denom, "tokens": count, "grad_norm": optax.tree.norm(grads)}
        return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    """eval_step(params, batch) -> (summed NLL, token count) over targets != -100."""
    loss_fn = make_loss_fn(graphdef)

    def eval_step(params, batch):
        return loss_fn(params, batch)[1]

    return eval_step
