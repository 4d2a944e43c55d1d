"""Where an op runs: the one place a backend is chosen.

While ``jaxfog.simulate`` traces the per-agent function, ops run on the
simulated agents (the backend the simulation brings:
``jaxfog.simulation._backend``, ``lax`` collectives over the agent axis);
otherwise on this job's MPI processes (:mod:`.mpi`, the FFI primitives).

What a backend implements comes in four concerns, one protocol each:
:class:`Ops` (``apply``: an :class:`Op` on its flat leaves with its resolved
arguments, returning the result leaves; the nonblocking start, wait and
poll), :class:`Windows` (the one-sided
windows), :class:`TrainingLoop` (what an agent's training loop needs: its
clock, compiled steps, the loop; ``jaxfog.ops._training_loop``) and
:class:`SharedValues` (AD-PSGD's shared models). :class:`Backend` is all
four; each backend implements each concern in a class of its own and is
their union. A new backend implements them; no module above ``jaxfog.ops``
asks which backend it runs on.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, NamedTuple, Protocol

import jax

from jaxfog import _context
from jaxfog.ops import _args
from jaxfog.ops._backends import mpi

Leaves = list[jax.Array]


class Op(NamedTuple):
    """An op as the backends run it, defined in its module beside its
    primitive, arguments and public functions (``jaxfog.ops.neighbor``...).

    ``name`` keys the simulation's rule for it
    (``jaxfog.simulation._backend.SIMULATED``: the op as ``lax`` collectives
    over the agents); the MPI rules are here. ``mpi(leaves, treedef, args)``
    builds the :class:`jaxfog.ops._call.Call` of the FFI primitive on MPI
    processes: the blocking op runs it, a nonblocking start starts it. An op
    MPI runs as several primitives gives ``mpi_run(leaves, treedef, args)``
    (its result leaves) instead, and has no nonblocking form.
    """

    name: str
    mpi: Callable[[Leaves, Any, Any], Any] | None = None
    mpi_run: Callable[[Leaves, Any, Any], Leaves] | None = None


class Ops(Protocol):
    """The message ops and their nonblocking forms."""

    def apply(self, op: Op, leaves: Leaves, treedef: Any, args: Any) -> Leaves:
        """``op`` on ``leaves`` (the flat input, of structure ``treedef``)
        with its resolved ``args``: the result leaves."""

    def barrier(self) -> None: ...

    # Nonblocking ops (jaxfog.ops.nonblocking): ``start`` runs ``op`` as
    # ``apply`` would on the same inputs (``win_get`` has no leaves: ``[]`` and
    # None), returning the arrays a handle holds and a hashable description;
    # ``wait`` turns them into the op's result leaves.
    def start(self, op: Op, leaves: Leaves, treedef: Any, args: Any
              ) -> tuple[Leaves, Any]: ...

    def wait(self, arrays: Leaves, handle: Any) -> Leaves: ...

    def poll(self, arrays: Leaves, handle: Any) -> bool:
        """Whether ``wait`` would return at once (concrete arrays)."""


class Windows(Protocol):
    """One-sided windows (jaxfog.ops.window): the public functions resolve
    their arguments (jaxfog.ops._args.Win*) and call these."""

    def win_create(self, leaves: Leaves, treedef: Any, args: _args.WinCreate) -> bool: ...

    def win_free(self, name: str | None) -> bool: ...

    def win_put(self, leaves: Leaves, treedef: Any, args: _args.WinPut) -> Leaves: ...

    def win_get(self, args: _args.WinGet) -> bool: ...

    def win_update(self, leaves: Leaves, treedef: Any, args: _args.WinUpdate) -> Leaves: ...

    def win_version(self, name: str) -> dict[int, Any]: ...

    def win_weight(self, name: str) -> Any: ...

    def win_mutex(self, name: str, ranks: Any) -> ContextManager[None]: ...


class TrainingLoop(Protocol):
    """An agent's training loop (jaxfog.ops._training_loop, for jaxfog.asynchrony):
    what differs between running as processes in real time and as traced
    agents in simulated time."""

    def now(self) -> Any:
        """This agent's clock, in seconds."""

    def call_step(self, step: Any, *args: Any) -> Any:
        """Runs a ``jaxfog.ops._training_loop.StepFunction`` (compiled, or traced in)."""

    def compile_step(self, step: Any, *args: Any) -> None:
        """Compiles it ahead of the loop (where there is anything to compile)."""

    def settle(self) -> None:
        """Collective: every agent's one-sided writes so far have landed."""

    def run(self, trainer: Any, state: Any, grad_fn: Any, iterations: int, until: Any, *,
            warmup: bool, poll: float, callback: Any) -> Any:
        """The agent's loop of ``trainer.ready``/``trainer.step`` until ``iterations``
        or its clock reaches ``until``."""


class SharedValues(Protocol):
    """AD-PSGD's shared models: a window's published value, read, added to and
    averaged pairwise, atomically."""

    def value_create(self, leaves: Leaves, treedef: Any, name: str, peers: Any) -> None: ...

    def value_read(self, name: str) -> Any: ...

    def value_add(self, name: str, x: Any) -> None: ...

    def value_pair_average(self, name: str, peer: Any) -> None: ...

    def value_compile(self, name: str) -> None: ...


class Backend(Ops, Windows, TrainingLoop, SharedValues, Protocol):
    """What every backend implements: the four concerns."""


#: The concerns, each with the protocol a backend's class for it implements.
CONCERNS = (Ops, Windows, TrainingLoop, SharedValues)


def current() -> Backend:
    """The backend the calling code runs on."""
    sim = _context.current()
    if sim is not None:
        return sim.backend(sim)
    return mpi.backend()


def apply(op: Op, x: Any, args: Any) -> Any:
    """Runs ``op`` with resolved ``args`` on the pytree ``x`` (one message per peer)."""
    leaves, treedef = _args.leaves(op.name, x)
    return jax.tree.unflatten(treedef, current().apply(op, leaves, treedef, args))
