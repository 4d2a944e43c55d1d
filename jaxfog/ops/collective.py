"""Global collectives: allreduce (sum or mean), broadcast, allgather.

Each op in one block: its resolved arguments, its primitive (the custom call
``jaxfog_<op>`` of the C++ op table, ``jaxfog/ffi/ops.h``) with its rules
(jvp; transpose: a sum allreduce is its own adjoint, a broadcast's is a sum
delivered to the root, an allgather's each rank's block of the summed
cotangents; vmap: one message for the batch; the NCCL lowering), its call on
MPI processes, its rule on simulated agents (``lax`` collectives over the
agent axis), its :class:`~jaxfog.ops._backends.Op` record holding both rules,
and its public blocking and nonblocking functions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import core
from jax.interpreters import ad, batching

from jaxfog import _context, runtime
from jaxfog import _validate as V
from jaxfog.ffi import _nccl_setup
from jaxfog.ops import _args, _dispatch, _nccl, _numerics, nonblocking
from jaxfog.ops._backends import Op
from jaxfog.ops._call import Call
from jaxfog.ops._primitive_machinery import (ADJOINTS, Adjoint, blocking_transpose, define,
                                             elementwise_batch, linear_jvp, linear_transpose,
                                             message, move_batch_to_axis1, rank_in, same_avals,
                                             unchanged)
from jaxfog.ops.nonblocking import Handle
from jaxfog.simulation import _clock, _mixing


# --- allreduce: the sum or the mean over all ranks ----------------------------


class Allreduce(NamedTuple):
    """Resolved arguments of ``allreduce``."""

    mean: bool
    what: str


def _allreduce_args(*, op: str, name: str | None) -> Allreduce:
    what = _args.call_name("allreduce", name)
    if not isinstance(op, str):
        raise TypeError(f"{what}: op must be 'mean' or 'sum', got {type(op).__name__} {op!r}")
    if op not in ("mean", "sum"):
        raise ValueError(f"{what}: op must be 'mean' or 'sum', got {op!r}")
    return Allreduce(op == "mean", what)


allreduce_p = define(
    "allreduce", same_avals,
    lambda avals, *, mean, comm_id: {"comm_id": comm_id, "mean": mean,
                                     **message("allreduce", avals)})
ad.primitive_jvps[allreduce_p] = linear_jvp(allreduce_p, 0)
ad.primitive_transposes[allreduce_p] = linear_transpose(
    lambda static, cts, xs, **params: allreduce_p.bind(*cts, **params))
ADJOINTS[allreduce_p] = lambda static, params, avals: Adjoint(allreduce_p, params, [], unchanged)
batching.primitive_batchers[allreduce_p] = elementwise_batch(allreduce_p)


def _allreduce_nccl(ctx, *xs, mean, comm_id):
    if (mean and _nccl.integer(ctx.avals_in)) or any(
            jnp.issubdtype(a.dtype, jnp.complexfloating) for a in ctx.avals_in):
        return None
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID,
                  **message("allreduce", ctx.avals_in)}
    sums = _nccl.nccl_call(ctx, "allreduce", xs, ctx.avals_in, ctx.avals_out, attributes)
    if not mean:
        return sums
    scale = 1.0 / runtime.size()
    return _nccl.lower_fn(
        ctx, lambda *ss: [(s.astype(_nccl.accumulator(s.dtype)) * scale).astype(s.dtype)
                          for s in ss], sums, ctx.avals_out, ctx.avals_out)


_nccl.register(allreduce_p, _allreduce_nccl)


def _allreduce_call(leaves: list, args: Allreduce) -> Call:
    return Call(allreduce_p, list(leaves),
                {"mean": args.mean, "comm_id": runtime.WORLD_COMM_ID})


def _allreduce_on_agents(sim: _context.Simulation, leaves: list, treedef: Any,
                         args: Any) -> list:
    _clock.synchronize()
    outs = []
    for x in leaves:
        if not args.mean and jnp.issubdtype(x.dtype, jnp.integer):
            outs.append(sim.psum(x))  # exact, as MPI's integer sum
            continue
        with _numerics.accumulating(x.dtype) as acc:
            total = sim.psum(x.astype(acc))
            outs.append(_numerics.finish(total / sim.size if args.mean else total, x.dtype))
    return outs


ALLREDUCE = Op("allreduce", simulated=_allreduce_on_agents,
               mpi=lambda leaves, treedef, args: _allreduce_call(leaves, args))


def allreduce(x: Any, op: str = "mean", *, name: str | None = None) -> Any:
    r"""Sum or mean over all ranks: :math:`y = \sum_j x_j` or :math:`\frac1n \sum_j x_j`.

    Args:
      x: an array or a pytree (one message per dtype).
      op: ``"mean"`` or ``"sum"``.
      name: a name for error messages.

    Returns:
      The same value on every rank. Integer means are rounded to nearest,
      ties to even; integer sums are exact.

    Its adjoint is the same allreduce, so gradient averaging composes with
    ``jax.grad``.

    Example::

        mean_loss = jaxfog.allreduce(loss)
    """
    return _dispatch.apply(ALLREDUCE, x, _allreduce_args(op=op, name=name))


def allreduce_nonblocking(x: Any, op: str = "mean", *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.allreduce` (same arguments)."""
    return nonblocking.start(ALLREDUCE, x, _allreduce_args(op=op, name=name))


# --- broadcast: every rank gets the root's value -------------------------------


class Broadcast(NamedTuple):
    """Resolved arguments of ``broadcast``."""

    root: int
    what: str


def _broadcast_args(*, root: Any, name: str | None) -> Broadcast:
    what = _args.call_name("broadcast", name)
    size = runtime.size()
    root = V.integer(what, "root", root, minimum=0)
    if root >= size:
        raise ValueError(f"{what}: root must be a rank in [0, {size}), got {root}")
    return Broadcast(root, what)


broadcast_p = define(
    "broadcast", same_avals,
    lambda avals, *, root, comm_id: {"comm_id": comm_id, "root": root,
                                     **message("broadcast", avals)})
ad.primitive_jvps[broadcast_p] = linear_jvp(broadcast_p, 0)


def _broadcast_adjoint(static, params, avals) -> Adjoint:
    """A sum delivered to the root."""
    is_root = rank_in(params["comm_id"]) == params["root"]
    return Adjoint(allreduce_p, {"mean": False, "comm_id": params["comm_id"]}, [],
                   unchanged if is_root else lambda outs: [jnp.zeros_like(o) for o in outs])


ADJOINTS[broadcast_p] = _broadcast_adjoint
ad.primitive_transposes[broadcast_p] = blocking_transpose(_broadcast_adjoint)
batching.primitive_batchers[broadcast_p] = elementwise_batch(broadcast_p)


def _broadcast_nccl(ctx, *xs, root, comm_id):
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID, "root": root,
                  **message("broadcast", ctx.avals_in)}
    return _nccl.nccl_call(ctx, "broadcast", xs, ctx.avals_in, ctx.avals_out, attributes)


_nccl.register(broadcast_p, _broadcast_nccl)


def _broadcast_call(leaves: list, args: Broadcast) -> Call:
    return Call(broadcast_p, list(leaves),
                {"root": args.root, "comm_id": runtime.WORLD_COMM_ID})


def _broadcast_on_agents(sim: _context.Simulation, leaves: list, treedef: Any,
                         args: Any) -> list:
    _clock.synchronize()
    is_root = sim.rank == args.root
    # psum widens bool and small integers; the root's value keeps its dtype.
    return [sim.psum(jnp.where(is_root, x, jnp.zeros_like(x)))
            .astype(x.dtype) for x in leaves]


BROADCAST = Op("broadcast", simulated=_broadcast_on_agents,
               mpi=lambda leaves, treedef, args: _broadcast_call(leaves, args))


def broadcast(x: Any, root: int = 0, *, name: str | None = None) -> Any:
    """Every rank gets ``x`` of rank ``root``: ``y_i = x_root``.

    Args:
      x: an array or a pytree (one message).
      root: the rank whose value is sent.
      name: a name for error messages.

    Returns:
      ``x_root`` on every rank. The adjoint sums the cotangents to the root.

    Example::

        params = jaxfog.broadcast(params, root=0)  # same initial model everywhere
    """
    return _dispatch.apply(BROADCAST, x, _broadcast_args(root=root, name=name))


def broadcast_nonblocking(x: Any, root: int = 0, *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.broadcast` (same arguments)."""
    return nonblocking.start(BROADCAST, x, _broadcast_args(root=root, name=name))


# --- allgather: every rank's value, in rank order ------------------------------


class Allgather(NamedTuple):
    """Resolved arguments of ``allgather``."""

    what: str


def _allgather_args(*, name: str | None) -> Allgather:
    return Allgather(_args.call_name("allgather", name))


allgather_p = define(
    "allgather",
    lambda *avals, size, comm_id: [
        core.ShapedArray((size * (a.shape or (1,))[0], *a.shape[1:]), a.dtype)
        for a in avals],
    lambda avals, *, size, comm_id: {"comm_id": comm_id,
                                     **message("allgather", avals)})
ad.primitive_jvps[allgather_p] = linear_jvp(allgather_p, 0)


def _allgather_adjoint(static, params, avals) -> Adjoint:
    """Each rank's block of the summed cotangents."""
    rank = rank_in(params["comm_id"])

    def block(summed):
        outs = []
        for s, aval in zip(summed, avals):
            rows = (aval.shape or (1,))[0]
            piece = jax.lax.slice_in_dim(s, rank * rows, (rank + 1) * rows, axis=0)
            outs.append(piece.reshape(aval.shape))
        return outs

    return Adjoint(allreduce_p, {"mean": False, "comm_id": params["comm_id"]}, [], block)


def _allgather_batch(args, dims, *, size, comm_id):
    moved, batched = zip(*(move_batch_to_axis1(x, d) for x, d in zip(args, dims)))
    outs = allgather_p.bind(*moved, size=size, comm_id=comm_id)
    return outs, [1 if b else None for b in batched]


ADJOINTS[allgather_p] = _allgather_adjoint
ad.primitive_transposes[allgather_p] = blocking_transpose(_allgather_adjoint)
batching.primitive_batchers[allgather_p] = _allgather_batch


def _allgather_nccl(ctx, *xs, size, comm_id):
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID,
                  **message("allgather", ctx.avals_in)}
    return _nccl.nccl_call(ctx, "allgather", xs, ctx.avals_in, ctx.avals_out, attributes)


_nccl.register(allgather_p, _allgather_nccl)


def _allgather_call(leaves: list, args: Allgather) -> Call:
    return Call(allgather_p, list(leaves),
                {"size": runtime.size(), "comm_id": runtime.WORLD_COMM_ID})


def _allgather_on_agents(sim: _context.Simulation, leaves: list, treedef: Any,
                         args: Any) -> list:
    _clock.synchronize()
    return [_mixing.stack_blocks(sim.all_gather(x)) for x in leaves]


ALLGATHER = Op("allgather", simulated=_allgather_on_agents,
               mpi=lambda leaves, treedef, args: _allgather_call(leaves, args))


def allgather(x: Any, *, name: str | None = None) -> Any:
    """Concatenates every rank's ``x`` along axis 0, in rank order.

    Args:
      x: an array or a pytree; all ranks pass the same shapes (a scalar counts
        as shape ``(1,)``).
      name: a name for error messages.

    Returns:
      Each leaf of shape ``(size * d0, *rest)``; block r is rank r's value.

    Example::

        everyone = jaxfog.allgather(jnp.array([float(jaxfog.rank())]))  # [0., 1., ...]
    """
    return _dispatch.apply(ALLGATHER, x, _allgather_args(name=name))


def allgather_nonblocking(x: Any, *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.allgather` (same arguments)."""
    return nonblocking.start(ALLGATHER, x, _allgather_args(name=name))


__all__ = ["allgather", "allgather_nonblocking", "allreduce", "allreduce_nonblocking",
           "broadcast", "broadcast_nonblocking"]
