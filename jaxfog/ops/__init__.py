"""Communication ops.

Each public op resolves its arguments once (:mod:`jaxfog.ops._args`) and runs
on the backend :func:`jaxfog.ops._backends.current` picks: the FFI primitives
(:mod:`jaxfog.ops._op_primitives`, custom calls into the C++ library over MPI) or
the simulation's ``lax`` collectives. See ``docs/architecture.rst``.

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
    "neighbor_allreduce_nonblocking": "nonblocking",
    "neighbor_allgather_nonblocking": "nonblocking", "pair_gossip_nonblocking": "nonblocking",
    "allreduce_nonblocking": "nonblocking", "broadcast_nonblocking": "nonblocking",
    "allgather_nonblocking": "nonblocking", "win_put_nonblocking": "nonblocking",
    "win_accumulate_nonblocking": "nonblocking", "win_get_nonblocking": "nonblocking",
    "wait": "nonblocking", "wait_all": "nonblocking", "poll": "nonblocking",
    "Handle": "nonblocking",
}

if TYPE_CHECKING:  # the names as type checkers see them (at run time: __getattr__)
    from jaxfog.ops.collective import allgather, allreduce, broadcast
    from jaxfog.ops.hierarchical import hierarchical_neighbor_allreduce
    from jaxfog.ops.neighbor import neighbor_allgather, neighbor_allreduce, pair_gossip
    from jaxfog.ops.nonblocking import (
        Handle, allgather_nonblocking, allreduce_nonblocking, broadcast_nonblocking,
        neighbor_allgather_nonblocking, neighbor_allreduce_nonblocking, pair_gossip_nonblocking,
        poll, wait, wait_all, win_accumulate_nonblocking, win_get_nonblocking,
        win_put_nonblocking)
    from jaxfog.ops.process import barrier, comm_rank, comm_size
    from jaxfog.ops.window import (
        win_accumulate, win_create, win_free, win_get, win_mutex, win_put, win_update,
        win_update_then_collect, win_version, win_weight)


def __getattr__(name: str) -> Any:
    if name in OPS:
        return getattr(importlib.import_module(f"{__name__}.{OPS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(OPS))


__all__ = sorted(OPS)
