"""jaxfog: decentralized optimization for JAX.

Neighbor averaging and collectives as XLA FFI custom calls over MPI, BlueFog's
topologies, and one program that runs as n MPI processes (``jaxfog run``).
"""

import importlib
from typing import TYPE_CHECKING, Any

from jaxfog import ops, topology
from jaxfog.errors import JaxfogError, JaxfogTimeoutError, NotInitializedError
from jaxfog.runtime import (
    async_min_bytes,
    comm_thread_min_bytes,
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
    set_async_min_bytes,
    set_comm_thread_min_bytes,
    set_machine_topology,
    set_topology,
    shutdown,
    size,
)
from jaxfog.traffic import CommStats, comm_stats

__version__ = "0.1.0"

# Names that need JAX, imported on first use so that `import jaxfog` (and the
# `jaxfog run` launcher) stays light. The ops come from jaxfog.ops's one list
# (itself light); comm_rank and comm_size stay in jaxfog.ops, since
# jaxfog.rank() and jaxfog.size() answer the same outside a computation.
_OPS = tuple(name for name in ops.OPS if name not in ("comm_rank", "comm_size"))
_LAZY = {"simulate": "jaxfog.simulation", "Agents": "jaxfog.simulation",
         "Delays": "jaxfog.simulation", "reset_clocks": "jaxfog.simulation",
         "jit": "jaxfog.ops.jit", **{name: "jaxfog.ops" for name in _OPS}}

if TYPE_CHECKING:  # the lazy names as type checkers see them (at run time: __getattr__)
    from jaxfog.ops.jit import jit
    from jaxfog.simulation import Agents, Delays, reset_clocks, simulate
    from jaxfog.ops.collective import (allgather, allgather_nonblocking, allreduce,
                                       allreduce_nonblocking, broadcast, broadcast_nonblocking)
    from jaxfog.ops.hierarchical import hierarchical_neighbor_allreduce
    from jaxfog.ops.neighbor import (
        neighbor_allgather, neighbor_allgather_nonblocking, neighbor_allreduce,
        neighbor_allreduce_nonblocking, pair_gossip, pair_gossip_nonblocking)
    from jaxfog.ops.nonblocking import Handle, poll, wait, wait_all
    from jaxfog.ops.process import barrier
    from jaxfog.ops.window import (
        win_accumulate, win_accumulate_nonblocking, win_create, win_free, win_get,
        win_get_nonblocking, win_mutex, win_put, win_put_nonblocking, win_update,
        win_update_then_collect, win_version, win_weight)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxfog' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so that dir(), pydoc and IDEs list the whole API.
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Agents", "CommStats", "Delays", "JaxfogError", "JaxfogTimeoutError", "NotInitializedError",
    *_OPS, "async_min_bytes", "comm_stats", "comm_thread_min_bytes", "in_neighbor_ranks", "init",
    "is_homogeneous", "is_initialized", "jit", "load_machine_topology", "load_topology",
    "local_rank", "local_size", "machine_rank", "machine_size", "out_neighbor_ranks", "rank",
    "reset_clocks", "set_async_min_bytes", "set_comm_thread_min_bytes", "set_machine_topology",
    "set_topology", "shutdown", "simulate", "size", "topology",
]
