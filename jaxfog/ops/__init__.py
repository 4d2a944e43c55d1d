"""Communication ops.

Each op is one block of its family's module (``neighbor``, ``collective``,
``hierarchical``, ``process``, ``window``): it resolves its arguments once
and is one record holding its rule on each backend, of which
:func:`jaxfog.ops._dispatch.current` picks one: its FFI primitive (a custom
call into the C++ library over MPI) or ``lax`` collectives over simulated
agents. See ``docs/architecture.rst``.

``OPS`` below is the one list of public ops: the name of each and the module
of its family that defines it. ``jaxfog.<op>`` and ``jaxfog.ops.<op>`` are
read from it, and both load the op's module (and JAX) on first use only.
"""

import importlib
from typing import TYPE_CHECKING, Any

#: Every public op, by the module (in ``jaxfog.ops``) that defines it.
OPS = {
    "neighbor_allreduce": "neighbor", "neighbor_allgather": "neighbor",
    "pair_gossip": "neighbor",
    "hierarchical_neighbor_allreduce": "hierarchical",
    "allreduce": "collective", "broadcast": "collective", "allgather": "collective",
    "barrier": "process", "comm_rank": "process", "comm_size": "process",
    "win_create": "window", "win_free": "window", "win_put": "window",
    "win_accumulate": "window", "win_get": "window", "win_update": "window",
    "win_update_then_collect": "window", "win_mutex": "window", "win_version": "window",
    "win_weight": "window",
    "neighbor_allreduce_nonblocking": "neighbor",
    "neighbor_allgather_nonblocking": "neighbor", "pair_gossip_nonblocking": "neighbor",
    "allreduce_nonblocking": "collective", "broadcast_nonblocking": "collective",
    "allgather_nonblocking": "collective", "win_put_nonblocking": "window",
    "win_accumulate_nonblocking": "window", "win_get_nonblocking": "window",
    "wait": "nonblocking", "wait_all": "nonblocking", "poll": "nonblocking",
    "Handle": "nonblocking",
}

if TYPE_CHECKING:  # the names as type checkers see them (at run time: __getattr__)
    from jaxfog.ops.collective import (allgather, allgather_nonblocking, allreduce,
                                       allreduce_nonblocking, broadcast, broadcast_nonblocking)
    from jaxfog.ops.hierarchical import hierarchical_neighbor_allreduce
    from jaxfog.ops.neighbor import (
        neighbor_allgather, neighbor_allgather_nonblocking, neighbor_allreduce,
        neighbor_allreduce_nonblocking, pair_gossip, pair_gossip_nonblocking)
    from jaxfog.ops.nonblocking import Handle, poll, wait, wait_all
    from jaxfog.ops.process import barrier, comm_rank, comm_size
    from jaxfog.ops.window import (
        win_accumulate, win_accumulate_nonblocking, win_create, win_free, win_get,
        win_get_nonblocking, win_mutex, win_put, win_put_nonblocking, win_update,
        win_update_then_collect, win_version, win_weight)


def __getattr__(name: str) -> Any:
    if name in OPS:
        return getattr(importlib.import_module(f"{__name__}.{OPS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(OPS))


__all__ = sorted(OPS)
