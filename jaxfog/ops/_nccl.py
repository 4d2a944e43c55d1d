"""CUDA lowerings of the communicating primitives onto the NCCL transport:
what the ops' NCCL rules share (each rule lives beside its primitive, in the
op's module, and is registered with :func:`register`).

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


def lower_fn(ctx, fn: Callable, values: Sequence, avals_in: Sequence, avals_out: Sequence):
    """Lowers the pure function ``fn`` on ``values`` (XLA fuses it)."""
    sub = ctx.replace(avals_in=tuple(avals_in), avals_out=tuple(avals_out), tokens_out=None)
    return mlir.lower_fun(fn, multiple_results=True)(sub, *values)


def nccl_call(ctx, op: str, values: Sequence, avals_in: Sequence, avals_out: Sequence,
          attributes: dict) -> list:
    """The custom call to ``op``'s NCCL handler (the op table's) on ``values``,
    in order with every other op."""
    sub = ctx.replace(avals_in=tuple(avals_in), avals_out=tuple(avals_out), tokens_out=None)
    results = lower_comm_call(sub, ffi.op_table()[op].nccl_target, values, attributes)
    ctx.set_tokens_out(sub.tokens_out)
    return results


def shaped(shape, dtype) -> core.ShapedArray:
    return core.ShapedArray(tuple(shape), dtype)


def accumulator(dtype):
    """Sums of 16-bit floats run in float32, as in the CPU kernels."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def exchange(ctx, values, avals, *, op: str, send_ranks, recv_ranks, stacked: bool,
              block_shapes):
    """The neighbours' blocks, stacked: leaf l comes back as (R, *block_shapes[l]).
    ``op`` is the op the exchange serves: headers, comm_stats, the timeline
    and errors name it."""
    blocks = [shaped(s, a.dtype) for s, a in zip(block_shapes, avals)]
    outs = [shaped((len(recv_ranks), *s), a.dtype) for s, a in zip(block_shapes, avals)]
    attributes = {"comm_id": _nccl_setup.NCCL_COMM_ID,
                  **message(f"nccl_{op}", blocks),
                  "send_ranks": np.array(send_ranks, np.int64),
                  "recv_ranks": np.array(recv_ranks, np.int64), "stacked": stacked,
                  "op": ffi.op_table()[op].code}
    return nccl_call(ctx, op, values, avals, outs, attributes), outs


def weighted(blocks, weights):
    """sum_j weights[j] * blocks[j] over axis 0, accumulated as the CPU kernels do
    (one fused XLA reduction, not a sum per neighbour)."""
    acc = accumulator(blocks.dtype)
    w = jnp.asarray(weights, acc).reshape(-1, *([1] * (blocks.ndim - 1)))
    return (blocks.astype(acc) * w).sum(axis=0)


def integer(avals) -> bool:
    return any(jnp.issubdtype(a.dtype, jnp.integer) for a in avals)


#: The NCCL rule of each op NCCL covers (those with an NCCL handler in the op
#: table, jaxfog/ffi/ops.h), registered beside the op's primitive with
#: :func:`register`; a rule returns None for the cases it leaves to the
#: host-staged call.
RULES: dict[str, Callable] = {}


def register(prim, rule: Callable) -> None:
    """Lowers ``prim`` on CUDA through ``rule`` (:func:`lowering`)."""
    RULES[prim.name.removeprefix("jaxfog_")] = rule
    mlir.register_lowering(prim, lowering, platform="cuda")


def lowering(ctx, *args, comm_id, **params):
    """The CUDA lowering of the primitives NCCL covers: NCCL where
    :func:`active` and the rule covers the case, else the generic lowering."""
    if active(comm_id):
        rule = RULES[ctx.primitive.name.removeprefix("jaxfog_")]
        results = rule(ctx, *args, comm_id=comm_id, **params)
        if results is not None:
            return results
    return GENERIC_LOWERINGS[ctx.primitive](ctx, *args, comm_id=comm_id, **params)
