"""A decoder-only language model whose attention layers come from attention.py (Flax NNX).

    tokens [B, T] -> embed (+ learned positions) -> n_layers x Block -> final norm -> tied head -> logits [B, T, V]
    Block: x + Attn(Norm(x)), then x + MLP(Norm(x))       (pre-norm, GELU MLP)

The file reads bottom-up as the model is built: the norm, the MLP, the block, then the model (``features`` -> ``head``
for training, ``decode`` for generation, ``classify`` for sentence tasks, ``capturing`` for diagnostics), then how the
layers run (remat policies, the stacked block) and the conversion of params between the two layer layouts.

The layers are either a list of Blocks run by a Python loop, or (`runtime.scan_layers`) one Block whose parameters are
stacked on a leading "layers" axis and run by jax.lax.scan: the program then holds one layer, so compile time and
HLO size do not grow with depth, and FSDP gathers one layer's weights per scan iteration. Both layouts initialise
identical values (the stacked block is the list's blocks stacked), and `to_scanned` / `to_unscanned` convert a
params tree (or a whole train state) between them. Per-layer constants (DiffAttn's λ_init) take the layer index as
an argument, a traced one inside the scan.

Parameters are float32; activations run in `cfg.dtype` (bf16 on accelerators), logits are returned in float32; what
runs in float32 under bf16 is the policy in precision.py.
Randomness is explicit: dropout takes a key argument, so a step is a pure function of (params, batch, key), which is
what makes resumed runs and seed-vmapped runs reproduce exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.attention import CausalSelfAttention, CouplingMLP, const_param, normal_param, rms_norm
from coupled_qk_jax.config import DYNAMICS_METHOD, ModelConfig, RuntimeConfig
from coupled_qk_jax.precision import add_bias

Array = jax.Array

RESIDUAL = ("batch", "length", "activation_embed")  # logical axes of the residual stream between blocks
CACHE_AXES = ("layers", "batch", "length", "heads", "head_dim")  # logical axes of a KV-cache array [L, B, S, H, D]


class Norm(nnx.Module):
    """RMSNorm or LayerNorm over the last axis, fp32 statistics."""

    def __init__(self, cfg: ModelConfig):
        self.kind = cfg.norm
        self.scale = const_param((cfg.d_model,), 1.0, ("embed",))
        if self.kind == "layernorm":
            self.bias = const_param((cfg.d_model,), 0.0, ("embed",))

    def __call__(self, x: Array) -> Array:
        if self.kind == "rmsnorm":
            return rms_norm(x, self.scale[...], eps=1e-6)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.var(x32, axis=-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...] + self.bias[...]).astype(x.dtype)


class MLP(nnx.Module):
    """GELU feed-forward d_model -> d_ff -> d_model."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, key: Array):
        path = f"layers/{layer_idx}/mlp"
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.w_in = normal_param(key, path + "/w_in", (cfg.d_model, cfg.d_ff), cfg.init_std, ("embed", "mlp"))
        self.b_in = const_param((cfg.d_ff,), 0.0, ("mlp",))
        self.w_out = normal_param(key, path + "/w_out", (cfg.d_ff, cfg.d_model), out_std, ("mlp", "embed"))
        self.b_out = const_param((cfg.d_model,), 0.0, ("embed",))

    def __call__(self, x: Array) -> Array:
        dtype = x.dtype  # matmuls in the compute dtype, bias adds in float32 (precision.py)
        h = jax.nn.gelu(add_bias(x @ self.w_in[...].astype(dtype), self.b_in[...]))
        return add_bias(h @ self.w_out[...].astype(dtype), self.b_out[...])


def dropout(x: Array, rate: float, key: Array | None) -> Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Block(nnx.Module):
    """One pre-norm transformer block, x [B, T, d_model] -> the same: x + Attn(Norm(x)), then x + MLP(Norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, key: Array, runtime: RuntimeConfig = RuntimeConfig()):
        self.cfg = cfg
        self.attn_norm = Norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer_idx, key, runtime)
        if cfg.d_ff:
            self.mlp_norm = Norm(cfg)
            self.mlp = MLP(cfg, layer_idx, key)

    def __call__(self, x: Array, dropout_key: Array | None = None, layer_idx: int | Array | None = None) -> Array:
        """x [B, T, d_model] -> the same; layer_idx: this block's depth (traced inside the layer scan)."""
        keys = (None, None) if dropout_key is None else tuple(jax.random.split(dropout_key))
        x = x + dropout(self.attn(self.attn_norm(x), layer_idx), self.cfg.dropout, keys[0])
        if self.cfg.d_ff:
            x = x + dropout(self.mlp(self.mlp_norm(x)), self.cfg.dropout, keys[1])
        return x

    def decode(self, x: Array, cache: dict[str, Array], positions: Array,
               layer_idx: int | Array | None = None) -> tuple[Array, dict[str, Array]]:
        """The block on new tokens with the attention layer's KV cache (no dropout): -> (x, cache)."""
        out, cache = self.attn.decode(self.attn_norm(x), cache, positions, layer_idx)
        x = x + out
        if self.cfg.d_ff:
            x = x + self.mlp(self.mlp_norm(x))
        return x, cache


class TransformerLM(nnx.Module):
    """Decoder-only LM. `TransformerLM(cfg, seed)`; `model(tokens)` -> float32 logits [B, T, vocab_size], which is
    `model.head(model.features(tokens))`: a loss that scores a few positions (MQAR's answers,
    training.steps.answer_logits) gathers them from the features and applies the head there alone.

    `runtime` (default: RuntimeConfig()) is how the function is computed: remat, the layer layout, the attention
    kernel and the dynamics scan. Every runtime gives the same function from the same seed.

    With model.coupling_scope="shared" the one coupling MLP f of every layer is `self.shared_coupling`, which the
    model lends to each block where it runs it (`lend_shared_coupling`)."""

    def __init__(self, cfg: ModelConfig, seed: int | Array = 0, runtime: RuntimeConfig = RuntimeConfig()):
        self.cfg, self.runtime = cfg, runtime
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        self.embed = normal_param(key, "embed", (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"))
        if cfg.positions == "learned":
            self.pos_embed = normal_param(key, "pos_embed", (cfg.max_len, cfg.d_model), cfg.init_std,
                                          (None, "embed"))
        if cfg.qk_transform in DYNAMICS_METHOD and cfg.coupling_scope == "shared":
            self.shared_coupling = CouplingMLP(cfg, key, "shared_coupling")
        blocks = [Block(cfg, i, key, runtime) for i in range(cfg.n_layers)]
        self.blocks = stack_blocks(blocks) if runtime.scan_layers else nnx.List(blocks)
        self.final_norm = Norm(cfg)
        if cfg.num_labels:
            self.cls_head = normal_param(key, "cls_head", (cfg.d_model, cfg.num_labels), cfg.init_std, ("embed", None))
            self.cls_bias = const_param((cfg.num_labels,), 0.0, (None,))

    def __call__(self, tokens: Array, *, dropout_key: Array | None = None) -> Array:
        """tokens: int [B, T] with T <= max_len -> logits [B, T, V] (float32)."""
        return self.head(self.features(tokens, dropout_key=dropout_key))

    def features(self, tokens: Array, *, dropout_key: Array | None = None) -> Array:
        """tokens int [B, T] -> the final hidden states [B, T, d_model] in the compute dtype, after the final norm:
        what `head` and `classify` read. dropout_key: None = no dropout."""
        cfg = self.cfg
        if tokens.shape[-1] > cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds model.max_len={cfg.max_len}")
        x = self._embed(tokens)
        keys = None
        if dropout_key is not None and cfg.dropout > 0:
            keys = jax.random.split(dropout_key, cfg.n_layers + 1)  # one per layer, the last for the embedding
            x = dropout(x, cfg.dropout, keys[-1])
        x = self._through_layers(_run_block, x, None if keys is None else keys[:-1], checkpointed=True)
        return shd.gather_weights(self.final_norm)(x)

    def head(self, hidden: Array) -> Array:
        """The tied output head: hidden [B, K, d_model] (the features, or some positions of them) -> logits
        [B, K, V] = hidden · Eᵀ, accumulated in float32."""
        embed = shd.gather_weight(self.embed, "embed").astype(jnp.dtype(self.cfg.dtype))
        logits = jnp.einsum("btd,vd->btv", hidden, embed, preferred_element_type=jnp.float32)
        return shd.constrain(logits, ("batch", "length", "vocab"))

    def classify(self, tokens: Array, positions: Array, *, dropout_key: Array | None = None) -> Array:
        """The classification head (model.num_labels > 0): tokens [B, T] and positions int [B], each row's last
        real token -> float32 [B, num_labels] (a regression's value at [:, 0]), from the final hidden state there:
        a causal model has read the whole sequence only at its last token."""
        x = self.features(tokens, dropout_key=dropout_key)
        last = jnp.take_along_axis(x, positions.astype(jnp.int32)[:, None, None], axis=1)[:, 0]  # [B, d_model]
        head = shd.gather_weight(self.cls_head, "cls_head").astype(last.dtype)
        return jnp.einsum("bd,dn->bn", last, head, preferred_element_type=jnp.float32) + self.cls_bias[...]

    def decode(self, tokens: Array, cache: dict[str, Array], start: Array) -> tuple[Array, dict[str, Array]]:
        """The forward pass with a KV cache (generate.py): tokens int [B, T] at positions start[b] + 0..T-1, where
        start is int [B] -> (logits [B, T, V] float32, the updated cache).

        cache: {"k", "v"}, each [n_layers, B, S, H, d_head] in the compute dtype (`generate.init_cache`); keys are
        stored after the QK transform. A prefill is `decode(prompts, cache, zeros)`, a decode step
        `decode(next_tokens[:, None], cache, positions)`; the logits equal those of `__call__` on the whole sequence.

        Under a mesh (generate.Generator on sharded params) the same FSDP gathers and activation constraints as
        __call__: each block's weights are gathered where it runs, the residual stream and the cache stay split
        over batch (and the cache over heads). Without a mesh every shd.* call is the identity.
        """
        positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]  # [B, T]

        # The whole cache rides along as one carry and each layer updates its own slice in place: scanning the
        # cache as the scan's xs/ys instead would build a second full cache every step (measured: temp memory
        # 42 MB vs 9 MB for small's 34 MB cache).
        def step(block: Block, carry: tuple[Array, Array, Array], layer_idx, _) -> tuple[Array, Array, Array]:
            x, ks, vs = carry
            x, layer = shd.gather_weights(block).decode(x, {"k": ks[layer_idx], "v": vs[layer_idx]}, positions,
                                                        layer_idx)
            ks = shd.constrain(ks.at[layer_idx].set(layer["k"]), CACHE_AXES)
            vs = shd.constrain(vs.at[layer_idx].set(layer["v"]), CACHE_AXES)
            return shd.constrain(x, RESIDUAL), ks, vs

        carry = (self._embed(tokens, positions),
                 shd.constrain(cache["k"], CACHE_AXES), shd.constrain(cache["v"], CACHE_AXES))
        x, ks, vs = self._through_layers(step, carry, None, checkpointed=False)
        return self.head(shd.gather_weights(self.final_norm)(x)), {"k": ks, "v": vs}

    def capturing(self) -> TransformerLM:
        """A copy of the model for a diagnostic forward: the same params and function, with attention layers that
        sow their intermediates (CausalSelfAttention.capture_intermediates: q/k before and after the transform,
        the attention weights, Δt) for nnx.capture(..., nnx.Intermediate) to collect; diagnostics.capture_layers
        runs it. The copy runs its layers as a Python loop (a scanned model's params are unstacked,
        `to_unscanned`), because values sown inside jax.lax.scan's body do not leave it, and without remat, since
        nothing of it is differentiated. Its blocks hold the shared coupling MLP themselves: it is never saved."""
        runtime = dataclasses.replace(self.runtime, scan_layers=False, remat="none")
        graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(self.cfg, 0, runtime)))
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        nnx.replace_by_pure_dict(state, to_unscanned(params) if self.runtime.scan_layers else params)
        copy = nnx.merge(graphdef, state)
        for i, block in enumerate(copy.blocks):
            copy.blocks[i] = copy.lend_shared_coupling(block)
            copy.blocks[i].attn.capture_intermediates = True
        return copy

    def lend_shared_coupling(self, block: Block) -> Block:
        """`block` with this model's shared coupling MLP as its attention's `coupling` (model.coupling_scope
        "shared"; any other scope, or a block that has one: `block` itself).

        The loan goes to a copy of the block (nnx.split/merge: the same arrays), never to the model's own blocks:
        NNX keeps a module that two attributes reference at the first path it meets in (sorted) attribute order,
        which would move the MLP's params from `shared_coupling` to `blocks/0/attn/coupling`, and the scanned
        layout's stacked block would stack it n_layers times."""
        if not hasattr(self, "shared_coupling") or hasattr(block.attn, "coupling"):
            return block
        block = nnx.merge(*nnx.split(block))
        block.attn.coupling = self.shared_coupling
        return block

    # -- the path every forward shares ---------------------------------------------------------------------------
    def _embed(self, tokens: Array, positions: Array | None = None) -> Array:
        """tokens int [B, T] -> the residual stream [B, T, d_model] in the compute dtype: the token embeddings plus,
        with learned positions, those of positions 0..T-1 or of the absolute `positions` [B, T] (decode)."""
        cfg = self.cfg
        x = jnp.take(shd.gather_weight(self.embed, "embed"), tokens, axis=0)
        if cfg.positions == "learned":
            pos_embed = shd.gather_weight(self.pos_embed, "pos_embed")
            x = x + (pos_embed[:tokens.shape[-1]] if positions is None else jnp.take(pos_embed, positions, axis=0))
        return shd.constrain(x.astype(jnp.dtype(cfg.dtype)), RESIDUAL)

    def _through_layers(self, step: Callable, carry: Any, keys: Array | None, checkpointed: bool) -> Any:
        """carry -> step(block, carry, layer_idx, key) for every layer in order, key = keys[layer_idx] (None
        without keys), each block lent the shared coupling MLP (`lend_shared_coupling`).

        Unscanned: a Python loop over the blocks, layer_idx a Python int. Scanned (runtime.scan_layers):
        jax.lax.scan, each iteration rebuilding one layer from its slice of the stacked params (nnx.merge), with a
        traced layer_idx. `checkpointed`: run each step (unscanned, nnx.remat) or the scan body (jax.checkpoint)
        under runtime.remat's policy."""
        remat = self.runtime.remat
        if not self.runtime.scan_layers:
            # remat="none" with nothing gathered saves every residual, so a checkpoint would only add its
            # reduce_precision markers, which XLA keeps as fusion barriers.
            if checkpointed and (remat != "none" or shd.fsdp_gathers()):
                step = nnx.remat(step, policy=REMAT_POLICIES[remat])
            for i, block in enumerate(self.blocks):
                carry = step(self.lend_shared_coupling(block), carry, i, None if keys is None else keys[i])
            return carry

        graphdef, stacked = nnx.split(self.blocks)

        def body(carry, xs):
            params, layer_idx, key = xs
            return step(self.lend_shared_coupling(nnx.merge(graphdef, params)), carry, layer_idx, key), None

        if checkpointed:
            # remat="none" saves only the weight matmuls' outputs here ("dots") and recomputes the rest of the block
            # in the backward loop. Saving everything, as the Python loop does, costs more in a scan: each residual
            # the backward pass reads (47 per layer at tiny: masks, exp, the GELU's and norms' pieces, the q/k/v
            # slices of every query block) is written into a stacked [L, ...] buffer by the forward loop and read
            # back by the backward loop, where the loop keeps XLA from fusing the cheap ones into their backward
            # consumers as it does in one unrolled graph. Measured on CPU:
            # 0.79-0.94x the step time of saving everything at 0.37x its memory; vs the Python loop 0.93-1.08x
            # under glibc malloc, 1.08-1.15x under tcmalloc (the recomputation is that floor; other policies cost more).
            policy = REMAT_POLICIES["dots" if remat == "none" else remat]
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        carry, _ = jax.lax.scan(body, carry, (nnx.to_pure_dict(stacked), jnp.arange(self.cfg.n_layers), keys))
        return carry


# ------------------------------------------------------------------------------------------- how the layers run
def _run_block(block: Block, x: Array, layer_idx: int | Array, dropout_key: Array | None) -> Array:
    """One block of the training forward, with its weights gathered over fsdp where it runs (inside the remat, so
    that the backward pass gathers them again instead of keeping them) and its output pinned to the residual
    layout."""
    return shd.constrain(shd.gather_weights(block)(x, dropout_key, layer_idx), RESIDUAL)


def _save_all_but_gathered(prim, *_, **params) -> bool:
    """The "none" remat policy: every residual is saveable except the FSDP-gathered weights.

    sharding.gather_weight is two layout constraints and a checkpoint_name(GATHERED): neither the named value nor the
    constraints' outputs may be saved (saving the outer constraint's output would keep the gathered weight all the
    same), so the backward pass re-gathers from the stored shard. Activation constraints are identities whose input
    is saved instead. Written out because jax.checkpoint_policies.save_anything_except_these_names ignores its names
    (on jax 0.10.2 it is `lambda *_, **__: True`): with it every layer's gathered weights were saved, a full copy of
    the stacked weights on every device (docs/scaling.md, "Memory of the 350m train step")."""
    if prim.name == "name":
        return params.get("name") != shd.GATHERED
    return prim.name != "sharding_constraint"


REMAT_POLICIES = {
    # Every block runs under jax.checkpoint with one of these. "none" saves every residual except the weights that
    # FSDP gathered (sharding.GATHERED): the backward pass re-gathers them instead of keeping a full copy of every
    # layer's weights alive from the forward pass (ZeRO-3). With nothing gathered (no fsdp) it would save all, so
    # the unscanned stack then runs its blocks without a checkpoint.
    # The scanned stack of layers (runtime.scan_layers) runs "none" as "dots" instead: see TransformerLM._through_layers.
    "none": _save_all_but_gathered,
    "full": None,  # save nothing but the block input: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose every Param is the blocks' Params stacked on a new leading axis, logical name "layers"."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(b)[1] for b in blocks[1:]]

    def stack(*variables):
        meta = variables[0].get_metadata().get("logical_axes") or (None,) * variables[0].get_value().ndim
        return variables[0].replace(value=jnp.stack([v.get_value() for v in variables]),
                                    logical_axes=("layers",) + tuple(meta))

    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))



# ------------------------------------------------------------------------------------------- layout conversion
def to_scanned(tree: Any) -> Any:
    """Stack the unscanned layout's blocks {"0": {...}, "1": {...}} (or [ {...}, ... ]) into one block with a leading
    layer axis, wherever a "blocks" entry appears in `tree` (a params dict, or a whole train state: AdamW's moments
    have the params' structure). Other leaves pass through."""
    def convert(blocks):
        layers = [blocks[i] for i in sorted(blocks, key=int)] if isinstance(blocks, dict) else list(blocks)
        return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)

    return _map_blocks(tree, convert)


def to_unscanned(tree: Any) -> Any:
    """The inverse of `to_scanned`: a stacked block -> {0: {...}, 1: {...}, ...} (the keys nnx.to_pure_dict uses)."""
    def convert(block):
        n = jax.tree.leaves(block)[0].shape[0]
        return {i: jax.tree.map(lambda a, i=i: a[i], block) for i in range(n)}

    return _map_blocks(tree, convert)


def _map_blocks(tree: Any, convert) -> Any:
    def visit(node):
        if isinstance(node, dict):
            return {k: convert(v) if k == "blocks" else visit(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return type(node)(visit(v) for v in node)
        if hasattr(node, "_fields"):  # NamedTuple optimiser states
            return type(node)(*(visit(v) for v in node))
        return node

    return visit(tree)


def count_params(model: nnx.Module) -> int:
    """Number of trainable scalars (every nnx.Param)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def abstract_param_count(cfg: ModelConfig) -> int:
    """Parameter count without allocating anything (safe for the 350m shape on a laptop)."""
    shapes = nnx.eval_shape(lambda: TransformerLM(cfg, 0))
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
