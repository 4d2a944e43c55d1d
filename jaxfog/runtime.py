"""Process runtime: MPI initialisation, ranks, machines and the current topology.

``init()`` initialises MPI through mpi4py with ``MPI_THREAD_MULTIPLE`` (XLA may
run communicating custom calls from several threads), duplicates
``COMM_WORLD`` so that jaxfog's traffic never mixes with the user's, hands the
duplicate to the C++ FFI library and sets the default topology. It works under
a launcher (``jaxfog run``, ``mpiexec``, ``srun``) and as size 1 under a plain
``python``. ``shutdown()`` runs at exit.

Machines: ``local_rank``/``local_size`` count the ranks sharing a node (an
``MPI_COMM_TYPE_SHARED`` split). ``machine_rank`` numbers the nodes in the
order of their lowest world rank, so on homogeneous clusters with block rank
placement ``machine_rank == rank // local_size``. Tests fake a grouping with
``JAXFOG_NODES_PER_MACHINE=k`` (BlueFog's ``BLUEFOG_NODES_PER_MACHINE`` is
honoured too): ranks ``[m*k, (m+1)*k)`` then form machine ``m``.

``mpi4py.MPI`` initialises MPI when imported, so it is imported inside the
functions that run once ``init()`` has set the thread level (and the FFI
library has chosen the ``libmpi``), never when ``jaxfog`` is imported.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import hashlib
import os
import subprocess
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from jaxfog import _context, _interrupt, ffi
from jaxfog.ffi import _nccl_setup
from jaxfog import _validate as V
from jaxfog import topology as T
from jaxfog.errors import BackendError, NotInitializedError

if TYPE_CHECKING:  # annotations only: importing jaxfog does not import JAX
    import jax

#: Environment variables that fake the machine grouping (first one set wins).
NODES_PER_MACHINE_ENV = ("JAXFOG_NODES_PER_MACHINE", "BLUEFOG_NODES_PER_MACHINE")
#: Seconds a communicating op may wait for a peer before failing; 0 disables.
TIMEOUT_ENV = "JAXFOG_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 600.0
#: Seconds ``init`` waits in MPI_Init for every rank of the job to join (a host
#: that never starts its ranks leaves the others there); 0 disables. Its own
#: setting, since ranks join as slowly as their launch (imports on a busy
#: machine), which has nothing to do with how long a peer may take in an op.
INIT_TIMEOUT_ENV = "JAXFOG_INIT_TIMEOUT"
DEFAULT_INIT_TIMEOUT_SECONDS = 600.0
#: Seconds after which an op still waiting says, once, on stderr, what it waits
#: for (op, sequence number, peers); the error still comes at the timeout.
WARN_AFTER_ENV = "JAXFOG_WARN_AFTER"
DEFAULT_WARN_AFTER_SECONDS = 30.0
#: Largest single MPI message; bigger ones travel in pieces (MPI counts are ints).
MAX_MESSAGE_ENV = "JAXFOG_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
#: Messages of at least this many bytes are sent from jaxfog's communication
#: thread, so that XLA runs the work that does not need them meanwhile (awc's
#: exchange beside the backward pass); smaller ones run inline, where handing
#: them over would cost more than it hides. ``off`` runs everything inline.
#: Unset: ``COMM_THREAD_MIN_BYTES`` when every rank of this machine has two cores (MPI
#: progresses only while polled, so the thread needs a core of its own), else off.
COMM_THREAD_MIN_BYTES_ENV = "JAXFOG_COMM_THREAD_MIN_BYTES"
COMM_THREAD_MIN_BYTES = 1 << 16
#: Its name until 0.1 (read when the new one is unset, with a FutureWarning).
_OLD_COMM_THREAD_MIN_BYTES_ENV = "JAXFOG_ASYNC_MIN_BYTES"
#: ``1``: an exchange ends only when every peer it sent to has received all of
#: it (an empty receipt from each), so that the next exchange's flows do not
#: start while this one's still drain from the network stack. For slow links
#: with shallow queues, where the two would lose packets to each other; it
#: costs a round trip of empty messages per exchange. The same on every rank.
SEND_RECEIPTS_ENV = "JAXFOG_SEND_RECEIPTS"
#: Bytes of freed memory the process keeps mapped instead of handing back to
#: the kernel (glibc), so that XLA's fresh output buffers and MPI's temporaries
#: reuse warm pages; ``0`` leaves malloc as it is.
KEEP_FREED_BYTES_ENV = "JAXFOG_KEEP_FREED_BYTES"
KEEP_FREED_BYTES = 512 << 20
#: Bytes of free scratch buffers (received messages, packed copies) jaxfog's
#: C++ library keeps for reuse; larger or older ones are freed (scratch.h).
SCRATCH_KEEP_BYTES_ENV = "JAXFOG_SCRATCH_KEEP_BYTES"
SCRATCH_KEEP_BYTES = 256 << 20
#: Bytes of free pinned host buffers kept for host-staged ops on GPU arrays
#: (pinning is slow, and pageable copies run at half the rate).
STAGING_KEEP_BYTES_ENV = "JAXFOG_STAGING_KEEP_BYTES"
STAGING_KEEP_BYTES = 2 << 30

#: Set in a rank by ``jaxfog run``'s per-rank shim (``jaxfog/cli/_launcher.py``):
#: its path, so that :func:`grow` starts the newcomers as ``jaxfog run`` started the
#: ranks (their environment, whole lines of output).
RANK_SHIM_ENV = "JAXFOG_RANK_SHIM"
#: Set by ``jaxfog run --max-restarts`` in the ranks: its control file. Rank 0
#: writes ``<file>.started`` once MPI is up, so that the launcher tells a job
#: that ran from a launch that failed before any rank started.
ELASTIC_CONTROL_ENV = "JAXFOG_ELASTIC_CONTROL"

# Communicator ids in the C++ registry: the world duplicate, the ranks of this
# machine, and the machines' local rank 0s (registered on those ranks only).
WORLD_COMM_ID = 0
LOCAL_COMM_ID = 1
LEADERS_COMM_ID = 2


@dataclasses.dataclass
class _State:
    comm: Any  # mpi4py.MPI.Intracomm, duplicate of COMM_WORLD: the C++ transport's
    comms: dict  # registered communicators by id (world, local, leaders)
    # Another duplicate, for collectives issued from Python (set-up, checks,
    # windows, checkpoints): MPI orders the collectives of one communicator only
    # when every rank issues them in the same order, and an asynchronously
    # dispatched step may be in a collective on the transport's from another
    # thread while Python issues one.
    python_comm: Any
    # Another duplicate, for the goodbyes ranks send when they shut down, so
    # that a peer's wait for a rank that left fails at once (ffi/peer_watch.h).
    peers_comm: Any
    rank: int
    size: int
    local_rank: int
    local_size: int
    machine_rank: int
    machine_size: int
    homogeneous: bool
    timeout: float
    gpu_backend: str | None  # "nccl", "mpi" (host staging) or None (no GPU)
    topology: T.Topology
    machine_topology: T.Topology


_state: _State | None = None
#: Whether :func:`shrink` or :func:`grow` rebuilt jaxfog in this process, or it
#: joined a running job (spawned by :func:`grow`): it then ends as survivors do.
_shrunk = False
#: Whether this process joined a running job: spawned by :func:`grow`.
_joined = False
#: Seconds MPI_Finalize may take at exit after a shrink, once every survivor
#: reached its exit: Open MPI 5.0.11's waits forever in about 1 exit of 12.
_EXIT_BOUND_AFTER_SHRINK_SECONDS = 5.0
#: The least MPI_Finalize may take at exit after an op failed (JAXFOG_TIMEOUT
#: if longer): a short JAXFOG_TIMEOUT bounds waits for peers, not MPI's own
#: finalization, which took over 1.5 s on 2 loaded cores.
_EXIT_BOUND_AFTER_FAILURE_SECONDS = 5.0
#: The status a process so bounded ends with: its work is done (0), or it
#: stops to be relaunched (jaxfog.elastic sets RESCALE_EXIT_STATUS), and then
#: ends without MPI_Finalize, once every survivor is there: the job is over
#: either way, and Open MPI 5.0.11's waited out its bound at every such exit
#: on the rig (5 s of a host's join).
_exit_status_after_shrink = 0
# What shutdown() runs, stage by stage in this order, each hook even if an
# earlier one failed (registered by the layers above with on_shutdown):
# "fence": wait for dispatched computations that still communicate;
# "discard": forget the nonblocking ops never waited for (after the fence);
# "release": collective clean-up that is no op, such as freeing windows, after
# this rank said goodbye (every op of its has finished by then) and before the
# communicators are released. Were it before the goodbye, a rank blocked there by
# a peer stuck in an op waiting for it would leave that peer to wait until
# JAXFOG_TIMEOUT;
# "abandon": run by shrink() in place of "release": forget what only a
# collective over the revoked communicator could free (windows).
_SHUTDOWN_STAGES = ("fence", "discard", "release", "abandon")
_shutdown_hooks: dict[str, list[Callable[[], None]]] = {stage: [] for stage in _SHUTDOWN_STAGES}


def on_shutdown(stage: str, hook: Callable[[], None]) -> None:
    """Runs ``hook`` at :func:`shutdown`'s ``stage`` (see ``_SHUTDOWN_STAGES``)."""
    _shutdown_hooks[stage].append(hook)


def _run_shutdown_hooks(stage: str) -> None:
    for hook in _shutdown_hooks[stage]:
        try:
            hook()
        except Exception as error:  # e.g. a peer died: the next hooks and the release run
            warnings.warn(f"jaxfog.shutdown ({stage}): {error}", RuntimeWarning)
# Bumped whenever a topology changes; the ops layer registers a listener
# that keys JAX's jit caches on it (see jaxfog.ops._primitive_machinery).
_topology_generation = 0
_topology_listeners: list[Callable[[int], None]] = []


def topology_generation() -> int:
    """How many times a topology has been set in this process."""
    return _topology_generation


def _topology_changed() -> None:
    global _topology_generation
    _topology_generation += 1
    for listener in _topology_listeners:
        listener(_topology_generation)


def _require() -> _State:
    if _state is None:
        raise NotInitializedError(
            "jaxfog is not initialized: call jaxfog.init() before using ranks, "
            "topologies or communication ops")
    return _state


def _seconds_from_env(name: str, default: float, zero_means: str) -> float:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} must be >= 0 (0 {zero_means})")
    return value


def _timeout_from_env() -> float:
    return _seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS, "disables the timeout")


def _max_message_from_env() -> int:
    text = os.environ.get(MAX_MESSAGE_ENV, "")
    if not text:
        return DEFAULT_MAX_MESSAGE_BYTES
    if not text.isdigit() or not 1 <= int(text) < 2**31:
        raise ValueError(f"{MAX_MESSAGE_ENV}={text!r} must be an integer in [1, 2**31)")
    return int(text)


def _send_receipts_from_env(comm) -> bool:
    """JAXFOG_SEND_RECEIPTS, which every rank of ``comm`` must set alike: a
    rank that awaits receipts from one that sends none would wait until
    JAXFOG_TIMEOUT. Collective."""
    text = os.environ.get(SEND_RECEIPTS_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{SEND_RECEIPTS_ENV}={text!r} must be 1 (on) or 0 (off)")
    everyone = comm.allgather(text == "1")
    if len(set(everyone)) > 1:
        on = [r for r, value in enumerate(everyone) if value]
        raise ValueError(f"{SEND_RECEIPTS_ENV} must be the same on every rank: it is 1 on "
                         f"ranks {on} only; export it to all (mpiexec -genv / -x)")
    return everyone[0]


def _comm_thread_min_bytes_from_env(local_size: int) -> int:
    """The communication thread's threshold for the C++ library; -1 means never."""
    name = COMM_THREAD_MIN_BYTES_ENV
    if name not in os.environ and _OLD_COMM_THREAD_MIN_BYTES_ENV in os.environ:
        name = _OLD_COMM_THREAD_MIN_BYTES_ENV
        warnings.warn(f"{name} is deprecated: set {COMM_THREAD_MIN_BYTES_ENV} (the same "
                      "setting; 'async' names jaxfog's asynchronous algorithms)",
                      FutureWarning, stacklevel=2)
    text = os.environ.get(name, "").strip().lower()
    if not text:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        return COMM_THREAD_MIN_BYTES if cores >= 2 * local_size else -1
    if text == "off":
        return -1
    if not text.isdigit():
        raise ValueError(f"{name}={text!r} must be a number of bytes "
                         "(0: every message) or 'off'")
    return int(text)


def _bytes_from_env(name: str, default: int, zero_means: str) -> int:
    """A number of bytes from environment variable ``name`` (``default`` if unset)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name}={text!r} must be a number of bytes (0: {zero_means})")
    return int(text)


def _faked_nodes_per_machine(size: int) -> int | None:
    for name in NODES_PER_MACHINE_ENV:
        text = os.environ.get(name)
        if text:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not an integer") from None
            if value < 1 or size % value:
                raise ValueError(
                    f"{name}={value} must be a positive divisor of the world size {size}")
            return value
    return None


def _machine_layout(comm) -> tuple[int, int, int, int, bool]:
    """(local_rank, local_size, machine_rank, machine_size, homogeneous)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    per_machine = _faked_nodes_per_machine(size)
    if per_machine is not None:
        return rank % per_machine, per_machine, rank // per_machine, size // per_machine, True
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
        leader = local.bcast(rank, root=0)  # lowest world rank on this node
    finally:
        local.Free()
    leaders, local_sizes = zip(*comm.allgather((leader, local_size)))
    machines = sorted(set(leaders))
    return (local_rank, local_size, machines.index(leader), len(machines),
            len(set(local_sizes)) == 1)


def _watch_peers(lib, comm, warn_after: float) -> None:
    error = ctypes.create_string_buffer(1024)
    if lib.jaxfog_watch_peers(comm.py2f(), warn_after, error, 1024):
        raise ffi.FfiLibraryError(f"jaxfog.init: {error.value.decode()}")


def _register(lib, comm_id: int, comm, timeout: float, max_message: int) -> None:
    error = ctypes.create_string_buffer(1024)
    if lib.jaxfog_register_mpi_comm(comm_id, comm.py2f(), timeout, max_message, error, 1024):
        raise ffi.FfiLibraryError(f"jaxfog.init: {error.value.decode()}")


#: The watchdog of ``_bounded_mpi_init``, a process of its own: MPI_Init runs
#: inside mpi4py.MPI's module initialisation, which holds the GIL, so no Python
#: thread of this process could act while it waits. It ends when its stdin
#: closes (MPI_Init returned, or this process died).
_INIT_WATCHDOG = """
import os, select, sys
if not select.select([0], [], [], float(sys.argv[1]))[0]:
    os.write(2, sys.argv[3].encode())
    os.kill(int(sys.argv[2]), 9)
"""


class _bounded_mpi_init:
    """Ends this process (SIGKILL, the reason on stderr) if MPI_Init (the
    block's import of mpi4py.MPI) has not returned after ``seconds``: it waits
    for every rank of the job, and a rank whose host never joins never comes,
    so without this bound the others would wait forever. The launcher knows
    which host is missing; MPI tells a rank nothing before MPI_Init returns."""

    watchdog: subprocess.Popen[bytes] | None

    def __init__(self, seconds: float):
        self.seconds, self.watchdog = seconds, None

    def __enter__(self) -> None:
        if self.seconds <= 0:
            return
        rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                             "SLURM_PROCID") if v in os.environ), "?")
        size = next((os.environ[v] for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                             "SLURM_NTASKS") if v in os.environ), "?")
        message = (f"jaxfog.init (rank {rank} of {size}): MPI_Init still waits after "
                   f"{self.seconds:g} s ({INIT_TIMEOUT_ENV}) for the other ranks of the job "
                   "to join; one never started (its host unreachable, or its launch failed "
                   "or hangs: see the launcher's output); ending this process\n")
        self.watchdog = subprocess.Popen(
            [sys.executable, "-S", "-c", _INIT_WATCHDOG, str(self.seconds), str(os.getpid()),
             message], stdin=subprocess.PIPE)

    def __exit__(self, *exc) -> None:
        if self.watchdog is not None:
            assert self.watchdog.stdin is not None  # stdin=PIPE
            self.watchdog.stdin.close()
            self.watchdog.wait()


def _setup(lib, base) -> None:
    """Sets jaxfog up over the processes of communicator ``base`` (``COMM_WORLD``
    at ``init``, the survivors' shrunk communicator after :func:`shrink`):
    duplicates of it for the C++ transports, Python's collectives and the peer
    watch, the machine layout, the default topology. Collective over ``base``."""
    from mpi4py import MPI

    timeout, max_message = _timeout_from_env(), _max_message_from_env()
    warn_after = _seconds_from_env(WARN_AFTER_ENV, DEFAULT_WARN_AFTER_SECONDS, "never warns")
    comm = base.Dup()
    comm.Set_name("jaxfog")
    comms = {WORLD_COMM_ID: comm}
    python_comm = base.Dup()
    python_comm.Set_name("jaxfog.python")
    peers_comm = base.Dup()
    peers_comm.Set_name("jaxfog.peers")
    try:
        _watch_peers(lib, peers_comm, warn_after)  # before the transports, which use it
        _interrupt.catch(lib)  # Ctrl-C ends an op's wait for a peer (jaxfog/_interrupt.py)
        local_rank, local_size, machine_rank, machine_size, homogeneous = _machine_layout(comm)
        rank = comm.Get_rank()
        # Communicator set-up is collective: all of it happens here, never in an op.
        comms[LOCAL_COMM_ID] = comm.Split(color=machine_rank, key=rank)
        leaders = comm.Split(color=0 if local_rank == 0 else MPI.UNDEFINED, key=rank)
        if leaders != MPI.COMM_NULL:
            comms[LEADERS_COMM_ID] = leaders
        for comm_id, member in comms.items():
            _register(lib, comm_id, member, timeout, max_message)
        gpu_backend = _nccl_setup.choose(_nccl_setup.has_cuda(), ffi.nccl_built(),
                                         _nccl_setup.requested())
        if gpu_backend == "nccl":
            checks = _nccl_setup.start_nccl(lib, comm, timeout, max_message)
            if checks is None:
                gpu_backend = "mpi"
            else:
                comms[_nccl_setup.NCCL_COMM_ID] = checks
        lib.jaxfog_set_comm_thread_min_bytes(_comm_thread_min_bytes_from_env(local_size))
        lib.jaxfog_set_send_receipts(_send_receipts_from_env(python_comm))
        keep = _bytes_from_env(KEEP_FREED_BYTES_ENV, KEEP_FREED_BYTES,
                               "leave malloc as it is")
        if keep:
            lib.jaxfog_keep_freed_memory(keep)
        lib.jaxfog_set_scratch_keep_bytes(_bytes_from_env(
            SCRATCH_KEEP_BYTES_ENV, SCRATCH_KEEP_BYTES, "keep no scratch buffer"))
        lib.jaxfog_set_staging_keep_bytes(_bytes_from_env(
            STAGING_KEEP_BYTES_ENV, STAGING_KEEP_BYTES, "keep no pinned staging buffer"))
        ffi.start_timeline(rank)  # JAXFOG_TIMELINE
    except BaseException:
        _release(lib, comms, python_comm, peers_comm)
        raise
    size = comm.Get_size()
    global _state
    _state = _State(comm=comm, comms=comms, python_comm=python_comm, peers_comm=peers_comm,
                    rank=rank, size=size,
                    local_rank=local_rank,
                    local_size=local_size, machine_rank=machine_rank,
                    machine_size=machine_size, homogeneous=homogeneous, timeout=timeout,
                    gpu_backend=gpu_backend,
                    topology=T.exponential(size), machine_topology=T.exponential(machine_size))
    _topology_changed()


def init(topology: T.Topology | Any | None = None) -> None:
    """Initialises MPI and jaxfog; collective over all ranks.

    Args:
      topology: the initial topology (a ``Topology`` or networkx graph);
        default ``topology.exponential(size())``. Calling ``init`` again
        only sets the topology if one is given.
    """
    global _state
    _check_topology_type(topology, "init")
    if _state is not None:
        if topology is not None:
            set_topology(topology)
        return
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    with _bounded_mpi_init(_seconds_from_env(INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_SECONDS,
                                             "disables the bound")):
        lib = ffi.library()  # it imports mpi4py.MPI, having chosen mpi4py's libmpi
        from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        warnings.warn(
            "MPI was initialised without MPI_THREAD_MULTIPLE (before jaxfog.init()); "
            "communicating ops may run from several XLA threads", RuntimeWarning)
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        _setup(lib, MPI.COMM_WORLD)
        control = os.environ.get(ELASTIC_CONTROL_ENV)
        if control and MPI.COMM_WORLD.Get_rank() == 0:
            try:
                open(control + ".started", "w").close()
            except OSError:  # rank 0 away from the launcher's files: no retry then
                pass
    else:  # spawned by the job's grow(): after its ranks, in one communicator with them
        global _joined
        merged = parent.Merge(high=True)
        parent.Disconnect()
        _set_up_again(lib, None, merged)
        _joined = True
    ffi.register_handlers()
    # JAX (imported by now) tears its backends down at exit; shutdown must run
    # first, while dispatched computations can still be waited for.
    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)
    if topology is not None:
        set_topology(topology)


def shutdown() -> None:
    """Waits for dispatched communication, then releases jaxfog's communicators.

    Computations dispatched asynchronously (``jaxfog.jit`` returns before they
    ran) finish their communication first, so no rank tears a communicator
    down under a peer that still exchanges with it. Then this rank tells the
    others it has left, so that an op still waiting for it fails at once
    (naming this rank and its last op) instead of at ``JAXFOG_TIMEOUT``. MPI
    itself is finalised at exit by mpi4py. Safe to call twice; ``init()`` may
    be called again.
    """
    _shutdown(at_exit=False)


@atexit.register
def _shutdown_at_exit() -> None:
    _shutdown(at_exit=True)


def _shutdown(at_exit: bool) -> None:
    global _state
    if _state is None:
        return
    _run_shutdown_hooks("fence")
    _run_shutdown_hooks("discard")
    lib = ffi.library()
    survivors_met = at_exit and _shrunk and _meet_at_exit(_state.python_comm)
    reason = ctypes.create_string_buffer(1024)
    if lib.jaxfog_say_goodbye(int(at_exit), reason, 1024):
        warnings.warn(f"jaxfog.shutdown: {reason.value.decode()}", RuntimeWarning)
    _run_shutdown_hooks("release")
    state, _state = _state, None
    _release(lib, state.comms, state.python_comm, state.peers_comm)
    # MPI_Finalize comes next, and never ends if a peer became unreachable; after
    # a shrink, Open MPI 5.0.11's sometimes waits though every survivor is done.
    if survivors_met and _exit_status_after_shrink:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status_after_shrink)
    # After a recovery the bound is armed even if no op of this rank failed: it
    # may have learnt of a failure from a revoked communicator, or from the
    # barrier above (in mpi4py calls, or between ops).
    if survivors_met:
        lib.jaxfog_bound_exit(_EXIT_BOUND_AFTER_SHRINK_SECONDS, _exit_status_after_shrink, 1)
    elif at_exit:
        lib.jaxfog_bound_exit(max(state.timeout, _EXIT_BOUND_AFTER_FAILURE_SECONDS)
                              if state.timeout > 0 else 0, 1, int(_shrunk))


def _meet_at_exit(comm) -> bool:
    """Whether every rank of ``comm`` reached its exit (a barrier; False if it
    failed: another rank died)."""
    from mpi4py import MPI

    try:
        comm.Barrier()
    except MPI.Exception:
        return False
    return True


def _release(lib, comms: dict, python_comm, peers_comm) -> None:
    """Drops the C++ transports and the peer watch, then frees the communicators."""
    from mpi4py import MPI

    for comm_id in comms:
        lib.jaxfog_release_comm(comm_id)
    error = ctypes.create_string_buffer(1024)
    if lib.jaxfog_unwatch_peers(error, 1024):
        warnings.warn(f"jaxfog.shutdown: {error.value.decode()}", RuntimeWarning)
    if not MPI.Is_finalized():
        for comm in (*comms.values(), python_comm, peers_comm):
            comm.Free()


def fault_tolerant() -> bool:
    """Whether this process runs under MPI with ULFM's fault tolerance on (Open
    MPI 5 launched with ``mpiexec --with-ft ulfm``): survivors of a dead rank
    then get errors instead of being ended, and :func:`shrink` can rebuild
    jaxfog on them."""
    _require()
    from mpi4py import MPI

    enabled = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower()
    return (enabled in ("1", "true", "yes", "on") and hasattr(MPI.Comm, "Shrink")
            and MPI.ERR_PROC_FAILED != MPI.ERR_UNKNOWN)


def shrink() -> list[int]:
    """Rebuilds jaxfog on the ranks still alive after a rank failed; collective
    over the survivors (each calls it once it has seen a failure). ULFM only.

    Revokes every jaxfog communicator (so that each survivor's pending and next
    ops fail at once, wherever they wait), waits for the computations already
    dispatched (their ops fail on the revoked communicators), discards the
    nonblocking ops never waited for, releases the C++ transports and the peer
    watch, shrinks the communicator to the survivors and sets jaxfog up again
    on it: new ranks (the survivors in the order of their old ranks) and size,
    machine layout, default topology ``exponential(size())`` (the topology
    generation is bumped, so jitted ops trace again). One-sided windows do not
    survive: they are forgotten (free them before, or create them again).

    Returns:
      The old rank of each survivor, in new rank order.
    """
    state = _require()
    if not fault_tolerant():
        raise BackendError(
            "jaxfog.shrink needs MPI with ULFM fault tolerance on: Open MPI 5 launched "
            "with `mpiexec --with-ft ulfm` (`jaxfog run --mpi-args='--with-ft ulfm'`); "
            "elsewhere a failed rank ends the job, and `jaxfog run --max-restarts` "
            "relaunches it")
    from mpi4py import MPI

    lib = ffi.library()
    for comm in (*state.comms.values(), state.python_comm, state.peers_comm):
        try:
            comm.Revoke()
        except MPI.Exception:  # already revoked by a peer
            pass
    _run_shutdown_hooks("fence")  # every dispatched op fails on the revoked communicators
    _run_shutdown_hooks("discard")
    _run_shutdown_hooks("abandon")
    survivors = state.python_comm.Shrink()
    old_ranks = survivors.allgather(state.rank)
    _set_up_again(lib, state, survivors)
    return old_ranks


def grow(count: int, hosts: Sequence[str] | None = None) -> int:
    """Adds ``count`` processes running this program to the job, after its
    ranks; collective over the job's ranks. ULFM only (the job runs with
    ``--with-ft ulfm``), as for :func:`shrink`.

    The processes are started with ``MPI_Comm_spawn`` (the interpreter and
    command line of this process, ``sys.orig_argv``), on ``hosts`` (a host
    name for each process; Open MPI's launcher adds a host it
    does not have yet) or where the launcher places them; a host may run more
    processes than its slots. Their ``init``
    finds the parent job and joins it: the new ranks are ``size()`` to
    ``size() + count - 1``, and :func:`joined` is true there. Then jaxfog is set up
    again on every rank, as :func:`shrink` does: the computations dispatched
    finish first, nonblocking ops never waited for are discarded, one-sided
    windows are forgotten, and the default topology is ``exponential(size())``.

    A newcomer that cannot start fails the call (``BackendError``); under Open
    MPI 5.0.11 a host whose daemon cannot start ends the whole job instead (its
    launcher aborts), and a newcomer that dies in its ``MPI_Init`` leaves the
    spawn waiting: after ``JAXFOG_TIMEOUT`` seconds this process ends, saying
    so. ``jaxfog run --max-restarts`` relaunches the job either way.

    Returns:
      The size before.
    """
    state = _require()
    count = V.integer("jaxfog.grow", "count", count, minimum=1)
    if not fault_tolerant():
        raise BackendError(
            "jaxfog.grow needs MPI with ULFM fault tolerance on, as shrink does: Open MPI 5 "
            "launched with `mpiexec --with-ft ulfm` (`jaxfog run --mpi-args='--with-ft "
            "ulfm'`); elsewhere hosts join at a relaunch (`jaxfog run "
            "--host-discovery-script`)")
    from mpi4py import MPI

    hosts = [str(h) for h in hosts or ()]
    if hosts and len(hosts) != count:
        raise ValueError(f"jaxfog.grow: {len(hosts)} hosts for {count} processes; give one "
                         "host a process, or none")
    lib = ffi.library()
    info = MPI.Info.Create()
    # Open MPI's: a host may hold more processes than its slots (the slots of the
    # job's ranks stay taken, and spawn would find none free).
    info.Set("map_by", "slot:oversubscribe")
    if hosts:
        info.Set("host", ",".join(hosts))
    where = f"{count} process(es){' on ' + ','.join(hosts) if hosts else ''}"
    # A newcomer that dies in its MPI_Init leaves the spawn waiting forever.
    watchdog = threading.Timer(state.timeout, _end_stuck_spawn, args=(where, state.timeout))
    watchdog.daemon = True
    if state.timeout > 0:
        watchdog.start()
    try:
        command = [sys.executable, *sys.orig_argv[1:]]
        shim = os.environ.get(RANK_SHIM_ENV)
        intercomm = state.python_comm.Spawn(
            sys.executable, args=[shim, *command] if shim else command[1:], maxprocs=count,
            info=info, root=0)
        merged = intercomm.Merge(high=False)
        intercomm.Disconnect()
    except MPI.Exception as error:
        raise BackendError(f"jaxfog.grow: MPI_Comm_spawn of {where} failed: {error}") from error
    finally:
        watchdog.cancel()
        info.Free()
    _run_shutdown_hooks("fence")
    _run_shutdown_hooks("discard")
    _run_shutdown_hooks("abandon")
    _set_up_again(lib, state, merged)
    return state.size


def _set_up_again(lib, state: _State | None, base) -> None:
    """jaxfog over communicator ``base`` (freed after), in place of ``state``'s
    (released first, if any): after :func:`shrink` and :func:`grow`, and in a
    process :func:`grow` started. Such a process ends as survivors do."""
    global _state, _shrunk
    _state, _shrunk = None, True
    if state is not None:
        _release(lib, state.comms, state.python_comm, state.peers_comm)
    try:
        _setup(lib, base)
    finally:
        base.Free()


def _end_stuck_spawn(where: str, seconds: float) -> None:
    sys.stderr.write(f"jaxfog.grow (rank {rank()}): starting {where} did not finish within "
                     f"{seconds:g} s ({TIMEOUT_ENV}); a newcomer failed to start or to join "
                     "(see the launcher's output); ending this process\n")
    sys.stderr.flush()
    os._exit(1)


def joined() -> bool:
    """Whether this process joined a running job (started by its :func:`grow`)."""
    return _joined


def is_initialized() -> bool:
    return _state is not None


def _world() -> _State | _context.Simulation:
    """Who answers the queries below: the simulation being traced, if any, else
    this MPI process. The one place the two are told apart."""
    return _context.current() or _require()


def rank() -> int | jax.Array:
    """This process's rank in the world communicator.

    Returns:
      An ``int``; inside ``jaxfog.simulate``, the traced index of the agent
      (an int32 tracer), since one trace serves every agent.
    """
    return _world().rank


def size() -> int:
    """Number of processes (agents)."""
    return _world().size


def local_rank() -> int | jax.Array:
    """Rank among the processes on this machine (traced inside ``simulate``)."""
    return _world().local_rank


def local_size() -> int:
    """Number of processes on this machine."""
    return _world().local_size


def machine_rank() -> int | jax.Array:
    """Index of this machine (``rank // local_size`` on homogeneous clusters;
    traced inside ``simulate``)."""
    return _world().machine_rank


def machine_size() -> int:
    """Number of machines."""
    return _world().machine_size


def is_homogeneous() -> bool:
    """True if every machine runs the same number of processes."""
    return _world().homogeneous


def gpu_backend() -> str | None:
    """How ops on GPU arrays communicate: "nccl", "mpi" (host staging), or
    None where JAX has no CUDA device."""
    return _require().gpu_backend


def timeout() -> float:
    """Seconds a communicating op waits for a peer before failing (0: forever)."""
    return _require().timeout


def comm_thread_min_bytes() -> int | None:
    """Messages of at least this size run on the communication thread; None: none do."""
    _require()
    value = ffi.library().jaxfog_comm_thread_min_bytes()  # kept by the C++ library only
    return None if value < 0 else value


def set_comm_thread_min_bytes(min_bytes: int | None) -> None:
    """Sends messages of at least ``min_bytes`` from the communication thread.

    A communicating op then returns to XLA at once and completes when its
    messages have arrived, so work that does not need them runs meanwhile (awc's
    exchange of x beside the backward pass). ``None`` runs every op inline on
    XLA's thread. Takes effect for the next op; ranks may differ. The default
    comes from ``JAXFOG_COMM_THREAD_MIN_BYTES`` (see ``COMM_THREAD_MIN_BYTES_ENV``).
    """
    _require()
    if min_bytes is not None:
        min_bytes = V.integer("jaxfog.set_comm_thread_min_bytes", "min_bytes", min_bytes,
                              minimum=0)
    ffi.library().jaxfog_set_comm_thread_min_bytes(-1 if min_bytes is None else int(min_bytes))


def _renamed(old: str, new: Callable) -> Callable:
    """``new`` under its name until 0.1, warning that it was renamed."""
    @functools.wraps(new)
    def call(*args, **kwargs):
        warnings.warn(f"jaxfog.{old} is deprecated: call jaxfog.{new.__name__} (the same "
                      "function; 'async' names jaxfog's asynchronous algorithms)",
                      FutureWarning, stacklevel=2)
        return new(*args, **kwargs)

    call.__name__ = call.__qualname__ = old
    call.__doc__ = f"Deprecated: :func:`{new.__name__}` (renamed; this name warns)."
    return call


async_min_bytes = _renamed("async_min_bytes", comm_thread_min_bytes)
set_async_min_bytes = _renamed("set_async_min_bytes", set_comm_thread_min_bytes)


def _check_topology_type(topology: Any, what: str) -> None:
    """None, a Topology or a networkx graph; TypeError naming ``jaxfog.<what>`` else."""
    if topology is not None and not isinstance(topology, T.Topology) and not (
            hasattr(topology, "nodes") and hasattr(topology, "edges")):
        raise TypeError(f"jaxfog.{what}: topology must be a jaxfog.topology.Topology or a "
                        f"networkx graph, got {type(topology).__name__} {topology!r}")


def _as_topology(topology: Any, expected_size: int, what: str) -> T.Topology:
    if topology is None:
        return T.exponential(expected_size)
    _check_topology_type(topology, what)
    if not isinstance(topology, T.Topology):
        topology = T.from_networkx(topology)
    if topology.size != expected_size:
        raise ValueError(size_mismatch(what, topology.size, expected_size,
                                       "ranks" if what == "set_topology" else "machines"))
    return topology


def size_mismatch(what: str, nodes: int, count: int, unit: str = "ranks") -> str:
    """The error for a topology of ``nodes`` nodes on ``count`` ranks; a script
    meant for a launcher but started with a plain ``python`` is told so."""
    text = f"{what}: the topology has {nodes} nodes but there are {count} {unit}"
    if unit == "ranks" and count == 1 and _context.current() is None:
        text += (f" (this is one process: did you mean `jaxfog run -np {nodes} python ...`? "
                 f"Or run it on {nodes} simulated agents with jaxfog.simulate or "
                 "jaxfog.Agents)")
    return text


def _check_same_everywhere(state: _State, topology: T.Topology, what: str) -> None:
    """Raises on every rank if ranks passed different topologies."""
    digest = hashlib.sha1(np.ascontiguousarray(topology.weights).tobytes()).hexdigest()
    digests = state.python_comm.allgather(digest)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise ValueError(
            f"{what}: ranks {differing} passed a different topology from rank 0; "
            "every rank must set the same graph")


def set_topology(topology: T.Topology | Any | None = None) -> bool:
    """Sets the global topology used by ops without explicit weights; collective.

    Args:
      topology: a ``Topology`` (or networkx graph) with ``size()`` nodes, the
        same on every rank; ``None`` restores ``exponential(size())``.

    Returns:
      True once set (BlueFog compatible).
    """
    _not_in_simulation("set_topology", "pass the topology to jaxfog.simulate, or "
                       "topology= to the op")
    return _set_topology("topology", topology, _require().size)


def load_topology() -> T.Topology | T.Schedule:
    """The current global topology (inside ``jaxfog.simulate``, the simulation's,
    which may be a ``Schedule``)."""
    return _world().topology


def _not_in_simulation(what: str, instead: str) -> None:
    if _context.current() is not None:
        raise BackendError(f"jaxfog.{what}() cannot be used inside jaxfog.simulate: the "
                           f"agent index is traced there; {instead}")


def in_neighbor_ranks() -> list[int]:
    """Ranks this rank receives from in the current topology."""
    _not_in_simulation("in_neighbor_ranks", "use jaxfog.load_topology().in_neighbors(r) "
                       "with a concrete r")
    state = _require()
    return state.topology.in_neighbors(state.rank)


def out_neighbor_ranks() -> list[int]:
    """Ranks this rank sends to in the current topology."""
    _not_in_simulation("out_neighbor_ranks", "use jaxfog.load_topology().out_neighbors(r) "
                       "with a concrete r")
    state = _require()
    return state.topology.out_neighbors(state.rank)


def set_machine_topology(topology: T.Topology | Any | None = None) -> bool:
    """Sets the machine-level topology used by hierarchical averaging; collective."""
    _not_in_simulation("set_machine_topology", "pass machine_topology= to jaxfog.simulate")
    return _set_topology("machine_topology", topology, _require().machine_size)


def _set_topology(field: str, topology: Any, size: int) -> bool:
    """Sets ``_State.<field>`` after checking that every rank passed the same graph."""
    state, what = _require(), f"set_{field}"
    topology = _as_topology(topology, size, what)
    _check_same_everywhere(state, topology, what)
    setattr(state, field, topology)
    _topology_changed()
    return True


def load_machine_topology() -> T.Topology:
    """The current machine-level topology."""
    return _world().machine_topology


def communicator():
    """The mpi4py communicator for collectives issued from Python (a duplicate
    of ``COMM_WORLD``). It is not the one the C++ transport uses: a step
    dispatched asynchronously may be in a collective on that one, from
    another thread, while Python runs one on this one, and MPI orders the
    collectives of one communicator only when every rank issues them in the
    same order."""
    return _require().python_comm


__all__ = ["async_min_bytes", "comm_thread_min_bytes", "fault_tolerant", "gpu_backend", "grow",
           "in_neighbor_ranks", "init", "is_homogeneous", "is_initialized", "joined",
           "load_machine_topology", "load_topology", "local_rank", "local_size", "machine_rank",
           "machine_size", "out_neighbor_ranks", "rank", "set_async_min_bytes",
           "set_comm_thread_min_bytes", "set_machine_topology", "set_topology", "shutdown",
           "shrink", "size"]
