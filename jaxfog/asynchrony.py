r"""Asynchronous decentralized training: one interface, synchronous or not.

A *trainer* owns a training loop's state and runs one iteration of one
agent at a time::

    trainer = jaxfog.asynchrony.adpsgd(optax.sgd(0.1))   # or hop(...), async_push_sum(...),
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
* :func:`async_push_sum`: asynchronous push-sum / SGP (BlueFog's
  asynchronous push-sum; Assran et al.), i.e.
  ``from_optax(jaxfog.optax.async_push_sum(inner))``. Its old name here,
  ``push_sum``, still works and warns: it reads as
  :func:`jaxfog.optax.push_sum`, the synchronous algorithm.
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

import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfog import _validate as V
from jaxfog import optax as jf_optax
from jaxfog import runtime
from jaxfog import topology as T
from jaxfog.ops import _training_loop, barrier
from jaxfog.ops import window as W

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
    #: ``free()``: releases the windows; collective (what it returns is unused).
    free: Callable[[], object]
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


# -- synchronous (and async push-sum): an optax transformation ----------------------------


class OptaxState(NamedTuple):
    """State of :func:`from_optax`."""

    params: Tree
    opt_state: optax.OptState
    #: This agent's iterations so far (int32).
    iteration: jax.Array


def from_optax(optimizer: optax.GradientTransformation, *,
               free: Callable[[], object] = _nothing, asynchronous: bool = False,
               finish: Callable[[Any], Any] | None = None) -> Trainer:
    """A trainer of one optax transformation: ``g = grad_fn(x, k)``,
    ``x += update(g)``. Synchronous for jaxfog's neighbour and collective
    ops; pass ``asynchronous=True`` for window-based ones that never wait
    (``async_push_sum``). Warns (:func:`jaxfog.optax.check_chain`) when a
    mixing transformation is followed by others in a chain. The trainer's
    ``finish`` is ``finish`` when given; else, for an optimizer with a
    ``finish(opt_state, params)`` method (``atc``/``awc`` with ``delay=``,
    ``streaming_diloco``: exchanges kept in flight), ``x += finish``'s updates;
    else the state as it is."""
    what = "jaxfog.asynchrony.from_optax"
    V.transformation(what, "optimizer", optimizer)
    V.function(what, "free", free)
    V.flag(what, "asynchronous", asynchronous)
    if finish is None:
        finish = _finish_of(optimizer)
    V.function(what, "finish", finish)
    jf_optax.check_chain(optimizer)

    def init(params: Tree) -> OptaxState:
        return OptaxState(params, optimizer.init(params), jnp.zeros([], jnp.int32))

    def local(state: OptaxState, grad_fn: GradFn) -> OptaxState:
        grads = grad_fn(state.params, state.iteration)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return OptaxState(optax.apply_updates(state.params, updates), opt_state,
                          state.iteration + 1)

    step = _training_loop.StepFunction(local, static_argnums=1)
    return Trainer(init, step, lambda state: state.params, _always, free, asynchronous,
                   step.compile, finish)


def _finish_of(optimizer: optax.GradientTransformation) -> Callable[[Any], Any]:
    """:func:`from_optax`'s default finish: the optimizer's own, if it has one."""
    if not callable(getattr(optimizer, "finish", None)):
        return lambda state: state

    def finish(state: OptaxState) -> OptaxState:
        updates, opt_state = optimizer.finish(state.opt_state, state.params)
        return state._replace(params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state)

    return finish


def async_push_sum(inner: optax.GradientTransformation, *, name: str = "jaxfog.push_sum",
                   topology: T.Topology | None = None) -> Trainer:
    """Asynchronous push-sum / SGP: ``from_optax(jaxfog.optax.async_push_sum(...))``.

    Not :func:`jaxfog.optax.push_sum`, the synchronous algorithm (every agent
    mixes with its in-neighbours each step); this one mixes over a one-sided
    window and nobody waits, and reduces to it only when every agent steps
    together. It was named ``push_sum`` here until the two names were told
    apart; that name still works and warns.

    ``finish(state)`` (collective, after every agent's last step) collects the
    mass still in flight: then each agent's numerator and weight hold all of
    it (their sums over the agents are the exact totals, ``allreduce`` gives
    the exact average) and ``params`` is ``numerator / weight``."""
    _check_trainer("jaxfog.asynchrony.async_push_sum", inner, name, topology)

    def finish(state: OptaxState) -> OptaxState:
        barrier()  # every push has landed
        opt = state.opt_state
        x, p = W.win_update_then_collect((opt.numerator, opt.weight), name)
        z = jax.tree.map(lambda v, w: (v / p.astype(v.dtype)).astype(jnp.result_type(w)), x,
                         state.params)
        return state._replace(params=z, opt_state=opt._replace(numerator=x, weight=p))

    return from_optax(jf_optax.async_push_sum(inner, name=name, topology=topology),
                      free=lambda: W.win_free(name), asynchronous=True, finish=finish)


# -- shared helpers -------------------------------------------------------------------------


def _check_trainer(what: str, inner: Any, name: Any, topology: Any) -> None:
    """What every window-based trainer takes, checked when it is made."""
    V.transformation(what, "inner", inner)
    V.text(what, "name", name)
    V.topology(what, topology, schedule=False)


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
    seed = V.integer("jaxfog.asynchrony.pick", "seed", seed)
    if not any(isinstance(v, jax.core.Tracer) for v in (rank, iteration, count)):
        if int(count) < 1:
            raise ValueError(f"jaxfog.asynchrony.pick: count must be >= 1, got {count!r}")
        with np.errstate(over="ignore"):
            x = np.uint32(seed) * np.uint32(0x9E3779B1) ^ _mix32(
                np.uint32(int(rank)) * np.uint32(0x85EBCA77) ^ _mix32(np.uint32(int(iteration))))
            return int(_mix32(np.uint32(x)) % np.uint32(int(count)))
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
    together are applied one after another in rank order
    (``jaxfog.ops._training_loop`` holds what differs).
    """
    _check_trainer("jaxfog.asynchrony.adpsgd", inner, name, topology)
    seed = V.integer("jaxfog.asynchrony.adpsgd", "seed", seed)
    held: dict[str, Any] = {}

    def init(params: Tree) -> ADPSGDState:
        graph = _graph(topology, "adpsgd")
        table, count = _neighbors(graph)
        held.update(table=table, count=count, shape=jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)), params))
        linked = np.zeros((graph.size,) * 2, bool)
        for i in range(graph.size):
            linked[i, table[i, :count[i]]] = True
        _training_loop.value_create(params, name, linked)
        return ADPSGDState(inner.init(params), jnp.zeros([], jnp.int32))

    def peer(iteration):
        row = _training_loop.rank_row(held["table"])  # numpy where the rank is concrete
        return row[pick(seed, runtime.rank(), iteration, _training_loop.rank_row(held["count"]))]

    def local(x: Tree, opt_state: optax.OptState, iteration: jax.Array,
              grad_fn: GradFn) -> tuple[optax.Updates, optax.OptState, jax.Array]:
        grads = grad_fn(x, iteration)
        return (*inner.update(grads, opt_state, x), iteration + 1)

    local_step = _training_loop.StepFunction(local, static_argnums=3)

    def step(state: ADPSGDState, grad_fn: GradFn) -> ADPSGDState:
        x = _training_loop.value_read(name)
        u, opt_state, iteration = local_step(x, state.opt_state, state.iteration, grad_fn)
        _training_loop.pair_average(name, peer(state.iteration))
        _training_loop.value_add(name, u)
        return ADPSGDState(opt_state, iteration)

    def params(state: ADPSGDState) -> Tree:
        return _training_loop.value_read(name)

    def compile_step(state: ADPSGDState, grad_fn: GradFn) -> None:
        x = _zeros(held["shape"])
        local_step.compile(x, state.opt_state, state.iteration, grad_fn)
        _training_loop.value_compile(name)

    def free() -> None:
        local_step.reset()
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
    what = "jaxfog.asynchrony.hop"
    _check_trainer(what, inner, name, topology)
    if staleness is not None:
        staleness = V.integer(what, "staleness", staleness, minimum=0)
    backups = V.integer(what, "backups", backups, minimum=0)
    skip = V.flag(what, "skip", skip)
    models, counters = name + ".x", name + ".k"
    held: dict[str, Any] = {}

    def init(params: Tree) -> HopState:
        graph = _graph(topology, "hop")
        n = graph.size
        ins = (graph.weights != 0) & ~np.eye(n, dtype=bool)
        if (backups >= ins.sum(axis=1)).any():
            raise ValueError(f"hop: backups={backups} must be below every rank's in-degree "
                             f"(smallest {ins.sum(axis=1).min()})")
        # reads[m]: a one-hot table naming each agent's m-th in-neighbour.
        k = ins.sum(axis=1).max()
        reads = np.zeros((k, n, n))
        for i in range(n):
            for m, j in enumerate(np.flatnonzero(ins[i])):
                reads[m, i, j] = 1.0
        held.update(graph=graph, ins=ins, n=n, reads=reads)
        W.win_create(params, models)
        W.win_create(jnp.zeros(n, jnp.int32), counters, zero_init=True)
        # The neighbours' slots start with this agent's own model: send it once.
        W.win_put(params, models)
        _training_loop.settle()
        return HopState(params, params, inner.init(params), jnp.zeros([], jnp.int32),
                        jnp.zeros(held["n"], jnp.int32))

    def read_counters():
        return W.win_update(jnp.zeros(held["n"], jnp.int32), counters, self_weight=0.0,
                            src_weights=held["ins"].astype(np.float64))

    def mine(table):  # this agent's row of a rank-indexed table
        return jnp.asarray(table)[runtime.rank()]

    def admissible(seen, k):
        ins = mine(held["ins"])
        fresh = ins & (seen >= k)
        ok = jnp.sum(fresh) >= jnp.sum(ins) - backups
        if staleness is not None:
            ok = ok & jnp.all(jnp.where(ins, seen >= k - staleness, True))
        return ok, fresh

    ready_step = _training_loop.StepFunction(lambda k: admissible(read_counters(), k)[0])

    def ready(state: HopState) -> jax.Array:
        return ready_step(state.iteration)

    def weights(fresh):
        w = held["graph"].weights
        self_w = mine(np.diag(w).copy())
        row = jnp.where(fresh, mine(w * ~np.eye(held["n"], dtype=bool)), 0.0)
        total = self_w + row.sum()
        return self_w / total, row / total

    def combine(sent, fresh):
        """The fresh in-neighbours' models mixed with this agent's: each
        in-neighbour's slot read alone (static ranks: one compiled step for
        every set of fresh neighbours), mixed with the traced weights here."""
        self_w, row = weights(fresh)
        x = jax.tree.map(lambda v: v * self_w.astype(v.dtype), sent)
        for m, reads in enumerate(held["reads"]):  # the m-th in-neighbour (if any)
            y = W.win_update(_zeros(sent), models, self_weight=0.0, src_weights=reads)
            w = jnp.dot(mine(reads), row)
            x = jax.tree.map(lambda a, b: a + b * w.astype(b.dtype), x, y)
        return x

    def local(state: HopState, grad_fn: GradFn) -> HopState:
        seen = read_counters()
        x = combine(state.sent, admissible(seen, state.iteration)[1])
        grads = grad_fn(x, state.iteration)
        u, opt_state = inner.update(grads, state.opt_state, x)
        y = optax.apply_updates(x, u)
        k = state.iteration + 1
        if skip:
            newest = jnp.max(jnp.where(mine(held["ins"]), seen, 0))
            k = jnp.maximum(k, newest.astype(k.dtype))
        W.win_put(y, models)
        W.win_put(jnp.zeros(held["n"], jnp.int32).at[runtime.rank()].set(k), counters)
        return HopState(x, y, opt_state, k, seen.astype(jnp.int32))

    step = _training_loop.StepFunction(local, static_argnums=1)

    def compile_step(state: HopState, grad_fn: GradFn) -> None:
        ready_step.compile(state.iteration)
        step.compile(state, grad_fn)

    def free() -> None:
        ready_step.reset()
        step.reset()
        W.win_free(models)
        W.win_free(counters)

    return Trainer(init, step, lambda state: state.params, ready, free, True, compile_step,
                   _settle)


def now() -> Any:
    """Seconds on this agent's clock: its simulated time under
    ``simulate(delays=...)`` (0 without delays), ``time.perf_counter()`` on MPI."""
    return _training_loop.now()


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
    what = "jaxfog.asynchrony.run"
    if not isinstance(trainer, Trainer):
        raise TypeError(f"{what}: trainer must be a jaxfog.asynchrony.Trainer (from "
                        f"from_optax, async_push_sum, adpsgd or hop), got {type(trainer).__name__}")
    V.function(what, "grad_fn", grad_fn)
    if isinstance(iterations, (jax.Array, np.ndarray, np.generic)):  # traced in a simulation
        if np.shape(iterations) != () or not jnp.issubdtype(iterations.dtype, jnp.integer):
            raise TypeError(f"{what}: iterations must be an int or an integer scalar, got "
                            f"{iterations.dtype}{list(np.shape(iterations))}")
    else:
        V.integer(what, "iterations", iterations, minimum=0)
    V.flag(what, "warmup", warmup)
    V.real(what, "poll", poll, low=0.0, low_open=True)
    if callback is not None:
        V.function(what, "callback", callback)
    if until is not None and not trainer.asynchronous:
        raise ValueError(f"{what}: until= needs an asynchronous trainer (the agents of a "
                         "synchronous one must run the same number of steps)")
    until = np.inf if until is None else until  # traced on simulated agents, or not
    return _training_loop.run(trainer, state, grad_fn, iterations, until, warmup=warmup, poll=poll,
                     callback=callback)


def __getattr__(name: str) -> Any:
    """``push_sum``, the old name of :func:`async_push_sum` (deprecated: it
    reads as the synchronous :func:`jaxfog.optax.push_sum`)."""
    if name == "push_sum":
        warnings.warn("jaxfog.asynchrony.push_sum is deprecated: it is asynchronous "
                      "push-sum, now jaxfog.asynchrony.async_push_sum (the name of its optax "
                      "form, jaxfog.optax.async_push_sum; jaxfog.optax.push_sum is the "
                      "synchronous algorithm)", FutureWarning, stacklevel=2)
        return async_push_sum
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADPSGDState", "HopState", "OptaxState", "Trainer", "adpsgd", "async_push_sum",
           "from_optax", "hop", "now", "pick", "run"]
