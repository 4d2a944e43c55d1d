#!/usr/bin/env python3
"""Kills host 3's rank mid-exchange RUNS times on a 4-host rig and counts the
clean runs (docs/launching.rst, "Network faults").

Usage (as root, with the Python whose jaxfog is built against the MPI to try)::

    python scripts/killed_host_runs.py OUTDIR RUNS [VAR=VALUE ...] [--mpiarg=ARG ...] [--killall]

e.g. ``--mpiarg=--with-ft --mpiarg=ulfm`` for Open MPI 5 with ULFM. Each run
starts tests/cluster_fault_rank.py on 4 hosts x 1 rank (a ring exchanging
1 MB, ``JAXFOG_TIMEOUT=5`` unless given), SIGKILLs host 3's rank program
(``--killall``: every process of host 3, its launcher daemon too) once all
ranks exchange, and waits for the survivors. A run is clean when every
survivor reported a failed ``neighbor_allreduce`` naming a rank within
JAXFOG_TIMEOUT + 2 s (or, ended by the launcher's SIGTERM, said on stderr
which op waited for which rank; or, stuck inside an MPI call, said which
call to which rank), none crashed (segfault, SIGUSR1), and no rank program
is left running. Under hydra (MPICH) the job gets ``-disable-auto-cleanup``;
under Open MPI the hosts go in with ``--hosts``. Writes OUTDIR/<run>/ (each
rank's report, stdout, stderr; mpiexec's output) and OUTDIR.json.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import netns_cluster  # beside this script

from jaxfog.cli._launcher import find_mpiexec, mpi_flavour
from jaxfog.testing import launch_environment, load_module, run_command

REPO = Path(__file__).resolve().parents[1]
run_command_args = load_module(REPO / "tests" / "netns_rig.py").run_command_args

N = 4
SCRIPT = REPO / "tests" / "cluster_fault_rank.py"


def rank_programs(cluster, host: int) -> list[int]:
    found = []
    for pid in cluster.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if len(argv) > 1 and argv[1].endswith(SCRIPT.name.encode()):
                found.append(pid)
        except OSError:
            pass
    return found


def one_run(d: Path, timeout: int, flavour: str, mpi_args, env_extra, killall: bool) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():
        if f.is_file():
            f.unlink()
    rank_var = "OMPI_COMM_WORLD_RANK" if flavour == "openmpi" else "PMI_RANK"
    extra = ["-disable-auto-cleanup"] if flavour == "hydra" else []
    cluster = netns_cluster.Cluster(N)
    done: dict = {}
    try:
        command = run_command_args(
            cluster, N, ["sh", "-c", (f"exec {sys.executable} {SCRIPT} {d} {1 << 18} "
                                      f"> {d}/stdout.${rank_var} 2> {d}/stderr.${rank_var}")],
            mpi_args=[*extra, *mpi_args], hosts_option=flavour == "openmpi")
        env = cluster.environment(launch_environment(
            {"JAXFOG_TIMEOUT": str(timeout), "PYTHONFAULTHANDLER": "1",
             "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
             **env_extra}))
        thread = threading.Thread(target=lambda: done.setdefault(
            "r", run_command(command, timeout=120, env=env)))
        thread.start()
        started = time.monotonic()
        while thread.is_alive() and time.monotonic() - started < 90 and not all(
                (d / f"ready.{r}").exists() for r in range(N)):
            time.sleep(0.1)
        time.sleep(0.5)  # inside the exchanges
        victims = cluster.pids(3) if killall else rank_programs(cluster, 3)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = time.monotonic()
        while time.monotonic() - killed < 2 * timeout + 20 and any(
                rank_programs(cluster, i) for i in range(N - 1)):
            time.sleep(0.2)
        ended = time.monotonic() - killed
        lingering = {i: rank_programs(cluster, i) for i in range(N - 1)}
        for pid in (p for pids in lingering.values() for p in pids):  # where each hangs
            stacks = run_command(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                                 timeout=60)
            (d / f"stack.{pid}").write_text(stacks.output)
        thread.join(timeout=8)
        mpiexec_ended = None if thread.is_alive() else round(time.monotonic() - killed, 1)
    finally:
        cluster.close()
    thread.join()
    result = done.get("r")
    (d / "mpiexec.out").write_text(f"rc={getattr(result, 'returncode', None)}\n"
                                   + (result.output if result else "no result"))
    res = {"ended_s": round(ended, 1), "lingering": any(lingering.values()),
           "mpiexec_ended_s": mpiexec_ended, "rc": getattr(result, "returncode", None)}
    for r in range(N - 1):
        report = (d / f"report.{r}").read_text().strip() if (d / f"report.{r}").exists() else ""
        said = "".join((d / f"{w}.{r}").read_text(errors="replace")
                       for w in ("stderr", "stdout") if (d / f"{w}.{r}").exists())
        crash = []
        if re.search(r"Caught signal 11|Segmentation fault|SIGSEGV|Fatal Python error", said):
            crash.append("segv")
        if "User defined signal 1" in said or "SIGUSR1" in said or "signal 10" in said:
            crash.append("usr1")
        # the peer: "rank K has failed" / "has left" / "waiting for ... rank K"
        named = re.search(r"rank [0-3] (has failed|has left)|from rank [0-3]|to rank [0-3]",
                          report)
        ok = "FAILED" in report and "neighbor_allreduce (op #" in report and named is not None
        waited = float(report.split(" after ")[1].split(" s")[0]) if "FAILED" in report else None
        # A rank the launcher ended (SIGTERM) while it waited says so on stderr.
        ended_by_launcher = re.search(r"jaxfog neighbor_allreduce \(op #\d+ on rank \d\): this "
                                      r"process got SIGTERM .* waiting for [^\n]*rank \d", said)
        # A rank stuck inside an MPI call says so on stderr, then ends (status 1).
        stuck = re.search(r"jaxfog neighbor_allreduce \(op #\d+ on rank \d\): MPI_\w+ [^(]*"
                          r"\(rank \d\) has not returned after \d+ s[^\n]*", said)
        bound = timeout + 2
        if not ok and (ended_by_launcher or stuck):
            ok, waited, report = True, ended, (ended_by_launcher or stuck).group(0)
            # the watchdog's JAXFOG_TIMEOUT + 2 s, checked 4 times a second
            bound += 1 if stuck else 0
        res[r] = {"ok": ok, "waited": waited, "bound": bound, "crash": crash,
                  "report": report[:400]}
    res["good"] = not res["lingering"] and all(
        res[r]["ok"] and res[r]["waited"] <= res[r]["bound"] and not res[r]["crash"]
        for r in range(N - 1))
    return res


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, runs = Path(sys.argv[1]), int(sys.argv[2])
    rest = sys.argv[3:]
    env_extra = dict(a.split("=", 1) for a in rest if "=" in a and not a.startswith("--"))
    mpi_args = [a[len("--mpiarg="):] for a in rest if a.startswith("--mpiarg=")]
    timeout = int(env_extra.get("JAXFOG_TIMEOUT", "5"))
    flavour = mpi_flavour(find_mpiexec())
    results = {}
    for k in range(runs):
        res = results[k] = one_run(out / str(k), timeout, flavour, mpi_args, env_extra,
                                   "--killall" in rest)
        print(k, "GOOD" if res["good"] else "BAD", "ended", res["ended_s"], "mpiexec",
              res["mpiexec_ended_s"], "rc", res["rc"],
              [(r, res[r]["ok"], res[r]["waited"], res[r]["crash"]) for r in range(N - 1)],
              flush=True)
        if not res["good"]:
            for r in range(N - 1):
                print("   ", r, res[r]["report"][:300], flush=True)
    print(out.name, flavour, "clean", sum(v["good"] for v in results.values()), "of", runs,
          flush=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
