"""Process-level ops: barrier and rank/size queries as XLA custom calls.

They work eagerly and inside ``jax.jit``. The barrier carries jaxfog's ordered
communication effect, so it keeps its place among the other communicating ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.interpreters import mlir

from jaxfog import _context, ffi, runtime
from jaxfog.ops._primitive import comm_effect, lower_comm_call

_SCALAR_I32 = jax.ShapeDtypeStruct((), jnp.int32)


def _query(target: str) -> jax.Array:
    runtime._require()  # clear error before any tracing if init() was not called
    ffi.register_handlers()
    return jax.ffi.ffi_call(target, _SCALAR_I32)(comm_id=np.int64(runtime.WORLD_COMM_ID))


def comm_rank() -> jax.Array:
    """This process's rank, computed by the FFI library (an int32 scalar array)."""
    return _query("jaxfog_rank")


def comm_size() -> jax.Array:
    """The world size, computed by the FFI library (an int32 scalar array)."""
    return _query("jaxfog_size")


barrier_p = core.Primitive("jaxfog_barrier")
barrier_p.multiple_results = True
barrier_p.def_effectful_abstract_eval(lambda *, comm_id: ([], {comm_effect}))


@barrier_p.def_impl
def _barrier_impl(*, comm_id: int):
    # Eagerly: run the compiled barrier and wait for it, so that barrier()
    # returns only once every rank has arrived.
    out = jax.jit(barrier_p.bind, static_argnames="comm_id")(comm_id=comm_id)
    jax.effects_barrier()
    return out

mlir.register_lowering(
    barrier_p, lambda ctx, *, comm_id: lower_comm_call(ctx, "jaxfog_barrier", [],
                                                        {"comm_id": comm_id}),
    platform="cpu")


# Completes after every op handed to the communication thread before it; in
# order with the other ops, and across calls in dispatch order.
fence_p = core.Primitive("jaxfog_fence")
fence_p.def_effectful_abstract_eval(
    lambda: (jax.core.ShapedArray((), jnp.int32), {comm_effect}))
mlir.register_lowering(
    fence_p, lambda ctx: lower_comm_call(ctx, "jaxfog_fence", [], {}), platform="cpu")


@functools.cache
def _fence_fn():
    from jaxfog.ops.jit import jit

    return jit(fence_p.bind)


def wait_for_dispatched() -> None:
    """Blocks until the communication of every computation this thread has
    dispatched so far has finished (PjRt runs them in dispatch order)."""
    if runtime.is_initialized() and _context.current() is None:
        _fence_fn()().block_until_ready()


runtime._before_shutdown.append(wait_for_dispatched)


def barrier() -> None:
    """Blocks until every rank has reached the barrier.

    Eagerly it returns once all ranks arrived. Inside ``jax.jit`` it runs, in
    order with the other communicating ops, when the compiled function runs. A
    rank that never arrives makes the others fail after ``JAXFOG_TIMEOUT`` seconds.
    """
    if _context.current() is not None:
        return  # simulated agents run in lockstep: nothing to wait for
    runtime._require()
    ffi.register_handlers()
    barrier_p.bind(comm_id=runtime.WORLD_COMM_ID)
