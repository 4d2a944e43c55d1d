"""The MPI backend: each op's record runs its rule on this job's processes.

An op's module computes this rank's part of it at trace time (its row of W as
a communication plan, its ranks, its root: ``Op.mpi``) and passes it to its
FFI primitive as static parameters; the C++ handler exchanges the messages.
Here: running and starting those calls, the training loop in real time, and
AD-PSGD's shared models (``jaxfog.ops._windows_mpi``).
"""

from __future__ import annotations

import time
from typing import Any

from jaxfog import ffi, runtime
from jaxfog.errors import JaxfogTimeoutError
from jaxfog.ops import _sync_primitives
from jaxfog.ops import _call, _windows_mpi
from jaxfog.ops._call import CallHandle


def _barrier() -> None:
    _sync_primitives.barrier_p.bind(comm_id=runtime.WORLD_COMM_ID)


class MpiOps:
    """Ops on this job's MPI processes, through jaxfog's C++ FFI library: each
    runs its op's :class:`jaxfog.ops._call.Call` (``Op.mpi``) or its own way
    (``Op.mpi_run``), and a start starts the call."""

    def apply(self, op: Any, leaves: list, treedef: Any, args: Any) -> Any:
        if op.mpi_run is not None:
            return op.mpi_run(leaves, treedef, args)
        return op.mpi(leaves, treedef, args).run()

    # Nonblocking ops: each op's Call started, and finished at the wait.
    def start(self, op: Any, leaves: list, treedef: Any, args: Any
              ) -> tuple[list, CallHandle]:
        if op.mpi is None:
            raise NotImplementedError(f"jaxfog.{op.name} has no nonblocking form")
        return _call.start_call(op.mpi(leaves, treedef, args))

    def wait(self, arrays: list, handle: CallHandle) -> list:
        return _call.wait_call(arrays, handle)

    def poll(self, arrays: list, handle: CallHandle) -> bool:
        return _call.poll_call(arrays, handle)


class MpiTrainingLoop:
    """An agent's training loop (jaxfog.ops._training_loop): real time, compiled steps."""

    def now(self) -> float:
        return time.perf_counter()

    def call_step(self, step: Any, *args: Any) -> Any:
        return step.jitted(*args)

    def compile_step(self, step: Any, *args: Any) -> None:
        step.jitted.lower(*args).compile()

    def settle(self) -> None:
        """Every rank's one-sided writes so far have landed (a barrier)."""
        _barrier()

    def run(self, trainer: Any, state: Any, grad_fn: Any, iterations: int, until: Any, *,
            warmup: bool, poll: float, callback: Any) -> Any:
        """The agent's loop in real time: wait for ``ready``, step, repeat."""
        limit, until = runtime.timeout(), float(until)
        if warmup:
            trainer.compile(state, grad_fn)
        while int(state.iteration) < iterations and self.now() < until:
            start = time.monotonic()
            while not trainer.ready(state):
                if self.now() >= until:
                    return state
                if limit and time.monotonic() - start > limit:
                    raise JaxfogTimeoutError(
                        f"rank {runtime.rank()}: not ready for iteration "
                        f"{int(state.iteration)} after {limit:.0f} s (JAXFOG_TIMEOUT): a "
                        "neighbour stopped")
                time.sleep(poll)
            state = trainer.step(state, grad_fn)
            if callback is not None:
                callback(state)
        return state


class MpiSharedValues:
    """AD-PSGD's shared models: a window's published value."""

    value_create = staticmethod(_windows_mpi.value_create)
    value_read = staticmethod(_windows_mpi.value_read)
    value_add = staticmethod(_windows_mpi.value_add)
    value_pair_average = staticmethod(_windows_mpi.value_pair_average)
    value_compile = staticmethod(_windows_mpi.value_compile)


class MpiBackend(MpiOps, MpiTrainingLoop, MpiSharedValues):
    """Ops on this job's MPI processes: the three concerns of
    ``jaxfog.ops._backends.Backend``."""


_BACKEND = MpiBackend()


def backend() -> MpiBackend:
    """The MPI backend, once jaxfog is initialised (its handlers registered)."""
    runtime._require()
    ffi.register_handlers()
    return _BACKEND
