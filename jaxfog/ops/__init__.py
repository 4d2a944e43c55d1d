"""Communication ops: each a JAX primitive lowered to a custom call into
jaxfog's C++ FFI library, with jvp, transpose and batching rules beside it."""

from jaxfog.ops.collective import allgather, allreduce, broadcast
from jaxfog.ops.hierarchical import hierarchical_neighbor_allreduce
from jaxfog.ops.neighbor import neighbor_allgather, neighbor_allreduce
from jaxfog.ops.process import barrier, comm_rank, comm_size

__all__ = ["allgather", "allreduce", "barrier", "broadcast", "comm_rank", "comm_size",
           "hierarchical_neighbor_allreduce", "neighbor_allgather", "neighbor_allreduce"]
