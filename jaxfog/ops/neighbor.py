"""Neighbor averaging and neighbor allgather (BlueFog's neighbor collectives).

Both are linear, so their rules are short: jvp applies the op to tangents,
the transpose is the adjoint (cotangents travel back along the same edges
with the same weights), and vmap sends one message for the whole batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.interpreters import ad, batching

from jaxfog import _context, runtime
from jaxfog import topology as T
from jaxfog.ops import _plan
from jaxfog.ops._primitive import (check_leaves, define, linear_jvp, linear_transpose,
                                   ready, signature)

# --- neighbor_allreduce ----------------------------------------------------


def _allreduce_attributes(avals_in, *, plan: _plan.Plan, comm_id: int) -> dict:
    return {"comm_id": comm_id, "signature": signature("neighbor_allreduce", avals_in[1:]),
            **plan.attributes()}


neighbor_allreduce_p = define(
    "jaxfog_neighbor_allreduce", "jaxfog_neighbor_allreduce",
    lambda step, *avals, plan, comm_id: [core.ShapedArray(a.shape, a.dtype) for a in avals],
    _allreduce_attributes)


ad.primitive_jvps[neighbor_allreduce_p] = linear_jvp(neighbor_allreduce_p, 1)


ad.primitive_transposes[neighbor_allreduce_p] = linear_transpose(
    lambda static, cts, xs, *, plan, comm_id: neighbor_allreduce_p.bind(
        *static, *cts, plan=plan.transpose(), comm_id=comm_id), n_static=1)


def _allreduce_batch(args, dims, *, plan, comm_id):
    if dims[0] is not None:
        raise ValueError("jaxfog.neighbor_allreduce: `step` cannot be batched by vmap; "
                         "every agent of a process takes the same step")
    return neighbor_allreduce_p.bind(*args, plan=plan, comm_id=comm_id), list(dims[1:])


batching.primitive_batchers[neighbor_allreduce_p] = _allreduce_batch


def _step_operand(step: Any, plan: _plan.Plan) -> jax.Array:
    if step is None:
        step = 0
    step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(f"neighbor_allreduce: step must be an integer scalar, got "
                        f"{step.dtype}{list(step.shape)}")
    return step.astype(jnp.int32)


def build_plan(topology: Any, rank: int, self_weight: Any, src_weights: Any,
               dst_weights: Any, current: T.Topology, what: str) -> _plan.Plan:
    """The plan for one call from its (topology, weights) arguments."""
    local_view = not (self_weight is None and src_weights is None and dst_weights is None)
    if isinstance(topology, T.Schedule):
        if local_view:
            raise ValueError(f"{what}: with a Schedule the weights come from it; do not "
                             "also give self_weight/src_weights/dst_weights")
        graph: Any = topology
    elif topology is None:
        graph = current
    elif isinstance(topology, T.Topology):
        graph = topology
    else:
        raise TypeError(f"{what}: topology must be a Topology or a Schedule, got "
                        f"{type(topology).__name__}")
    if graph.size != current.size:
        raise ValueError(f"{what}: the topology has {graph.size} nodes but there are "
                         f"{current.size} ranks")
    if local_view:
        return _plan.from_local_view(graph, rank, self_weight, src_weights, dst_weights)
    return _plan.from_topology(graph, rank)


def neighbor_allreduce_leaves(leaves: Sequence[Any], plan: _plan.Plan, step: Any,
                              comm_id: int) -> list:
    """The primitive on flat leaves (one fused message per peer)."""
    return neighbor_allreduce_p.bind(_step_operand(step, plan), *leaves, plan=plan,
                                     comm_id=comm_id)


def neighbor_allreduce(x: Any, *, self_weight: float | None = None,
                       src_weights: dict[int, float] | None = None,
                       dst_weights: dict[int, float] | Sequence[int] | None = None,
                       topology: T.Topology | T.Schedule | None = None, step: Any = None,
                       check_topology: bool = False, name: str | None = None) -> Any:
    """Weighted average with graph neighbours: row ``rank`` of ``W @ X``.

    On rank i the result is
    ``self_weight * x_i + sum_{j in src} src_weights[j] * d_j(i) * x_j``
    where ``d_j(i)`` is sender j's dst weight for i (1.0 if it gave none).

    Modes:
      * static: no weights; the current topology's row of W (or ``topology=``).
      * local view (BlueFog's forms): ``self_weight`` with ``src_weights``
        (pull: the senders are the static in-neighbours), with ``dst_weights``
        (push: receive from the static in-neighbours), or with both (push-pull:
        any ranks, also outside the static graph, empty lists allowed).
        ``dst_weights`` may be a list of ranks (weight 1.0 each).
      * scheduled: ``topology=`` a ``Schedule`` and ``step=`` an integer, traced
        or not; the entry ``step % period`` is chosen when the op runs, so a
        time-varying graph inside ``lax.scan`` compiles once.

    Args:
      x: an array or a pytree of arrays (float16, bfloat16, float32, float64,
        complex64/128, int32, int64; integers are averaged in float64 and
        rounded to nearest, ties to even). A pytree travels as one message
        per peer.
      check_topology: check, at trace time and collectively, that every rank
        sends exactly to the ranks that receive from it; a mismatch raises
        ValueError on every rank naming the ranks.
      name: accepted for BlueFog compatibility; used in error messages.

    Differentiable (the adjoint averages with ``W^T``) and batchable (one
    message for the whole batch).
    """
    what = f"neighbor_allreduce{f' ({name})' if name else ''}"
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    check_leaves("neighbor_allreduce", leaves)
    if isinstance(topology, T.Schedule) and step is None:
        raise ValueError(f"{what}: a Schedule needs step= (a Python or traced integer)")
    sim = _context.current()
    if sim is not None:
        from jaxfog import sim as simulation

        return jax.tree.unflatten(treedef, simulation.neighbor_allreduce(
            leaves, sim, topology=topology, step=step, self_weight=self_weight,
            src_weights=src_weights, dst_weights=dst_weights))
    ready()
    rank = runtime.rank()
    plan = build_plan(topology, rank, self_weight, src_weights, dst_weights,
                      runtime.load_topology(), what)
    if check_topology:
        _plan.check_matching(plan, runtime.communicator(), rank, what)
    outs = neighbor_allreduce_leaves(leaves, plan, step, runtime.WORLD_COMM_ID)
    return jax.tree.unflatten(treedef, outs)


# --- neighbor_allgather ----------------------------------------------------


def _gathered(aval, k: int) -> core.ShapedArray:
    shape = aval.shape or (1,)
    return core.ShapedArray((k * shape[0], *shape[1:]), aval.dtype)


def _block(aval, k: int) -> core.ShapedArray:
    return core.ShapedArray((aval.shape[0] // k, *aval.shape[1:]), aval.dtype)


def _gather_attributes(op):
    def attributes(avals_in, *, send_ranks, recv_ranks, out_shapes, comm_id):
        blocks = out_shapes if op == "neighbor_reduce_scatter" else [a.shape for a in avals_in]
        avals = [core.ShapedArray(s, a.dtype) for s, a in zip(blocks, avals_in)]
        return {"comm_id": comm_id, "signature": signature("neighbor_allgather", avals),
                "send_ranks": np.array(send_ranks, np.int64),
                "recv_ranks": np.array(recv_ranks, np.int64)}

    return attributes


neighbor_allgather_p = define(
    "jaxfog_neighbor_allgather", "jaxfog_neighbor_allgather",
    lambda *avals, send_ranks, recv_ranks, out_shapes, comm_id: [
        core.ShapedArray(s, a.dtype) for s, a in zip(out_shapes, avals)],
    _gather_attributes("neighbor_allgather"))

# Its adjoint: block i of each input goes back to send_ranks[i]; the blocks
# received are summed.
neighbor_reduce_scatter_p = define(
    "jaxfog_neighbor_reduce_scatter", "jaxfog_neighbor_reduce_scatter",
    lambda *avals, send_ranks, recv_ranks, out_shapes, comm_id: [
        core.ShapedArray(s, a.dtype) for s, a in zip(out_shapes, avals)],
    _gather_attributes("neighbor_reduce_scatter"))

ad.primitive_jvps[neighbor_allgather_p] = linear_jvp(neighbor_allgather_p, 0)
ad.primitive_jvps[neighbor_reduce_scatter_p] = linear_jvp(neighbor_reduce_scatter_p, 0)


def _gather_transpose(adjoint):
    """Swap the directions: what was sent comes back, what came in goes out."""
    def back(static, cts, xs, *, send_ranks, recv_ranks, out_shapes, comm_id):
        return adjoint.bind(*cts, send_ranks=recv_ranks, recv_ranks=send_ranks,
                            out_shapes=tuple(x.aval.shape for x in xs), comm_id=comm_id)

    return linear_transpose(back)


ad.primitive_transposes[neighbor_allgather_p] = _gather_transpose(neighbor_reduce_scatter_p)
ad.primitive_transposes[neighbor_reduce_scatter_p] = _gather_transpose(neighbor_allgather_p)


def _move_batch_to_axis1(x, dim):
    """Puts the batch axis second, so that blocks along axis 0 stay contiguous."""
    if dim is None:
        return x, False
    x = jnp.moveaxis(x, dim, 0)
    if x.ndim == 1:
        return x[None, :], True
    return jnp.moveaxis(x, 0, 1), True


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


batching.primitive_batchers[neighbor_allgather_p] = _gather_batch(neighbor_allgather_p)
batching.primitive_batchers[neighbor_reduce_scatter_p] = _gather_batch(
    neighbor_reduce_scatter_p)


def _gather_ranks(ranks: Any, size: int, rank: int, what: str) -> tuple[int, ...]:
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{what} must be a list of ranks, got {type(ranks).__name__}")
    ranks = list(ranks)
    _plan._ranks(ranks, size, rank, what)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} lists a rank twice: {ranks}")
    return tuple(int(r) for r in ranks)


def neighbor_allgather(x: Any, *, src_ranks: Sequence[int] | None = None,
                       dst_ranks: Sequence[int] | None = None,
                       name: str | None = None) -> Any:
    """Concatenates the neighbours' values along axis 0.

    The result on rank i stacks ``x_j`` for j in ``src_ranks`` in that order
    (default: the current topology's in-neighbours, ascending); every rank
    sends its ``x`` to ``dst_ranks`` (default: its out-neighbours). A scalar
    counts as shape ``(1,)``. Every neighbour must have the same shapes.
    Linear: the adjoint sums each block back to the rank it came from.
    """
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    check_leaves("neighbor_allgather", leaves)
    sim = _context.current()
    if sim is not None:
        from jaxfog import sim as simulation

        return jax.tree.unflatten(treedef, simulation.neighbor_allgather(
            leaves, sim, src_ranks=src_ranks))
    ready()
    rank, size, topo = runtime.rank(), runtime.size(), runtime.load_topology()
    recv = (tuple(topo.in_neighbors(rank)) if src_ranks is None
            else _gather_ranks(src_ranks, size, rank, "neighbor_allgather: src_ranks"))
    send = (tuple(topo.out_neighbors(rank)) if dst_ranks is None
            else _gather_ranks(dst_ranks, size, rank, "neighbor_allgather: dst_ranks"))
    out_shapes = tuple(_gathered(jax.typeof(leaf), len(recv)).shape for leaf in leaves)
    outs = neighbor_allgather_p.bind(*leaves, send_ranks=send, recv_ranks=recv,
                                     out_shapes=out_shapes, comm_id=runtime.WORLD_COMM_ID)
    return jax.tree.unflatten(treedef, outs)
