"""What an agent's training loop needs from the backend it runs on.

:mod:`jaxfog.asynchrony`'s trainers are written once against these
functions; each asks :func:`jaxfog.ops._dispatch.current` (the one place a
backend is chosen) and the backend answers (:class:`~jaxfog.ops._backends.Backend`):

* the clock (:func:`now`): ``time.perf_counter()`` on MPI processes,
  simulated time on simulated agents;
* compiled steps (:class:`StepFunction`): ``jaxfog.jit`` on MPI, traced into
  the simulation on simulated agents;
* the loop itself (:func:`run`): real time and polling on MPI, ticks of a
  ``while_loop`` (in simulated time under ``simulate(delays=...)``);
* AD-PSGD's shared models (:func:`value_create`, :func:`value_read`,
  :func:`value_add`, :func:`pair_average`): a window's published value, read
  and averaged under the window mutexes on MPI.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from jaxfog.ops import _args, _dispatch
from jaxfog.ops.jit import jit


def rank_row(table: Any) -> Any:
    """This agent's row of a rank-indexed table: numpy where the rank is
    concrete (no computation to compile), else traced."""
    return _args.rank_row(table)


def now() -> Any:
    """Seconds on this agent's clock."""
    return _dispatch.current().now()


def settle() -> None:
    """Returns once the one-sided writes every agent made so far have landed
    (a barrier on MPI; nothing on simulated agents, where they land at once
    or after their simulated delay). Collective."""
    _dispatch.current().settle()


class StepFunction:
    """``fn`` as a step: compiled once with ``jaxfog.jit`` on MPI processes,
    traced as it is into the simulation."""

    def __init__(self, fn: Callable, static_argnums: int | Sequence[int] = ()):
        self.fn = fn
        self.static_argnums = static_argnums
        self._jitted: Any = None

    @property
    def jitted(self) -> Any:
        if self._jitted is None:
            self._jitted = jit(self.fn, static_argnums=self.static_argnums)
        return self._jitted

    def __call__(self, *args: Any) -> Any:
        return _dispatch.current().call_step(self, *args)

    def compile(self, *args: Any) -> None:
        """Compiles the step for ``args`` without running it (nothing when simulated)."""
        _dispatch.current().compile_step(self, *args)

    def reset(self) -> None:
        self._jitted = None


def run(trainer: Any, state: Any, grad_fn: Callable, iterations: int, until: Any, *,
        warmup: bool, poll: float, callback: Callable | None) -> Any:
    """The agent's loop (see :func:`jaxfog.asynchrony.run`)."""
    return _dispatch.current().run(trainer, state, grad_fn, iterations, until, warmup=warmup,
                                  poll=poll, callback=callback)


def value_create(x: Any, name: str, peers: np.ndarray) -> None:
    """A shared model: window ``name`` publishing ``x``; ``peers[i, j]``:
    agent i may average with j. Collective."""
    leaves, treedef = _args.leaves("win_create", x)
    _dispatch.current().value_create(leaves, treedef, name, np.asarray(peers, bool))


def value_read(name: str) -> Any:
    """This agent's shared model (its published value; a neighbour may change it)."""
    return _dispatch.current().value_read(name)


def value_add(name: str, x: Any) -> None:
    """Adds ``x`` onto this agent's shared model, atomically."""
    _dispatch.current().value_add(name, x)


def pair_average(name: str, peer: Any) -> None:
    """``v_me = v_peer = (v_me + v_peer) / 2``, atomically (both mutexes held)."""
    _dispatch.current().value_pair_average(name, peer)


def value_compile(name: str) -> None:
    """Compiles the shared model's reads, adds and averages (nothing when simulated)."""
    _dispatch.current().value_compile(name)
