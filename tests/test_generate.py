"""Generation (coupled_qk_jax/generate.py): cached decoding against the full forward, sampling rules, compilation."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coupled_qk_jax import generate
from coupled_qk_jax.config import ALL_VARIANTS, ModelConfig, RuntimeConfig
from coupled_qk_jax.generate import Generator, Sampling, sample_logits
from coupled_qk_jax.model import TransformerLM

T, CACHE = 16, 24  # sequence length checked, cache slots (>= T, so stale slots exist above every position)
LENGTHS = np.array([5, 11], np.int32)  # two prompts of different lengths in one batch


def tiny_model(variant: str, positions: str, **overrides) -> TransformerLM:
    """A small model whose parameters are all perturbed: f ≠ 0, the affine nets ≠ identity, Δt and λ away from
    their init, so that every QK transform really changes q and k."""
    cfg = ModelConfig(**{**dict(variant=variant, vocab_size=61, max_len=CACHE, d_model=32, n_layers=2, n_heads=4,
                             d_ff=48, coupling_hidden=8, affine_hidden=8, positions=positions), **overrides})
    model = TransformerLM(cfg, 0)
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


@jax.jit  # the graphdef is a static pytree node: one compilation per model structure and shape
def _full(state, graphdef, tokens):
    return nnx.merge(graphdef, state)(tokens)


def _full_and_cached(model: TransformerLM, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Logits [B, T, V] of one full forward over `tokens`, and the same logits computed the generation way: one
    prefill of the right-padded prompts (row b: its first lengths[b] tokens), then one decode step per token, each
    row at its own position. One compilation for both."""
    graphdef, state = nnx.split(model)
    b, t = tokens.shape
    width = int(lengths.max())
    prompts = np.where(np.arange(width)[None] < lengths[:, None], tokens[:, :width], 0)  # padding = token 0
    n_steps = t - int(lengths.min())

    @jax.jit
    def run(state, prompts, tokens, lengths):
        m = nnx.merge(graphdef, state)
        logits, cache = m.decode(prompts, generate.init_cache(m.cfg, b, CACHE), jnp.zeros_like(lengths))

        def step(cache, j):  # feed token (b, lengths[b] + j) at that position
            pos = lengths + j
            tok = jnp.take_along_axis(tokens, jnp.minimum(pos, t - 1)[:, None], axis=1)
            out, cache = m.decode(tok, cache, pos)
            return cache, out[:, 0]

        _, steps = jax.lax.scan(step, cache, jnp.arange(n_steps))
        return m(tokens), logits, steps

    full, prefill, steps = jax.device_get(run(state, prompts, tokens, lengths))
    cached = np.zeros_like(full)
    for row in range(b):
        n = int(lengths[row])
        cached[row, :n] = prefill[row, :n]
        cached[row, n:] = steps[:t - n, row]
    return full, cached


def assert_same_logits(cached: np.ndarray, full: np.ndarray) -> None:
    """Equal to 2e-5 of the logits' scale (fp32 rounding of matmuls of other shapes, amplified by exp in the affine
    coupling, reaches ~5e-6 of it; a wrong position, mask or cached key is off by O(1))."""
    scale = float(np.abs(full).max())
    assert scale > 1.0  # not a comparison of near-zero logits
    np.testing.assert_allclose(cached, full, rtol=0, atol=2e-5 * scale)


# Every variant once. Positions alternate so that every QK transform, and both scorings (softmax and differential),
# meet both learned positions and RoPE; a wrong position, mask or cached key shows up in every case, so the full
# cross product (twice the compilations) only repeats paths.
ROPE = {"differential", "coupled_euler", "coupled_leapfrog+differential", "mlp_only", "affine+differential"}
VARIANT_CASES = [(v, "rope" if v in ROPE else "learned") for v in ALL_VARIANTS]


@pytest.mark.parametrize("variant,positions", VARIANT_CASES)
def test_cached_decoding_matches_full_forward(variant, positions):
    model = tiny_model(variant, positions)
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, T), 0, 61), np.int32)
    full, cached = _full_and_cached(model, tokens, LENGTHS)
    assert_same_logits(cached, full)


@pytest.mark.parametrize("overrides", [{"coupling_scope": "shared", "n_steps": 2},
                                       {"per_head_params": True, "n_steps": 3}])
def test_cached_decoding_coupling_options(overrides):
    model = tiny_model("coupled_leapfrog", "rope", **overrides)
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, T), 0, 61), np.int32)
    full, cached = _full_and_cached(model, tokens, LENGTHS)
    assert_same_logits(cached, full)


def test_cached_decoding_with_scanned_layers():
    """runtime.scan_layers: the cache's layer axis runs through the layer scan with the stacked params (and
    differential scoring's λ_init gets the traced layer index). The same weights, stacked, give the same cached
    logits as the unscanned model's full forward."""
    from coupled_qk_jax.model import to_scanned

    model = tiny_model("coupled_leapfrog+differential", "rope", n_layers=3)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(model.cfg, 0, RuntimeConfig(scan_layers=True))))
    scanned = nnx.merge(graphdef, to_scanned(nnx.to_pure_dict(nnx.state(model))))
    tokens = np.asarray(jax.random.randint(jax.random.key(5), (2, T), 0, 61), np.int32)
    g, state = nnx.split(model)
    full = np.asarray(_full(state, g, jnp.asarray(tokens)))  # the unscanned reference
    scanned_full, cached = _full_and_cached(scanned, tokens, LENGTHS)
    assert_same_logits(scanned_full, full)
    assert_same_logits(cached, full)


def test_cached_decoding_in_bfloat16():
    """The accelerator dtype: the cache is bf16 and the cached logits follow the bf16 full forward to bf16 rounding
    (each path rounds differently, so only the scale of the agreement is checked)."""
    model = tiny_model("coupled_leapfrog+differential", "rope", dtype="bfloat16")
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (2, T), 0, 61), np.int32)
    full, cached = _full_and_cached(model, tokens, LENGTHS)
    assert np.abs(cached - full).max() < 0.01 * np.abs(full).max()  # bf16 vs fp32 full forwards differ by 0.02
    assert (cached.argmax(-1) == full.argmax(-1)).mean() > 0.9


# ------------------------------------------------------------------------------------------------- the Generator
@pytest.fixture(scope="module")
def gen_model():
    return tiny_model("coupled_euler+differential", "rope")


@pytest.fixture(scope="module")
def generator(gen_model):
    return Generator(gen_model, vocab_limit=50, cache_size=CACHE)


PROMPTS = [np.array([3, 1, 4], np.int32), np.array([1, 5, 9, 2, 6, 5, 3], np.int32)]


GREEDY = Sampling(temperature=0)
SAMPLED = Sampling(temperature=4.0, top_k=40, top_p=0.98)  # one compiled sampler for the sampling tests below


def test_greedy_equals_argmax_of_full_forward(gen_model, generator):
    out = generator.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY)
    seqs = [np.concatenate([p, new]) for p, new in zip(PROMPTS, out)]
    # One full forward over both sequences, right-padded: causal, so a row's logits ignore the padding after it.
    batch = np.zeros((2, max(map(len, seqs))), np.int32)
    for row, seq in enumerate(seqs):
        batch[row, :len(seq)] = seq
    graphdef, state = nnx.split(gen_model)
    logits = np.asarray(_full(state, graphdef, jnp.asarray(batch)))
    for row, (prompt, new) in enumerate(zip(PROMPTS, out)):
        assert new.shape == (8,)
        # new token j is the argmax, over the real ids (< 50), of the full forward at the position before it
        expected = np.argmax(logits[row, len(prompt) - 1:len(prompt) + 7, :50], axis=-1)
        np.testing.assert_array_equal(new, expected)


def test_padding_ids_never_generated(gen_model, generator):
    """vocab_limit=50 < vocab_size=61: ids 50..60 exist in the model but are never produced."""
    for sampling in (GREEDY, SAMPLED):
        out = np.concatenate(generator.generate(PROMPTS, max_new_tokens=12, sampling=sampling, seed=4))
        assert out.max() < 50, sampling
    # Without the mask the padded ids would be drawn: at temperature 4 they hold a real share of the model's mass.
    graphdef, state = nnx.split(gen_model)
    probs = jax.nn.softmax(_full(state, graphdef, jnp.asarray(PROMPTS[1][None])) / 4.0, axis=-1)
    assert float(probs[..., 50:].sum(-1).mean()) > 0.1


def test_seed_reproduces_and_changes_samples(generator):
    a = generator.generate(PROMPTS, max_new_tokens=10, sampling=SAMPLED, seed=7)
    b = generator.generate(PROMPTS, max_new_tokens=10, sampling=SAMPLED, seed=7)
    c = generator.generate(PROMPTS, max_new_tokens=10, sampling=SAMPLED, seed=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert any((x != y).any() for x, y in zip(a, c))


def test_no_recompilation_per_token(generator):
    """After one warm-up call, a longer generation traces nothing: one prefill and one decode step serve every
    token (counted with jax.monitoring's trace events, which fire even when a persistent compile cache hits)."""
    generator.generate(PROMPTS, max_new_tokens=2, sampling=SAMPLED)
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        generator.generate(PROMPTS, max_new_tokens=12, sampling=SAMPLED, seed=3)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == []


def test_eot_stops_a_row(gen_model, generator):
    """With eot_id set to the token greedy decoding produces third, each row ends right before it."""
    full = generator.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY)
    eot = int(full[0][2])
    cut = generator.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY, eot_id=eot)
    for f, c in zip(full, cut):
        stop = int(np.argmax(f == eot)) if (f == eot).any() else len(f)
        np.testing.assert_array_equal(c, f[:stop])
    assert len(cut[0]) <= 2


def test_generate_errors(generator):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generator.generate(PROMPTS, max_new_tokens=CACHE, sampling=GREEDY)
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        generator.generate([np.array([1, 99])], max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token"):
        generator.generate([np.array([], np.int32)], max_new_tokens=2)
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            Sampling(**bad)


# ------------------------------------------------------------------------------------------------- sampling rules
LOGITS = np.log(np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.06, 0.04, 0.02, 0.01], np.float64))
N_DRAWS = 20000


def _draws(sampling: Sampling, vocab_limit: int = 9, seed: int = 0) -> np.ndarray:
    logits = jnp.asarray(np.broadcast_to(LOGITS, (N_DRAWS, LOGITS.size)), jnp.float32)
    return np.asarray(jax.jit(sample_logits, static_argnums=(2, 3))(logits, jax.random.key(seed), sampling,
                                                                     vocab_limit))


def _expected(logits: np.ndarray, allowed: np.ndarray, temperature: float) -> np.ndarray:
    p = np.where(allowed, np.exp(logits / temperature), 0.0)
    return p / p.sum()


@pytest.mark.parametrize("sampling,allowed", [
    (Sampling(temperature=1.0, top_k=3), np.arange(9) < 3),
    # nucleus of 0.6 at temperature 1: 0.30 + 0.20 = 0.50 < 0.6, so the third token is needed, the fourth is not
    (Sampling(temperature=1.0, top_p=0.6), np.arange(9) < 3),
    # top-k 5, then top-p 0.9 of the renormalised five (0.30 .. 0.10 / 0.87): 0.3448+0.2299+0.1724 = 0.747 < 0.9,
    # +0.1379 = 0.885 < 0.9, so the fifth (0.1149) is needed too: all five stay
    (Sampling(temperature=1.0, top_k=5, top_p=0.9), np.arange(9) < 5),
    (Sampling(temperature=0.5), np.ones(9, bool)),
    (Sampling(temperature=2.0, top_p=0.5), None),  # allowed set computed below from the flattened distribution
])
def test_sampling_draws_only_allowed_tokens_with_the_right_frequencies(sampling, allowed):
    if allowed is None:  # at T=2 the probabilities flatten: the nucleus of 0.5 is found in float64
        p = _expected(LOGITS, np.ones(9, bool), sampling.temperature)
        allowed = (np.cumsum(p) - p) < sampling.top_p
    draws = _draws(sampling)
    assert set(np.unique(draws)) <= set(np.flatnonzero(allowed))
    freq = np.bincount(draws, minlength=9) / N_DRAWS
    np.testing.assert_allclose(freq, _expected(LOGITS, allowed, sampling.temperature), atol=0.015)


def test_sampling_vocab_limit_and_greedy():
    # The most likely tokens are ids 0..: a limit of 4 leaves only 0..3 even at a high temperature.
    draws = _draws(Sampling(temperature=3.0), vocab_limit=4)
    assert draws.max() <= 3 and len(np.unique(draws)) == 4
    # Greedy takes the argmax among the allowed ids: reversing the logits puts the best one above the limit.
    rev = jnp.asarray(LOGITS[::-1][None], jnp.float32)
    assert int(sample_logits(rev, jax.random.key(0), Sampling(temperature=0), 9)[0]) == 8
    assert int(sample_logits(rev, jax.random.key(0), Sampling(temperature=0), 6)[0]) == 5


def test_sampling_seed_reproduces():
    s = Sampling(temperature=0.7, top_k=4, top_p=0.8)
    np.testing.assert_array_equal(_draws(s, seed=5), _draws(s, seed=5))
    assert (_draws(s, seed=5) != _draws(s, seed=6)).any()


# ---------------------------------------------- token ids (a trained run and sample.py: test_run.py, on its 2-seed run)
def test_parse_token_ids():
    parse_ids = generate.parse_token_ids
    np.testing.assert_array_equal(parse_ids("1, 2,3", 10), [1, 2, 3])
    with pytest.raises(ValueError, match="token id 10 is outside the tokenizer's vocabulary 0..9"):
        parse_ids("1,10", 10)
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_ids("1;2", 10)
    with pytest.raises(ValueError, match="at least one"):
        parse_ids(" ", 10)


def test_sampling_cutoffs_on_a_wide_vocabulary():
    """Top-k and top-p sets on random logits over 3000 ids (negative and positive values), against numpy's sort."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (4, 3000)).astype(np.float32)
    reps = np.repeat(logits, 500, axis=0)  # 500 draws per row
    for sampling in (Sampling(temperature=1.0, top_k=7), Sampling(temperature=4.0, top_p=0.5)):
        draws = np.asarray(jax.jit(sample_logits, static_argnums=(2, 3))(
            jnp.asarray(reps), jax.random.key(1), sampling, 3000)).reshape(4, 500)
        for row in range(4):
            order = np.argsort(-logits[row].astype(np.float64))
            if sampling.top_k:
                allowed = order[:7]
            else:
                p = np.exp((logits[row] - logits[row].max()) / 4.0)
                p = p[order] / p.sum()
                allowed = order[:int(np.sum(np.cumsum(p) - p < 0.5))]
            assert set(draws[row]) <= set(allowed), (sampling, row)
            assert len(allowed) > 1 and len(set(draws[row])) > 1  # a real choice, not a degenerate argmax
