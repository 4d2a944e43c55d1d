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
it does not cover (periodic schedules, the machine-level communicators,
integer means, windows, barrier), the primitive keeps its generic lowering:
the same custom call as on CPU, which XLA binds to the host-staged handler.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import core
from jax.interpreters import mlir

from jaxfog import _gpu, runtime
from jaxfog.ops._primitive import GENERIC_LOWERINGS, lower_comm_call, signature

EXCHANGE, ALLREDUCE, BROADCAST, ALLGATHER = (
    "jaxfog_nccl_exchange", "jaxfog_nccl_allreduce", "jaxfog_nccl_broadcast",
    "jaxfog_nccl_allgather")


def active(comm_id: int) -> bool:
    """Whether ops on communicator ``comm_id`` lower to NCCL (the world
    communicator, with the NCCL transport up)."""
    return (comm_id == runtime.WORLD_COMM_ID and runtime.is_initialized()
            and runtime.gpu_backend() == "nccl")


def _apply(ctx, fn: Callable, values: Sequence, avals_in: Sequence, avals_out: Sequence):
    """Lowers the pure function ``fn`` on ``values`` (XLA fuses it)."""
    sub = ctx.replace(avals_in=tuple(avals_in), avals_out=tuple(avals_out), tokens_out=None)
    return mlir.lower_fun(fn, multiple_results=True)(sub, *values)


def _call(ctx, target: str, values: Sequence, avals_in: Sequence, avals_out: Sequence,
          attributes: dict) -> list:
    """The NCCL custom call on ``values``, in order with every other op."""
    sub = ctx.replace(avals_in=tuple(avals_in), avals_out=tuple(avals_out), tokens_out=None)
    results = lower_comm_call(sub, target, values, attributes)
    ctx.set_tokens_out(sub.tokens_out)
    return results


def _shaped(shape, dtype) -> core.ShapedArray:
    return core.ShapedArray(tuple(shape), dtype)


def _accumulator(dtype):
    """Sums of 16-bit floats run in float32, as in the CPU kernels."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def _exchange(ctx, values, avals, *, send_ranks, recv_ranks, stacked: bool, block_shapes):
    """The neighbours' blocks, stacked: leaf l comes back as (R, *block_shapes[l])."""
    blocks = [_shaped(s, a.dtype) for s, a in zip(block_shapes, avals)]
    outs = [_shaped((len(recv_ranks), *s), a.dtype) for s, a in zip(block_shapes, avals)]
    attributes = {"comm_id": _gpu.NCCL_COMM_ID,
                  "signature": signature("nccl_exchange", blocks),
                  "send_ranks": np.array(send_ranks, np.int64),
                  "recv_ranks": np.array(recv_ranks, np.int64), "stacked": stacked}
    return _call(ctx, EXCHANGE, values, avals, outs, attributes), outs


def _neighbor_allreduce(ctx, step, *xs, plan, comm_id):
    if not active(comm_id) or plan.period != 1:
        return GENERIC_LOWERINGS[ctx.primitive](ctx, step, *xs, plan=plan,
                                                         comm_id=comm_id)
    avals = ctx.avals_in[1:]
    self_weight = plan.self_weights[0]
    send_ranks = [r for r, _ in plan.sends[0]]
    send_weights = [w for _, w in plan.sends[0]]
    recv_weights = [w for _, w in plan.recvs[0]]
    stacked = any(w != 1.0 for w in send_weights)
    values, sent = list(xs), list(avals)
    if stacked:
        def scale(*leaves):
            return [jnp.stack([(x.astype(_accumulator(x.dtype)) * w).astype(x.dtype)
                               for w in send_weights]) for x in leaves]
        sent = [_shaped((len(send_ranks), *a.shape), a.dtype) for a in avals]
        values = _apply(ctx, scale, values, avals, sent)
    received, received_avals = _exchange(
        ctx, values, sent, send_ranks=send_ranks, recv_ranks=[r for r, _ in plan.recvs[0]],
        stacked=stacked, block_shapes=[a.shape for a in avals])

    def mix(*leaves):
        own, blocks = leaves[:len(xs)], leaves[len(xs):]
        outs = []
        for x, b in zip(own, blocks):
            acc = _accumulator(x.dtype)
            total = x.astype(acc) * self_weight
            for j, w in enumerate(recv_weights):
                total = total + b[j].astype(acc) * w
            outs.append(total.astype(x.dtype))
        return outs

    return _apply(ctx, mix, [*xs, *received], [*avals, *received_avals], avals)


def _neighbor_allgather(ctx, *xs, send_ranks, recv_ranks, out_shapes, comm_id):
    if not active(comm_id):
        return GENERIC_LOWERINGS[ctx.primitive](
            ctx, *xs, send_ranks=send_ranks, recv_ranks=recv_ranks, out_shapes=out_shapes,
            comm_id=comm_id)
    avals = ctx.avals_in
    received, received_avals = _exchange(ctx, xs, avals, send_ranks=send_ranks,
                                         recv_ranks=recv_ranks, stacked=False,
                                         block_shapes=[a.shape for a in avals])
    return _apply(ctx, lambda *bs: [b.reshape(s) for b, s in zip(bs, out_shapes)],
                  received, received_avals, ctx.avals_out)


def _neighbor_reduce_scatter(ctx, *xs, send_ranks, recv_ranks, out_shapes, comm_id):
    if not active(comm_id):
        return GENERIC_LOWERINGS[ctx.primitive](
            ctx, *xs, send_ranks=send_ranks, recv_ranks=recv_ranks, out_shapes=out_shapes,
            comm_id=comm_id)
    avals = ctx.avals_in
    # Block s of every input (a slice along axis 0) goes to send_ranks[s].
    stacked = [_shaped((len(send_ranks), *s), a.dtype) for s, a in zip(out_shapes, avals)]
    values = _apply(ctx, lambda *ls: [x.reshape(a.shape) for x, a in zip(ls, stacked)],
                    xs, avals, stacked)
    received, received_avals = _exchange(ctx, values, stacked, send_ranks=send_ranks,
                                         recv_ranks=recv_ranks, stacked=True,
                                         block_shapes=out_shapes)

    def total(*blocks):
        return [b.astype(_accumulator(b.dtype)).sum(axis=0).astype(b.dtype) for b in blocks]

    return _apply(ctx, total, received, received_avals, ctx.avals_out)


def _allreduce(ctx, *xs, mean, comm_id):
    integer = any(jnp.issubdtype(a.dtype, jnp.integer) for a in ctx.avals_in)
    if not active(comm_id) or (mean and integer):
        return GENERIC_LOWERINGS[ctx.primitive](ctx, *xs, mean=mean, comm_id=comm_id)
    attributes = {"comm_id": _gpu.NCCL_COMM_ID,
                  "signature": signature("allreduce", ctx.avals_in)}
    sums = _call(ctx, ALLREDUCE, xs, ctx.avals_in, ctx.avals_out, attributes)
    if not mean:
        return sums
    scale = 1.0 / runtime.size()
    return _apply(ctx, lambda *ss: [(s.astype(_accumulator(s.dtype)) * scale).astype(s.dtype)
                                    for s in ss], sums, ctx.avals_out, ctx.avals_out)


def _broadcast(ctx, *xs, root, comm_id):
    if not active(comm_id):
        return GENERIC_LOWERINGS[ctx.primitive](ctx, *xs, root=root, comm_id=comm_id)
    attributes = {"comm_id": _gpu.NCCL_COMM_ID, "root": root,
                  "signature": signature("broadcast", ctx.avals_in)}
    return _call(ctx, BROADCAST, xs, ctx.avals_in, ctx.avals_out, attributes)


def _allgather(ctx, *xs, size, comm_id):
    if not active(comm_id):
        return GENERIC_LOWERINGS[ctx.primitive](ctx, *xs, size=size, comm_id=comm_id)
    attributes = {"comm_id": _gpu.NCCL_COMM_ID,
                  "signature": signature("allgather", ctx.avals_in)}
    return _call(ctx, ALLGATHER, xs, ctx.avals_in, ctx.avals_out, attributes)


#: The CUDA rule of each primitive that NCCL covers, by op name
#: (``jaxfog.ops.primitives`` registers them).
RULES: dict[str, Callable] = {
    "neighbor_allreduce": _neighbor_allreduce, "neighbor_allgather": _neighbor_allgather,
    "neighbor_reduce_scatter": _neighbor_reduce_scatter, "allreduce": _allreduce,
    "broadcast": _broadcast, "allgather": _allgather}
