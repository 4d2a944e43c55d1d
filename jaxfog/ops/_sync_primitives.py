"""The two primitives that order a rank's communication as a whole: the
barrier (every rank arrives) and the fence (every op handed to the
communication thread has finished).

Like the ops' own primitives, they lower to the custom call ``jaxfog_<op>`` of
the C++ op table (``jaxfog/ffi/ops.h``) and carry jaxfog's ordered
communication effect. Both the process ops (``jaxfog.ops.process``) and the
MPI backend use them, which is why they sit below both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import core
from jax.extend import core as jex_core

from jaxfog import runtime
from jaxfog.ops.jit import jit
from jaxfog.ops._primitive_machinery import comm_effect, lower_comm_call, register_lowering, target


barrier_p = jex_core.Primitive(target("barrier"))
barrier_p.multiple_results = True
barrier_p.def_effectful_abstract_eval(lambda *, comm_id: ([], {comm_effect}))


@barrier_p.def_impl
def _barrier_impl(*, comm_id: int):
    # Eagerly: run the compiled barrier and wait for it, so that barrier()
    # returns only once every rank has arrived.
    out = jax.jit(barrier_p.bind, static_argnames="comm_id")(comm_id=comm_id)
    jax.effects_barrier()
    return out


register_lowering(
    barrier_p, lambda ctx, *, comm_id: lower_comm_call(ctx, barrier_p.name, [],
                                                        {"comm_id": comm_id}))

# Completes after every op handed to the communication thread before it; in
# order with the other ops, and across calls in dispatch order.
fence_p = jex_core.Primitive(target("fence"))
fence_p.def_effectful_abstract_eval(
    lambda: (core.ShapedArray((), jnp.int32), {comm_effect}))
register_lowering(fence_p, lambda ctx: lower_comm_call(ctx, fence_p.name, [], {}))


@functools.cache
def _fence():
    return jit(fence_p.bind)


def wait_for_dispatched() -> None:
    """Blocks until the communication of every computation this thread has
    dispatched so far has finished (PjRt runs them in dispatch order)."""
    if runtime.is_initialized():
        _fence()().block_until_ready()


runtime.on_shutdown("fence", wait_for_dispatched)
