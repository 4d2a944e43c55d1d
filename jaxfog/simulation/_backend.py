"""The simulation backend: ops run by their rules on simulated agents.

``jaxfog.simulate`` vmaps the per-agent function over a named axis; while it
traces, each op's record runs its rule on agents (``Op.simulated``, in the
op's module: ``lax`` collectives over the agent axis, with no FFI and no
MPI; the mixing they share is ``_mixing.py``, the windows' ``_windows.py``).
Here: starting and waiting for them in simulated time, the agents' training
loop (a ``while_loop`` of ticks) and AD-PSGD's shared models.

Everything the rules compute is differentiable (``ppermute`` transposes to
the inverse permutation, i.e. averaging with W^T), batchable and jittable, on
CPU or GPU. It is the oracle the MPI backend is tested against.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfog import _context
from jaxfog.ops import _args
from jaxfog.simulation import _clock, _windows


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
    """Ops on the agents, by their rules (``Op.simulated``)."""

    # A nonblocking op is computed at its start and held back until its wait,
    # where the agent's clock waits for its messages.
    def apply(self, op: Any, leaves: list, treedef: Any, args: Any) -> Any:
        return op.simulated(self.sim, leaves, treedef, args)

    def start(self, op: Any, leaves: list, treedef: Any, args: Any
              ) -> tuple[list, SimulatedHandle]:
        with _clock.recording_arrivals() as arrivals:
            outs = self.apply(op, leaves, treedef, args)
        outs = list(outs)
        if not arrivals:
            return outs, SimulatedHandle(len(outs), False)
        return [*outs, functools.reduce(jnp.maximum, arrivals)], SimulatedHandle(len(outs), True)

    def poll(self, arrays: list, handle: SimulatedHandle) -> bool:
        return True  # the result is held in the handle

    def wait(self, arrays: list, handle: SimulatedHandle) -> list:
        if handle.timed:
            _clock.arrive(arrays[handle.n])
        return list(arrays[:handle.n])


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


class SimulatedBackend(SimulatedOps, SimulatedTrainingLoop, SimulatedSharedValues):
    """Ops on the agents of the simulation being traced: the three concerns of
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
