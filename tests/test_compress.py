"""jaxfog.compress: each compressor's claims (unbiasedness, contraction,
variance, payload bytes) checked over many keys, grouping and MergeComp's search."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog.compress as C

pytestmark = pytest.mark.numerical

jax.config.update("jax_enable_x64", True)

KEYS = 4000


def _samples(compressor, x, keys=KEYS):
    """C(x) for ``keys`` keys, stacked."""
    keys = jax.random.split(jax.random.PRNGKey(7), keys)
    return np.asarray(jax.jit(jax.vmap(lambda k: compressor.decompress(
        compressor.compress(x, k))))(keys))


def _x(d=60, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(d))


ALL = [C.identity(), C.top_k(0.1), C.top_k(1.0), C.rand_k(0.1), C.rand_k(0.25, unbiased=True),
       C.qsgd(1), C.qsgd(7), C.qsgd(7, unbiased=False), C.qsgd(300), C.qsgd(3, bucket=16),
       C.qsgd(3, unbiased=False, bucket=16), C.sign()]


def test_identity_round_trip_is_exact():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4, 5)))
    c = C.identity()
    np.testing.assert_array_equal(c.decompress(c.compress(x, jax.random.PRNGKey(0))), x)


@pytest.mark.parametrize("compressor", [c for c in ALL if c.unbiased], ids=lambda c: c.name)
def test_unbiased_compressors_average_to_x_over_keys(compressor):
    x = _x()
    samples = _samples(compressor, x)
    spread = samples.std(0) / math.sqrt(len(samples))
    assert np.all(np.abs(samples.mean(0) - x) <= 5 * spread + 1e-12), compressor.name
    if compressor.name.startswith("qsgd"):  # bfloat16 too: quantized in float32
        narrow = x.astype(jnp.bfloat16)
        samples = _samples(compressor, narrow).astype(np.float64)
        spread = samples.std(0) / math.sqrt(len(samples))
        target = np.asarray(narrow.astype(jnp.float64))
        # bfloat16 rounds each decompressed value (relative 2^-8): within that too.
        assert np.all(np.abs(samples.mean(0) - target) <= 5 * spread + 4e-3 * np.abs(target)
                      + 1e-3), compressor.name
    # and the variance bound omega
    error = np.mean(np.sum((samples - np.asarray(x)) ** 2, axis=1))
    assert error <= compressor.omega(x.size) * float(jnp.sum(x ** 2)) * 1.05 + 1e-12


@pytest.mark.parametrize("compressor", [c for c in ALL if c.delta(60) is not None],
                         ids=lambda c: c.name)
def test_contraction_bound_holds_with_the_claimed_delta(compressor):
    for seed in range(3):
        x = _x(seed=seed)
        samples = _samples(compressor, x, 1000)
        error = np.mean(np.sum((samples - np.asarray(x)) ** 2, axis=1))
        bound = (1 - compressor.delta(x.size)) * float(jnp.sum(x ** 2))
        assert error <= bound * 1.02, (compressor.name, error, bound)


def test_biased_forms_are_biased_and_scaled_sign_is_exact():
    x = _x()
    np.testing.assert_allclose(_samples(C.rand_k(0.1), x).mean(0), 6 / 60 * np.asarray(x),
                               atol=0.05)
    s = C.sign()
    got = np.asarray(s.decompress(s.compress(x, jax.random.PRNGKey(0))))
    l1, l2 = float(jnp.abs(x).sum()), float(jnp.sum(x ** 2))
    np.testing.assert_allclose(np.sum((got - np.asarray(x)) ** 2), l2 - l1 ** 2 / x.size,
                               rtol=1e-12)
    np.testing.assert_allclose(got, l1 / x.size * np.where(np.asarray(x) >= 0, 1, -1))


def test_top_k_keeps_the_largest_entries():
    x = jnp.asarray([0.1, -5.0, 3.0, 0.0, -0.2, 4.0])
    c = C.top_k(0.5)
    np.testing.assert_array_equal(c.decompress(c.compress(x, None)), [0, -5, 3, 0, 0, 4])


@pytest.mark.parametrize("d", [7, 256, 257, 65536, 65537])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_payload_bytes_are_what_the_docstrings_say(d, dtype):
    size = np.dtype(dtype).itemsize
    x = jnp.zeros(d, dtype)
    index = 1 if d <= 256 else 2 if d <= 65536 else 4
    k = math.ceil(0.01 * d)
    expected = {
        C.identity(): d * size,
        C.top_k(0.01): k * (size + index),
        C.rand_k(0.01): k * size + 8,
        C.qsgd(7): math.ceil(d * 4 / 8) + max(size, 4),
        C.qsgd(1): math.ceil(d * 2 / 8) + max(size, 4),
        C.qsgd(127): d + max(size, 4),
        C.qsgd(128): 2 * d + max(size, 4),
        C.qsgd(7, bucket=128): math.ceil(d * 4 / 8) + math.ceil(d / 128) * max(size, 4),
        C.sign(): math.ceil(d / 8) + size,
    }
    for compressor, nbytes in expected.items():
        assert compressor.bytes(x) == nbytes, compressor.name
        if d == 257:  # and a real payload (compiling each size would be slow)
            payload = compressor.compress(x + 1, jax.random.PRNGKey(0))
            assert payload.nbytes == nbytes, compressor.name
    m = jnp.zeros((40, 3, 5), dtype)
    assert C.low_rank(4).bytes(m) == (40 + 15) * 4 * size
    assert C.low_rank(100).bytes(m) == (40 + 15) * 15 * size  # rank capped at min(m, n)


def test_low_rank_warm_start_converges_to_the_best_approximation():
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((30, 30)))
    v, _ = np.linalg.qr(rng.standard_normal((20, 20)))
    spectrum = np.r_[10.0, 8.0, 1.0, 0.5, np.full(16, 0.1)]
    m = jnp.asarray(u[:, :20] * spectrum @ v.T)
    c = C.low_rank(2)
    best = float(np.sum(spectrum[2:] ** 2))
    key = jax.random.PRNGKey(0)
    payload = c.compress(m, key)
    cold = float(jnp.sum((c.decompress(payload) - m) ** 2))
    for _ in range(30):
        payload = c.compress(m, key, payload)
    warm = float(jnp.sum((c.decompress(payload) - m) ** 2))
    assert warm <= cold and warm == pytest.approx(best, rel=1e-9)
    # Cold starts: on an orthogonal matrix (a flat spectrum, the worst case)
    # every draw leaves exactly (1 - r / columns) of the energy.
    flat = jnp.asarray(v)
    samples = _samples(c, flat, 50).reshape(50, -1)
    error = np.sum((samples - np.asarray(flat).reshape(-1)) ** 2, axis=1)
    np.testing.assert_allclose(error, (1 - 2 / 20) * 20, rtol=1e-9)
    # Vectors: an error, or the compressor given for them.
    with pytest.raises(ValueError, match="compresses matrices"):
        c.compress(jnp.ones(5), key)
    mixed = C.low_rank(2, vectors=C.identity())
    np.testing.assert_array_equal(mixed.decompress(mixed.compress(jnp.ones(5), key)), 1.0)


def test_bad_input_is_a_clear_error():
    for make in (C.top_k, C.rand_k):  # a wrong type is a TypeError, a wrong value a ValueError
        for ratio in (0, -0.1, 1.5):
            with pytest.raises(ValueError, match=r"ratio must be in \(0.0, 1.0\]"):
                make(ratio)
        for ratio in (True, "0.1"):
            with pytest.raises(TypeError, match="ratio must be a number"):
                make(ratio)
    for levels in (0, -3):
        with pytest.raises(ValueError, match="levels must be >= 1"):
            C.qsgd(levels)
    with pytest.raises(ValueError, match=r"levels must be in \[1, 32767\]"):
        C.qsgd(40000)
    with pytest.raises(TypeError, match="levels must be an int"):
        C.qsgd(1.5)
    with pytest.raises(ValueError, match="bucket must be >= 1"):
        C.qsgd(7, bucket=0)
    with pytest.raises(ValueError, match="max_groups must be >= 1"):
        C.search(C.sign(), [jnp.ones(3)], lambda g: 1.0, max_groups=0)
    with pytest.raises(ValueError, match="no leaves"):
        C.balanced({}, 1)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        C.low_rank(0)
    with pytest.raises(TypeError, match="real floating"):
        C.top_k(0.5).compress(jnp.arange(4), jax.random.PRNGKey(0))


def test_groups_merge_split_and_checks():
    tree = {"a": jnp.ones((3, 4)), "b": jnp.arange(5.0), "c": jnp.full((2, 2, 2), 2.0)}
    assert C.per_leaf(tree) == ((0, 1), (1, 2), (2, 3))
    assert C.balanced(tree, 1) == ((0, 3),)
    for y in (1, 2, 3):
        groups = C.balanced(tree, y)
        assert len(groups) == y and groups[0][0] == 0 and groups[-1][1] == 3
        back = C.split(C.merge(tree, groups), tree, groups)
        jax.tree.map(np.testing.assert_array_equal, back, tree)
        payloads = C.compress_tree(C.identity(), tree, jax.random.PRNGKey(0), groups)
        jax.tree.map(np.testing.assert_array_equal,
                     C.decompress_tree(C.identity(), payloads, tree, groups), tree)
    assert C.tree_bytes(C.sign(), tree, ((0, 3),)) == math.ceil(25 / 8) + 8
    with pytest.raises(ValueError, match="contiguous"):
        C.check_groups(C.sign(), tree, ((0, 1), (2, 3)))
    with pytest.raises(ValueError, match="cannot merge"):
        C.check_groups(C.low_rank(1), tree, ((0, 3),))
    with pytest.raises(ValueError, match="mixes dtypes"):
        C.check_groups(C.sign(), {"a": jnp.ones(2, jnp.float32), "b": jnp.ones(2)}, ((0, 2),))
    with pytest.raises(ValueError, match="y must be in"):
        C.balanced(tree, 4)


def test_search_follows_mergecomps_algorithm_2_and_caches():
    tree = [jnp.ones(10 * (i + 1)) for i in range(8)]
    calls = []

    def timer_from(costs):
        def timer(groups):
            calls.append(len(groups))
            return costs[len(groups)]
        return timer

    # Gains 4 then 0.1 (< alpha * 6): stops at y = 3 and keeps it.
    result = C.search(C.top_k(0.5), tree, timer_from({1: 10, 2: 6, 3: 5.9, 4: 1}), cache=False)
    assert len(result.groups) == 3 and [y for y, _ in result.timings] == [1, 2, 3]
    # y = 2 slower than y = 1: keeps one group.
    result = C.search(C.top_k(0.5), tree, timer_from({1: 1, 2: 2}), cache=False)
    assert result.groups == ((0, 8),)
    # Improving all the way: ends at y = number of leaves.
    improving = timer_from({y: 10 - y for y in range(1, 9)})
    result = C.search(C.sign(), tree, improving)
    assert result.groups == C.per_leaf(tree)
    calls.clear()
    assert C.search(C.sign(), tree, improving) == result and not calls  # cached
    assert C.search(C.sign(), tree, improving, max_groups=2).groups == C.balanced(tree, 2)
    assert C.search(C.low_rank(1), [jnp.ones((2, 2))]).groups == ((0, 1),)
    # The default timer (compression alone, outside MPI) gives a valid grouping.
    found = C.search(C.top_k(0.1), tree, max_groups=3, cache=False)
    C.check_groups(C.top_k(0.1), tree, found.groups)
    assert all(seconds > 0 for _, seconds in found.timings)
