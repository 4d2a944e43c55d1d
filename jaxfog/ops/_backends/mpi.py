"""The MPI backend: each op is one of the FFI primitives (an XLA custom call).

This rank's part of an op is computed here at trace time (its row of W as a
communication plan, its ranks, its root) and passed to the primitive as
static parameters; the C++ handler exchanges the messages.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jaxfog import ffi, runtime
from jaxfog.errors import JaxfogTimeoutError
from jaxfog import topology as T
from jaxfog.ops import _args, _call, _plan
from jaxfog.ops._call import Call, StartedCall
from jaxfog.ops import _op_primitives as P
from jaxfog.ops._backends import mpi_windows


def _static(value: Any, label: str, what: str) -> np.ndarray:
    if _args.is_traced(value):
        raise TypeError(
            f"{what}: {label} is a traced value, but on MPI processes it must be concrete "
            "(a number, a dict, a list or a numpy/JAX array): its nonzero entries fix whom "
            "this rank exchanges with when the op is compiled. Pass the whole rank-indexed "
            "table (each rank takes its row) rather than indexing it with jaxfog.rank() "
            "inside a jitted function")
    return np.asarray(value, np.float64)


def _row_dict(row: np.ndarray, skip: int | None = None) -> dict[int, float]:
    return {int(j): float(row[j]) for j in np.flatnonzero(row) if j != skip}


def local_view(view: _args.LocalView, rank: int, what: str,
               labels: tuple[str, str] = ("src_weights", "dst_weights")) -> _args.LocalView:
    """This rank's view (a float and dicts) from any documented form: a
    rank-indexed table is reduced to this rank's row; with a whole (n, n)
    table of one side and nothing of the other, the other side follows from
    the table (a pull table says where to send, a push table whom to hear)."""
    self_weight, src, dst = view
    if _args.is_array(self_weight):
        a = _static(self_weight, "self_weight", what)
        self_weight = float(a[rank] if a.ndim == 1 else a)
    tables = {}
    for label, value in zip(labels, (src, dst)):
        if _args.is_array(value):
            tables[label] = _static(value, label, what)
    S, D = tables.get(labels[0]), tables.get(labels[1])
    if S is not None:
        src = _row_dict(S[rank], skip=rank) if S.ndim == 2 else _row_dict(S)
    if D is not None:
        dst = _row_dict(D[rank], skip=rank) if D.ndim == 2 else _row_dict(D)
    if S is not None and S.ndim == 2 and D is not None and D.ndim == 2:
        src = {j: w for j, w in src.items() if D[j, rank] != 0}
        dst = {i: w for i, w in dst.items() if S[i, rank] != 0}
    elif S is not None and S.ndim == 2 and view.dst_weights is None:
        dst = {int(i): 1.0 for i in np.flatnonzero(S[:, rank]) if i != rank}
    elif D is not None and D.ndim == 2 and view.src_weights is None:
        src = {int(j): 1.0 for j in np.flatnonzero(D[:, rank]) if j != rank}
    return _args.LocalView(self_weight, src, dst)


def _plan_for(graph: T.Topology | T.Schedule, rank: int,
              local_view_: _args.LocalView | None, what: str,
              labels: tuple[str, str] = ("src_weights", "dst_weights")) -> _plan.Plan:
    if local_view_ is None:
        return _plan.from_topology(graph, rank)
    return _plan.from_local_view(graph, rank, *local_view(local_view_, rank, what, labels),
                                 what=what, labels=labels)


def _mix(leaves: list, plan: _plan.Plan, step: Any, comm_id: int) -> Call:
    step = jnp.asarray(0 if step is None else step).astype(jnp.int32)
    return Call(P.neighbor_allreduce_p, [step, *leaves], {"plan": plan, "comm_id": comm_id},
                n_static=1)


@dataclasses.dataclass(frozen=True)
class _InOrder:
    """A rank-indexed ``src_ranks`` table's row: the blocks received from
    ``recv`` (ascending), in the row's ``order``, this rank's own value (kept)
    where the row names it."""

    rank: int
    order: tuple
    recv: tuple

    def __call__(self, got: list, kept: list) -> list:
        outs = []
        for leaf, blocks in zip(kept, got):
            mine = leaf.reshape(leaf.shape or (1,))
            split = blocks.reshape((len(self.recv), *mine.shape)) if self.recv else None
            parts = [mine if j == self.rank else split[self.recv.index(j)] for j in self.order]
            outs.append(jnp.concatenate(parts, axis=0) if parts else
                        jnp.zeros((0, *mine.shape[1:]), leaf.dtype))
        return outs


# Each op with a nonblocking form is built as a Call; the blocking op runs it,
# a start starts it (CALLS).


def neighbor_allreduce_call(leaves: list, args: _args.NeighborAllreduce) -> Call:
    rank = runtime.rank()
    plan = _plan_for(args.graph, rank, args.local_view, args.what)
    if args.check_topology:
        _plan.check_matching(plan, runtime.communicator(), rank, args.what)
    return _mix(leaves, plan, args.step, runtime.WORLD_COMM_ID)


def pair_gossip_call(leaves: list, args: _args.PairGossip) -> Call:
    if _args.is_traced(args.peer):
        raise TypeError(f"{args.what}: peer is a traced value, but on MPI processes it "
                        "must be concrete (an int, a concrete integer array, or a "
                        "rank-indexed table of peers): the exchange with it is fixed when "
                        "the op is compiled. Make it a static argument of jaxfog.jit, or "
                        "pass the whole table of peers")
    peer = int(args.peer)
    alone = peer == runtime.rank()  # still an op: every rank counts its ops alike
    return neighbor_allreduce_call(leaves, _args.neighbor_allreduce(
        self_weight=1.0 if alone else 0.5, src_weights={} if alone else {peer: 0.5},
        dst_weights=[] if alone else [peer], topology=None, step=None,
        check_topology=False, name=args.what))


def neighbor_allgather_call(leaves: list, args: _args.NeighborAllgather) -> Call:
    rank, size, topology = runtime.rank(), runtime.size(), runtime.load_topology()

    def ranks(given: Any, default: list[int], label: str) -> tuple[int, ...]:
        if given is None:
            return tuple(default)
        return _plan.rank_tuple(given, size, rank, f"{args.what}: {label}")

    def table(given: Any, label: str) -> np.ndarray | None:
        if not _args.is_array(given) or np.ndim(given) != 2:
            return None
        if _args.is_traced(given):
            raise TypeError(f"{args.what}: {label} is a traced value, but on MPI "
                            "processes it must be concrete: the ranks fix the exchanges "
                            "when the op is compiled")
        return np.asarray(given)

    def listed(given: Any, label: str) -> Any:
        if _args.is_array(given):
            table(given[None], label)  # a traced list: the same error
            return np.asarray(given).tolist()
        return given

    sources = table(args.src_ranks, "src_ranks")
    if sources is None:
        order = None
        recv = ranks(listed(args.src_ranks, "src_ranks"), topology.in_neighbors(rank),
                     "src_ranks")
    else:
        # A rank-indexed table: this rank's row, in its order; an entry
        # naming this rank (padding) is its own value, no message.
        order = [int(j) for j in sources[rank]]
        recv = tuple(sorted({j for j in order if j != rank}))
    dst = table(args.dst_ranks, "dst_ranks")
    if dst is not None:
        send = tuple(sorted({int(j) for j in dst[rank] if j != rank}))
    elif args.dst_ranks is None and sources is not None:  # whoever lists this rank
        send = tuple(int(j) for j in range(size)
                     if j != rank and rank in set(sources[j].tolist()))
    else:
        send = ranks(listed(args.dst_ranks, "dst_ranks"), topology.out_neighbors(rank),
                     "dst_ranks")
    out_shapes = tuple((len(recv) * (leaf.shape or (1,))[0], *leaf.shape[1:])
                       for leaf in leaves)
    call = Call(P.neighbor_allgather_p, list(leaves),
                {"send_ranks": send, "recv_ranks": recv, "out_shapes": out_shapes,
                 "comm_id": runtime.WORLD_COMM_ID})
    if order is None:
        return call
    return call._replace(post=_InOrder(rank, tuple(order), recv), kept=list(leaves))


def allreduce_call(leaves: list, args: _args.Allreduce) -> Call:
    return Call(P.allreduce_p, list(leaves),
                {"mean": args.mean, "comm_id": runtime.WORLD_COMM_ID})


def broadcast_call(leaves: list, args: _args.Broadcast) -> Call:
    return Call(P.broadcast_p, list(leaves),
                {"root": args.root, "comm_id": runtime.WORLD_COMM_ID})


def allgather_call(leaves: list, args: _args.Allgather) -> Call:
    return Call(P.allgather_p, list(leaves),
                {"size": runtime.size(), "comm_id": runtime.WORLD_COMM_ID})


def _message(build: Callable[[list, Any], Call]) -> Callable[[list, Any, Any], Call]:
    """A message op's builder as a start calls it (its treedef unused)."""
    return lambda leaves, treedef, args: build(leaves, args)


#: The ops with a nonblocking form, each with the function that builds its
#: :class:`Call` from a start's inputs (``leaves, treedef, args``); the keys
#: are those of the simulation's ``jaxfog.simulation._backend.STARTS``.
CALLS: dict[str, Callable[[list, Any, Any], Call]] = {
    "neighbor_allreduce": _message(neighbor_allreduce_call),
    "pair_gossip": _message(pair_gossip_call),
    "neighbor_allgather": _message(neighbor_allgather_call),
    "allreduce": _message(allreduce_call),
    "broadcast": _message(broadcast_call),
    "allgather": _message(allgather_call),
    "win_put": mpi_windows.win_put_call,
    "win_get": lambda leaves, treedef, args: mpi_windows.win_get_call(args),
}


def _barrier() -> None:
    P.barrier_p.bind(comm_id=runtime.WORLD_COMM_ID)


class MpiOps:
    """The message ops on this job's MPI processes, through jaxfog's C++ FFI
    library: each runs its :class:`Call` (:data:`CALLS`), and a start starts
    it."""

    def neighbor_allreduce(self, leaves: list, args: _args.NeighborAllreduce) -> list:
        return neighbor_allreduce_call(leaves, args).run()

    def pair_gossip(self, leaves: list, args: _args.PairGossip) -> list:
        return pair_gossip_call(leaves, args).run()

    def hierarchical_neighbor_allreduce(
            self, leaves: list, args: _args.HierarchicalNeighborAllreduce) -> list:
        # Machine means, the leaders' averaging over the machine topology, and
        # the leaders' results broadcast inside each machine (BlueFog, V-B).
        plan = _plan_for(runtime.load_machine_topology(), runtime.machine_rank(),
                         args.local_view, args.what,
                         ("src_machine_weights", "dst_machine_weights"))
        local = P.allreduce_p.bind(*leaves, mean=True, comm_id=runtime.LOCAL_COMM_ID)
        if runtime.local_rank() == 0:
            local = _mix(local, plan, None, runtime.LEADERS_COMM_ID).run()
        return P.broadcast_p.bind(*local, root=0, comm_id=runtime.LOCAL_COMM_ID)

    def neighbor_allgather(self, leaves: list, args: _args.NeighborAllgather) -> list:
        return neighbor_allgather_call(leaves, args).run()

    def allreduce(self, leaves: list, args: _args.Allreduce) -> list:
        return allreduce_call(leaves, args).run()

    def broadcast(self, leaves: list, args: _args.Broadcast) -> list:
        return broadcast_call(leaves, args).run()

    def allgather(self, leaves: list, args: _args.Allgather) -> list:
        return allgather_call(leaves, args).run()

    def barrier(self) -> None:
        _barrier()

    # Nonblocking ops: each op's Call started, and finished at the wait.
    def start(self, op: str, leaves: list, treedef: Any, args: Any
              ) -> tuple[list, StartedCall]:
        build = CALLS.get(op)
        if build is None:
            raise NotImplementedError(f"jaxfog.{op} has no nonblocking form")
        return _call.start_call(build(leaves, treedef, args))

    def wait(self, arrays: list, started: StartedCall) -> list:
        return _call.wait_call(arrays, started)

    def poll(self, arrays: list, started: StartedCall) -> bool:
        return _call.poll_call(arrays, started)


class MpiTrainingLoop:
    """An agent's training loop (jaxfog.ops._agent): real time, compiled steps."""

    def now(self) -> float:
        return time.perf_counter()

    def call_step(self, step: Any, *args: Any) -> Any:
        return step.jitted(*args)

    def compile_step(self, step: Any, *args: Any) -> None:
        step.jitted.lower(*args).compile()

    def settle(self) -> None:
        """Every rank's one-sided writes so far have landed (a barrier)."""
        _barrier()

    def run(self, trainer: Any, state: Any, grad_fn: Any, iterations: int, until: Any, *,
            warmup: bool, poll: float, callback: Any) -> Any:
        """The agent's loop in real time: wait for ``ready``, step, repeat."""
        limit, until = runtime.timeout(), float(until)
        if warmup:
            trainer.compile(state, grad_fn)
        while int(state.iteration) < iterations and self.now() < until:
            start = time.monotonic()
            while not trainer.ready(state):
                if self.now() >= until:
                    return state
                if limit and time.monotonic() - start > limit:
                    raise JaxfogTimeoutError(
                        f"rank {runtime.rank()}: not ready for iteration "
                        f"{int(state.iteration)} after {limit:.0f} s (JAXFOG_TIMEOUT): a "
                        "neighbour stopped")
                time.sleep(poll)
            state = trainer.step(state, grad_fn)
            if callback is not None:
                callback(state)
        return state


class MpiBackend(MpiOps, mpi_windows.MpiWindows, MpiTrainingLoop,
                 mpi_windows.MpiSharedValues):
    """Ops on this job's MPI processes: the four concerns of
    ``jaxfog.ops._backends.Backend``."""


_BACKEND = MpiBackend()


def backend() -> MpiBackend:
    """The MPI backend, once jaxfog is initialised (its handlers registered)."""
    runtime._require()
    ffi.register_handlers()
    return _BACKEND
