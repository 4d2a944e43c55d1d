"""Process-level ops: barrier, and rank/size computed by the FFI library."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import ffi, runtime
from jaxfog.ops import _dispatch
from jaxfog.ops import _sync_primitives
from jaxfog.ops._backends import Op
from jaxfog.ops._primitive_machinery import target
from jaxfog.simulation import _clock

# Queries without communication: plain (effect-free) FFI calls.
_RANK, _SIZE = target("rank"), target("size")


def _query(name: str) -> jax.Array:
    runtime._require()  # a clear error before any tracing if init() was not called
    ffi.register_handlers()
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((), jnp.int32))(
        comm_id=np.int64(runtime.WORLD_COMM_ID))


def comm_rank() -> jax.Array:
    """This process's rank, computed by the FFI library (an int32 scalar array)."""
    return _query(_RANK)


def comm_size() -> jax.Array:
    """The world size, computed by the FFI library (an int32 scalar array)."""
    return _query(_SIZE)


# Simulated agents run in lockstep: only their clocks wait.
BARRIER = Op("barrier", simulated=lambda sim, leaves, treedef, args: _clock.synchronize(),
             mpi_run=lambda leaves, treedef, args: _sync_primitives.barrier_p.bind(
                 comm_id=runtime.WORLD_COMM_ID))


def barrier() -> None:
    """Blocks until every rank has reached the barrier.

    Eagerly it returns once all ranks arrived. Inside ``jax.jit`` it runs, in
    order with the other communicating ops, when the compiled function runs. A
    rank that never arrives makes the others fail after ``JAXFOG_TIMEOUT``
    seconds. Inside :func:`jaxfog.simulate` it does nothing (the agents run in
    lockstep).
    """
    _dispatch.run(BARRIER, None)


__all__ = ["barrier", "comm_rank", "comm_size"]
