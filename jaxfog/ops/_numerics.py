"""The C++ handlers' arithmetic, in JAX: what sums of each dtype are computed
in, and how they are stored back (shared by the simulation and by the parts
of the MPI backend that XLA computes)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax
import jax.numpy as jnp


@contextlib.contextmanager
def accumulating(dtype) -> Iterator[Any]:
    """Yields the type a sum of ``dtype`` values is computed in.

    Integers are summed in float64 like the C++ handlers, so float64 is turned
    on for that part of the trace even when ``jax_enable_x64`` is off; 16-bit
    floats are summed in float32.
    """
    if jnp.issubdtype(dtype, jnp.integer):
        with jax.enable_x64(True):
            yield jnp.float64
    elif dtype in (jnp.float16, jnp.bfloat16):
        yield jnp.float32
    else:
        yield dtype


def finish(value, dtype):
    """A sum stored back as ``dtype`` (integers rounded half to even)."""
    if jnp.issubdtype(dtype, jnp.integer):
        value = jnp.round(value)
    return value.astype(dtype)


def scaled(x, w):
    """``w * x`` as the handlers compute it; ``x`` itself when ``w`` is 1."""
    if isinstance(w, float) and w == 1.0:
        return x
    with accumulating(x.dtype) as acc:
        return finish(jnp.asarray(w).astype(acc) * x.astype(acc), x.dtype)
