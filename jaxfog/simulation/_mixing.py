"""Mixing on simulated agents: row ``rank`` of ``W @ X`` as ``lax`` collectives
over the agent axis, what the ops' rules on agents share.

The edges of W are grouped by offset ``(i - j) mod n``; each offset is one
``lax.ppermute`` (a cyclic shift of the agents), scaled by the per-agent weight
column (zero where there is no edge). A circulant graph (ring, exponential)
costs one ppermute per neighbour; under vmap each is a fused row gather, walked
row by row, so a neighbour's row is reused from cache only while it is still
there (on a GPU at d = 1e7 the step reads in-degree + 1 copies of X).
``JAXFOG_SIM_MIXING`` picks a column-tiled Pallas kernel instead that reads X
about once (``_tiled``: by default on a GPU for large leaves; the gather path
stays the default on CPU and is the oracle). BlueFog's local views (weights
as numbers, dicts, rank-indexed tables or traced values) resolve here to a
static W or, with a traced weight, to every agent's weights for every sender.

Numerics follow the C++ handlers (``jaxfog.ops._numerics``): integers are
averaged in float64 (also with ``jax_enable_x64`` off) and rounded to nearest,
ties to even; 16-bit floats in float32.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxfog import _context
from jaxfog import topology as T
from jaxfog.ops import _args, _numerics, _plan
from jaxfog.simulation import _clock, _tiled


def _mix_leaf(x, w: np.ndarray, sim: _context.Simulation, self_weight: Any = None):
    """Row ``rank`` of ``W @ X`` for one leaf: the column-tiled kernel where
    ``_tiled.wanted`` (``JAXFOG_SIM_MIXING``), else :func:`_gather_leaf`."""
    if _tiled.wanted(x, sim, self_weight):
        return _tiled.mix_leaf(x, sim, _tiled.table(w), _tiled.table(w.T),
                               functools.partial(_gather_leaf, w=w, sim=sim),
                               functools.partial(_gather_leaf, w=w.T, sim=sim))
    return _gather_leaf(x, w, sim, self_weight)


def _gather_leaf(x, w: np.ndarray, sim: _context.Simulation, self_weight: Any = None):
    """Row ``rank`` of ``W @ X`` for one leaf, with one ppermute per offset
    (``self_weight``: this agent's traced self weight instead of W's diagonal)."""
    n, i = sim.size, sim.rank
    with _numerics.accumulating(x.dtype) as acc:
        xs = x.astype(acc)
        rows = np.arange(n)
        own = jnp.asarray(np.diag(w))[i] if self_weight is None else jnp.asarray(self_weight)
        out = own.astype(acc) * xs
        for offset in range(1, n):
            column = w[rows, (rows - offset) % n]  # weight agent r gives agent r - offset
            if not column.any():
                continue
            # A full shift: vmap's ppermute needs whole permutations; the weight
            # column is zero where there is no edge.
            perm = [(int((r - offset) % n), int(r)) for r in rows]
            shifted = sim.ppermute(xs, perm)
            out = out + jnp.asarray(column)[i].astype(acc) * shifted
        return _numerics.finish(out, x.dtype)


def hierarchical_leaf(x, wm: np.ndarray, sim: _context.Simulation):
    """This agent's machine mean (ppermutes inside its machine), then the
    machine topology ``wm`` between machines (ppermutes by whole machines)."""
    n, size_l = sim.size, sim.local_size
    with _numerics.accumulating(x.dtype) as acc:
        xs = x.astype(acc)
        total = xs
        for shift in range(1, size_l):  # each agent collects its machine's values
            perm = [(int(r), int(r - r % size_l + (r % size_l + shift) % size_l))
                    for r in range(n)]
            total = total + sim.ppermute(xs, perm)
        # Rounded like the C++ path's machine mean (an allreduce) for integers.
        mean = _numerics.finish(total / size_l, x.dtype)
    return _gather_leaf(mean, np.kron(wm, np.eye(size_l)), sim)  # machine m' -> m, same l


def mix(leaves: list, w: np.ndarray, sim: _context.Simulation, self_weight: Any = None) -> list:
    return [_mix_leaf(leaf, w, sim, self_weight) for leaf in leaves]


def _mix_dense(leaves: list, self_weight: Any, weights: Any, sim: _context.Simulation) -> list:
    """``self_weight * x_i + sum_j weights[j] x_j`` with traced weights: every
    agent's value gathered (the senders are not known at trace time)."""
    outs = []
    for x in leaves:
        with _numerics.accumulating(x.dtype) as acc:
            xs = x.astype(acc)
            everyone = sim.all_gather(xs)
            w = weights.astype(acc).reshape((-1,) + (1,) * x.ndim)
            out = jnp.asarray(self_weight).astype(acc) * xs + jnp.sum(w * everyone, axis=0)
            outs.append(_numerics.finish(out, x.dtype))
    return outs


class Mixing(NamedTuple):
    """A local view resolved for every agent: a static W (``self_weight``
    None: its diagonal; else this agent's traced self weight), or, when a
    weight is traced, ``weights``: this agent's weight for every sender."""

    static: np.ndarray | None
    self_weight: Any
    weights: Any


def _side(value: Any, label: str, what: str, n: int, rank: Any, allow_list: bool):
    """(kind, value): ``table`` (n, n) numpy with a zero diagonal, ``row`` (n,)
    numpy (this agent's view, the same for every agent), ``traced`` (n,)."""
    if value is None:
        return None
    where = f"{what}: {label}"
    if not _args.is_array(value):
        given = _plan.weights_dict(value, where, allow_list=allow_list)
        _plan.check_ranks(given, n, -1, where)
        row = np.zeros(n)
        for j, w in given.items():
            row[j] = w
        return "row", row
    if _args.is_traced(value):
        row = value[rank] * (jnp.arange(n) != rank) if value.ndim == 2 else value
        return "traced", row
    a = np.asarray(value, np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"{where}: weights must be finite")
    if a.ndim == 2:
        a = a.copy()
        np.fill_diagonal(a, 0.0)
        return "table", a
    return "row", a


def _full(side, label: str, what: str, n: int) -> np.ndarray | None:
    """Every agent's row of a static side."""
    if side is None:
        return None
    kind, value = side
    if kind == "table":
        return value
    named = [int(j) for j in np.flatnonzero(value)]
    if named:
        raise ValueError(f"{what}: {label} names ranks {named} for every agent, so agent "
                         f"{named[0]} cannot be its own neighbor; give a rank-indexed table "
                         "(row i: agent i's weights) instead")
    return np.tile(value, (n, 1))


def local_view_mixing(topology: T.Topology, view: _args.LocalView, what: str, rank: Any,
                      labels: tuple[str, str] = ("src_weights", "dst_weights")) -> Mixing:
    """W of BlueFog's local view, from any documented form of each weight.

    ``self_weight``: a number, a rank-indexed (n,) array, or a traced value;
    ``src_weights``: ``{rank: w}``, a row of n weights, or a rank-indexed
    table ``src[i, j]`` (the weight i gives j's value); ``dst_weights``: the
    same, or a list of ranks, with ``dst[j, i]`` the weight j scales what it
    sends to i by. ``W[i, j] = src[i, j] * dst[j, i]``; with one side only,
    the other's weights are 1 on its edges. A dict or a list is one agent's
    view, the same for every agent (as on MPI, in pull or push form its ranks
    must be the topology's in- or out-neighbours).
    """
    n = topology.size
    sw = view.self_weight
    traced_self = None
    if _args.is_traced(sw):
        traced_self = sw[rank] if jnp.ndim(sw) == 1 else sw
        self_row = None
    else:
        if not _args.is_array(sw):
            sw = _plan.weight(sw, f"{what}: self_weight")
        self_row = np.broadcast_to(np.asarray(sw, np.float64), (n,))
        if not np.isfinite(self_row).all():
            raise ValueError(f"{what}: self_weight must be finite")
    src = _side(view.src_weights, labels[0], what, n, rank, allow_list=False)
    dst = _side(view.dst_weights, labels[1], what, n, rank, allow_list=True)
    if any(side is not None and side[0] == "traced" for side in (src, dst)):
        return _dense(src, dst, self_row, traced_self, n, rank)
    S, D = _full(src, labels[0], what, n), _full(dst, labels[1], what, n)
    edges = (topology.weights != 0) & ~np.eye(n, dtype=bool)
    if S is not None and D is not None:
        w = S * D.T
    elif S is not None:
        if src[0] == "row" and ((S != 0) != edges).any():
            raise ValueError(f"{what}: {labels[0]} names ranks other than the static "
                             "topology's in-neighbours; give dst_weights too for a dynamic "
                             "graph")
        w = S.copy()
    else:
        assert D is not None  # _args.local_view refuses a view with neither side
        if dst[0] == "row" and ((D != 0) != edges.T).any():
            raise ValueError(f"{what}: {labels[1]} names ranks other than the static "
                             "topology's out-neighbours; give src_weights too for a dynamic "
                             "graph")
        w = D.T.copy()
    np.fill_diagonal(w, 0.0 if self_row is None else self_row)
    return Mixing(w, traced_self, None)


def _dense(src, dst, self_row, traced_self, n: int, rank: Any) -> Mixing:
    def mine(side):  # this agent's src row
        kind, value = side
        return jnp.asarray(value)[rank] if kind == "table" else jnp.asarray(value)

    def column(side):  # every sender's dst weight for this agent
        kind, value = side
        if kind == "table":
            return jnp.asarray(value)[:, rank]
        if kind == "row":
            return jnp.full(n, jnp.asarray(value)[rank])
        sim = _context.current()
        assert sim is not None  # an agent is being traced
        return sim.all_gather(value)[:, rank]

    s = None if src is None else mine(src)
    d = None if dst is None else column(dst)
    if s is None:
        assert d is not None  # the caller's check: a side is traced
        s = (d != 0).astype(d.dtype)
    if d is None:
        d = jnp.ones(n, s.dtype)
    weights = jnp.where(jnp.arange(n) != rank, s * d, 0)
    own = traced_self if self_row is None else jnp.asarray(self_row)[rank]
    return Mixing(None, own, weights)


def apply_mixing(leaves: list, mixing: Mixing, sim: _context.Simulation) -> list:
    if mixing.static is not None:
        _clock.synchronize(mixing.static != 0)
        return mix(leaves, mixing.static, sim, mixing.self_weight)
    _clock.synchronize()
    return _mix_dense(leaves, mixing.self_weight, mixing.weights, sim)


def stack_blocks(gathered):
    """(k, *shape) -> concatenation along axis 0 (a scalar counts as shape (1,))."""
    if gathered.ndim == 1:
        return gathered
    return gathered.reshape((gathered.shape[0] * gathered.shape[1], *gathered.shape[2:]))


def source_table(sim: _context.Simulation, src_ranks: Any) -> np.ndarray:
    """Row i: the agents agent i gathers from (rank-indexed, (n, k))."""
    n = sim.size
    if src_ranks is None:
        if isinstance(sim.topology, T.Schedule):
            raise ValueError("jaxfog.simulate: neighbor_allgather needs src_ranks when the "
                             "simulation's topology is a Schedule")
        ins = [sim.topology.in_neighbors(r) for r in range(n)]
        if len({len(s) for s in ins}) != 1:
            raise ValueError("jaxfog.simulate: neighbor_allgather needs every agent to "
                             "receive from the same number of ranks (in-degrees differ); "
                             "pass src_ranks as an (n, k) array")
        return np.array(ins, dtype=np.int32).reshape(n, -1)
    if _args.is_traced(src_ranks):
        raise TypeError("jaxfog.simulate: src_ranks must be concrete (a list, or a "
                        "rank-indexed (n, k) table): they fix the exchanges, not a traced "
                        "value")
    table = np.asarray(list(src_ranks) if not _args.is_array(src_ranks) else src_ranks,
                       dtype=np.int32)
    if table.ndim == 1:  # one agent's list, the same for every agent
        table = np.tile(table, (n, 1))
    if table.ndim != 2 or table.shape[0] != n or ((table < 0) | (table >= n)).any():
        raise ValueError(f"jaxfog.simulate: src_ranks must be an ({n}, k) array of ranks")
    return table


def hierarchical_mix(leaves: list, wm: np.ndarray, sim: _context.Simulation) -> list:
    """:func:`hierarchical_leaf` for each leaf, or the column-tiled kernel
    where ``_tiled.wanted`` (the machine topology as an agents' table)."""
    outs = []
    for x in leaves:
        if _tiled.wanted(x, sim, None):
            size_l = sim.local_size
            outs.append(_tiled.mix_leaf(
                x, sim, _tiled.machine_table(wm, size_l), _tiled.machine_table(wm.T, size_l),
                functools.partial(hierarchical_leaf, wm=wm, sim=sim),
                functools.partial(hierarchical_leaf, wm=wm.T, sim=sim)))
        else:
            outs.append(hierarchical_leaf(x, wm, sim))
    return outs
