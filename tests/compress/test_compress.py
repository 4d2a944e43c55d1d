"""jaxfog.compress: each compressor's claims (unbiasedness, contraction,
variance, payload bytes) checked over many keys, grouping and MergeComp's search."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog.compress as C

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("x64")]

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


# --- the compressors for outer gradients, against numpy models ----------------------------

def _np_chunks(flat: np.ndarray, chunk: int | None) -> np.ndarray:
    size = flat.size if chunk is None else chunk
    rows = -(-flat.size // size)
    return np.pad(flat, (0, rows * size - flat.size)).reshape(rows, size)


def _np_scales(rows: np.ndarray, top: float) -> np.ndarray:
    amax = np.abs(rows).max(axis=1).astype(np.float32)
    return np.where(amax > 0, amax * np.float32(1 / top), np.float32(1)).astype(np.float32)


def _np_float8(x: np.ndarray, format: str, chunk: int | None):
    """(codes as bytes, scales, decompressed) of float8, in numpy and ml_dtypes."""
    import ml_dtypes

    dtype, top = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
                  "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}[format]
    rows = _np_chunks(x.astype(np.float32), chunk)
    scales = _np_scales(rows, top)
    codes = np.clip(rows / scales[:, None], -top, top).astype(dtype)
    back = codes.astype(np.float32) * scales[:, None]
    return codes.view(np.uint8).reshape(-1)[:x.size], scales, back.reshape(-1)[:x.size]


def _np_quantize(x: np.ndarray, bits: int, chunk: int | None):
    """(codes in [0, 2L], scales, decompressed) of quantize."""
    levels = 2 ** (bits - 1) - 1
    rows = _np_chunks(x.astype(np.float32), chunk)
    scales = _np_scales(rows, levels)
    codes = np.clip(np.round(rows / scales[:, None]), -levels, levels)
    back = (codes * scales[:, None]).reshape(-1)[:x.size]
    return (codes.reshape(-1)[:x.size] + levels).astype(np.int64), scales, back


def _unpacked(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    """Codes from bytes, ``8 // bits`` a byte, the first in the low bits."""
    per = 8 // bits
    shifts = np.arange(per) * bits
    return ((packed.astype(np.int64)[:, None] >> shifts) & (2 ** bits - 1)).reshape(-1)[:d]


def _np_chunked_top_k(x: np.ndarray, ratio: float, chunk: int, bits: int | None):
    k = max(1, min(chunk, math.ceil(ratio * chunk)))
    rows = _np_chunks(x, chunk)
    keep = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :k]
    values = np.take_along_axis(rows, keep, axis=1)
    if bits is not None:
        levels = 2 ** (bits - 1) - 1
        scales = _np_scales(values.astype(np.float32), levels)
        values = np.clip(np.round(values.astype(np.float32) / scales[:, None]), -levels,
                         levels) * scales[:, None]
    out = np.zeros(rows.shape, np.float64)
    np.put_along_axis(out, keep, values, axis=1)
    return out.reshape(-1)[:x.size]


def _np_dct_top_k(x: np.ndarray, ratio: float, chunk: int):
    from scipy.fft import dct, idct

    k = max(1, min(chunk, math.ceil(ratio * chunk)))
    rows = _np_chunks(x.astype(np.float64), chunk)
    coefficients = dct(rows, type=2, norm="ortho", axis=1)
    keep = np.argsort(-np.abs(coefficients), axis=1, kind="stable")[:, :k]
    kept = np.zeros_like(coefficients)
    np.put_along_axis(kept, keep, np.take_along_axis(coefficients, keep, axis=1), axis=1)
    return idct(kept, type=2, norm="ortho", axis=1).reshape(-1)[:x.size]


def _x32(d: int, seed: int = 0) -> np.ndarray:
    """Entries spread over 5 decades, float32 (exact in every dtype tested)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 2, d)).astype(np.float32)


@pytest.mark.parametrize("chunk", [None, 64, 7])
@pytest.mark.parametrize("format", ["e4m3", "e5m2"])
def test_float8_sends_the_bits_of_the_numpy_model(format, chunk):
    x = _x32(300)
    compressor = C.float8(format, chunk=chunk)
    payload = compressor.compress(jnp.asarray(x), None)
    codes, scales, back = _np_float8(x, format, chunk)
    np.testing.assert_array_equal(np.asarray(payload.arrays[0]), codes)  # the bits on the wire
    np.testing.assert_array_equal(np.asarray(payload.arrays[1]), scales)
    np.testing.assert_array_equal(np.asarray(compressor.decompress(payload)), back)
    rows = _np_chunks(x, chunk)  # each chunk's largest entry comes back
    top = np.argmax(np.abs(rows), axis=1)
    got = _np_chunks(np.asarray(compressor.decompress(payload)), chunk)
    np.testing.assert_allclose(got[np.arange(len(rows)), top], rows[np.arange(len(rows)), top],
                               rtol=1e-6)


@pytest.mark.parametrize("chunk", [None, 32, 5])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_sends_the_codes_of_the_numpy_model(bits, chunk):
    x = _x32(301, seed=1)
    compressor = C.quantize(bits, chunk=chunk)
    payload = compressor.compress(jnp.asarray(x), None)
    codes, scales, back = _np_quantize(x, bits, chunk)
    np.testing.assert_array_equal(_unpacked(np.asarray(payload.arrays[0]), bits, x.size), codes)
    np.testing.assert_array_equal(np.asarray(payload.arrays[1]), scales)
    np.testing.assert_allclose(np.asarray(compressor.decompress(payload)), back, rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("bits", [None, 2, 8])
def test_chunked_top_k_keeps_each_chunks_largest_and_quantizes_them(bits):
    x = _x32(250, seed=2)
    compressor = C.chunked_top_k(0.05, chunk=64, bits=bits)
    got = np.asarray(compressor.decompress(compressor.compress(jnp.asarray(x), None)))
    np.testing.assert_allclose(got, _np_chunked_top_k(x, 0.05, 64, bits), rtol=1e-6, atol=0)
    assert np.count_nonzero(got) <= 4 * 4  # k = ceil(0.05 * 64) = 4 in each of 4 chunks


@pytest.mark.parametrize("chunk", [64, 16, 300])
def test_dct_top_k_is_scipys_dct_with_the_largest_coefficients(chunk):
    x = _x32(250, seed=3).astype(np.float64)
    compressor = C.dct_top_k(0.25, chunk=chunk)
    got = np.asarray(compressor.decompress(compressor.compress(jnp.asarray(x), None)))
    np.testing.assert_allclose(got, _np_dct_top_k(x, 0.25, chunk), rtol=1e-9, atol=1e-9)
    # Smooth chunks: a quarter of the coefficients carries nearly all of a sine.
    smooth = jnp.sin(jnp.linspace(0.0, 3.0, 256))
    c = C.dct_top_k(0.25, chunk=64)
    error = jnp.sum((c.decompress(c.compress(smooth, None)) - smooth) ** 2) / jnp.sum(smooth ** 2)
    assert error < 1e-4, error


OUTER = [C.float8(), C.float8("e5m2", chunk=16), C.quantize(8), C.quantize(4, chunk=16),
         C.quantize(2, chunk=8), C.chunked_top_k(0.1, chunk=16), C.chunked_top_k(0.1, bits=None),
         C.dct_top_k(0.25, chunk=16)]


@pytest.mark.parametrize("compressor", OUTER, ids=lambda c: c.name)
def test_outer_compressors_are_contractions_with_the_claimed_delta(compressor):
    for seed in range(3):
        x = jnp.asarray(_x32(200, seed=seed))
        got = compressor.decompress(compressor.compress(x, None))
        assert got.dtype == x.dtype and got.shape == x.shape
        error = float(jnp.sum((got - x) ** 2))
        bound = (1 - compressor.delta(x.size)) * float(jnp.sum(x ** 2))
        assert error <= bound * (1 + 1e-5), (compressor.name, error, bound)
    zeros = jnp.zeros(50)  # an all-zero chunk: scale 1, back to zeros
    np.testing.assert_array_equal(compressor.decompress(compressor.compress(zeros, None)), zeros)


@pytest.mark.parametrize("d", [7, 257, 65537])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_outer_payload_bytes_are_what_the_docstrings_say(d, dtype):
    size = np.dtype(dtype).itemsize
    x = jnp.zeros(d, dtype)
    m16, m64 = math.ceil(d / 16), math.ceil(d / 64)
    expected = {
        C.float8(): d + 4,
        C.float8("e5m2", chunk=16): d + 4 * m16,
        C.quantize(8, chunk=16): d + 4 * m16,
        C.quantize(4): math.ceil(d / 2) + 4,
        C.quantize(2, chunk=16): math.ceil(d / 4) + 4 * m16,
        # k = ceil(0.05 * 64) = 4 a chunk: uint8 positions, 2-bit values, a scale
        C.chunked_top_k(0.05): m64 * 4 + math.ceil(m64 * 4 * 2 / 8) + 4 * m64,
        C.chunked_top_k(0.05, bits=None): m64 * 4 * (1 + size),
        C.chunked_top_k(0.01, chunk=1000, bits=8):
            math.ceil(d / 1000) * 10 * (2 + 1) + 4 * math.ceil(d / 1000),
        C.dct_top_k(0.25): m64 * 16 * (max(size, 4) + 1),
    }
    for compressor, nbytes in expected.items():
        assert compressor.bytes(x) == nbytes, compressor.name
        if d == 257:
            assert compressor.compress(x + 1, None).nbytes == nbytes, compressor.name


def test_outer_compressors_reject_bad_input():
    with pytest.raises(ValueError, match="format must be one of"):
        C.float8("e3m4")
    for bits in (0, 3, 16):
        with pytest.raises(ValueError, match=r"bits must"):
            C.quantize(bits)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8\)"):
        C.chunked_top_k(0.1, bits=1)
    with pytest.raises(TypeError, match="bits must be an int"):
        C.quantize(4.0)
    for make in (C.quantize, C.float8):
        with pytest.raises(ValueError, match="chunk must be >= 1"):
            make(8, chunk=0) if make is C.quantize else make(chunk=0)
    for make in (C.chunked_top_k, C.dct_top_k):
        with pytest.raises(ValueError, match="chunk must be <= 65536"):
            make(0.1, chunk=1 << 17)
        with pytest.raises(ValueError, match=r"ratio must be in \(0.0, 1.0\]"):
            make(0.0)
    for compressor in OUTER[:1] + OUTER[3:4] + OUTER[-2:]:
        with pytest.raises(TypeError, match="real floating"):
            compressor.compress(jnp.arange(4), None)
