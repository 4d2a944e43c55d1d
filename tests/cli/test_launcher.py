"""`jaxfog run`: the mpiexec command it builds, the per-rank set-up, and a real launch."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxfog.cli import _launcher as launcher

SHIM = str(Path(launcher.__file__).resolve())


def test_hydra_command():
    args = launcher.build_command(["python", "train.py", "--lr", "0.1"], 4,
                                  hosts="a:2,b:2", mpi_args=["-bind-to", "core"],
                                  mpiexec="/x/mpiexec", flavour="hydra", env={})
    progress = ["-genv", "MPIR_CVAR_ASYNC_PROGRESS", "1"]  # several hosts: RMA progress
    assert args == ["/x/mpiexec", "-n", "4", "-genvall", "-hosts", "a:2,b:2", *progress,
                    "-bind-to", "core", sys.executable, SHIM,
                    "python", "train.py", "--lr", "0.1"]
    args = launcher.build_command(["a.out"], 2, hostfile="hosts.txt", mpiexec="/x/mpiexec",
                                  flavour="hydra", env={}, rank_shim=False)
    assert args == ["/x/mpiexec", "-n", "2", "-genvall", "-f", "hosts.txt", *progress, "a.out"]
    # The user's own setting wins; one node needs no progress thread.
    args = launcher.build_command(["a.out"], 2, hostfile="h", mpiexec="/x/mpiexec",
                                  flavour="hydra", env={"MPIR_CVAR_ASYNC_PROGRESS": "0"},
                                  rank_shim=False)
    assert "MPIR_CVAR_ASYNC_PROGRESS" not in args
    args = launcher.build_command(["a.out"], 2, mpiexec="/x/mpiexec", flavour="hydra", env={},
                                  rank_shim=False)
    assert args == ["/x/mpiexec", "-n", "2", "-genvall", "a.out"]


def test_openmpi_command_forwards_environment():
    env = {"PATH": "/nonexistent", "JAXFOG_TIMEOUT": "5", "BASH_FUNC_x%%": "() {}",
           "PWD": "/"}
    args = launcher.build_command(["python", "t.py"], 2, hosts="n1:1,n2:1",
                                  mpiexec="/o/mpiexec", flavour="openmpi", env=env)
    assert args[:5] == ["/o/mpiexec", "-n", "2", "-H", "n1:1,n2:1"]
    forwarded = [args[i + 1] for i, a in enumerate(args) if a == "-x"]
    assert forwarded == ["JAXFOG_TIMEOUT", "PATH"]
    assert ("--allow-run-as-root" in args) == (os.geteuid() == 0)
    assert "--oversubscribe" not in args  # hosts were given
    local = launcher.build_command(["t"], 1000, mpiexec="/o/mpiexec", flavour="openmpi",
                                   env={})
    assert "--oversubscribe" in local
    assert args[-4:] == [sys.executable, SHIM, "python", "t.py"]


@pytest.mark.parametrize("np_, command, message", [
    (0, ["python"], "-np must be >= 1"),
    (2, [], "no command to run"),
])
def test_bad_arguments(np_, command, message):
    with pytest.raises(ValueError, match=message):
        launcher.build_command(command, np_, mpiexec="/x/mpiexec", flavour="hydra", env={})


def test_missing_mpiexec_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="JAXFOG_MPIEXEC='/nope/mpiexec'"):
        launcher.find_mpiexec({"JAXFOG_MPIEXEC": "/nope/mpiexec"})


def test_installed_mpiexec_is_hydra():
    assert launcher.mpi_flavour(launcher.find_mpiexec()) == "hydra"


@pytest.mark.parametrize("env, rank_size", [
    ({"MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}, (3, 4)),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (1, 2)),
    ({"SLURM_LOCALID": "5", "SLURM_TASKS_PER_NODE": "8(x2)"}, (5, 8)),
    ({}, (0, 1)),
])
def test_local_rank_from_launchers(env, rank_size):
    assert launcher.local_rank_and_size(env) == rank_size


def test_one_gpu_per_local_rank():
    env = {"MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4", "CUDA_VISIBLE_DEVICES": "4,5,6"}
    assert launcher.rank_environment(env, cores=64)["CUDA_VISIBLE_DEVICES"] == "4"
    env["MPI_LOCALRANKID"] = "1"
    assert launcher.rank_environment(env, cores=64)["CUDA_VISIBLE_DEVICES"] == "5"
    env["CUDA_VISIBLE_DEVICES"] = ""
    assert "CUDA_VISIBLE_DEVICES" not in launcher.rank_environment(env, cores=64)


def test_cpu_threads_capped_only_when_oversubscribed():
    env = {"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4", "CUDA_VISIBLE_DEVICES": ""}
    assert launcher.rank_environment(env, cores=4) == {}
    capped = launcher.rank_environment(env, cores=2)
    assert capped["XLA_FLAGS"] == ("--xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1")
    assert capped["OMP_NUM_THREADS"] == "1"
    env["XLA_FLAGS"] = "--xla_dump_to=/tmp/d"
    assert launcher.rank_environment(env, cores=2)["XLA_FLAGS"].startswith(
        "--xla_dump_to=/tmp/d --xla_cpu_multi_thread_eigen=false")


def test_every_rank_gets_a_folder_of_its_own_in_the_compilation_cache():
    """JAX writes a cache entry in place: ranks sharing the folder (on a host,
    or hosts on one file system) could read each other's half-written entries."""
    env = {"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4", "JAX_COMPILATION_CACHE_DIR": "/c"}
    host = socket.gethostname()
    assert launcher.rank_environment(env, cores=8)["JAX_COMPILATION_CACHE_DIR"] == f"/c/{host}.2"
    del env["JAX_COMPILATION_CACHE_DIR"]
    assert "JAX_COMPILATION_CACHE_DIR" not in launcher.rank_environment(env, cores=8)


def test_jaxfog_run_end_to_end(tmp_path):
    """Three real ranks: environment forwarded, ranks distinct, threads capped.

    Each rank writes its own file: mpiexec forwards the ranks' stdout through one pipe
    and may cut a rank's line in two, so parsing the merged stdout is flaky.
    """
    code = ("import os, jaxfog as jf; jf.init(); "
            "open(os.path.join(os.environ['OUT_DIR'], str(jf.rank())), 'w').write("
            "f\"{jf.rank()} {jf.size()} {os.environ['MY_SETTING']} "
            "{os.environ.get('OMP_NUM_THREADS')}\")")
    env = {**os.environ, "MY_SETTING": "forwarded", "OUT_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "jaxfog.cli", "run", "-np", "3",
                          sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    capped = "1" if 3 > len(os.sched_getaffinity(0)) else "None"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["0", "1", "2"]
    for r in range(3):
        assert (tmp_path / str(r)).read_text() == f"{r} 3 forwarded {capped}"


def test_jaxfog_run_reports_bad_usage():
    out = subprocess.run([sys.executable, "-m", "jaxfog.cli", "run", "-np", "0", "true"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "-np must be >= 1" in out.stderr


@pytest.mark.parametrize("argv, expected", [
    (["-np", "4", "python", "t.py", "-v"], (["-np", "4"], [], ["python", "t.py", "-v"])),
    (["-np", "2", "-prepend-rank", "--dry-run", "a.out"],
     (["-np", "2", "--dry-run"], ["-prepend-rank"], ["a.out"])),
    (["-n", "2", "-bind-to", "core", "--", "python", "--", "x"],
     (["-n", "2"], ["-bind-to", "core"], ["python", "--", "x"])),
    (["--hosts=a:2", "-np", "3", "--map-by=node", "prog"],
     (["--hosts=a:2", "-np", "3"], ["--map-by=node"], ["prog"])),
])
def test_run_arguments_split(argv, expected):
    from jaxfog.cli import split_run_argv

    assert split_run_argv(argv) == expected


def test_mpiexec_options_reach_mpiexec(capsys):
    from jaxfog.cli import main

    assert main(["run", "-np", "2", "-prepend-rank", "--dry-run", "python", "x.py"]) == 0
    words = capsys.readouterr().out.split()
    assert words[1:5] == ["-n", "2", "-genvall", "-prepend-rank"]
    assert words[-2:] == [shutil.which("python"), "x.py"]  # resolved here (see below)


# --- the program the launching shell would run -------------------------------

def test_program_resolved_on_the_launchers_path(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
        (folder / "prog").write_text("#!/bin/sh\n")
        (folder / "prog").chmod(0o755)
    env = {"PATH": f"{first}:{second}"}
    build = lambda command: launcher.build_command(  # noqa: E731
        command, 2, mpiexec="/x/mpiexec", flavour="hydra", env=env)
    assert build(["prog", "-v"])[-2:] == [str(first / "prog"), "-v"]
    # A path is the user's choice; a name not found here is left to the ranks
    # (a program only the other hosts have).
    assert build(["./prog", "prog"])[-2:] == ["./prog", "prog"]
    assert build(["only-on-the-nodes"])[-1] == "only-on-the-nodes"
    assert launcher.build_command(["prog"], 2, mpiexec="/x/mpiexec", flavour="openmpi",
                                  env=env, rank_shim=False)[-1] == str(first / "prog")


# Stands in for Open MPI 4's mpiexec started by an absolute path (ORTE's
# "--prefix by absolute path"): each rank's PATH starts with the prefix's bin,
# even over a forwarded ``-x PATH``. Measured with Debian's Open MPI 4.1.4:
# ``/prefix/usr/bin/mpiexec.openmpi -n 2 sh -c 'echo $PATH'`` printed
# ``/prefix/usr/bin:/prefix/usr/bin:<the caller's PATH>``.
_PREFIXING_MPIEXEC = r"""#!{python}
import os, subprocess, sys
if sys.argv[1:] == ["--version"]:
    sys.exit(print("mpiexec (OpenRTE) 4.1.6"))
args, n = sys.argv[1:], 1
while args[0].startswith("-"):
    if args[0] in ("-n", "-x"):
        n = int(args[1]) if args[0] == "-n" else n
        args = args[2:]
    else:
        args = args[1:]
env = {{**os.environ, "PATH": os.path.dirname(os.path.abspath(__file__)) + ":" +
       os.environ["PATH"], "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)}}
ranks = [subprocess.Popen(args, env={{**env, "OMPI_COMM_WORLD_RANK": str(r),
                                      "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}})
         for r in range(n)]
sys.exit(max(rank.wait() for rank in ranks))
"""


def _marked_python(folder: Path, marker: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "python3").write_text(f"#!/bin/sh\necho {marker} \"$@\"\n")
    (folder / "python3").chmod(0o755)


@pytest.mark.parametrize("mpi", ["installed", "prefixing", "JAXFOG_TEST_MPIEXEC"])
def test_ranks_run_the_program_the_shell_finds(tmp_path, mpi):
    """The GPU machine's failure: ``jaxfog run -np 2 python3 bench.py`` ran an
    interpreter without numpy in every rank while ``python3`` in the same
    shell had it (its Open MPI at /usr/bin put /usr/bin first on the ranks'
    PATH). The shell's first ``python3`` here prints a marker; each rank must
    run that one."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if mpi == "prefixing":
        mpiexec = tmp_path / "prefix" / "bin" / "mpiexec"
        _marked_python(mpiexec.parent, "the-mpi-prefix-python3")
        mpiexec.write_text(_PREFIXING_MPIEXEC.format(python=sys.executable))
        mpiexec.chmod(0o755)
        env[launcher.MPIEXEC_ENV] = str(mpiexec)
    elif mpi == "JAXFOG_TEST_MPIEXEC":
        if not os.environ.get(mpi):
            pytest.skip("set JAXFOG_TEST_MPIEXEC to an Open MPI's mpiexec (e.g. "
                        "/usr/bin/mpiexec.openmpi) to launch with it too")
        env[launcher.MPIEXEC_ENV] = os.environ[mpi]
    _marked_python(tmp_path / "shell", "the-shells-python3")
    env["PATH"] = f"{tmp_path / 'shell'}:{env['PATH']}"
    out = subprocess.run([sys.executable, "-m", "jaxfog.cli", "run", "-np", "2", "python3",
                          "bench.py"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["the-shells-python3 bench.py"] * 2, out.stdout


_PARTIAL = r"""
import os, sys, time
rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
for i in range(30):  # every line written in two pieces, the ranks at once
    sys.stdout.write(f"rank {rank}: line {i} begins,")
    sys.stdout.flush()
    time.sleep(0.002)
    sys.stdout.write(" ends\n")
    sys.stdout.flush()
    sys.stderr.write(f"rank {rank}: err {i}")
    sys.stderr.flush()
    sys.stderr.write("\n")
sys.stdout.write(f"rank {rank}: last, without a newline")
"""


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "rank-prefix"])
def test_ranks_lines_are_never_joined(tmp_path, prefix):
    """Two ranks write partial lines at the same time (as an unbuffered print
    does: the text, then the newline); every line comes out whole, once."""
    script = tmp_path / "partial.py"
    script.write_text(_PARTIAL)
    out = subprocess.run([sys.executable, "-m", "jaxfog.cli", "run", "-np", "2",
                          *(["--rank-prefix"] if prefix else []),
                          sys.executable, "-u", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    label = r"\[(\d)\] " if prefix else r"()"
    for stream, pattern, count in ((out.stdout, r"line \d+ begins, ends|last, without a "
                                    r"newline", 31), (out.stderr, r"err \d+", 30)):
        lines = stream.splitlines()
        for line in lines:
            match = re.fullmatch(label + r"rank (\d): (" + pattern + ")", line)
            assert match, f"a joined or cut line: {line!r}"
            assert not prefix or match[1] == match[2]
        assert sorted(lines) == sorted(set(lines)) and len(lines) == 2 * count


def test_forward_lines_status_and_signals(tmp_path):
    """The rank's command's exit status comes back (128 + n for signal n), a
    signal to the rank shim reaches the command, and the shim ends with that
    status, or under Open MPI by that signal (ULFM then tells the survivors)."""
    out = tmp_path / "out"
    with open(out, "wb") as sink:
        status = launcher.forward_lines([sys.executable, "-c", "print('a'); exit(3)"],
                                        prefix=b"[0] ", sinks=(sink.fileno(), sink.fileno()))
    assert status == 3 and out.read_text() == "[0] a\n"
    assert launcher.forward_lines(["sh", "-c", "kill -TERM $$"]) == 128 + 15
    assert launcher.forward_lines(["no-such-command-jaxfog"]) == 127
    for openmpi, status in ((False, 128 + signal.SIGTERM), (True, -signal.SIGTERM)):
        env = {**os.environ, "OMPI_COMM_WORLD_RANK": "0"} if openmpi else {
            k: v for k, v in os.environ.items() if k != "OMPI_COMM_WORLD_RANK"}
        shim = subprocess.Popen([sys.executable, SHIM, sys.executable, "-c",
                                 "import time; print('up', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True, env=env)
        assert shim.stdout.readline() == "up\n"
        shim.send_signal(signal.SIGTERM)
        assert shim.wait(timeout=20) == status, openmpi


def test_the_launcher_asks_a_running_job_for_the_slots_it_lacks(tmp_path):
    """What a discovery script names beyond the job's hosts, up to -np: the
    lines the job's control file gets (its ranks join in place under ULFM);
    the job's own list, written after a change in place, replaces the
    launcher's (a host whose rank was lost is asked for again)."""
    assert launcher._new_slots({"a": 1, "b": 1}, {"a": 2, "b": 1, "c": 2}, room=2) == {
        "a": 1, "c": 1}
    assert launcher._new_slots({"a": 2}, {"a": 2}, room=3) == {}
    assert launcher._new_slots({"a": 1}, {"a": 4}, room=0) == {}
    control = str(tmp_path / "rescale")
    assert launcher._job_hosts(control, {"a": 2}) == {"a": 2}
    (tmp_path / "rescale.hosts").write_text("a\nc\n")  # as jaxfog.elastic writes it
    assert launcher._job_hosts(control, {"a": 2}) == {"a": 1, "c": 1}
