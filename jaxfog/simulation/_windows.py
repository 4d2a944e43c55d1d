"""Windows on simulated agents: the window state as JAX references.

Every agent runs the same window op at once (the agents are one vmapped
trace), so a put or accumulate is delivered at once: each destination's
slot holds it before anyone's next op (immediate delivery), and the mutex
is trivially held. An agent's window state is

* ``published``: its published value (the window's leaves);
* ``slots``: one slot per rank (leading axis n; only the sources' are used);
* ``versions`` (n,), and ``p``/``slot_p`` (the push-sum weights);
* with message delays (``simulate(delays=...)``), the messages in flight to
  it: a FIFO of ``queue`` entries per source (``inbox*``, ``head``,
  ``tail``), delivered into the slots by the receiver's reads once its clock
  passes their arrival time (a full FIFO delivers its oldest message early).

Under ``delays`` only the agents that take the current step act
(:func:`jaxfog.simulation._clock.active`): the others' puts are
not sent and their window state does not change.

kept in ``jax.Ref`` s, so that ops inside ``lax.scan``, ``fori_loop`` and
``jax.jit`` update them in place. A window outlives the simulated call that
created it: :func:`jaxfog.simulate` hands the windows that exist to each
call (:func:`bound`) and keeps those the call created (:func:`keep`), so a
Python loop of jitted simulated steps shares its windows like MPI processes
do. ``win_create``/``win_free`` take effect when the function that calls them
is traced.

Exchanges: one ``lax.ppermute`` per rank offset that some agent uses (every
offset when the peers are traced), as for neighbour averaging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfog import _context
from jaxfog import topology as T
from jaxfog.errors import BackendError
from jaxfog.ops import _args, _primitive_machinery
from jaxfog.ops import _numerics, _window_spec
from jaxfog.simulation import _clock


@dataclasses.dataclass
class _Window:
    spec: _window_spec.WindowSpec
    refs: dict  # the state's references (this agent's view inside the trace)


# Windows that outlive a simulated call: name -> (spec, stacked references).
_kept: dict[str, _Window] = {}


class _Session:
    """The windows one simulated call sees, and what it creates and frees."""

    def __init__(self, windows: dict[str, _Window]):
        self.windows = dict(windows)
        self.created: set[str] = set()
        self.freed: set[str] = set()


class _Sessions(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Session] = []


_sessions = _Sessions()


def kept_refs() -> dict[str, dict]:
    """The references of every window that exists, to pass into a simulated call."""
    return {name: window.refs for name, window in _kept.items()}


@contextlib.contextmanager
def bound(refs: dict[str, dict]) -> Iterator[_Session]:
    """Makes the windows ``refs`` (this agent's views) current while ``fn`` runs."""
    session = _Session({name: _Window(_kept[name].spec, r) for name, r in refs.items()})
    _sessions.stack.append(session)
    try:
        yield session
    finally:
        _sessions.stack.pop()


def created_states(session: _Session) -> dict[str, dict]:
    """The final state of the windows this call created (to :func:`keep`)."""
    return {name: jax.tree.map(lambda r: r[...], session.windows[name].refs)
            for name in session.created if name in session.windows}


def keep(session_specs: dict[str, _window_spec.WindowSpec], states: dict[str, dict],
         freed: set[str]) -> None:
    """Outside the vmap: keeps the windows created by a call (stacked states)."""
    if freed or states:
        _primitive_machinery.windows_changed()
    for name in freed:
        _kept.pop(name, None)
    for name, state in states.items():
        def persistent(value):
            ref = _clock.persistent_zeros(value.shape, value.dtype)
            ref[...] = value
            return ref

        _kept[name] = _Window(session_specs[name], jax.tree.map(persistent, state))


def values() -> dict[str, dict]:
    """The state of every window this call sees (to carry through a loop)."""
    return {name: _get(window) for name, window in _session("run").windows.items()}


def store(states: dict[str, dict]) -> None:
    """Writes ``states`` (from :func:`values`) back into the windows."""
    for name, state in states.items():
        _set(_session("run").windows[name], state)


@contextlib.contextmanager
def local_refs(states: dict[str, dict]) -> Iterator[Callable[[], dict[str, dict]]]:
    """Inside a loop body: the windows hold ``states`` in boxes
    (:class:`~jaxfog.simulation._clock.Box`); yields a function
    that reads them back."""
    windows = _session("run").windows
    outer = {name: windows[name].refs for name in states}
    for name, state in states.items():
        windows[name].refs = jax.tree.map(_clock.Box, state)
    try:
        yield lambda: {name: _get(windows[name]) for name in states}
    finally:
        for name, refs in outer.items():
            windows[name].refs = refs


def _session(what: str) -> _Session:
    if not _sessions.stack:
        raise BackendError(f"{what}: windows in the simulation need jaxfog.simulate")
    return _sessions.stack[-1]


def _lookup(name: str, what: str) -> _Window:
    windows = _session(what).windows
    if name not in windows:
        known = ", ".join(sorted(windows)) or "none"
        raise ValueError(f"{what}: no window named {name!r} (windows: {known}); create it "
                         "with jaxfog.win_create")
    return windows[name]


def _weight_dtype():
    return jnp.result_type(float)


def _row(matrix: np.ndarray, sim: _context.Simulation):
    return jnp.asarray(matrix)[sim.rank]


def _sources_of(sim: _context.Simulation, src_ranks: tuple[int, ...] | None,
               table: tuple[tuple[int, ...], ...] | None = None) -> np.ndarray:
    n = sim.size
    sources = np.zeros((n, n), bool)
    if table is not None:
        for i, row in enumerate(table):
            sources[i, list(row)] = True
    elif src_ranks is not None:
        sources[:, list(src_ranks)] = True
    else:
        # Every entry's in-neighbours: the window outlives a step of the schedule.
        graphs = (list(sim.topology) if isinstance(sim.topology, T.Schedule)
                  else [sim.topology])
        for graph in graphs:
            sources |= graph.weights != 0
    np.fill_diagonal(sources, False)
    return sources


def win_create(sim: _context.Simulation, leaves: list, treedef: Any,
               args: _args.WinCreate) -> bool:
    session = _session(args.what)
    if args.name in session.windows:
        raise ValueError(f"{args.what}: window {args.name!r} exists already (win_free it "
                         "first)")
    sources = _sources_of(sim, args.src_ranks, args.src_table)
    spec = _window_spec.WindowSpec.make(args.name, treedef, _window_spec.layout(leaves),
                                        args.with_weight, sources, sim.topology)
    n, has = sim.size, _row(sources, sim)
    fill = 0.0 if args.zero_init else 1.0
    state = {
        "published": list(leaves),
        "slots": [jnp.broadcast_to(leaf * jnp.asarray(fill).astype(leaf.dtype),
                                   (n, *leaf.shape)) for leaf in leaves],
        "versions": jnp.zeros(n, jnp.int32),
        "p": jnp.ones((), _weight_dtype()),
        "slot_p": jnp.where(has, fill, 0.0).astype(_weight_dtype()),
    }
    if _clock.has_message_delays():
        timing = _clock.timing()
        assert timing is not None  # has_message_delays() says there is one
        q = timing.queue
        state.update(
            inbox=[jnp.zeros((q, n, *leaf.shape), leaf.dtype) for leaf in leaves],
            inbox_p=jnp.zeros((q, n), _weight_dtype()),
            inbox_time=jnp.full((q, n), jnp.inf, _weight_dtype()),
            inbox_add=jnp.zeros((q, n), bool),
            head=jnp.zeros(n, jnp.int32), tail=jnp.zeros(n, jnp.int32))
    session.windows[args.name] = _Window(spec, jax.tree.map(jax.new_ref, state))
    session.created.add(args.name)
    return True


def win_free(name: str | None) -> bool:
    session = _session("win_free")
    names = list(session.windows) if name is None else [_lookup(name, "win_free").spec.name]
    for n in names:
        del session.windows[n]
        session.created.discard(n)
        session.freed.add(n)
    return True


def _get(window: _Window) -> dict:
    return jax.tree.map(lambda r: r[...], window.refs)


def _set(window: _Window, state: dict) -> None:
    jax.tree.map(lambda r, v: r.__setitem__(Ellipsis, v), window.refs, state)


def _peer_rows(peers: _args.Peers | None, default: np.ndarray, sim: _context.Simulation):
    """(mask row, weight row, static mask matrix or None) for this agent."""
    n = sim.size
    not_self = jnp.arange(n) != sim.rank
    if peers is None:
        mask = default != 0
        return _row(mask, sim), _row(default, sim), mask
    if isinstance(peers.mask, np.ndarray) and peers.mask.ndim == 2:  # a rank-indexed table
        mask = peers.mask & ~np.eye(n, dtype=bool)
        return _row(mask, sim), _row(np.where(mask, peers.weights, 0.0), sim), mask
    if isinstance(peers.mask, np.ndarray):  # the same ranks for every agent
        mask = np.broadcast_to(peers.mask, (n, n)) & ~np.eye(n, dtype=bool)
        return _row(mask, sim), jnp.asarray(peers.weights) * not_self, mask
    return peers.mask & not_self, jnp.where(peers.mask & not_self, peers.weights, 0.0), None


def _offsets(static_mask: np.ndarray | None, n: int) -> list[int]:
    """The offsets ``o`` (``k = i + o``) that some agent uses."""
    if static_mask is None:
        return list(range(1, n))
    rows = np.arange(n)
    return [o for o in range(1, n) if static_mask[rows, (rows + o) % n].any()]


def _deliver(state: dict, s: Any, values: list, p: Any, add: Any, ok: Any) -> dict:
    """Message ``values`` (weight ``p``) from source ``s`` lands in the slots
    where ``ok``: a put overwrites the slot and counts a version, an
    accumulate (``add``) adds."""
    slots, slot_p = list(state["slots"]), state["slot_p"]
    for l, value in enumerate(values):
        old = slots[l][s]
        slots[l] = slots[l].at[s].set(jnp.where(ok, jnp.where(add, old + value, value), old))
    slot_p = slot_p.at[s].set(jnp.where(ok, jnp.where(add, slot_p[s] + p, p), slot_p[s]))
    versions = state["versions"].at[s].add((ok & ~jnp.asarray(add)).astype(jnp.int32))
    return {**state, "slots": slots, "slot_p": slot_p.astype(state["slot_p"].dtype),
            "versions": versions}


def _deliver_oldest(state: dict, due: Any) -> dict:
    """Delivers the oldest message in flight from each source where ``due`` (n,)."""
    q, n = state["inbox_time"].shape
    at, sources = state["head"] % q, jnp.arange(n)
    add = state["inbox_add"][at, sources]
    slots = []
    for slot, box in zip(state["slots"], state["inbox"]):
        shape = (-1,) + (1,) * (slot.ndim - 1)
        message = box[at, sources]
        slots.append(jnp.where(due.reshape(shape), jnp.where(
            add.reshape(shape), slot + message, message), slot))
    p = state["inbox_p"][at, sources]
    slot_p = jnp.where(due, jnp.where(add, state["slot_p"] + p, p), state["slot_p"])
    return {**state, "slots": slots, "slot_p": slot_p.astype(state["slot_p"].dtype),
            "versions": state["versions"] + (due & ~add).astype(jnp.int32),
            "head": state["head"] + due.astype(jnp.int32),
            "inbox_time": state["inbox_time"].at[at, sources].set(
                jnp.where(due, jnp.inf, state["inbox_time"][at, sources]))}


def _deliver_due(state: dict) -> dict:
    """Delivers every message in flight that has arrived by this agent's clock."""
    if "inbox" not in state:
        return state
    q, n = state["inbox_time"].shape
    t = _clock.now()

    def one(_, state):
        at = state["head"] % q
        due = (state["head"] < state["tail"]) & (state["inbox_time"][at, jnp.arange(n)] <= t)
        return _deliver_oldest(state, due)

    return lax.fori_loop(0, q, one, state)


def _enqueue(state: dict, s: Any, values: list, p: Any, when: Any, add: bool, ok: Any) -> dict:
    """Message from source ``s`` in flight until ``when`` (where ``ok``)."""
    q, n = state["inbox_time"].shape
    full = ok & (state["tail"][s] - state["head"][s] >= q)
    state = _deliver_oldest(state, (jnp.arange(n) == s) & full)
    at = state["tail"][s] % q
    inbox = [box.at[at, s].set(jnp.where(ok, value, box[at, s]))
             for box, value in zip(state["inbox"], values)]
    return {**state, "inbox": inbox,
            "inbox_p": state["inbox_p"].at[at, s].set(jnp.where(ok, p, state["inbox_p"][at, s])),
            "inbox_time": state["inbox_time"].at[at, s].set(
                jnp.where(ok, when, state["inbox_time"][at, s])),
            "inbox_add": state["inbox_add"].at[at, s].set(
                jnp.where(ok, add, state["inbox_add"][at, s])),
            "tail": state["tail"].at[s].add(ok.astype(jnp.int32))}


def _check_delays(state: dict, name: str, what: str) -> None:
    if _clock.has_message_delays() and "inbox" not in state:
        raise ValueError(f"{what}: window {name!r} was created without message delays; "
                         "create it in the simulation that has them")


def _keep_inactive(old: dict, new: dict) -> dict:
    """The new window state where this agent acts, the old one elsewhere."""
    go = _clock.active()
    if go is True:
        return new
    return jax.tree.map(lambda a, b: jnp.where(go, b, a), old, new)


def win_put(sim: _context.Simulation, leaves: list, treedef: Any,
            args: _args.WinPut) -> list:
    window = _lookup(args.name, args.what)
    spec = window.spec
    spec.check_value(treedef, leaves, args.what)
    n, i = sim.size, sim.rank
    # Default: the out-neighbours (with a schedule, every rank holding a slot for me).
    edges = (sim.topology.weights != 0 if isinstance(sim.topology, T.Topology)
             else spec.sources)
    out_edges = (edges.T & ~np.eye(n, dtype=bool)).astype(np.float64)
    mask, weights, static = _peer_rows(args.dst, out_edges, sim)
    if static is not None:
        senders, receivers = np.nonzero(static)
        spec.check_sources(receivers, senders, args.what)
    self_weight = 1.0 if args.self_weight is None else args.self_weight
    old = _get(window)
    _check_delays(old, args.name, args.what)
    state, go = old, _clock.active()
    for o in _offsets(static, n):
        k = (i + o) % n  # my destination at this offset
        perm = [(s, (s + o) % n) for s in range(n)]
        flag = sim.ppermute(mask[k] & go, perm)
        w = weights[k]
        sent = [sim.ppermute(_numerics.scaled(leaf, w), perm) for leaf in leaves]
        sent_p = sim.ppermute(w * old["p"], perm)
        s = (i - o) % n  # the sender whose message I receive
        ok = flag & _row(spec.sources, sim)[s]
        if "inbox" in state:
            when = sim.ppermute(_clock.arrival(k), perm)
            state = _enqueue(state, s, sent, sent_p, when, args.accumulate, ok)
        else:
            state = _deliver(state, s, sent, sent_p, args.accumulate, ok)
    p = jnp.where(go, self_weight * old["p"], old["p"]).astype(old["p"].dtype)
    published = [jnp.where(go, leaf, mine) for leaf, mine in zip(leaves, old["published"])]
    _set(window, {**state, "published": published, "p": p})
    return [_numerics.scaled(leaf, self_weight) for leaf in leaves]


def win_get(sim: _context.Simulation, args: _args.WinGet) -> list:
    """The slots read (``[True]``, as the op's result)."""
    window = _lookup(args.name, args.what)
    spec = window.spec
    n, i = sim.size, sim.rank
    mask, weights, static = _peer_rows(args.src, spec.sources.astype(float), sim)
    if static is not None:
        receivers, senders = np.nonzero(static)
        spec.check_sources(receivers, senders, args.what)
    state = _get(window)
    _check_delays(state, args.name, args.what)
    slots, versions, slot_p = list(state["slots"]), state["versions"], state["slot_p"]
    for o in _offsets(static, n):
        j = (i + o) % n  # the source I read at this offset
        perm = [(s, (s - o) % n) for s in range(n)]
        ok = mask[j] & _row(spec.sources, sim)[j] & _clock.active()
        w = weights[j]
        for l, leaf in enumerate(state["published"]):
            value = _numerics.scaled(sim.ppermute(leaf, perm), w)
            slots[l] = slots[l].at[j].set(jnp.where(ok, value, slots[l][j]))
        their_p = sim.ppermute(state["p"], perm)
        slot_p = slot_p.at[j].set(jnp.where(ok, w * their_p, slot_p[j]))
        versions = versions.at[j].add(ok.astype(versions.dtype))
    _set(window, {**state, "slots": slots, "versions": versions,
                  "slot_p": slot_p.astype(state["slot_p"].dtype)})
    return [True]


def win_update(sim: _context.Simulation, leaves: list, treedef: Any,
               args: _args.WinUpdate) -> list:
    window = _lookup(args.name, args.what)
    spec = window.spec
    spec.check_value(treedef, leaves, args.what)
    sources = _row(spec.sources, sim)
    if args.collect:
        mask, weights, self_weight = sources, sources.astype(float), 1.0
    else:
        mask, weights, static = _peer_rows(args.src, spec.src_weights, sim)
        if args.src is not None and static is not None:
            receivers, senders = np.nonzero(static)
            spec.check_sources(receivers, senders, args.what)
        if args.src is None:
            mask = sources
        self_weight = (_row(spec.self_weight, sim) if args.self_weight is None
                       else args.self_weight)
    mask = mask & sources
    weights = jnp.where(mask, weights, 0.0)
    state = _get(window)
    _check_delays(state, args.name, args.what)
    state = _deliver_due(state)
    out, slots = [], []
    for leaf, slot in zip(leaves, state["slots"]):
        with _numerics.accumulating(leaf.dtype) as acc:
            w = weights.astype(acc)
            # Not a dot for integers: inside a loop body, dot would drop float64.
            mixed = (jnp.tensordot(w, slot.astype(acc), axes=1) if acc == leaf.dtype else
                     jnp.sum(w.reshape((-1,) + (1,) * leaf.ndim) * slot.astype(acc), axis=0))
            total = jnp.asarray(self_weight).astype(acc) * leaf.astype(acc) + mixed
            out.append(_numerics.finish(total, leaf.dtype))
        if args.reset:
            keep = (~mask).reshape((-1,) + (1,) * leaf.ndim)
            slot = jnp.where(keep, slot, jnp.zeros_like(slot))
        slots.append(slot)
    p = self_weight * state["p"] + jnp.dot(weights.astype(state["p"].dtype), state["slot_p"])
    slot_p = jnp.where(mask, 0.0, state["slot_p"]) if args.reset else state["slot_p"]
    _set(window, _keep_inactive(state, {
        **state, "published": out, "slots": slots,
        "versions": jnp.where(mask, 0, state["versions"]),
        "p": p.astype(state["p"].dtype), "slot_p": slot_p.astype(state["p"].dtype)}))
    return out


def win_version(name: str) -> dict[int, Any]:
    window = _lookup(name, "win_version")
    state = _get(window)
    if "inbox" in state:
        state = _deliver_due(state)
        _set(window, state)
    versions = state["versions"]
    return {j: versions[j] for j in range(versions.shape[0])}


def next_arrival() -> Any:
    """When the next message in flight to this agent arrives after its clock
    (inf: none; the ones due already are delivered by its next read)."""
    now = _clock.now()
    times = [jnp.min(jnp.where(window.refs["inbox_time"][...] > now,
                               window.refs["inbox_time"][...], jnp.inf))
             for window in _session("run").windows.values() if "inbox_time" in window.refs]
    return jnp.min(jnp.stack(times)) if times else jnp.inf


def win_weight(name: str) -> Any:
    window = _lookup(name, "win_weight")
    if not window.spec.with_weight:
        raise ValueError(f"win_weight: window {name!r} was created without with_weight=True")
    return _get(window)["p"]


def win_mutex(name: str, ranks: Any) -> contextlib.AbstractContextManager[None]:
    _lookup(name, "win_mutex")
    return contextlib.nullcontext()


# -- AD-PSGD's shared models (jaxfog.asynchrony): the published values ---------------------


def read_value(name: str) -> Any:
    """This agent's published value of window ``name`` (its pytree)."""
    window = _lookup(name, "adpsgd")
    return jax.tree.unflatten(window.spec.treedef, list(window.refs["published"][l][...]
                                                       for l in range(len(window.spec.avals))))


def add_to_value(name: str, x: Any) -> None:
    """Adds ``x`` onto this agent's published value (where it is active)."""
    window = _lookup(name, "adpsgd")
    go = active()
    for ref, leaf in zip(window.refs["published"], jax.tree.leaves(x)):
        ref[...] = jnp.where(go, ref[...] + leaf.astype(ref.dtype), ref[...])


def pair_average(name: str, peer: Any) -> None:
    """Every active agent ``a`` sets ``v_a = v_peer(a) = (v_a + v_peer(a)) / 2``,
    atomically, one after another in rank order (AD-PSGD's averages of the
    agents that step together, serialised as their mutexes would)."""
    sim = _context.current()
    assert sim is not None  # an agent is being traced
    window = _lookup(name, "adpsgd")
    peers = sim.all_gather(jnp.asarray(peer, jnp.int32))
    going = sim.all_gather(active())
    values = [sim.all_gather(ref[...]) for ref in window.refs["published"]]
    for a in range(sim.size):
        b = peers[a]
        for l, v in enumerate(values):
            mean = (v[a] + v[b]) / 2
            values[l] = jnp.where(going[a], v.at[a].set(mean).at[b].set(mean), v)
    for ref, v in zip(window.refs["published"], values):
        ref[...] = v[sim.rank]


def active() -> Any:
    """Whether this agent takes the current step (see ``clock``)."""
    return _clock.active()
