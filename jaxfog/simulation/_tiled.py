"""Column-tiled neighbor averaging of the stacked agents (issue 45).

Today's simulated mixing (``_backend._mix_leaf``, the *gather* path) is one
``ppermute`` per rank offset; under vmap each is a shifted row gather that XLA
fuses into one loop over the output, row by row. A neighbour's row is reused
from the GPU's L2 cache only while it is still there, so once a row no longer
fits (d = 1e7 float32: 40 MB a row) the step reads in-degree + 1 copies of X
instead of one.

The *tiled* path computes ``W @ X`` for the stacked ``X`` (n, d) with a Pallas
kernel over a grid of (row, column tile) programs, the row index the fastest
(Triton's ``program_id(0)``): all n rows of a column tile are produced while
that tile of X (n * tile values, well under 1 MB at tile = 1024) stays in L2,
so X is read from memory about once. Each row's sources are a padded table
built from the static W: slot 0 the agent itself, then its in-neighbours by
rank offset ``(i - j) mod n`` ascending, the order the gather path sums in;
the weights are W's entries in the accumulation type. Numerics are those of
``jaxfog.ops._numerics``: integers averaged in float64 and rounded
half to even (in the kernel, from ``floor``: Triton has no round), 16-bit
floats in float32.

How the kernel gets the whole stacked array while ``jaxfog.simulate`` traces
one agent: a ``jax.custom_batching.custom_vmap`` function of (x, rank) whose
batching rule, when the rank is batched (i.e. this is the agents' vmap axis),
receives the stacked (n, ...) operand and calls the kernel once. For any
other vmap axis (a vmap inside the agent's code) the rule moves that axis to
the last one, more columns mixed alike, and calls the function again, which
the agents' axis then batches; so nested vmaps, ``jit`` and ``lax.switch``
keep working. Its plain form (traced for its shape) is the gather path.
A ``jax.custom_vjp`` around it mixes the cotangent with W^T (the same kernel on
W^T's table). Forward-mode autodiff (``jax.jvp``, ``jacfwd``) of a custom_vjp
function is not supported by JAX: use the gather path for it.

Chosen by ``JAXFOG_SIM_MIXING`` (read when a simulation is traced):

* ``gather``: today's path everywhere;
* ``tiled``: the kernel on every platform (compiled by Triton on a GPU, run
  by Pallas' interpreter elsewhere: a check of its numerics, slow);
* ``auto`` (the default): the gather path, on every platform, until the GPU
  check has compiled and timed the kernel (it has never run on a GPU; on one
  it would also take forward-mode autodiff away). Then ``auto`` is to pick it
  by platform and size from that table.

Only a static W takes the tiled path (neighbor_allreduce on a Topology or a
Schedule entry, a static local view, the optimizers that call it, and the
hierarchical form: machine means, stored back as the leaf's type, then
``kron(wm, I)``, in one kernel); a traced self weight, traced weights,
simulations over a mesh, bool and complex leaves, and the one-sided windows
keep the gather path, as do values traced under a mesh with Explicit axes
(``jax.set_mesh``: Pallas takes no sharding-typed operands). GPU speed is NOT
yet measured: the kernel was checked against numpy and the gather path in
Pallas' interpreter on CPU, and its Triton lowering was built on CPU (not
compiled by ptxas nor run); ``benchmarks/bench_gpu.py --part simulate``
reports it beside the gather path, the bound and dense W @ X, and ``GPU_TILE``
is a guess until it has run.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog.ops import _numerics

ENV = "JAXFOG_SIM_MIXING"
MODES = ("auto", "gather", "tiled")
#: Columns per program when Triton compiles the kernel (a power of 2).
GPU_TILE = 1024
#: Columns per program in Pallas' interpreter (small: the tests' ragged tiles).
INTERPRET_TILE = 128


class _Forced(threading.local):
    def __init__(self) -> None:
        self.mode: str | None = None


_forced = _Forced()


def mode() -> str:
    """The mixing path asked for: a :func:`forcing` block's, else ``JAXFOG_SIM_MIXING``'s."""
    if _forced.mode is not None:
        return _forced.mode
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


@contextlib.contextmanager
def forcing(value: str) -> Iterator[None]:
    """Trace simulations in this block with mixing path ``value`` (tests, benchmarks)."""
    if value not in MODES:
        raise ValueError(f"mixing path {value!r}: expected one of {', '.join(MODES)}")
    before, _forced.mode = _forced.mode, value
    try:
        yield
    finally:
        _forced.mode = before


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _explicit_sharding(x: Any) -> bool:
    """Whether ``x`` is traced under a mesh with Explicit axes (``jax.set_mesh``,
    or sharded arguments): sharding-typed values Pallas does not take."""
    from jax.sharding import AxisType

    meshes = [jax.sharding.get_abstract_mesh(), getattr(jax.typeof(x).sharding, "mesh", None)]
    return any(m is not None and not m.empty and AxisType.Explicit in m.axis_types
               for m in meshes)


def wanted(x: Any, sim: Any, self_weight: Any) -> bool:
    """Whether this leaf's mixing takes the tiled path."""
    chosen = mode()
    if chosen == "gather" or self_weight is not None or sim.on_mesh:
        return False
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        return False  # bool, complex: the gather path
    if _explicit_sharding(x):
        return False  # the kernel takes no sharded operands: the gather path
    return chosen == "tiled"  # auto: the gather path until measured (module docstring)


@functools.lru_cache(maxsize=256)
def _table_cached(data: bytes, n: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.frombuffer(data, np.float64).reshape(n, n)
    edges = (w != 0) & ~np.eye(n, dtype=bool)
    slots = 1 + int(edges.sum(axis=1).max(initial=0))
    src = np.repeat(np.arange(n, dtype=np.int32)[:, None], slots, axis=1)  # padding: i, 0
    wt = np.zeros((n, slots), np.float64)
    wt[:, 0] = np.diag(w)
    for i in range(n):
        js = np.flatnonzero(edges[i])
        js = js[np.argsort((i - js) % n, kind="stable")]  # by rank offset, as gathered
        src[i, 1:1 + len(js)] = js
        wt[i, 1:1 + len(js)] = w[i, js]
    src.flags.writeable = wt.flags.writeable = False
    return src, wt


def table(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(src, wt), each (n, slots): row i's sources and their weights in W, in
    the gather path's order (slot 0: i itself; padding: i with weight 0)."""
    w = np.ascontiguousarray(w, np.float64)
    return _table_cached(w.tobytes(), w.shape[0])


def machine_table(wm: np.ndarray, local_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The hierarchical form's (src (n, slots, local_size), wt (n, slots)): row
    i's slots are those of ``kron(wm, I)``, each the mean of source j's
    machine, whose members are listed in the gather path's order (j, then
    its machine's agents at local offsets 1, 2, ...)."""
    src, wt = table(np.kron(wm, np.eye(local_size)))
    if local_size == 1:  # a machine's mean is its one agent's value
        return src, wt
    base, local = src - src % local_size, src % local_size
    shifts = np.arange(local_size)
    return (base[..., None] + (local[..., None] - shifts) % local_size).astype(np.int32), wt


def _round_half_even(v):
    """``jnp.round`` (half to even) from ``floor``, which Triton lowers."""
    r = jnp.floor(v)
    frac = v - r
    odd = r - 2 * jnp.floor(r / 2)
    return jnp.where((frac > 0.5) | ((frac == 0.5) & (odd == 1)), r + 1, r)


def _kernel(src_ref, wt_ref, x_ref, o_ref, *, slots: int, members: int, d: int, tile: int,
            acc: Any, integer: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i, c = pl.program_id(0), pl.program_id(1)
    mask = c * tile + jnp.arange(tile, dtype=jnp.int32) < d

    def finish(v):  # _numerics.finish, back to the accumulation type
        return (_round_half_even(v) if integer else v).astype(o_ref.dtype)

    def load(*index):
        return plt.load(x_ref.at[src_ref[index], pl.ds(0, tile)], mask=mask,
                        other=0).astype(acc)

    total = None
    for k in range(slots):  # static: slot 0 (the agent itself) first, as the gather path
        if members == 1:
            v = load(i, k)
        else:  # a machine's mean, stored back as the leaf's type
            v = load(i, k, 0)
            for m in range(1, members):
                v = v + load(i, k, m)
            v = finish(v / members).astype(acc)
        term = wt_ref[i, k] * v
        total = term if total is None else total + term
    plt.store(o_ref.at[pl.ds(0, tile)], finish(total), mask=mask)


def mix_stacked(xs, src: np.ndarray, wt: np.ndarray, *, interpret: bool | None = None,
                tile: int | None = None):
    """``W @ X`` for stacked ``xs`` (n, ...) with the kernel, in ``_numerics``' arithmetic.

    ``(src, wt)``: :func:`table` or :func:`machine_table`; ``interpret``:
    Pallas' interpreter (default: off a GPU); ``tile``: columns per program (a
    power of 2; default ``GPU_TILE`` compiled, ``INTERPRET_TILE`` interpreted)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if interpret is None:
        interpret = not _on_gpu()
    if tile is None:
        tile = INTERPRET_TILE if interpret else GPU_TILE
    n, shape = xs.shape[0], xs.shape
    d = math.prod(shape[1:])
    if d == 0 or n == 0:
        return xs
    with _numerics.accumulating(xs.dtype) as acc:
        kernel = functools.partial(
            _kernel, slots=src.shape[1], members=src.shape[2] if src.ndim == 3 else 1, d=d,
            tile=tile, acc=acc, integer=bool(jnp.issubdtype(xs.dtype, jnp.integer)))
        out = pl.pallas_call(
            kernel,
            # Rows are grid axis 0, Triton's program_id(0): the fastest, so one
            # column tile's rows run together while that tile of X is in L2.
            grid=(n, pl.cdiv(d, tile)),
            in_specs=[pl.BlockSpec(src.shape, lambda i, c: (0,) * src.ndim),
                      pl.BlockSpec(wt.shape, lambda i, c: (0, 0)),
                      pl.BlockSpec((n, tile), lambda i, c: (0, c))],
            out_specs=pl.BlockSpec((None, tile), lambda i, c: (i, c)),
            out_shape=jax.ShapeDtypeStruct((n, d), xs.dtype),
            interpret=interpret,
            compiler_params=None if interpret else plt.CompilerParams(num_warps=4,
                                                                      num_stages=1),
            name="jaxfog_tiled_mix",
        )(jnp.asarray(src), jnp.asarray(wt, acc), xs.reshape(n, d))
    return out.reshape(shape)


def _per_agent(tables: tuple[np.ndarray, np.ndarray], n: int, gather: Callable) -> Callable:
    """(x, rank) -> this agent's row of W @ X: the kernel on the agents' axis."""

    @jax.custom_batching.custom_vmap
    def mix(x, rank):
        # Traced for its shape; its value is used only where no vmap batches
        # the call, which the agents' axis always does (rank is batched there).
        try:
            return gather(x)
        except NameError:  # the agents' axis is not bound (a custom_vjp's bwd)
            return x

    @mix.def_vmap
    def rule(axis_size, in_batched, x, rank):
        x_batched, rank_batched = in_batched
        if not rank_batched or axis_size != n:
            # A vmap inside the agent's code: its axis is more columns, mixed
            # alike; the call, no longer batched here, goes to the agents' axis.
            return jnp.moveaxis(mix(jnp.moveaxis(x, 0, -1), rank), -1, 0), True
        if not x_batched:  # the same value on every agent
            x = jnp.broadcast_to(x, (n, *x.shape))
        return mix_stacked(x, *tables), True

    return mix


def mix_leaf(x, sim: Any, forward: tuple[np.ndarray, np.ndarray],
             backward: tuple[np.ndarray, np.ndarray], gather: Callable, gather_t: Callable):
    """This agent's row of the mixing by the kernel: ``forward`` its tables,
    ``backward`` the transpose's; ``gather``/``gather_t``: the same by today's
    path (per agent: the form that only shapes are taken from)."""
    n = sim.size
    mix = _per_agent(forward, n, gather)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return mix(x, sim.rank)
    mix_t = _per_agent(backward, n, gather_t)

    @jax.custom_vjp
    def mixed(x, rank):
        return mix(x, rank)

    def fwd(x, rank):
        return mix(x, rank), rank

    def bwd(rank, ct):  # the transpose of averaging with W is averaging with W^T
        return mix_t(ct, rank), None

    mixed.defvjp(fwd, bwd)
    return mixed(x, sim.rank)
