"""Neighbor averaging and neighbor allgather (BlueFog's neighbor collectives).

Each op in one block: its resolved arguments, its primitive (the custom call
``jaxfog_<op>`` of the C++ op table, ``jaxfog/ffi/ops.h``) with its rules
(jvp, transpose: averaging with ``W^T``; vmap: one message for the batch;
the NCCL lowering), its call on MPI processes (this rank's row of W as a
communication plan), its rule on simulated agents (``lax`` collectives over
the agent axis, with ``jaxfog.simulation._mixing``), its
:class:`~jaxfog.ops._backends.Op` record holding both rules, and its public
blocking and nonblocking functions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import core, lax
from jax.interpreters import ad, batching

from jaxfog import _context, runtime
from jaxfog import topology as T
from jaxfog.ops import _args, _dispatch, _nccl, _numerics, _plan, nonblocking
from jaxfog.ops._backends import Op
from jaxfog.ops._call import Call
from jaxfog.ops.nonblocking import Handle
from jaxfog.simulation import _clock, _mixing
from jaxfog.ops._primitive_machinery import (ADJOINTS, Adjoint, define, linear_jvp,
                                             linear_transpose, message, move_batch_to_axis1,
                                             same_avals, unchanged)


# --- neighbor_allreduce: out_i = sum_j W[i, j] x_j for this rank's plan ------


class NeighborAllreduce(NamedTuple):
    """Resolved arguments of ``neighbor_allreduce``."""

    graph: T.Topology | T.Schedule
    step: Any  # None, int or an integer scalar array
    local_view: _args.LocalView | None
    check_topology: bool
    what: str


def _neighbor_allreduce_args(*, self_weight: Any, src_weights: Any, dst_weights: Any,
                             topology: Any, step: Any, check_topology: bool,
                             name: str | None) -> NeighborAllreduce:
    what = _args.call_name("neighbor_allreduce", name)
    if topology is None:
        graph = runtime.load_topology()
    elif isinstance(topology, (T.Topology, T.Schedule)):
        graph = topology
    else:
        raise TypeError(f"{what}: topology must be a Topology or a Schedule, got "
                        f"{type(topology).__name__}")
    if isinstance(graph, T.Schedule):
        if not (self_weight is None and src_weights is None and dst_weights is None):
            raise ValueError(f"{what}: with a Schedule the weights come from it; do not "
                             "also give self_weight/src_weights/dst_weights")
        if step is None:
            whose = " (the simulation's topology is one)" if topology is None else ""
            raise ValueError(f"{what}: a Schedule needs step= (a Python or traced "
                             f"integer){whose}")
    local_view = _args.local_view(self_weight, src_weights, dst_weights, what)
    _args.check_size(graph, what)
    return NeighborAllreduce(graph, _args.checked_step(step, what), local_view,
                             _args.flag(check_topology, "check_topology", what), what)


def _allreduce_attributes(avals_in, *, plan: _plan.Plan, comm_id: int) -> dict:
    return {"comm_id": comm_id, **message("neighbor_allreduce", avals_in[1:]),
            "plan_id": plan.define()}


# Operands: the step (an int32 scalar choosing the plan's entry), then the leaves.
neighbor_allreduce_p = define(
    "neighbor_allreduce",
    lambda step, *avals, plan, comm_id: same_avals(*avals), _allreduce_attributes)
ad.primitive_jvps[neighbor_allreduce_p] = linear_jvp(neighbor_allreduce_p, 1)
ad.primitive_transposes[neighbor_allreduce_p] = linear_transpose(
    lambda static, cts, xs, *, plan, comm_id: neighbor_allreduce_p.bind(
        *static, *cts, plan=plan.transpose(), comm_id=comm_id), n_static=1)


ADJOINTS[neighbor_allreduce_p] = lambda static, params, avals: Adjoint(
    neighbor_allreduce_p, {**params, "plan": params["plan"].transpose()}, list(static),
    unchanged)


def _neighbor_allreduce_batch(args, dims, *, plan, comm_id):
    if dims[0] is not None:
        raise ValueError("jaxfog.neighbor_allreduce: `step` cannot be batched by vmap; "
                         "every agent of a process takes the same step")
    return neighbor_allreduce_p.bind(*args, plan=plan, comm_id=comm_id), list(dims[1:])


batching.primitive_batchers[neighbor_allreduce_p] = _neighbor_allreduce_batch


def _neighbor_allreduce_nccl(ctx, step, *xs, plan, comm_id):
    avals = ctx.avals_in[1:]
    if plan.period != 1 or _nccl.integer(avals):  # schedules pick their entry at run time
        return None
    (self_weight,), (sends,), (recvs,) = plan.self_weights, plan.sends, plan.recvs
    send_weights = [w for _, w in sends]
    stacked = any(w != 1.0 for w in send_weights)
    values, sent = list(xs), list(avals)
    if stacked:  # one scaled copy per destination
        def scale(*leaves):
            return [(x.astype(_nccl.accumulator(x.dtype))[None]
                     * jnp.asarray(send_weights, _nccl.accumulator(x.dtype)).reshape(
                         -1, *([1] * x.ndim))).astype(x.dtype) for x in leaves]
        sent = [_nccl.shaped((len(sends), *a.shape), a.dtype) for a in avals]
        values = _nccl.lower_fn(ctx, scale, values, avals, sent)
    received, received_avals = _nccl.exchange(
        ctx, values, sent, op="neighbor_allreduce", send_ranks=[r for r, _ in sends],
        recv_ranks=[r for r, _ in recvs], stacked=stacked,
        block_shapes=[a.shape for a in avals])

    def mix(*leaves):
        own, blocks = leaves[:len(xs)], leaves[len(xs):]
        return [(x.astype(_nccl.accumulator(x.dtype)) * self_weight
                 + _nccl.weighted(b, [w for _, w in recvs])).astype(x.dtype)
                for x, b in zip(own, blocks)]

    return _nccl.lower_fn(ctx, mix, [*xs, *received], [*avals, *received_avals], avals)


_nccl.register(neighbor_allreduce_p, _neighbor_allreduce_nccl)


# On MPI processes: this rank's row of W as a plan (static), from the topology
# or from any documented form of the local view.


def _static(value: Any, label: str, what: str) -> np.ndarray:
    if _args.is_traced(value):
        raise TypeError(
            f"{what}: {label} is a traced value, but on MPI processes it must be concrete "
            "(a number, a dict, a list or a numpy/JAX array): its nonzero entries fix whom "
            "this rank exchanges with when the op is compiled. Pass the whole rank-indexed "
            "table (each rank takes its row) rather than indexing it with jaxfog.rank() "
            "inside a jitted function")
    return np.asarray(value, np.float64)


def _row_dict(row: np.ndarray, skip: int | None = None) -> dict[int, float]:
    return {int(j): float(row[j]) for j in np.flatnonzero(row) if j != skip}


def _this_ranks_view(view: _args.LocalView, rank: int, what: str,
               labels: tuple[str, str] = ("src_weights", "dst_weights")) -> _args.LocalView:
    """This rank's view (a float and dicts) from any documented form: a
    rank-indexed table is reduced to this rank's row; with a whole (n, n)
    table of one side and nothing of the other, the other side follows from
    the table (a pull table says where to send, a push table whom to hear)."""
    self_weight, src, dst = view
    if _args.is_array(self_weight):
        a = _static(self_weight, "self_weight", what)
        self_weight = float(a[rank] if a.ndim == 1 else a)
    tables = {}
    for label, value in zip(labels, (src, dst)):
        if _args.is_array(value):
            tables[label] = _static(value, label, what)
    S, D = tables.get(labels[0]), tables.get(labels[1])
    if S is not None:
        src = _row_dict(S[rank], skip=rank) if S.ndim == 2 else _row_dict(S)
    if D is not None:
        dst = _row_dict(D[rank], skip=rank) if D.ndim == 2 else _row_dict(D)
    if S is not None and S.ndim == 2 and D is not None and D.ndim == 2:
        src = {j: w for j, w in src.items() if D[j, rank] != 0}
        dst = {i: w for i, w in dst.items() if S[i, rank] != 0}
    elif S is not None and S.ndim == 2 and view.dst_weights is None:
        dst = {int(i): 1.0 for i in np.flatnonzero(S[:, rank]) if i != rank}
    elif D is not None and D.ndim == 2 and view.src_weights is None:
        src = {int(j): 1.0 for j in np.flatnonzero(D[:, rank]) if j != rank}
    return _args.LocalView(self_weight, src, dst)


def plan_for(graph: T.Topology | T.Schedule, rank: int,
              local_view_: _args.LocalView | None, what: str,
              labels: tuple[str, str] = ("src_weights", "dst_weights")) -> _plan.Plan:
    if local_view_ is None:
        return _plan.from_topology(graph, rank)
    assert isinstance(graph, T.Topology)  # a Schedule takes no weights (refused earlier)
    return _plan.from_local_view(graph, rank, *_this_ranks_view(local_view_, rank, what, labels),
                                 what=what, labels=labels)


def mixing_call(leaves: list, plan: _plan.Plan, step: Any, comm_id: int) -> Call:
    step = jnp.asarray(0 if step is None else step).astype(jnp.int32)
    return Call(neighbor_allreduce_p, [step, *leaves], {"plan": plan, "comm_id": comm_id},
                n_static=1)


def _neighbor_allreduce_call(leaves: list, args: NeighborAllreduce) -> Call:
    rank = cast(int, runtime.rank())  # an MPI process's (only a simulated agent's is traced)
    plan = plan_for(args.graph, rank, args.local_view, args.what)
    if args.check_topology:
        _plan.check_matching(plan, runtime.communicator(), rank, args.what)
    return mixing_call(leaves, plan, args.step, runtime.WORLD_COMM_ID)


def _neighbor_allreduce_on_agents(sim: _context.Simulation, leaves: list, treedef: Any,
                                  args: Any) -> list:
    graph = args.graph
    if isinstance(graph, T.Schedule):
        if isinstance(args.step, int):
            _clock.synchronize(graph.at(args.step).weights != 0)
            return _mixing.mix(leaves, graph.at(args.step).weights, sim)
        _clock.synchronize(np.any([t.weights != 0 for t in graph], axis=0))
        branches = [functools.partial(_mixing.mix, w=t.weights, sim=sim) for t in graph]
        return lax.switch(args.step.astype(jnp.int32) % graph.period, branches, leaves)
    # Every agent's plan is a row of one W, so senders and receivers always
    # match: check_topology has nothing to check here.
    if args.local_view is None:
        return _mixing.apply_mixing(leaves, _mixing.Mixing(graph.weights, None, None), sim)
    mixing = _mixing.local_view_mixing(graph, args.local_view, args.what, sim.rank)
    return _mixing.apply_mixing(leaves, mixing, sim)


NEIGHBOR_ALLREDUCE = Op("neighbor_allreduce", simulated=_neighbor_allreduce_on_agents,
                        mpi=lambda leaves, treedef, args: _neighbor_allreduce_call(leaves, args))


def neighbor_allreduce(x: Any, *, self_weight: float | None = None,
                       src_weights: dict[int, float] | None = None,
                       dst_weights: dict[int, float] | Sequence[int] | None = None,
                       topology: T.Topology | T.Schedule | None = None, step: Any = None,
                       check_topology: bool = False, name: str | None = None) -> Any:
    r"""Weighted average with graph neighbours: row ``rank`` of ``W @ X``.

    On rank i the result is

    .. math::

        y_i = w_{ii} x_i + \sum_{j \in \mathrm{src}(i)} s_{ij}\, d_{ji}\, x_j

    with ``w_ii = self_weight``, ``s_ij = src_weights[j]`` and ``d_ji`` the
    weight sender j gives its message to i (``dst_weights[i]`` on rank j,
    1.0 if it gave none). With no weights this is ``y = W x`` for the
    topology's mixing matrix ``W``, which is how decentralized (stochastic)
    gradient descent and diffusion average.

    Modes:

    * **static**: no weights; the current topology's row of W, or ``topology=``.
    * **local view** (BlueFog's forms): ``self_weight`` with ``src_weights``
      (pull: the senders are the static in-neighbours), with ``dst_weights``
      (push: receive from the static in-neighbours), or with both (push-pull:
      any ranks, also outside the static graph; empty lists allowed).
      ``dst_weights`` may be a list of ranks (weight 1.0 each). On every
      backend each weight may also be a row of n weights or the whole
      rank-indexed table (``self_weight[i]``, ``src_weights[i, j]``,
      ``dst_weights[j, i]``), of which each rank takes its row; a table of
      one side alone also says the other (who sends, who hears). On MPI the
      weights must be concrete (a TypeError names a traced one).
    * **scheduled**: ``topology=`` a :class:`~jaxfog.topology.Schedule` and
      ``step=`` an integer, traced or not; the entry ``step % period`` is
      chosen when the op runs, so a time-varying graph inside ``lax.scan``
      compiles once.

    Args:
      x: an array or a pytree of arrays (float16, bfloat16, float32, float64,
        complex64/128, int32, int64). A pytree travels as one message per peer.
      self_weight: ``w_ii`` (local view).
      src_weights: ``{rank j: s_ij}``, the weight given to what j sends.
      dst_weights: ``{rank i: d_ji}`` or a list of ranks: where this rank sends,
        scaled by that weight.
      topology: a ``Topology`` or ``Schedule``; default the current topology
        (:func:`jaxfog.load_topology`).
      step: the step of a ``Schedule`` (a Python int or an integer scalar array).
      check_topology: check, at trace time and collectively, that every rank
        sends exactly to the ranks that receive from it; a mismatch raises
        ``ValueError`` on every rank, naming the ranks.
      name: a name for error messages (BlueFog compatible).

    Returns:
      The averaged value, with ``x``'s structure, shapes and dtypes. Integers
      are averaged in float64 and rounded to nearest, ties to even.

    Differentiable (the adjoint averages with ``W^T``), batchable by ``vmap``
    (one message for the whole batch) and usable inside ``jit``, ``scan``,
    ``cond`` and ``while_loop``.

    Example::

        jaxfog.init(topology=jaxfog.topology.ring(jaxfog.size()))
        x = jnp.full(3, float(jaxfog.rank()))
        y = jaxfog.neighbor_allreduce(x)  # mean of this rank and its two neighbours

    References:
      Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms
      Practical for Optimization and Deep Learning*, 2021 (arXiv:2111.04287).

      Lian, Zhang, Zhang, Hsieh, Zhang, Liu. *Can Decentralized Algorithms
      Outperform Centralized Algorithms? A Case Study for Decentralized
      Parallel Stochastic Gradient Descent*, NeurIPS 2017.
    """
    args = _neighbor_allreduce_args(self_weight=self_weight, src_weights=src_weights,
                                    dst_weights=dst_weights, topology=topology, step=step,
                                    check_topology=check_topology, name=name)
    return _dispatch.apply(NEIGHBOR_ALLREDUCE, x, args)


def neighbor_allreduce_nonblocking(x: Any, *, self_weight: float | None = None,
                                   src_weights: dict[int, float] | None = None,
                                   dst_weights: dict[int, float] | Sequence[int] | None = None,
                                   topology: T.Topology | T.Schedule | None = None,
                                   step: Any = None, check_topology: bool = False,
                                   name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.neighbor_allreduce` (same arguments); :func:`wait`
    gives its result.

    Example (BlueFog's Listing 5: the exchange of x overlaps the gradient)::

        handle = jaxfog.neighbor_allreduce_nonblocking(x)
        g = grad(loss)(x, batch)
        x = jaxfog.wait(handle) - lr * g
    """
    args = _neighbor_allreduce_args(self_weight=self_weight, src_weights=src_weights,
                                    dst_weights=dst_weights, topology=topology, step=step,
                                    check_topology=check_topology, name=name)
    return nonblocking.start(NEIGHBOR_ALLREDUCE, x, args)


# --- pair_gossip: a push-pull neighbor_allreduce with one peer -----------------


class PairGossip(NamedTuple):
    peer: Any  # this rank's peer: an int, a concrete or a traced integer scalar
    what: str


def _pair_gossip_args(peer: Any, *, name: str | None) -> PairGossip:
    what = _args.call_name("pair_gossip", name)
    size = runtime.size()
    if (_args.is_array(peer) and np.shape(peer) == (size,)
            and jnp.issubdtype(peer.dtype, jnp.integer)):
        if not _args.is_traced(peer) and ((np.asarray(peer) < 0)
                                          | (np.asarray(peer) >= size)).any():
            raise ValueError(f"{what}: the peer table holds ranks outside [0, {size}): "
                             f"{np.asarray(peer).tolist()}")
        peer = _args.rank_row(peer)  # a rank-indexed table of peers: this rank's entry
    if isinstance(peer, (bool, np.bool_)) or not (
            isinstance(peer, (int, np.integer)) or (
                hasattr(peer, "dtype") and np.ndim(peer) == 0
                and np.issubdtype(peer.dtype, np.integer))):
        raise TypeError(f"{what}: peer must be a rank (an integer), got {peer!r}")
    if isinstance(peer, (int, np.integer)) and not 0 <= peer < size:
        raise ValueError(f"{what}: peer {peer} is not a rank of {size}")
    return PairGossip(peer, what)


def _pair_gossip_call(leaves: list, args: PairGossip) -> Call:
    if _args.is_traced(args.peer):
        raise TypeError(f"{args.what}: peer is a traced value, but on MPI processes it "
                        "must be concrete (an int, a concrete integer array, or a "
                        "rank-indexed table of peers): the exchange with it is fixed when "
                        "the op is compiled. Make it a static argument of jaxfog.jit, or "
                        "pass the whole table of peers")
    peer = int(args.peer)
    alone = peer == runtime.rank()  # still an op: every rank counts its ops alike
    return _neighbor_allreduce_call(leaves, _neighbor_allreduce_args(
        self_weight=1.0 if alone else 0.5, src_weights={} if alone else {peer: 0.5},
        dst_weights=[] if alone else [peer], topology=None, step=None,
        check_topology=False, name=args.what))


def _pair_gossip_on_agents(sim: _context.Simulation, leaves: list, treedef: Any,
                           args: Any) -> list:
    """Every agent reads its peer's value (a gather: the peers may be
    traced); a pair that does not name each other gets NaN."""
    _clock.synchronize()
    peer = jnp.asarray(args.peer, jnp.int32)
    peers = sim.all_gather(peer)
    paired = (peer >= 0) & (peer < sim.size) & (peers[jnp.clip(peer, 0, sim.size - 1)]
                                                == sim.rank)
    outs = []
    for x in leaves:
        with _numerics.accumulating(x.dtype) as acc:
            theirs = sim.all_gather(x)[jnp.clip(peer, 0, sim.size - 1)]
            mean = _numerics.finish((x.astype(acc) + theirs.astype(acc)) / 2, x.dtype)
        bad = jnp.asarray(jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0, x.dtype)
        outs.append(jnp.where(paired, mean, bad))
    return outs


PAIR_GOSSIP = Op("pair_gossip", simulated=_pair_gossip_on_agents,
                 mpi=lambda leaves, treedef, args: _pair_gossip_call(leaves, args))


def pair_gossip(x: Any, peer: Any, *, name: str | None = None) -> Any:
    r"""Pairwise averaging: :math:`x_i = x_j = \tfrac12 (x_i + x_j)` with ``peer`` j.

    The synchronous two-sided form of AD-PSGD's gossip (Lian et al. 2018):
    every rank calls it at once and the ranks pair up, each naming the other
    (``peer`` of ``peer`` is this rank); a rank that names itself keeps its
    value. ``peer`` may also be a rank-indexed table of n peers. On MPI
    processes ``peer`` is concrete (a Python int, static under
    ``jaxfog.jit``) and the op is a push-pull ``neighbor_allreduce`` with
    that one rank; on simulated agents it may be traced (e.g. drawn from the
    agent's rank and the step), and an agent whose peer does not name it back
    gets NaN, not a wrong number.

    Args:
      x: an array or a pytree of arrays (one message).
      peer: the rank to average with.
      name: a name for error messages.

    Returns:
      The pair's mean, with ``x``'s structure.
    """
    args = _pair_gossip_args(peer, name=name)
    return _dispatch.apply(PAIR_GOSSIP, x, args)


def pair_gossip_nonblocking(x: Any, peer: Any, *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.pair_gossip` (same arguments)."""
    return nonblocking.start(PAIR_GOSSIP, x, _pair_gossip_args(peer, name=name))


# --- neighbor_allgather and its adjoint, neighbor_reduce_scatter ------------


class NeighborAllgather(NamedTuple):
    """Resolved arguments of ``neighbor_allgather``; ``None``: the topology's."""

    src_ranks: Any
    dst_ranks: Any
    what: str


def _neighbor_allgather_args(*, src_ranks: Any, dst_ranks: Any,
                             name: str | None) -> NeighborAllgather:
    what = _args.call_name("neighbor_allgather", name)
    for label, ranks in (("src_ranks", src_ranks), ("dst_ranks", dst_ranks)):
        if _args.is_array(ranks):
            n = runtime.size()
            if np.ndim(ranks) not in (1, 2) or (np.ndim(ranks) == 2 and ranks.shape[0] != n) \
                    or not jnp.issubdtype(ranks.dtype, jnp.integer):
                raise ValueError(f"{what}: {label} as an array must be integer ranks, a list "
                                 f"(shape (k,)) or a rank-indexed table (shape ({n}, k)), got "
                                 f"{ranks.dtype}{list(np.shape(ranks))}")
        elif ranks is not None and (isinstance(ranks, (str, bytes))
                                    or not hasattr(ranks, "__iter__")):
            raise TypeError(f"{what}: {label} must be a list of ranks, got "
                            f"{type(ranks).__name__}")
    return NeighborAllgather(src_ranks, dst_ranks, what)


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
        moved, batched = zip(*(move_batch_to_axis1(x, d) for x, d in zip(args, dims)))
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
                                 "comm_id": params["comm_id"]}, [], unchanged)

    return rule


for _prim, _adjoint in ((neighbor_allgather_p, neighbor_reduce_scatter_p),
                        (neighbor_reduce_scatter_p, neighbor_allgather_p)):
    ad.primitive_jvps[_prim] = linear_jvp(_prim, 0)
    ad.primitive_transposes[_prim] = _gather_transpose(_adjoint)
    batching.primitive_batchers[_prim] = _gather_batch(_prim)
    ADJOINTS[_prim] = _gather_adjoint(_adjoint)


def _neighbor_allgather_nccl(ctx, *xs, send_ranks, recv_ranks, out_shapes, comm_id):
    avals = ctx.avals_in
    received, received_avals = _nccl.exchange(
        ctx, xs, avals, op="neighbor_allgather", send_ranks=send_ranks,
        recv_ranks=recv_ranks, stacked=False, block_shapes=[a.shape for a in avals])
    return _nccl.lower_fn(ctx, lambda *bs: [b.reshape(s) for b, s in zip(bs, out_shapes)],
                          received, received_avals, ctx.avals_out)


def _neighbor_reduce_scatter_nccl(ctx, *xs, send_ranks, recv_ranks, out_shapes, comm_id):
    avals = ctx.avals_in
    # Block s of every input (a slice along axis 0) goes to send_ranks[s].
    stacked = [_nccl.shaped((len(send_ranks), *s), a.dtype) for s, a in zip(out_shapes, avals)]
    values = _nccl.lower_fn(ctx, lambda *ls: [x.reshape(a.shape) for x, a in zip(ls, stacked)],
                            xs, avals, stacked)
    received, received_avals = _nccl.exchange(
        ctx, values, stacked, op="neighbor_reduce_scatter", send_ranks=send_ranks,
        recv_ranks=recv_ranks, stacked=True, block_shapes=out_shapes)
    return _nccl.lower_fn(
        ctx, lambda *bs: [_nccl.weighted(b, [1.0] * len(recv_ranks)).astype(b.dtype)
                          for b in bs],
        received, received_avals, ctx.avals_out)


_nccl.register(neighbor_allgather_p, _neighbor_allgather_nccl)
_nccl.register(neighbor_reduce_scatter_p, _neighbor_reduce_scatter_nccl)


@dataclasses.dataclass(frozen=True)
class _InOrder:
    """A rank-indexed ``src_ranks`` table's row: the blocks received from
    ``recv`` (ascending), in the row's ``order``, this rank's own value (kept)
    where the row names it."""

    rank: int
    order: tuple
    recv: tuple

    def __call__(self, got: list, kept: list) -> list:
        outs = []
        for leaf, blocks in zip(kept, got):
            mine = leaf.reshape(leaf.shape or (1,))
            # None when nothing came: then every entry of the order is this rank.
            split: Any = blocks.reshape((len(self.recv), *mine.shape)) if self.recv else None
            parts = [mine if j == self.rank else split[self.recv.index(j)] for j in self.order]
            outs.append(jnp.concatenate(parts, axis=0) if parts else
                        jnp.zeros((0, *mine.shape[1:]), leaf.dtype))
        return outs


def _neighbor_allgather_call(leaves: list, args: NeighborAllgather) -> Call:
    # An MPI process's: an int rank and a Topology (only a simulation's may
    # be traced, or a Schedule).
    rank, size = cast(int, runtime.rank()), runtime.size()
    topology = cast(T.Topology, runtime.load_topology())

    def ranks(given: Any, default: list[int], label: str) -> tuple[int, ...]:
        if given is None:
            return tuple(default)
        return _plan.rank_tuple(given, size, rank, f"{args.what}: {label}")

    def table(given: Any, label: str) -> np.ndarray | None:
        if not _args.is_array(given) or np.ndim(given) != 2:
            return None
        if _args.is_traced(given):
            raise TypeError(f"{args.what}: {label} is a traced value, but on MPI "
                            "processes it must be concrete: the ranks fix the exchanges "
                            "when the op is compiled")
        return np.asarray(given)

    def listed(given: Any, label: str) -> Any:
        if _args.is_array(given):
            table(given[None], label)  # a traced list: the same error
            return np.asarray(given).tolist()
        return given

    sources = table(args.src_ranks, "src_ranks")
    if sources is None:
        order = None
        recv = ranks(listed(args.src_ranks, "src_ranks"), topology.in_neighbors(rank),
                     "src_ranks")
    else:
        # A rank-indexed table: this rank's row, in its order; an entry
        # naming this rank (padding) is its own value, no message.
        order = [int(j) for j in sources[rank]]
        recv = tuple(sorted({j for j in order if j != rank}))
    dst = table(args.dst_ranks, "dst_ranks")
    if dst is not None:
        send = tuple(sorted({int(j) for j in dst[rank] if j != rank}))
    elif args.dst_ranks is None and sources is not None:  # whoever lists this rank
        send = tuple(int(j) for j in range(size)
                     if j != rank and rank in set(sources[j].tolist()))
    else:
        send = ranks(listed(args.dst_ranks, "dst_ranks"), topology.out_neighbors(rank),
                     "dst_ranks")
    out_shapes = tuple((len(recv) * (leaf.shape or (1,))[0], *leaf.shape[1:])
                       for leaf in leaves)
    call = Call(neighbor_allgather_p, list(leaves),
                {"send_ranks": send, "recv_ranks": recv, "out_shapes": out_shapes,
                 "comm_id": runtime.WORLD_COMM_ID})
    if order is None:
        return call
    return call._replace(post=_InOrder(rank, tuple(order), recv), kept=list(leaves))


def _neighbor_allgather_on_agents(sim: _context.Simulation, leaves: list, treedef: Any,
                                  args: Any) -> list:
    table = _mixing.source_table(sim, args.src_ranks)
    receives = np.zeros((sim.size,) * 2, bool)
    receives[np.arange(sim.size)[:, None], table] = True
    _clock.synchronize(receives)
    mine = jnp.asarray(table)[sim.rank]
    return [_mixing.stack_blocks(jnp.take(sim.all_gather(x), mine, axis=0))
            for x in leaves]


NEIGHBOR_ALLGATHER = Op("neighbor_allgather", simulated=_neighbor_allgather_on_agents,
                        mpi=lambda leaves, treedef, args: _neighbor_allgather_call(leaves, args))


def neighbor_allgather(
        x: Any, *, src_ranks: Sequence[int] | np.ndarray | jax.Array | None = None,
        dst_ranks: Sequence[int] | np.ndarray | jax.Array | None = None,
        name: str | None = None) -> Any:
    """Concatenates the neighbours' values along axis 0.

    On rank i the result stacks ``x_j`` for j in ``src_ranks``, in that order:
    ``y_i = concat_j x_j``. Every rank sends its ``x`` to ``dst_ranks``.

    Args:
      x: an array or a pytree; every neighbour must send the same shapes. A
        scalar counts as shape ``(1,)``.
      src_ranks: ranks to receive from; default the current topology's
        in-neighbours, ascending. Or, on every backend, an ``(n, k)`` table
        whose row i lists agent i's sources (an entry naming the agent itself
        is its own value; the senders follow from the table).
      dst_ranks: ranks to send to; default the out-neighbours (not needed in
        a simulation, where the sources decide).
      name: a name for error messages.

    Returns:
      ``x``'s structure with each leaf of shape ``(k * d0, *rest)`` for ``k``
      sources.

    Linear: the adjoint sums each block back to the rank it came from.

    Example::

        blocks = jaxfog.neighbor_allgather(jnp.array([float(jaxfog.rank())]))
        # on rank i: the ranks of its in-neighbours, as floats
    """
    args = _neighbor_allgather_args(src_ranks=src_ranks, dst_ranks=dst_ranks, name=name)
    return _dispatch.apply(NEIGHBOR_ALLGATHER, x, args)


def neighbor_allgather_nonblocking(
        x: Any, *, src_ranks: Sequence[int] | np.ndarray | jax.Array | None = None,
        dst_ranks: Sequence[int] | np.ndarray | jax.Array | None = None,
        name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.neighbor_allgather` (same arguments)."""
    args = _neighbor_allgather_args(src_ranks=src_ranks, dst_ranks=dst_ranks, name=name)
    return nonblocking.start(NEIGHBOR_ALLGATHER, x, args)


__all__ = ["neighbor_allgather", "neighbor_allgather_nonblocking", "neighbor_allreduce",
           "neighbor_allreduce_nonblocking", "pair_gossip", "pair_gossip_nonblocking"]
