"""Hierarchical neighbor averaging (BlueFog paper, section V-B).

Composed of other ops' primitives: on MPI processes the machine mean
(``allreduce`` inside each machine), the leaders' ``neighbor_allreduce`` over
the machine topology, and a ``broadcast`` inside each machine; on simulated
agents permutations inside and across the declared machines
(``jaxfog.simulation._mixing.hierarchical_mix``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence, cast

from jaxfog import _context, runtime
from jaxfog.ops import _args, _dispatch
from jaxfog.ops._backends import Op
from jaxfog.ops.collective import allreduce_p, broadcast_p
from jaxfog.ops.neighbor import mixing_call, plan_for
from jaxfog.simulation import _clock, _mixing


class HierarchicalNeighborAllreduce(NamedTuple):
    """Resolved arguments of ``hierarchical_neighbor_allreduce`` (machine ranks)."""

    local_view: _args.LocalView | None
    what: str


def _hierarchical_args(*, self_weight: Any, src_machine_weights: Any,
                      dst_machine_weights: Any,
                      name: str | None) -> HierarchicalNeighborAllreduce:
    what = _args.call_name("hierarchical_neighbor_allreduce", name)
    return HierarchicalNeighborAllreduce(
        _args.local_view(self_weight, src_machine_weights, dst_machine_weights, what,
                         ("src_machine_weights", "dst_machine_weights"),
                              runtime.machine_size()), what)


def _hierarchical_mpi(leaves: list, treedef: Any, args: HierarchicalNeighborAllreduce) -> list:
    # Machine means, the leaders' averaging over the machine topology, and
    # the leaders' results broadcast inside each machine (BlueFog, V-B).
    # An MPI process's machine rank: an int (only a simulated agent's is traced).
    plan = plan_for(runtime.load_machine_topology(), cast(int, runtime.machine_rank()),
                    args.local_view, args.what,
                    ("src_machine_weights", "dst_machine_weights"))
    local = allreduce_p.bind(*leaves, mean=True, comm_id=runtime.LOCAL_COMM_ID)
    if runtime.local_rank() == 0:
        local = mixing_call(local, plan, None, runtime.LEADERS_COMM_ID).run()
    return broadcast_p.bind(*local, root=0, comm_id=runtime.LOCAL_COMM_ID)


def _hierarchical_neighbor_allreduce_on_agents(sim: _context.Simulation, leaves: list, treedef: Any,
                                               args: Any) -> list:
    """Machine means (ppermutes inside each machine), then the machine
    topology applied between machines (ppermutes by whole machines)."""
    wm = sim.machine_topology.weights
    if args.local_view is not None:
        mixing = _mixing.local_view_mixing(sim.machine_topology, args.local_view, args.what,
                                           sim.machine_rank,
                                           ("src_machine_weights", "dst_machine_weights"))
        if mixing.static is None or mixing.self_weight is not None:
            raise TypeError(f"{args.what}: in jaxfog.simulate the machine weights must "
                            "be concrete (numbers, dicts, lists or rank-indexed arrays "
                            "over machines), not traced values")
        wm = mixing.static
    _clock.synchronize()
    return _mixing.hierarchical_mix(leaves, wm, sim)


HIERARCHICAL_NEIGHBOR_ALLREDUCE = Op("hierarchical_neighbor_allreduce",
                                     simulated=_hierarchical_neighbor_allreduce_on_agents,
                                     mpi_run=_hierarchical_mpi)


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
    args = _hierarchical_args(
        self_weight=self_weight, src_machine_weights=src_machine_weights,
        dst_machine_weights=dst_machine_weights, name=name)
    return _dispatch.apply(HIERARCHICAL_NEIGHBOR_ALLREDUCE, x, args)


__all__ = ["hierarchical_neighbor_allreduce"]
