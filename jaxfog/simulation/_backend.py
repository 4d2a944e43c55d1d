"""The simulation backend: every op as ``lax`` collectives over the agent axis.

``jaxfog.simulate`` vmaps the per-agent function over a named axis; while it
traces, each op lowers here, with no FFI and no MPI:

* neighbor averaging: the edges of W grouped by offset ``(i - j) mod n``;
  each offset is one ``lax.ppermute`` (a cyclic shift of the agents), scaled
  by the per-agent weight column (zero where there is no edge). A circulant
  graph (ring, exponential) costs one ppermute per neighbour; under vmap each
  is a fused row gather, walked row by row, so a neighbour's row is reused
  from cache only while it is still there (on a GPU at d = 1e7 the step reads
  in-degree + 1 copies of X). ``JAXFOG_SIM_MIXING`` picks a column-tiled Pallas
  kernel instead that reads X about once (``_tiled``: by default on a GPU for
  large leaves; the gather path stays the default on CPU and is the oracle). A
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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfog import _context
from jaxfog import topology as T
from jaxfog.ops import _args, _plan
from jaxfog.ops._backends import _numerics
from jaxfog.simulation import _clock, _tiled, _windows


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


def _hierarchical_leaf(x, wm: np.ndarray, sim: _context.Simulation):
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


def _mix(leaves: list, w: np.ndarray, sim: _context.Simulation, self_weight: Any = None) -> list:
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


def _apply(leaves: list, mixing: Mixing, sim: _context.Simulation) -> list:
    if mixing.static is not None:
        _clock.synchronize(mixing.static != 0)
        return _mix(leaves, mixing.static, sim, mixing.self_weight)
    _clock.synchronize()
    return _mix_dense(leaves, mixing.self_weight, mixing.weights, sim)


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


class SimulatedHandle(NamedTuple):
    """A nonblocking op's results are its arrays: the first ``n`` (then, with
    delays, the time its last message arrives)."""

    n: int
    timed: bool


class _OnAgents:
    """A concern of the simulation backend, on the simulation being traced."""

    def __init__(self, sim: _context.Simulation):
        self.sim = sim


class SimulatedOps(_OnAgents):
    """The message ops on the agents, as ``lax`` collectives."""

    # A nonblocking op is computed at its start and held back until its wait,
    # where the agent's clock waits for its messages.
    def apply(self, op: Any, leaves: list, treedef: Any, args: Any) -> list:
        return SIMULATED[op.name](self.sim, leaves, treedef, args)

    def start(self, op: Any, leaves: list, treedef: Any, args: Any
              ) -> tuple[list, SimulatedHandle]:
        with _clock.recording_arrivals() as arrivals:
            outs = self.apply(op, leaves, treedef, args)
        outs = [True] if outs is True else list(outs)  # a get: True
        if not arrivals:
            return outs, SimulatedHandle(len(outs), False)
        return [*outs, functools.reduce(jnp.maximum, arrivals)], SimulatedHandle(len(outs), True)

    def poll(self, arrays: list, handle: SimulatedHandle) -> bool:
        return True  # the result is held in the handle

    def wait(self, arrays: list, handle: SimulatedHandle) -> list:
        if handle.timed:
            _clock.arrive(arrays[handle.n])
        return list(arrays[:handle.n])

    def barrier(self) -> None:
        """Simulated agents run in lockstep: only their clocks wait."""
        _clock.synchronize()


class SimulatedWindows(_OnAgents):
    """One-sided windows: JAX references, immediate delivery (simulation/_windows.py)."""

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


class SimulatedTrainingLoop(_OnAgents):
    """An agent's training loop (jaxfog.ops._training_loop): simulated time, traced steps."""

    def now(self) -> Any:
        return _clock.now()

    def call_step(self, step: Any, *args: Any) -> Any:
        return step.fn(*args)  # traced into the simulation

    def compile_step(self, step: Any, *args: Any) -> None:
        """Nothing: simulated time never counts compilation."""

    def settle(self) -> None:
        """Nothing: a simulated put lands at once (or after its delay)."""

    def run(self, trainer: Any, state: Any, grad_fn: Any, iterations: int, until: Any, *,
            warmup: bool, poll: float, callback: Any) -> Any:
        if callback is not None:
            raise TypeError("run: callback runs on MPI only; on simulated agents call run "
                            "in chunks of iterations")
        return _run(self.sim, trainer, state, grad_fn, iterations, until)


class SimulatedSharedValues(_OnAgents):
    """AD-PSGD's shared models: a window's published value (simulation/_windows.py)."""

    def value_create(self, leaves: list, treedef: Any, name: str, peers: np.ndarray) -> None:
        args = _args.win_create(name=name, zero_init=False, with_weight=False, src_ranks=None)
        _windows.win_create(self.sim, leaves, treedef, args)

    def value_read(self, name: str) -> Any:
        return _windows.read_value(name)

    def value_add(self, name: str, x: Any) -> None:
        _windows.add_to_value(name, x)

    def value_pair_average(self, name: str, peer: Any) -> None:
        _windows.pair_average(name, peer)

    def value_compile(self, name: str) -> None:
        """Nothing to compile."""


# --- the message ops' rules ---------------------------------------------------


def _neighbor_allreduce(sim: _context.Simulation, leaves: list, args: Any) -> list:
    graph = args.graph
    if isinstance(graph, T.Schedule):
        if isinstance(args.step, int):
            _clock.synchronize(graph.at(args.step).weights != 0)
            return _mix(leaves, graph.at(args.step).weights, sim)
        _clock.synchronize(np.any([t.weights != 0 for t in graph], axis=0))
        branches = [functools.partial(_mix, w=t.weights, sim=sim) for t in graph]
        return lax.switch(args.step.astype(jnp.int32) % graph.period, branches, leaves)
    # Every agent's plan is a row of one W, so senders and receivers always
    # match: check_topology has nothing to check here.
    if args.local_view is None:
        return _apply(leaves, Mixing(graph.weights, None, None), sim)
    return _apply(leaves, local_view_mixing(graph, args.local_view, args.what, sim.rank),
                  sim)


def _pair_gossip(sim: _context.Simulation, leaves: list, args: Any) -> list:
    """Every agent reads its peer's value (a gather: the peers may be
    traced); a pair that does not name each other gets NaN."""
    _clock.synchronize()
    peer = jnp.asarray(args.peer, jnp.int32)
    peers = sim.all_gather(peer)
    paired = (peer >= 0) & (peer < sim.size) & (peers[jnp.clip(peer, 0, sim.size - 1)]
                                                == sim.rank)
    outs = []
    for x in leaves:
        with _numerics.accumulating(x.dtype) as acc:
            theirs = sim.all_gather(x)[jnp.clip(peer, 0, sim.size - 1)]
            mean = _numerics.finish((x.astype(acc) + theirs.astype(acc)) / 2, x.dtype)
        bad = jnp.asarray(jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0, x.dtype)
        outs.append(jnp.where(paired, mean, bad))
    return outs


def _hierarchical_neighbor_allreduce(sim: _context.Simulation, leaves: list,
                                     args: Any) -> list:
    """Machine means (ppermutes inside each machine), then the machine
    topology applied between machines (ppermutes by whole machines)."""
    wm = sim.machine_topology.weights
    if args.local_view is not None:
        mixing = local_view_mixing(sim.machine_topology, args.local_view, args.what,
                                   sim.machine_rank,
                                   ("src_machine_weights", "dst_machine_weights"))
        if mixing.static is None or mixing.self_weight is not None:
            raise TypeError(f"{args.what}: in jaxfog.simulate the machine weights must "
                            "be concrete (numbers, dicts, lists or rank-indexed arrays "
                            "over machines), not traced values")
        wm = mixing.static
    _clock.synchronize()
    outs = []
    for x in leaves:
        if _tiled.wanted(x, sim, None):
            size_l = sim.local_size
            outs.append(_tiled.mix_leaf(
                x, sim, _tiled.machine_table(wm, size_l),
                _tiled.machine_table(wm.T, size_l),
                functools.partial(_hierarchical_leaf, wm=wm, sim=sim),
                functools.partial(_hierarchical_leaf, wm=wm.T, sim=sim)))
        else:
            outs.append(_hierarchical_leaf(x, wm, sim))
    return outs


def _neighbor_allgather(sim: _context.Simulation, leaves: list, args: Any) -> list:
    table = _source_table(sim, args.src_ranks)
    receives = np.zeros((sim.size,) * 2, bool)
    receives[np.arange(sim.size)[:, None], table] = True
    _clock.synchronize(receives)
    mine = jnp.asarray(table)[sim.rank]
    return [_stack_blocks(jnp.take(sim.all_gather(x), mine, axis=0))
            for x in leaves]


def _allreduce(sim: _context.Simulation, leaves: list, args: Any) -> list:
    _clock.synchronize()
    outs = []
    for x in leaves:
        if not args.mean and jnp.issubdtype(x.dtype, jnp.integer):
            outs.append(sim.psum(x))  # exact, as MPI's integer sum
            continue
        with _numerics.accumulating(x.dtype) as acc:
            total = sim.psum(x.astype(acc))
            outs.append(_numerics.finish(total / sim.size if args.mean else total, x.dtype))
    return outs


def _broadcast(sim: _context.Simulation, leaves: list, args: Any) -> list:
    _clock.synchronize()
    is_root = sim.rank == args.root
    # psum widens bool and small integers; the root's value keeps its dtype.
    return [sim.psum(jnp.where(is_root, x, jnp.zeros_like(x)))
            .astype(x.dtype) for x in leaves]


def _allgather(sim: _context.Simulation, leaves: list, args: Any) -> list:
    _clock.synchronize()
    return [_stack_blocks(sim.all_gather(x)) for x in leaves]


def _message(rule: Callable[[_context.Simulation, list, Any], list]) -> Callable[..., list]:
    """A message op's rule as the table holds it (its treedef unused)."""
    return lambda sim, leaves, treedef, args: rule(sim, leaves, args)


#: Each op's rule on the agents, by ``Op.name`` (``jaxfog.ops._backends.Op``):
#: ``SIMULATED[name](sim, leaves, treedef, args)`` gives the result leaves; a
#: nonblocking start computes it at once, held back until the wait. The MPI
#: rules are the ``Op``'s own, in the op's module.
SIMULATED: dict[str, Callable[..., Any]] = {
    "neighbor_allreduce": _message(_neighbor_allreduce),
    "pair_gossip": _message(_pair_gossip),
    "hierarchical_neighbor_allreduce": _message(_hierarchical_neighbor_allreduce),
    "neighbor_allgather": _message(_neighbor_allgather),
    "allreduce": _message(_allreduce),
    "broadcast": _message(_broadcast),
    "allgather": _message(_allgather),
    "win_put": _windows.win_put,
    "win_get": lambda sim, leaves, treedef, args: _windows.win_get(sim, args),
}


class SimulatedBackend(SimulatedOps, SimulatedWindows, SimulatedTrainingLoop,
                       SimulatedSharedValues):
    """Ops on the agents of the simulation being traced: the four concerns of
    ``jaxfog.ops._backends.Backend``."""


def _run(sim: _context.Simulation, trainer: Any, state: Any, grad_fn: Any, iterations: int,
         until: Any) -> Any:
    """Ticks of a ``while_loop``: with delays, the ready agents whose steps end
    first (an asynchronous trainer) or every agent with its compute time
    charged (a synchronous one); without, every ready agent each tick."""
    timed = _clock.timing() is not None
    event_driven = timed and trainer.asynchronous

    def tick(carry):
        state, _ = carry
        todo = (state.iteration < iterations) & (_clock.now() < until)
        ready = todo & trainer.ready(state)
        if event_driven:
            # The next event: the first step to end, or a message reaching an
            # agent that waits (it may make it ready).
            ends = jnp.where(ready, _clock.now() + _clock.compute_time(state.iteration),
                             jnp.inf)
            wakes = jnp.where(todo & ~ready, _windows.next_arrival(), jnp.inf)
            t = sim.pmin(jnp.minimum(ends, wakes)).astype(jnp.result_type(float))
            go = ready & (ends == t)
            # The stepping agents' steps end now; the waiting ones waited until now.
            _clock.set_now(jnp.where(go | (todo & ~ready), jnp.maximum(_clock.now(), t),
                                     _clock.now()))
        else:
            go = ready
            t = jnp.where(sim.pmax(ready), 0.0, jnp.inf)
            with _clock.stepping(go):
                _clock.set_now(_clock.now() + _clock.compute_time(state.iteration))
        with _clock.stepping(go):
            new = trainer.step(state, grad_fn)
        state = jax.tree.map(lambda old, new: jnp.where(go, new, old), state, new)
        return state, t

    def body(carry):
        # The windows and the clock travel in the carry: a while_loop body may
        # not update the references outside it.
        state, t, windows, clock = carry
        with _windows.local_refs(windows) as read_windows, \
                _clock.local_ref(clock) as read_clock:
            state, t = tick((state, t))
            return state, t, read_windows(), read_clock()

    def more(carry):
        state, t = carry[:2]
        return sim.pmax(state.iteration < iterations) & (t < jnp.inf)  # t: last tick

    session = _clock.current()
    assert session is not None  # an agent is being traced (its clock bound)
    clock = None if session.now is None else session.now[...]
    state, _, windows, clock = lax.while_loop(more, body, (
        state, jnp.zeros([], jnp.result_type(float)), _windows.values(), clock))
    _windows.store(windows)
    if clock is not None:
        session.now[...] = clock
    return state
