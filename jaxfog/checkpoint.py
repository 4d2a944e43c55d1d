"""Checkpointing a decentralized run with orbax-checkpoint.

In a decentralized run every agent has its own parameters and optimizer state
(the schedule step lives there too), so every agent is saved. Each MPI process
is its own JAX process, so each rank writes its own orbax checkpoint under
``<directory>/rank_<r>``; with one process (simulated agents, their state
stacked along the agent axis) the checkpoint is ``<directory>/rank_0``.
``<directory>/jaxfog.json`` records the number of processes, and a restore
with another number raises instead of mixing up agents::

    manager = jaxfog.checkpoint.CheckpointManager("ckpt", max_to_keep=3)
    step = manager.latest_step()            # agreed by all ranks, or None
    if step is not None:
        params, opt_state = manager.restore(step, like=(params, opt_state))
    ...
    manager.save(step, (params, opt_state))  # every rank, same step
    manager.close()

Arrays are restored with the dtypes and shapes of ``like`` and bit for bit,
so a restored run continues exactly as the uninterrupted one would have.
Needs ``pip install orbax-checkpoint`` (the ``jaxfog[checkpoint]`` extra).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from jaxfog import runtime


def _processes() -> tuple[int, int, Any]:
    """(rank, number of processes, mpi4py comm or None)."""
    if runtime.is_initialized() and runtime.size() > 1:
        return runtime.rank(), runtime.size(), runtime._require().comm
    return 0, 1, None


class CheckpointManager:
    """One orbax ``CheckpointManager`` per rank, stepping together.

    Args:
      directory: shared by all ranks (each writes ``rank_<r>`` inside it).
      max_to_keep: keep only the newest checkpoints (default: all).
      save_interval_steps: as orbax's option of that name.
      async_save: let orbax write in a background thread (``save`` returns
        before the files are complete; ``wait_until_finished`` or ``close``
        waits).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
                 save_interval_steps: int = 1, async_save: bool = True):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.rank, self.size, self._comm = _processes()
        self.directory = os.path.abspath(os.fspath(directory))
        self._check_layout()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                               save_interval_steps=save_interval_steps,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(
            os.path.join(self.directory, f"rank_{self.rank}"), options=options)

    def _check_layout(self) -> None:
        """Writes (rank 0) or checks the number of processes the directory is for."""
        layout = os.path.join(self.directory, "jaxfog.json")
        found = None
        if self.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
            if os.path.exists(layout):
                with open(layout) as f:
                    found = json.load(f)["processes"]
            else:
                with open(layout, "w") as f:
                    json.dump({"processes": self.size}, f)
        if self._comm is not None:
            found = self._comm.bcast(found, root=0)
        if found is not None and found != self.size:
            raise ValueError(
                f"jaxfog.checkpoint: {self.directory} holds checkpoints of a run with {found} "
                f"process(es); this run has {self.size}. Restore with the same number of "
                "processes (each rank restores its own agent).")

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Saves this rank's ``state`` (any pytree of arrays) as ``step``.

        Every rank must call it with the same step. Returns whether a
        checkpoint was written (orbax skips steps by ``save_interval_steps``).
        """
        steps = [int(step)] if self._comm is None else self._comm.allgather(int(step))
        if len(set(steps)) > 1:
            passed = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
            raise ValueError(f"jaxfog.checkpoint.save: ranks disagree on the step ({passed})")
        return self._manager.save(int(step), args=self._ocp.args.StandardSave(state),
                                  force=force)

    def all_steps(self) -> list[int]:
        """Steps that every rank has a checkpoint of."""
        steps = set(self._manager.all_steps())
        if self._comm is not None:
            for other in self._comm.allgather(sorted(steps)):
                steps &= set(other)
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest step that every rank has (a rank stopped mid-save has fewer)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None, like: Any) -> Any:
        """This rank's state at ``step`` (default: ``latest_step()``), shaped like ``like``."""
        steps = self.all_steps()
        step = (steps[-1] if steps else None) if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"jaxfog.checkpoint: no checkpoint of step {step} on "
                                    f"every rank in {self.directory} (have {steps})")
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), like)
        return self._manager.restore(step, args=self._ocp.args.StandardRestore(target))

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["CheckpointManager"]
