"""``jaxfog run``: a thin wrapper over the installed MPI's ``mpiexec``.

It builds one ``mpiexec`` command line for the MPI flavour found (MPICH's
hydra or Open MPI), forwards the environment, and starts every rank through
:func:`exec_rank`, which gives each local rank its own GPU (when GPUs exist)
and caps XLA's CPU threads when a machine runs more ranks than it has cores,
then ``exec``s the user's command. Nothing else is hidden: ``--dry-run``
prints the command.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

#: Overrides which mpiexec is used (e.g. a cluster's system MPI).
MPIEXEC_ENV = "JAXFOG_MPIEXEC"
#: XLA flags that keep one rank on one CPU thread.
XLA_SINGLE_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false",
                           "intra_op_parallelism_threads=1")
# Variables never forwarded to Open MPI ranks with -x (shell internals).
_NOT_FORWARDED = ("BASH_FUNC_", "_", "PWD", "OLDPWD", "SHLVL")


def find_mpiexec(env: Mapping[str, str] | None = None) -> str:
    """The mpiexec to use: ``$JAXFOG_MPIEXEC``, the one installed beside this
    Python (the ``mpich`` wheel puts it there), then the first on ``PATH``."""
    env = os.environ if env is None else env
    chosen = env.get(MPIEXEC_ENV)
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            raise FileNotFoundError(f"{MPIEXEC_ENV}={chosen!r} is not an executable")
        return path
    beside_python = Path(sys.executable).parent / "mpiexec"
    if beside_python.exists():
        return str(beside_python)
    path = shutil.which("mpiexec", path=env.get("PATH"))
    if path is None:
        raise FileNotFoundError(
            "no mpiexec found: install the 'mpich' wheel (pip install mpich) or set "
            f"{MPIEXEC_ENV} to your MPI's mpiexec")
    return path


def mpi_flavour(mpiexec: str) -> str:
    """'hydra' (MPICH, Intel MPI), 'openmpi', or 'unknown'."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in text.upper() or "Intel(R) MPI" in text:
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text or "prterun" in text:
        return "openmpi"
    return "unknown"


#: MPICH's asynchronous progress (a thread per rank that progresses one-sided
#: operations); ``jaxfog run`` turns it on for runs over several hosts.
ASYNC_PROGRESS_ENV = "MPIR_CVAR_ASYNC_PROGRESS"


def build_command(command: Sequence[str], np: int, *, hosts: str | None = None,
                  hostfile: str | None = None, mpi_args: Sequence[str] = (),
                  mpiexec: str | None = None, flavour: str | None = None,
                  env: Mapping[str, str] | None = None,
                  rank_shim: bool = True) -> list[str]:
    """The full mpiexec command line that ``jaxfog run`` executes."""
    if np < 1:
        raise ValueError(f"-np must be >= 1, got {np}")
    if not command:
        raise ValueError("no command to run: jaxfog run -np N COMMAND [ARGS...]")
    env = os.environ if env is None else env
    mpiexec = mpiexec or find_mpiexec(env)
    flavour = flavour or mpi_flavour(mpiexec)
    args = [mpiexec, "-n", str(np)]
    if flavour == "openmpi":
        if hosts:
            args += ["-H", hosts]
        if hostfile:
            args += ["--hostfile", hostfile]
        if not hosts and not hostfile and np > (os.cpu_count() or 1):
            args.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--allow-run-as-root")
        for name in sorted(env):
            if not name.startswith(_NOT_FORWARDED) and name not in _NOT_FORWARDED:
                args += ["-x", name]
    else:  # hydra forwards the whole environment with -genvall
        if flavour == "hydra":
            args.append("-genvall")
        if hosts:
            args += ["-hosts", hosts]
        if hostfile:
            args += ["-f", hostfile]
        if flavour == "hydra" and (hosts or hostfile) and ASYNC_PROGRESS_ENV not in env:
            # Passive-target RMA (jaxfog's windows) across nodes completes only
            # while the target enters MPI; MPICH's progress thread does that.
            args += ["-genv", ASYNC_PROGRESS_ENV, "1"]
    args += list(mpi_args)
    if rank_shim:
        args += [sys.executable, str(Path(__file__).resolve())]
    return args + list(command)


# --- per-rank set-up (runs in each rank before the user's command) ---------

def _first_int(env: Mapping[str, str], names: Sequence[str]) -> int | None:
    for name in names:
        text = env.get(name, "")
        # SLURM_TASKS_PER_NODE looks like "4(x2),3": the first count is ours
        # only on homogeneous allocations, which is what the cap needs.
        digits = text.split("(")[0].split(",")[0]
        if digits.isdigit():
            return int(digits)
    return None


def local_rank_and_size(env: Mapping[str, str]) -> tuple[int, int]:
    """This rank's position on its machine, from the launcher's variables."""
    rank = _first_int(env, ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                            "PMI_LOCAL_RANK", "PMIX_LOCAL_RANK", "SLURM_LOCALID"))
    size = _first_int(env, ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                            "PMI_LOCAL_SIZE", "PMIX_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                            "SLURM_TASKS_PER_NODE"))
    return rank or 0, size or 1


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """GPU ids this machine offers: CUDA_VISIBLE_DEVICES if set, else the
    devices the NVIDIA driver lists (none on a machine without one)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    count = len(list(driver.iterdir())) if driver.is_dir() else 0
    return [str(i) for i in range(count)]


def rank_environment(env: Mapping[str, str], cores: int | None = None) -> dict[str, str]:
    """The environment changes for one rank: its GPU and the CPU thread cap."""
    local_rank, local_size = local_rank_and_size(env)
    changes: dict[str, str] = {}
    gpus = visible_gpus(env)
    if gpus:
        changes["CUDA_VISIBLE_DEVICES"] = gpus[local_rank % len(gpus)]
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    if local_size > cores:
        flags = env.get("XLA_FLAGS", "")
        missing = [f for f in XLA_SINGLE_THREAD_FLAGS if f.split("=")[0] not in flags]
        if missing:
            changes["XLA_FLAGS"] = " ".join(filter(None, [flags, *missing]))
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            if name not in env:
                changes[name] = "1"
    return changes


def exec_rank(command: Sequence[str]) -> None:
    """Applies :func:`rank_environment` and replaces this process by ``command``."""
    if not command:
        raise SystemExit("jaxfog: no command given to run in the rank")
    os.environ.update(rank_environment(os.environ))
    try:
        os.execvp(command[0], list(command))
    except FileNotFoundError:
        raise SystemExit(f"jaxfog: command not found: {command[0]}") from None


def run(command: Sequence[str], np: int, *, dry_run: bool = False, **options) -> int:
    """Launches ``command`` on ``np`` ranks; returns mpiexec's exit status."""
    args = build_command(command, np, **options)
    if dry_run:
        print(shlex.join(args))
        return 0
    return subprocess.call(args)


if __name__ == "__main__":  # the per-rank shim, run by path so it imports nothing heavy
    exec_rank(sys.argv[1:])
