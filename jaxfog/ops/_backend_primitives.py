"""The primitives bound outside an op's own block: barrier, fence, and the
one-sided windows' (whose rules on MPI, ``_windows_mpi``, hold their state).

The message ops' primitives live in their ops' modules
(``jaxfog.ops.neighbor``, ``collective``), each beside its rules. These, like
them, lower to the custom call ``jaxfog_<op>`` of the C++ op table
(``jaxfog/ffi/ops.h``) and carry jaxfog's ordered communication effect; the
window ops are not differentiable (a write into another rank's memory has no
tangent).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.extend import core as jex_core
from jax.interpreters import ad

from jaxfog import runtime
from jaxfog.ops.jit import jit
from jaxfog.ops._primitive_machinery import (comm_effect, define, lower_comm_call,
                                             not_differentiable, register_lowering, same_avals,
                                             target)


# --- process-level: barrier, fence -----------------------------------------

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


# --- one-sided windows --------------------------------------------------------


def _window_attributes(avals_in, **params) -> dict:
    """Static tuples become the handler's array attributes (ranks and regions
    int64, weights float64)."""
    def attribute(key, value):
        if not isinstance(value, tuple):
            return value
        return np.array(value, np.float64 if key.endswith("weights") else np.int64)

    return {key: attribute(key, value) for key, value in params.items()}


def _not_differentiable(prim):
    def jvp(primals, tangents, **params):
        raise not_differentiable(prim)

    return jvp


# win_put / win_accumulate: the leaves go to the destinations' slots (no
# results: the caller computes self_weight * x). win_update: the weighted sum with the slots.
# win_get (no operands, no results): the sources' published values into the
# slots.
win_put_p = define("win_put", lambda *avals, **params: [], _window_attributes)
win_accumulate_p = define("win_accumulate", lambda *avals, **params: [], _window_attributes)
win_update_p = define("win_update", same_avals, _window_attributes)
win_get_p = define("win_get", same_avals, _window_attributes)
# win_state: this rank's version counters (one per slot) and push-sum weight.
win_state_p = define(
    "win_state",
    lambda *, win_id, slots: [
        core.ShapedArray((slots,), jax.dtypes.canonicalize_dtype(np.int64)),
        core.ShapedArray((), jax.dtypes.canonicalize_dtype(np.float64))],
    lambda avals_in, *, win_id, slots: {"win_id": win_id})
for _prim in (win_put_p, win_accumulate_p, win_update_p):
    ad.primitive_jvps[_prim] = _not_differentiable(_prim)
