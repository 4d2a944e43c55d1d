"""Process-level ops: barrier, and rank/size computed by the FFI library."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import runtime
from jaxfog.ops import _backends
from jaxfog.ops._backends import mpi
from jaxfog.ops._primitive_machinery import target

# Queries without communication: plain (effect-free) FFI calls.
_RANK, _SIZE = target("rank"), target("size")


def _query(name: str) -> jax.Array:
    mpi.backend()  # a clear error before any tracing if init() was not called
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((), jnp.int32))(
        comm_id=np.int64(runtime.WORLD_COMM_ID))


def comm_rank() -> jax.Array:
    """This process's rank, computed by the FFI library (an int32 scalar array)."""
    return _query(_RANK)


def comm_size() -> jax.Array:
    """The world size, computed by the FFI library (an int32 scalar array)."""
    return _query(_SIZE)


def barrier() -> None:
    """Blocks until every rank has reached the barrier.

    Eagerly it returns once all ranks arrived. Inside ``jax.jit`` it runs, in
    order with the other communicating ops, when the compiled function runs. A
    rank that never arrives makes the others fail after ``JAXFOG_TIMEOUT``
    seconds. Inside :func:`jaxfog.simulate` it does nothing (the agents run in
    lockstep).
    """
    _backends.current().barrier()


__all__ = ["barrier", "comm_rank", "comm_size"]
