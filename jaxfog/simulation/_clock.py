"""Simulated time: the agents' clocks under ``jaxfog.simulate(..., delays=...)``.

Each agent has a clock (seconds, a ``jax.Ref`` kept across simulated calls,
like a window, until :func:`reset`). Time moves in three places:

* :func:`jaxfog.asynchrony.run` charges each step its compute time
  (:func:`compute_time`) and picks which agents step (:func:`stepping`);
* a synchronous op (neighbour averaging, collectives) ends for agent ``i``
  when the last in-neighbour's message has arrived (:func:`synchronize`):
  ``t_i = max(t_i, max_j t_j + d[j, i])``;
* a window put leaves at the sender's clock and becomes visible to the
  receiver ``d[src, dst]`` seconds later (``windows`` keeps the
  messages in flight).

Without delays there is no clock, every agent is active, and nothing here
changes what an op computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import _context


class Timing(NamedTuple):
    """Delays resolved for n agents (see :class:`jaxfog.Delays`)."""

    compute: np.ndarray  # (n,) seconds per step
    message: np.ndarray  # (n, n) seconds, [src, dst]
    jitter: float
    seed: int
    queue: int  # messages in flight kept per edge and window


# The agents' clocks, kept across simulated calls: (n, dtype, placement) -> Ref (n,).
_kept: dict[tuple[int, Any, Any], Any] = {}
# Where state kept across calls lives: None (the default device), or the
# sharding of the agents' mesh (row i on agent i's device) during a call of
# ``simulate(mesh=...)``.
_placement: list[Any] = [None]


@contextlib.contextmanager
def placed(sharding: Any) -> Iterator[None]:
    """State made while this is active (clocks, windows kept across calls) is
    laid out with ``sharding``: a mesh call's references must live on the mesh."""
    _placement.append(sharding)
    try:
        yield
    finally:
        _placement.pop()


def persistent_zeros(shape: tuple, dtype: Any) -> Any:
    """A ``jax.Ref`` of zeros, for state kept across calls, placed as
    :func:`placed` says."""
    with jax.ensure_compile_time_eval():
        if _placement[-1] is None:
            return jax.new_ref(jnp.zeros(shape, dtype))
        return jax.new_ref(jax.device_put(np.zeros(shape, dtype), _placement[-1]))


def kept(n: int) -> Any:
    """The clocks of n simulated agents (a ``jax.Ref``; zeros at first), in
    the default float type (float64 under ``jax_enable_x64``)."""
    key = (n, jnp.result_type(float), _placement[-1])
    if key not in _kept:
        _kept[key] = persistent_zeros((n,), key[1])
    return _kept[key]


def reset() -> None:
    """Sets every simulated agent's clock back to 0 (in place: compiled
    functions hold the references)."""
    for ref in _kept.values():
        with jax.enable_x64(True):  # a float64 clock stays float64
            ref[...] = jax.device_put(np.zeros(ref.shape, ref.dtype), ref[...].sharding)


@dataclasses.dataclass
class _Session:
    timing: Timing | None
    now: Any  # this agent's clock (a Ref view), or None without delays
    active: Any = True


class _Sessions(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Session] = []


_sessions = _Sessions()


@contextlib.contextmanager
def bound(timing: Timing | None, now: Any) -> Iterator[_Session]:
    """The clock of the agent being traced (``now``: its Ref view) while ``fn`` runs."""
    session = _Session(timing, now)
    _sessions.stack.append(session)
    try:
        yield session
    finally:
        _sessions.stack.pop()


def current() -> _Session | None:
    return _sessions.stack[-1] if _sessions.stack else None


def timing() -> Timing | None:
    session = current()
    return None if session is None else session.timing


def has_message_delays() -> bool:
    t = timing()
    return t is not None and bool((t.message > 0).any())


def active() -> Any:
    """Whether this agent takes the current step (a traced bool, or True)."""
    session = current()
    return True if session is None else session.active


@contextlib.contextmanager
def stepping(go: Any) -> Iterator[None]:
    """Ops inside act only for the agents where ``go`` holds (the others keep
    their window state and clock; :func:`jaxfog.asynchrony.run` keeps their
    trainer state)."""
    session = current()
    assert session is not None  # an agent is being traced
    previous, session.active = session.active, go
    try:
        yield
    finally:
        session.active = previous


def now() -> Any:
    """This agent's clock (0.0 without delays)."""
    session = current()
    if session is None or session.now is None:
        return jnp.zeros([], jnp.result_type(float))
    return session.now[...]


class Box:
    """A value read and written like a ``jax.Ref`` (``box[...]``), but plain:
    inside a ``while_loop`` body the windows and clocks live in boxes and
    travel in the carry, since the body may not update outer references
    (and JAX cannot discharge fresh ones in a body with constants)."""

    def __init__(self, value: Any):
        self.value = value

    def __getitem__(self, index: Any) -> Any:
        return self.value if index is Ellipsis else self.value[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self.value = value if index is Ellipsis else self.value.at[index].set(value)

    @property
    def dtype(self) -> Any:
        return self.value.dtype


@contextlib.contextmanager
def local_ref(value: Any) -> Iterator[Callable[[], Any]]:
    """Inside a loop body: the clock is a :class:`Box` holding ``value``
    (None: no clock); yields a function that reads it back."""
    session = current()
    if value is None:
        yield lambda: None
        return
    assert session is not None  # an agent is being traced
    outer, session.now = session.now, Box(value)
    try:
        yield lambda: session.now[...]
    finally:
        session.now = outer


def set_now(value: Any) -> None:
    session = current()
    if session is not None and session.now is not None:
        session.now[...] = jnp.where(active(), value, session.now[...]).astype(
            session.now.dtype)


def _uniform(seed: int, rank: Any, iteration: Any) -> Any:
    """A uniform number in [0, 1) from (seed, rank, iteration), as a 32-bit hash."""
    u32 = jnp.uint32
    x = (u32(seed) * u32(0x9E3779B1)) ^ (jnp.asarray(rank).astype(u32) * u32(0x85EBCA77)) ^ (
        jnp.asarray(iteration).astype(u32) * u32(0xC2B2AE3D))
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = (x ^ (x >> shift)) * u32(mul)
    x = x ^ (x >> 16)
    return (x >> 8).astype(jnp.result_type(float)) / float(1 << 24)


def compute_time(iteration: Any) -> Any:
    """This agent's compute time for ``iteration``: ``compute[i]`` scaled by a
    seeded factor uniform in ``[1 - jitter, 1 + jitter]``."""
    t, sim = timing(), _context.current()
    if t is None:
        return jnp.zeros([], jnp.result_type(float))
    assert sim is not None  # a timing is bound only while simulate traces an agent
    base = jnp.asarray(t.compute)[sim.rank]
    if not t.jitter:
        return base
    return base * (1.0 + t.jitter * (2.0 * _uniform(t.seed, sim.rank, iteration) - 1.0))


def arrival(dst: Any) -> Any:
    """When a message this agent sends now reaches ``dst``."""
    t, sim = timing(), _context.current()
    assert t is not None and sim is not None  # only with message delays, in simulate
    return now() + jnp.asarray(t.message)[sim.rank, dst]


# While a nonblocking op starts, the arrival times its synchronous parts
# record instead of waiting for them (innermost last).
_recording: list[list[Any]] = []


@contextlib.contextmanager
def recording_arrivals() -> Iterator[list[Any]]:
    """Inside, a synchronous op does not wait: it appends the time its last
    message arrives at this agent to the list yielded (a nonblocking op's
    start; its wait calls :func:`arrive`)."""
    arrivals: list[Any] = []
    _recording.append(arrivals)
    try:
        yield arrivals
    finally:
        _recording.pop()


def arrive(at: Any) -> None:
    """This agent waits until ``at`` (a message's arrival)."""
    set_now(jnp.maximum(now(), at))


def synchronize(receives: np.ndarray | None = None) -> None:
    """A synchronous op: this agent's clock becomes the time the last message
    it receives arrives. ``receives[i, j]``: agent i receives from j (None:
    from everyone, a collective)."""
    t, sim = timing(), _context.current()
    if t is None or sim is None:
        return
    n = sim.size
    receives = np.ones((n, n), bool) if receives is None else np.asarray(receives, bool)
    receives = receives & ~np.eye(n, dtype=bool)
    clocks = sim.all_gather(now())
    incoming = clocks + jnp.asarray(t.message)[:, sim.rank]
    latest = jnp.max(jnp.where(jnp.asarray(receives)[sim.rank], incoming, -jnp.inf))
    if _recording:
        _recording[-1].append(latest)
    else:
        arrive(latest)
