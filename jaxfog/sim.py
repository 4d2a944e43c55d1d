"""The embedded backend: the same per-agent code for n agents in one process.

``simulate(fn, topology_or_n)`` returns a function whose arguments carry a
leading agent axis of size n. It vmaps ``fn`` over that axis with a name;
while ``fn`` is traced, ``jaxfog.rank()`` is the (traced) agent index,
``jaxfog.size()`` is n, and every jaxfog op lowers to ``lax`` collectives
over the named axis -- no FFI, no MPI:

* neighbor averaging: the edges of W grouped by offset ``(i - j) mod n``;
  each offset is one ``lax.ppermute`` (a cyclic shift of the agents), scaled
  by the per-agent weight column (zero where there is no edge). A circulant graph (ring, exponential) costs one
  ppermute per neighbour; under vmap each is a fused row gather, so the whole
  step reads every neighbour row once. A ``Schedule`` with a traced step is a
  ``lax.switch`` over its entries, so only the current entry's exchanges run.
* ``allreduce``: ``psum``; ``broadcast``: ``psum`` of the root's value;
  ``allgather``/``neighbor_allgather``: ``all_gather`` (and a gather).
* hierarchical averaging: permutations inside and across the declared machines.

Everything is differentiable (``ppermute`` transposes to the inverse
permutation, i.e. averaging with W^T), batchable and jittable, on CPU or GPU.
It is also the oracle the MPI backend is tested against.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfog import _context
from jaxfog import topology as T

#: Name of the vmapped agent axis (override with ``simulate(axis_name=...)``).
AGENT_AXIS = "jaxfog_agents"


def simulate(fn: Callable, topology_or_n: T.Topology | int, *, local_size: int = 1,
             machine_topology: T.Topology | None = None, in_axes: Any = 0,
             out_axes: Any = 0, axis_name: str = AGENT_AXIS) -> Callable:
    """Runs the per-agent function ``fn`` for n agents in this process.

    Args:
      fn: per-agent code, exactly as it runs under ``jaxfog run`` (it may call
        ``jaxfog.rank()``, ``size()`` and every op, and need not call ``init``).
      topology_or_n: the agents' topology (``load_topology()`` inside ``fn``),
        or n for ``exponential(n)``.
      local_size: agents per simulated machine (for ``local_rank``,
        ``machine_rank`` and hierarchical averaging); must divide n.
      machine_topology: default ``exponential(n // local_size)``.
      in_axes, out_axes: as for ``jax.vmap`` (the agent axis).
      axis_name: name of the agent axis.

    Returns:
      A function of stacked per-agent arguments; jit it, grad it, scan it.
    """
    if isinstance(topology_or_n, T.Topology):
        topology = topology_or_n
    elif isinstance(topology_or_n, (int, np.integer)) and not isinstance(topology_or_n, bool):
        topology = T.exponential(int(topology_or_n))
    else:
        raise TypeError("simulate needs a Topology or a number of agents, got "
                        f"{type(topology_or_n).__name__}")
    n = topology.size
    if isinstance(local_size, bool) or not isinstance(local_size, (int, np.integer)) or (
            local_size < 1 or n % local_size):
        raise ValueError(f"simulate: local_size={local_size!r} must be a positive divisor "
                         f"of the number of agents {n}")
    machines = n // int(local_size)
    machine_topology = T.exponential(machines) if machine_topology is None else machine_topology
    if not isinstance(machine_topology, T.Topology) or machine_topology.size != machines:
        raise ValueError(f"simulate: machine_topology must be a Topology over {machines} "
                         "machines")
    simulation = _context.Simulation(axis_name, n, topology, int(local_size), machine_topology)

    @functools.wraps(fn)
    def per_agent(*args, **kwargs):
        with _context.simulating(simulation):
            return fn(*args, **kwargs)

    return jax.vmap(per_agent, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)


# --- the ops on simulated agents -------------------------------------------


def _accumulator(dtype) -> Any:
    """Float type the sum is computed in (integers round at the end)."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    if dtype in (jnp.float16, jnp.bfloat16):
        return jnp.float32
    return dtype


def _finish(value, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        value = jnp.round(value)  # half to even, as the MPI backend
    return value.astype(dtype)


def _mix_leaf(x, w: np.ndarray, sim: _context.Simulation):
    """Row ``rank`` of ``W @ X`` for one leaf, with one ppermute per offset."""
    n, i = sim.size, lax.axis_index(sim.axis_name)
    acc = _accumulator(x.dtype)
    xs = x.astype(acc)
    rows = np.arange(n)
    out = jnp.asarray(np.diag(w))[i].astype(acc) * xs
    for offset in range(1, n):
        column = w[rows, (rows - offset) % n]  # weight agent r gives to agent r - offset
        if not column.any():
            continue
        # A full shift: vmap's ppermute needs whole permutations; the weight
        # column is zero where there is no edge.
        perm = [(int((r - offset) % n), int(r)) for r in rows]
        out = out + jnp.asarray(column)[i].astype(acc) * lax.ppermute(xs, sim.axis_name, perm)
    return _finish(out, x.dtype)


def _mix(leaves, w: np.ndarray, sim):
    return [_mix_leaf(leaf, w, sim) for leaf in leaves]


def _concrete(value: Any, what: str) -> np.ndarray:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"jaxfog.simulate: {what} must be a concrete numpy array (its "
                        "sparsity fixes the exchanges), not a traced value")
    return np.asarray(value, dtype=np.float64)


def local_view_matrix(sim: _context.Simulation, self_weight: Any, src_weights: Any,
                      dst_weights: Any) -> np.ndarray:
    """W from rank-indexed weight arrays (the simulation's form of the local view).

    ``self_weight[i]``; ``src_weights[i, j]``, the weight i gives to j's value
    (default: 1 on the topology's edges); ``dst_weights[j, i]``, the weight j
    scales what it sends to i by (default 1): ``W[i, j] = src[i, j] * dst[j, i]``.
    """
    n = sim.size
    for name, value in (("self_weight", self_weight), ("src_weights", src_weights),
                        ("dst_weights", dst_weights)):
        if isinstance(value, (dict, list, tuple)) or (
                np.ndim(value) == 0 and value is not None and name != "self_weight"):
            raise TypeError(
                f"jaxfog.simulate: {name} is a per-rank value ({type(value).__name__}), "
                "which cannot differ between traced agents; pass rank-indexed numpy "
                "arrays instead (self_weight of shape (n,), src_weights[i, j] and "
                "dst_weights[j, i] of shape (n, n)), or a Topology as topology=")
    if self_weight is None:
        raise ValueError("neighbor_allreduce: self_weight is required when src_weights or "
                         "dst_weights is given")
    sw = np.broadcast_to(_concrete(self_weight, "self_weight"), (n,))
    edges = (sim.topology.weights != 0).astype(np.float64)
    src = edges if src_weights is None else _concrete(src_weights, "src_weights")
    dst = np.ones((n, n)) if dst_weights is None else _concrete(dst_weights, "dst_weights")
    for name, m in (("src_weights", src), ("dst_weights", dst)):
        if m.shape != (n, n):
            raise ValueError(f"jaxfog.simulate: {name} must have shape ({n}, {n}), got "
                             f"{m.shape}")
    w = src * dst.T
    np.fill_diagonal(w, sw)
    return w


def neighbor_allreduce(leaves: Sequence[Any], sim: _context.Simulation, *, topology: Any,
                       step: Any, self_weight: Any, src_weights: Any,
                       dst_weights: Any) -> list:
    local_view = not (self_weight is None and src_weights is None and dst_weights is None)
    if isinstance(topology, T.Schedule):
        if local_view:
            raise ValueError("neighbor_allreduce: with a Schedule the weights come from it")
        if topology.size != sim.size:
            raise ValueError(f"neighbor_allreduce: the schedule has {topology.size} nodes "
                             f"but there are {sim.size} agents")
        if isinstance(step, (int, np.integer)):
            return _mix(leaves, topology.at(int(step)).weights, sim)
        branches = [functools.partial(_mix, w=t.weights, sim=sim) for t in topology]
        return lax.switch(jnp.asarray(step, jnp.int32) % topology.period, branches, leaves)
    graph = sim.topology if topology is None else topology
    if graph.size != sim.size:
        raise ValueError(f"neighbor_allreduce: the topology has {graph.size} nodes but "
                         f"there are {sim.size} agents")
    if local_view:
        sim_view = _context.Simulation(sim.axis_name, sim.size, graph, sim.local_size,
                                       sim.machine_topology)
        w = local_view_matrix(sim_view, self_weight, src_weights, dst_weights)
    else:
        w = graph.weights
    return _mix(leaves, w, sim)


def allreduce(leaves, sim, *, mean: bool) -> list:
    outs = []
    for x in leaves:
        acc = _accumulator(x.dtype)
        total = lax.psum(x.astype(acc), sim.axis_name)
        outs.append(_finish(total / sim.size if mean else total, x.dtype))
    return outs


def broadcast(leaves, sim, *, root: int) -> list:
    is_root = lax.axis_index(sim.axis_name) == root
    return [lax.psum(jnp.where(is_root, x, jnp.zeros_like(x)), sim.axis_name)
            for x in leaves]


def _stack_blocks(gathered):
    """(k, *shape) -> concatenation along axis 0 (a scalar counts as shape (1,))."""
    k = gathered.shape[0]
    if gathered.ndim == 1:
        return gathered
    return gathered.reshape((k * gathered.shape[1], *gathered.shape[2:]))


def allgather(leaves, sim) -> list:
    return [_stack_blocks(lax.all_gather(x, sim.axis_name)) for x in leaves]


def neighbor_allgather(leaves, sim, *, src_ranks: Any) -> list:
    """Blocks from ``src_ranks[i]`` (rank-indexed (n, k)) or the in-neighbours."""
    n = sim.size
    if src_ranks is None:
        ins = [sim.topology.in_neighbors(r) for r in range(n)]
        if len({len(s) for s in ins}) != 1:
            raise ValueError("jaxfog.simulate: neighbor_allgather needs every agent to "
                             "receive from the same number of ranks (in-degrees differ); "
                             "pass src_ranks as an (n, k) array")
        table = np.array(ins, dtype=np.int32).reshape(n, -1)
    else:
        if isinstance(src_ranks, (list, tuple)) and src_ranks and np.ndim(src_ranks) == 1:
            raise TypeError("jaxfog.simulate: src_ranks must be rank-indexed, an (n, k) "
                            "array whose row i lists agent i's sources")
        table = np.asarray(src_ranks, dtype=np.int32)
        if table.ndim != 2 or table.shape[0] != n or ((table < 0) | (table >= n)).any():
            raise ValueError(f"jaxfog.simulate: src_ranks must be an ({n}, k) array of "
                             "ranks")
    mine = jnp.asarray(table)[lax.axis_index(sim.axis_name)]
    return [_stack_blocks(jnp.take(lax.all_gather(x, sim.axis_name), mine, axis=0))
            for x in leaves]


def hierarchical_neighbor_allreduce(leaves, sim) -> list:
    """Machine means (ppermutes inside each machine), then the machine topology
    applied between machines (ppermutes by whole machines)."""
    n, size_l = sim.size, sim.local_size
    ranks = np.arange(n)
    out = []
    for x in leaves:
        acc = _accumulator(x.dtype)
        xs = x.astype(acc)
        total = xs
        for shift in range(1, size_l):  # each agent collects its machine's values
            perm = [(int(r), int(r - r % size_l + (r % size_l + shift) % size_l))
                    for r in ranks]
            total = total + lax.ppermute(xs, sim.axis_name, perm)
        mean = total / size_l
        w = np.kron(sim.machine_topology.weights, np.eye(size_l))  # machine m' -> m, same l
        out.append(_finish(_mix_leaf(mean, w, sim).astype(acc), x.dtype))
    return out


# --- one program, any scale -------------------------------------------------


class Agents:
    """Runs per-agent code on this job's MPI processes, or on simulated agents.

    Under a launcher (``jaxfog run -np N``) each of the N processes is one
    agent and holds its own data. With a plain ``python`` (one process),
    ``simulated`` agents run in this process through :func:`simulate`, their
    data stacked along a leading axis. Scripts written against this class run
    unchanged both ways::

        agents = jaxfog.Agents(simulated=8)
        x = agents.data(lambda r: np.full(3, float(r)))   # rank r's value
        step = agents.map(jaxfog.neighbor_allreduce)      # jitted, per agent
        x = step(x)
        total = agents.mean(agents.map(jnp.sum)(x))       # collective: every rank calls it

    Args:
      simulated: number of agents when not launched by MPI.
      topology: a Topology, or a function of the number of agents returning
        one (default: the exponential graph). Under MPI it becomes the
        runtime's topology (``set_topology``).
      local_size: agents per simulated machine (see :func:`simulate`).
    """

    def __init__(self, simulated: int = 4, topology: Any = None, *, local_size: int = 1):
        from jaxfog import runtime

        runtime.init()
        self.simulated = runtime.size() == 1 and simulated > 1
        self.size = simulated if self.simulated else runtime.size()
        if callable(topology):
            topology = topology(self.size)
        self.topology = T.exponential(self.size) if topology is None else topology
        self.local_size = local_size
        if not self.simulated:
            runtime.set_topology(self.topology)

    @property
    def is_root(self) -> bool:
        """True in the process that should print (rank 0, or the simulation)."""
        from jaxfog import runtime

        return self.simulated or runtime.rank() == 0

    def data(self, make: Callable[[int], Any]) -> Any:
        """``make(rank)`` for this process's agent, or stacked over all agents."""
        from jaxfog import runtime

        if not self.simulated:
            return jax.tree.map(jnp.asarray, make(runtime.rank()))
        values = [make(r) for r in range(self.size)]
        return jax.tree.map(lambda *leaves: jnp.stack([jnp.asarray(v) for v in leaves]),
                            *values)

    def map(self, fn: Callable, *, in_axes: Any = 0, out_axes: Any = 0) -> Callable:
        """``fn`` jitted for one agent (MPI, with ``jaxfog.jit``) or for all
        agents (simulation)."""
        if not self.simulated:
            from jaxfog.ops.jit import jit

            return jit(fn)
        return jax.jit(simulate(fn, self.topology, local_size=self.local_size,
                                in_axes=in_axes, out_axes=out_axes))

    def mean(self, value: Any) -> Any:
        """The average over agents of a per-agent value, as numpy (same on every rank)."""
        if self.simulated:
            return np.asarray(jnp.mean(jnp.asarray(value), axis=0))
        from jaxfog.ops import allreduce

        return np.asarray(allreduce(jnp.asarray(value)))
