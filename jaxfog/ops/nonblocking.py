"""Nonblocking ops: start an exchange now, wait for it later (BlueFog's
``*_nonblocking`` and ``wait``). Here: the :class:`Handle`, :func:`wait`,
:func:`poll`, :func:`wait_all`, and the :func:`start` every ``*_nonblocking``
form calls (each lives beside its blocking op: ``jaxfog.ops.neighbor``,
``collective``, ``window``).

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

from jaxfog.errors import HandleError
from jaxfog.ops import _args, _dispatch
from jaxfog.ops._backends import Op


@jax.tree_util.register_pytree_node_class
class Handle:
    """A nonblocking op in flight; :func:`wait` gives its result.

    A pytree: its leaves are JAX arrays (on MPI processes a handle id naming the
    op in this process's C++ library; on simulated agents the held result),
    its structure says which op it is and how to finish it. Pass it through
    ``jit``, return it, carry it in a ``lax.scan``.
    """

    __slots__ = ("arrays", "aux", "waited")

    def __init__(self, arrays: Sequence[Any], aux: Any):
        self.arrays = tuple(arrays)
        # Its pytree aux data: (op, the backend's handle, the result's treedef).
        self.aux = aux
        self.waited = False

    @property
    def op(self) -> str:
        return self.aux[0]

    def tree_flatten(self):
        return self.arrays, self.aux

    @classmethod
    def tree_unflatten(cls, aux, arrays):
        return cls(arrays, aux)

    def __repr__(self) -> str:
        return f"Handle({self.op})"


def start(op: Op, x: Any, args: Any) -> Handle:
    """Starts ``op`` with its resolved ``args`` on the pytree ``x``: each
    ``*_nonblocking`` form of a message op (in its op's module) is this."""
    leaves, treedef = _args.leaves(op.name, x)
    return start_leaves(op, leaves, treedef, args, op.name, treedef)


def start_leaves(op: Op, leaves: list, treedef: Any, args: Any, label: str,
                 result: Any) -> Handle:
    """Starts ``op`` on the backend (the one call of its ``start``): a handle
    named ``label`` whose wait gives a result of structure ``result``."""
    arrays, backend_handle = _dispatch.current().start(op, leaves, treedef, args)
    return Handle(arrays, (label, backend_handle, result))


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
    op, backend_handle, treedef = handle.aux
    leaves = _dispatch.current().wait(list(handle.arrays), backend_handle)
    return jax.tree.unflatten(treedef, leaves)


def poll(handle: Handle) -> bool:
    """Whether the op ``handle`` started has finished on this rank, so that
    :func:`wait` would not block (BlueFog's ``poll``). Outside ``jit`` only: it
    reads the handle's arrays. On simulated agents, always True."""
    if not isinstance(handle, Handle):
        raise HandleError(f"jaxfog.poll: expected a Handle from a *_nonblocking op, got "
                          f"{type(handle).__name__}")
    if handle.waited:
        raise HandleError(f"jaxfog.poll: this {handle.op} handle was already waited for")
    op, backend_handle, treedef = handle.aux
    return _dispatch.current().poll(list(handle.arrays), backend_handle)


def wait_all(tree: Any) -> Any:
    """``tree`` with each :class:`Handle` in it replaced by its result
    (:func:`wait`); e.g. ``jaxfog.wait_all(opt_state)`` when training ends,
    for the exchanges an optimizer keeps in flight."""
    return jax.tree.map(lambda leaf: wait(leaf) if isinstance(leaf, Handle) else leaf, tree,
                        is_leaf=lambda leaf: isinstance(leaf, Handle))


__all__ = ["Handle", "poll", "wait", "wait_all"]
