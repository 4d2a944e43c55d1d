r"""The compressors: pure functions of an array and a key, with fixed payload
shapes (see :mod:`jaxfog.compress` for the contract)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import _validate as V

Array = jax.Array
Tree = Any


@dataclasses.dataclass(frozen=True)
class Payload:
    """What a compressor sends for one array: ``arrays`` travel, ``shape`` and
    ``dtype`` (the original array's) are static, so they never do."""

    #: The arrays on the wire, each at least 1-D (a gather stacks them on axis 0).
    arrays: tuple[Array, ...]
    #: Shape of the compressed array.
    shape: tuple[int, ...]
    #: Its dtype, as a string.
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays: what one message of this payload weighs."""
        return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in self.arrays))


jax.tree_util.register_dataclass(Payload, data_fields=["arrays"], meta_fields=["shape", "dtype"])


class Compressor(NamedTuple):
    """A compressor: see the module docstring for the contract."""

    #: e.g. ``"top_k(0.01)"``; part of the MergeComp cache key.
    name: str
    #: ``compress(x, key, warm=None) -> Payload``.
    compress: Callable[..., Payload]
    #: ``decompress(payload) -> x_hat``.
    decompress: Callable[[Payload], Array]
    #: Whether :math:`\mathbb{E}\, C(x) = x`.
    unbiased: bool
    #: ``delta(d)``: the contraction factor for ``d`` entries, or None.
    delta: Callable[[int], float | None]
    #: ``omega(d)``: the variance bound of an unbiased compressor, else None.
    omega: Callable[[int], float | None]
    #: Whether ``compress`` uses ``warm`` (its previous payload): low-rank.
    warm_start: bool = False
    #: Whether it compresses a merged (flattened) group of leaves; low-rank
    #: keeps each matrix's shape and so compresses leaf by leaf.
    mergeable: bool = True

    def bytes(self, x: Any) -> int:
        """Bytes of the payload for an array shaped like ``x``."""
        x = jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        return jax.eval_shape(self.compress, x, key).nbytes


# --- helpers ---------------------------------------------------------------


def _check_ratio(what: str, ratio: Any) -> float:
    return V.real(f"jaxfog.compress.{what}", "ratio", ratio, low=0.0, high=1.0, low_open=True)


def _check_compressor(what: str, compressor: Any, name: str = "compressor") -> "Compressor":
    if not isinstance(compressor, Compressor):
        raise TypeError(f"jaxfog.compress.{what}: {name} must be a jaxfog.compress "
                        f"Compressor, got {type(compressor).__name__} {compressor!r}")
    return compressor


def _check_float(what: str, x: Array) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jaxfog.compress.{what}: compresses real floating arrays, got {x.dtype}")
    return x


def _key_data(key: Array) -> Array:
    """A key as its raw uint32 words (what travels in a payload)."""
    key = jnp.asarray(key) if not hasattr(key, "dtype") else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key.astype(jnp.uint32)


def _count(ratio: float, d: int) -> int:
    return max(1, min(d, math.ceil(ratio * d)))


def _index_dtype(d: int) -> Any:
    """The narrowest unsigned integer that indexes ``d`` entries."""
    return jnp.uint8 if d <= 1 << 8 else jnp.uint16 if d <= 1 << 16 else jnp.uint32


def _pack(codes: Array, bits: int) -> Array:
    """Packs unsigned codes of ``bits`` (1, 2, 4 or 8) bits, ``8 // bits`` per byte."""
    per = 8 // bits
    codes = jnp.pad(codes.astype(jnp.uint8), (0, -codes.size % per)).reshape(-1, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    return jnp.sum(codes << shifts, axis=1, dtype=jnp.uint8)


def _unpack(packed: Array, bits: int, d: int) -> Array:
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:d]


def _payload(x: Array, *arrays: Array) -> Payload:
    return Payload(tuple(jnp.atleast_1d(a) for a in arrays), tuple(x.shape), str(x.dtype))


# --- the compressors ---------------------------------------------------------


def identity() -> Compressor:
    """No compression: the payload is ``x`` itself, ``d * itemsize`` bytes.

    Unbiased, ``delta = 1``, ``omega = 0``; the round trip is exact.
    """
    def compress(x, key, warm=None):
        x = _check_float("identity", x)
        return _payload(x, x.reshape(-1))

    def decompress(p):
        return p.arrays[0].reshape(p.shape)

    return Compressor("identity()", compress, decompress, True, lambda d: 1.0, lambda d: 0.0)


def top_k(ratio: float) -> Compressor:
    r"""The ``k = ceil(ratio * d)`` entries largest in magnitude; the rest are zero.

    Payload: the ``k`` values (``x``'s dtype) and their indices in the
    narrowest unsigned integer that holds ``d - 1`` (uint8 up to 256 entries,
    uint16 up to 65536, else uint32): ``k * (itemsize + index bytes)`` bytes.
    Biased; deterministic contraction with :math:`\delta = k / d`.
    """
    ratio = _check_ratio("top_k", ratio)

    def compress(x, key, warm=None):
        x = _check_float("top_k", x)
        flat = x.reshape(-1)
        k = _count(ratio, flat.size)
        _, index = jax.lax.top_k(jnp.abs(flat), k)
        return _payload(x, flat[index], index.astype(_index_dtype(flat.size)))

    def decompress(p):
        values, index = p.arrays
        d = math.prod(p.shape)
        return jnp.zeros(d, p.dtype).at[index.astype(jnp.int32)].set(values).reshape(p.shape)

    return Compressor(f"top_k({ratio:g})", compress, decompress, False,
                      lambda d: _count(ratio, d) / d, lambda d: None)


def rand_k(ratio: float, *, unbiased: bool = False) -> Compressor:
    r"""``k = ceil(ratio * d)`` entries drawn uniformly without replacement from ``key``.

    Payload: the ``k`` values and the key (2 uint32 words), from which the
    receiver draws the same indices: ``k * itemsize + 8`` bytes.

    * ``unbiased=False`` (the default, what CHOCO-SGD takes): the values as
      they are; :math:`\mathbb{E}\,C(x) = (k/d)\, x`, a contraction with
      :math:`\delta = k / d` in expectation.
    * ``unbiased=True``: the values scaled by :math:`d / k`; unbiased, with
      variance :math:`\omega = d / k - 1` and no contraction.
    """
    ratio = _check_ratio("rand_k", ratio)
    unbiased = V.flag("jaxfog.compress.rand_k", "unbiased", unbiased)

    def indices(key, d):
        return jax.random.permutation(key, d)[:_count(ratio, d)]

    def compress(x, key, warm=None):
        x = _check_float("rand_k", x)
        flat = x.reshape(-1)
        words = _key_data(key)
        values = flat[indices(words, flat.size)]
        if unbiased:
            values = values * (flat.size / values.size)
        return _payload(x, values, words)

    def decompress(p):
        values, words = p.arrays
        d = math.prod(p.shape)
        return jnp.zeros(d, p.dtype).at[indices(words, d)].set(values).reshape(p.shape)

    name = f"rand_k({ratio:g}{', unbiased=True' if unbiased else ''})"
    return Compressor(name, compress, decompress, unbiased,
                      (lambda d: None) if unbiased else (lambda d: _count(ratio, d) / d),
                      (lambda d: d / _count(ratio, d) - 1) if unbiased else (lambda d: None))


def _qsgd_bits(levels: int) -> int:
    """Bits of one code ``sign * level + levels`` in [0, 2 levels]: 2, 4, 8 or 16."""
    need = math.ceil(math.log2(2 * levels + 1))
    return next(b for b in (2, 4, 8, 16) if b >= need)


def qsgd(levels: int, *, unbiased: bool = True, bucket: int | None = None) -> Compressor:
    r"""QSGD stochastic quantization with ``s = levels`` levels and the 2-norm.

    .. math::

        C(x)_i = \|x\|_2\, \mathrm{sign}(x_i)\, \frac{\ell_i}{s},
        \qquad \ell_i = \lfloor s |x_i| / \|x\|_2 + u_i \rfloor,\ u_i \sim U[0, 1),

    with the norm taken over the whole array, or over each of ``ceil(d /
    bucket)`` equal runs of at most ``bucket`` entries (QSGD's buckets: a
    smaller variance for one norm per bucket).
    Unbiased, with :math:`\omega = \min(b / s^2, \sqrt b / s)` for buckets of
    :math:`b` entries (:math:`b = d` without buckets; Alistarh et al., Lemma
    3.1). ``unbiased=False`` divides by :math:`\tau = 1 + \omega`, a
    contraction with :math:`\delta = 1 / \tau` (Koloskova et al.), for CHOCO.

    Payload: each entry's code ``sign * level + s`` in ``b`` bits, the
    smallest of 2, 4, 8, 16 that holds ``2 s + 1`` values, packed ``8 / b``
    per byte (uint16 codes for ``b = 16``), and one norm per run, in float32
    for 16-bit floats (rounding it to 16 bits would bias the result) and in
    ``x``'s dtype otherwise: ``ceil(d * b / 8) + ceil(d / bucket) * max(itemsize,
    4)`` bytes.
    ``qsgd(7)`` sends 4 bits per entry, ``qsgd(1)`` 2 bits (ternary).
    """
    levels = V.integer("jaxfog.compress.qsgd", "levels", levels, minimum=1)
    if levels > 32767:
        raise ValueError(f"jaxfog.compress.qsgd: levels must be in [1, 32767], got {levels}")
    if bucket is not None:
        bucket = V.integer("jaxfog.compress.qsgd", "bucket", bucket, minimum=1)
    unbiased = V.flag("jaxfog.compress.qsgd", "unbiased", unbiased)
    s, bits = levels, _qsgd_bits(levels)

    def omega(d):
        b = d if bucket is None else min(bucket, d)
        return min(b / s**2, math.sqrt(b) / s)

    def runs(d):
        return 1 if bucket is None else -(-d // bucket)

    def compress(x, key, warm=None):
        x = _check_float("qsgd", x)
        flat = x.reshape(-1)
        d, m = flat.size, runs(flat.size)
        # Narrow floats are quantized in float32: rounding scaled + u in bfloat16
        # would bias the levels away from zero.
        wide = flat.astype(jnp.float32) if flat.dtype.itemsize < 4 else flat
        norms = jnp.linalg.norm(jnp.pad(wide, (0, m * (-(-d // m)) - d)).reshape(m, -1), axis=1)
        per_entry = jnp.repeat(norms, -(-d // m))[:d]
        scaled = jnp.abs(wide) / jnp.where(per_entry > 0, per_entry, 1) * s
        u = jax.random.uniform(_key_data(key), flat.shape, wide.dtype)
        level = jnp.minimum(jnp.floor(scaled + u), s)
        codes = (jnp.where(flat < 0, -level, level) + s).astype(jnp.int32)
        packed = codes.astype(jnp.uint16) if bits == 16 else _pack(codes, bits)
        return _payload(x, packed, norms)  # float32 for narrow floats: no rounding bias

    def decompress(p):
        packed, norms = p.arrays
        d = math.prod(p.shape)
        codes = packed if bits == 16 else _unpack(packed, bits, d)
        per_entry = jnp.repeat(norms, -(-d // norms.size))[:d]
        scale = per_entry / s / (1.0 if unbiased else 1.0 + omega(d))
        return ((codes.astype(jnp.int32) - s).astype(scale.dtype) * scale).astype(
            p.dtype).reshape(p.shape)

    name = (f"qsgd({levels}{'' if unbiased else ', unbiased=False'}"
            f"{'' if bucket is None else f', bucket={bucket}'})")
    return Compressor(name, compress, decompress, unbiased,
                      (lambda d: None) if unbiased else (lambda d: 1 / (1 + omega(d))),
                      omega if unbiased else (lambda d: None))


def sign() -> Compressor:
    r"""Scaled sign: :math:`C(x) = \frac{\|x\|_1}{d}\, \mathrm{sign}(x)` (0 counts as +).

    Payload: the signs, one bit each, packed 8 per byte, and the scale in
    ``x``'s dtype: ``ceil(d / 8) + itemsize`` bytes. Biased; deterministic
    contraction with :math:`\delta = \|x\|_1^2 / (d \|x\|_2^2) \ge 1 / d`
    (``delta(d)`` reports the worst case, ``1 / d``).
    """
    def compress(x, key, warm=None):
        x = _check_float("sign", x)
        flat = x.reshape(-1)
        return _payload(x, _pack(flat >= 0, 1), jnp.mean(jnp.abs(flat)))

    def decompress(p):
        bits, scale = p.arrays
        signs = _unpack(bits, 1, math.prod(p.shape)).astype(p.dtype) * 2 - 1
        return (signs * scale[0]).reshape(p.shape)

    return Compressor("sign()", compress, decompress, False, lambda d: 1 / d, lambda d: None)


def _orthonormal(m: Array) -> Array:
    q, _ = jnp.linalg.qr(m)
    return q


def low_rank(rank: int, *, vectors: Compressor | None = None) -> Compressor:
    r"""Rank-``r`` approximation by one step of power iteration (PowerGossip).

    A leaf of shape ``(m, ...)`` is the matrix ``M`` of shape ``(m, n)``
    (trailing axes flattened). With ``Q`` (``n x r``) the previous payload's
    right factor (``warm``) or, cold, a Gaussian draw from ``key``:

    .. math::

        P = \mathrm{orth}(M Q), \qquad Q' = M^\top P, \qquad C(M) = P Q'^\top
        = P P^\top M,

    the projection of ``M``'s columns on ``span(M Q)``. Payload: ``P`` and
    ``Q'``, ``(m + n) * r * itemsize`` bytes (``r`` is capped at ``min(m, n)``).
    Biased. :math:`\|C(M) - M\| \le \|M\|` always; from a cold start,
    :math:`\mathbb{E}\,\|C(M) - M\|^2 \le (1 - r/n) \|M\|^2` (``delta(d)``
    cannot know ``n`` and reports 0, the bound that always holds).

    Matrices only: a 1-D array is a ``ValueError``, unless ``vectors`` names
    the compressor for vectors (PowerSGD sends them uncompressed:
    ``vectors=identity()``). Not mergeable: :func:`compress_tree` keeps one
    group per leaf.
    """
    rank = V.integer("jaxfog.compress.low_rank", "rank", rank, minimum=1)
    if vectors is not None:
        _check_compressor("low_rank", vectors, "vectors")

    def matrix(x):
        return x.reshape(x.shape[0], -1)

    def compress(x, key, warm=None):
        x = _check_float("low_rank", x)
        if x.ndim < 2:
            if vectors is None:
                raise ValueError(
                    f"jaxfog.compress.low_rank: compresses matrices, got shape {x.shape}; "
                    "pass vectors=jaxfog.compress.identity() (or another compressor) for "
                    "the vectors")
            return vectors.compress(x, key)
        m = matrix(x)
        r = min(rank, *m.shape)
        q = jax.random.normal(_key_data(key), (m.shape[1], r), m.dtype)
        if warm is not None and len(warm.arrays) == 2 and warm.arrays[1].shape == q.shape:
            # The previous right factor, unless it is zero (it was a zero matrix's).
            q = jnp.where(jnp.any(warm.arrays[1] != 0), warm.arrays[1], q)
        p = _orthonormal(m @ q)
        return _payload(x, p, m.T @ p)

    def decompress(p):
        if len(p.shape) < 2:
            return vectors.decompress(p)
        left, right = p.arrays
        return (left @ right.T).reshape(p.shape)

    name = f"low_rank({rank}{'' if vectors is None else ', vectors=' + vectors.name})"
    return Compressor(name, compress, decompress, False, lambda d: 0.0, lambda d: None,
                      warm_start=True, mergeable=False)


__all__ = ["Compressor", "Payload", "identity", "low_rank", "qsgd", "rand_k", "sign", "top_k"]
