"""Communication ops: each a custom call into jaxfog's C++ FFI library."""

from jaxfog.ops.process import barrier, comm_rank, comm_size

__all__ = ["barrier", "comm_rank", "comm_size"]
