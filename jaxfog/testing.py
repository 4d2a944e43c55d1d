"""Running test bodies on several MPI ranks from a plain pytest process.

``run_mpi(nprocs, file, function)`` launches ``jaxfog run``'s mpiexec command
with ``python -m jaxfog.testing FILE FUNCTION`` in every rank, under a
timeout, so a deadlock fails in seconds instead of hanging the suite. In the
ranks, :func:`main` imports FILE, calls FUNCTION (or its ``mpi_body``), and on
an exception prints the rank's traceback, gives the other ranks a moment to
report theirs, then aborts the job so that ranks stuck waiting for the failed
one do not hang.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable, Mapping, Sequence

from jaxfog import runtime, simulation, topology
from jaxfog.cli import _launcher

#: Seconds a failed rank waits for the others to fail too before aborting.
FAILURE_GRACE_SECONDS = 3.0


@dataclasses.dataclass
class MpiResult:
    """What a launch did: its command, exit status, the ranks' merged output
    and how long it ran."""

    command: list[str]
    returncode: int | None  # None: killed at the timeout
    output: str
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether the launch exited with status 0 (as every rank did)."""
        return self.returncode == 0

    def report(self) -> str:
        """The command, how it ended and the ranks' output, for an assertion message."""
        status = ("timed out (killed)" if self.returncode is None
                  else f"exit status {self.returncode}")
        return (f"{' '.join(self.command)}\n{status} after {self.seconds:.1f} s; "
                f"output of all ranks:\n{self.output}")


#: The JAX platforms the ranks of :func:`run_mpi` use (default ``cpu``).
TEST_PLATFORMS_ENV = "JAXFOG_TEST_PLATFORMS"


def platforms() -> str:
    """The JAX platforms test launches use: ``JAXFOG_TEST_PLATFORMS``, default ``cpu``."""
    return os.environ.get(TEST_PLATFORMS_ENV, "cpu")


def launch_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a test launch: JAX on :func:`platforms`, a bounded
    JAXFOG_TIMEOUT, unbuffered output, no GPU memory taken up front."""
    # XLA_PYTHON_CLIENT_PREALLOCATE: ranks sharing a GPU must not each take 75% of it.
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            **os.environ, "JAXFOG_TIMEOUT": "30", "PYTHONUNBUFFERED": "1",
            "JAX_PLATFORMS": platforms(), **(env or {})}


def run_command(command: Sequence[str], *, timeout: float,
                env: Mapping[str, str] | None = None,
                stop: Callable[[], bool] | None = None) -> MpiResult:
    """Runs ``command`` (e.g. ``jaxfog run -np 4 ...``) with stdout and stderr
    merged; never past ``timeout``, and nothing it started outlives it.

    ``subprocess.run(timeout=...)`` kills only its child: ``jaxfog run`` dies,
    and mpiexec and the ranks go on (holding the GPU). Killing the command's
    session is not enough either, since MPI launchers start the ranks in
    sessions of their own (on the GPU machine, 9 processes of a timed-out
    launch outlived it and hung the next test). So every process started
    carries a marker in its environment, and whatever carries it is killed
    at the timeout, when this process is interrupted (Ctrl-C,
    pytest-timeout), and after a normal end. ``stop``, polled twice a second,
    ends the command the same way when it returns true (as the timeout does:
    ``returncode`` None).
    """
    start = time.monotonic()
    marker = f"{os.getpid()}.{next(_launches)}"
    process = subprocess.Popen(list(command),
                               env={**(os.environ if env is None else env), _MARKER: marker},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    deadline = start + timeout
    returncode: int | None = None
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                output, _ = process.communicate(
                    timeout=max(0.0, left if stop is None else min(left, 0.5)))
                returncode = process.returncode
                break
            except subprocess.TimeoutExpired:  # retrying loses no output
                if time.monotonic() >= deadline or (stop is not None and stop()):
                    _kill_launch(process, marker)
                    output, _ = process.communicate()
                    break
    except BaseException:
        _kill_launch(process, marker)
        process.wait()
        raise
    _kill_launch(process, marker)
    return MpiResult(list(command), returncode, output, time.monotonic() - start)


#: The environment variable that marks the processes of one :func:`run_command`.
_MARKER = "JAXFOG_TEST_LAUNCH"
_launches = itertools.count()


def _kill_launch(process: subprocess.Popen, marker: str) -> None:
    """SIGKILLs the command's session and every process whose environment
    carries ``_MARKER=marker`` (where /proc lists them)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the session is gone already
        pass
    tag = f"{_MARKER}={marker}".encode() + b"\0"
    processes = Path("/proc")
    for entry in processes.iterdir() if processes.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if tag in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue


def beside(file: str | os.PathLike, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the folder of ``file`` first on ``PYTHONPATH``: the ranks
    that run a test's bodies import the helper modules beside it."""
    folder = str(Path(file).resolve().parent)
    return {**env, "PYTHONPATH": os.pathsep.join(
        [folder, *filter(None, [env.get("PYTHONPATH")])])}


def run_mpi(nprocs: int, file: str | os.PathLike, function: str | Sequence[str], *,
            timeout: float = 120, env: Mapping[str, str] | None = None,
            stop: Callable[[], bool] | None = None) -> MpiResult:
    """Runs ``function`` from ``file`` on ``nprocs`` ranks; never hangs past ``timeout``.

    Several functions run one after the other in the same processes (each
    starts with the environment, float64 setting, topology and clocks the
    launch began with); ``stop`` and :data:`PROGRESS_ENV` tell which hung.
    The ranks run JAX on the CPU, or on ``JAXFOG_TEST_PLATFORMS`` (e.g. ``cuda``:
    the GPU check runs the multi-rank suite on GPU arrays).
    """
    functions = [function] if isinstance(function, str) else list(function)
    full_env = beside(file, launch_environment(env))
    command = _launcher.build_command(
        [sys.executable, "-m", "jaxfog.testing", str(Path(file).resolve()), *functions],
        nprocs, env=full_env)
    return run_command(command, timeout=timeout, env=full_env, stop=stop)


def _load(file: str):
    path = Path(file)
    spec = importlib.util.spec_from_file_location(f"_jaxfog_mpi_{path.stem}", path)
    assert spec is not None and spec.loader is not None  # a test's .py file: a source loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Beside(importlib.abc.MetaPathFinder):
    """Finds a top-level module in ``folder``: last on ``sys.meta_path``, so only
    what no other finder has (installed packages, the standard library) comes
    from there."""

    def __init__(self, folder: Path):
        self.folder = str(folder)

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [self.folder])


def load_module(file: str | os.PathLike) -> ModuleType:
    """The program ``file`` (a ``.py`` file: an example, a script, a benchmark)
    as a module, under its own name in ``sys.modules``, as running it makes it
    importable; a second call gives the same module.

    While it loads, its imports of the modules beside it (``train_lm`` imports
    ``train_digits``, as a script imports a file in its folder) are looked for
    in its folder, after every other place, and loaded the same way. Nothing
    stays on ``sys.path`` or ``sys.meta_path``, so an ``import`` elsewhere never
    finds such a file by accident.

    Raises:
      ModuleNotFoundError: no such file.
      ImportError: a module of that name is already imported from elsewhere.
    """
    path = Path(file).resolve()
    name = path.stem
    module = sys.modules.get(name)
    if module is not None:  # loaded before (or imported by a file loaded before)
        if Path(getattr(module, "__file__", None) or "").resolve() != path:
            raise ImportError(f"a module named {name!r} is already imported, from "
                              f"{getattr(module, '__file__', None)}, not from {path.parent}")
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ModuleNotFoundError(f"no {path.name} in {path.parent}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: its own imports may refer to it
    finder = _Beside(path.parent)
    sys.meta_path.append(finder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.meta_path.remove(finder)
    return module


def _fail(rank: int, error: BaseException) -> None:
    from mpi4py import MPI

    text = "".join(traceback.format_exception(error))
    sys.stderr.write(f"===== rank {rank} failed =====\n{text}")
    sys.stderr.flush()
    # Let ranks failing the same way print theirs; then end ranks stuck waiting.
    request = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + FAILURE_GRACE_SECONDS
    while not request.Test():
        if time.monotonic() > deadline:
            MPI.COMM_WORLD.Abort(1)
        time.sleep(0.01)
    sys.exit(1)


#: Set in the ranks of a launch running several functions: the folder where
#: each rank notes which it started and which passed (``rank<r>``), so that the
#: launching process tells which failed or hung.
PROGRESS_ENV = "JAXFOG_TEST_PROGRESS"


def _between_functions(environ: dict[str, str], x64: bool) -> None:
    """Undoes what one function of a launch leaves behind for the next: the
    environment, float64, jaxfog's topology (back to the default) and clocks."""
    import jax

    os.environ.clear()
    os.environ.update(environ)
    jax.config.update("jax_enable_x64", x64)
    if runtime.is_initialized():
        runtime.set_topology(topology.exponential(runtime.size()))
        simulation.reset_clocks()


def main(argv: Sequence[str] | None = None) -> None:
    """In each rank (``python -m jaxfog.testing FILE FUNCTION...``): runs each
    FUNCTION (or its ``mpi_body``) from FILE in turn, the ranks together; on an
    exception reports it and aborts the job."""
    file, *functions = (sys.argv[1:] if argv is None else argv)
    module = _load(file)
    import jax

    progress = os.environ.get(PROGRESS_ENV)
    rank = _launcher._first_int(os.environ, _launcher._RANK_VARS) or 0  # before MPI starts
    note = Path(progress, f"rank{rank}") if progress else None
    environ = dict(os.environ)
    # jax.config's options are attributes it sets at run time (untyped).
    x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]
    for function in functions:
        if note is not None:
            with note.open("a") as out:
                out.write(f"start {function}\n")
        target = getattr(module, function)
        try:
            getattr(target, "mpi_body", target)()
        except BaseException as error:  # noqa: BLE001 (report every failure, then abort)
            from mpi4py import MPI

            _fail(MPI.COMM_WORLD.Get_rank(), error)
        from mpi4py import MPI

        # Every rank leaves together, so none finalizes (or starts the next
        # function) while a peer still works.
        MPI.COMM_WORLD.Barrier()
        if note is not None:
            with note.open("a") as out:
                out.write(f"ok {function}\n")
        _between_functions(environ, x64)


__all__ = ["MpiResult", "beside", "launch_environment", "load_module", "main", "platforms",
           "run_command", "run_mpi"]


if __name__ == "__main__":
    main()
