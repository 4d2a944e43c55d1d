"""Agents on a JAX device mesh: one or more agents per device, in one process or many.

``jaxfog.simulate(fn, topology, mesh=mesh)`` runs the per-agent function with
the agent axis laid on a mesh axis: each device holds one agent (or n / devices
consecutive agents, vmapped), and every op is the simulation backend's ``lax``
collective over that axis, which XLA lowers
to the platform's own (NCCL between GPUs, the interconnect between TPUs, gloo
between CPU processes). Nothing else changes: the same per-agent code, the
same values as the vmapped simulation, composable with ``jit``, ``grad`` and
``scan``. Across processes, :func:`init_distributed` starts JAX's
multi-controller runtime and each process contributes its local devices to
one global mesh (:func:`agent_mesh`); :class:`jaxfog.Agents` with ``mesh=``
builds the global arrays from each process's agents.

The mesh runs in lockstep (SPMD): one program on every device, collectives
where the code has them. The MPI/NCCL custom calls (``jaxfog run`` without a
mesh) overlap communication with compute, have truly one-sided windows and
let agents run at their own pace; the mesh runs wherever JAX runs.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
import socket
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxfog.errors import JaxfogError

#: The mesh axis that holds the agents (``agent_mesh``'s, and what
#: ``simulate(mesh=...)`` looks for when the mesh has several axes).
AXIS = "agents"


def _launched_processes() -> tuple[int, int] | None:
    """(rank, size) of this process under an MPI launcher with several
    processes, else None; without initialising MPI where no launcher is seen."""
    markers = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "HYDI_CONTROL_FD",
               "MPI_LOCALNRANKS")
    if not any(m in os.environ for m in markers):
        return None
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return (comm.Get_rank(), comm.Get_size()) if comm.Get_size() > 1 else None


def init_distributed(*, coordinator: str | None = None, cpu_collectives: str = "gloo") -> int:
    """Starts ``jax.distributed`` for the processes of this job; returns their number.

    Under ``jaxfog run -np N`` (or any MPI launcher) rank 0 picks a free port and
    tells the others over MPI; elsewhere (e.g. Slurm) JAX's own detection is
    used. On CPU, collectives between processes use ``cpu_collectives``
    ("gloo"). Call it first, before anything asks JAX for its devices. A
    single process, or a second call, does nothing.
    """
    if jax.distributed.is_initialized():
        return jax.process_count()
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    launched = _launched_processes()
    if launched is None and coordinator is None:
        if any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri")):
            jax.distributed.initialize()
        return jax.process_count()
    rank, size = launched if launched is not None else (None, None)
    if coordinator is None:
        from mpi4py import MPI

        if rank == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
            coordinator = f"{socket.gethostname()}:{port}"
        coordinator = MPI.COMM_WORLD.bcast(coordinator, root=0)
    if launched is not None:
        from mpi4py import MPI

        # Decided before JAX starts: asking JAX for its devices starts the
        # GPU client, whose start-up is collective across the processes; 4
        # processes sharing one H200 hung there, never reaching a check made
        # after it.
        refusal = shared_gpus(MPI.COMM_WORLD.allgather(gpu_identity()))
        if refusal is not None:  # every process alike: none waits alone in a collective
            raise JaxfogError(f"jaxfog.mesh.init_distributed: {refusal}")
    jax.distributed.initialize(coordinator, num_processes=size, process_id=rank)
    return jax.process_count()


def gpu_identity() -> tuple[str, list[str]] | None:
    """(host, the physical GPUs this process's JAX will drive), or None off the GPU.

    Decided without starting JAX's backend (which must wait for
    ``jax.distributed``): JAX runs on the GPU when ``jax_platforms`` names
    one first, or, unset, when a CUDA plugin is installed and the NVIDIA
    driver lists a GPU; it then drives every GPU in CUDA_VISIBLE_DEVICES
    (``jaxfog run`` gives each local rank one), else every GPU of the host."""
    # jax.config's options are attributes it sets at run time (untyped).
    setting = jax.config.jax_platforms or ""  # type: ignore[attr-defined]
    platforms = [p.strip() for p in setting.split(",") if p.strip()]
    if platforms and platforms[0] not in ("cuda", "gpu"):
        return None
    if not platforms and not _cuda_plugin_installed():
        return None
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        gpus = [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    else:
        driver = Path("/proc/driver/nvidia/gpus")
        gpus = [str(i) for i in range(len(list(driver.iterdir())))] if driver.is_dir() else []
    return (socket.gethostname(), gpus) if gpus else None


def _cuda_plugin_installed() -> bool:
    """Whether JAX finds a CUDA PJRT plugin (a ``jax_plugins`` module or entry point)."""
    try:
        import jax_plugins
    except ImportError:
        names = []
    else:
        names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    names += [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    return any("cuda" in name for name in names)


def shared_gpus(identities: Sequence[tuple[str, list[str]] | None]) -> str | None:
    """Why these processes cannot form one GPU mesh, or None.

    XLA's collectives between GPUs are NCCL's, and NCCL takes one process per
    GPU: processes that share one fail at their first collective (the digits
    demo on 4 processes and one H200: "Duplicate GPU detected"), some after
    others already wait in it. Decided from every process's
    :func:`gpu_identity`, before any collective."""
    owner: dict[tuple[str, str], int] = {}
    for process, identity in enumerate(identities):
        if identity is None:
            continue
        host, gpus = identity
        for gpu in gpus:
            if (host, gpu) in owner:
                return (f"processes {owner[host, gpu]} and {process} share GPU {gpu} on "
                        f"{host}, and XLA's GPU collectives (NCCL) take one process per GPU: "
                        "launch at most one process per GPU, or run the agents in one "
                        "process, several per device (jaxfog.Agents(mesh=True, "
                        "per_device=k), simulate(mesh=...) with k agents per device)")
            owner[host, gpu] = process
    return None


def agent_mesh(devices: Sequence[Any] | None = None, *, axis_name: str = AXIS) -> Mesh:
    """A one-axis mesh of ``devices`` (default: every device of every process,
    process by process): agent i on the mesh's device i."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("agent_mesh: no devices")
    return Mesh(np.array(devices), (axis_name,))


def agent_axis(mesh: Any, n: int, axis_name: str | None) -> str:
    """The mesh axis that holds ``n`` agents: ``axis_name`` if given, the only
    axis of a one-axis mesh, else :data:`AXIS`. Clear errors for a mesh that
    is not one, lacks the axis, or whose axis does not fit n agents."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"simulate: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    axis = axis_name if axis_name is not None else names[0] if len(names) == 1 else AXIS
    if axis not in names:
        raise ValueError(f"simulate: the mesh has no axis {axis!r} (its axes: {list(names)}); "
                         "name the agents' axis with axis_name=")
    devices = mesh.shape[axis]
    if n < 1 or n % devices:
        raise ValueError(f"simulate: {n} agents on a mesh axis of {devices} devices: each "
                         "device holds the same number of agents, so the topology needs a "
                         f"multiple of {devices} agents")
    return axis


def place(tree: Any, mesh: Mesh, spec: PartitionSpec, what: str) -> Any:
    """``tree``'s leaves laid out as ``NamedSharding(mesh, spec)`` where
    ``shard_map`` needs it. On a mesh with Explicit axes (``jax.make_mesh``'s
    default) ``shard_map`` takes only inputs already typed with its in_specs,
    so every leaf is resharded (a no-op for one already there, also under
    ``jit``); elsewhere ``shard_map`` moves what it gets. A concrete array on
    devices outside the mesh is moved onto a mesh this process holds whole,
    and refused (naming the cure) on a mesh of several processes, where only
    a global array says which process holds which agents' rows."""
    sharding = NamedSharding(mesh, spec)
    whole = all(d.process_index == jax.process_index() for d in mesh.devices.flat)
    inside = set(mesh.devices.flat)

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not (
                x.sharding.device_set <= inside):
            if not whole:
                outside = sorted(str(d) for d in x.sharding.device_set - inside)
                raise ValueError(f"simulate: {what} is on {', '.join(outside)}, outside the "
                                 "agents' mesh; jax.device_put it onto the mesh (or build it "
                                 "with jaxfog.Agents(mesh=...).data)")
            return jax.device_put(x, sharding)
        return jax.sharding.reshard(x, sharding) if mesh.explicit_axes else x

    return jax.tree.map(leaf, tree)


def explicit_input_mesh(tree: Any) -> Any:
    """The (abstract) mesh of the first leaf typed with an Explicit mesh axis
    (an array placed on a ``jax.make_mesh`` mesh, concrete or traced), else None."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            m = jax.typeof(x).sharding.mesh
            if m.explicit_axes:
                return m
    return None


def global_array(mesh: Mesh, axis: str, make: Any, n_agents: int | None = None) -> Any:
    """The (n, ...) array whose row i is ``make(i)``, sharded along ``axis``
    (n / devices consecutive agents per device); each process makes only its
    own devices' rows."""
    devices = list(mesh.devices.flat)
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    n = n_agents or len(devices)
    if n % len(devices):
        raise ValueError(f"{n} agents on {len(devices)} devices: give a multiple")
    k = n // len(devices)
    mine = [(p, d) for p, d in enumerate(devices) if d.process_index == jax.process_index()]
    rows = {i: make(i) for p, _ in mine for i in range(p * k, (p + 1) * k)}
    leaves, treedef = jax.tree.flatten(next(iter(rows.values())))
    out = []
    for l, leaf in enumerate(leaves):
        pieces = [jax.device_put(np.stack([np.asarray(jax.tree.leaves(rows[i])[l])
                                           for i in range(p * k, (p + 1) * k)]), d)
                  for p, d in mine]
        out.append(jax.make_array_from_single_device_arrays(
            (n, *np.shape(leaf)), sharding, pieces))
    return jax.tree.unflatten(treedef, out)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


__all__ = ["AXIS", "agent_mesh", "init_distributed"]
