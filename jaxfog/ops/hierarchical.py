"""Hierarchical neighbor averaging (BlueFog paper, section V-B)."""

from __future__ import annotations

from typing import Any, Sequence

from jaxfog.ops import _args, _backends


def hierarchical_neighbor_allreduce(
        x: Any, *, self_weight: float | None = None,
        src_machine_weights: dict[int, float] | None = None,
        dst_machine_weights: dict[int, float] | Sequence[int] | None = None,
        name: str | None = None) -> Any:
    r"""Machine-level neighbor averaging.

    With ``m`` this rank's machine (:func:`jaxfog.machine_rank`) and ``W_M``
    the machine topology (:func:`jaxfog.set_machine_topology`), every rank of
    machine ``m`` ends with

    .. math::

        y = \sum_{m'} W_M[m, m']\; \bar x_{m'}, \qquad
        \bar x_{m'} = \text{mean of } x \text{ over the ranks of machine } m'.

    Three steps: average inside every machine; the machines' local rank 0s
    average over the machine topology; each local rank 0 broadcasts the result
    inside its machine. Only ``machine_size()`` ranks talk across machines,
    which is what makes it cheap where the network is the bottleneck.

    Args:
      x: an array or a pytree.
      self_weight, src_machine_weights, dst_machine_weights: the local view in
        machine ranks, with ``neighbor_allreduce``'s pull/push/push-pull
        meanings, in any of its forms (numbers, dicts, lists, rank-indexed
        tables over machines) on every backend (default: the machine
        topology's, in :func:`jaxfog.simulate` its ``machine_topology``).
      name: a name for error messages.

    Returns:
      ``x``'s structure; integers are rounded after each step.

    Example::

        jaxfog.set_machine_topology(jaxfog.topology.ring(jaxfog.machine_size()))
        y = jaxfog.hierarchical_neighbor_allreduce(x)

    References:
      Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms
      Practical for Optimization and Deep Learning*, 2021, section V-B.
    """
    args = _args.hierarchical_neighbor_allreduce(
        self_weight=self_weight, src_machine_weights=src_machine_weights,
        dst_machine_weights=dst_machine_weights, name=name)
    return _backends.apply("hierarchical_neighbor_allreduce", x, args)


__all__ = ["hierarchical_neighbor_allreduce"]
