"""Where an op runs: the one place a backend is chosen.

While ``jaxfog.simulate`` traces the per-agent function, ops run on the
simulated agents (the backend the simulation brings,
``jaxfog.simulation._backend``); otherwise on this job's MPI processes
(``jaxfog.ops._backends.mpi``). No module above ``jaxfog.ops`` asks which.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxfog import _context
from jaxfog.ops import _args
from jaxfog.ops._backends import Backend, Op, mpi


def current() -> Backend:
    """The backend the calling code runs on."""
    sim = _context.current()
    if sim is not None:
        return sim.backend(sim)
    return mpi.backend()


def apply(op: Op, x: Any, args: Any) -> Any:
    """Runs the message op ``op`` with resolved ``args`` on the pytree ``x``
    (one message per peer)."""
    leaves, treedef = _args.leaves(op.name, x)
    return jax.tree.unflatten(treedef, current().apply(op, leaves, treedef, args))


def run(op: Op, args: Any, leaves: list | None = None, treedef: Any = None) -> Any:
    """Runs ``op`` with resolved ``args`` (on ``leaves`` of structure
    ``treedef``, for an op with data): its result as the backend gives it."""
    return current().apply(op, [] if leaves is None else leaves, treedef, args)
