"""``jaxfog run``: a thin wrapper over the installed MPI's ``mpiexec``.

It builds one ``mpiexec`` command line for the MPI flavour found (MPICH's
hydra or Open MPI), forwards the environment, and starts every rank through
:func:`exec_rank`, which gives each local rank its own GPU (when GPUs exist)
and caps XLA's CPU threads when a machine runs more ranks than it has cores,
then runs the user's command and hands its output to mpiexec in whole lines
(two ranks' lines are never joined; ``--rank-prefix`` labels them). Nothing
else is hidden: ``--dry-run`` prints the command.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from jaxfog.errors import JaxfogError

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
#: JAX's persistent compilation cache, which ``--max-restarts`` points at a folder of the job's.
COMPILATION_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


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
    return args + resolve_program(command, env)


def resolve_program(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``command`` with its program as the launching shell finds it on
    ``env``'s PATH: a rank's PATH may differ. Open MPI started by an absolute
    path (``/usr/bin/mpiexec``, what :func:`find_mpiexec` gives) acts as if
    given ``--prefix``: every rank's PATH starts with that prefix's ``bin``, so
    ``python3`` in a rank was ``/usr/bin/python3``, not the virtual
    environment's. A path with a ``/``, or a name not found here (a program
    only the other hosts have), is left to the ranks."""
    program, *rest = command
    found = None if "/" in program else shutil.which(program, path=env.get("PATH", ""))
    return [found or program, *rest]


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
    """The environment changes for one rank: its GPU, the CPU thread cap, and
    its own folder of JAX's persistent compilation cache."""
    local_rank, local_size = local_rank_and_size(env)
    changes: dict[str, str] = {}
    cache = env.get(COMPILATION_CACHE_ENV)
    if cache:
        # JAX writes an entry in place: a rank reading one while another rank
        # (of this host, or of another sharing the file system) writes it would
        # read part of it, and compile again with a warning.
        changes[COMPILATION_CACHE_ENV] = os.path.join(
            cache, f"{socket.gethostname()}.{local_rank}")
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


#: "0": the rank's command replaces the shim and writes straight to mpiexec
#: (whose forwarding may join two ranks' partial lines); default: whole lines.
LINES_ENV = "JAXFOG_WHOLE_LINES"
#: "1": every line a rank writes starts with ``[rank] `` (``jaxfog run --rank-prefix``).
PREFIX_ENV = "JAXFOG_RANK_PREFIX"
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def exec_rank(command: Sequence[str]) -> None:
    """Applies :func:`rank_environment` and runs ``command`` as this rank:
    under :func:`forward_lines` (the default), or in place of this process."""
    if not command:
        raise SystemExit("jaxfog: no command given to run in the rank")
    os.environ.update(rank_environment(os.environ))
    # jaxfog.runtime.RANK_SHIM_ENV: a rank's grow() starts its newcomers through the shim too.
    os.environ["JAXFOG_RANK_SHIM"] = str(Path(__file__).resolve())
    if os.environ.get(LINES_ENV, "1") != "0":
        rank = _first_int(os.environ, _RANK_VARS)
        prefix = f"[{rank}] ".encode() if os.environ.get(PREFIX_ENV) == "1" else b""
        _end_like(forward_lines(command, prefix=prefix))
    try:
        os.execvp(command[0], list(command))
    except FileNotFoundError:
        raise SystemExit(f"jaxfog: command not found: {command[0]}") from None


def _end_like(status: int) -> None:
    """Ends the shim with its command's status, or, under Open MPI, by the
    signal that killed the command: Open MPI's ULFM tells the survivors of a
    rank killed by a signal, not of one that exited with status 137. (MPICH's
    hydra, told of a rank killed by a signal, kills the others at once, before
    they can say why they end, e.g. JAXFOG_INIT_TIMEOUT's SIGKILL.)"""
    import signal

    number = status - 128
    if ("OMPI_COMM_WORLD_RANK" in os.environ and number in signal.valid_signals()
            and number not in (signal.SIGSTOP, signal.SIGTSTP)):
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL: its handler cannot be set, nor needs to be
            pass
        os.kill(os.getpid(), number)
    raise SystemExit(status)


def _die_with_parent() -> None:  # in the child, before exec: no orphan if the shim is killed
    os.setpgrp()  # a terminal's Ctrl-C reaches the shim, which forwards it once
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _copy_lines(source: int, sink: int, prefix: bytes) -> None:
    """Copies ``source`` to ``sink`` in whole lines, each read's complete
    lines in one write: mpiexec forwards each rank's pipe in the chunks it
    reads, so a chunk that ends mid-line is what let another rank's line be
    joined to it (an unbuffered ``print`` writes the text and the newline
    separately). A last line without a newline gets one."""
    pending = b""
    while True:
        try:
            chunk = os.read(source, 1 << 16)
        except InterruptedError:
            continue
        if not chunk:
            break
        pending += chunk
        cut = pending.rfind(b"\n") + 1
        if cut:
            lines, pending = pending[:cut], pending[cut:]
            if prefix:
                lines = b"".join(prefix + line for line in lines.splitlines(keepends=True))
            _write_all(sink, lines)
    if pending:
        _write_all(sink, prefix + pending + b"\n")
    os.close(source)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except BrokenPipeError:
            return


def forward_lines(command: Sequence[str], *, prefix: bytes = b"",
                  sinks: tuple[int, int] = (1, 2)) -> int:
    """Runs ``command`` with its stdout and stderr copied to ``sinks`` whole
    lines at a time (each line starting with ``prefix``), forwarding signals
    to it; returns its exit status (128 + signal if a signal ended it)."""
    import signal
    import threading

    try:
        # close_fds=False: the launcher's inherited descriptors (PMI_FD) stay open.
        child = subprocess.Popen(list(command), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, close_fds=False,
                                 preexec_fn=_die_with_parent)
    except FileNotFoundError:
        return _fail(f"jaxfog: command not found: {command[0]}")
    assert child.stdout is not None and child.stderr is not None  # both are PIPEs
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    copiers = [threading.Thread(target=_copy_lines, args=(pipe.fileno(), sink, prefix),
                                daemon=True)
               for pipe, sink in ((child.stdout, sinks[0]), (child.stderr, sinks[1]))]
    for copier in copiers:
        copier.start()
    status = child.wait()
    for copier in copiers:  # a process the command left running may hold the pipes
        copier.join(timeout=10)
    return 128 - status if status < 0 else status


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 127


def run(command: Sequence[str], np: int, *, dry_run: bool = False,
        rank_prefix: bool = False, **options) -> int:
    """Launches ``command`` on ``np`` ranks; returns mpiexec's exit status.
    Each rank's output reaches mpiexec in whole lines (:func:`forward_lines`),
    with ``rank_prefix`` each starting with ``[rank] ``."""
    if rank_prefix:
        os.environ[PREFIX_ENV] = "1"  # forwarded to the ranks with the environment
    args = build_command(command, np, **options)
    if dry_run:
        print(shlex.join(args))
        return 0
    return subprocess.call(args)


# --- elastic runs: relaunch on the hosts still reachable -------------------

#: Seconds a probe of a host (``mpiexec -n 1`` of ``true`` there) may take.
PROBE_TIMEOUT_ENV = "JAXFOG_PROBE_TIMEOUT"
#: Seconds between two runs of ``--host-discovery-script`` while the job runs.
DISCOVERY_INTERVAL_ENV = "JAXFOG_DISCOVERY_INTERVAL"


def parse_hosts(text: str) -> dict[str, int]:
    """``{host: slots}`` from ``host:slots,...`` or hostfile lines (``host``,
    ``host:slots``, Open MPI's ``host slots=N``); comments and blanks skipped."""
    hosts: dict[str, int] = {}
    for entry in text.replace(",", "\n").splitlines():
        entry = entry.split("#")[0].strip()
        if not entry:
            continue
        name, _, rest = entry.partition(" ")
        name, _, slots = name.partition(":")
        if "slots=" in rest:
            slots = rest.split("slots=")[1].split()[0]
        if slots and not slots.isdigit():
            raise ValueError(f"host entry {entry!r}: slots must be a number")
        hosts[name] = hosts.get(name, 0) + (int(slots) if slots else 1)
    return hosts


def _format_hosts(hosts: Mapping[str, int]) -> str:
    return ",".join(f"{name}:{slots}" for name, slots in hosts.items())


def probe_hosts(hosts: Mapping[str, int], *, mpiexec: str, flavour: str,
                env: Mapping[str, str], timeout: float) -> dict[str, int]:
    """The hosts among ``hosts`` where the MPI launcher starts ``true`` within
    ``timeout`` seconds (all probed at once)."""
    import threading

    reachable: dict[str, bool] = {}

    def probe(host: str) -> None:
        args = build_command(["true"], 1, hosts=f"{host}:1", mpiexec=mpiexec, flavour=flavour,
                             env=env, rank_shim=False)
        try:
            process = subprocess.Popen(args, env=dict(env), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            reachable[host] = False
            return
        try:
            reachable[host] = process.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            reachable[host] = False
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass
            process.wait()

    threads = [threading.Thread(target=probe, args=(host,), daemon=True) for host in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {host: slots for host, slots in hosts.items() if reachable.get(host)}


def discover_hosts(script: str, env: Mapping[str, str], timeout: float) -> dict[str, int]:
    """The hosts ``script`` prints (one ``host:slots`` a line), as Horovod's
    ``--host-discovery-script``."""
    out = subprocess.run([script], capture_output=True, text=True, timeout=timeout,
                         env=dict(env))
    if out.returncode:
        raise JaxfogError(f"host discovery script {script} failed (exit status "
                           f"{out.returncode}): {out.stderr.strip()}")
    return parse_hosts(out.stdout)


def _job_hosts(control: str, known: dict[str, int]) -> dict[str, int]:
    """The hosts of the running job: what its rank 0 last wrote beside the
    control file (``jaxfog.elastic.run``, after a change in place), else ``known``."""
    try:
        return parse_hosts(Path(control + ".hosts").read_text())
    except OSError:
        return known


def _new_slots(running: Mapping[str, int], now: Mapping[str, int],
               room: int) -> dict[str, int]:
    """The slots of ``now`` that ``running`` lacks, ``room`` at most."""
    wanted: dict[str, int] = {}
    for host, slots in now.items():
        extra = min(slots - running.get(host, 0), room - sum(wanted.values()))
        if extra > 0:
            wanted[host] = extra
    return wanted


#: A relaunch whose ranks never started (the launcher failed) is tried again this many
#: times, after this many seconds, before it counts against ``--max-restarts``.
UNSTARTED_RELAUNCH_RETRIES = 2
UNSTARTED_RELAUNCH_PAUSE = 2.0


def run_elastic(command: Sequence[str], np: int, *, max_restarts: int, min_np: int = 1,
                hosts: str | None = None, hostfile: str | None = None,
                discovery_script: str | None = None, mpi_args: Sequence[str] = (),
                rank_prefix: bool = False, dry_run: bool = False) -> int:
    """Runs the job, and relaunches it when it fails (at most ``max_restarts``
    times) on the hosts still reachable, or those ``discovery_script`` names:
    ``np`` ranks at most, one per slot, and never fewer than ``min_np``. While
    it runs, a discovery script is run every ``JAXFOG_DISCOVERY_INTERVAL``
    seconds (default 10); when it names hosts or slots the job does not have,
    the job is asked to take them at its next snapshot (``jaxfog.elastic``):
    the file ``JAXFOG_ELASTIC_CONTROL`` names them, a host a line, a line a rank. Under
    ULFM, ``jaxfog.elastic.run`` starts ranks there in place; elsewhere the job
    stops and is relaunched with them, without counting as a failure. Every rank learns
    the launch's number from ``JAXFOG_ELASTIC_RESTART``. A relaunch that fails before
    its rank 0 started jaxfog (the MPI launcher's own failure) is tried again, up to
    ``UNSTARTED_RELAUNCH_RETRIES`` times, without counting as a failure.

    The ranks keep XLA's compiled programs in JAX's persistent compilation
    cache, in a folder of the job's (unless ``JAX_COMPILATION_CACHE_DIR`` is
    set), whatever their compile time: a relaunched rank loads them instead of
    compiling again."""
    import tempfile
    import time

    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not 1 <= min_np <= np:
        raise ValueError(f"--min-np must be in [1, -np={np}], got {min_np}")
    if rank_prefix:
        os.environ[PREFIX_ENV] = "1"
    env = dict(os.environ)
    mpiexec = find_mpiexec(env)
    flavour = mpi_flavour(mpiexec)
    timeout = float(env.get(PROBE_TIMEOUT_ENV, "10"))
    interval = float(env.get(DISCOVERY_INTERVAL_ENV, "10"))
    listed = parse_hosts(hosts) if hosts else (
        parse_hosts(Path(hostfile).read_text()) if hostfile else None)

    def available() -> dict[str, int] | None:
        if discovery_script:
            return discover_hosts(discovery_script, env, timeout)
        if listed is None:
            return None  # this machine only
        return probe_hosts(listed, mpiexec=mpiexec, flavour=flavour, env=env, timeout=timeout)

    scratch = tempfile.mkdtemp(prefix="jaxfog-elastic-")
    control = os.path.join(scratch, "rescale")
    env.setdefault(COMPILATION_CACHE_ENV, os.path.join(scratch, "compiled"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    found = listed if dry_run else None
    try:
        failures = launch = unstarted = 0
        while True:
            found = available() if not dry_run else found
            ranks = np if found is None else min(np, sum(found.values()))
            if ranks < min_np:
                print(f"jaxfog run: {ranks} slot(s) reachable ({_format_hosts(found or {})}), "
                      f"fewer than --min-np {min_np}; giving up", file=sys.stderr, flush=True)
                return 1
            env.update({"JAXFOG_ELASTIC_RESTART": str(launch), "JAXFOG_ELASTIC_CONTROL": control})
            args = build_command(command, ranks, hosts=_format_hosts(found) if found else None,
                                 mpi_args=mpi_args, mpiexec=mpiexec, flavour=flavour, env=env)
            if dry_run:
                print(shlex.join(args))
                return 0
            if launch:
                print(f"jaxfog run: relaunch {launch} on {ranks} rank(s)"
                      + (f" ({_format_hosts(found)})" if found else ""), file=sys.stderr,
                      flush=True)
            for stale in (control, control + ".hosts", control + ".done", control + ".started"):
                if os.path.exists(stale):
                    os.remove(stale)
            started = time.monotonic()
            process = subprocess.Popen(args, env=env)
            running = dict(found or {})  # the job's hosts, as far as this launcher knows
            while process.poll() is None:
                try:
                    process.wait(timeout=interval)
                except subprocess.TimeoutExpired:
                    if discovery_script and not os.path.exists(control):
                        running = _job_hosts(control, running)
                        now = discover_hosts(discovery_script, env, timeout)
                        wanted = _new_slots(running, now, np - sum(running.values()))
                        if wanted:
                            # The job takes them in place at its next snapshot (under
                            # ULFM, jaxfog.elastic.run), or stops there to be relaunched;
                            # always so for hosts the launch lacks (an empty file): Open
                            # MPI 5.0.11 loses a daemon it adds to a running job.
                            inside = all(host in (found or {}) for host in wanted)
                            Path(control).write_text("".join(
                                f"{host}\n" for host, slots in wanted.items()
                                for _ in range(slots)) if inside else "")
                            for host, slots in wanted.items():
                                running[host] = running.get(host, 0) + slots
            status = process.returncode
            rescaled = os.path.exists(control)
            if status == 0:
                return 0
            if os.path.exists(control + ".done"):
                # Open MPI's launcher reports a rank that joined in place (a job of
                # its own) and then died as a failure, though the survivors finished.
                print(f"jaxfog run: the job finished (its rank 0 says so); exit status "
                      f"{status} came from a rank lost on the way", file=sys.stderr, flush=True)
                return 0
            if (launch and not os.path.exists(control + ".started")
                    and unstarted < UNSTARTED_RELAUNCH_RETRIES):
                # No rank started: the MPI launcher itself failed, as Open MPI 5.0.11's
                # does now and then when the job before left a host a moment ago (a
                # daemon that "failed to report back"). Not the program's failure.
                unstarted += 1
                print(f"jaxfog run: relaunch {launch} failed before any rank started (exit "
                      f"status {status}); trying it again in {UNSTARTED_RELAUNCH_PAUSE:g} s "
                      f"({unstarted} of {UNSTARTED_RELAUNCH_RETRIES}, not counted as a "
                      "failure)", file=sys.stderr, flush=True)
                time.sleep(UNSTARTED_RELAUNCH_PAUSE)
                continue
            unstarted = 0
            launch += 1
            if rescaled:
                print("jaxfog run: the job stopped to take in new hosts", file=sys.stderr,
                      flush=True)
                continue
            failures += 1
            if failures > max_restarts:
                print(f"jaxfog run: the job failed (exit status {status}) after "
                      f"{time.monotonic() - started:.1f} s, and --max-restarts {max_restarts} "
                      "are spent; giving up", file=sys.stderr, flush=True)
                return status
            print(f"jaxfog run: the job failed (exit status {status}) after "
                  f"{time.monotonic() - started:.1f} s; restart {failures} of {max_restarts}",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":  # the per-rank shim, run by path so it imports nothing heavy
    exec_rank(sys.argv[1:])
