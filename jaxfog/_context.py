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
from typing import Any, Callable, Iterator

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
    #: How ops run while this simulation is traced: ``backend(simulation)``
    #: is the ``jaxfog.ops._backends.Backend`` that
    #: ``jaxfog.ops._dispatch.current()`` returns (the simulation's front end
    #: passes ``jaxfog.simulation._backend.SimulatedBackend``), so no op
    #: imports a backend.
    backend: Callable[[Simulation], Any] = dataclasses.field(compare=False, kw_only=True)
    #: Several agents per device of a mesh (``simulate(mesh=...)`` with n a
    #: multiple of the devices): ``axis_name`` is then the device axis and
    #: ``inner_axis`` the vmapped axis of the ``inner_size`` agents of a device.
    inner_axis: str | None = None
    inner_size: int = 1
    #: The agents live on a mesh's devices (``shard_map``), not along a vmap axis.
    on_mesh: bool = False
    homogeneous = True

    # The collectives over all agents. With one axis they are lax's; with a
    # device axis and an inner one, two in turn (lax cannot take the pair).

    @property
    def rank(self) -> Any:
        from jax import lax  # only ever asked for while JAX traces

        if self.inner_axis is None:
            return lax.axis_index(self.axis_name)
        return lax.axis_index(self.axis_name) * self.inner_size + lax.axis_index(self.inner_axis)

    def all_gather(self, x: Any) -> Any:
        """Every agent's ``x``, stacked in rank order (one pytree)."""
        import jax
        from jax import lax

        if self.inner_axis is None:
            return lax.all_gather(x, self.axis_name)
        return jax.tree.map(lambda v: lax.all_gather(lax.all_gather(v, self.inner_axis),
                                                     self.axis_name).reshape(
                                                         (self.size, *v.shape)), x)

    def psum(self, x: Any) -> Any:
        return self._reduce("psum", x)

    def pmin(self, x: Any) -> Any:
        return self._reduce("pmin", x)

    def pmax(self, x: Any) -> Any:
        return self._reduce("pmax", x)

    def _reduce(self, name: str, x: Any) -> Any:
        from jax import lax

        reduce = getattr(lax, name)
        if self.inner_axis is None:
            return reduce(x, self.axis_name)
        return reduce(reduce(x, self.inner_axis), self.axis_name)

    def ppermute(self, x: Any, perm: Any) -> Any:
        """``lax.ppermute`` over the agents: agent ``dst`` gets ``src``'s ``x``
        for each ``(src, dst)`` of ``perm``, the others zeros. With several
        agents per device, each device's block of agents travels once per
        device offset the pairs use (a shift of the agents: at most two), and
        each agent picks its source's row."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax import lax

        if self.inner_axis is None:
            return lax.ppermute(x, self.axis_name, perm)
        k, devices = self.inner_size, self.size // self.inner_size
        source = np.full(self.size, -1)
        for src, dst in perm:
            source[dst] = src
        offset = np.where(source >= 0, (np.arange(self.size) // k - source // k) % devices, 0)
        offsets = sorted(set(offset[source >= 0].tolist())) or [0]
        which = np.searchsorted(offsets, offset)  # each agent's position in `offsets`
        me = self.rank
        pick, row = jnp.asarray(which)[me], jnp.asarray(np.maximum(source, 0) % k)[me]
        receives = jnp.asarray(source >= 0)[me]

        def one(v):
            block = lax.all_gather(v, self.inner_axis)  # this device's agents
            moved = jnp.stack([block if o == 0 else lax.ppermute(
                block, self.axis_name, [(i, (i + o) % devices) for i in range(devices)])
                for o in offsets])
            return jnp.where(receives, moved[pick, row], jnp.zeros_like(v))

        return jax.tree.map(one, x)

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
