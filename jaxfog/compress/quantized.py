r"""Compressors for the outer gradients of the low-communication optimizers
(:func:`jaxfog.optax.diloco`, ``streaming_diloco``, ``noloco``), where a
pseudo-gradient of a whole model travels every ``H`` steps over a slow link:

* :func:`float8`: each entry as an 8-bit float (``e4m3`` or ``e5m2``) after
  dividing by a scale per chunk (torchft's float8 allreduce);
* :func:`quantize`: each entry as a signed integer of 8, 4 or 2 bits, one
  scale per chunk (INTELLECT-1's int8, Streaming DiLoCo's 4 bits);
* :func:`chunked_top_k`: in each chunk the ``k`` entries largest in magnitude,
  their values quantized as :func:`quantize` does (SparseLoCo: top-k of 1-3%
  with 2-bit values);
* :func:`dct_top_k`: each chunk's DCT-II, then its ``k`` largest
  coefficients (DeMo).

Every scale is one float32 per chunk of ``chunk`` entries (the flattened
array cut in runs of ``chunk``, the last one shorter; ``chunk=None``: one for
the whole array). Deterministic: rounding to nearest, even on ties, so the
payload for an array is the same bits on every backend, and the entry
largest in magnitude of each chunk (of each chunk's kept entries) comes back
as it was, up to the float32 rounding of its scale. Each is biased and a
contraction (an entry's rounding error is at most the entry, as zero is a
level), which the optimizers pair with error feedback.

References:
  Jaghouar et al. *INTELLECT-1 Technical Report*, 2024 (int8 outer gradients).

  Douillard et al. *Streaming DiLoCo with overlapping communication*, 2025
  (4-bit outer gradients).

  Sarfi et al. *SparseLoCo: Communication-efficient LLM training*, 2025
  (chunked top-k with 2-bit values, error feedback).

  Peng, Quesnelle, Kingma. *DeMo: Decoupled Momentum Optimization*, 2024.
"""

from __future__ import annotations

import math
from typing import overload

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import _validate as V
from jaxfog.compress.compressors import (Compressor, _check_float, _check_ratio, _count,
                                         _index_dtype, _pack, _payload, _unpack)

#: The 8-bit float formats: (JAX dtype, largest finite value).
_FLOAT8_FORMATS = {"e4m3": (jnp.float8_e4m3fn, 448.0), "e5m2": (jnp.float8_e5m2, 57344.0)}
#: The integer widths :func:`quantize` and :func:`chunked_top_k` pack.
_BITS = (2, 4, 8)
#: The largest chunk whose positions :func:`chunked_top_k` and
#: :func:`dct_top_k` send (as uint16).
_MAX_INDEXED_CHUNK = 1 << 16


@overload
def _check_chunk(what: str, chunk: int | None, maximum: int) -> int: ...


@overload
def _check_chunk(what: str, chunk: int | None, maximum: None = None) -> int | None: ...


def _check_chunk(what: str, chunk: int | None, maximum: int | None = None) -> int | None:
    if chunk is None and maximum is None:
        return None
    chunk = V.integer(f"jaxfog.compress.{what}", "chunk", chunk, minimum=1)
    if maximum is not None and chunk > maximum:
        raise ValueError(f"jaxfog.compress.{what}: chunk must be <= {maximum} (its positions "
                         f"travel as uint16), got {chunk}")
    return chunk


def _check_bits(what: str, bits: int) -> int:
    bits = V.integer(f"jaxfog.compress.{what}", "bits", bits, minimum=1)
    if bits not in _BITS:
        raise ValueError(f"jaxfog.compress.{what}: bits must be one of {_BITS}, got {bits}")
    return bits


def _chunks(flat: jax.Array, chunk: int | None) -> jax.Array:
    """``flat`` as rows of ``chunk`` entries (the last padded with zeros)."""
    size = flat.size if chunk is None else chunk
    rows = max(1, -(-flat.size // size))
    return jnp.pad(flat, (0, rows * size - flat.size)).reshape(rows, size)


def _rows(d: int, chunk: int | None) -> int:
    return 1 if chunk is None else max(1, -(-d // chunk))


def _wide(x: jax.Array) -> jax.Array:
    """Narrow floats in float32 (rounding scaled values in bfloat16 would add error)."""
    return x.astype(jnp.float32) if x.dtype.itemsize < 4 else x


def _scales(rows: jax.Array, top: float) -> jax.Array:
    """Per row: its largest magnitude times ``1 / top`` (rounded to float32: a
    product, which every compiler leaves as it is), or 1 for an all-zero row."""
    amax = jnp.max(jnp.abs(rows), axis=1).astype(jnp.float32)
    return jnp.where(amax > 0, amax * np.float32(1 / top), np.float32(1))


def _to_levels(rows: jax.Array, scales: jax.Array, levels: int) -> jax.Array:
    """Signed integer codes in [-levels, levels], rounded to nearest (even)."""
    scaled = rows / scales[:, None].astype(rows.dtype)
    return jnp.clip(jnp.round(scaled), -levels, levels).astype(jnp.int32)


def _from_levels(codes: jax.Array, scales: jax.Array) -> jax.Array:
    return codes.astype(jnp.float32) * scales[:, None]


def _levels(bits: int) -> int:
    """The largest code of a signed ``bits``-bit symmetric quantizer: 1, 7, 127."""
    return (1 << (bits - 1)) - 1


def float8(format: str = "e4m3", *, chunk: int | None = None) -> Compressor:
    r"""Each entry as an 8-bit float, after dividing by its chunk's scale.

    .. math::

        s_c = \max_{i \in c} |x_i| / F, \qquad
        C(x)_i = s_c \cdot \mathrm{fp8}(x_i / s_c),

    with :math:`F` the format's largest finite value (448 for ``e4m3``, the
    finite-only ``float8_e4m3fn``; 57344 for ``e5m2``), so that each chunk
    uses the format's whole range, and ``fp8`` rounding to nearest. ``e4m3``
    keeps 3 mantissa bits (a relative error of at most 1/16 for entries
    within 2^-6 of the chunk's largest: those below it lose precision, down
    to zero), ``e5m2`` 2 bits with a wider range.

    Payload: one byte an entry and one float32 scale a chunk: ``d + 4 *
    ceil(d / chunk)`` bytes (``d + 4`` with ``chunk=None``). Biased;
    deterministic contraction with :math:`\delta \ge 1 / d` (the worst case,
    which ``delta(d)`` reports).
    """
    if format not in _FLOAT8_FORMATS:
        raise ValueError(f"jaxfog.compress.float8: format must be one of "
                         f"{sorted(_FLOAT8_FORMATS)}, got {format!r}")
    chunk = _check_chunk("float8", chunk)
    dtype, top = _FLOAT8_FORMATS[format]

    def compress(x, key, warm=None):
        x = _check_float("float8", x)
        rows = _chunks(_wide(x.reshape(-1)), chunk)
        scales = _scales(rows, top)
        scaled = jnp.clip(rows / scales[:, None].astype(rows.dtype), -top, top)
        codes = jax.lax.bitcast_convert_type(scaled.astype(dtype), jnp.uint8)
        return _payload(x, codes.reshape(-1)[:x.size], scales)

    def decompress(p):
        codes, scales = p.arrays
        d = math.prod(p.shape)
        values = jax.lax.bitcast_convert_type(codes, dtype).astype(jnp.float32)
        rows = _chunks(values, chunk) * scales[:, None]
        return rows.reshape(-1)[:d].astype(p.dtype).reshape(p.shape)

    name = f"float8({format!r}{'' if chunk is None else f', chunk={chunk}'})"
    return Compressor(name, compress, decompress, False, lambda d: 1 / d, lambda d: None)


def quantize(bits: int, *, chunk: int | None = None) -> Compressor:
    r"""Each entry as a signed integer of ``bits`` (8, 4 or 2) bits, one scale a chunk.

    .. math::

        s_c = \max_{i \in c} |x_i| / L, \qquad
        C(x)_i = s_c\, \mathrm{round}(x_i / s_c), \qquad L = 2^{b - 1} - 1,

    so codes lie in :math:`[-L, L]` (127 for int8, 7 for 4 bits, 1 for 2
    bits: ternary), rounded to nearest (even on ties).

    Payload: the codes shifted to :math:`[0, 2L]`, packed ``8 / bits`` a
    byte, and one float32 scale a chunk: ``ceil(d * bits / 8) + 4 *
    ceil(d / chunk)`` bytes. Biased; deterministic contraction with
    :math:`\delta \ge 1 / d` (reported).
    """
    bits = _check_bits("quantize", bits)
    chunk = _check_chunk("quantize", chunk)
    levels = _levels(bits)

    def compress(x, key, warm=None):
        x = _check_float("quantize", x)
        rows = _chunks(_wide(x.reshape(-1)), chunk)
        scales = _scales(rows, levels)
        codes = _to_levels(rows, scales, levels).reshape(-1)[:x.size] + levels
        return _payload(x, _pack(codes, bits), scales)

    def decompress(p):
        packed, scales = p.arrays
        d = math.prod(p.shape)
        codes = _unpack(packed, bits, d).astype(jnp.int32) - levels
        rows = _from_levels(_chunks(codes, chunk), scales)
        return rows.reshape(-1)[:d].astype(p.dtype).reshape(p.shape)

    name = f"quantize({bits}{'' if chunk is None else f', chunk={chunk}'})"
    return Compressor(name, compress, decompress, False, lambda d: 1 / d, lambda d: None)


def chunked_top_k(ratio: float, *, chunk: int = 64, bits: int | None = 2) -> Compressor:
    r"""In each chunk, its ``k = ceil(ratio * chunk)`` entries largest in
    magnitude, their values quantized (SparseLoCo).

    The flattened array is cut in chunks of ``chunk`` entries (the last
    padded with zeros); each keeps its top ``k`` and sends their positions in
    the chunk (uint8 for chunks of up to 256 entries, else uint16) and their
    values, as :func:`quantize` sends them with ``bits`` (one float32 scale a
    chunk: the largest kept value is exact), or in ``x``'s dtype with
    ``bits=None``.

    Payload, for ``m = ceil(d / chunk)`` chunks: ``m * k`` positions, and
    ``ceil(m * k * bits / 8) + 4 * m`` bytes of values (``m * k * itemsize``
    with ``bits=None``). Biased; deterministic contraction: without
    quantization :math:`\delta = k / \mathrm{chunk}` (each chunk keeps at
    least that share of its energy), and with it at least :math:`1 / d`
    (``delta(d)`` reports these).
    """
    ratio = _check_ratio("chunked_top_k", ratio)
    chunk = _check_chunk("chunked_top_k", chunk, _MAX_INDEXED_CHUNK)
    if bits is not None:
        bits = _check_bits("chunked_top_k", bits)
    k = _count(ratio, chunk)
    index_dtype = _index_dtype(chunk)

    def compress(x, key, warm=None):
        x = _check_float("chunked_top_k", x)
        rows = _chunks(x.reshape(-1), chunk)
        _, index = jax.lax.top_k(jnp.abs(rows), k)
        kept = jnp.take_along_axis(rows, index, axis=1)
        positions = index.astype(index_dtype).reshape(-1)
        if bits is None:
            return _payload(x, positions, kept.reshape(-1))
        kept = _wide(kept)
        scales = _scales(kept, _levels(bits))
        codes = _to_levels(kept, scales, _levels(bits)).reshape(-1) + _levels(bits)
        return _payload(x, positions, _pack(codes, bits), scales)

    def decompress(p):
        d = math.prod(p.shape)
        m = _rows(d, chunk)
        index = p.arrays[0].astype(jnp.int32).reshape(m, k)
        if bits is None:
            values = p.arrays[1].reshape(m, k)
        else:
            packed, scales = p.arrays[1:]
            codes = _unpack(packed, bits, m * k).astype(jnp.int32) - _levels(bits)
            values = _from_levels(codes.reshape(m, k), scales)
        rows = jnp.zeros((m, chunk), values.dtype)
        rows = rows.at[jnp.arange(m)[:, None], index].set(values)
        return rows.reshape(-1)[:d].astype(p.dtype).reshape(p.shape)

    name = f"chunked_top_k({ratio:g}, chunk={chunk}, bits={bits})"
    return Compressor(name, compress, decompress, False,
                      (lambda d: k / chunk) if bits is None else (lambda d: 1 / d),
                      lambda d: None)


def _dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix: ``D @ v`` is ``v``'s DCT, ``D.T`` its inverse."""
    i = np.arange(n)
    d = np.cos(np.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * np.sqrt(2.0 / n)
    d[0] /= np.sqrt(2.0)
    return d


def dct_top_k(ratio: float, *, chunk: int = 64) -> Compressor:
    r"""Each chunk's orthonormal DCT-II, then its ``k = ceil(ratio * chunk)``
    coefficients largest in magnitude (DeMo).

    .. math::

        \hat x_c = D x_c, \qquad C(x)_c = D^\top\, \mathrm{top}_k(\hat x_c),

    with :math:`D` the ``chunk x chunk`` orthonormal DCT-II matrix. Smooth
    or slowly varying chunks put their energy in few coefficients, so a few
    carry most of it.

    Payload, for ``m = ceil(d / chunk)`` chunks: the ``m * k`` coefficients
    in ``x``'s dtype (float32 for narrower floats) and their positions (uint8
    for chunks of up to 256 entries, else uint16). Biased; deterministic
    contraction with :math:`\delta = k / \mathrm{chunk}` (``D`` keeps norms:
    each chunk keeps at least that share of its energy).
    """
    ratio = _check_ratio("dct_top_k", ratio)
    chunk = _check_chunk("dct_top_k", chunk, _MAX_INDEXED_CHUNK)
    k = _count(ratio, chunk)
    index_dtype = _index_dtype(chunk)
    basis = _dct_matrix(chunk)

    def compress(x, key, warm=None):
        x = _check_float("dct_top_k", x)
        rows = _chunks(_wide(x.reshape(-1)), chunk)
        coefficients = rows @ jnp.asarray(basis.T, rows.dtype)
        _, index = jax.lax.top_k(jnp.abs(coefficients), k)
        kept = jnp.take_along_axis(coefficients, index, axis=1)
        return _payload(x, kept.reshape(-1), index.astype(index_dtype).reshape(-1))

    def decompress(p):
        values, positions = p.arrays
        d = math.prod(p.shape)
        m = _rows(d, chunk)
        index = positions.astype(jnp.int32).reshape(m, k)
        coefficients = jnp.zeros((m, chunk), values.dtype)
        coefficients = coefficients.at[jnp.arange(m)[:, None], index].set(values.reshape(m, k))
        rows = coefficients @ jnp.asarray(basis, values.dtype)
        return rows.reshape(-1)[:d].astype(p.dtype).reshape(p.shape)

    return Compressor(f"dct_top_k({ratio:g}, chunk={chunk})", compress, decompress, False,
                      lambda d: k / chunk, lambda d: None)


__all__ = ["chunked_top_k", "dct_top_k", "float8", "quantize"]
