"""Nonblocking ops: start an exchange now, wait for it later (BlueFog's
``*_nonblocking`` and ``wait``).

``handle = jaxfog.neighbor_allreduce_nonblocking(x)`` starts the exchange and
returns at once; ``jaxfog.wait(handle)`` returns what
``jaxfog.neighbor_allreduce(x)`` would have. Between the two the program
computes (a gradient, the next inner steps) while the messages move. The
start and the wait may lie in different ``jax.jit`` / ``jaxfog.jit`` calls
or iterations of a ``lax.scan``: a :class:`Handle` is a pytree of JAX
arrays, so it is returned, passed and carried like any value.

On MPI processes a start copies its inputs before it returns (reuse or
donate them at once) and hands the messages to jaxfog's communication
thread in program order, like every op; a wait does not communicate, so a
rank may wait for its handles in any order. A handle is waited for once;
waiting twice raises, and :func:`jaxfog.shutdown` warns of handles never
waited for. On simulated agents the result is computed at the start and
held in the handle; with :class:`jaxfog.Delays` the agent's clock waits for
the messages at the wait, not at the start.

Differentiable where the blocking op is: the adjoint of start/wait is
start/wait of the adjoint op, so under ``jax.grad`` the cotangents' exchange
is started where the forward pass waited and waited for where it started:
it moves while the backward pass computes what lay between.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from jaxfog import topology as T
from jaxfog.errors import HandleError
from jaxfog.ops import _args, _backends


@jax.tree_util.register_pytree_node_class
class Handle:
    """A nonblocking op in flight; :func:`wait` gives its result.

    A pytree: its leaves are JAX arrays (on MPI processes a ticket naming the
    op in this process's C++ library; on simulated agents the held result),
    its structure says which op it is and how to finish it. Pass it through
    ``jit``, return it, carry it in a ``lax.scan``.
    """

    __slots__ = ("arrays", "spec", "waited")

    def __init__(self, arrays: Sequence[Any], spec: Any):
        self.arrays = tuple(arrays)
        # (op, the backend's record of the start, the result's treedef)
        self.spec = spec
        self.waited = False

    @property
    def op(self) -> str:
        return self.spec[0]

    def tree_flatten(self):
        return self.arrays, self.spec

    @classmethod
    def tree_unflatten(cls, spec, arrays):
        return cls(arrays, spec)

    def __repr__(self) -> str:
        return f"Handle({self.op})"


def _started(op: str, leaves: list, treedef: Any, args: Any, label: str,
             result: Any) -> Handle:
    """Starts ``op`` on the backend (the one call of its ``start``): a handle
    named ``label`` whose wait gives a result of structure ``result``."""
    arrays, started = _backends.current().start(op, leaves, treedef, args)
    return Handle(arrays, (label, started, result))


def _start(op: str, x: Any, args: Any) -> Handle:
    leaves, treedef = _args.leaves(op, x)
    return _started(op, leaves, treedef, args, op, treedef)


def _start_put(x: Any, name: str, self_weight: Any, dst_weights: Any, require_mutex: bool,
               accumulate: bool) -> Handle:
    args = _args.win_put(name=name, self_weight=self_weight, dst_weights=dst_weights,
                         require_mutex=require_mutex, accumulate=accumulate)
    leaves, treedef = _args.leaves(args.what, x)
    return _started("win_put", leaves, treedef, args, args.what.removeprefix("jaxfog."),
                    treedef)


def wait(handle: Handle) -> Any:
    """The result of the nonblocking op ``handle`` started.

    Blocks (or, inside ``jit``, makes what uses the result wait) until the
    op has finished on this rank. Wait for each handle once.
    """
    if not isinstance(handle, Handle):
        raise HandleError(f"jaxfog.wait: expected a Handle from a *_nonblocking op, got "
                          f"{type(handle).__name__}")
    if handle.waited:
        raise HandleError(f"jaxfog.wait: this {handle.op} handle was already waited for "
                          "(wait for each handle once)")
    handle.waited = True
    op, started, treedef = handle.spec
    return jax.tree.unflatten(treedef, _backends.current().wait(list(handle.arrays), started))


def poll(handle: Handle) -> bool:
    """Whether the op ``handle`` started has finished on this rank, so that
    :func:`wait` would not block (BlueFog's ``poll``). Outside ``jit`` only: it
    reads the handle's arrays. On simulated agents, always True."""
    if not isinstance(handle, Handle):
        raise HandleError(f"jaxfog.poll: expected a Handle from a *_nonblocking op, got "
                          f"{type(handle).__name__}")
    if handle.waited:
        raise HandleError(f"jaxfog.poll: this {handle.op} handle was already waited for")
    op, started, treedef = handle.spec
    return _backends.current().poll(list(handle.arrays), started)


def wait_all(tree: Any) -> Any:
    """``tree`` with each :class:`Handle` in it replaced by its result
    (:func:`wait`); e.g. ``jaxfog.wait_all(opt_state)`` when training ends,
    for the exchanges an optimizer keeps in flight."""
    return jax.tree.map(lambda leaf: wait(leaf) if isinstance(leaf, Handle) else leaf, tree,
                        is_leaf=lambda leaf: isinstance(leaf, Handle))


def neighbor_allreduce_nonblocking(x: Any, *, self_weight: float | None = None,
                                   src_weights: dict[int, float] | None = None,
                                   dst_weights: dict[int, float] | Sequence[int] | None = None,
                                   topology: T.Topology | T.Schedule | None = None,
                                   step: Any = None, check_topology: bool = False,
                                   name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.neighbor_allreduce` (same arguments); :func:`wait`
    gives its result.

    Example (BlueFog's Listing 5: the exchange of x overlaps the gradient)::

        handle = jaxfog.neighbor_allreduce_nonblocking(x)
        g = grad(loss)(x, batch)
        x = jaxfog.wait(handle) - lr * g
    """
    args = _args.neighbor_allreduce(self_weight=self_weight, src_weights=src_weights,
                                    dst_weights=dst_weights, topology=topology, step=step,
                                    check_topology=check_topology, name=name)
    return _start("neighbor_allreduce", x, args)


def neighbor_allgather_nonblocking(x: Any, *, src_ranks: Sequence[int] | None = None,
                                   dst_ranks: Sequence[int] | None = None,
                                   name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.neighbor_allgather` (same arguments)."""
    args = _args.neighbor_allgather(src_ranks=src_ranks, dst_ranks=dst_ranks, name=name)
    return _start("neighbor_allgather", x, args)


def pair_gossip_nonblocking(x: Any, peer: Any, *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.pair_gossip` (same arguments)."""
    return _start("pair_gossip", x, _args.pair_gossip(peer, name=name))


def allreduce_nonblocking(x: Any, op: str = "mean", *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.allreduce` (same arguments)."""
    return _start("allreduce", x, _args.allreduce(op=op, name=name))


def broadcast_nonblocking(x: Any, root: int = 0, *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.broadcast` (same arguments)."""
    return _start("broadcast", x, _args.broadcast(root=root, name=name))


def allgather_nonblocking(x: Any, *, name: str | None = None) -> Handle:
    """Starts :func:`jaxfog.allgather` (same arguments)."""
    return _start("allgather", x, _args.allgather(name=name))


def win_put_nonblocking(x: Any, name: str, *, self_weight: float | None = None,
                        dst_weights: Any = None, require_mutex: bool = False) -> Handle:
    """Starts :func:`jaxfog.ops.window.win_put` (same arguments); :func:`wait` gives
    ``self_weight * x`` once the writes have completed at the destinations."""
    return _start_put(x, name, self_weight, dst_weights, require_mutex, accumulate=False)


def win_accumulate_nonblocking(x: Any, name: str, *, self_weight: float | None = None,
                               dst_weights: Any = None, require_mutex: bool = False) -> Handle:
    """Starts :func:`jaxfog.ops.window.win_accumulate` (same arguments)."""
    return _start_put(x, name, self_weight, dst_weights, require_mutex, accumulate=True)


def win_get_nonblocking(name: str, *, src_weights: Any = None,
                        require_mutex: bool = False) -> Handle:
    """Starts :func:`jaxfog.ops.window.win_get` (same arguments); :func:`wait` gives True
    once the slots hold what was read."""
    args = _args.win_get(name=name, src_weights=src_weights, require_mutex=require_mutex)
    return _started("win_get", [], None, args, "win_get", jax.tree.structure(True))


__all__ = ["Handle", "allgather_nonblocking", "allreduce_nonblocking",
           "broadcast_nonblocking", "neighbor_allgather_nonblocking",
           "neighbor_allreduce_nonblocking", "pair_gossip_nonblocking", "poll", "wait",
           "wait_all",
           "win_accumulate_nonblocking", "win_get_nonblocking", "win_put_nonblocking"]
