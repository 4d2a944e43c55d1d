"""Communication graphs and dynamic schedules for decentralized averaging.

This package is pure data: numpy only (networkx is imported lazily by the interop
functions). It knows nothing of MPI or JAX tracing, so every object here can be built,
inspected and tested anywhere, and handed to a jitted function as a static argument.

Weight-matrix convention
------------------------
``W[i, j]`` is the weight that receiver ``i`` gives to the value of sender ``j``: one
averaging step is ``x_new = W @ x``. ``W[i, i]`` is the self weight and the edge
``j -> i`` exists iff ``W[i, j] != 0`` (``i != j``). Row sums 1 means row-stochastic
(pull), column sums 1 means column-stochastic (push), both means doubly stochastic.
Unweighted graphs get uniform weights ``1 / (in_degree + 1)`` in each receiver's row,
self included.

Contents
--------
* :class:`Topology`: an immutable, hashable weight matrix with neighbour queries.
* Static graphs: :func:`exponential`, :func:`symmetric_exponential`, :func:`ring`,
  :func:`mesh_grid_2d`, :func:`star`, :func:`fully_connected`,
  :func:`metropolis_hastings`, :func:`from_weights`, :func:`from_networkx`.
* :class:`Schedule`: an immutable, hashable periodic sequence of topologies.
* Dynamic schedules: :func:`one_peer_exponential`, :func:`one_peer`,
  :func:`inner_outer_ring`, :func:`inner_outer_exponential`,
  :func:`machine_one_peer_exponential`.
* :func:`send_recv_ranks`: BlueFog-style per-rank ``(send_ranks, recv_ranks)`` generator.
"""

from jaxfog.errors import TopologyWarning
from jaxfog.topology._graphs import (
    Topology,
    exponential,
    from_networkx,
    from_weights,
    fully_connected,
    mesh_grid_2d,
    metropolis_hastings,
    ring,
    star,
    symmetric_exponential,
)
from jaxfog.topology._schedules import (
    Schedule,
    inner_outer_exponential,
    inner_outer_ring,
    machine_one_peer_exponential,
    one_peer,
    one_peer_exponential,
    send_recv_ranks,
)

# Pickles made while this package was one module name its unpickling hooks here.
from jaxfog.topology._graphs import _restore_topology  # noqa: F401
from jaxfog.topology._schedules import _restore_schedule  # noqa: F401

__all__ = [
    "Topology",
    "Schedule",
    "TopologyWarning",
    "from_weights",
    "from_networkx",
    "metropolis_hastings",
    "exponential",
    "symmetric_exponential",
    "ring",
    "mesh_grid_2d",
    "star",
    "fully_connected",
    "one_peer_exponential",
    "one_peer",
    "inner_outer_ring",
    "inner_outer_exponential",
    "machine_one_peer_exponential",
    "send_recv_ranks",
]
