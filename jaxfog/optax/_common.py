"""What the transformations of :mod:`jaxfog.optax` share: the mark of those
that mix the parameters (read by :func:`check_chain`), the ``params`` check,
and one step of neighbour averaging or of the other communications."""

from __future__ import annotations

import contextvars
import functools
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxfog import _validate as V
from jaxfog import runtime
from jaxfog import topology as T
from jaxfog.ops import (allreduce, allreduce_nonblocking, hierarchical_neighbor_allreduce,
                        neighbor_allreduce, neighbor_allreduce_nonblocking, wait)

Tree = Any


#: Set while :func:`check_chain` builds a probe state: the inits of the
#: transformations marked by :func:`mixes_parameters` then give a
#: :class:`_Mixing` instead of their state.
_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxfog_check_chain",
                                                                default=False)


class _Mixing(NamedTuple):
    """Where a mixing transformation's state stands in a probe state."""

    name: str


def mixes_parameters(make: Callable) -> Callable:
    """Marks the transformations whose update moves the parameters to mixed
    values, so that :func:`check_chain` can find them in a chain: while it
    probes, their ``init`` gives a :class:`_Mixing` (and touches neither the
    parameters nor the backend)."""

    @functools.wraps(make)
    def marked(*args, **kwargs):
        transformation = make(*args, **kwargs)
        init = transformation.init

        @functools.wraps(init)
        def probed_init(params: optax.Params) -> optax.OptState:
            return _Mixing(make.__name__) if _PROBING.get() else init(params)

        return transformation._replace(init=probed_init)

    return marked


def _members(state: Any) -> list:
    """The states of a chain's members in order, nested chains flattened:
    ``optax.chain``'s state is the tuple of its members' states and
    ``optax.named_chain``'s the (ordered) dict of them (their documented layout);
    any other state is one member."""
    if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
        return [m for s in state for m in _members(s)]
    if isinstance(state, dict):
        return [m for s in state.values() for m in _members(s)]
    return [state]


def check_chain(optimizer: optax.GradientTransformation) -> None:
    """Warns when a transformation that mixes the parameters with the neighbours
    (``atc``, ``awc``, ``push_sum``, ...) is followed by another one in an
    ``optax.chain`` or ``optax.named_chain``: that one would transform the
    mixing too (a clip after ``atc`` clips the consensus step, silently). Put
    it inside instead:
    ``atc(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))``.
    :func:`jaxfog.asynchrony.from_optax` calls it; call it on your own
    optimizer where you build one.

    It reads the chain's state: ``optimizer.init`` on a scalar, traced (no
    JAX backend is started), with the mixing transformations' inits replaced
    by markers. Chains inside other
    wrappers (``optax.partition``, ``optax.masked``, ...) are not looked
    into, and an optimizer whose init fails on a scalar is not checked."""
    V.transformation("jaxfog.optax.check_chain", "optimizer", optimizer)
    states = []

    def probe(params):  # traced only: no array is made, no backend started
        states.append(optimizer.init(params))
        return ()

    token = _PROBING.set(True)
    try:
        jax.eval_shape(probe, jax.ShapeDtypeStruct((), jnp.float32))
    except Exception:  # noqa: BLE001 (a structured init: not checked, as documented)
        return
    finally:
        _PROBING.reset(token)
    members = _members(states[0])
    for k, member in enumerate(members[:-1]):
        if isinstance(member, _Mixing):
            name = member.name
            warnings.warn(
                f"jaxfog.optax.{name} is followed by {len(members) - k - 1} other "
                "transformation(s) in an optax.chain: they will also transform the "
                f"neighbour mixing in {name}'s update (a clip would clip the consensus "
                f"step). Put them inside instead: {name}(optax.chain(..., inner)), or "
                f"make {name} the chain's last element.", UserWarning, stacklevel=2)
            return


def need_params(name: str, params: Any) -> None:
    if params is None:
        raise ValueError(f"jaxfog.optax.{name}: update() needs params "
                         "(call update(grads, state, params))")


def average(tree: Tree, topology: Any, count: jax.Array, caller: str) -> Tree:
    """One neighbor averaging step with W (static, runtime or scheduled: the
    step picks a Schedule's entry and is ignored by a static graph); errors
    name the transformation the user called."""
    return neighbor_allreduce(tree, topology=topology, step=count,
                              name=f"jaxfog.optax.{caller}")


def add(a: Tree, b: Tree) -> Tree:
    return jax.tree.map(lambda x, y: x + y, a, b)


def sub(a: Tree, b: Tree) -> Tree:
    return jax.tree.map(lambda x, y: x - y, a, b)


def communicate(tree: Tree, topology: Any, count: jax.Array, communication: str,
                 global_every: int | None, caller: str) -> Tree:
    name = f"jaxfog.optax.{caller}"
    allreduce_named = lambda t: allreduce(t, name=name)  # noqa: E731
    mixers = {"neighbor": lambda t: average(t, topology, count, caller),
              "allreduce": allreduce_named,
              "hierarchical": lambda t: hierarchical_neighbor_allreduce(t, name=name),
              "none": lambda t: t}
    mix = mixers[communication]
    if global_every is None:
        return mix(tree)
    # The step count is the same on every rank, so all take the same branch.
    return lax.cond(count % global_every == 0, allreduce_named, mix, tree)


COMMUNICATIONS = ("neighbor", "allreduce", "hierarchical", "none")


class Delayed(NamedTuple):
    """The exchanges in flight of a delayed mixing, oldest first: each
    ``(handle, sent, self_weight)``, the handle of the mix of ``sent`` with
    a W whose diagonal entry for this agent is ``self_weight``; after a
    ``finish`` (:func:`delayed_finish`), idle exchanges that mix nothing."""

    exchanges: tuple


def check_delay(what: str, delay: Any, communication: str, global_every: Any) -> int:
    """``delay``, checked: a non-negative integer, with communication that
    has a nonblocking form."""
    what = f"jaxfog.optax.{what}"
    V.integer(what, "delay", delay, minimum=0)
    if delay and (communication not in ("neighbor", "allreduce") or global_every is not None):
        raise ValueError(f"{what}: delay= mixes with neighbour or global averaging "
                         f"(communication='neighbor' or 'allreduce', no global_every); got "
                         f"communication={communication!r}, global_every={global_every!r}")
    return int(delay)


def _self_weight(topology: Any, count: jax.Array, communication: str) -> jax.Array:
    """This agent's diagonal entry of the W that mixes at step ``count``."""
    if communication == "allreduce":
        return jnp.asarray(1.0 / runtime.size())
    graph = runtime.load_topology() if topology is None else topology
    if isinstance(graph, T.Schedule):
        table = np.stack([np.diagonal(t.weights) for t in graph])
        return jnp.asarray(table)[count % graph.period, runtime.rank()]
    return jnp.asarray(np.diagonal(graph.weights))[runtime.rank()]


def _start_mix(tree: Tree, topology: Any, count: jax.Array, communication: str,
               caller: str) -> tuple:
    """Starts the mixing of ``tree`` (:func:`communicate`'s, nonblocking): an
    entry of :class:`Delayed`."""
    name = f"jaxfog.optax.{caller}"
    if communication == "allreduce":
        handle = allreduce_nonblocking(tree, name=name)
    else:
        handle = neighbor_allreduce_nonblocking(tree, topology=topology, step=count, name=name)
    return handle, tree, _self_weight(topology, count, communication)


def delayed_init(params: Tree, delay: int, topology: Any, communication: str,
                 caller: str) -> Delayed:
    """``delay`` exchanges of ``params`` in flight: in the first ``delay``
    steps the neighbours' values are their initial ones."""
    step = jnp.zeros([], jnp.int32)
    return Delayed(tuple(_start_mix(params, topology, step, communication, caller)
                         for _ in range(delay)))


def delayed_mix(tree: Tree, delayed: Delayed, topology: Any, count: jax.Array,
                communication: str, caller: str) -> tuple[Tree, Delayed]:
    """Starts the mixing of ``tree`` and finishes the oldest exchange in flight:
    ``w_ii tree + sum_{j != i} W_ij sent_j`` (this agent's fresh value, the
    neighbours' as they were sent), and the exchanges left in flight."""
    started = _start_mix(tree, topology, count, communication, caller)
    (handle, sent, w), rest = delayed.exchanges[0], delayed.exchanges[1:]
    mixed = jax.tree.map(lambda m, t, s: m + w.astype(t.dtype) * (t - s), wait(handle), tree,
                         sent)
    return mixed, Delayed((*rest, started))


def _idle(exchange: tuple) -> tuple:
    """An exchange that mixes nothing, in the place of ``exchange``: its
    handle's arrays zero (handle id 0 on MPI processes, which waits for nothing
    and gives zeros; zeros held on simulated agents), ``sent`` zero and the
    self weight 1, so that :func:`delayed_mix`'s
    ``wait + w (tree - sent)`` gives ``tree`` back. Structure, shapes and
    dtypes are ``exchange``'s: a ``lax.scan`` carries it unchanged."""
    handle, sent, w = exchange
    return (jax.tree.map(jnp.zeros_like, handle), jax.tree.map(jnp.zeros_like, sent),
            jnp.ones_like(w))


def delayed_finish(tree: Tree, delayed: Delayed) -> tuple[Tree, Delayed]:
    """Finishes every exchange in flight, oldest first, each as
    :func:`delayed_mix` finishes one, ``z <- wait(handle) + w (z - sent)``
    from ``z = tree``, starting none; returns ``z`` and idle exchanges in
    their places (:func:`_idle`). The same waits on every rank, in one order."""
    for handle, sent, w in delayed.exchanges:
        tree = jax.tree.map(lambda m, t, s: m + w.astype(t.dtype) * (t - s), wait(handle),
                            tree, sent)
    return tree, Delayed(tuple(_idle(exchange) for exchange in delayed.exchanges))
