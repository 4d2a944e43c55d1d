"""The MPI backend: each op is one of the FFI primitives (an XLA custom call).

This rank's part of an op is computed here at trace time (its row of W as a
communication plan, its ranks, its root) and passed to the primitive as
static parameters; the C++ handler exchanges the messages.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxfog import ffi, runtime
from jaxfog import topology as T
from jaxfog.ops import _args, _plan
from jaxfog.ops import primitives as P
from jaxfog.ops.backends import mpi_windows


def _plan_for(graph: T.Topology | T.Schedule, rank: int,
              local_view: _args.LocalView | None) -> _plan.Plan:
    if local_view is None:
        return _plan.from_topology(graph, rank)
    return _plan.from_local_view(graph, rank, *local_view)


def _mix(leaves: list, plan: _plan.Plan, step: Any, comm_id: int) -> list:
    step = jnp.asarray(0 if step is None else step).astype(jnp.int32)
    return P.neighbor_allreduce_p.bind(step, *leaves, plan=plan, comm_id=comm_id)


class MpiBackend:
    """Ops on this job's MPI processes, through jaxfog's C++ FFI library."""

    def neighbor_allreduce(self, leaves: list, args: _args.NeighborAllreduce) -> list:
        rank = runtime.rank()
        plan = _plan_for(args.graph, rank, args.local_view)
        if args.check_topology:
            _plan.check_matching(plan, runtime.communicator(), rank, args.what)
        return _mix(leaves, plan, args.step, runtime.WORLD_COMM_ID)

    def pair_gossip(self, leaves: list, args: _args.PairGossip) -> list:
        if not isinstance(args.peer, (int, np.integer)):
            raise TypeError(f"{args.what}: on MPI processes the peer must be a Python int "
                            "(a static argument of jaxfog.jit), not a traced value")
        peer = int(args.peer)
        alone = peer == runtime.rank()  # still an op: every rank counts its ops alike
        return self.neighbor_allreduce(leaves, _args.neighbor_allreduce(
            self_weight=1.0 if alone else 0.5, src_weights={} if alone else {peer: 0.5},
            dst_weights=[] if alone else [peer], topology=None, step=None,
            check_topology=False, name=args.what))

    def hierarchical_neighbor_allreduce(
            self, leaves: list, args: _args.HierarchicalNeighborAllreduce) -> list:
        # Machine means, the leaders' averaging over the machine topology, and
        # the leaders' results broadcast inside each machine (BlueFog, V-B).
        plan = _plan_for(runtime.load_machine_topology(), runtime.machine_rank(),
                         args.local_view)
        local = P.allreduce_p.bind(*leaves, mean=True, comm_id=runtime.LOCAL_COMM_ID)
        if runtime.local_rank() == 0:
            local = _mix(local, plan, None, runtime.LEADERS_COMM_ID)
        return P.broadcast_p.bind(*local, root=0, comm_id=runtime.LOCAL_COMM_ID)

    def neighbor_allgather(self, leaves: list, args: _args.NeighborAllgather) -> list:
        rank, size, topology = runtime.rank(), runtime.size(), runtime.load_topology()

        def ranks(given: Any, default: list[int], label: str) -> tuple[int, ...]:
            if given is None:
                return tuple(default)
            return _plan.rank_tuple(given, size, rank, f"{args.what}: {label}")

        recv = ranks(args.src_ranks, topology.in_neighbors(rank), "src_ranks")
        send = ranks(args.dst_ranks, topology.out_neighbors(rank), "dst_ranks")
        out_shapes = tuple((len(recv) * (leaf.shape or (1,))[0], *leaf.shape[1:])
                           for leaf in leaves)
        return P.neighbor_allgather_p.bind(*leaves, send_ranks=send, recv_ranks=recv,
                                           out_shapes=out_shapes,
                                           comm_id=runtime.WORLD_COMM_ID)

    def allreduce(self, leaves: list, args: _args.Allreduce) -> list:
        return P.allreduce_p.bind(*leaves, mean=args.mean, comm_id=runtime.WORLD_COMM_ID)

    def broadcast(self, leaves: list, args: _args.Broadcast) -> list:
        return P.broadcast_p.bind(*leaves, root=args.root, comm_id=runtime.WORLD_COMM_ID)

    def allgather(self, leaves: list, args: _args.Allgather) -> list:
        return P.allgather_p.bind(*leaves, size=runtime.size(),
                                  comm_id=runtime.WORLD_COMM_ID)

    def barrier(self) -> None:
        P.barrier_p.bind(comm_id=runtime.WORLD_COMM_ID)

    # One-sided windows: MPI-3 RMA windows in the C++ library.
    win_create = staticmethod(mpi_windows.win_create)
    win_free = staticmethod(mpi_windows.win_free)
    win_put = staticmethod(mpi_windows.win_put)
    win_get = staticmethod(mpi_windows.win_get)
    win_update = staticmethod(mpi_windows.win_update)
    win_version = staticmethod(mpi_windows.win_version)
    win_weight = staticmethod(mpi_windows.win_weight)
    win_mutex = staticmethod(mpi_windows.win_mutex)


_BACKEND = MpiBackend()


def backend() -> MpiBackend:
    """The MPI backend, once jaxfog is initialised (its handlers registered)."""
    runtime._require()
    ffi.register_handlers()
    return _BACKEND
