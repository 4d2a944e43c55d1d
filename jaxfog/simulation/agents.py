"""The simulation's front end: the same per-agent code for n agents in one process.

``simulate(fn, topology_or_n)`` returns a function whose arguments carry a
leading agent axis of size n. It vmaps ``fn`` over that axis with a name;
while ``fn`` is traced, ``jaxfog.rank()`` is the (traced) agent index,
``jaxfog.size()`` is n, and every jaxfog op runs on the simulation backend
(``jaxfog.simulation._backend``): its rule on agents, ``lax`` collectives
over the named axis, no FFI, no MPI. :class:`Agents` picks MPI processes or simulated agents
for a whole script.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxfog import _context, runtime
from jaxfog import _validate as V
from jaxfog import mesh as agents_mesh
from jaxfog import topology as T
from jaxfog.ops import allgather, allreduce
from jaxfog.ops.jit import jit
from jaxfog.simulation import _clock, _windows
from jaxfog.simulation._backend import SimulatedBackend

#: Name of the vmapped agent axis (override with ``simulate(axis_name=...)``).
AGENT_AXIS = "jaxfog_agents"
#: On a mesh, the vmapped axis of the agents that share a device.
INNER_AXIS = "jaxfog_agents_of_a_device"


class Delays(NamedTuple):
    """A seeded model of time for simulated agents (``simulate(delays=...)``).

    Agent ``i``'s step ``k`` computes for ``compute[i] * (1 + jitter * u)``
    seconds, ``u`` uniform in ``[-1, 1]`` drawn from ``(seed, i, k)``; a
    message from ``j`` to ``i`` travels ``message[j, i]`` seconds. With
    delays, :func:`jaxfog.asynchrony.run` runs the agents in simulated time:
    each step happens at the moment it ends, the agents whose steps end
    first go first, a window put becomes visible to its receiver once its
    delay has passed, a synchronous op waits for its last in-neighbour, and a
    trainer that is not ready (Hop's bounds) waits for the next event.
    :func:`jaxfog.asynchrony.now` is an agent's simulated time. The same
    seed gives the same run.

    One-sided reads of published values (``win_get``, AD-PSGD's pairwise
    average) take no time in this model.
    """

    #: Seconds per step: one number, or one per agent.
    compute: Any = 1.0
    #: Seconds per message: one number, or an (n, n) matrix ``[src, dst]``.
    message: Any = 0.0
    #: Relative spread of each step's compute time (0 <= jitter < 1).
    jitter: float = 0.0
    #: Seed of the compute-time draws.
    seed: int = 0
    #: Messages kept in flight per edge and window (default: enough for the
    #: slowest edge at the fastest agent's pace); a full queue delivers its
    #: oldest message early.
    queue: int | None = None

    @classmethod
    def straggler(cls, n: int, slowdown: float, *, agent: int = 0, compute: float = 1.0,
                  **kwargs: Any) -> "Delays":
        """Every agent computes for ``compute`` seconds a step, ``agent`` for
        ``slowdown`` times that."""
        times = np.full(n, float(compute))
        times[agent] *= slowdown
        return cls(compute=times, **kwargs)

    @classmethod
    def random_messages(cls, n: int, low: float, high: float, *, seed: int = 0,
                        **kwargs: Any) -> "Delays":
        """Each edge's message delay drawn once, uniform in ``[low, high]``."""
        message = np.random.default_rng(seed).uniform(low, high, (n, n))
        return cls(message=message, seed=seed, **kwargs)

    def _resolve(self, n: int) -> _clock.Timing:
        """The model for ``n`` agents (checked)."""
        what = "jaxfog.Delays"
        arrays = {}
        for label in ("compute", "message"):
            value = getattr(self, label)
            try:
                arrays[label] = np.asarray(value, np.float64)
            except (TypeError, ValueError):
                raise TypeError(f"{what}: {label} must be a number or an array of numbers, "
                                f"got {type(value).__name__} {value!r}") from None
        compute: np.ndarray | None  # None below: not n numbers
        compute, message = arrays["compute"], arrays["message"]
        compute = np.broadcast_to(compute, (n,)).copy() if (
            compute.ndim in (0, 1) and compute.size in (1, n)) else None
        if compute is None or not np.isfinite(compute).all() or (compute <= 0).any():
            raise ValueError(f"{what}: compute must be one positive number or {n} of them, "
                             f"got {self.compute!r}")
        if message.ndim not in (0, 2) or (message.ndim == 2 and message.shape != (n, n)) or (
                not np.isfinite(message).all() or (message < 0).any()):
            raise ValueError(f"{what}: message must be a number >= 0 or an ({n}, {n}) "
                             "matrix of them")
        jitter = V.real(what, "jitter", self.jitter)
        if not 0 <= jitter < 1:
            raise ValueError(f"{what}: jitter must be in [0, 1), got {self.jitter!r}")
        seed = V.integer(what, "seed", self.seed)
        message = np.broadcast_to(message, (n, n)).copy()
        queue = self.queue
        if queue is None:
            fastest = compute.min() * (1 - jitter)
            queue = int(math.ceil(message.max() / fastest)) + 2
        queue = V.integer(what, "queue", queue, minimum=1)
        return _clock.Timing(compute, message, jitter, seed, queue)


def simulate(fn: Callable, topology_or_n: T.Topology | T.Schedule | int, *,
             local_size: int = 1,
             machine_topology: T.Topology | None = None, in_axes: Any = 0,
             out_axes: Any = 0, axis_name: str = AGENT_AXIS,
             delays: Delays | None = None, mesh: Any = None) -> Callable:
    """Runs the per-agent function ``fn`` for n agents in this process.

    Args:
      fn: per-agent code, exactly as it runs under ``jaxfog run`` (it may call
        ``jaxfog.rank()``, ``size()`` and every op, and need not call ``init``).
      topology_or_n: the agents' topology (``load_topology()`` inside ``fn``):
        a ``Topology``; a ``Schedule``, which ops without ``topology=`` then
        follow at the ``step=`` they are given (a step is required); or n for
        ``exponential(n)``.
      local_size: agents per simulated machine (for ``local_rank``,
        ``machine_rank`` and hierarchical averaging); must divide n.
      machine_topology: default ``exponential(n // local_size)``.
      in_axes, out_axes: as for ``jax.vmap`` (the agent axis).
      axis_name: name of the agent axis.
      delays: a :class:`Delays` model: the agents run in simulated time
        (their clocks start at 0 and carry over between simulated calls, like
        windows, until :func:`reset_clocks`).
      mesh: a ``jax.sharding.Mesh``: the agents live on its devices, one per
        device along ``axis_name`` (the only axis of a one-axis mesh, e.g.
        :func:`jaxfog.mesh.agent_mesh`), and every op is a collective over
        that mesh axis (``shard_map``); the values are the vmapped
        simulation's. The devices may belong to several processes
        (:func:`jaxfog.mesh.init_distributed`); arguments are then global
        arrays (``Agents(mesh=...).data``). ``in_axes`` entries must be 0 or
        None and ``out_axes`` 0.

    Returns:
      A function of stacked per-agent arguments; jit it, grad it, scan it.

    Example::

        def agent(x):  # the same code runs under `jaxfog run -np 8`
            return jaxfog.neighbor_allreduce(x) + jaxfog.rank()

        X = jnp.arange(8.0)[:, None] * jnp.ones((8, 3))  # row r: agent r's value
        Y = jax.jit(jaxfog.simulate(agent, jaxfog.topology.ring(8)))(X)
    """
    what = "jaxfog.simulate"
    V.function(what, "fn", fn)
    if isinstance(topology_or_n, (T.Topology, T.Schedule)):
        topology = topology_or_n
    elif isinstance(topology_or_n, (int, np.integer)) and not isinstance(topology_or_n, bool):
        topology = T.exponential(V.integer(what, "the number of agents", topology_or_n,
                                           minimum=1))
    else:
        raise TypeError(f"{what}: needs a Topology, a Schedule or a number of agents, got "
                        f"{type(topology_or_n).__name__} {topology_or_n!r}")
    n = topology.size
    local_size = V.integer(what, "local_size", local_size)
    if local_size < 1 or n % local_size:
        raise ValueError(f"{what}: local_size={local_size!r} must be a positive divisor "
                         f"of the number of agents {n}")
    machines = n // int(local_size)
    machine_topology = T.exponential(machines) if machine_topology is None else machine_topology
    if not isinstance(machine_topology, T.Topology):
        raise TypeError(f"{what}: machine_topology must be a Topology, got "
                        f"{type(machine_topology).__name__} {machine_topology!r}")
    if machine_topology.size != machines:
        raise ValueError(f"{what}: machine_topology must be a Topology over {machines} "
                         f"machines, got one of size {machine_topology.size}")
    inner = {}
    if mesh is not None:
        axis_name = agents_mesh.agent_axis(mesh, n,
                                           None if axis_name == AGENT_AXIS else axis_name)
        per_device = n // mesh.shape[axis_name]
        inner = {"inner_axis": INNER_AXIS if per_device > 1 else None, "inner_size": per_device,
                 "on_mesh": True}
    simulation = _context.Simulation(axis_name, n, topology, int(local_size), machine_topology,
                                     backend=SimulatedBackend, **inner)
    if delays is not None and not isinstance(delays, Delays):
        raise TypeError(f"{what}: delays must be a jaxfog.Delays, got {type(delays).__name__}")
    timing = None if delays is None else delays._resolve(n)
    if mesh is not None:
        return _on_mesh(fn, mesh, simulation, timing, in_axes, out_axes, topology_or_n)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        # Arrays placed on a mesh with Explicit axes (jax.make_mesh's default)
        # carry their sharding in their type, and vmap would shard the agent
        # axis by it with no mesh to resolve it: run the agents with those
        # axes Auto (XLA partitions as it likes, nothing moves) and give the
        # outputs the inputs' agent sharding back.
        explicit = agents_mesh.explicit_input_mesh((args, kwargs))
        if explicit is None:
            return run_vmapped(*args, **kwargs)
        out_spec = PartitionSpec(_agent_entry(args, in_axes)) if out_axes == 0 else (
            PartitionSpec())
        # auto_axes needs the mesh in context (jax.set_mesh may have put it there).
        with (jax.sharding.use_abstract_mesh(explicit)
              if jax.sharding.get_abstract_mesh().empty else contextlib.nullcontext()):
            return jax.sharding.auto_axes(lambda a, k: run_vmapped(*a, **k),
                                          axes=explicit.explicit_axes,
                                          out_sharding=out_spec)(args, kwargs)

    def run_vmapped(*args, **kwargs):
        # The windows that exist go in as this call's references (one view per
        # agent); the ones it creates come out as stacked states, kept after.
        refs = _windows.kept_refs()
        clocks = None if timing is None else _clock.kept(n)
        sessions = []

        def per_agent(refs, now, *args, **kwargs):
            with _context.simulating(simulation), _windows.bound(refs) as session, \
                    _clock.bound(timing, now):
                out = fn(*args, **kwargs)
            sessions.append(session)
            return out, _windows.created_states(session)

        axes = (0, 0, *in_axes) if isinstance(in_axes, (tuple, list)) else (
            (0, 0) + (in_axes,) * len(args))
        _check_agent_axes(args, axes[2:], n, topology_or_n)
        out, created = jax.vmap(per_agent, in_axes=axes, out_axes=(out_axes, 0),
                                axis_name=axis_name, axis_size=n)(refs, clocks, *args,
                                                                  **kwargs)
        session = sessions[-1]
        _windows.keep({name: session.windows[name].spec for name in created}, created,
                     session.freed)
        return out

    return run


def _agent_entry(args: tuple, in_axes: Any) -> Any:
    """The mesh axes (a PartitionSpec entry) that the first argument with an
    explicit sharding shards its agent axis along, else None."""
    axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    for arg, axis in zip(args, axes):
        if not isinstance(axis, int):
            continue
        for leaf in jax.tree.leaves(arg):
            if isinstance(leaf, jax.Array) and jax.typeof(leaf).sharding.mesh.explicit_axes:
                spec = jax.typeof(leaf).sharding.spec
                return spec[axis] if -len(spec) <= axis < len(spec) else None
    return None


def _on_mesh(fn: Callable, mesh: Any, simulation: _context.Simulation, timing: Any,
             in_axes: Any, out_axes: Any, given: Any) -> Callable:
    """``simulate`` on the devices of ``mesh``: ``shard_map`` over the mesh
    axis, and inside it a vmap over the device's agents (one, or n / devices).
    Windows and clocks live in references, which do not cross ``shard_map``:
    their values go in, each device works on fresh references to its rows,
    and the final values are written back."""
    axis, n, per_device_count = simulation.axis_name, simulation.size, simulation.inner_size
    if out_axes != 0:
        raise ValueError("simulate: with mesh=, out_axes must be 0 (the agents along the mesh)")
    spec, whole = PartitionSpec(axis), PartitionSpec()
    extra_axes = frozenset(mesh.axis_names) - {axis}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        if len(axes) != len(args) or any(a not in (0, None) for a in axes):
            raise ValueError(f"simulate: with mesh=, in_axes must be 0 or None for each of the "
                             f"{len(args)} arguments, got {in_axes!r}")
        _check_agent_axes(args, axes, n, given)
        args = tuple(agents_mesh.place(arg, mesh, spec if a == 0 else whole, f"argument {i}")
                     for i, (arg, a) in enumerate(zip(args, axes)))
        kwargs = agents_mesh.place(kwargs, mesh, spec, "a keyword argument")
        with _clock.placed(NamedSharding(mesh, spec)):
            return call(axes, *args, **kwargs)

    def call(axes, *args, **kwargs):
        refs = _windows.kept_refs()
        clocks = None if timing is None else _clock.kept(n)
        values = agents_mesh.place(jax.tree.map(lambda r: r[...], (refs, clocks)), mesh, spec,
                                   "a window")
        sessions = []

        def per_agent(refs, now, kwargs, *args):
            with _context.simulating(simulation), _windows.bound(refs) as session, \
                    _clock.bound(timing, now):
                out = fn(*args, **kwargs)
            sessions.append(session)
            return out, _windows.created_states(session)

        def per_device(values, kwargs, *args):  # this device's agents, vmapped
            refs, now = jax.tree.map(jax.new_ref, values)
            out, created = jax.vmap(per_agent, in_axes=(0, 0, 0, *axes),
                                    axis_name=INNER_AXIS, axis_size=per_device_count)(
                refs, now, kwargs, *args)
            return out, created, jax.tree.map(lambda r: r[...], (refs, now))

        mapped = jax.shard_map(
            per_device, mesh=mesh, in_specs=(spec, spec, *(spec if a == 0 else whole
                                                           for a in axes)),
            out_specs=spec, check_vma=False,
            **({"axis_names": frozenset({axis})} if extra_axes else {}))
        out, created, finals = mapped(values, kwargs, *args)
        jax.tree.map(lambda r, v: r.__setitem__(Ellipsis, v), (refs, clocks), finals)
        _windows.keep({name: sessions[-1].windows[name].spec for name in created}, created,
                     sessions[-1].freed)
        return out

    return run


def _check_agent_axes(args: tuple, axes: tuple, n: int, given: Any) -> None:
    """A ValueError naming the argument whose agent axis is not n long (vmap
    would fail deep inside a collective); nested ``in_axes`` are left to vmap."""
    for i, (arg, axis) in enumerate(zip(args, axes)):
        if not isinstance(axis, int):
            continue
        for leaf in jax.tree.leaves(arg):
            shape = np.shape(leaf)
            if not -len(shape) <= axis < len(shape) or shape[axis] != n:
                where = "topology" if not isinstance(given, (int, np.integer)) else "number"
                raise ValueError(
                    f"simulate: the {where} has {n} agents but argument {i} has "
                    + (f"{shape[axis]} along its agent axis {axis} (shape {shape})"
                       if -len(shape) <= axis < len(shape) else
                       f"no axis {axis} (shape {shape})")
                    + f"; give every agent's value stacked along axis {axis}, or a "
                    "topology of that size")


def reset_clocks() -> None:
    """Sets the simulated agents' clocks (``simulate(..., delays=...)``) back to 0."""
    _clock.reset()


def _inexact(value: Any) -> jax.Array:
    """``value`` as ``jnp.mean`` averages it: integers in the default float dtype."""
    x = jnp.asarray(value)
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(
        jax.dtypes.canonicalize_dtype(jnp.float64))


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
      mesh: run the agents on a device mesh instead, one per device
        (``simulate(mesh=...)``): a ``jax.sharding.Mesh``, or True for every
        device of every process of the job (:func:`jaxfog.mesh.init_distributed`
        starts ``jax.distributed`` under ``jaxfog run``, then
        :func:`jaxfog.mesh.agent_mesh`). ``data`` then builds global arrays from
        each process's own agents.
      per_device: agents per device of the mesh.

    Attributes:
      simulated: True when the agents' values are stacked along a leading axis
        (simulated in this process: a plain ``python`` with ``simulated > 1``,
        or on a mesh), False for one agent per MPI process.
      mesh: the agents' mesh, or None.
      size: the number of agents.
      topology: the agents' topology.
    """

    def __init__(self, simulated: int = 4, topology: Any = None, *, local_size: int = 1,
                 mesh: Any = None, per_device: int = 1):
        what = "jaxfog.Agents"
        simulated = V.integer(what, "simulated", simulated, minimum=1)
        local_size = V.integer(what, "local_size", local_size, minimum=1)
        per_device = V.integer(what, "per_device", per_device, minimum=1)
        self.mesh = None
        if mesh is not None and mesh is not False:
            if mesh is True:
                agents_mesh.init_distributed()
                mesh = agents_mesh.agent_mesh()
            names = tuple(getattr(mesh, "axis_names", ()))
            axis = names[0] if len(names) == 1 else agents_mesh.AXIS
            self.size = dict(getattr(mesh, "shape", {})).get(axis, 0) * per_device
            self._axis = agents_mesh.agent_axis(mesh, self.size, axis)
            self.mesh, self.simulated = mesh, True
        else:
            runtime.init()
            self.simulated = runtime.size() == 1 and simulated > 1
            self.size = simulated if self.simulated else runtime.size()
        if callable(topology) and not isinstance(topology, (T.Topology, T.Schedule)):
            topology = topology(self.size)
        V.topology(what, topology, schedule=self.simulated)
        if self.simulated and self.size % local_size:
            raise ValueError(f"{what}: local_size={local_size} must be a positive divisor of "
                             f"the number of agents {self.size}")
        self.topology = T.exponential(self.size) if topology is None else topology
        self.local_size = local_size
        if not self.simulated:
            runtime.set_topology(self.topology)

    @property
    def is_root(self) -> bool:
        """True in the process that should print (rank 0, or the simulation)."""
        if self.mesh is not None:
            return jax.process_index() == 0
        # Not simulated: an MPI process's rank, an int.
        return self.simulated or cast(int, runtime.rank()) == 0

    def data(self, make: Callable[[int], Any]) -> Any:
        """``make(rank)`` for this process's agent, or stacked over all agents.

        ``make`` may return an array or any pytree of arrays (a tuple ``(x, y)``
        comes back as a tuple of arrays, each stacked over the agents when
        simulated)."""
        if not self.simulated:
            # An MPI process's rank: an int.
            return jax.tree.map(jnp.asarray, make(cast(int, runtime.rank())))
        if self.mesh is not None:
            return agents_mesh.global_array(self.mesh, self._axis, make, self.size)
        values = [make(r) for r in range(self.size)]
        return jax.tree.map(lambda *leaves: jnp.stack([jnp.asarray(v) for v in leaves]),
                            *values)

    def map(self, fn: Callable, *, in_axes: Any = 0, out_axes: Any = 0) -> Callable:
        """``fn`` jitted for one agent (MPI, with ``jaxfog.jit``) or for all
        agents (simulation)."""
        if not self.simulated:
            return jit(fn)
        axis: dict[str, Any] = {} if self.mesh is None else {"axis_name": self._axis}
        return jax.jit(simulate(fn, self.topology, local_size=self.local_size,
                                in_axes=in_axes, out_axes=out_axes, mesh=self.mesh, **axis))

    def gather(self, value: Any) -> Any:
        """Every agent's value of a per-agent array (or pytree), stacked along a
        leading axis of ``size``, as numpy, the same on every process;
        collective under MPI and on a mesh of several processes."""
        if self.mesh is not None:
            every = jax.jit(lambda v: v, out_shardings=agents_mesh.replicated(self.mesh))(value)
            return jax.tree.map(np.asarray, every)
        if self.simulated:
            return jax.tree.map(np.asarray, value)
        gathered = allgather(jax.tree.map(lambda v: jnp.reshape(v, (-1,)), value))
        return jax.tree.map(lambda g, v: np.asarray(g).reshape(self.size, *np.shape(v)),
                            gathered, value)

    def mean(self, value: Any) -> Any:
        """The average over agents of a per-agent value (an array or a pytree of
        arrays, e.g. a Flax NNX ``State``), as numpy leaves in the same
        structure, the same on every rank; collective under MPI. Floating and
        complex leaves keep their dtype; integer leaves (an optimizer's step
        counter) are averaged in JAX's default float dtype, as ``jnp.mean``
        does, on every backend."""
        leaves, treedef = jax.tree.flatten(value)
        for leaf in leaves:
            if not (isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float))
                    and jnp.issubdtype(jnp.result_type(leaf), jnp.number)):
                raise TypeError("Agents.mean: needs numbers, arrays or a pytree of them, "
                                f"got a leaf of type {type(leaf).__name__}")
        if self.mesh is not None:  # global arrays: the mean, replicated on every device
            means = jax.jit(lambda *vs: [jnp.mean(jnp.asarray(v), axis=0) for v in vs],
                            out_shardings=agents_mesh.replicated(self.mesh))(*leaves)
            means = [np.asarray(m) for m in means]
        elif self.simulated:
            means = [np.asarray(jnp.mean(jnp.asarray(v), axis=0)) for v in leaves]
        else:
            means = [np.asarray(v) for v in allreduce([_inexact(v) for v in leaves])]
        return jax.tree.unflatten(treedef, means)


__all__ = ["AGENT_AXIS", "INNER_AXIS", "Agents", "Delays", "reset_clocks", "simulate"]
