"""The backend protocol: what running an op takes, and what else differs
between backends.

An op is one :class:`Op` record, defined in its module beside its arguments,
primitive and public functions: it carries its rule on MPI processes and its
rule on simulated agents. A backend runs records (:class:`Ops`: ``apply``,
and the nonblocking ``start``, ``wait`` and ``poll``) and implements what is
truly its own: an agent's training loop (:class:`TrainingLoop`,
``jaxfog.ops._training_loop``) and AD-PSGD's shared models
(:class:`SharedValues`). :class:`Backend` is the three; each backend
implements each concern in a class of its own and is their union: the MPI
backend (``mpi.py``) and the simulation's (``jaxfog.simulation._backend``).
This module imports neither; ``jaxfog.ops._dispatch`` chooses between them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax


Leaves = list[jax.Array]


class Op(NamedTuple):
    """An op, defined in its module (``jaxfog.ops.neighbor``...) beside its
    arguments, primitive and public functions, with its rule on each backend.

    On MPI processes, ``mpi(leaves, treedef, args)`` builds the
    :class:`jaxfog.ops._call.Call` of its FFI primitive: the blocking op runs
    it, a nonblocking start starts it. An op MPI runs otherwise (several
    primitives, or the C API of the windows) gives ``mpi_run(leaves, treedef,
    args)``, its result, instead, and has no nonblocking form. On simulated
    agents, ``simulated(sim, leaves, treedef, args)`` is its result computed
    with ``lax`` collectives over the agent axis (``sim``: the
    ``jaxfog._context.Simulation`` being traced); a nonblocking start computes
    it at once and holds it until the wait.

    ``args`` are the op's resolved arguments (a NamedTuple of its module);
    the message ops' result is their result leaves.
    """

    name: str
    simulated: Callable[..., Any]
    mpi: Callable[[Leaves, Any, Any], Any] | None = None
    mpi_run: Callable[[Leaves, Any, Any], Any] | None = None


class Ops(Protocol):
    """Running an op's record: at once, or started and waited for."""

    def apply(self, op: Op, leaves: Leaves, treedef: Any, args: Any) -> Any:
        """``op`` on ``leaves`` (the flat input, of structure ``treedef``;
        ``[]`` and None for an op without data) with its resolved ``args``:
        its result (a message op's: the result leaves)."""

    # Nonblocking ops (jaxfog.ops.nonblocking): ``start`` runs ``op`` as
    # ``apply`` would on the same inputs, returning the arrays a handle holds
    # and a hashable description; ``wait`` turns them into the op's result.
    def start(self, op: Op, leaves: Leaves, treedef: Any, args: Any
              ) -> tuple[Leaves, Any]: ...

    def wait(self, arrays: Leaves, handle: Any) -> Leaves: ...

    def poll(self, arrays: Leaves, handle: Any) -> bool:
        """Whether ``wait`` would return at once (concrete arrays)."""


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


class Backend(Ops, TrainingLoop, SharedValues, Protocol):
    """What every backend implements: the three concerns."""


#: The concerns, each with the protocol a backend's class for it implements.
CONCERNS = (Ops, TrainingLoop, SharedValues)
