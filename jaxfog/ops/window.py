"""One-sided windows: BlueFog's win_* ops in functional form.

A window is created collectively from a value ``x`` (an array or pytree). On
every rank it holds the rank's *published* value and one *slot* shaped like
``x`` per rank it receives from (the in-neighbours of the current topology,
or ``src_ranks``). Ranks write into each other's slots with no matching call
on the receiving side, and combine what has arrived when they choose. The
local value is an argument and the new value is returned; everything else
lives in the window.

For rank ``i`` with slots ``s_j`` (one per source ``j``), published value
``v_i``, version counters ``c_j`` and (``with_weight=True``) push-sum weights
``p_i`` and ``p_j`` per slot:

* ``win_put(x)``: on each destination ``k``: ``s_i := w_k x``,
  ``c_i += 1`` (and ``p := w_k p_i``); ``v_i := x``; ``p_i := a p_i``;
  returns ``a x`` (``a``: ``self_weight``, default 1).
* ``win_accumulate(x)``: the same with ``s_i += w_k x`` (``p += w_k p_i``);
  versions untouched.
* ``win_get()``: ``s_j := w_j v_j`` for each source ``j``; ``c_j += 1``.
* ``win_update(x)``: ``y = a x + sum_j w_j s_j`` (default: the topology's row
  of W when the sources are the in-neighbours, else uniform ``1/(k+1)``);
  ``v_i := y``; ``p_i := a p_i + sum_j w_j p_j``; ``c_j := 0`` for the slots
  read; ``reset`` zeroes them (and their ``p_j``). Returns ``y``.
* ``win_update_then_collect(x)``: ``x + sum_j s_j`` with every slot drained,
  under this rank's mutex.

Writes land while their target computes (one passive-target epoch per
window, each operation flushed), so nothing waits for a slow rank. An update
does not keep concurrent writes out of the slots it reads unless both sides
use the mutex: accumulate with ``require_mutex=True`` when every unit of
mass must be collected exactly once (push-sum).

Each data-moving op is one custom call on MPI, ordered with jaxfog's other
ops on the rank (program order), eagerly and inside ``jax.jit``,
``jaxfog.jit``, ``lax.scan`` and ``fori_loop``; a pytree moves to each peer
as one completion (every leaf put, then one ``MPI_Win_flush``). The ops are
not differentiable (their effect on other
ranks' memory has no tangent): under ``grad`` they raise a ``TypeError``;
differentiate the local computation around them.

Ops name a window when they are traced; creating or freeing a window makes
functions jitted before trace again (so a window made again under the same
name is the one they use).

In the simulation (:func:`jaxfog.simulate`) windows live in the process:
every agent runs the same op at once, so a put or accumulate is visible at
its destination's next update (immediate delivery), and the mutex is
trivially held.

References:
  Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms Practical
  for Optimization and Deep Learning*, 2021 (section IV, one-sided ops).
"""

from __future__ import annotations

from typing import Any, ContextManager, Mapping, Sequence

import jax
import numpy as np

from jaxfog.ops import _args, _dispatch, _windows_mpi, nonblocking
from jaxfog.ops._backends import Op
from jaxfog.ops.nonblocking import Handle
from jaxfog.simulation import _windows as _windows_simulated

Weights = Mapping[int, float] | Sequence[int] | Any  # a dict, a list of ranks or n weights


# Each window op is one record: its rule on MPI processes (``_windows_mpi``: the
# C API for what is collective or eager, a Call of its primitive for what moves
# data) and on simulated agents (``jaxfog.simulation._windows``: the windows as
# JAX references).


def _without_data(name: str, simulated: Any, mpi: Any) -> Op:
    """The record of a window op without data, whose arguments are a tuple
    (the window's name, and more) that both rules take as they are."""
    return Op(name, simulated=lambda sim, leaves, treedef, args: simulated(*args),
              mpi_run=lambda leaves, treedef, args: mpi(*args))


WIN_CREATE = Op("win_create", simulated=_windows_simulated.win_create,
                mpi_run=_windows_mpi.win_create)
WIN_PUT = Op("win_put", simulated=_windows_simulated.win_put, mpi=_windows_mpi.win_put_call)
WIN_GET = Op("win_get", simulated=lambda sim, leaves, treedef, args: (
    _windows_simulated.win_get(sim, args)), mpi=lambda leaves, treedef, args: (
        _windows_mpi.win_get_call(args)))
WIN_UPDATE = Op("win_update", simulated=_windows_simulated.win_update,
                mpi_run=_windows_mpi.win_update)
WIN_FREE = _without_data("win_free", _windows_simulated.win_free, _windows_mpi.win_free)
WIN_MUTEX = _without_data("win_mutex", _windows_simulated.win_mutex, _windows_mpi.win_mutex)
WIN_VERSION = _without_data("win_version", _windows_simulated.win_version,
                            _windows_mpi.win_version)
WIN_WEIGHT = _without_data("win_weight", _windows_simulated.win_weight,
                           _windows_mpi.win_weight)


def win_create(x: Any, name: str, *, zero_init: bool = False, with_weight: bool = False,
               src_ranks: Sequence[int] | None = None) -> bool:
    """Creates window ``name`` from ``x``; collective over every rank.

    Args:
      x: an array or pytree: the shapes and dtypes of everything the window
        moves, and its initial content (the published value, and every slot
        unless ``zero_init``).
      name: the window's name (the same on every rank).
      zero_init: start the slots at zero instead of copies of ``x``.
      with_weight: keep a push-sum weight ``p``: 1 for the rank, 1 per slot
        (0 with ``zero_init``); ops scale and combine it like the value.
      src_ranks: the ranks that may write into this rank's window (default:
        the current topology's in-neighbours; e.g. the union over a
        schedule). A put from any other rank is an error on the sender.

    Returns:
      True (BlueFog compatible).

    Raises:
      ValueError: on every rank, when ranks passed different names,
        structures, shapes, dtypes or ``with_weight``.
    """
    args = _args.win_create(name=name, zero_init=zero_init, with_weight=with_weight,
                            src_ranks=src_ranks)
    leaves, treedef = _args.leaves("win_create", x)
    return _dispatch.run(WIN_CREATE, args, leaves, treedef)


def win_free(name: str | None = None) -> bool:
    """Frees window ``name`` (every window with ``None``) once the ops already
    dispatched have finished; collective."""
    if name is not None:
        name = _args._window_name(name, "win_free")
    return _dispatch.run(WIN_FREE, (name,))


def _put(x: Any, name: str, self_weight: Any, dst_weights: Any, require_mutex: bool,
         accumulate: bool) -> Any:
    args = _args.win_put(name=name, self_weight=self_weight, dst_weights=dst_weights,
                         require_mutex=require_mutex, accumulate=accumulate)
    leaves, treedef = _args.leaves(args.what, x)
    return jax.tree.unflatten(treedef, _dispatch.run(WIN_PUT, args, leaves, treedef))


def win_put(x: Any, name: str, *, self_weight: float | None = None,
            dst_weights: Weights | None = None, require_mutex: bool = False) -> Any:
    """Writes ``w_k * x`` into my slot on each destination ``k``; one-sided.

    Args:
      x: the value (the window's structure, shapes and dtypes).
      name: the window.
      self_weight: the factor of the returned value (default 1.0).
      dst_weights: the destinations: a dict ``{rank: weight}``, a list of
        ranks (weight 1.0), or an array of n weights (the ranks with a
        nonzero weight; traced values are allowed in the simulation).
        Default: the out-neighbours, weight 1.0. Each must hold a slot for
        this rank.
      require_mutex: hold the destinations' mutexes while writing.

    Returns:
      ``self_weight * x``. My published value becomes ``x``; each
      destination's version for me grows by one; with a push-sum weight,
      the slots' ``p := w_k p`` and my ``p := self_weight * p``.
    """
    return _put(x, name, self_weight, dst_weights, require_mutex, accumulate=False)


def win_accumulate(x: Any, name: str, *,
                   self_weight: float | np.ndarray | jax.Array | None = None,
                   dst_weights: Weights | None = None, require_mutex: bool = False) -> Any:
    """Adds ``w_k * x`` onto my slot on each destination ``k`` (MPI_Accumulate,
    SUM); as :func:`win_put` otherwise, but the versions are untouched.

    float16 and bfloat16 cannot be accumulated by MPI (a clear error).
    With a push-sum weight the slots' ``p += w_k p`` and my
    ``p := self_weight * p``: with column-stochastic weights
    (``self_weight + sum_k w_k = 1``) the total mass is conserved.
    """
    return _put(x, name, self_weight, dst_weights, require_mutex, accumulate=True)


def win_get(name: str, *, src_weights: Weights | None = None,
            require_mutex: bool = False) -> bool:
    """Reads each source ``j``'s published value into my slot for ``j``:
    ``slot_j := w_j * v_j`` (and ``p_j := w_j * p_j``); ``version_j += 1``.

    Args:
      name: the window.
      src_weights: as ``dst_weights`` of :func:`win_put`, over this rank's
        sources (default: all of them, weight 1.0).
      require_mutex: hold the sources' mutexes while reading.

    Returns:
      True (the slots change; read them with :func:`win_update`).
    """
    args = _args.win_get(name=name, src_weights=src_weights, require_mutex=require_mutex)
    return _dispatch.run(WIN_GET, args)[0]


def win_update(x: Any, name: str, *, self_weight: float | None = None,
               src_weights: Mapping[int, float] | Any | None = None, reset: bool = False,
               require_mutex: bool = False) -> Any:
    """``self_weight * x + sum_j src_weights[j] * slot_j``; publishes the result.

    Args:
      x: this rank's value (the window's structure, shapes and dtypes).
      name: the window.
      self_weight, src_weights: default: the current topology's row of W when
        the window's sources are this rank's in-neighbours, else uniform
        ``1 / (k + 1)`` over the ``k`` sources and itself. ``src_weights`` is
        a dict ``{rank: weight}`` or an array of n weights.
      reset: zero the slots read (and their push-sum weights) afterwards.
      require_mutex: hold this rank's own mutex while reading.

    Returns:
      The combination. My published value becomes it, my push-sum weight
      ``p := self_weight * p + sum_j w_j p_j``, and the versions of the slots
      read return to 0.
    """
    args = _args.win_update(name=name, self_weight=self_weight, src_weights=src_weights,
                            reset=reset, require_mutex=require_mutex)
    leaves, treedef = _args.leaves(args.what, x)
    return jax.tree.unflatten(treedef, _dispatch.run(WIN_UPDATE, args, leaves, treedef))


def win_update_then_collect(x: Any, name: str, *, require_mutex: bool = True) -> Any:
    """``x + sum_j slot_j`` over every slot, which it drains (``reset``).

    Accumulated mass is collected exactly once: a second call adds nothing
    until more arrives. Holds this rank's mutex by default, so that
    mutex-protected accumulates are either wholly in or wholly out.
    """
    args = _args.win_update(name=name, self_weight=1.0, src_weights=None, reset=True,
                            require_mutex=require_mutex, collect=True)
    leaves, treedef = _args.leaves(args.what, x)
    return jax.tree.unflatten(treedef, _dispatch.run(WIN_UPDATE, args, leaves, treedef))


def win_mutex(name: str, ranks: Sequence[int] | None = None) -> ContextManager[None]:
    """Holds the mutexes of ``ranks``' windows (default: my out-neighbours).

    A context manager, usable around eager and jitted calls: the ops
    dispatched before it finish before the mutexes are taken, and the ops
    inside finish before they are released. Ops with ``require_mutex=True``
    on other ranks wait for them. Mutexes are taken in rank order (no
    deadlock between ranks contending for overlapping sets) and give up with
    an error after ``JAXFOG_TIMEOUT``.
    """
    return _dispatch.run(WIN_MUTEX, (_args._window_name(name, "win_mutex"),
                                     _args.win_mutex_ranks(ranks)))


def win_version(name: str) -> dict[int, int]:
    """``{source rank: puts and gets into its slot since my last update}``.

    Eager on MPI (it waits for the dispatched ops); in the simulation a
    traced count per rank (0 where this agent holds no slot).
    """
    return _dispatch.run(WIN_VERSION, (_args._window_name(name, "win_version"),))


def win_weight(name: str) -> Any:
    """This rank's push-sum weight ``p`` (a window made with ``with_weight``).

    Eager on MPI (a float, after the dispatched ops); traced in the
    simulation.
    """
    return _dispatch.run(WIN_WEIGHT, (_args._window_name(name, "win_weight"),))


# --- the nonblocking forms: a write or a read started, waited for later ---------

def _start_put(x: Any, name: str, self_weight: Any, dst_weights: Any, require_mutex: bool,
               accumulate: bool) -> Handle:
    args = _args.win_put(name=name, self_weight=self_weight, dst_weights=dst_weights,
                         require_mutex=require_mutex, accumulate=accumulate)
    leaves, treedef = _args.leaves(args.what, x)
    return nonblocking.start_leaves(WIN_PUT, leaves, treedef, args,
                               args.what.removeprefix("jaxfog."), treedef)


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
    return nonblocking.start_leaves(WIN_GET, [], None, args, "win_get", jax.tree.structure(True))


__all__ = ["win_accumulate", "win_accumulate_nonblocking", "win_create", "win_free", "win_get",
           "win_get_nonblocking", "win_mutex", "win_put", "win_put_nonblocking", "win_update",
           "win_update_then_collect", "win_version", "win_weight"]
