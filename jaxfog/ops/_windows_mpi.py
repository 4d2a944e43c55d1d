"""The window ops on MPI processes: MPI-3 RMA windows in the C++ library.

``win_create`` and ``win_free`` are collective calls into the library's C
API (a window is allocated and freed with every rank, never inside a
handler); the data-moving ops are the FFI primitives ``win_put``,
``win_accumulate``, ``win_get`` and ``win_update``, ordered with every other
op on the rank and defined here (only MPI binds them); the mutex, versions
and weight are read through the C API after the dispatched ops have
finished. Each function is the MPI rule of its op's record
(``jaxfog.ops.window``); AD-PSGD's shared models, which the MPI backend
serves, are built on them at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
from typing import Any, Iterator, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.interpreters import ad

from jaxfog import _interrupt, ffi, runtime
from jaxfog import topology as T
from jaxfog.errors import JaxfogError
from jaxfog.ops import _args, _jax_compat, _plan, _primitive_machinery, _sync_primitives
from jaxfog.ops._primitive_machinery import define, not_differentiable, same_avals
from jaxfog.ops.jit import jit
from jaxfog.ops._call import Call
from jaxfog.ops import _numerics, _window_spec

_ALIGN = 64  # the C++ window layout: each leaf (and the weight) at a multiple of 64 bytes

#: XLA's element type codes (``xla::ffi::DataType``) of the dtypes windows hold.
_TYPE_CODES = {np.dtype("int32"): 4, np.dtype("int64"): 5, np.dtype("float16"): 10,
               np.dtype("float32"): 11, np.dtype("float64"): 12, np.dtype("complex64"): 15,
               np.dtype("complex128"): 18}


# --- the primitives ----------------------------------------------------------


def _window_attributes(avals_in, **params) -> dict:
    """Static tuples become the handler's array attributes (ranks and regions
    int64, weights float64)."""
    def attribute(key, value):
        if not isinstance(value, tuple):
            return value
        return np.array(value, np.float64 if key.endswith("weights") else np.int64)

    return {key: attribute(key, value) for key, value in params.items()}


def _not_differentiable(prim):
    # A write into another rank's memory has no tangent.
    def jvp(primals, tangents, **params):
        raise not_differentiable(prim)

    return jvp


# win_put / win_accumulate: the leaves go to the destinations' slots (no
# results: the caller computes self_weight * x). win_update: the weighted sum with the slots.
# win_get (no operands, no results): the sources' published values into the
# slots.
win_put_p = define("win_put", lambda *avals, **params: [], _window_attributes)
win_accumulate_p = define("win_accumulate", lambda *avals, **params: [], _window_attributes)
win_update_p = define("win_update", same_avals, _window_attributes)
win_get_p = define("win_get", same_avals, _window_attributes)
# win_state: this rank's version counters (one per slot) and push-sum weight.
win_state_p = define(
    "win_state",
    lambda *, win_id, slots: [
        core.ShapedArray((slots,), jax.dtypes.canonicalize_dtype(np.int64)),
        core.ShapedArray((), jax.dtypes.canonicalize_dtype(np.float64))],
    lambda avals_in, *, win_id, slots: {"win_id": win_id})
for _prim in (win_put_p, win_accumulate_p, win_update_p):
    ad.primitive_jvps[_prim] = _not_differentiable(_prim)


# --- the windows ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Window:
    id: int
    spec: _window_spec.WindowSpec
    offsets: tuple[int, ...]  # each leaf's offset in a region, then the message's extent
    region: dict[tuple[int, int], int]  # region[dst, src]: src's slot on dst (1-based)

    @property
    def weight_offset(self) -> int:
        return self.offsets[-1] if self.spec.with_weight else -1

    @property
    def region_bytes(self) -> int:
        return self.offsets[-1] + (_ALIGN if self.spec.with_weight else 0)


_windows: dict[str, _Window] = {}
_ids = itertools.count(1)


def _rank() -> int:
    """This process's rank: an int (only a simulated agent's is traced)."""
    return cast(int, runtime.rank())


def _topology() -> T.Topology:
    """The global topology: a Topology on MPI processes (only a simulation's
    may be a Schedule)."""
    return cast(T.Topology, runtime.load_topology())


def _offsets(avals) -> tuple[int, ...]:
    offsets, at = [], 0
    for shape, dtype in avals:
        offsets.append(at)
        at += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // _ALIGN) * _ALIGN
    return (*offsets, at)


def _type_code(dtype: np.dtype) -> int:
    return 16 if dtype == np.dtype(jnp.bfloat16) else _TYPE_CODES[dtype]


def lookup(name: str, what: str) -> _Window:
    if name not in _windows:
        known = ", ".join(sorted(_windows)) or "none"
        raise ValueError(f"{what}: no window named {name!r} (windows: {known}); create it "
                         "with jaxfog.win_create")
    return _windows[name]


def _call(function, *args) -> None:
    error = ctypes.create_string_buffer(1024)
    if function(*args, error, 1024):
        text = error.value.decode()
        if _interrupt.MARK in text:  # Ctrl-C while waiting for a peer's mutex
            raise _interrupt.interrupt(text)
        raise JaxfogError(f"jaxfog window: {text}")


def win_create(leaves: list, treedef: Any, args: _args.WinCreate) -> bool:
    what = args.what
    if args.name in _windows:
        raise ValueError(f"{what}: window {args.name!r} exists already (win_free it first)")
    rank, size, topology = _rank(), runtime.size(), _topology()
    sources = (tuple(topology.in_neighbors(rank)) if args.src_ranks is None
               else tuple(r for r in args.src_ranks if r != rank or args.self_slot))
    comm = runtime.communicator()
    mine = (args.name, _window_spec.describe(leaves, treedef), args.with_weight)
    everyone = comm.allgather((mine, sources))
    differing = [r for r, (theirs, _) in enumerate(everyone) if theirs != mine]
    if differing:
        raise ValueError(f"{what}: ranks {differing} passed a different name, structure, "
                         f"shape, dtype or with_weight from rank {rank}; every rank must "
                         "create the same window")
    has_slot = np.zeros((size, size), bool)
    region = {}
    for dst, (_, srcs) in enumerate(everyone):
        for slot, src in enumerate(srcs):
            has_slot[dst, src] = True
            region[dst, src] = 1 + slot
    spec = _window_spec.WindowSpec.make(args.name, treedef, _window_spec.layout(leaves),
                                        args.with_weight, has_slot, topology)
    window = _Window(next(_ids), spec, _offsets(spec.avals), region)
    avals = spec.avals
    lib = ffi.library()
    # Kept alive across the call (ctypes takes their addresses).
    types = np.array([_type_code(d) for _, d in avals], np.int32)
    offsets = np.array(window.offsets[:-1], np.int64)
    sizes = np.array([int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in avals], np.int64)
    _call(lib.jaxfog_win_create, window.id, comm.py2f(), len(avals), types.ctypes.data,
          offsets.ctypes.data, sizes.ctypes.data, window.offsets[-1], window.weight_offset,
          len(sources), runtime.timeout())
    packed = np.zeros(window.region_bytes, np.uint8)
    for leaf, at in zip(leaves, window.offsets):
        data = np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).reshape(-1)
        packed[at:at + data.size] = data
    if args.with_weight:
        packed[window.weight_offset:window.weight_offset + 8] = np.array([1.0]).view(np.uint8)
    _call(lib.jaxfog_win_fill, window.id, packed.ctypes.data, packed.size,
          int(not args.zero_init))
    comm.Barrier()  # no rank writes into a window before every rank has filled it
    _windows[args.name] = window
    _primitive_machinery.windows_changed()
    return True


def win_free(name: str | None) -> bool:
    names = list(_windows) if name is None else [lookup(name, "win_free").spec.name]
    _sync_primitives.wait_for_dispatched()
    for n in names:
        ffi.library().jaxfog_win_free(_windows.pop(n).id)
        _values.pop(n, None)
    _primitive_machinery.windows_changed()
    return True


def _free_at_shutdown() -> None:
    """``shutdown()`` frees the windows still open (every rank shuts down, so
    the collective free is matched), before MPI is finalised; after this
    rank's goodbye, so that a peer stuck waiting for it fails meanwhile and
    comes to free them too."""
    if _windows:
        win_free(None)


def _abandon_at_shrink() -> None:
    """``shrink()`` forgets the windows: their collective free cannot run on
    the revoked communicator, and MPI frees nothing of theirs before exit."""
    _windows.clear()
    _values.clear()
    _primitive_machinery.windows_changed()


runtime.on_shutdown("release", _free_at_shutdown)
runtime.on_shutdown("abandon", _abandon_at_shrink)


def _named(peers: _args.Peers | None, default: np.ndarray, what: str,
           label: str) -> dict[int, float]:
    """``{rank: weight}`` from resolved peers (static here) or the default row."""
    if peers is None:
        return {int(r): float(default[r]) for r in np.flatnonzero(default)}
    if not isinstance(peers.mask, np.ndarray):
        raise TypeError(f"{what}: {label} is a traced value, but on MPI processes it must be "
                        "static (a dict, a list, a concrete array or a rank-indexed table): "
                        "the C++ op takes its ranks and weights when it is compiled. Pass "
                        "the whole table rather than indexing it with jaxfog.rank() inside "
                        "a jitted function")
    return {int(r): float(peers.weights[r]) for r in np.flatnonzero(peers.mask)}


def _self_weight(value: Any, default: float, what: str) -> float:
    if _args.is_traced(value):
        raise TypeError(f"{what}: self_weight is a traced value, but on MPI processes it "
                        "must be static (a number or a concrete rank-indexed array): the C++ "
                        "op takes its weights when it is compiled")
    return _plan.weight(default if value is None else value, f"{what}: self_weight")


@dataclasses.dataclass(frozen=True)
class _Returns:
    """What a put returns once it has run: its value scaled by ``self_weight``
    (a get: True)."""

    self_weight: float | None

    def __call__(self, outs: list, kept: list) -> list:
        if self.self_weight is None:
            return [True]
        return [_numerics.scaled(leaf, self.self_weight) for leaf in kept]


def win_put(leaves: list, treedef: Any, args: _args.WinPut) -> list:
    return win_put_call(leaves, treedef, args).run()


def win_put_call(leaves: list, treedef: Any, args: _args.WinPut) -> Call:
    window = lookup(args.name, args.what)
    window.spec.check_value(treedef, leaves, args.what)
    rank, topology = _rank(), _topology()
    out_neighbors = np.zeros(runtime.size())
    out_neighbors[list(topology.out_neighbors(rank))] = 1.0
    dsts = _named(args.dst, out_neighbors, args.what, "dst_weights")
    ranks = tuple(sorted(dsts))
    if args.into_values:
        if not args.accumulate:
            raise ValueError(f"{args.what}: only an accumulate can target published values")
        return Call(win_accumulate_p, list(leaves),
                    {"win_id": window.id, "self_weight": 1.0, "dst_ranks": ranks,
                     "dst_regions": (0,) * len(ranks),
                     "dst_weights": tuple(dsts[d] for d in ranks),
                     "require_mutex": args.require_mutex},
                    post=_Returns(1.0), kept=list(leaves))
    window.spec.check_sources(np.array(ranks, int), np.full(len(dsts), rank), args.what)
    prim = win_accumulate_p if args.accumulate else win_put_p
    self_weight = _self_weight(args.self_weight, 1.0, args.what)
    return Call(prim, list(leaves),
                {"win_id": window.id, "self_weight": self_weight, "dst_ranks": ranks,
                 "dst_regions": tuple(window.region[d, rank] for d in ranks),
                 "dst_weights": tuple(dsts[d] for d in ranks),
                 "require_mutex": args.require_mutex},
                post=_Returns(self_weight), kept=list(leaves))


def _sources(window: _Window, peers: _args.Peers | None, default: np.ndarray,
             what: str) -> dict[int, float]:
    rank = _rank()
    srcs = _named(peers, default, what, "src_weights")
    unknown = sorted(set(srcs) - set(np.flatnonzero(window.spec.sources[rank])))
    if unknown:
        raise ValueError(f"{what}: window {window.spec.name!r} holds no slot for ranks "
                         f"{unknown} (its sources are "
                         f"{list(np.flatnonzero(window.spec.sources[rank]))})")
    return srcs


def win_get(args: _args.WinGet) -> list:
    return win_get_call(args).run()


def win_get_call(args: _args.WinGet) -> Call:
    window = lookup(args.name, args.what)
    rank = _rank()
    srcs = _sources(window, args.src, window.spec.sources[rank].astype(float), args.what)
    ranks = tuple(sorted(srcs))
    return Call(win_get_p, [],
                {"win_id": window.id, "self_weight": 1.0, "src_ranks": ranks,
                 "src_regions": tuple(window.region[rank, j] for j in ranks),
                 "src_weights": tuple(srcs[j] for j in ranks),
                 "require_mutex": args.require_mutex},
                post=_Returns(None))


def win_update(leaves: list, treedef: Any, args: _args.WinUpdate) -> list:
    window = lookup(args.name, args.what)
    window.spec.check_value(treedef, leaves, args.what)
    rank = _rank()
    default = (window.spec.sources[rank].astype(float) if args.collect
               else window.spec.src_weights[rank])
    srcs = _sources(window, args.src, default, args.what)
    ranks = sorted(srcs)
    return win_update_p.bind(
        *leaves, win_id=window.id,
        self_weight=_self_weight(args.self_weight, window.spec.self_weight[rank], args.what),
        src_regions=tuple(window.region[rank, j] for j in ranks),
        src_weights=tuple(srcs[j] for j in ranks), reset=args.reset,
        require_mutex=args.require_mutex)


def _state(window: _Window) -> tuple[dict[int, Any], Any]:
    """This rank's versions by source, and its push-sum weight: Python numbers
    read after the dispatched ops eagerly; under a trace, the ``win_state``
    op's results, in program order with the other ops."""
    rank = _rank()
    sources = sorted((int(j) for j in np.flatnonzero(window.spec.sources[rank])),
                     key=lambda j: window.region[rank, j])
    if _jax_compat.at_top_level():
        _sync_primitives.wait_for_dispatched()
        versions = np.zeros(max(len(sources), 1), np.int64)
        weight = ctypes.c_double()
        _call(ffi.library().jaxfog_win_query, window.id, versions.ctypes.data,
              ctypes.byref(weight))
        return {j: int(versions[k]) for k, j in enumerate(sources)}, weight.value
    versions, weight = win_state_p.bind(win_id=window.id, slots=len(sources))
    return {j: versions[k] for k, j in enumerate(sources)}, weight


def win_version(name: str) -> dict[int, Any]:
    return _state(lookup(name, "win_version"))[0]


def win_weight(name: str) -> Any:
    window = lookup(name, "win_weight")
    if not window.spec.with_weight:
        raise ValueError(f"win_weight: window {name!r} was created without with_weight=True")
    return _state(window)[1]


@contextlib.contextmanager
def win_mutex(name: str, ranks: Any) -> Iterator[None]:
    window = lookup(name, "win_mutex")
    rank, size = _rank(), runtime.size()
    if ranks is None:
        ranks = _topology().out_neighbors(rank)
    ranks = list(ranks)
    for r in ranks:
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)) or not (
                0 <= r < size):
            raise ValueError(f"win_mutex: {r!r} is not a rank in [0, {size})")
    held = np.array(sorted({int(r) for r in ranks}), np.int64)
    lib = ffi.library()
    _sync_primitives.wait_for_dispatched()
    _call(lib.jaxfog_win_mutex, window.id, held.ctypes.data, held.size, 1)
    try:
        yield
    finally:
        _sync_primitives.wait_for_dispatched()  # what ran under the mutex has finished
        _call(lib.jaxfog_win_mutex, window.id, held.ctypes.data, held.size, 0)


# -- AD-PSGD's shared models (jaxfog.ops._training_loop): published values read ---------------
# -- and averaged under the window mutexes, in short compiled calls -------------------------

_values: dict[str, dict[str, Any]] = {}


def _peers_of(weights: dict[int, float]) -> _args.Peers:
    mask, row = np.zeros(runtime.size(), bool), np.zeros(runtime.size())
    for j, w in weights.items():
        mask[j], row[j] = True, w
    return _args.Peers(mask, row)


def _get_own(name: str, weights: dict[int, float]) -> None:
    """``win_get`` that may name this rank itself (its own slot)."""
    win_get(_args.WinGet(name, _peers_of(weights), False, "adpsgd"))


def _combine(x: Any, name: str, self_weight: float, weights: dict[int, float]) -> Any:
    """``win_update`` that may read this rank's own slot."""
    leaves, treedef = _args.leaves("adpsgd", x)
    args = _args.WinUpdate(name, self_weight, _peers_of(weights), False, False, False, "adpsgd")
    return jax.tree.unflatten(treedef, win_update(leaves, treedef, args))


def _accumulate_values(x: Any, name: str, dst: dict[int, float], require_mutex: bool) -> None:
    """Adds ``w * x`` onto each destination's published value."""
    args = _args.WinPut(name, None, _peers_of(dst), require_mutex, True, "adpsgd",
                        into_values=True)
    leaves, treedef = _args.leaves(args.what, x)
    win_put(leaves, treedef, args)


def value_create(leaves: list, treedef: Any, name: str, peers: np.ndarray) -> None:
    """Window ``name`` holding this rank's model, with a slot for each peer
    (``peers[rank]``) and for itself (read under its own mutex)."""
    r = _rank()
    args = _args.win_create(name=name, zero_init=False, with_weight=False,
                            src_ranks=[*np.flatnonzero(peers[r]), r])
    win_create(leaves, treedef, args._replace(self_slot=True))
    shapes = [jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for v in leaves]
    _values[name] = {"peers": [int(j) for j in np.flatnonzero(peers[r])], "pieces": _pieces(
        name, lambda: jax.tree.unflatten(treedef, [jnp.zeros(s.shape, s.dtype)
                                                   for s in shapes]))}


def _pieces(name: str, zeros: Any) -> dict[str, Any]:
    def read():
        r = _rank()
        _get_own(name, {r: 1.0})
        return _combine(zeros(), name, 0.0, {r: 1.0})

    def average(j):
        r = _rank()
        _get_own(name, {r: 1.0, j: 1.0})
        mine = _combine(zeros(), name, 0.0, {r: 1.0})
        mean = _combine(mine, name, 0.5, {j: 0.5})
        _accumulate_values(jax.tree.map(jnp.subtract, mine, mean), name, {j: 1.0}, False)
        return mean

    return {"read": jit(read), "average": jit(average, static_argnums=0),
            "add": jit(lambda u: _accumulate_values(u, name, {_rank(): 1.0}, True)),
            "zeros": zeros}


def _value(name: str) -> dict[str, Any]:
    lookup(name, "adpsgd")
    return _values[name]


def value_read(name: str) -> Any:
    with win_mutex(name, [_rank()]):
        return _value(name)["pieces"]["read"]()


def value_add(name: str, x: Any) -> None:
    _value(name)["pieces"]["add"](x)


def value_pair_average(name: str, peer: Any) -> None:
    if _args.is_traced(peer):
        raise TypeError("adpsgd: the peer is a traced value, but on MPI processes the pairwise "
                        "average must know it (it takes both ranks' mutexes); step "
                        "outside jax.jit")
    j = int(peer)
    with win_mutex(name, [_rank(), j]):
        _value(name)["pieces"]["average"](j)


def value_compile(name: str) -> None:
    value = _value(name)
    pieces = value["pieces"]
    pieces["read"].lower().compile()
    pieces["add"].lower(pieces["zeros"]()).compile()
    for j in value["peers"]:  # every peer
        pieces["average"].lower(j).compile()
    with win_mutex(name, [_rank()]):  # and the mutex's own small computations
        pass
