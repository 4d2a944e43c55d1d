"""One-sided windows over MPI-3 RMA (BlueFog's win_* ops, in functional form).

A window is created collectively from a value ``x`` (an array or pytree). On
every rank it holds one slot shaped like ``x`` per rank it receives from (the
in-neighbours of the current topology, or ``src_ranks``) and the rank's
published value. Ranks then write into each other's slots with no matching
call on the receiving side, and combine what arrived when they choose:

* ``win_put(x, name)``: on each destination ``j``, my slot := ``w_j * x``;
  my published value := ``x``; returns ``self_weight * x``.
* ``win_accumulate(x, name)``: the same, with my slot ``+= w_j * x``.
* ``win_update(x, name)``: returns
  ``self_weight * x + sum_j src_weights[j] * slot_j`` (default: the
  topology's row of W when the window's sources are its in-neighbours,
  else uniform ``1 / (k + 1)``); my published value := the result; with
  ``reset=True`` the slots read are zeroed.

Each op is a custom call ordered with jaxfog's other ops on the same rank
(program order), eagerly and inside ``jax.jit``/``jaxfog.jit``/``lax.scan``.

References:
  Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms Practical
  for Optimization and Deep Learning*, 2021 (section IV, one-sided ops).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from jaxfog import ffi, runtime
from jaxfog.ops import _args, _plan
from jaxfog.ops import primitives as P
from jaxfog.ops.backends import mpi

_ALIGN = 64  # the C++ message layout: each leaf at a multiple of 64 bytes


@dataclasses.dataclass(frozen=True)
class _Window:
    id: int
    name: str
    treedef: Any
    avals: tuple[tuple[tuple[int, ...], np.dtype], ...]
    sources: tuple[int, ...]  # the ranks whose slots this rank holds, in slot order
    region_of: Mapping[int, Mapping[int, int]]  # region_of[dst][src]: src's slot on dst

    @property
    def offsets(self) -> list[int]:
        offsets, at = [], 0
        for shape, dtype in self.avals:
            offsets.append(at)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            at += -(-nbytes // _ALIGN) * _ALIGN
        offsets.append(at)
        return offsets


_windows: dict[str, _Window] = {}
_ids = itertools.count(1)


def _layout(x: Any, what: str) -> tuple[list[jax.Array], Any, tuple]:
    leaves, treedef = _args.leaves(what, x)
    return leaves, treedef, tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves)


def _window(name: str, what: str) -> _Window:
    if name not in _windows:
        known = ", ".join(sorted(_windows)) or "none"
        raise ValueError(f"{what}: no window named {name!r} (windows: {known}); create it "
                         "with jaxfog.win_create")
    return _windows[name]


def _check_value(window: _Window, treedef, avals, what: str) -> None:
    if treedef != window.treedef or avals != window.avals:
        raise ValueError(f"{what}: the value does not match window {window.name!r}: it has "
                         f"{[(s, str(d)) for s, d in avals]}, the window "
                         f"{[(s, str(d)) for s, d in window.avals]}")


def win_create(x: Any, name: str, *, zero_init: bool = False,
               src_ranks: Sequence[int] | None = None) -> bool:
    """Creates window ``name`` from ``x``; collective over every rank.

    Args:
      x: an array or pytree: the shapes and dtypes of everything the window
        moves, and its initial content.
      name: the window's name (the same on every rank).
      zero_init: start the slots at zero instead of copies of ``x``.
      src_ranks: the ranks that may write into this rank's window (default:
        the current topology's in-neighbours); a put from any other rank is
        an error on the sender.

    Returns:
      True (BlueFog compatible).
    """
    mpi.backend()
    what = "win_create"
    if name in _windows:
        raise ValueError(f"{what}: window {name!r} exists already (win_free it first)")
    rank, size = runtime.rank(), runtime.size()
    leaves, treedef, avals = _layout(x, what)
    sources = (tuple(runtime.load_topology().in_neighbors(rank)) if src_ranks is None
               else tuple(sorted(_plan.rank_tuple(src_ranks, size, rank,
                                                  f"{what}: src_ranks"))))
    comm = runtime.communicator()
    mine = (name, str(treedef), [(s, d.str) for s, d in avals], sources)
    everyone = comm.allgather(mine)
    differing = [r for r, (n, t, a, _) in enumerate(everyone) if (n, t, a) != mine[:3]]
    if differing:
        raise ValueError(f"{what}: ranks {differing} passed a different name, structure, "
                         f"shape or dtype from rank {rank}; every rank must create the same "
                         "window")
    region_of = {dst: {src: 1 + i for i, src in enumerate(srcs)}
                 for dst, (_, _, _, srcs) in enumerate(everyone)}
    window = _Window(next(_ids), name, treedef, avals, sources, region_of)
    offsets = window.offsets
    packed = np.zeros(offsets[-1], np.uint8)
    for leaf, at in zip(leaves, offsets):
        data = np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).reshape(-1)
        packed[at:at + data.size] = data
    lib, error = ffi.library(), ctypes.create_string_buffer(1024)
    if lib.jaxfog_win_create(window.id, comm.py2f(), offsets[-1], len(sources), error, 1024):
        raise RuntimeError(f"{what}: {error.value.decode()}")
    if lib.jaxfog_win_fill(window.id, packed.ctypes.data, packed.size, int(not zero_init),
                           error, 1024):
        raise RuntimeError(f"{what}: {error.value.decode()}")
    comm.Barrier()  # no rank writes into a window before every rank has filled it
    _windows[name] = window
    return True


def win_free(name: str | None = None) -> bool:
    """Frees window ``name`` (every window with ``None``) once dispatched ops
    have finished; collective."""
    names = list(_windows) if name is None else [_window(name, "win_free").name]
    mpi.wait_for_dispatched()
    for n in names:
        ffi.library().jaxfog_win_free(_windows.pop(n).id)
    return True


def _free_at_shutdown() -> None:
    """``shutdown()`` frees the windows still open (every rank shuts down, so
    the collective free is matched), before MPI is finalised."""
    if _windows:
        win_free()


runtime._before_shutdown.append(_free_at_shutdown)


def _put(prim, x: Any, name: str, self_weight: float | None,
         dst_weights: Mapping[int, float] | Sequence[int] | None, what: str) -> Any:
    window = _window(name, what)
    leaves, treedef, avals = _layout(x, what)
    _check_value(window, treedef, avals, what)
    rank = runtime.rank()
    if dst_weights is None:
        dsts = {d: 1.0 for d in runtime.load_topology().out_neighbors(rank)}
    else:
        dsts = _plan.weights_dict(dst_weights, f"{what}: dst_weights", allow_list=True)
        _plan.check_ranks(dsts, runtime.size(), rank, f"{what}: dst_weights")
    missing = [d for d in dsts if rank not in window.region_of[d]]
    if missing:
        raise ValueError(f"{what}: ranks {missing} hold no slot for rank {rank} in window "
                         f"{name!r}; declare src_ranks at win_create")
    ranks = sorted(dsts)
    outs = prim.bind(*leaves, win_id=window.id,
                     self_weight=_plan.weight(1.0 if self_weight is None else self_weight,
                                               f"{what}: self_weight"),
                     dst_ranks=tuple(ranks),
                     dst_regions=tuple(window.region_of[d][rank] for d in ranks),
                     dst_weights=tuple(float(dsts[d]) for d in ranks))
    return jax.tree.unflatten(treedef, outs)


def win_put(x: Any, name: str, *, self_weight: float | None = None,
            dst_weights: Mapping[int, float] | Sequence[int] | None = None) -> Any:
    """Writes ``w_j * x`` into my slot on each destination ``j`` (default: the
    out-neighbours, weight 1.0); my published value := ``x``.

    Returns:
      ``self_weight * x`` (default ``x``).
    """
    return _put(P.win_put_p, x, name, self_weight, dst_weights, "win_put")


def win_accumulate(x: Any, name: str, *, self_weight: float | None = None,
                   dst_weights: Mapping[int, float] | Sequence[int] | None = None) -> Any:
    """Adds ``w_j * x`` onto my slot on each destination ``j`` (MPI_Accumulate,
    SUM; float16/bfloat16 cannot be accumulated by MPI).

    Returns:
      ``self_weight * x`` (default ``x``).
    """
    return _put(P.win_accumulate_p, x, name, self_weight, dst_weights, "win_accumulate")


def win_update(x: Any, name: str, *, self_weight: float | None = None,
               src_weights: Mapping[int, float] | None = None, reset: bool = False) -> Any:
    """``self_weight * x + sum_j src_weights[j] * slot_j``; publishes the result.

    Defaults: the current topology's row of W when the window's sources are
    this rank's in-neighbours, else uniform ``1 / (k + 1)`` over the ``k``
    sources and itself. With ``reset`` the slots read are zeroed afterwards.
    """
    what = "win_update"
    window = _window(name, what)
    leaves, treedef, avals = _layout(x, what)
    _check_value(window, treedef, avals, what)
    rank, topology = runtime.rank(), runtime.load_topology()
    if tuple(topology.in_neighbors(rank)) == window.sources:
        default_self = float(topology.weights[rank, rank])
        default = {j: float(topology.weights[rank, j]) for j in window.sources}
    else:
        default_self = 1.0 / (len(window.sources) + 1)
        default = {j: default_self for j in window.sources}
    srcs = default if src_weights is None else _plan.weights_dict(
        src_weights, f"{what}: src_weights", allow_list=False)
    unknown = sorted(set(srcs) - set(window.sources))
    if unknown:
        raise ValueError(f"{what}: window {name!r} holds no slot for ranks {unknown} (its "
                         f"sources are {list(window.sources)})")
    ranks = sorted(srcs)
    slot = {j: 1 + i for i, j in enumerate(window.sources)}
    outs = P.win_update_p.bind(
        *leaves, win_id=window.id,
        self_weight=_plan.weight(default_self if self_weight is None else self_weight,
                                  f"{what}: self_weight"),
        src_regions=tuple(slot[j] for j in ranks),
        src_weights=tuple(float(srcs[j]) for j in ranks), reset=bool(reset))
    return jax.tree.unflatten(treedef, outs)


__all__ = ["win_accumulate", "win_create", "win_free", "win_put", "win_update"]
