"""Process-level ops: barrier and rank/size queries as XLA custom calls.

They work eagerly and inside ``jax.jit``; being side-effecting custom calls,
XLA never removes them even when their results are unused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import ffi, runtime

_SCALAR_I32 = jax.ShapeDtypeStruct((), jnp.int32)


def _call(target: str, *operands, **attrs):
    runtime._require()  # clear error before any tracing if init() was not called
    ffi.register_handlers()
    return jax.ffi.ffi_call(target, _SCALAR_I32, has_side_effect=True)(
        *operands, comm_id=np.int64(runtime.WORLD_COMM_ID), **attrs)


def comm_rank() -> jax.Array:
    """This process's rank, computed by the FFI library (an int32 scalar array)."""
    return _call("jaxfog_rank")


def comm_size() -> jax.Array:
    """The world size, computed by the FFI library (an int32 scalar array)."""
    return _call("jaxfog_size")


def barrier() -> None:
    """Blocks until every rank has reached the barrier.

    Eagerly it returns once all ranks arrived. Inside ``jax.jit`` it is a
    side-effecting custom call executed when the compiled function runs. A rank
    that never arrives makes the others fail after ``JAXFOG_TIMEOUT`` seconds.
    """
    out = _call("jaxfog_barrier", jnp.zeros((), jnp.int32))
    if not isinstance(out, jax.core.Tracer):
        out.block_until_ready()
