"""Tests for the MQAR port (specs/mqar.md): golden fixtures, §3 invariants, fillers, seeds, batching, metric."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coupled_qk_jax.data import mqar
from coupled_qk_jax.data.mqar import (
    IGNORE_INDEX,
    LEVELS,
    MQARAccuracy,
    MQARMix,
    MQARSegment,
    make_batches,
    make_segments,
    multiquery_ar,
    per_example_accuracy,
    segment_seeds,
)

# ---------------------------------------------------------------------------------------------------------------
# Golden fixtures (spec §9): V = 32, L = 16, N = 2, seed 0, power_a 0.01, one pass, fillers off.
# ---------------------------------------------------------------------------------------------------------------

FIXTURE_KW = dict(vocab_size=32, input_seq_len=16, seed=0, power_a=0.01, num_kv_pairs=2, random_non_queries=False)


def _labels_from(n_rows: int, entries: dict[int, dict[int, int]], L: int = 16) -> np.ndarray:
    lab = np.full((n_rows, L), -100)
    for r, pos in entries.items():
        for p, v in pos.items():
            lab[r, p] = v
    return lab


def test_golden_fixture_a():
    inputs, labels = multiquery_ar(num_examples=1, **FIXTURE_KW)
    np.testing.assert_array_equal(inputs, [[2, 18, 7, 30, 2, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0]])
    np.testing.assert_array_equal(labels, _labels_from(1, {0: {4: 18, 12: 30}}))


def test_golden_fixture_b():
    inputs, labels = multiquery_ar(num_examples=3, **FIXTURE_KW)
    np.testing.assert_array_equal(inputs, [
        [2, 29, 7, 22, 2, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [3, 21, 5, 16, 3, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [5, 17, 13, 18, 13, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0],
    ])
    np.testing.assert_array_equal(labels, _labels_from(3, {0: {4: 29, 6: 22}, 1: {4: 21, 6: 16}, 2: {4: 18, 8: 17}}))


def test_output_dtype_and_shape():
    inputs, labels = multiquery_ar(8192, 7, 64, seed=5, num_kv_pairs=4)
    assert inputs.shape == labels.shape == (7, 64)
    assert np.issubdtype(inputs.dtype, np.integer) and np.issubdtype(labels.dtype, np.integer)


# ---------------------------------------------------------------------------------------------------------------
# Draw-for-draw reference: a literal transcription of spec §3, one example at a time with Python lists.
# ---------------------------------------------------------------------------------------------------------------


def _reference_mqar(V, n, L, N, seed, a=0.01, P=1):
    rs = np.random.RandomState(seed)
    keys = [rs.choice(np.arange(1, V // 2), N, replace=False) for _ in range(n)]
    vals = [rs.choice(np.arange(V // 2, V), N, replace=False) for _ in range(n)]
    C = 2 * N * P
    space = (L - C) // 2
    w = np.array([a * j ** (a - 1) for j in range(1, space + 1)])
    p = w / w.sum()
    gaps = [rs.choice(np.arange(space), N, replace=False, p=p) for _ in range(n)]
    all_in, all_lab = [], []
    for i in range(n):
        block = []
        for j in range(N):
            block += [int(keys[i][j]), int(vals[i][j])]
        seq = block * P + [0] * (L - C + 1)
        lab = [-100] * (L + 1)
        for j in range(N):
            seq[C + 2 * int(gaps[i][j])] = int(keys[i][j])
            lab[C + 2 * int(gaps[i][j]) + 1] = int(vals[i][j])
        all_in.append(seq[:L])
        all_lab.append(lab[1:])
    return np.array(all_in), np.array(all_lab)


@pytest.mark.parametrize("V,n,L,N,seed,P", [
    (8192, 5, 64, 4, 17, 1), (8192, 3, 128, 8, 2**31 + 5, 1), (300, 4, 64, 16, 3, 1), (8192, 3, 96, 8, 9, 2),
    (100, 6, 20, 3, 0, 2),
])
def test_matches_spec_transcription(V, n, L, N, seed, P):
    got = multiquery_ar(V, n, L, seed, num_kv_pairs=N, random_non_queries=False, num_passes=P)
    ref = _reference_mqar(V, n, L, N, seed, P=P)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])


# ---------------------------------------------------------------------------------------------------------------
# §3 invariants on random configurations
# ---------------------------------------------------------------------------------------------------------------


def _random_configs(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        P = int(rng.integers(1, 3))
        N = int(rng.integers(1, 9))
        L = 2 * int(rng.integers(N * (P + 1), N * (P + 1) + 40))
        V = int(rng.integers(L + 1, L + 500))
        n = int(rng.integers(1, 12))
        a = float(rng.choice([0.01, 0.5, 1.0]))
        yield V, n, L, N, P, a, int(rng.integers(0, 2**32))


@pytest.mark.parametrize("cfg", list(_random_configs(25)))
def test_invariants(cfg):
    V, n, L, N, P, a, seed = cfg
    inputs, labels = multiquery_ar(V, n, L, seed, power_a=a, num_kv_pairs=N, random_non_queries=False,
                                   num_passes=P)
    C = 2 * N * P
    for i in range(n):
        x, y = inputs[i], labels[i]
        keys, vals = x[0:2 * N:2], x[1:2 * N:2]
        # Token ranges and distinctness.
        assert np.all((keys >= 1) & (keys < V // 2)) and np.all((vals >= V // 2) & (vals < V))
        assert len(set(keys.tolist())) == N and len(set(vals.tolist())) == N
        # The KV block is tiled P times and carries no labels.
        for r in range(P):
            np.testing.assert_array_equal(x[r * 2 * N:(r + 1) * 2 * N], x[:2 * N])
        assert np.all(y[:C] == IGNORE_INDEX)
        # Exactly N labels, all at even offsets of the query region, where the input is the queried key.
        pos = np.flatnonzero(y != IGNORE_INDEX)
        assert len(pos) == N
        assert np.all(pos >= C) and np.all((pos - C) % 2 == 0)
        pair = dict(zip(keys.tolist(), vals.tolist()))
        queried = x[pos].tolist()
        assert sorted(queried) == sorted(keys.tolist())  # every key queried exactly once
        for p_ in pos:
            assert y[p_] == pair[int(x[p_])]  # the label is the value paired with the queried key
        # Everything in the query region other than the queries is blank.
        blank = np.ones(L, dtype=bool)
        blank[:C] = False
        blank[pos] = False
        assert np.all(x[blank] == 0)


def test_gap_distribution_formula_and_uniform_limit():
    p = mqar.gap_distribution(6, 0.01)
    w = np.array([0.01 * j ** (0.01 - 1) for j in range(1, 7)])
    np.testing.assert_allclose(p, w / w.sum(), rtol=1e-12)
    np.testing.assert_allclose(mqar.gap_distribution(5, 1.0), np.full(5, 0.2))


def test_gap_frequencies_match_sampling_without_replacement():
    # P(slot 0 is one of the N = 2 gaps) for sequential sampling without replacement from p is
    # p0 + sum_{k != 0} p_k * p0 / (1 - p_k); compare with the empirical frequency over many examples.
    L, N, n = 64, 2, 4000
    C = 2 * N
    space = (L - C) // 2
    for a in (0.01, 1.0):
        _, lab = multiquery_ar(8192, n, L, 1, power_a=a, num_kv_pairs=N, random_non_queries=False)
        empirical = float(np.mean(lab[:, C] != IGNORE_INDEX))
        w = np.arange(1, space + 1, dtype=np.float64) ** (a - 1)
        p = w / w.sum()
        exact = p[0] + sum(p[k] * p[0] / (1 - p[k]) for k in range(1, space))
        assert empirical == pytest.approx(exact, abs=4 * np.sqrt(exact * (1 - exact) / n))
    # The steep law really does favour early slots over the uniform one.
    _, steep = multiquery_ar(8192, n, L, 1, power_a=0.01, num_kv_pairs=N, random_non_queries=False)
    _, flat = multiquery_ar(8192, n, L, 1, power_a=1.0, num_kv_pairs=N, random_non_queries=False)
    assert np.mean(steep[:, C] != IGNORE_INDEX) > 2 * np.mean(flat[:, C] != IGNORE_INDEX)


# ---------------------------------------------------------------------------------------------------------------
# Fillers (spec §4 port)
# ---------------------------------------------------------------------------------------------------------------


def test_fillers_follow_default_rng_and_keep_structure():
    V, n, L, N, seed = 512, 9, 64, 4, 77
    plain_x, plain_y = multiquery_ar(V, n, L, seed, num_kv_pairs=N, random_non_queries=False)
    fill_x, fill_y = multiquery_ar(V, n, L, seed, num_kv_pairs=N, random_non_queries=True)
    np.testing.assert_array_equal(fill_y, plain_y)  # labels never change
    structure = plain_x != 0
    np.testing.assert_array_equal(fill_x[structure], plain_x[structure])
    expected = np.random.default_rng(seed).integers(0, V, size=(n, L))
    np.testing.assert_array_equal(fill_x[~structure], expected[~structure])
    assert fill_x.min() >= 0 and fill_x.max() < V


def test_fillers_deterministic_and_seed_dependent():
    a = multiquery_ar(8192, 5, 128, 3, num_kv_pairs=8)
    b = multiquery_ar(8192, 5, 128, 3, num_kv_pairs=8)
    c = multiquery_ar(8192, 5, 128, 4, num_kv_pairs=8)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    # Fillers replace (almost) every blank: with V = 8192 a 0 survives with probability 1/8192 per blank.
    blanks = multiquery_ar(8192, 5, 128, 3, num_kv_pairs=8, random_non_queries=False)[0] == 0
    assert np.mean(a[0][blanks] == 0) < 0.01


def test_default_global_rng_untouched():
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    multiquery_ar(64, 3, 16, 1, num_kv_pairs=2)
    segment_seeds(3, 3)
    np.testing.assert_array_equal(np.random.get_state()[1], before)


# ---------------------------------------------------------------------------------------------------------------
# Constraint errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,field", [
    (dict(input_seq_len=63), "input_seq_len"),
    (dict(vocab_size=64), "vocab_size"),
    (dict(num_kv_pairs=17), "num_kv_pairs"),
    (dict(num_kv_pairs=11, num_passes=2), "num_kv_pairs"),
    (dict(num_examples=0), "num_examples"),
    (dict(power_a=0.0), "power_a"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**32), "seed"),
    (dict(num_kv_pairs=2.0), "num_kv_pairs"),
    (dict(num_passes=0), "num_passes"),
])
def test_constraint_errors(kwargs, field):
    base = dict(vocab_size=8192, num_examples=2, input_seq_len=64, seed=0, num_kv_pairs=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field) as exc:
        multiquery_ar(**base)
    assert "\n" not in str(exc.value)


def test_boundary_config_is_accepted():
    # 2·N·P + 2·N == L exactly (density-maximal): space == N, so every query slot is used.
    inputs, labels = multiquery_ar(8192, 4, 64, 0, num_kv_pairs=16, random_non_queries=False)
    assert np.all((labels != IGNORE_INDEX).sum(1) == 16)
    assert np.all(labels[:, 32::2] != IGNORE_INDEX)


# ---------------------------------------------------------------------------------------------------------------
# Seeds and segments (spec §5)
# ---------------------------------------------------------------------------------------------------------------


def test_segment_seeds_match_global_rng_derivation():
    state = np.random.get_state()
    try:
        np.random.seed(123)
        ref_train = np.random.randint(0, 2**31, size=5)
        ref_test = np.random.randint(2**31, 2**32, size=7)
    finally:
        np.random.set_state(state)
    train, test = segment_seeds(5, 7)
    assert train == ref_train.tolist() and test == ref_test.tolist()
    assert all(0 <= s < 2**31 for s in train) and all(2**31 <= s < 2**32 for s in test)
    assert not set(train) & set(test)


def test_make_segments_assigns_seeds_in_order():
    train_specs = [(64, 4, 10), (128, 8, 5)]
    test_specs = [(64, 4, 3), (64, 8, 3), (64, 16, 3)]
    train, test = make_segments(train_specs, test_specs, vocab_size=8192, fillers=False)
    tr_seeds, te_seeds = segment_seeds(2, 3)
    assert [s.seed for s in train] == tr_seeds and [s.seed for s in test] == te_seeds
    assert [(s.L, s.N, s.num_examples) for s in train] == train_specs
    x, y = test[2].generate()
    ref = multiquery_ar(8192, 3, 64, te_seeds[2], num_kv_pairs=16, random_non_queries=False)
    np.testing.assert_array_equal(x, ref[0])
    np.testing.assert_array_equal(y, ref[1])


def test_segment_validates_on_construction():
    with pytest.raises(ValueError, match="input_seq_len"):
        MQARSegment(L=63, N=4, num_examples=3, seed=0)
    with pytest.raises(ValueError, match="train\\[0\\]"):
        make_segments([(64, 4)], [])


# Zoology's standard sweep (experiments/mqar_example_configs/original_mqar_configs.py), spec §6: a mix of several
# segments per split.
ZOOLOGY_TRAIN = ((64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000), (256, 64, 20_000))
ZOOLOGY_TEST = ((64, 4, 1_000), (64, 8, 1_000), (64, 16, 1_000), (128, 32, 1_000), (256, 64, 1_000),
                (512, 128, 1_000), (1024, 256, 1_000))


def test_levels_and_mixes():
    assert set(LEVELS) == {"easy", "medium", "hard"}
    assert [(lv.seq_len, lv.num_kv_pairs) for lv in LEVELS.values()] == [(64, 4), (128, 8), (256, 16)]
    for name, level in LEVELS.items():
        mix = level.mix()
        train, test = mix.segments()
        assert (train[0].L, train[0].N, train[0].num_examples) == (level.seq_len, level.num_kv_pairs, level.num_train)
        assert test[0].num_examples == level.num_test and not train[0].fillers
        small = MQARSegment(L=level.seq_len, N=level.num_kv_pairs, num_examples=2, seed=1,
                            vocab_size=level.vocab_size)
        assert small.generate()[0].shape == (2, level.seq_len)
    std = MQARMix("zoology_standard", ZOOLOGY_TRAIN, ZOOLOGY_TEST)  # zoology's defaults: V 8192, fillers on
    assert std.fillers and std.vocab_size == 8192 and std.max_seq_len == 1024
    train, test = std.segments()  # every segment satisfies the constraints (MQARSegment validates on construction)
    assert [(s.L, s.N, s.num_examples) for s in train] == list(ZOOLOGY_TRAIN)
    assert [(s.L, s.N) for s in test] == [t[:2] for t in ZOOLOGY_TEST]
    assert len({s.seed for s in train + test}) == len(train) + len(test)  # one seed per segment


# ---------------------------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------------------------


def test_batches_are_contiguous_single_segment_and_padded():
    seg_a = MQARSegment(L=16, N=2, num_examples=5, seed=1, fillers=False, vocab_size=64)
    seg_b = MQARSegment(L=32, N=4, num_examples=4, seed=2, fillers=True, vocab_size=64)
    batches = make_batches([seg_a, seg_b], batch_size=2, pad_to=32)
    assert len(batches) == 3 + 2
    xa, ya = seg_a.generate()
    xb, yb = seg_b.generate()
    for b in batches:
        assert b["inputs"].shape == b["labels"].shape == (2, 32) and b["mask"].shape == (2,)
    # Segment a: right padded with token 0 / label −100; rows in stored order.
    np.testing.assert_array_equal(batches[0]["inputs"][:, :16], xa[0:2])
    np.testing.assert_array_equal(batches[1]["labels"][:, :16], ya[2:4])
    assert np.all(batches[0]["inputs"][:, 16:] == 0) and np.all(batches[0]["labels"][:, 16:] == IGNORE_INDEX)
    # Partial last batch of a: one real row, one all-−100 padding row.
    last = batches[2]
    np.testing.assert_array_equal(last["mask"], [True, False])
    np.testing.assert_array_equal(last["inputs"][0, :16], xa[4])
    assert np.all(last["labels"][1] == IGNORE_INDEX) and np.all(last["inputs"][1] == 0)
    np.testing.assert_array_equal(last["num_kv_pairs"], [2, 0])
    # Segment b needs no padding.
    np.testing.assert_array_equal(np.concatenate([batches[3]["inputs"], batches[4]["inputs"]]), xb)
    np.testing.assert_array_equal(batches[4]["num_kv_pairs"], [4, 4])
    # answer_positions: each row's labelled positions in increasing order (hand-found with np.nonzero); the
    # padding row gets 0..N-1, all labelled -100.
    for b in batches:
        for row, labels in enumerate(b["labels"]):
            want = np.nonzero(labels != IGNORE_INDEX)[0] if b["mask"][row] else np.arange(b["answer_positions"].shape[1])
            np.testing.assert_array_equal(b["answer_positions"][row], want)
    assert batches[0]["answer_positions"].shape == (2, 2) and batches[3]["answer_positions"].shape == (2, 4)
    assert np.all(np.take_along_axis(last["labels"], last["answer_positions"], axis=1)[1] == IGNORE_INDEX)


def test_batches_without_padding_and_errors():
    seg = MQARSegment(L=16, N=2, num_examples=5, seed=1, vocab_size=64)
    batches = make_batches([seg], batch_size=2, pad_last=False)
    assert [b["inputs"].shape for b in batches] == [(2, 16), (2, 16), (1, 16)]
    # Pre-generated pairs work too; N is inferred from the label count.
    x, y = seg.generate()
    again = make_batches([(x, y)], batch_size=4)
    np.testing.assert_array_equal(again[0]["num_kv_pairs"], [2, 2, 2, 2])
    with pytest.raises(ValueError, match="pad_to"):
        make_batches([seg], batch_size=2, pad_to=8)
    # A row whose label count is not N would lose answers to the fixed-width answer_positions: refused.
    y_bad = y.copy()
    y_bad[1, np.nonzero(y_bad[1] != IGNORE_INDEX)[0][0]] = IGNORE_INDEX
    with pytest.raises(ValueError, match="every MQAR row must have 2 labels"):
        mqar.pad_batch(x[:2], y_bad[:2], 2, 16, 2)
    with pytest.raises(ValueError, match="batch_size"):
        make_batches([seg], batch_size=0)


def test_training_replays_the_batches_in_order_every_epoch():
    """The MQAR task's training dataset with mqar.shuffle off (zoology's order): batch i of every epoch is stored
    batch i, for any seed, with the labels as the targets. (The default, seeded order: test_mqar_train.py.)"""
    from coupled_qk_jax.configs import mqar as mqar_config
    from coupled_qk_jax.training.config import RunConfig
    from coupled_qk_jax.training.tasks import MQARTask

    cfg = mqar_config.get_config("standard,easy")
    cfg.mqar.update(num_train=96, num_test=8, num_valid=8, shuffle=False)
    cfg.train.batch_size = 32
    task = MQARTask(RunConfig.from_configdict(cfg), batch_devices=1)
    assert len(task.train) == 3
    for seed in (0, 5):
        ds = task.train_dataset(seed)
        for i in range(7):
            np.testing.assert_array_equal(ds[i]["inputs"], task.train[i % 3]["inputs"])
            np.testing.assert_array_equal(ds[i]["targets"], task.train[i % 3]["labels"])


# ---------------------------------------------------------------------------------------------------------------
# Metric (spec §8)
# ---------------------------------------------------------------------------------------------------------------


def mqar_accuracy(x, labels) -> dict[str, float]:
    """The metric of one array of examples."""
    meter = MQARAccuracy()
    meter.update(x, labels)
    return meter.compute()


def _one_hot_logits(preds: np.ndarray, V: int) -> np.ndarray:
    logits = np.full(preds.shape + (V,), -1.0, dtype=np.float32)
    np.put_along_axis(logits, preds[..., None], 2.0, axis=-1)
    return logits


def test_metric_on_hand_made_logits_with_padding_rows():
    V, T = 10, 6
    labels = np.full((4, T), -100)
    labels[0, [1, 3]] = [5, 6]          # N = 2, one of two right -> 0.5
    labels[1, [0, 2, 4, 5]] = [1, 2, 3, 4]  # N = 4, all right -> 1.0
    labels[2, [1, 3]] = [7, 8]          # N = 2, none right -> 0.0
    # row 3: all −100 (batch padding), must be ignored even though predictions are arbitrary.
    preds = np.zeros((4, T), dtype=np.int64)
    preds[0, [1, 3]] = [5, 0]
    preds[1, [0, 2, 4, 5]] = [1, 2, 3, 4]
    preds[2, [1, 3]] = [0, 0]
    preds[1, 1] = 9  # wrong prediction at an unlabelled position must not count
    logits = _one_hot_logits(preds, V)
    # Example-weighted pooled mean: (0.5 + 1 + 0) / 3, not the token mean 5/8.
    expected = {
        "valid/accuracy": 0.5,
        "valid/num_kv_pairs/accuracy-2": 0.25,
        "valid/num_kv_pairs/accuracy-4": 1.0,
    }
    for x in (logits, preds):
        got = mqar_accuracy(x, labels)
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            assert got[k] == pytest.approx(v)
    acc, count = per_example_accuracy(logits, labels)
    np.testing.assert_allclose(np.asarray(acc), [0.5, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(count), [2, 4, 2, 0])
    json.dumps(mqar_accuracy(logits, labels))  # Python floats only


def test_metric_pools_over_batches_with_explicit_slices():
    rng = np.random.default_rng(0)
    meter = MQARAccuracy()
    all_acc, all_n = [], []
    for N, L in ((2, 16), (4, 32), (2, 16)):
        _, labels = multiquery_ar(64, 5, L, int(rng.integers(100)), num_kv_pairs=N, random_non_queries=False)
        preds = np.where(rng.random(labels.shape) < 0.6, labels, 1)
        batch = make_batches([(np.zeros_like(labels), labels)], batch_size=4)  # 4 + (1 real + 3 padding)
        pred_batches = make_batches([(preds, labels)], batch_size=4)
        for b, pb in zip(batch, pred_batches):
            meter.update(pb["inputs"], b["labels"], b["num_kv_pairs"])
        lab = labels != -100
        all_acc += list(((preds == labels) & lab).sum(1) / lab.sum(1))
        all_n += [N] * 5
    out = meter.compute()
    all_acc, all_n = np.array(all_acc), np.array(all_n)
    assert meter.num_examples == 15
    assert out["valid/accuracy"] == pytest.approx(all_acc.mean())
    assert out["valid/num_kv_pairs/accuracy-2"] == pytest.approx(all_acc[all_n == 2].mean())
    assert out["valid/num_kv_pairs/accuracy-4"] == pytest.approx(all_acc[all_n == 4].mean())


def test_metric_errors_and_empty():
    labels = np.full((2, 4), -100)
    with pytest.raises(ValueError, match="logits_or_predictions"):
        mqar_accuracy(np.zeros((2, 4), dtype=np.float32), labels)
    with pytest.raises(ValueError, match="shape"):
        mqar_accuracy(np.zeros((2, 5), dtype=np.int32), labels)
    assert np.isnan(mqar_accuracy(np.zeros((2, 4), dtype=np.int32), labels)["valid/accuracy"])


@pytest.mark.parametrize("name", sorted(mqar.LEVELS))
def test_validation_split_shares_no_example_with_train_or_test(name):
    """The validation segment (its own seed draw, after zoology's train and test draws) is disjoint from train and
    test by content, on the levels the runs use. The reference is a plain set of row tuples."""
    level = mqar.LEVELS[name]
    mix = level.mix()
    (train,), (test,) = mix.segments()
    (valid,) = mix.validation_segments()
    train_seeds, test_seeds = mqar.segment_seeds(1, 1)
    assert (train.seed, test.seed) == (train_seeds[0], test_seeds[0])  # zoology's seeds are unchanged
    assert 2**31 <= valid.seed < 2**32 and valid.seed not in (train.seed, test.seed)
    assert valid.num_examples == level.num_valid == 1_000
    data = {k: seg.generate() for k, seg in (("train", train), ("valid", valid), ("test", test))}

    def rows(split):
        x, y = data[split]
        return {tuple(a) + tuple(b) for a, b in zip(x.tolist(), y.tolist())}

    assert not rows("valid") & rows("train") and not rows("valid") & rows("test")
    assert mqar.overlapping_rows(data["valid"], data["train"]).size == 0
    assert mqar.overlapping_rows(data["valid"], data["test"]).size == 0
    # positive control: validation rows 3, 7 and 11 copied into the training set are found, and only those
    x, y = data["train"]
    planted = (np.concatenate([x, data["valid"][0][[3, 7, 11]]]), np.concatenate([y, data["valid"][1][[3, 7, 11]]]))
    assert mqar.overlapping_rows(data["valid"], planted).tolist() == [3, 7, 11]


def test_validation_seeds_skip_train_and_test_seeds(monkeypatch):
    """A draw equal to a train or test seed is drawn again (forced here by a RandomState whose held-out draws
    repeat the test seed first)."""
    train, test = mqar.segment_seeds(2, 3)
    seeds = mqar.validation_seeds(2, 3, 4)
    assert len(set(seeds)) == 4 and not set(seeds) & set(train + test)
    real = np.random.RandomState

    class Repeating(real):
        calls = 0

        def randint(self, low, high=None, size=None):
            if size is None:  # a validation draw: the first one repeats a test seed
                Repeating.calls += 1
                if Repeating.calls == 1:
                    return test[0]
            return super().randint(low, high, size)

    monkeypatch.setattr(np.random, "RandomState", Repeating)
    forced = mqar.validation_seeds(2, 3, 1)
    assert forced[0] != test[0] and Repeating.calls == 2
