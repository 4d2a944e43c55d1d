"""Each op's arguments, resolved and validated once for every backend.

A public op calls one function here. It checks what does not depend on the
backend (types, sizes, options that exclude each other), with one message per
mistake, and returns a NamedTuple that the backends read
(``jaxfog.ops._backends``). Every backend takes every documented form of an
argument: this rank's view (a number, ``{rank: w}``, a list of ranks, a row
of n weights) or the whole rank-indexed table (shape (n,) for a per-rank
number, (n, n) or (n, k) for per-rank rows), of which each backend takes
this rank's row (MPI at trace time, from the concrete table; simulated
agents by their traced index). What a backend checks itself is what it
alone cannot do: MPI needs concrete weights and ranks (they fix whom a rank
exchanges with), and says so with a TypeError naming the argument.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import runtime
from jaxfog import topology as T
from jaxfog.ops import _plan

#: dtypes every op accepts (integers are averaged in float64 and rounded to
#: nearest, ties to even).
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.complex64, jnp.complex128,
    jnp.int32, jnp.int64))

#: ops that only move data, never average it: they also take the small
#: integer and bool dtypes compressed payloads are made of.
MOVING_OPS = ("allgather", "neighbor_allgather", "broadcast")
MOVED_DTYPES = SUPPORTED_DTYPES + tuple(np.dtype(t) for t in (
    jnp.bool_, jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.uint32, jnp.uint64))


def leaves(op: str, x: Any) -> tuple[list[jax.Array], Any]:
    """``x``'s leaves as arrays and its treedef; TypeError for a dtype ``op`` does not take."""
    flat, treedef = jax.tree.flatten(x)
    arrays = []
    for leaf in flat:
        try:
            arrays.append(jnp.asarray(leaf))
        except TypeError:
            raise TypeError(f"jaxfog.{op}: x must be an array or a pytree of arrays, got a "
                            f"leaf of type {type(leaf).__name__}: {leaf!r}") from None
    flat = arrays
    allowed = MOVED_DTYPES if op in MOVING_OPS else SUPPORTED_DTYPES
    for leaf in flat:
        if leaf.dtype not in allowed:
            names = ", ".join(str(d) for d in allowed)
            raise TypeError(f"jaxfog.{op}: dtype {leaf.dtype} is not supported "
                            f"(supported: {names})")
    return flat, treedef


def _array_like(leaf: Any) -> bool:
    try:
        jnp.asarray(leaf)
    except TypeError:
        return False
    return True


def call_name(op: str, name: str | None) -> str:
    """How errors name the call: the op, and the user's name for it if any."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{op}: name must be a str or None, got {type(name).__name__} "
                        f"{name!r}")
    return f"{op} ({name})" if name else op


class LocalView(NamedTuple):
    """BlueFog's local view of neighbor averaging, as the user gave it."""

    self_weight: Any
    src_weights: Any
    dst_weights: Any


def local_view(self_weight: Any, src_weights: Any, dst_weights: Any, what: str,
                names: tuple[str, str] = ("src_weights", "dst_weights"),
                size: Any = None) -> LocalView | None:
    if self_weight is None and src_weights is None and dst_weights is None:
        return None
    if self_weight is None:
        raise ValueError(f"{what}: self_weight is required when {names[0]} or {names[1]} "
                         "is given")
    if src_weights is None and dst_weights is None:
        raise ValueError(f"{what}: self_weight needs {names[0]} and/or {names[1]} (leave "
                         "all three out to use the topology's weights)")
    n = runtime.size() if size is None else size
    for label, value, shapes in (("self_weight", self_weight, ((), (n,))),
                                 (names[0], src_weights, ((n,), (n, n))),
                                 (names[1], dst_weights, ((n,), (n, n)))):
        if is_array(value) and (np.shape(value) not in shapes or not (
                jnp.issubdtype(value.dtype, jnp.floating)
                or jnp.issubdtype(value.dtype, jnp.integer))):
            forms = " or ".join(str(s_) for s_ in shapes)
            raise ValueError(f"{what}: {label} as an array must be real with shape {forms} "
                             f"(n = {n}), got {value.dtype}{list(np.shape(value))}")
    return LocalView(self_weight, src_weights, dst_weights)


def is_array(value: Any) -> bool:
    """A numpy or JAX array (concrete or traced), or a numpy scalar."""
    return isinstance(value, (np.ndarray, np.generic, jax.Array))


def is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def checked_step(step: Any, what: str) -> Any:
    """None, a Python int, or an integer scalar array (traced or not)."""
    if step is None or (isinstance(step, numbers.Integral) and not isinstance(step, bool)):
        return None if step is None else int(step)
    if not _array_like(step):
        raise TypeError(f"{what}: step must be an integer scalar, got {type(step).__name__} "
                        f"{step!r}")
    array = jnp.asarray(step)
    if array.shape != () or not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{what}: step must be an integer scalar, got "
                        f"{array.dtype}{list(array.shape)}")
    return array


def check_size(graph: T.Topology | T.Schedule, what: str) -> None:
    if graph.size != runtime.size():
        raise ValueError(runtime.size_mismatch(what, graph.size, runtime.size()))


def rank_row(table: Any) -> Any:
    """Row ``rank()`` of a rank-indexed table: numpy where the rank and the
    table are concrete (MPI, at trace time), else a traced row."""
    rank = runtime.rank()
    if isinstance(rank, (int, np.integer)) and not is_traced(table):
        return np.asarray(table)[rank]
    return jnp.asarray(table)[rank]



# --- one-sided windows --------------------------------------------------------


def _window_name(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what}: a window's name must be a non-empty string, got {name!r}")
    if not name:
        raise ValueError(f"{what}: a window's name must be a non-empty string, got ''")
    return name


def win_mutex_ranks(ranks: Any) -> Any:
    """``win_mutex``'s ranks: None (the out-neighbours) or a list of ranks."""
    what = "win_mutex"
    if ranks is None or is_traced(ranks):
        return ranks
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{what}: ranks must be a list of ranks or None, got "
                        f"{type(ranks).__name__} {ranks!r}")
    ranks = list(np.asarray(ranks).tolist() if is_array(ranks) else ranks)
    size = runtime.size()
    for r in ranks:
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Integral):
            raise TypeError(f"{what}: ranks: {r!r} is not a rank (an int), it is a "
                            f"{type(r).__name__}")
        if not 0 <= cast(int, r) < size:  # an Integral: typeshed's has no __ge__
            raise ValueError(f"{what}: {r!r} is not a rank in [0, {size})")
    return ranks


def flag(value: Any, label: str, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: {label} must be True or False, got {value!r}")
    return bool(value)


def _self_weight(value: Any, what: str) -> Any:
    """None, a real number, a rank-indexed array of n numbers (this rank's
    entry is taken), or a traced real scalar (simulated agents)."""
    if is_array(value):
        n = runtime.size()
        if np.shape(value) not in ((), (n,)) or not (
                jnp.issubdtype(value.dtype, jnp.floating)
                or jnp.issubdtype(value.dtype, jnp.integer)):
            raise ValueError(f"{what}: self_weight as an array must be real with shape () "
                             f"or ({n},), got {value.dtype}{list(np.shape(value))}")
        if np.shape(value) == (n,):
            value = rank_row(value)
        if not is_traced(value):
            value = np.asarray(value).item()
    if value is None or isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: self_weight must be a real number, got {value!r}")
    if not np.isfinite(cast(float, value)):  # a Real, which numpy's stubs do not name
        raise ValueError(f"{what}: self_weight must be finite, got {value}")
    return float(value)


class Peers(NamedTuple):
    """The ranks a window op names and their weights, as length-n rows.

    numpy when given as a dict, a list or a concrete array; a traced array
    (simulation only) when given as one. A rank's weight is 0 where its mask
    is False.
    """

    mask: Any
    weights: Any


def _peers(value: Any, label: str, what: str, allow_list: bool) -> Peers | None:
    """``None`` (the op's default), a dict ``{rank: weight}``, a list of ranks
    (weight 1), an array of n weights (this rank's row: the ranks with a
    nonzero weight) or a rank-indexed (n, n) table of them (row i: rank i's;
    its diagonal is not used)."""
    if value is None:
        return None
    n, rank = runtime.size(), runtime.rank()
    where = f"{what}: {label}"
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape == (n, n) and (
            jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype,
                                                                        jnp.integer)):
        if is_traced(value):
            value = value * (1 - jnp.eye(n, dtype=value.dtype))
            return _peers(value[rank], label, what, allow_list)
        table = np.asarray(value, np.float64).copy()
        if not np.isfinite(table).all():
            raise ValueError(f"{where}: weights must be finite")
        np.fill_diagonal(table, 0.0)
        if isinstance(rank, (int, np.integer)):
            return Peers(table[rank] != 0, table[rank])
        return Peers(table != 0, table)  # simulated agents: every agent's row, static
    if isinstance(value, (np.ndarray, jax.Array)):
        if value.shape != (n,) or not (jnp.issubdtype(value.dtype, jnp.floating)
                                       or jnp.issubdtype(value.dtype, jnp.integer)):
            raise ValueError(f"{where}: an array of weights must be real with shape ({n},) "
                             f"or ({n}, {n}), got {value.dtype}{list(value.shape)}")
        if isinstance(value, jax.core.Tracer):
            return Peers(value != 0, value)
        weights = np.asarray(value, np.float64)
        if not np.isfinite(weights).all():
            raise ValueError(f"{where}: weights must be finite")
        if isinstance(rank, int) and weights[rank] != 0:
            raise ValueError(f"{where}: rank {rank} cannot name itself (use self_weight)")
        return Peers(weights != 0, weights)
    given = _plan.weights_dict(value, where, allow_list=allow_list)
    _plan.check_ranks(given, n, rank if isinstance(rank, int) else -1, where)
    mask, weights = np.zeros(n, bool), np.zeros(n)
    for r, w in given.items():
        mask[r], weights[r] = True, w
    return Peers(mask, weights)


class WinCreate(NamedTuple):
    name: str
    zero_init: bool
    with_weight: bool
    src_ranks: tuple[int, ...] | None
    what: str
    #: MPI only, internal (AD-PSGD): keep a slot for the rank itself, so that
    #: it can read its own published value with win_get under its mutex.
    self_slot: bool = False
    #: src_ranks given as a rank-indexed table: every rank's sources.
    src_table: tuple[tuple[int, ...], ...] | None = None


def win_create(*, name: Any, zero_init: Any, with_weight: Any, src_ranks: Any) -> WinCreate:
    what = "win_create"
    name = _window_name(name, what)
    table: tuple[tuple[int, ...], ...] | None = None
    if is_array(src_ranks) and np.ndim(src_ranks) == 2:
        n = runtime.size()
        if is_traced(src_ranks):
            raise TypeError(f"{what}: src_ranks must be concrete (a window's slots are "
                            "allocated when it is created), not a traced value")
        array = np.asarray(src_ranks)
        if array.shape[0] != n or not np.issubdtype(array.dtype, np.integer) or (
                (array < 0) | (array >= n)).any():
            raise ValueError(f"{what}: src_ranks as a table must be an ({n}, k) array of "
                             f"ranks, got {array.dtype}{list(array.shape)}")
        table = tuple(tuple(sorted({int(r) for r in row if r != i}))
                      for i, row in enumerate(array))
        rank = runtime.rank()
        src_ranks = table[rank] if isinstance(rank, (int, np.integer)) else None
    if src_ranks is not None:
        if isinstance(src_ranks, (str, bytes)) or not hasattr(src_ranks, "__iter__"):
            raise TypeError(f"{what}: src_ranks must be a list of ranks, got "
                            f"{type(src_ranks).__name__}")
        src_ranks = list(src_ranks)
        for r in src_ranks:
            if isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Integral):
                raise TypeError(f"{what}: src_ranks: {r!r} is not a rank (an int), it is a "
                                f"{type(r).__name__}")
            if not 0 <= cast(int, r) < runtime.size():  # an Integral: typeshed's has no __ge__
                raise ValueError(f"{what}: src_ranks: {r!r} is not a rank in "
                                 f"[0, {runtime.size()})")
        src_ranks = tuple(sorted({int(r) for r in src_ranks}))
    return WinCreate(name, flag(zero_init, "zero_init", what),
                     flag(with_weight, "with_weight", what), src_ranks, what,
                     src_table=table)


class WinPut(NamedTuple):
    """``win_put`` (``accumulate`` False) or ``win_accumulate``."""

    name: str
    self_weight: Any  # None: 1.0
    dst: Peers | None  # None: the out-neighbours, weight 1
    require_mutex: bool
    accumulate: bool
    what: str
    #: MPI only, internal (AD-PSGD): accumulate onto the destinations'
    #: published values (region 0), not into my slots there.
    into_values: bool = False


def win_put(*, name: Any, self_weight: Any, dst_weights: Any, require_mutex: Any,
            accumulate: bool) -> WinPut:
    what = "win_accumulate" if accumulate else "win_put"
    return WinPut(_window_name(name, what), _self_weight(self_weight, what),
                  _peers(dst_weights, "dst_weights", what, allow_list=True),
                  flag(require_mutex, "require_mutex", what), accumulate, what)


class WinGet(NamedTuple):
    name: str
    src: Peers | None  # None: every source of the window, weight 1
    require_mutex: bool
    what: str


def win_get(*, name: Any, src_weights: Any, require_mutex: Any) -> WinGet:
    what = "win_get"
    return WinGet(_window_name(name, what),
                  _peers(src_weights, "src_weights", what, allow_list=True),
                  flag(require_mutex, "require_mutex", what), what)


class WinUpdate(NamedTuple):
    """``win_update``, or with ``collect`` ``win_update_then_collect`` (every
    source with weight 1, self weight 1, reset)."""

    name: str
    self_weight: Any  # None: the default row's
    src: Peers | None  # None: the topology's row of W, or uniform
    reset: bool
    require_mutex: bool
    collect: bool
    what: str


def win_update(*, name: Any, self_weight: Any, src_weights: Any, reset: Any,
               require_mutex: Any, collect: bool = False) -> WinUpdate:
    what = "win_update_then_collect" if collect else "win_update"
    return WinUpdate(_window_name(name, what), _self_weight(self_weight, what),
                     _peers(src_weights, "src_weights", what, allow_list=False),
                     flag(reset, "reset", what), flag(require_mutex, "require_mutex", what),
                     collect, what)
