"""Hierarchical neighbor averaging (BlueFog paper, section V-B).

Three steps, each one of jaxfog's primitives: (1) average inside every
machine; (2) the machines' local rank 0s average over the *machine* topology;
(3) each machine's local rank 0 broadcasts the result inside its machine. Only
``machine_size()`` ranks talk across machines, which is what makes it cheap on
clusters where the network is the bottleneck.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from jaxfog import _context, runtime
from jaxfog.ops.collective import _leaves, _simulated, allreduce_leaves, broadcast_leaves
from jaxfog.ops.neighbor import build_plan, neighbor_allreduce_leaves


def hierarchical_neighbor_allreduce(
        x: Any, *, self_weight: float | None = None,
        src_machine_weights: dict[int, float] | None = None,
        dst_machine_weights: dict[int, float] | Sequence[int] | None = None,
        name: str | None = None) -> Any:
    """Machine-level neighbor averaging.

    With ``m = machine_rank()`` and ``W_M`` the machine topology
    (``set_machine_topology``), every rank of machine m ends with
    ``sum_{m'} W_M[m, m'] * mean(x over machine m')``. The local view takes
    machine ranks: ``self_weight`` with ``src_machine_weights`` and/or
    ``dst_machine_weights``, with the same pull/push/push-pull meanings as
    ``neighbor_allreduce``.
    """
    leaves, treedef = _leaves("hierarchical_neighbor_allreduce", x)
    what = f"hierarchical_neighbor_allreduce{f' ({name})' if name else ''}"
    if _context.current() is not None:
        if not (self_weight is None and src_machine_weights is None
                and dst_machine_weights is None):
            raise TypeError(f"{what}: in jaxfog.simulate the machine weights come from "
                            "simulate(machine_topology=...), not per-rank dicts")
        return jax.tree.unflatten(treedef, _simulated("hierarchical_neighbor_allreduce",
                                                      leaves))
    machine_topology = runtime.load_machine_topology()
    plan = build_plan(None, runtime.machine_rank(), self_weight, src_machine_weights,
                      dst_machine_weights, machine_topology, what)
    local = allreduce_leaves(leaves, mean=True, comm_id=runtime.LOCAL_COMM_ID)
    if runtime.local_rank() == 0:
        local = neighbor_allreduce_leaves(local, plan, None, runtime.LEADERS_COMM_ID)
    out = broadcast_leaves(local, root=0, comm_id=runtime.LOCAL_COMM_ID)
    return jax.tree.unflatten(treedef, out)


__all__ = ["hierarchical_neighbor_allreduce"]
