"""The FFI backend's primitives: one per entry of the C++ op table.

Each primitive lowers to the custom call ``jaxfog_<op>`` (see
``jaxfog/ffi/ops.h``) and carries jaxfog's ordered communication effect. Its
rules live beside it. Every op is linear in its data operands, so the rules
are short:

* jvp applies the op to the tangents;
* the transpose is the adjoint: neighbor averaging with ``W^T`` (cotangents
  travel back along the same edges with the same weights), a sum allreduce
  itself, a broadcast a sum delivered to the root, an allgather (neighbor or
  global) each rank's block of the summed cotangents;
* vmap sends one message for the whole batch.

Parameters are static and hashable: plans, ranks, shapes and the id of the
communicator the op runs on (``runtime.WORLD_COMM_ID`` and friends).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxfog import runtime
from jaxfog.ops import _nccl, _plan
from jaxfog.ops.jit import jit
from jaxfog.ops._primitive_machinery import (GENERIC_LOWERINGS, comm_effect, define, linear_jvp,
                                   linear_transpose, lower_comm_call, message,
                                   not_differentiable, register_lowering, target)


class Adjoint(NamedTuple):
    """An op's adjoint as one op and a local step after it (for the
    nonblocking ops, which start the op and finish with ``post`` at the wait):
    ``post(adjoint_prim.bind(*static, *cotangents, **params))``."""

    prim: jex_core.Primitive
    params: dict
    static: list  # operands before the cotangents (the step of a schedule)
    post: Callable[[list], list]


#: Each linear primitive's adjoint as an :class:`Adjoint`:
#: ``ADJOINTS[prim](static, params, avals_in)`` (``avals_in``: its data operands').
ADJOINTS: dict[jex_core.Primitive, Callable[..., Adjoint]] = {}


def _unchanged(outs: list) -> list:
    return outs


def _same_avals(*avals, **params) -> list:
    return [core.ShapedArray(a.shape, a.dtype) for a in avals]


def _elementwise_batch(prim):
    def rule(args, dims, **params):
        return prim.bind(*args, **params), list(dims)

    return rule


def _move_batch_to_axis1(x, dim):
    """Puts the batch axis second, so that blocks along axis 0 stay contiguous."""
    if dim is None:
        return x, False
    x = jnp.moveaxis(x, dim, 0)
    if x.ndim == 1:
        return x[None, :], True
    return jnp.moveaxis(x, 0, 1), True


# --- neighbor_allreduce: out_i = sum_j W[i, j] x_j for this rank's plan ------


def _allreduce_attributes(avals_in, *, plan: _plan.Plan, comm_id: int) -> dict:
    return {"comm_id": comm_id, **message("neighbor_allreduce", avals_in[1:]),
            **plan.attributes()}


# Operands: the step (an int32 scalar choosing the plan's entry), then the leaves.
neighbor_allreduce_p = define(
    "neighbor_allreduce",
    lambda step, *avals, plan, comm_id: _same_avals(*avals), _allreduce_attributes)
ad.primitive_jvps[neighbor_allreduce_p] = linear_jvp(neighbor_allreduce_p, 1)
ad.primitive_transposes[neighbor_allreduce_p] = linear_transpose(
    lambda static, cts, xs, *, plan, comm_id: neighbor_allreduce_p.bind(
        *static, *cts, plan=plan.transpose(), comm_id=comm_id), n_static=1)


ADJOINTS[neighbor_allreduce_p] = lambda static, params, avals: Adjoint(
    neighbor_allreduce_p, {**params, "plan": params["plan"].transpose()}, list(static),
    _unchanged)


def _neighbor_allreduce_batch(args, dims, *, plan, comm_id):
    if dims[0] is not None:
        raise ValueError("jaxfog.neighbor_allreduce: `step` cannot be batched by vmap; "
                         "every agent of a process takes the same step")
    return neighbor_allreduce_p.bind(*args, plan=plan, comm_id=comm_id), list(dims[1:])


batching.primitive_batchers[neighbor_allreduce_p] = _neighbor_allreduce_batch


# --- neighbor_allgather and its adjoint, neighbor_reduce_scatter ------------


def _gather_attributes(op: str):
    def attributes(avals_in, *, send_ranks, recv_ranks, out_shapes, comm_id):
        blocks = out_shapes if op == "neighbor_reduce_scatter" else [a.shape for a in avals_in]
        avals = [core.ShapedArray(s, a.dtype) for s, a in zip(blocks, avals_in)]
        return {"comm_id": comm_id, **message("neighbor_allgather", avals),
                "send_ranks": np.array(send_ranks, np.int64),
                "recv_ranks": np.array(recv_ranks, np.int64)}

    return attributes


def _shaped_as(*avals, send_ranks, recv_ranks, out_shapes, comm_id) -> list:
    return [core.ShapedArray(s, a.dtype) for s, a in zip(out_shapes, avals)]


neighbor_allgather_p = define("neighbor_allgather", _shaped_as,
                              _gather_attributes("neighbor_allgather"))
# Block i of each input goes back to send_ranks[i]; the blocks received are summed.
neighbor_reduce_scatter_p = define("neighbor_reduce_scatter", _shaped_as,
                                   _gather_attributes("neighbor_reduce_scatter"))


def _gather_transpose(adjoint):
    """Swap the directions: what was sent comes back, what came in goes out."""
    def back(static, cts, xs, *, send_ranks, recv_ranks, out_shapes, comm_id):
        return adjoint.bind(*cts, send_ranks=recv_ranks, recv_ranks=send_ranks,
                            out_shapes=tuple(x.aval.shape for x in xs), comm_id=comm_id)

    return linear_transpose(back)


def _gather_batch(prim):
    def rule(args, dims, *, send_ranks, recv_ranks, out_shapes, comm_id):
        moved, batched = zip(*(_move_batch_to_axis1(x, d) for x, d in zip(args, dims)))
        shapes = []
        for x, was_batched, shape in zip(moved, batched, out_shapes):
            if was_batched:
                shape = shape or (1,)
                shapes.append((shape[0], x.shape[1], *shape[1:]))
            else:
                shapes.append(shape)
        outs = prim.bind(*moved, send_ranks=send_ranks, recv_ranks=recv_ranks,
                         out_shapes=tuple(shapes), comm_id=comm_id)
        dims_out = [1 if b else None for b in batched]
        for i, (b, shape) in enumerate(zip(batched, out_shapes)):
            if b and shape == ():  # a scalar per example came back as (1, batch)
                outs[i], dims_out[i] = outs[i][0], 0
        return outs, dims_out

    return rule


def _gather_adjoint(adjoint):
    def rule(static, params, avals):
        return Adjoint(adjoint, {"send_ranks": params["recv_ranks"],
                                 "recv_ranks": params["send_ranks"],
                                 "out_shapes": tuple(a.shape for a in avals),
                                 "comm_id": params["comm_id"]}, [], _unchanged)

    return rule


for _prim, _adjoint in ((neighbor_allgather_p, neighbor_reduce_scatter_p),
                        (neighbor_reduce_scatter_p, neighbor_allgather_p)):
    ad.primitive_jvps[_prim] = linear_jvp(_prim, 0)
    ad.primitive_transposes[_prim] = _gather_transpose(_adjoint)
    batching.primitive_batchers[_prim] = _gather_batch(_prim)
    ADJOINTS[_prim] = _gather_adjoint(_adjoint)


# --- global collectives ------------------------------------------------------

allreduce_p = define(
    "allreduce", _same_avals,
    lambda avals, *, mean, comm_id: {"comm_id": comm_id, "mean": mean,
                                     **message("allreduce", avals)})
broadcast_p = define(
    "broadcast", _same_avals,
    lambda avals, *, root, comm_id: {"comm_id": comm_id, "root": root,
                                     **message("broadcast", avals)})
allgather_p = define(
    "allgather",
    lambda *avals, size, comm_id: [
        core.ShapedArray((size * (a.shape or (1,))[0], *a.shape[1:]), a.dtype)
        for a in avals],
    lambda avals, *, size, comm_id: {"comm_id": comm_id,
                                     **message("allgather", avals)})

for _prim in (allreduce_p, broadcast_p, allgather_p):
    ad.primitive_jvps[_prim] = linear_jvp(_prim, 0)


ad.primitive_transposes[allreduce_p] = linear_transpose(
    lambda static, cts, xs, **params: allreduce_p.bind(*cts, **params))


def _rank_in(comm_id: int) -> int:
    """This process's rank in the communicator registered under ``comm_id``."""
    return {runtime.WORLD_COMM_ID: runtime.rank, runtime.LOCAL_COMM_ID: runtime.local_rank,
            runtime.LEADERS_COMM_ID: runtime.machine_rank}[comm_id]()


def _broadcast_adjoint(static, params, avals) -> Adjoint:
    """A sum delivered to the root."""
    is_root = _rank_in(params["comm_id"]) == params["root"]
    return Adjoint(allreduce_p, {"mean": False, "comm_id": params["comm_id"]}, [],
                   _unchanged if is_root else lambda outs: [jnp.zeros_like(o) for o in outs])


def _allgather_adjoint(static, params, avals) -> Adjoint:
    """Each rank's block of the summed cotangents."""
    rank = _rank_in(params["comm_id"])

    def block(summed):
        outs = []
        for s, aval in zip(summed, avals):
            rows = (aval.shape or (1,))[0]
            piece = jax.lax.slice_in_dim(s, rank * rows, (rank + 1) * rows, axis=0)
            outs.append(piece.reshape(aval.shape))
        return outs

    return Adjoint(allreduce_p, {"mean": False, "comm_id": params["comm_id"]}, [], block)


def _blocking_transpose(adjoint_rule):
    """The transpose rule that runs an :class:`Adjoint` at once."""
    def back(static, cts, xs, **params):
        adjoint = adjoint_rule(static, params, [x.aval for x in xs])
        return adjoint.post(adjoint.prim.bind(*adjoint.static, *cts, **adjoint.params))

    return linear_transpose(back)


def _allgather_batch(args, dims, *, size, comm_id):
    moved, batched = zip(*(_move_batch_to_axis1(x, d) for x, d in zip(args, dims)))
    outs = allgather_p.bind(*moved, size=size, comm_id=comm_id)
    return outs, [1 if b else None for b in batched]


ADJOINTS[allreduce_p] = lambda static, params, avals: Adjoint(allreduce_p, params, [],
                                                              _unchanged)
ADJOINTS[broadcast_p] = _broadcast_adjoint
ADJOINTS[allgather_p] = _allgather_adjoint
ad.primitive_transposes[broadcast_p] = _blocking_transpose(_broadcast_adjoint)
ad.primitive_transposes[allgather_p] = _blocking_transpose(_allgather_adjoint)
batching.primitive_batchers[allreduce_p] = _elementwise_batch(allreduce_p)
batching.primitive_batchers[broadcast_p] = _elementwise_batch(broadcast_p)
batching.primitive_batchers[allgather_p] = _allgather_batch


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
win_update_p = define("win_update", _same_avals, _window_attributes)
win_get_p = define("win_get", _same_avals, _window_attributes)
# win_state: this rank's version counters (one per slot) and push-sum weight.
win_state_p = define(
    "win_state",
    lambda *, win_id, slots: [
        core.ShapedArray((slots,), jax.dtypes.canonicalize_dtype(np.int64)),
        core.ShapedArray((), jax.dtypes.canonicalize_dtype(np.float64))],
    lambda avals_in, *, win_id, slots: {"win_id": win_id})
for _prim in (win_put_p, win_accumulate_p, win_update_p):
    ad.primitive_jvps[_prim] = _not_differentiable(_prim)


# On CUDA with the NCCL transport up, the primitives jaxfog.ops._nccl has a
# rule for lower to NCCL; otherwise, and every other primitive, to the
# host-staged custom call.
for _prim in GENERIC_LOWERINGS:
    if _prim.name.removeprefix("jaxfog_") in _nccl.RULES:
        mlir.register_lowering(_prim, _nccl.lowering, platform="cuda")
