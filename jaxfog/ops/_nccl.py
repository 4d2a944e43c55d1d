"""CUDA lowerings of the communicating primitives onto the NCCL transport.

The NCCL handlers only move data; what the CPU handlers compute around the
messages is left to XLA, which fuses it with the neighbouring GPU work:

* neighbor_allreduce: senders with weights other than 1 stack their scaled
  copies (one block per destination), the exchange returns the neighbours'
  blocks, and ``self_weight * x + sum_j w_j * block_j`` is ordinary XLA;
* neighbor_allgather: the exchange's blocks are the result;
* neighbor_reduce_scatter (allgather's adjoint): the blocks received are summed;
* allreduce: an NCCL sum, scaled by ``1/n`` for the mean; broadcast and
  allgather map onto NCCL directly.

Where NCCL is not in use (``runtime.gpu_backend() != "nccl"``), or for what
it does not cover, the primitive keeps its generic lowering: the same custom
call as on CPU, which XLA binds to the host-staged handler. NCCL leaves out
periodic schedules, the machine-level communicators, windows and barrier;
integer neighbour averages and means (the CPU kernels accumulate integers in
float64 and round half to even: XLA would truncate scaled integer sends, and
float32 loses integers above 2**24 where x64 is off); complex allreduce
(NCCL has no complex type).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import core
from jax.interpreters import mlir

from jaxfog import ffi, runtime
from jaxfog.ffi import _nccl_setup
from jaxfog.ops._primitive_machinery import GENERIC_LOWERINGS, lower_comm_call, message

def active(comm_id: int) -> bool:
    """Whether ops on communicator ``comm_id`` lower to NCCL (the world
    communicator, with the NCCL transport up)."""
    return (comm_id == runtime.WORLD_COMM_ID and runtime.is_initialized()
            and runtime.gpu_backend() == "nccl")


def _apply(ctx, fn: Callable, values: Sequence, avals_in: Sequence, avals_out: Sequence):
    """Lowers the pure function ``fn`` on ``values`` (XLA fuses it)."""
    sub = ctx.replace(avals_in=tuple(avals_in), avals_out=tuple(avals_out), tokens_out=None)
    return mlir.lower_fun(fn, multiple_results=True)(sub, *values)


def _call(ctx, op: str, values: Sequence, avals_in: Sequence, avals_out: Sequence,
          attributes: dict) -> list:
    """The custom call to ``op``'s NCCL handler (the op table's) on ``values``,
    in order with every other op."""
    sub = ctx.replace(avals_in=tuple(avals_in), avals_out=tuple(avals_out), tokens_out=None)
    results = lower_comm_call(sub, ffi.op_table()[op].nccl_target, values, attributes)
    ctx.set_tokens_out(sub.tokens_out)
    return results


def _shaped(shape, dtype) -> core.ShapedArray:
    return core.ShapedArray(tuple(shape), dtype)


def _accumulator(dtype):
    """Sums of 16-bit floats run in float32, as in the CPU kernels."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def _exchange(ctx, values, avals, *, op: str, send_ranks, recv_ranks, stacked: bool,
              block_shapes):
    """The neighbours' blocks, stacked: leaf l comes back as (R, *block_shapes[l]).
    ``op`` is the op the exchange serves: headers, comm_stats, the timeline
    and errors name it."""
    blocks = [_shaped(s, a.dtype) for s, a in zip(block_shapes, avals)]
    outs = [_shaped((len(recv_ranks), *s), a.dtype) for s, a in zip(block_shapes, avals)]
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID,
                  **message(f"nccl_{op}", blocks),
                  "send_ranks": np.array(send_ranks, np.int64),
                  "recv_ranks": np.array(recv_ranks, np.int64), "stacked": stacked,
                  "op": ffi.op_table()[op].code}
    return _call(ctx, op, values, avals, outs, attributes), outs


def _weighted(blocks, weights):
    """sum_j weights[j] * blocks[j] over axis 0, accumulated as the CPU kernels do
    (one fused XLA reduction, not a sum per neighbour)."""
    acc = _accumulator(blocks.dtype)
    w = jnp.asarray(weights, acc).reshape(-1, *([1] * (blocks.ndim - 1)))
    return (blocks.astype(acc) * w).sum(axis=0)


def _integer(avals) -> bool:
    return any(jnp.issubdtype(a.dtype, jnp.integer) for a in avals)


def _neighbor_allreduce(ctx, step, *xs, plan, comm_id):
    avals = ctx.avals_in[1:]
    if plan.period != 1 or _integer(avals):  # schedules pick their entry at run time
        return None
    (self_weight,), (sends,), (recvs,) = plan.self_weights, plan.sends, plan.recvs
    send_weights = [w for _, w in sends]
    stacked = any(w != 1.0 for w in send_weights)
    values, sent = list(xs), list(avals)
    if stacked:  # one scaled copy per destination
        def scale(*leaves):
            return [(x.astype(_accumulator(x.dtype))[None]
                     * jnp.asarray(send_weights, _accumulator(x.dtype)).reshape(
                         -1, *([1] * x.ndim))).astype(x.dtype) for x in leaves]
        sent = [_shaped((len(sends), *a.shape), a.dtype) for a in avals]
        values = _apply(ctx, scale, values, avals, sent)
    received, received_avals = _exchange(
        ctx, values, sent, op="neighbor_allreduce", send_ranks=[r for r, _ in sends],
        recv_ranks=[r for r, _ in recvs], stacked=stacked,
        block_shapes=[a.shape for a in avals])

    def mix(*leaves):
        own, blocks = leaves[:len(xs)], leaves[len(xs):]
        return [(x.astype(_accumulator(x.dtype)) * self_weight
                 + _weighted(b, [w for _, w in recvs])).astype(x.dtype)
                for x, b in zip(own, blocks)]

    return _apply(ctx, mix, [*xs, *received], [*avals, *received_avals], avals)


def _neighbor_allgather(ctx, *xs, send_ranks, recv_ranks, out_shapes, comm_id):
    avals = ctx.avals_in
    received, received_avals = _exchange(ctx, xs, avals, op="neighbor_allgather",
                                         send_ranks=send_ranks,
                                         recv_ranks=recv_ranks, stacked=False,
                                         block_shapes=[a.shape for a in avals])
    return _apply(ctx, lambda *bs: [b.reshape(s) for b, s in zip(bs, out_shapes)],
                  received, received_avals, ctx.avals_out)


def _neighbor_reduce_scatter(ctx, *xs, send_ranks, recv_ranks, out_shapes, comm_id):
    avals = ctx.avals_in
    # Block s of every input (a slice along axis 0) goes to send_ranks[s].
    stacked = [_shaped((len(send_ranks), *s), a.dtype) for s, a in zip(out_shapes, avals)]
    values = _apply(ctx, lambda *ls: [x.reshape(a.shape) for x, a in zip(ls, stacked)],
                    xs, avals, stacked)
    received, received_avals = _exchange(ctx, values, stacked, op="neighbor_reduce_scatter",
                                         send_ranks=send_ranks,
                                         recv_ranks=recv_ranks, stacked=True,
                                         block_shapes=out_shapes)
    return _apply(ctx, lambda *bs: [_weighted(b, [1.0] * len(recv_ranks)).astype(b.dtype)
                                    for b in bs],
                  received, received_avals, ctx.avals_out)


def _allreduce(ctx, *xs, mean, comm_id):
    if (mean and _integer(ctx.avals_in)) or any(
            jnp.issubdtype(a.dtype, jnp.complexfloating) for a in ctx.avals_in):
        return None
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID,
                  **message("allreduce", ctx.avals_in)}
    sums = _call(ctx, "allreduce", xs, ctx.avals_in, ctx.avals_out, attributes)
    if not mean:
        return sums
    scale = 1.0 / runtime.size()
    return _apply(ctx, lambda *ss: [(s.astype(_accumulator(s.dtype)) * scale).astype(s.dtype)
                                    for s in ss], sums, ctx.avals_out, ctx.avals_out)


def _broadcast(ctx, *xs, root, comm_id):
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID, "root": root,
                  **message("broadcast", ctx.avals_in)}
    return _call(ctx, "broadcast", xs, ctx.avals_in, ctx.avals_out, attributes)


def _allgather(ctx, *xs, size, comm_id):
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID,
                  **message("allgather", ctx.avals_in)}
    return _call(ctx, "allgather", xs, ctx.avals_in, ctx.avals_out, attributes)


#: The NCCL rule of each op NCCL covers (those with an NCCL handler in the op
#: table, jaxfog/ffi/ops.h; _op_primitives registers this lowering for them); a
#: rule returns None for the cases it leaves to the host-staged call.
RULES: dict[str, Callable] = {
    "neighbor_allreduce": _neighbor_allreduce, "neighbor_allgather": _neighbor_allgather,
    "neighbor_reduce_scatter": _neighbor_reduce_scatter, "allreduce": _allreduce,
    "broadcast": _broadcast, "allgather": _allgather}


def lowering(ctx, *args, comm_id, **params):
    """The CUDA lowering of the primitives NCCL covers: NCCL where
    :func:`active` and the rule covers the case, else the generic lowering."""
    if active(comm_id):
        rule = RULES[ctx.primitive.name.removeprefix("jaxfog_")]
        results = rule(ctx, *args, comm_id=comm_id, **params)
        if results is not None:
            return results
    return GENERIC_LOWERINGS[ctx.primitive](ctx, *args, comm_id=comm_id, **params)
