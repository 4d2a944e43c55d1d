"""Which backend calling code runs on: MPI processes, or agents simulated in one process.

While ``jaxfog.simulate`` traces the per-agent function, a :class:`Simulation`
is current: the runtime's queries (``rank()``, ``size()``, topologies) and
every op answer for the simulated agents instead of the MPI process. Pure
data; JAX is imported only when a traced agent index is asked for, so the
runtime stays light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

from jaxfog import topology as T


@dataclasses.dataclass(frozen=True)
class Simulation:
    """n agents along the named vmap axis ``axis_name``.

    Answers the runtime's queries with the same names as the MPI runtime's
    state; the ranks are traced (the agent index along the axis).
    """

    axis_name: str
    size: int
    topology: T.Topology | T.Schedule
    local_size: int
    machine_topology: T.Topology
    homogeneous = True

    @property
    def rank(self) -> Any:
        from jax import lax  # only ever asked for while JAX traces

        return lax.axis_index(self.axis_name)

    @property
    def local_rank(self) -> Any:
        return self.rank % self.local_size

    @property
    def machine_rank(self) -> Any:
        return self.rank // self.local_size

    @property
    def machine_size(self) -> int:
        return self.size // self.local_size


class _Stack(threading.local):
    def __init__(self) -> None:
        self.items: list[Simulation] = []


_stack = _Stack()


def current() -> Simulation | None:
    """The simulation being traced on this thread, if any."""
    return _stack.items[-1] if _stack.items else None


@contextlib.contextmanager
def simulating(simulation: Simulation) -> Iterator[Simulation]:
    _stack.items.append(simulation)
    try:
        yield simulation
    finally:
        _stack.items.pop()
