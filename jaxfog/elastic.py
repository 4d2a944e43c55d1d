r"""Elastic training: the run goes on when a rank or a host is lost, and hosts can join.

Every rank of a decentralized run holds a whole model, so a lost rank takes no
global state with it: only the graph needs repair. jaxfog repairs it by
restart. ``jaxfog run --max-restarts R`` relaunches the job when it fails, on
the hosts still reachable (and on new ones a ``--host-discovery-script``
names), and every rank resumes from its own latest *snapshot*: its state,
written every ``every`` steps by a background thread while training goes on.
A rank that finds no snapshot of its own (a new host, or more slots) gets a
live copy of a neighbour's state over MPI. The user's loop needs two changes::

    state = jaxfog.elastic.State(params=params, opt_state=opt_state, every=20)
    for step in state.steps(300):        # from the resumed step
        state.params, state.opt_state, loss = train_step(state.params, state.opt_state,
                                                         batch(step, jf.rank(), jf.size()))

Since a relaunch runs the whole script again, everything that depends on the
number of ranks (topologies, schedules, optimizers, data shards) is rebuilt
for the new size by the script itself; the values given to :class:`State` are
then the fresh state of that program, whose structure the snapshot must match.

What a resume does (the same on MPI processes and in :func:`simulate`):

1. Every rank lists the snapshots on its own host
   (``<directory>/<host>/member<id>.step<s>.npz``). A *member* is one model:
   member ids are ranks at the first launch and follow their models across
   restarts, whatever their new ranks.
2. The resume step ``S`` is the newest step every current member has: the
   oldest of their latest snapshots (each rank keeps its last two, and a rank
   stopped mid-write is at most ``every`` steps behind), so no rank resumes
   from a state older than another's. Members whose latest snapshot is older
   than the newest by more than ``every`` steps are stale (a host that left
   earlier and came back): they are dropped.
3. On each host, the ranks (ascending) take the host's members (ascending).
   A rank left without one is a *newcomer*: it gets the state of the nearest
   resumed rank below it (cyclically; rank r - 1 sends to r on the ring and
   exponential graphs) as a live copy over MPI, and a new member id.
4. If the members are not those of the snapshot (a member lost, one joined),
   each optimizer's invariant is restored (below). Exchanges that were in
   flight at the snapshot (``delay=``, Streaming DiLoCo) are replaced by idle
   ones in every case, since they do not survive their processes.

The invariants, restored when membership changes:

* ``atc``, ``awc``, ``gradient_allreduce``, ``push_sum``, ``diloco``,
  ``noloco``, ``local_sgd``: none to restore. Each member's parameters and
  state are its own; DiLoCo's anchor is the same on every member after a
  sync and stays so (a newcomer copies its neighbour's); push-sum's estimate
  is :math:`x / w` whatever the total mass.
* ``gradient_tracking``: the trackers' average equals the members' average
  gradient, :math:`\frac1n\sum_i y_i = \frac1n\sum_i g_i`, kept by a doubly
  stochastic W but broken when a member leaves or joins; restored by
  :math:`y_i \leftarrow g_i^{k-1}` (its last gradient), as at the start.
* ``exact_diffusion``: the correction :math:`x_i - \psi_i` sums to the
  members' gradients' history; restored by :math:`\psi_i \leftarrow x_i` (the
  parameters, given as ``params``), as ``init`` does.
* ``choco``, ``beer``: public copies of the in-neighbours, whose number
  changes with the graph, start again as ``init`` makes them (the fresh
  state's).
* delayed ``atc``/``awc``: the ``d`` exchanges in flight become idle (each
  member keeps its own value for those ``d`` mixes); Streaming DiLoCo: the
  fragments in flight are not applied (their outer step is skipped, the
  anchor kept), in every resume.

In place, under Open MPI with ULFM, :func:`run` goes on without a relaunch:
the survivors of a lost rank shrink the job and resume from the state each
kept in memory, and new ranks join at a snapshot step (asked for by
:func:`request_join` or by ``jaxfog run``'s discovery script), started by
``MPI_Comm_spawn`` and given a live copy; both as a restart with the same
members would resume.

:func:`simulate` runs a program on simulated agents with membership changes
at given steps (agents leave, agents join) with these semantics: research on
churn on one machine, and the oracle the MPI tests compare with.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence, cast

import jax
import numpy as np

from jaxfog import runtime
from jaxfog import _validate as V
from jaxfog.errors import JaxfogError, MembershipChange
from jaxfog.ops import _jax_compat
from jaxfog.ops.nonblocking import Handle
from jaxfog.optax import _common
from jaxfog.optax.compressed import BeerState, ChocoState
from jaxfog.optax.exact import ExactDiffusionState, TrackingState
from jaxfog.optax.local_sgd import NoLoCoState
from jaxfog.optax.streaming import StreamingDiLoCoState

#: Where snapshots go (default ``./jaxfog_elastic``); ``directory=`` overrides it.
DIRECTORY_ENV = "JAXFOG_ELASTIC_DIR"
#: Set by ``jaxfog run --max-restarts`` in the ranks: the number of this launch (0 first).
RESTART_ENV = "JAXFOG_ELASTIC_RESTART"
#: Set by ``jaxfog run --max-restarts``: a file whose existence asks the job to stop at
#: the next snapshot so that it is relaunched on the hosts now available (a host joined).
CONTROL_ENV = runtime.ELASTIC_CONTROL_ENV
#: The exit status of every rank that stopped for such a relaunch.
RESCALE_EXIT_STATUS = 75
#: Steps between snapshots when ``every`` is not given.
DEFAULT_EVERY = 50

_COPY_TAG = 7
_JOIN_TAG = 8
_FILE = re.compile(r"^member(\d+)\.step(\d+)\.npz$")
_WHAT = "jaxfog.elastic.State"


class Change(NamedTuple):
    """A membership change of :func:`simulate`, at a step boundary."""

    #: Member ids of the agents that leave (at the first launch, member id = rank).
    leave: Sequence[int] = ()
    #: How many agents join (they take the last ranks, as a host added last does).
    join: int = 0


class Resumed(NamedTuple):
    """How a :class:`State` started: its step, members, and what came from where."""

    #: The step it resumes at (0: a fresh start).
    step: int
    #: The member id of each rank, in rank order.
    members: tuple
    #: The ranks that got a live copy, each from the rank given: ``{newcomer: donor}``.
    copied_from: dict
    #: Whether the members differ from the snapshot's (invariants were restored).
    changed: bool


# --- the rules that restore invariants (state type -> rule) ---------------------------

Rule = Callable[[Any, Any, Any], Any]  # (restored node, fresh node, params) -> node


def _idle_handles(tree: Any) -> Any:
    """Every :class:`jaxfog.Handle` in ``tree`` made idle (zeros: handle id 0 on MPI
    processes, which waits for nothing)."""
    return jax.tree.map(lambda h: jax.tree.map(np.zeros_like, h) if isinstance(h, Handle)
                        else h, tree, is_leaf=lambda x: isinstance(x, Handle))


def _delayed(restored: _common.Delayed, fresh: Any, params: Any, changed: bool):
    return _common.Delayed(tuple(_common._idle(e) for e in restored.exchanges))


def _streaming(restored: StreamingDiLoCoState, fresh: Any, params: Any, changed: bool):
    # numpy zeros: a state's arrays may be numpy ones until the next (jitted) update.
    return restored._replace(handles=_idle_handles(restored.handles),
                             pending=cast(jax.Array, np.zeros_like(restored.pending)))


def _tracking(restored: TrackingState, fresh: Any, params: Any, changed: bool):
    return restored._replace(tracker=restored.prev_grads) if changed else restored


def _exact(restored: ExactDiffusionState, fresh: Any, params: Any, changed: bool):
    if not changed:
        return restored
    if params is None:
        raise ValueError(f"{_WHAT}: exact_diffusion's state needs the parameters to restore "
                         "its invariant after a membership change: pass them as params=")
    return restored._replace(psi=params)


def _public_copies(restored: Any, fresh: Any, params: Any, changed: bool):
    return restored._replace(public=fresh.public) if changed else restored


#: The rules, by state type: ``rule(restored, fresh, params, changed) -> state``.
RULES: dict[type, Callable[..., Any]] = {
    _common.Delayed: _delayed, StreamingDiLoCoState: _streaming, TrackingState: _tracking,
    ExactDiffusionState: _exact, ChocoState: _public_copies, BeerState: _public_copies,
    NoLoCoState: _public_copies,
}


def _reconcile(restored: Any, fresh: Any, params: Any, changed: bool) -> Any:
    """``restored`` with each rule applied where its type occurs (the outermost
    one of a path), and every other :class:`jaxfog.Handle` made idle."""
    def is_node(x):
        return x is None or type(x) in RULES or isinstance(x, Handle)

    treedef: Any  # a PyTreeDef, which jaxlib 0.10 gives no type stubs for
    nodes, treedef = jax.tree_util.tree_flatten(restored, is_leaf=is_node)
    done = []
    for node, like in zip(nodes, treedef.flatten_up_to(fresh)):
        if type(node) in RULES:
            node = RULES[type(node)](node, like, params, changed)
        elif isinstance(node, Handle):
            node = _idle_handles(node)
        done.append(node)
    return treedef.unflatten(done)


# --- snapshots on disk ------------------------------------------------------------------

def _flatten(tree: Any) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def _signature(tree: Any, version: str) -> str:
    """The structure, shapes and dtypes of ``tree`` and the program's version."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    parts = [f"{jax.tree_util.keystr(p)}:{np.shape(x)}:{getattr(x, 'dtype', None) or type(x)}"
             for p, x in leaves]
    return json.dumps([version, parts])


def _unflatten_like(arrays: Mapping[str, np.ndarray], fresh: Any) -> Any:
    """``fresh``'s structure holding the snapshot's arrays where the key
    exists (with the snapshot's shape), ``None`` where it does not."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: arrays.get(jax.tree_util.keystr(path)), fresh)


def _host_directory(directory: str, host: str) -> str:
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]", "_", host))


def _listing(directory: str) -> dict[int, list[int]]:
    """{member: sorted steps} of the complete snapshots in ``directory``."""
    found: dict[int, list[int]] = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        match = _FILE.match(name)
        if match:
            found.setdefault(int(match[1]), []).append(int(match[2]))
    return {member: sorted(steps) for member, steps in found.items()}


def _read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["__jaxfog_meta__"]))
        return meta, {key: data[f"a{i}"] for i, key in enumerate(meta["keys"])}


def _roster(path: str) -> list[int]:
    """The members of the run that wrote the snapshot at ``path``."""
    with np.load(path, allow_pickle=False) as data:
        return list(json.loads(str(data["__jaxfog_meta__"]))["members"])


class _Writer:
    """Writes snapshots in a background thread, one at a time, atomically
    (a temporary file renamed), keeping this member's newest two."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def write(self, directory: str, member: int, step: int, meta: dict,
              arrays: dict[str, np.ndarray]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._write, daemon=True, name="jaxfog.elastic",
                                        args=(directory, member, step, meta, arrays))
        self._thread.start()

    def _write(self, directory, member, step, meta, arrays) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
            final = os.path.join(directory, f"member{member}.step{step}.npz")
            partial = final + f".{os.getpid()}.partial"
            # Keys by position: a path's text may hold characters a zip name cannot.
            meta = {**meta, "keys": list(arrays)}
            with open(partial, "wb") as f:
                np.savez(f, __jaxfog_meta__=np.asarray(json.dumps(meta)),
                         **{f"a{i}": a for i, a in enumerate(arrays.values())})
            os.replace(partial, final)
            for old in _listing(directory).get(member, [])[:-2]:
                os.remove(os.path.join(directory, f"member{member}.step{old}.npz"))
        except BaseException as error:  # reported at the next write or wait
            self.error = error

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise OSError(f"{_WHAT}: writing a snapshot failed: {error}") from error


# --- who resumes what ---------------------------------------------------------------------

class Plan(NamedTuple):
    """What :func:`plan` decides: the resume step, each rank's member, what it loads."""

    step: int
    members: list  # member id of each rank
    snapshots: list  # (host, member) each rank loads, or None for a newcomer
    donors: dict  # newcomer -> donor rank
    previous: list | None  # the members of the snapshot (None: fresh start)


def plan(hosts: Sequence[str], listings: Mapping[str, Mapping[int, Sequence[int]]],
         every: int, rosters: Mapping[tuple, Sequence[int]] | None = None) -> Plan:
    """Who resumes what, from each rank's host (``hosts[r]``), each host's
    snapshot listing (``{host: {member: steps}}``) and the members of the run
    that wrote each member's latest snapshot (``rosters[(host, member)]``; by
    default every member listed); pure, the same on every rank (see the
    module's steps)."""
    latest = {(h, m): max(steps) for h, listing in listings.items()
              for m, steps in listing.items() if steps}
    size = len(hosts)
    ids_seen = [m for _, m in latest]
    if not latest:
        return Plan(0, list(range(size)), [None] * size, {}, None)
    newest = max(latest.values())
    # The members of the last run: those its newest snapshots list. A member
    # left out of that run (its host gone then, back now) is stale.
    last_run = {m for key, s in latest.items() if s == newest
                for m in (rosters or {}).get(key, [key[1]])} if rosters else set(ids_seen)
    current = {key: s for key, s in latest.items()
               if s >= newest - every and key[1] in last_run}
    step = min(current.values())
    members: list[int | None] = [None] * size
    snapshots: list = [None] * size
    for host in dict.fromkeys(hosts):
        ranks = [r for r in range(size) if hosts[r] == host]
        available = sorted(m for h, m in current if h == host
                           and step in listings[h][m])
        for r, m in zip(ranks, available):
            members[r], snapshots[r] = m, (host, m)
    resumed = [r for r in range(size) if snapshots[r] is not None]
    if not resumed:
        return Plan(0, list(range(size)), [None] * size, {}, None)
    fresh_id = max(ids_seen) + 1
    donors = {}
    for r in range(size):
        if members[r] is None:
            members[r], fresh_id = fresh_id, fresh_id + 1
            donors[r] = next(d for d in ((r - k) % size for k in range(1, size + 1))
                             if d in resumed)
    return Plan(step, members, snapshots, donors, None)


# --- the state -------------------------------------------------------------------------------

class _Churn:
    """What :func:`simulate` hands the :class:`State` of the program it runs."""

    def __init__(self, agents: int, changes: Mapping[int, Change]):
        self.members = list(range(agents))
        self.changes = dict(changes)
        self.snapshot: tuple | None = None  # (step, members, {key: stacked array})
        self.resumed: list[Resumed] = []


_churn: _Churn | None = None


class State:
    """A training state that survives restarts, and the loop that snapshots it.

    Construct it with the program's fresh values (any pytrees of arrays, by
    keyword) after everything that depends on the number of ranks is built;
    construction is collective. It resumes (see the module's docstring) and
    its attributes then hold the resumed values: ``state.params`` etc. Assign
    them in the loop; :meth:`steps` snapshots them every ``every`` steps.

    Args:
      every: steps between snapshots (also the most steps a restart redoes).
      directory: where snapshots go (shared or per host; each rank writes under
        its host's name). Default ``$JAXFOG_ELASTIC_DIR`` or ``./jaxfog_elastic``.
      version: the program's version: ranks (and snapshots) of another version
        are refused, as are values whose structure, shapes or dtypes differ.
      **values: the state, e.g. ``params=..., opt_state=...``; ``params`` is what
        ``exact_diffusion``'s invariant is restored from.

    Attributes:
      step: the step to run next (the resumed step after construction).
      resumed: a :class:`Resumed` saying how it started.
    """

    _names: tuple[str, ...]  # the values' names (set first, in __init__'s __dict__)

    def __init__(self, *, every: int = DEFAULT_EVERY, directory: str | os.PathLike | None = None,
                 version: str = "", **values: Any):
        self.__dict__["_names"] = tuple(values)
        if not values:
            raise ValueError(f"{_WHAT}: give the state as keyword arguments, e.g. "
                             "State(params=params, opt_state=opt_state)")
        self.every = V.integer(_WHAT, "every", every, minimum=1)
        if not isinstance(version, str):
            raise TypeError(f"{_WHAT}: version must be a str, got {type(version).__name__}")
        self.version = version
        directory = directory or os.environ.get(DIRECTORY_ENV) or "jaxfog_elastic"
        self.directory = os.path.abspath(os.fspath(directory))
        self._writer = _Writer()
        self._fresh = dict(values)
        self.__dict__.update(values)
        self._history: dict[int, dict[str, Any]] = {}  # step -> values before it
        if _churn is not None:
            self._resume_in_churn(_churn)
        elif _in_place is not None and _in_place.resume is not None:
            self._resume_in_place(_in_place.resume)
        else:
            self._resume()
        if _in_place is not None:
            _in_place.state = self
            _in_place.next_member = max(_in_place.next_member, max(self.resumed.members) + 1)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in self._names or name in ("every", "version",
                                                                   "directory", "step",
                                                                   "resumed", "member"):
            self.__dict__[name] = value
        else:
            raise AttributeError(f"{_WHAT} has no value {name!r} (it holds "
                                 f"{', '.join(self._names)})")

    @property
    def values(self) -> dict[str, Any]:
        """The state's values by name."""
        return {name: self.__dict__[name] for name in self._names}

    # -- MPI processes (and one plain process) --

    def _comm(self):
        return runtime.communicator() if runtime.is_initialized() and runtime.size() > 1 \
            else None

    def _resume(self) -> None:
        runtime.init()  # under a launcher: the job's ranks; else one process
        comm = self._comm()
        rank, size = (comm.Get_rank(), comm.Get_size()) if comm else (0, 1)
        signature = _signature(self._fresh, self.version)
        self._check_same(comm, signature)
        host = socket.gethostname()
        here = _host_directory(self.directory, host)
        listing = _listing(here)
        rosters = {(host, m): _roster(os.path.join(here, f"member{m}.step{steps[-1]}.npz"))
                   for m, steps in listing.items()}
        gathered = comm.allgather((host, listing, rosters)) if comm else [
            (host, listing, rosters)]
        hosts = [h for h, _, _ in gathered]
        everyone = {key: r for _, _, found in gathered for key, r in found.items()}
        plan_ = plan(hosts, {h: found for h, found, _ in gathered}, self.every, everyone)
        self.step, self.member = plan_.step, plan_.members[rank]
        self._here = here
        restored = previous = None
        if plan_.snapshots[rank] is not None:
            meta, arrays = _read(os.path.join(here, f"member{self.member}.step{plan_.step}.npz"))
            self._check_snapshot(meta, plan_.step)
            previous = meta["members"]
            restored = arrays
        if comm is not None:  # the live copies, over MPI
            for newcomer, donor in plan_.donors.items():
                if rank == donor:
                    comm.send((previous, restored), dest=newcomer, tag=_COPY_TAG)
                if rank == newcomer:
                    previous, restored = comm.recv(source=donor, tag=_COPY_TAG)
        # Each rank's members before (None where it resumes nothing).
        befores: list[Any] = comm.allgather(previous) if comm is not None else [previous]
        changed = restored is not None and any(list(b) != list(plan_.members)
                                               for b in befores)
        if size == 1 and any(b is not None and len(b) > 1 for b in befores):
            warnings.warn(f"{_WHAT}: one rank is left of the run's "
                          f"{max(len(b) for b in befores if b)}; it goes on alone",
                          RuntimeWarning)
        if restored is not None:
            self._restore(restored, changed)
        self.resumed = Resumed(plan_.step, tuple(plan_.members), dict(plan_.donors), changed)
        if restored is not None and rank == 0:
            what = (f"{len(plan_.donors)} rank(s) copied from a neighbour; " if plan_.donors
                    else "")
            print(f"jaxfog.elastic: resumed at step {plan_.step} on {size} rank(s) "
                  f"({what}members {'changed' if changed else 'unchanged'})", flush=True)

    def _check_same(self, comm, signature: str) -> None:
        if comm is None:
            return
        signatures = comm.allgather(signature)
        differ = [r for r, s in enumerate(signatures) if s != signatures[0]]
        if differ:
            raise ValueError(
                f"{_WHAT}: ranks {differ} hold a state (structure, shapes, dtypes or "
                f"version) other than rank 0's; a joining host must run the job's program "
                f"(rank 0: {signatures[0][:300]}; rank {differ[0]}: "
                f"{signatures[differ[0]][:300]})")

    def _check_snapshot(self, meta: dict, step: int) -> None:
        if meta.get("version") != self.version:
            raise ValueError(f"{_WHAT}: the snapshot of step {step} in {self._here} is of "
                             f"version {meta.get('version')!r}, this program is "
                             f"{self.version!r}")
        if meta.get("every") != self.every:
            raise ValueError(f"{_WHAT}: the snapshots in {self.directory} were taken every "
                             f"{meta.get('every')} steps; this run says every={self.every} "
                             "(the resume step is agreed from that interval)")

    def _restore(self, arrays: Mapping[str, np.ndarray], changed: bool) -> None:
        restored = _unflatten_like(arrays, self._fresh)
        params = restored.get("params")
        restored = _reconcile(restored, self._fresh, params, changed)
        fresh_leaves = jax.tree_util.tree_flatten_with_path(self._fresh)[0]
        done_leaves, treedef = jax.tree_util.tree_flatten(
            restored, is_leaf=lambda x: x is None)
        values = []
        for (path, fresh), value in zip(fresh_leaves, done_leaves):
            key = jax.tree_util.keystr(path)
            if value is None:
                raise ValueError(f"{_WHAT}: the snapshot has no value for {key}: the "
                                 "program's state changed since it was taken")
            if np.shape(value) != np.shape(fresh):
                raise ValueError(f"{_WHAT}: {key} is {np.shape(value)} in the snapshot but "
                                 f"{np.shape(fresh)} in this program (no rule restores it "
                                 "for a new membership)")
            dtype = fresh.dtype if hasattr(fresh, "dtype") else np.result_type(fresh)
            values.append(jax.numpy.asarray(np.asarray(value, dtype=dtype)))
        self.__dict__.update(jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(self._fresh), values))

    def _snapshot(self) -> None:
        arrays = _flatten(self.values)  # waits for the step that made them, not for later ones
        meta = {"step": self.step, "every": self.every, "version": self.version,
                "members": list(self.resumed.members)}
        self._writer.write(self._here, self.member, self.step, meta, arrays)

    # -- simulated agents --

    def _resume_in_churn(self, sim: _Churn) -> None:
        self.member = None
        self.step = 0
        changed = False
        copied: dict[int, int] = {}
        if sim.snapshot is not None:
            step, before, arrays = sim.snapshot
            after = sim.members
            index = {m: i for i, m in enumerate(before)}
            rows = []
            for r, m in enumerate(after):
                if m in index:
                    rows.append(index[m])
                else:
                    donor = next(d for d in ((r - k) % len(after) for k in range(1, len(after) + 1))
                                 if after[d] in index)
                    copied[r] = donor
                    rows.append(index[after[donor]])
            changed = list(before) != list(after)
            self.step = step
            # One agent is one unstacked value (jaxfog.Agents(simulated=1) is a process's).
            pick = (lambda v: v[rows[0]]) if len(after) == 1 else (lambda v: v[np.asarray(rows)])
            self._restore({k: pick(np.asarray(v)) for k, v in arrays.items()}, changed)
        self.resumed = Resumed(self.step, tuple(sim.members), copied, changed)
        sim.resumed.append(self.resumed)

    # -- in place, under ULFM (see run) --

    def _resume_in_place(self, resume: "_Resume") -> None:
        # A newcomer runs the job's program too: its state must be the job's.
        self._check_same(self._comm(), _signature(self._fresh, self.version))
        rank = runtime.rank()
        self.step, self.member = resume.step, resume.members[rank]
        self._here = _host_directory(self.directory, socket.gethostname())
        self._restore(resume.arrays, True)
        self.resumed = Resumed(resume.step, tuple(resume.members), dict(resume.copied), True)

    def _keep_for_recovery(self, keep: int) -> None:
        """Keeps the state before this step (references: JAX arrays are
        immutable) and the last ``keep - 1`` before it, and waits for the one
        before the previous step: one step runs while this one is dispatched,
        so the newest complete state is at most one step old, and the
        ``keep - 1`` before it are kept too. When a failure shows, survivors
        may stand at different steps (one whose step did not need the dead
        rank went on): they find a state in common while they stand within
        ``keep - 2`` steps of each other."""
        if self._history:  # before keeping this one: if it raises, the older ones are kept
            jax.block_until_ready(self._history[max(self._history)])
        self._history[self.step] = self.values
        for old in sorted(self._history)[:-keep]:
            del self._history[old]

    def _ready_steps(self) -> list[int]:
        """The steps whose kept state is complete (a failed step's outputs are
        errors: waiting for them raises)."""
        ready = []
        for step, values in self._history.items():
            try:
                jax.block_until_ready(values)
                ready.append(step)
            except Exception:
                pass
        return ready

    # -- the loop --

    def steps(self, total: int) -> Iterator[int]:
        """The steps from :attr:`step` to ``total`` - 1; after each, the state
        is snapshotted when the step count is a multiple of ``every``."""
        total = V.integer(f"{_WHAT}.steps", "total", total, minimum=0)
        control = os.environ.get(CONTROL_ENV)
        while self.step < total:
            if _in_place is not None:
                self._keep_for_recovery(_in_place.keep)
            yield self.step
            self.step += 1
            if _churn is not None:
                if self.step in _churn.changes and self.step < total:
                    arrays = _flatten(self.values)
                    if len(_churn.members) == 1:  # unstacked: one agent's values
                        arrays = {k: v[None] for k, v in arrays.items()}
                    _churn.snapshot = (self.step, list(_churn.members), arrays)
                    raise MembershipChange(self.step)
                continue
            if self.step % self.every == 0 or self.step == total:
                self._snapshot()
                if self.step == total:
                    continue
                if _in_place is not None:
                    joining, relaunch = self._joins_requested(control)
                    if joining and not relaunch:
                        _grow(_in_place, self.step, joining)
                        raise MembershipChange(self.step)  # run() runs the program again
                else:
                    relaunch = control is not None and self._rescale_requested(control)
                if relaunch:
                    self._writer.wait()
                    if runtime._shrunk:  # shut down at exit, where MPI_Finalize is bounded
                        runtime._exit_status_after_shrink = RESCALE_EXIT_STATUS
                    else:
                        runtime.shutdown()
                    raise SystemExit(RESCALE_EXIT_STATUS)
        if _churn is None:
            self._writer.wait()

    def _rescale_requested(self, control: str) -> bool:
        comm = self._comm()
        if comm is None:
            return os.path.exists(control)
        asked = os.path.exists(control) if comm.Get_rank() == 0 else None
        return bool(comm.bcast(asked, root=0))

    def _joins_requested(self, control: str | None) -> tuple[list[str], bool]:
        """The hosts of the ranks asked to join in place (``""``: anywhere), from
        :func:`request_join` on any rank and ``jaxfog run``'s control file
        (a host a line, a line a rank), and whether to stop for a relaunch instead: the file
        is empty (hosts the launch did not have), or ranks are to join a job
        across hosts after a recovery in place (Open MPI 5.0.11's newcomer
        then fails in its MPI_Init); collective, rank 0 decides."""
        comm = self._comm()
        assert _in_place is not None
        mine, _in_place.requests = _in_place.requests, []
        relaunch = False
        if control and (comm is None or comm.Get_rank() == 0) and os.path.exists(control):
            with open(control) as f:
                text = f.read()
            relaunch = not text.strip()
            if not relaunch:  # an empty file stays: the launcher reads it as a rescale
                os.remove(control)
            mine = mine + text.split()
        said = comm.allgather((mine, relaunch)) if comm else [(mine, relaunch)]
        hosts = [h for requested, _ in said for h in requested]
        if said[0][1]:
            return hosts, True
        if hosts and _in_place.recoveries and runtime.machine_size() > 1:
            if not control:
                warnings.warn(f"{_WHAT}: {len(hosts)} rank(s) cannot join this job in place "
                              "after a recovery (Open MPI 5.0.11 across hosts), and no "
                              "`jaxfog run` is there to relaunch it: they do not join",
                              RuntimeWarning)
                return [], False
            if runtime.rank() == 0:
                open(control, "w").close()  # jaxfog run relaunches on every host it finds
            return hosts, True
        return hosts, False

    def wait(self) -> None:
        """Waits for the snapshot being written (``steps`` does at its end)."""
        self._writer.wait()


# --- in place, under ULFM -------------------------------------------------------------------

class _Resume(NamedTuple):
    step: int
    arrays: dict  # the state before ``step``, flattened (keystr -> numpy)
    members: list  # member id of each new rank
    copied: dict = {}  # newcomer rank -> the rank its state came from


class Recovery(NamedTuple):
    """One recovery in place by :func:`run`."""
    step: int  # the step the survivors resumed at (redone)
    old_ranks: tuple  # each survivor's rank before, in new rank order
    members: tuple  # each new rank's member id
    shrink_s: float  # seconds in runtime.shrink
    recover_s: float  # seconds from the failed program's error to the resume


class Join(NamedTuple):
    """Ranks joining in place, by :func:`run`."""
    step: int  # the step the job resumed at with the newcomers (none redone)
    members: tuple  # each new rank's member id (the newcomers last)
    copied_from: dict  # newcomer rank -> the rank that sent it its state
    join_s: float  # seconds from the request seen to the resume (spawn, merge, copy)


class _InPlace:
    """What :func:`run` shares with the :class:`State` of the program it runs."""

    def __init__(self, keep: int):
        self.keep = keep
        self.state: State | None = None  # the State of the current run of the program
        self.resume: _Resume | None = None
        self.recoveries: list[Recovery] = []
        self.joins: list[Join] = []
        self.requests: list[str] = []  # hosts asked for by request_join, here
        self.next_member = 0  # the next newcomer's member id


def request_join(count: int = 1, hosts: Sequence[str] | None = None) -> None:
    """Asks for ``count`` more ranks, running this program, to join the job in
    place at the next snapshot step (a multiple of ``State``'s ``every``),
    on ``hosts`` (one a rank; default: where the launcher places them), as
    :func:`run` does for hosts a ``--host-discovery-script`` names. Any rank
    may ask; each request is counted. Inside :func:`run` under ULFM only:
    elsewhere hosts join at a relaunch (``jaxfog run --host-discovery-script``)."""
    count = V.integer("jaxfog.elastic.request_join", "count", count, minimum=1)
    hosts = list(hosts) if hosts is not None else [""] * count
    if len(hosts) != count or not all(isinstance(h, str) for h in hosts):
        raise ValueError(f"jaxfog.elastic.request_join: hosts must be {count} str (one a rank), "
                         f"got {hosts!r}")
    if _in_place is None:
        raise JaxfogError(
            "jaxfog.elastic.request_join: ranks join in place only inside jaxfog.elastic.run "
            "under ULFM (`jaxfog run --mpi-args='--with-ft ulfm'`); elsewhere hosts join at "
            "a relaunch (`jaxfog run --max-restarts R --host-discovery-script S`)")
    _in_place.requests += hosts


def joins() -> tuple[Join, ...]:
    """The joins in place of the :func:`run` this is called in, oldest first
    (a newcomer lists the join that brought it)."""
    return tuple(_in_place.joins) if _in_place is not None else ()


def recoveries() -> tuple[Recovery, ...]:
    """The recoveries in place of the :func:`run` this is called in, oldest
    first (empty outside ``run``, or before a failure): a program that keys
    something to its life (a test's kill, a log) counts them."""
    return tuple(_in_place.recoveries) if _in_place is not None else ()


_in_place: _InPlace | None = None

_FAILURE_SIGNS = ("has failed", "MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "PROC_FAILED",
                  "REVOKED")


def _known_failures() -> int:
    """How many processes of jaxfog's communicator MPI knows to have failed
    (ULFM's MPIX_Comm_get_failed, local); 1 if a jaxfog communicator was
    revoked by a peer."""
    try:
        state = runtime._require()
        comms = (*state.comms.values(), state.python_comm, state.peers_comm)
        # A survivor that saw the failure first revokes them (runtime.shrink):
        # this rank's op may then fail with MPI_ERR_IN_STATUS only.
        if any(comm.Is_revoked() for comm in comms):
            return 1
        group = state.python_comm.Get_failed()
        try:
            return group.Get_size()
        finally:
            group.Free()
    except Exception:
        return 0


def _peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or one it came from) says that a peer process failed,
    or MPI knows of a failed process (an op's error does not always name it:
    ``MPI_ERR_IN_STATUS`` from a request to the dead rank completed with the
    others)."""
    if _known_failures():
        return True
    seen = set()
    cause: BaseException | None = error  # then the exceptions it came from
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        try:
            from mpi4py import MPI
            if isinstance(cause, MPI.Exception) and cause.Get_error_class() in (
                    MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED):
                return True
        except ImportError:  # pragma: no cover
            pass
        if any(sign in str(cause) for sign in _FAILURE_SIGNS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _recover(ip: _InPlace, error: BaseException) -> _Resume:
    """Shrinks jaxfog to the survivors and agrees on the step they resume at."""
    started = time.monotonic()
    state = ip.state
    old_ranks = runtime.shrink()
    shrunk = time.monotonic()
    comm = runtime.communicator()
    ready = state._ready_steps() if state is not None else []
    held = comm.allgather(ready)
    common = set(held[0]).intersection(*held[1:])
    if not common:
        raise JaxfogError(
            f"jaxfog.elastic.run: the survivors (old ranks {old_ranks}) hold no common step "
            f"in memory (steps held: {held}); nothing to resume in place from (keep more "
            f"steps than run(..., keep={ip.keep}))") from error
    step = max(common)
    assert state is not None  # this rank's steps (none without a State) hold `step`
    members = [state.resumed.members[r] for r in old_ranks]
    arrays = _flatten(state._history[step])
    record = Recovery(step, tuple(old_ranks), tuple(members), shrunk - started,
                      time.monotonic() - started)
    ip.recoveries.append(record)
    if runtime.size() == 1:
        warnings.warn(f"jaxfog.elastic.run: one rank survives (old rank {old_ranks[0]}); it "
                      "goes on alone, with nobody to average with", RuntimeWarning)
    if runtime.rank() == 0:
        lost = sorted(set(range(len(state.resumed.members))) - set(old_ranks))
        print(f"jaxfog.elastic: rank(s) {lost} failed; resumed in place at step {step} on "
              f"{runtime.size()} rank(s) (members {members}; shrink {record.shrink_s:.2f} s, "
              f"recovery {record.recover_s:.2f} s)", flush=True)
    return _Resume(step, arrays, members)


def _grow(ip: _InPlace, step: int, hosts: list[str]) -> None:
    """Adds ranks to the job in place (:func:`jaxfog.runtime.grow`), hands each
    newcomer the members and the state of the rank below the first one (the
    live copy), and sets everyone to resume at ``step``."""
    started = time.monotonic()
    state = ip.state
    assert state is not None  # the State that saw the request
    arrays = _flatten(state.values)  # the state before `step`: no step is redone
    old_members = list(state.resumed.members)
    count = len(hosts)
    old_size = runtime.grow(count, hosts if all(hosts) else None)
    members = old_members + list(range(ip.next_member, ip.next_member + count))
    donor = old_size - 1
    copied = {r: donor for r in range(old_size, runtime.size())}
    comm, rank = runtime.communicator(), runtime.rank()
    for newcomer in copied:
        if rank == 0:
            comm.send((step, members, copied), dest=newcomer, tag=_JOIN_TAG)
        if rank == donor:
            comm.send(arrays, dest=newcomer, tag=_COPY_TAG)
    record = Join(step, tuple(members), copied, time.monotonic() - started)
    ip.joins.append(record)
    if rank == 0:
        print(f"jaxfog.elastic: {count} rank(s) joined in place at step {step}; "
              f"{runtime.size()} rank(s) (members {members}, the newcomers' state from rank "
              f"{donor}; {record.join_s:.2f} s)", flush=True)
    ip.resume = _Resume(step, arrays, members, copied)


def _tell_launcher_hosts() -> None:
    """Writes the job's hosts (a rank's host a line) beside ``jaxfog run``'s
    control file, after a change in place, so that it asks for a host that
    comes back after its rank was lost; collective."""
    control = os.environ.get(CONTROL_ENV)
    if not control:
        return
    hosts = runtime.communicator().allgather(socket.gethostname())
    if runtime.rank() == 0:
        with open(control + ".hosts.partial", "w") as f:
            f.write("".join(f"{host}\n" for host in hosts))
        os.replace(control + ".hosts.partial", control + ".hosts")


def _tell_launcher_done() -> None:
    """Rank 0 tells ``jaxfog run`` that the program finished (a file beside its
    control file): Open MPI's launcher reports a failure when a rank that
    joined in place died, though the others went on and finished."""
    control = os.environ.get(CONTROL_ENV)
    if control and runtime.rank() == 0:
        open(control + ".done", "w").close()


def _arrive(ip: _InPlace) -> _Resume:
    """A newcomer's side of :func:`_grow`: the step, the members, a live copy."""
    comm = runtime.communicator()
    step, members, copied = comm.recv(source=0, tag=_JOIN_TAG)
    arrays = comm.recv(source=copied[runtime.rank()], tag=_COPY_TAG)
    ip.joins.append(Join(step, tuple(members), copied, 0.0))
    return _Resume(step, arrays, members, copied)


def _cache_compiled_programs() -> None:
    """Keeps every program this process compiles in JAX's persistent
    compilation cache (a folder of its own, removed at exit), unless the user
    or ``jaxfog run --max-restarts`` chose one.

    After a recovery in place every jitted function traces again (the ranks
    changed), and each program that is the same for the new size is loaded
    instead of compiled: the eager ops of the model's set-up, and the whole
    step of gradient allreduce or DiLoCo when its shapes do not depend on the
    number of ranks (their exchanges' programs do not).
    """
    if getattr(jax.config, "jax_compilation_cache_dir", None):  # set by the user or jaxfog run
        return
    folder = tempfile.mkdtemp(prefix="jaxfog-compiled-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    # A JAX without the touchpoint is named by tests/ops/test_jax_compat.py;
    # the run goes on, compiling again after a recovery.
    _jax_compat.use_compilation_cache(folder)


def run(program: Callable[[int], Any], *, max_failures: int = 1, keep: int = 3) -> Any:
    """Runs ``program(jaxfog.size())``, recovering in place when ranks fail.

    Under Open MPI 5 with ULFM (``mpiexec --with-ft ulfm``), a rank's death
    makes the survivors' ops fail (``rank r has failed``) instead of ending the
    job. ``run`` then catches the error ``program`` raises, rebuilds jaxfog on
    the survivors (:func:`jaxfog.runtime.shrink`: new ranks and size, default
    topology ``exponential(size())``), and runs ``program`` again for the new
    size, without a relaunch: its :class:`State` resumes from memory at the
    newest step whose state every survivor holds (each keeps the state before
    each of its last ``keep`` steps, as references, and lets one step run
    while it dispatches the next, so that the state before a failed step is
    still held when its failure shows, on survivors up to ``keep - 2`` steps
    apart), so the step that failed is redone.
    Members keep their ids, and the optimizers' invariants are restored as on
    a restart (:data:`RULES`): the same result as :func:`simulate` with
    ``Change(leave=[...])`` at that step.

    ``program(n)`` is the whole training for ``n`` ranks, as for
    :func:`simulate`: it builds what depends on the size (topology, optimizer,
    data shards, jitted steps), a :class:`State`, and loops over
    ``state.steps``. An error that is not a peer's failure is raised as is, as
    is the ``max_failures + 1``-th failure. One-sided windows do not survive a
    recovery.

    Where ULFM is absent (MPICH, Open MPI without ``--with-ft ulfm``, one
    process), ``run`` calls ``program`` once: a failed rank ends the job, and
    ``jaxfog run --max-restarts`` relaunches it (restart mode, from snapshots
    on disk).

    Returns:
      ``program``'s return value of the last run.
    """
    global _in_place
    max_failures = V.integer("jaxfog.elastic.run", "max_failures", max_failures, minimum=0)
    keep = V.integer("jaxfog.elastic.run", "keep", keep, minimum=2)
    runtime.init()
    if not runtime.fault_tolerant():
        return program(runtime.size())
    if _in_place is not None or _churn is not None:
        raise JaxfogError("jaxfog.elastic.run: already running (it does not nest)")
    _cache_compiled_programs()
    ip = _in_place = _InPlace(keep)
    failures = 0
    try:
        if runtime.joined():
            ip.resume = _arrive(ip)
        while True:
            ip.state = None
            if ip.resume is not None:
                _tell_launcher_hosts()
            try:
                result = program(runtime.size())
                _tell_launcher_done()
                return result
            except MembershipChange:  # ranks joined (State.steps grew the job)
                continue
            except Exception as error:
                if failures >= max_failures or not _peer_failure(error):
                    raise
                failures += 1
                ip.resume = _recover(ip, error)
    finally:
        _in_place = None


# --- churn on simulated agents ---------------------------------------------------------------

def simulate(program: Callable[[int], Any], agents: int,
             changes: Mapping[int, Change | Mapping[str, Any]] | None = None) -> Any:
    """Runs ``program(n)`` on ``n`` simulated agents with membership changes.

    ``program(n)`` is the whole training script for ``n`` agents (it builds its
    agents, e.g. ``jaxfog.Agents(simulated=n)``, its topology and optimizer,
    a :class:`State` of stacked values, and loops over ``state.steps``). At
    each step ``s`` of ``changes`` the loop stops, the agents of
    ``Change.leave`` (by member id) leave, ``Change.join`` agents join at the
    end, and ``program`` runs again for the new number of agents: its
    :class:`State` resumes at ``s`` as MPI ranks resume from a snapshot of
    step ``s`` (newcomers copied from the nearest remaining agent below them,
    invariants restored). An empty ``Change()`` is a restart with the same
    members (exchanges in flight dropped, as on MPI processes).

    Returns:
      ``program``'s return value of the last run, and each run's
      :class:`Resumed`: ``(result, [Resumed, ...])``.
    """
    global _churn
    agents = V.integer("jaxfog.elastic.simulate", "agents", agents, minimum=1)
    schedule = {}
    for step, change in (changes or {}).items():
        step = V.integer("jaxfog.elastic.simulate", "step", step, minimum=1)
        schedule[step] = change if isinstance(change, Change) else Change(**change)
    if _churn is not None:
        raise JaxfogError("jaxfog.elastic.simulate: already running (it does not nest)")
    sim = _Churn(agents, schedule)
    next_id = agents
    _churn = sim
    try:
        while True:
            try:
                result = program(len(sim.members))
                return result, sim.resumed
            except MembershipChange as stop:
                step = stop.args[0]
                change = schedule.pop(step)
                unknown = set(change.leave) - set(sim.members)
                if unknown:
                    raise ValueError(f"jaxfog.elastic.simulate: step {step}: members "
                                     f"{sorted(unknown)} are not in the run "
                                     f"({sim.members})") from None
                members = [m for m in sim.members if m not in set(change.leave)]
                members += list(range(next_id, next_id + change.join))
                next_id += change.join
                if not members:
                    raise ValueError(f"jaxfog.elastic.simulate: step {step}: no agent "
                                     "is left") from None
                if len(members) == 1:
                    warnings.warn("jaxfog.elastic.simulate: one agent is left; it goes on "
                                  "alone", RuntimeWarning)
                sim.members = members
    finally:
        _churn = None


__all__ = ["CONTROL_ENV", "Change", "DIRECTORY_ENV", "RESCALE_EXIT_STATUS", "RESTART_ENV",
           "Join", "Plan", "Recovery", "Resumed", "RULES", "State", "joins", "plan", "recoveries",
           "request_join", "run", "simulate"]
