"""Neighbor averaging and neighbor allgather (BlueFog's neighbor collectives)."""

from __future__ import annotations

from typing import Any, Sequence

from jaxfog import topology as T
from jaxfog.ops import _args, _backends


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
    args = _args.neighbor_allreduce(self_weight=self_weight, src_weights=src_weights,
                                    dst_weights=dst_weights, topology=topology, step=step,
                                    check_topology=check_topology, name=name)
    return _backends.apply("neighbor_allreduce", x, args)


def neighbor_allgather(x: Any, *, src_ranks: Sequence[int] | None = None,
                       dst_ranks: Sequence[int] | None = None,
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
    args = _args.neighbor_allgather(src_ranks=src_ranks, dst_ranks=dst_ranks, name=name)
    return _backends.apply("neighbor_allgather", x, args)


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
    args = _args.pair_gossip(peer, name=name)
    return _backends.apply("pair_gossip", x, args)


__all__ = ["neighbor_allgather", "neighbor_allreduce", "pair_gossip"]
