r"""Asynchronous decentralized training: one interface, synchronous or not.

A *trainer* owns a training loop's state and runs one iteration of one
agent at a time::

    trainer = jaxfog.asynchrony.adpsgd(optax.sgd(0.1))   # or hop(...), push_sum(...),
    state = trainer.init(params)                          # or from_optax(jaxfog.optax.atc(...))
    for _ in range(steps):
        state = trainer.step(state, grad_fn)              # grad_fn(params, iteration)
    params = trainer.params(state)

Switching between synchronous and asynchronous training is the one line
that makes the trainer. ``grad_fn(params, iteration)`` returns the local
gradient at ``params``; ``iteration`` is the agent's own iteration count (an
int32 scalar), from which it draws its batch, so that agents at different
iterations draw different batches.

The trainers:

* :func:`from_optax`: any (synchronous) jaxfog.optax transformation, e.g.
  ``atc``, ``gradient_allreduce`` or the asynchronous ``async_push_sum``.
* :func:`push_sum`: asynchronous push-sum / SGP (BlueFog's asynchronous
  push-sum; Assran et al.), i.e. ``from_optax(jaxfog.optax.async_push_sum(inner))``.
* :func:`adpsgd`: AD-PSGD (Lian et al. 2018): after each local step an agent
  averages its model with one random neighbour atomically,
  :math:`x_i = x_j = (x_i + x_j) / 2`.
* :func:`hop`: Hop (Luo et al. 2019): bounded staleness (an agent is never
  more than ``staleness`` iterations ahead of an in-neighbour), backup
  workers (combine once all but ``backups`` in-neighbours have sent this
  iteration's model, drop the late ones) and skipping iterations (a lagging
  agent jumps its counter to its neighbours').

Every trainer runs on MPI processes (``jaxfog run``) and on simulated agents
(:func:`jaxfog.simulate`). ``trainer.ready(state)`` says whether an agent may
start its next iteration (always for all but Hop); :func:`run` is the loop
that waits for it, the same code on both. On simulated agents without delays
the ready agents step together (each tick); with
``simulate(..., delays=jaxfog.Delays(...))`` they run in simulated time: the
agents whose steps end first go first, puts arrive after their delay, Hop's
waits last until the message that lifts them, and :func:`now` is an agent's
clock. Equal speeds and no message delays reproduce the synchronous
iterates; a seed fixes a run.

References:
  Lian, Zhang, Zhang, Liu. *Asynchronous Decentralized Parallel Stochastic
  Gradient Descent*. ICML, 2018.

  Luo, Lin, Zhuo, Qian. *Hop: Heterogeneity-Aware Decentralized Training*.
  ASPLOS, 2019.

  Assran, Loizou, Ballas, Rabbat. *Stochastic Gradient Push for Distributed
  Deep Learning*. ICML, 2019.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxfog import _context, runtime
from jaxfog import _validate as V
from jaxfog.errors import JaxfogTimeoutError
from jaxfog import topology as T
from jaxfog import optax as jf_optax
from jaxfog.ops import _args, backends, barrier
from jaxfog.ops.backends import simulated_clock as sc
from jaxfog.ops.backends import simulated_windows as sw
from jaxfog.ops import window as W
from jaxfog.ops.jit import jit

Tree = Any
GradFn = Callable[[Tree, jax.Array], Tree]


class Trainer(NamedTuple):
    """One agent's training loop, synchronous or asynchronous."""

    #: ``init(params) -> state``; collective (it may create windows).
    init: Callable[[Tree], Any]
    #: ``step(state, grad_fn) -> state``: one iteration of this agent.
    step: Callable[[Any, GradFn], Any]
    #: ``params(state) -> params``: the agent's current model.
    params: Callable[[Any], Tree]
    #: ``ready(state) -> bool``: may the agent start its next iteration now
    #: (Hop's bounds); always True for the others.
    ready: Callable[[Any], Any]
    #: ``free()``: releases the windows; collective.
    free: Callable[[], None]
    #: Whether agents step independently (in simulated time, the agents
    #: whose steps end first go first); a synchronous trainer's agents step
    #: together and its ops wait for the neighbours.
    asynchronous: bool = False
    #: ``compile(state, grad_fn)``: compiles what ``step`` runs on MPI
    #: without running it (:func:`run`'s warm-up); nothing on simulated agents.
    compile: Callable[[Any, GradFn], None] = lambda state, grad_fn: None
    #: ``finish(state) -> state``: collective, after the last step on every
    #: agent: delivers what is still in flight (push-sum's mass in the
    #: windows), so that ``params(state)`` is final; the state as it is for a
    #: trainer that keeps nothing in flight.
    finish: Callable[[Any], Any] = lambda state: state


def _always(state: Any) -> bool:
    return True


def _nothing() -> None:
    return None


def _settle(state: Any) -> Any:
    """The finish of a trainer whose writes complete before its step returns:
    a barrier, after which no agent's model changes."""
    barrier()
    return state


def _simulated() -> bool:
    return _context.current() is not None


# -- synchronous (and async push-sum): an optax transformation ----------------------------


class OptaxState(NamedTuple):
    """State of :func:`from_optax`."""

    params: Tree
    opt_state: optax.OptState
    #: This agent's iterations so far (int32).
    iteration: jax.Array


def from_optax(optimizer: optax.GradientTransformation, *,
               free: Callable[[], None] = _nothing, asynchronous: bool = False,
               finish: Callable[[Any], Any] = lambda state: state) -> Trainer:
    """A trainer of one optax transformation: ``g = grad_fn(x, k)``,
    ``x += update(g)``. Synchronous for jaxfog's neighbour and collective
    ops; pass ``asynchronous=True`` for window-based ones that never wait
    (``async_push_sum``). Warns (:func:`jaxfog.optax.check_chain`) when a
    mixing transformation is followed by others in a chain."""
    jf_optax.check_chain(optimizer)

    def init(params):
        return OptaxState(params, optimizer.init(params), jnp.zeros([], jnp.int32))

    def local(state, grad_fn):
        grads = grad_fn(state.params, state.iteration)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return OptaxState(optax.apply_updates(state.params, updates), opt_state,
                          state.iteration + 1)

    compiled = jit(local, static_argnums=1)

    def step(state, grad_fn):
        return local(state, grad_fn) if _simulated() else compiled(state, grad_fn)

    def compile_step(state, grad_fn):
        if not _simulated():
            compiled.lower(state, grad_fn).compile()

    return Trainer(init, step, lambda state: state.params, _always, free, asynchronous,
                   compile_step, finish)


def push_sum(inner: optax.GradientTransformation, *, name: str = "jaxfog.push_sum",
             topology: T.Topology | None = None) -> Trainer:
    """Asynchronous push-sum / SGP: ``from_optax(jaxfog.optax.async_push_sum(...))``.

    ``finish(state)`` (collective, after every agent's last step) collects the
    mass still in flight: then each agent's numerator and weight hold all of
    it (their sums over the agents are the exact totals, ``allreduce`` gives
    the exact average) and ``params`` is ``numerator / weight``."""

    def finish(state):
        barrier()  # every push has landed
        opt = state.opt_state
        x, p = W.win_update_then_collect((opt.numerator, opt.weight), name)
        z = jax.tree.map(lambda v, w: (v / p.astype(v.dtype)).astype(jnp.result_type(w)), x,
                         state.params)
        return state._replace(params=z, opt_state=opt._replace(numerator=x, weight=p))

    return from_optax(jf_optax.async_push_sum(inner, name=name, topology=topology),
                      free=lambda: W.win_free(name), asynchronous=True, finish=finish)


# -- shared helpers -------------------------------------------------------------------------


def _graph(topology: T.Topology | None, what: str) -> T.Topology:
    graph = runtime.load_topology() if topology is None else topology
    if not isinstance(graph, T.Topology):
        raise TypeError(f"{what}: needs a static Topology (got {type(graph).__name__}); "
                        "a window's slots are fixed when it is created")
    return graph


def _mix32(x, u32=np.uint32):
    """A 32-bit integer hash (the same in numpy and jax.numpy, ``u32`` the
    matching uint32 type; wraps on overflow)."""
    x = x ^ (x >> u32(16))
    x = x * u32(0x7FEB352D)
    x = x ^ (x >> u32(15))
    x = x * u32(0x846CA68B)
    return x ^ (x >> u32(16))


def pick(seed: int, rank: Any, iteration: Any, count: Any) -> Any:
    """A neighbour index in ``[0, count)``, a hash of (seed, rank, iteration):
    the same on MPI (numpy) and in the simulation (traced), so the runs agree."""
    if isinstance(rank, (int, np.integer)) and isinstance(iteration, (int, np.integer)):
        with np.errstate(over="ignore"):
            x = np.uint32(seed) * np.uint32(0x9E3779B1) ^ _mix32(
                np.uint32(rank) * np.uint32(0x85EBCA77) ^ _mix32(np.uint32(iteration)))
            return int(_mix32(np.uint32(x)) % np.uint32(count))
    u32 = jnp.uint32
    x = u32(seed) * u32(0x9E3779B1) ^ _mix32(
        jnp.asarray(rank).astype(u32) * u32(0x85EBCA77) ^ _mix32(
            jnp.asarray(iteration).astype(u32), u32), u32)
    return (_mix32(x, u32) % jnp.asarray(count).astype(u32)).astype(jnp.int32)


def _neighbors(graph: T.Topology) -> tuple[np.ndarray, np.ndarray]:
    """(table, count): row i lists i's neighbours (in or out, padded), count[i] of them."""
    n = graph.size
    linked = ((graph.weights != 0) | (graph.weights.T != 0)) & ~np.eye(n, dtype=bool)
    count = linked.sum(axis=1)
    if (count == 0).any():
        raise ValueError(f"the topology leaves ranks {list(np.flatnonzero(count == 0))} "
                         "without a neighbour")
    table = np.zeros((n, count.max()), np.int32)
    for i in range(n):
        table[i, :count[i]] = np.flatnonzero(linked[i])
    return table, count


def _zeros(template: Tree) -> Tree:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)


def _accumulate_values(x: Tree, name: str, dst: dict[int, float], require_mutex: bool) -> None:
    """Adds ``w * x`` onto each destination's published value (MPI; internal)."""
    args = _args.WinPut(name, None, _peers(dst), require_mutex, True, "adpsgd",
                        into_values=True)
    leaves, treedef = _args.leaves(args.what, x)
    backends.current().win_put(leaves, treedef, args)


def _peers(weights: dict[int, float]) -> _args.Peers:
    mask, row = np.zeros(runtime.size(), bool), np.zeros(runtime.size())
    for j, w in weights.items():
        mask[j], row[j] = True, w
    return _args.Peers(mask, row)


def _get_own(name: str, weights: dict[int, float]) -> None:
    """``win_get`` that may name this rank itself (MPI; its own slot)."""
    backends.current().win_get(_args.WinGet(name, _peers(weights), False, "adpsgd"))


def _combine(x: Tree, name: str, self_weight: float, weights: dict[int, float]) -> Tree:
    """``win_update`` that may read this rank's own slot (MPI)."""
    leaves, treedef = _args.leaves("adpsgd", x)
    args = _args.WinUpdate(name, self_weight, _peers(weights), False, False, False, "adpsgd")
    return jax.tree.unflatten(treedef, backends.current().win_update(leaves, treedef, args))


def _create(params: Tree, name: str, src_ranks: Any = None, *, self_slot: bool = False,
            zero_init: bool = False) -> None:
    args = _args.win_create(name=name, zero_init=zero_init, with_weight=False,
                            src_ranks=src_ranks)
    leaves, treedef = _args.leaves(args.what, params)
    backends.current().win_create(leaves, treedef, args._replace(self_slot=self_slot))


class ADPSGDState(NamedTuple):
    """State of :func:`adpsgd` (the model itself lives in the window)."""

    opt_state: optax.OptState
    #: This agent's iterations so far (int32).
    iteration: jax.Array


def adpsgd(inner: optax.GradientTransformation, *, name: str = "jaxfog.adpsgd",
           topology: T.Topology | None = None, seed: int = 0) -> Trainer:
    r"""AD-PSGD: local steps and atomic pairwise averages with a random neighbour.

    One iteration of agent :math:`i` (Lian et al. 2018, Algorithm 1):

    .. math::

        \hat x = x_i, \qquad u = \mathrm{inner}(g(\hat x)), \qquad
        x_i = x_j = \tfrac12 (x_i + x_j), \qquad x_i \mathrel{+}= u,

    with :math:`j` a neighbour (in or out) drawn from (seed, rank,
    iteration) by :func:`pick`. Each agent's model is the published value of
    its window ``name``; a neighbour may change it at any time. The
    pairwise average holds both agents' window mutexes (taken in rank order,
    so agents averaging over overlapping pairs never deadlock), so it is
    atomic and conserves :math:`x_i + x_j`; the gradient, computed at the
    model read before, is added after, as in the paper. Any agent may start
    an average (the mutex replaces the paper's active/passive split).

    On MPI each iteration is four short jitted calls (read, local step,
    average, add). In the simulation the averages of the agents that step
    together are applied one after another in rank order.
    """

    state_template: dict[str, Any] = {}
    compiled: dict[Any, Any] = {}

    def init(params):
        graph = _graph(topology, "adpsgd")
        table, count = _neighbors(graph)
        state_template.update(graph=graph, table=table, count=count, shape=jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)), params))
        if _simulated():
            W.win_create(params, name)
        else:
            r = runtime.rank()
            _create(params, name, [*table[r, :count[r]], r], self_slot=True)
        return ADPSGDState(inner.init(params), jnp.zeros([], jnp.int32))

    def peer(iteration):
        table, count = state_template["table"], state_template["count"]
        r = runtime.rank()
        return jf_optax._rank_row(table)[pick(seed, r, iteration, jf_optax._rank_row(count))]

    def read_mpi():
        r = runtime.rank()
        _get_own(name, {r: 1.0})
        return _combine(_zeros(state_template["shape"]), name, 0.0, {r: 1.0})

    def average_mpi(j):
        r = runtime.rank()
        _get_own(name, {r: 1.0, j: 1.0})
        mine = _combine(_zeros(state_template["shape"]), name, 0.0, {r: 1.0})
        mean = _combine(mine, name, 0.5, {j: 0.5})
        _accumulate_values(jax.tree.map(jnp.subtract, mine, mean), name, {j: 1.0}, False)
        return mean

    def local(x, opt_state, iteration, grad_fn):
        grads = grad_fn(x, iteration)
        return (*inner.update(grads, opt_state, x), iteration + 1)

    def step(state, grad_fn):
        if _simulated():
            x = sw.read_value(name)
            u, opt_state, iteration = local(x, state.opt_state, state.iteration, grad_fn)
            sw.pair_average(name, peer(state.iteration))
            sw.add_to_value(name, u)
            return ADPSGDState(opt_state, iteration)
        jitted()
        r = runtime.rank()
        it = int(state.iteration)
        with W.win_mutex(name, [r]):
            x = compiled["read"]()
        u, opt_state, iteration = compiled["local"](x, state.opt_state, state.iteration,
                                                    grad_fn)
        j = int(peer(it))
        with W.win_mutex(name, [r, j]):
            compiled["average"](j)
        compiled["add"](u)
        return ADPSGDState(opt_state, iteration)

    def jitted():
        if "local" not in compiled:
            compiled.update(read=jit(read_mpi), average=jit(average_mpi, static_argnums=0),
                            add=jit(lambda u: _accumulate_values(
                                u, name, {runtime.rank(): 1.0}, True)),
                            local=jit(local, static_argnums=3))
        return compiled

    def params(state):
        if _simulated():
            return sw.read_value(name)
        with W.win_mutex(name, [runtime.rank()]):
            return jitted()["read"]()

    def compile_step(state, grad_fn):
        if _simulated():
            return
        pieces, r = jitted(), runtime.rank()
        x = _zeros(state_template["shape"])
        pieces["read"].lower().compile()
        pieces["local"].lower(x, state.opt_state, state.iteration, grad_fn).compile()
        pieces["add"].lower(x).compile()
        for j in state_template["table"][r, :state_template["count"][r]]:  # every peer
            pieces["average"].lower(int(j)).compile()
        with W.win_mutex(name, [r]):  # and the mutex's own small computations
            pass

    def free():
        compiled.clear()
        W.win_free(name)

    return Trainer(init, step, params, _always, free, True, compile_step, _settle)


class HopState(NamedTuple):
    """State of :func:`hop`."""

    #: The combined model the last local step started from.
    params: Tree
    #: The model after the last local step (what this agent sent).
    sent: Tree
    opt_state: optax.OptState
    #: This agent's iteration counter (int32; skipping moves it forward).
    iteration: jax.Array
    #: The in-neighbours' counters the last step saw (n entries, 0 elsewhere).
    seen: jax.Array


def hop(inner: optax.GradientTransformation, *, staleness: int | None = 2, backups: int = 0,
        skip: bool = True, name: str = "jaxfog.hop",
        topology: T.Topology | None = None) -> Trainer:
    r"""Hop: decentralized training with bounded staleness, backup workers and skips.

    Agent :math:`i` at iteration :math:`k` with model :math:`y_i` (Luo et al.
    2019): it may start once (``ready``)

    * every in-neighbour has reached iteration :math:`k - s` (``staleness``
      :math:`s`; ``None``: no bound), and
    * at least :math:`d_i - b` of its :math:`d_i` in-neighbours have sent
      iteration :math:`k`'s model (``backups`` :math:`b`);

    then it combines the fresh ones, :math:`F` (counter at least :math:`k`),
    with the topology's weights renormalised over :math:`F \cup \{i\}`,
    dropping the late ones, takes a local step and sends the result:

    .. math::

        x = \frac{W_{ii} y_i + \sum_{j \in F} W_{ij} y_j}{W_{ii} + \sum_{j \in F} W_{ij}},
        \qquad y_i = x + \mathrm{inner}(g(x)),
        \qquad k \leftarrow \max(k + 1, \max_j k_j) \text{ (skip) or } k + 1.

    With ``skip`` a lagging agent jumps to the newest iteration among its
    in-neighbours, so that it does not hold them at the staleness bound.
    Models travel by ``win_put`` into window ``name + ".x"``, iteration
    counters in window ``name + ".k"`` (one entry per rank, so one
    ``win_update`` reads all of them). With :math:`s = 0`, :math:`b = 0`
    and no skipping it is synchronous diffusion (ATC).
    """
    if staleness is not None:
        staleness = V.integer("jaxfog.asynchrony.hop", "staleness", staleness, minimum=0)
    backups = V.integer("jaxfog.asynchrony.hop", "backups", backups, minimum=0)
    models, counters = name + ".x", name + ".k"
    held: dict[str, Any] = {}
    compiled: dict[Any, Any] = {}

    def init(params):
        graph = _graph(topology, "hop")
        n = graph.size
        ins = (graph.weights != 0) & ~np.eye(n, dtype=bool)
        if (backups >= ins.sum(axis=1)).any():
            raise ValueError(f"hop: backups={backups} must be below every rank's in-degree "
                             f"(smallest {ins.sum(axis=1).min()})")
        held.update(graph=graph, ins=ins, n=n)
        W.win_create(params, models)
        W.win_create(jnp.zeros(n, jnp.int32), counters, zero_init=True)
        # The neighbours' slots start with this agent's own model: send it once.
        W.win_put(params, models)
        if not _simulated():
            barrier()
        return HopState(params, params, inner.init(params), jnp.zeros([], jnp.int32),
                        jnp.zeros(held["n"], jnp.int32))

    def read_counters():
        return W.win_update(jnp.zeros(held["n"], jnp.int32), counters, self_weight=0.0,
                            src_weights=jf_optax._rank_row(held["ins"].astype(np.float64)))

    def admissible(seen, k):
        ins = jf_optax._rank_row(held["ins"])
        fresh = ins & (seen >= k)
        ok = jnp.sum(fresh) >= jnp.sum(ins) - backups
        if staleness is not None:
            ok = ok & jnp.all(jnp.where(ins, seen >= k - staleness, True))
        return ok, fresh

    def ready(state):
        if _simulated():
            return admissible(read_counters(), state.iteration)[0]
        return bool(jitted()["ready"](state.iteration))

    def weights(fresh):
        w = held["graph"].weights
        self_w = jf_optax._rank_row(np.diag(w).copy())
        row = jnp.where(fresh, jf_optax._rank_row(w * ~np.eye(held["n"], dtype=bool)), 0.0)
        total = self_w + row.sum()
        return self_w / total, row / total

    def combine(sent, fresh):
        """The fresh in-neighbours' models mixed with this agent's."""
        self_w, row = weights(fresh)
        if _simulated():  # one update with traced weights
            return W.win_update(sent, models, self_weight=self_w, src_weights=row)
        # MPI weights are static: read each in-neighbour's slot alone (one
        # compiled step for every set of fresh neighbours) and mix here.
        x = jax.tree.map(lambda v: v * self_w.astype(v.dtype), sent)
        for j in np.flatnonzero(held["ins"][runtime.rank()]):
            y = W.win_update(_zeros(sent), models, self_weight=0.0, src_weights={int(j): 1.0})
            x = jax.tree.map(lambda a, b: a + b * row[j].astype(b.dtype), x, y)
        return x

    def local(state, grad_fn):
        seen = read_counters()
        x = combine(state.sent, admissible(seen, state.iteration)[1])
        grads = grad_fn(x, state.iteration)
        u, opt_state = inner.update(grads, state.opt_state, x)
        y = optax.apply_updates(x, u)
        k = state.iteration + 1
        if skip:
            newest = jnp.max(jnp.where(jf_optax._rank_row(held["ins"]), seen, 0))
            k = jnp.maximum(k, newest.astype(k.dtype))
        W.win_put(y, models)
        W.win_put(jnp.zeros(held["n"], jnp.int32).at[runtime.rank()].set(k), counters)
        return HopState(x, y, opt_state, k, seen.astype(jnp.int32))

    def jitted():
        if "local" not in compiled:
            compiled.update(ready=jit(lambda k: admissible(read_counters(), k)[0]),
                            local=jit(local, static_argnums=1))
        return compiled

    def step(state, grad_fn):
        if _simulated():
            return local(state, grad_fn)
        return jitted()["local"](state, grad_fn)

    def compile_step(state, grad_fn):
        if not _simulated():
            jitted()["ready"].lower(state.iteration).compile()
            jitted()["local"].lower(state, grad_fn).compile()

    def free():
        compiled.clear()
        W.win_free(models)
        W.win_free(counters)

    return Trainer(init, step, lambda state: state.params, ready, free, True, compile_step,
                   _settle)


def now() -> Any:
    """Seconds on this agent's clock: its simulated time under
    ``simulate(delays=...)`` (0 without delays), ``time.perf_counter()`` on MPI."""
    return sc.now() if _simulated() else time.perf_counter()


def run(trainer: Trainer, state: Any, grad_fn: GradFn, iterations: int, *,
        until: float | None = None, warmup: bool = True, poll: float = 1e-4,
        callback: Callable[[Any], None] | None = None) -> Any:
    """This agent's iterations until its counter reaches ``iterations`` (Hop's
    skips move it forward), or, for an asynchronous trainer, until its clock
    (:func:`now`) reaches ``until``: it starts no step after that. On MPI the
    clock is ``time.perf_counter()``, so a budget of ``b`` seconds is
    ``until=jfa.now() + b``, taken after ``init``.

    ``grad_fn(params, iteration)`` is traced into the compiled step once:
    host work inside it (a ``time.sleep``, a print) happens at trace time
    only. Emulate compute time with ``callback`` (MPI) or
    ``simulate(..., delays=...)``.

    With ``warmup`` (the default) every compiled piece of the step is
    compiled on MPI before the first step, so compilation does not eat into
    ``until`` (the first execution of each piece still costs some tens of
    milliseconds); simulated time never counts compilation.

    On MPI it waits for ``trainer.ready`` before each step, polling every
    ``poll`` seconds, and raises ``TimeoutError`` after ``JAXFOG_TIMEOUT`` (a
    neighbour stopped); ``callback(state)`` after each step.

    On simulated agents it is a loop of ticks (jit it): with
    ``simulate(delays=...)``, each tick runs the ready agents whose steps end
    first, at that moment of simulated time (an asynchronous trainer), or
    every agent with its compute time charged (a synchronous one, whose ops
    wait for the neighbours); without delays, every ready agent steps each
    tick. It ends when every agent is done, or when none can go on (a
    deadlock, e.g. Hop with a stopped neighbour: the counters say so).
    """
    if until is not None and not trainer.asynchronous:
        raise ValueError("run: until= needs an asynchronous trainer (the agents of a "
                         "synchronous one must run the same number of steps)")
    until = np.inf if until is None else until  # traced on simulated agents, or not
    if _simulated():
        if callback is not None:
            raise TypeError("run: callback runs on MPI only; on simulated agents call run "
                            "in chunks of iterations")
        return _run_simulated(trainer, state, grad_fn, iterations, until)
    limit, until = runtime.timeout(), float(until)
    if warmup:
        trainer.compile(state, grad_fn)
    while int(state.iteration) < iterations and now() < until:
        start = time.monotonic()
        while not trainer.ready(state):
            if now() >= until:
                return state
            if limit and time.monotonic() - start > limit:
                raise JaxfogTimeoutError(f"rank {runtime.rank()}: not ready for iteration "
                                   f"{int(state.iteration)} after {limit:.0f} s "
                                   "(JAXFOG_TIMEOUT): a neighbour stopped")
            time.sleep(poll)
        state = trainer.step(state, grad_fn)
        if callback is not None:
            callback(state)
    return state


def _run_simulated(trainer: Trainer, state: Any, grad_fn: GradFn, iterations: int,
                   until: float) -> Any:
    axis = _context.current().axis_name
    timed = sc.timing() is not None
    event_driven = timed and trainer.asynchronous

    def tick(carry):
        state, _ = carry
        todo = (state.iteration < iterations) & (sc.now() < until)
        ready = todo & trainer.ready(state)
        if event_driven:
            # The next event: the first step to end, or a message reaching an
            # agent that waits (it may make it ready).
            ends = jnp.where(ready, sc.now() + sc.compute_time(state.iteration), jnp.inf)
            wakes = jnp.where(todo & ~ready, sw.next_arrival(), jnp.inf)
            t = lax.pmin(jnp.minimum(ends, wakes), axis).astype(jnp.result_type(float))
            go = ready & (ends == t)
            # The stepping agents' steps end now; the waiting ones waited until now.
            sc.set_now(jnp.where(go | (todo & ~ready), jnp.maximum(sc.now(), t), sc.now()))
        else:
            go = ready
            t = jnp.where(lax.pmax(ready, axis), 0.0, jnp.inf)
            with sc.stepping(go):
                sc.set_now(sc.now() + sc.compute_time(state.iteration))
        with sc.stepping(go):
            new = trainer.step(state, grad_fn)
        state = jax.tree.map(lambda old, new: jnp.where(go, new, old), state, new)
        return state, t

    def body(carry):
        # The windows and the clock travel in the carry: a while_loop body may
        # not update the references outside it.
        state, t, windows, clock = carry
        with sw.local_refs(windows) as read_windows, sc.local_ref(clock) as read_clock:
            state, t = tick((state, t))
            return state, t, read_windows(), read_clock()

    def more(carry):
        state, t = carry[:2]
        return lax.pmax(state.iteration < iterations, axis) & (t < jnp.inf)  # t: last tick

    session = sc.current()
    clock = None if session.now is None else session.now[...]
    state, _, windows, clock = lax.while_loop(more, body, (
        state, jnp.zeros([], jnp.result_type(float)), sw.values(), clock))
    sw.store(windows)
    if clock is not None:
        session.now[...] = clock
    return state


__all__ = ["ADPSGDState", "HopState", "OptaxState", "Trainer", "adpsgd", "from_optax", "hop",
           "now", "pick", "push_sum", "run"]
