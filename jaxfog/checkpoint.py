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

A run of n simulated agents (one process, states stacked) continues on n MPI
processes, and back, after :func:`convert` rewrites its checkpoints in the
other layout (offline, in one process)::

    jaxfog.checkpoint.convert("ckpt_sim", "ckpt_mpi", processes=4, like=one_agent_state)

On a device mesh of several processes (``jaxfog.Agents(mesh=True)``), the
state is global arrays of the stacked agents: every process calls ``save``
and ``restore`` together and they write one checkpoint, in the simulated
agents' layout (restored with the sharding of ``like``).

Needs ``pip install orbax-checkpoint`` (the ``jaxfog[checkpoint]`` extra).
"""

from __future__ import annotations

import json
import os
from typing import Any, cast

import jax
import numpy as np

from jaxfog import _validate as V
from jaxfog import runtime


def _processes() -> tuple[int, int, Any]:
    """(rank, number of processes, mpi4py comm or None) of the per-rank
    layout. Processes of one ``jax.distributed`` job (a device mesh) write one
    checkpoint of their global arrays together, as one process would: the
    simulated agents' layout (orbax coordinates them)."""
    if jax.process_count() == 1 and runtime.is_initialized() and runtime.size() > 1:
        # An MPI process's rank: an int (only a simulated agent's is traced).
        return cast(int, runtime.rank()), runtime.size(), runtime.communicator()
    return 0, 1, None


def _path(what: str, name: str, value: Any) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what}: {name} must be a path (a str or os.PathLike), got "
                        f"{type(value).__name__} {value!r}")


def _step(what: str, step: Any) -> int:
    """A step: an int >= 0, or an integer scalar array (e.g. an optimizer's count)."""
    if hasattr(step, "dtype") and np.ndim(step) == 0 and np.issubdtype(step.dtype, np.integer):
        step = int(step)
    return V.integer(what, "step", step, minimum=0)


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
        what = "jaxfog.checkpoint.CheckpointManager"
        _path(what, "directory", directory)
        if max_to_keep is not None:
            V.integer(what, "max_to_keep", max_to_keep, minimum=1)
        V.integer(what, "save_interval_steps", save_interval_steps, minimum=1)
        V.flag(what, "async_save", async_save)
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
        hint = ("; jaxfog.checkpoint.convert rewrites simulated agents' checkpoints for "
                "MPI processes and back")
        layout = os.path.join(self.directory, "jaxfog.json")
        found = None
        if self.rank == 0 and jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            if os.path.exists(layout):
                with open(layout) as f:
                    found = json.load(f)["processes"]
            else:
                with open(layout, "w") as f:
                    json.dump({"processes": self.size}, f)
        if self._comm is not None:
            found = self._comm.bcast(found, root=0)
        elif jax.process_count() > 1:
            from jax.experimental import multihost_utils

            found = int(multihost_utils.broadcast_one_to_all(
                np.int64(-1 if found is None else found)))
            found = None if found < 0 else found
        if found is not None and found != self.size:
            raise ValueError(
                f"jaxfog.checkpoint: {self.directory} holds checkpoints of a run with {found} "
                f"process(es); this run has {self.size}. Restore with the same number of "
                f"processes (each rank restores its own agent){hint}.")

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Saves this rank's ``state`` (any pytree of arrays) as ``step``.

        Every rank must call it with the same step. Returns whether a
        checkpoint was written (orbax skips steps by ``save_interval_steps``).
        """
        step = _step("jaxfog.checkpoint.save", step)
        V.flag("jaxfog.checkpoint.save", "force", force)
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
        if step is not None:
            step = _step("jaxfog.checkpoint.restore", step)
        steps = self.all_steps()
        step = (steps[-1] if steps else None) if step is None else step
        if step not in steps:
            raise FileNotFoundError(f"jaxfog.checkpoint: no checkpoint of step {step} on "
                                    f"every rank in {self.directory} (have {steps})")
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), like)
        return self._manager.restore(step, args=self._ocp.args.StandardRestore(target))

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _layout(directory: str) -> int:
    try:
        with open(os.path.join(directory, "jaxfog.json")) as f:
            return int(json.load(f)["processes"])
    except FileNotFoundError:
        raise FileNotFoundError(f"jaxfog.checkpoint.convert: {directory} holds no jaxfog "
                                "checkpoints (no jaxfog.json)") from None


def convert(source: str | os.PathLike, destination: str | os.PathLike, *, processes: int,
            like: Any) -> list[int]:
    """Rewrites every checkpoint in ``source`` for ``processes`` processes.

    One process of n simulated agents (each leaf stacked along a leading axis
    of n) becomes n processes of one agent each (``processes=n``), and n
    processes become one process of n stacked agents (``processes=1``).
    Offline, in one process (no MPI); bit for bit.

    Args:
      source: a directory written by :class:`CheckpointManager`.
      destination: a new (or empty) directory.
      processes: the number of processes the destination is for.
      like: the state of *one* agent (a pytree of arrays or
        ``jax.ShapeDtypeStruct``): the structure, shapes and dtypes.

    Returns:
      The steps converted.
    """
    _path("jaxfog.checkpoint.convert", "source", source)
    _path("jaxfog.checkpoint.convert", "destination", destination)
    import orbax.checkpoint as ocp

    source, destination = os.path.abspath(os.fspath(source)), os.path.abspath(
        os.fspath(destination))
    processes = V.integer("jaxfog.checkpoint.convert", "processes", processes, minimum=1)
    found = _layout(source)
    if (found == 1) == (processes == 1):
        raise ValueError(f"jaxfog.checkpoint.convert: {source} is for {found} process(es); "
                         "it converts one process of stacked agents to one process per "
                         f"agent and back, not to {processes}")
    if os.path.exists(destination) and os.listdir(destination):
        raise ValueError(f"jaxfog.checkpoint.convert: {destination} is not empty")
    agents = max(found, processes)
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), like)
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((agents, *x.shape), x.dtype), one)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)

    def managers(root, count):
        return [ocp.CheckpointManager(os.path.join(root, f"rank_{r}"), options=options)
                for r in range(count)]

    readers, writers = managers(source, found), managers(destination, processes)
    try:
        steps = sorted(set.intersection(*(set(m.all_steps()) for m in readers)))
        for step in steps:
            if found == 1:
                state = readers[0].restore(step, args=ocp.args.StandardRestore(stacked))
                for r, writer in enumerate(writers):
                    writer.save(step, args=ocp.args.StandardSave(
                        jax.tree.map(lambda v, r=r: np.asarray(v)[r], state)))
            else:
                states = [m.restore(step, args=ocp.args.StandardRestore(one)) for m in readers]
                writers[0].save(step, args=ocp.args.StandardSave(jax.tree.map(
                    lambda *v: np.stack([np.asarray(x) for x in v]), *states)))
    finally:
        for manager in readers + writers:
            manager.close()
    with open(os.path.join(destination, "jaxfog.json"), "w") as f:
        json.dump({"processes": processes}, f)
    return steps


__all__ = ["CheckpointManager", "convert"]
