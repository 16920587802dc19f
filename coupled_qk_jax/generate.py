"""Sampling from a trained model with a preallocated KV cache: one jitted prefill, one jitted decode step.

    run = Run.open("runs/main_job/coupled_euler")     # coupled_qk_jax.training.run
    model, tokenizer = run.model(), run.tokenizer
    gen = Generator(model, vocab_limit=tokenizer.vocab_size)
    ids = gen.generate(encode_prompts(tokenizer, ["def ", "import"]), max_new_tokens=64,
                       sampling=Sampling(temperature=0.8, top_k=50), seed=0)

How it works. The cache holds, per layer, the keys *after* the QK transform (and after RoPE) and the values, in
[n_layers, B, S, H, d_head] arrays of a fixed size S (default `model.max_len`). Every QK transform here (coupled
dynamics, the MLP-only ablation, the affine coupling) acts on each token's own (q, k) pair, so a token's evolved key
never changes once computed and caching it is exact (`TransformerLM.decode`).

* Prompts of different lengths are right-padded to one bucket length (a power of two, so that few prefill shapes are
  ever compiled). Row b's prompt fills cache slots 0..len_b-1; its padding writes slots that stay masked until the
  row's own decoding overwrites them, so every row decodes exactly as if it were alone.
* The prefill returns the first sampled token of each row (from the logits at its last prompt position); each decode
  step feeds one token per row at that row's own position, writes its key and value into the cache (donated, so
  updated in place) and samples the next. Shapes never change between steps: one compilation serves every token.
* Ids at or above `vocab_limit` (a model vocabulary padded above the tokenizer's size) are masked out of the logits,
  so they are never produced.

On a mesh. A model whose parameters live on a (data, fsdp, tensor) mesh (`Run.open(dir, mesh="data:2,fsdp:2,
tensor:2")`) is generated from on that mesh: the Generator reads the mesh off the parameters, keeps them in the
training layout of sharding.py's rules (FSDP-split, tensor-split heads / MLP / vocab; `TransformerLM.decode` gathers
each block's weights over fsdp where it runs), and splits the KV cache, tokens and positions over the batch (data x
fsdp) and the cache also over heads (tensor). A batch that data x fsdp does not divide is padded with one-token
dummy rows, which are dropped from the result: every device holds an equal share of the cache and the real rows
decode exactly as they would alone. On one device nothing of this applies: the same programs as without a mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.errors import UserError
from coupled_qk_jax.model import CACHE_AXES, TransformerLM

Array = jax.Array


# ---------------------------------------------------------------------------------------------------------- sampling
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits (static: a new setting compiles once, never per token).

    temperature: 0 = greedy (argmax); otherwise logits are divided by it before top-k / top-p.
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = off); applied after
      top-k, to the temperature-scaled distribution (the order Hugging Face's samplers use).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _ordered_keys(x: Array) -> Array:
    """float32 -> uint32 with the same order (the sign bit flipped for x >= 0, every bit for x < 0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(0x80000000))


def _cutoff(keys: Array, enough) -> Array:
    """Per row of keys [B, V], the largest t for which enough(t [B, 1]) -> bool [B] holds, where enough is true at the
    row's smallest key and stays false once false (a monotone predicate): 32 bisection steps over uint32.

    This is how top-k and top-p find their cut-off value: on CPU, lax.top_k and sort of [8, 16384] logits cost about
    8x these 32 masked reductions (and more than the rest of a `small` decode step)."""
    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + ((hi - lo) & 1)  # ceil midpoint, no uint32 overflow
        ok = enough(mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, body, (keys.min(axis=-1), keys.max(axis=-1)))[0][:, None]


def sample_logits(logits: Array, key: Array, sampling: Sampling, vocab_limit: int) -> Array:
    """Draw one token per row. logits: float [B, V]; ids >= vocab_limit are never drawn. Returns int32 [B].

    Top-k keeps the tokens whose logit is at least the k-th largest; top-p the smallest set of most likely tokens
    whose probability reaches top_p, i.e. those at or above the largest cut-off that still leaves top_p of the mass.
    Tokens tied with a cut-off are kept, so with exact ties slightly more than k tokens (or than the nucleus) stay."""
    neg = jnp.finfo(jnp.float32).min
    logits = logits.astype(jnp.float32)
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, neg)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < vocab_limit:
        keys = _ordered_keys(logits)
        t = _cutoff(keys, lambda t: jnp.sum(keys >= t, axis=-1) >= sampling.top_k)
        logits = jnp.where(keys >= t, logits, neg)
    if sampling.top_p < 1.0:
        keys, probs = _ordered_keys(logits), jax.nn.softmax(logits, axis=-1)
        t = _cutoff(keys, lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1) >= sampling.top_p)
        logits = jnp.where(keys >= t, logits, neg)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------------------- cache
def init_cache(cfg: ModelConfig, batch: int, size: int) -> dict[str, Array]:
    """An empty KV cache: {"k", "v"}, each [n_layers, batch, size, n_heads, head_dim] in the compute dtype.

    (With differential scoring the H = n_heads entries are the half-heads, whose values are paired back into the
    differential heads' wider values at scoring time.)"""
    shape = (cfg.n_layers, batch, size, cfg.n_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Where a KV-cache array [n_layers, B, S, n_heads, head_dim] lives on `mesh`, by sharding.py's one rules table
    (model.CACHE_AXES): B over (data, fsdp), heads over tensor, the rest whole. The same for every B that data x fsdp
    divides (a PartitionSpec does not depend on the shape), so one sharding serves every batch.

    Both splits always divide, so nothing is replicated: `Generator.generate` pads B to a multiple of data x fsdp,
    and the cache's H is the H of every attention weight (wq [d_model, H, d_head]), which the same rule already had
    to split over tensor when the parameters were placed."""
    shape = (cfg.n_layers, mesh.shape["data"] * mesh.shape["fsdp"], 1, cfg.n_heads, cfg.head_dim)
    return NamedSharding(mesh, shd.logical_to_spec(CACHE_AXES, shape, mesh, name="the KV cache"))


def _bucket(n: int, cap: int) -> int:
    """The padded prompt length: the next power of two >= n (at least 8), at most cap."""
    return min(cap, max(8, 1 << (n - 1).bit_length()))


# --------------------------------------------------------------------------------------------------------- generator
class Generator:
    """Batched generation for one model: holds the jitted prefill and decode step (compiled once per shape).

    Args:
      model: a TransformerLM (its current parameters are captured). Parameters on a (data, fsdp, tensor) mesh make
        a sharded Generator on that mesh (see the module docstring); on one device, an unsharded one.
      vocab_limit: ids >= this are never generated (the tokenizer's size when the model vocabulary is padded).
      cache_size: KV-cache slots S (default model.max_len); a prompt plus its new tokens must fit in them.
    """

    def __init__(self, model: TransformerLM, vocab_limit: int | None = None, cache_size: int | None = None):
        cfg = model.cfg
        self.cfg = cfg
        self.vocab_limit = cfg.vocab_size if vocab_limit is None else int(vocab_limit)
        if not 1 <= self.vocab_limit <= cfg.vocab_size:
            raise ValueError(f"vocab_limit must be in 1..model.vocab_size={cfg.vocab_size}, got {vocab_limit}")
        self.cache_size = cfg.max_len if cache_size is None else int(cache_size)
        if not 1 <= self.cache_size <= cfg.max_len:
            raise ValueError(f"cache_size must be in 1..model.max_len={cfg.max_len}, got {cache_size}")
        self.graphdef, self.state = nnx.split(model)
        self.mesh = shd.mesh_of(self.state)  # None: one device
        self._jit(model)
        if self.mesh is not None:  # the params in the layout of the rules table (Run.open(mesh=) put them there)
            self.state = jax.device_put(nnx.to_pure_dict(self.state), self._param_shardings)

    @classmethod
    def for_mesh(cls, abstract_model: TransformerLM, mesh: Mesh) -> "Generator":
        """A Generator with no parameters, whose prefill and decode step are jitted for `mesh` (they take the
        parameters as an argument): what an ahead-of-time compile lowers (coupled_qk_jax.aot)."""
        gen = cls.__new__(cls)
        gen.cfg, gen.vocab_limit, gen.cache_size = abstract_model.cfg, abstract_model.cfg.vocab_size, \
            abstract_model.cfg.max_len
        gen.graphdef, gen.state, gen.mesh = nnx.graphdef(abstract_model), None, mesh
        gen._jit(abstract_model)
        return gen

    def _jit(self, model: TransformerLM) -> None:
        """The jitted prefill and decode step (and the cache's constructor) for self.mesh."""
        if self.mesh is None:
            self._prefill = jax.jit(self._prefill_impl, static_argnames=("sampling",))
            self._decode = jax.jit(self._decode_impl, static_argnames=("sampling",), donate_argnames=("cache",))
            return
        # Every input and output placed explicitly, so one compilation serves every step: left to XLA, the cache
        # could come back from a step in another layout and force a reshard (or a recompile) on the next.
        mesh, cfg = self.mesh, self.cfg
        params = self._param_shardings = shd.named_shardings(shd.param_specs(model, mesh), mesh)
        rows, rep = NamedSharding(mesh, P(shd.BATCH_AXES)), shd.replicated(mesh)  # [B] tokens / positions
        cache = self.cache_shardings = dict.fromkeys(("k", "v"), cache_sharding(cfg, mesh))
        self._prefill = jax.jit(shd.under_mesh(self._prefill_impl, mesh), static_argnames=("sampling",),
                                in_shardings=(params, cache, rows, rows, rep), out_shardings=(rows, cache))
        self._decode = jax.jit(shd.under_mesh(self._decode_impl, mesh), static_argnames=("sampling",),
                               donate_argnames=("cache",), in_shardings=(params, cache, rows, rows, rep, rep),
                               out_shardings=(rows, cache))
        self._new_cache = jax.jit(init_cache, static_argnums=(0, 1, 2), out_shardings=cache)

    # The two compiled functions. `state` is an argument, not a constant, so the weights are not baked into the HLO.
    def _prefill_impl(self, state, cache, tokens, lengths, key, sampling: Sampling):
        model = nnx.merge(self.graphdef, state)
        logits, cache = model.decode(tokens, cache, jnp.zeros_like(lengths))
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
        return sample_logits(last, jax.random.fold_in(key, 0), sampling, self.vocab_limit), cache

    def _decode_impl(self, state, cache, tokens, positions, step, key, sampling: Sampling):
        model = nnx.merge(self.graphdef, state)
        logits, cache = model.decode(tokens[:, None], cache, positions)
        return sample_logits(logits[:, 0], jax.random.fold_in(key, step), sampling, self.vocab_limit), cache

    def generate(self, prompts: Sequence[Sequence[int] | np.ndarray], max_new_tokens: int,
                 sampling: Sampling = Sampling(), seed: int = 0, eot_id: int | None = None) -> list[np.ndarray]:
        """Continue every prompt (token ids, lengths may differ) by up to max_new_tokens tokens.

        Returns one int32 array per prompt: its new tokens only. With eot_id, a row's output stops before its first
        eot_id and decoding ends early once every row has produced one. A fixed seed reproduces the samples (for
        the same prompts in the same batch).
        """
        if not prompts:
            raise UserError("no prompts given")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        lengths = np.array([r.size for r in rows], dtype=np.int32)
        if lengths.min() < 1:
            raise UserError("every prompt needs at least one token")
        bad = [int(i) for r in rows for i in r if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the model vocabulary 0..{self.cfg.vocab_size - 1}")
        # The last new token is never fed back, so the cache needs longest prompt + max_new_tokens - 1 slots.
        need = int(lengths.max()) + max_new_tokens - 1
        if need > self.cache_size:
            raise UserError(f"the longest prompt ({int(lengths.max())} tokens) plus max_new_tokens={max_new_tokens} "
                             f"needs {need} positions, more than the {self.cache_size} of the cache "
                             f"(model.max_len={self.cfg.max_len}); shorten the prompt or lower max_new_tokens")
        n_real = len(rows)
        if self.mesh is not None:  # pad to a multiple of data x fsdp with one-token rows (dropped below)
            split = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            n_pad = -n_real % split
            rows += [np.zeros(1, np.int64)] * n_pad
            lengths = np.concatenate([lengths, np.ones(n_pad, np.int32)])
        width = _bucket(int(lengths.max()), self.cache_size)
        tokens = np.zeros((len(rows), width), np.int32)
        for b, r in enumerate(rows):
            tokens[b, :r.size] = r
        key = jax.random.key(seed)
        if self.mesh is None:
            cache = init_cache(self.cfg, len(rows), self.cache_size)
            tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
        else:  # made in place on the mesh, never whole on one device
            cache = self._new_cache(self.cfg, len(rows), self.cache_size)
            tokens, lengths = jax.device_put((tokens, lengths), NamedSharding(self.mesh, P(shd.BATCH_AXES)))
        tok, cache = self._prefill(self.state, cache, tokens, lengths, key, sampling)
        out = [tok]
        positions = lengths  # where each row's newest token goes
        finished = np.arange(len(rows)) >= n_real  # padding rows never hold up stopping at eot
        for step in range(1, max_new_tokens):
            if eot_id is not None:
                # One host sync per step, only when stopping early is asked (all-gathered across processes).
                finished |= shd.to_host(tok) == eot_id
                if finished.all():
                    break
            tok, cache = self._decode(self.state, cache, tok, positions, step, key, sampling)
            positions = positions + 1
            out.append(tok)
        ids = np.stack([shd.to_host(t) for t in out], axis=1)  # [B, steps]; every process gets every row
        results = []
        for row in ids[:n_real]:
            if eot_id is not None and (row == eot_id).any():
                row = row[:int(np.argmax(row == eot_id))]
            results.append(row.astype(np.int32))
        return results


# -------------------------------------------------------------------------------------------------------- text, runs
def encode_prompts(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
    """Text prompts -> token ids, each preceded by <|endoftext|>: training documents follow one (the token cache
    terminates every document with it), so this is how a document starts. An empty text is just that token."""
    return [np.concatenate([[tokenizer.eot_id], ids]).astype(np.int32) for ids in tokenizer.encode_batch(list(texts))]


def parse_token_ids(text: str, vocab: int) -> np.ndarray:
    """A prompt given as ids: '1, 2,3' -> int32 [1, 2, 3]; every id must be a token of the tokenizer (< vocab)."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--ids={text!r}: expected comma-separated integers, e.g. --ids=12,7,301") from None
    if not ids:
        raise UserError("--ids needs at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UserError(f"--ids: token id {bad[0]} is outside the tokenizer's vocabulary 0..{vocab - 1}")
    return np.asarray(ids, np.int32)
