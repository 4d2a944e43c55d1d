"""The simulation backend: every op as ``lax`` collectives over the agent axis.

``jaxfog.simulate`` vmaps the per-agent function over a named axis; while it
traces, each op lowers here, with no FFI and no MPI:

* neighbor averaging: the edges of W grouped by offset ``(i - j) mod n``;
  each offset is one ``lax.ppermute`` (a cyclic shift of the agents), scaled
  by the per-agent weight column (zero where there is no edge). A circulant
  graph (ring, exponential) costs one ppermute per neighbour; under vmap each
  is a fused row gather, so the whole step reads every neighbour row once. A
  ``Schedule`` with a traced step is a ``lax.switch`` over its entries, so
  only the current entry's exchanges run.
* ``allreduce``: ``psum``; ``broadcast``: ``psum`` of the root's value;
  ``allgather``/``neighbor_allgather``: ``all_gather`` (and a gather).
* hierarchical averaging: permutations inside and across the declared machines.

Everything is differentiable (``ppermute`` transposes to the inverse
permutation, i.e. averaging with W^T), batchable and jittable, on CPU or GPU.
Numerics follow the C++ handlers: integers are averaged in float64 (also with
``jax_enable_x64`` off) and rounded to nearest, ties to even; 16-bit floats
in float32. It is the oracle the MPI backend is tested against.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfog import _context
from jaxfog import topology as T
from jaxfog.ops import _args
from jaxfog.ops.backends import _numerics
from jaxfog.ops.backends import simulated_clock as _clock
from jaxfog.ops.backends import simulated_windows as _windows


def _mix_leaf(x, w: np.ndarray, sim: _context.Simulation):
    """Row ``rank`` of ``W @ X`` for one leaf, with one ppermute per offset."""
    n, i = sim.size, sim.rank
    with _numerics.accumulating(x.dtype) as acc:
        xs = x.astype(acc)
        rows = np.arange(n)
        out = jnp.asarray(np.diag(w))[i].astype(acc) * xs
        for offset in range(1, n):
            column = w[rows, (rows - offset) % n]  # weight agent r gives agent r - offset
            if not column.any():
                continue
            # A full shift: vmap's ppermute needs whole permutations; the weight
            # column is zero where there is no edge.
            perm = [(int((r - offset) % n), int(r)) for r in rows]
            shifted = lax.ppermute(xs, sim.axis_name, perm)
            out = out + jnp.asarray(column)[i].astype(acc) * shifted
        return _numerics.finish(out, x.dtype)


def _mix(leaves: list, w: np.ndarray, sim: _context.Simulation) -> list:
    return [_mix_leaf(leaf, w, sim) for leaf in leaves]


def _concrete(value: Any, what: str) -> np.ndarray:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"jaxfog.simulate: {what} must be a concrete numpy array (its "
                        "sparsity fixes the exchanges), not a traced value")
    return np.asarray(value, dtype=np.float64)


def local_view_matrix(topology: T.Topology, view: _args.LocalView) -> np.ndarray:
    """W from rank-indexed weight arrays (the simulation's form of the local view).

    ``self_weight[i]``; ``src_weights[i, j]``, the weight i gives to j's value
    (default: 1 on the topology's edges); ``dst_weights[j, i]``, the weight j
    scales what it sends to i by (default 1): ``W[i, j] = src[i, j] * dst[j, i]``.
    """
    n = topology.size
    for name, value in zip(view._fields, view):
        if isinstance(value, (dict, list, tuple)) or (
                np.ndim(value) == 0 and value is not None and name != "self_weight"):
            raise TypeError(
                f"jaxfog.simulate: {name} is a per-rank value ({type(value).__name__}), "
                "which cannot differ between traced agents; pass rank-indexed numpy "
                "arrays instead (self_weight of shape (n,), src_weights[i, j] and "
                "dst_weights[j, i] of shape (n, n)), or a Topology as topology=")
    self_weight = np.broadcast_to(_concrete(view.self_weight, "self_weight"), (n,))
    edges = (topology.weights != 0).astype(np.float64)
    src = edges if view.src_weights is None else _concrete(view.src_weights, "src_weights")
    dst = np.ones((n, n)) if view.dst_weights is None else _concrete(view.dst_weights,
                                                                     "dst_weights")
    for name, m in (("src_weights", src), ("dst_weights", dst)):
        if m.shape != (n, n):
            raise ValueError(f"jaxfog.simulate: {name} must have shape ({n}, {n}), got "
                             f"{m.shape}")
    w = src * dst.T
    np.fill_diagonal(w, self_weight)
    return w


def _stack_blocks(gathered):
    """(k, *shape) -> concatenation along axis 0 (a scalar counts as shape (1,))."""
    if gathered.ndim == 1:
        return gathered
    return gathered.reshape((gathered.shape[0] * gathered.shape[1], *gathered.shape[2:]))


def _source_table(sim: _context.Simulation, src_ranks: Any) -> np.ndarray:
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
    if isinstance(src_ranks, (list, tuple)) and src_ranks and np.ndim(src_ranks) == 1:
        raise TypeError("jaxfog.simulate: src_ranks must be rank-indexed, an (n, k) "
                        "array whose row i lists agent i's sources")
    table = np.asarray(src_ranks, dtype=np.int32)
    if table.ndim != 2 or table.shape[0] != n or ((table < 0) | (table >= n)).any():
        raise ValueError(f"jaxfog.simulate: src_ranks must be an ({n}, k) array of ranks")
    return table


class SimulatedBackend:
    """Ops on the agents of the simulation being traced."""

    def __init__(self, sim: _context.Simulation):
        self.sim = sim

    def neighbor_allreduce(self, leaves: list, args: _args.NeighborAllreduce) -> list:
        sim, graph = self.sim, args.graph
        if isinstance(graph, T.Schedule):
            if isinstance(args.step, int):
                _clock.synchronize(graph.at(args.step).weights != 0)
                return _mix(leaves, graph.at(args.step).weights, sim)
            _clock.synchronize(np.any([t.weights != 0 for t in graph], axis=0))
            branches = [functools.partial(_mix, w=t.weights, sim=sim) for t in graph]
            return lax.switch(args.step.astype(jnp.int32) % graph.period, branches, leaves)
        # Every agent's plan is a row of one W, so senders and receivers always
        # match: check_topology has nothing to check here.
        w = graph.weights if args.local_view is None else local_view_matrix(
            graph, args.local_view)
        _clock.synchronize(w != 0)
        return _mix(leaves, w, sim)

    def pair_gossip(self, leaves: list, args: _args.PairGossip) -> list:
        """Every agent reads its peer's value (a gather: the peers may be
        traced); a pair that does not name each other gets NaN."""
        sim = self.sim
        _clock.synchronize()
        peer = jnp.asarray(args.peer, jnp.int32)
        peers = lax.all_gather(peer, sim.axis_name)
        paired = (peer >= 0) & (peer < sim.size) & (peers[jnp.clip(peer, 0, sim.size - 1)]
                                                    == sim.rank)
        outs = []
        for x in leaves:
            with _numerics.accumulating(x.dtype) as acc:
                theirs = lax.all_gather(x, sim.axis_name)[jnp.clip(peer, 0, sim.size - 1)]
                mean = _numerics.finish((x.astype(acc) + theirs.astype(acc)) / 2, x.dtype)
            bad = jnp.asarray(jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0, x.dtype)
            outs.append(jnp.where(paired, mean, bad))
        return outs

    def hierarchical_neighbor_allreduce(
            self, leaves: list, args: _args.HierarchicalNeighborAllreduce) -> list:
        """Machine means (ppermutes inside each machine), then the machine
        topology applied between machines (ppermutes by whole machines)."""
        if args.local_view is not None:
            raise TypeError(f"{args.what}: in jaxfog.simulate the machine weights come "
                            "from simulate(machine_topology=...), not per-rank dicts")
        sim = self.sim
        _clock.synchronize()
        n, size_l = sim.size, sim.local_size
        w = np.kron(sim.machine_topology.weights, np.eye(size_l))  # machine m' -> m, same l
        outs = []
        for x in leaves:
            with _numerics.accumulating(x.dtype) as acc:
                xs = x.astype(acc)
                total = xs
                for shift in range(1, size_l):  # each agent collects its machine's values
                    perm = [(int(r), int(r - r % size_l + (r % size_l + shift) % size_l))
                            for r in range(n)]
                    total = total + lax.ppermute(xs, sim.axis_name, perm)
                # Rounded like the C++ path's machine mean (an allreduce) for integers.
                mean = _numerics.finish(total / size_l, x.dtype)
            outs.append(_mix_leaf(mean, w, sim))
        return outs

    def neighbor_allgather(self, leaves: list, args: _args.NeighborAllgather) -> list:
        table = _source_table(self.sim, args.src_ranks)
        receives = np.zeros((self.sim.size,) * 2, bool)
        receives[np.arange(self.sim.size)[:, None], table] = True
        _clock.synchronize(receives)
        mine = jnp.asarray(table)[self.sim.rank]
        return [_stack_blocks(jnp.take(lax.all_gather(x, self.sim.axis_name), mine, axis=0))
                for x in leaves]

    def allreduce(self, leaves: list, args: _args.Allreduce) -> list:
        _clock.synchronize()
        outs = []
        for x in leaves:
            if not args.mean and jnp.issubdtype(x.dtype, jnp.integer):
                outs.append(lax.psum(x, self.sim.axis_name))  # exact, as MPI's integer sum
                continue
            with _numerics.accumulating(x.dtype) as acc:
                total = lax.psum(x.astype(acc), self.sim.axis_name)
                outs.append(_numerics.finish(total / self.sim.size if args.mean else total, x.dtype))
        return outs

    def broadcast(self, leaves: list, args: _args.Broadcast) -> list:
        _clock.synchronize()
        is_root = self.sim.rank == args.root
        # psum widens bool and small integers; the root's value keeps its dtype.
        return [lax.psum(jnp.where(is_root, x, jnp.zeros_like(x)), self.sim.axis_name)
                .astype(x.dtype) for x in leaves]

    def allgather(self, leaves: list, args: _args.Allgather) -> list:
        _clock.synchronize()
        return [_stack_blocks(lax.all_gather(x, self.sim.axis_name)) for x in leaves]

    def barrier(self) -> None:
        """Simulated agents run in lockstep: only their clocks wait."""
        _clock.synchronize()

    # One-sided windows: JAX references, immediate delivery (simulated_windows).
    def win_create(self, leaves: list, treedef: Any, args: _args.WinCreate) -> bool:
        return _windows.win_create(self.sim, leaves, treedef, args)

    def win_free(self, name: str | None) -> bool:
        return _windows.win_free(name)

    def win_put(self, leaves: list, treedef: Any, args: _args.WinPut) -> list:
        return _windows.win_put(self.sim, leaves, treedef, args)

    def win_get(self, args: _args.WinGet) -> bool:
        return _windows.win_get(self.sim, args)

    def win_update(self, leaves: list, treedef: Any, args: _args.WinUpdate) -> list:
        return _windows.win_update(self.sim, leaves, treedef, args)

    win_version = staticmethod(_windows.win_version)
    win_weight = staticmethod(_windows.win_weight)
    win_mutex = staticmethod(_windows.win_mutex)
