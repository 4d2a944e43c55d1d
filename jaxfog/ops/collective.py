"""Global collectives: allreduce (sum/mean), broadcast, allgather.

Linear, like the neighbor ops: jvp applies the op to tangents; the adjoint of
a sum (mean) allreduce is the same allreduce, of a broadcast a sum delivered
to the root, of an allgather each rank's block of the summed cotangents.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import core
from jax.interpreters import ad, batching

from jaxfog import _context, runtime
from jaxfog.ops._primitive import (check_leaves, define, linear_jvp, linear_transpose,
                                   ready, signature)
from jaxfog.ops.neighbor import _move_batch_to_axis1


def _same_avals(*avals, **params):
    return [core.ShapedArray(a.shape, a.dtype) for a in avals]


allreduce_p = define(
    "jaxfog_allreduce", "jaxfog_allreduce", _same_avals,
    lambda avals, *, mean, comm_id: {"comm_id": comm_id, "mean": mean,
                                     "signature": signature("allreduce", avals)})

broadcast_p = define(
    "jaxfog_broadcast", "jaxfog_broadcast", _same_avals,
    lambda avals, *, root, comm_id: {"comm_id": comm_id, "root": root,
                                     "signature": signature("broadcast", avals)})

allgather_p = define(
    "jaxfog_allgather", "jaxfog_allgather",
    lambda *avals, size, comm_id: [
        core.ShapedArray((size * (a.shape or (1,))[0], *a.shape[1:]), a.dtype)
        for a in avals],
    lambda avals, *, size, comm_id: {"comm_id": comm_id,
                                     "signature": signature("allgather", avals)})

for _p in (allreduce_p, broadcast_p, allgather_p):
    ad.primitive_jvps[_p] = linear_jvp(_p, 0)


ad.primitive_transposes[allreduce_p] = linear_transpose(
    lambda static, cts, xs, **params: allreduce_p.bind(*cts, **params))


def _broadcast_adjoint(static, cts, xs, *, root, comm_id):
    summed = allreduce_p.bind(*cts, mean=False, comm_id=comm_id)
    is_root = runtime.rank() == root if comm_id == runtime.WORLD_COMM_ID else (
        runtime.local_rank() == root)
    return [s if is_root else jnp.zeros_like(s) for s in summed]


ad.primitive_transposes[broadcast_p] = linear_transpose(_broadcast_adjoint)


def _allgather_adjoint(static, cts, xs, *, size, comm_id):
    summed = allreduce_p.bind(*cts, mean=False, comm_id=comm_id)
    rank = runtime.rank()
    outs = []
    for s, x in zip(summed, xs):
        block = (x.aval.shape or (1,))[0]
        piece = jax.lax.slice_in_dim(s, rank * block, (rank + 1) * block, axis=0)
        outs.append(piece.reshape(x.aval.shape))
    return outs


ad.primitive_transposes[allgather_p] = linear_transpose(_allgather_adjoint)


def _elementwise_batch(prim):
    def rule(args, dims, **params):
        return prim.bind(*args, **params), list(dims)

    return rule


batching.primitive_batchers[allreduce_p] = _elementwise_batch(allreduce_p)
batching.primitive_batchers[broadcast_p] = _elementwise_batch(broadcast_p)


def _allgather_batch(args, dims, *, size, comm_id):
    moved, batched = zip(*(_move_batch_to_axis1(x, d) for x, d in zip(args, dims)))
    outs = allgather_p.bind(*moved, size=size, comm_id=comm_id)
    return outs, [1 if b else None for b in batched]


batching.primitive_batchers[allgather_p] = _allgather_batch


def _leaves(op: str, x: Any):
    """Flat checked leaves; requires init unless agents are being simulated."""
    if _context.current() is None:
        ready()
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    check_leaves(op, leaves)
    return leaves, treedef


def _simulated(op: str, leaves, **params):
    """The op on simulated agents, or None outside ``jaxfog.simulate``."""
    sim = _context.current()
    if sim is None:
        return None
    from jaxfog import sim as simulation

    return getattr(simulation, op)(leaves, sim, **params)


def allreduce_leaves(leaves, *, mean: bool, comm_id: int) -> list:
    return allreduce_p.bind(*leaves, mean=mean, comm_id=comm_id)


def allreduce(x: Any, op: str = "mean", *, name: str | None = None) -> Any:
    """Sum or mean over all ranks (``op="mean"`` or ``"sum"``).

    Integer means are rounded to nearest (ties to even). A pytree is one
    message per dtype.
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"allreduce: op must be 'mean' or 'sum', got {op!r}")
    leaves, treedef = _leaves("allreduce", x)
    outs = _simulated("allreduce", leaves, mean=op == "mean")
    if outs is None:
        outs = allreduce_leaves(leaves, mean=op == "mean", comm_id=runtime.WORLD_COMM_ID)
    return jax.tree.unflatten(treedef, outs)


def broadcast_leaves(leaves, *, root: int, comm_id: int) -> list:
    return broadcast_p.bind(*leaves, root=root, comm_id=comm_id)


def broadcast(x: Any, root: int = 0, *, name: str | None = None) -> Any:
    """Every rank gets ``x`` of rank ``root`` (the pytree as one message)."""
    leaves, treedef = _leaves("broadcast", x)
    size = runtime.size()
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"broadcast: root must be a rank in [0, {size}), got {root!r}")
    outs = _simulated("broadcast", leaves, root=root)
    if outs is None:
        outs = broadcast_leaves(leaves, root=root, comm_id=runtime.WORLD_COMM_ID)
    return jax.tree.unflatten(treedef, outs)


def allgather(x: Any, *, name: str | None = None) -> Any:
    """Concatenates every rank's ``x`` along axis 0, in rank order.

    All ranks must pass the same shapes (a scalar counts as shape ``(1,)``).
    """
    leaves, treedef = _leaves("allgather", x)
    outs = _simulated("allgather", leaves)
    if outs is None:
        outs = allgather_p.bind(*leaves, size=runtime.size(), comm_id=runtime.WORLD_COMM_ID)
    return jax.tree.unflatten(treedef, outs)
