"""jaxfog: decentralized optimization for JAX.

Neighbor averaging and collectives as XLA FFI custom calls over MPI, BlueFog's
topologies, and one program that runs as n MPI processes (``jaxfog run``).
"""

from jaxfog import topology
from jaxfog.ops import barrier
from jaxfog.runtime import (
    NotInitializedError,
    in_neighbor_ranks,
    init,
    is_homogeneous,
    is_initialized,
    load_machine_topology,
    load_topology,
    local_rank,
    local_size,
    machine_rank,
    machine_size,
    out_neighbor_ranks,
    rank,
    set_machine_topology,
    set_topology,
    shutdown,
    size,
)

__version__ = "0.1.0"

__all__ = [
    "NotInitializedError", "barrier", "in_neighbor_ranks", "init", "is_homogeneous",
    "is_initialized", "load_machine_topology", "load_topology", "local_rank", "local_size",
    "machine_rank", "machine_size", "out_neighbor_ranks", "rank", "set_machine_topology",
    "set_topology", "shutdown", "size", "topology",
]
