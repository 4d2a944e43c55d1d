"""Goodput of elastic training on the cluster on one machine (root only).

4 hosts (network namespaces) joined by 100 Mbit/s links, one rank each, run
``examples/elastic_digits.py`` under ``jaxfog run --max-restarts`` for each
method, in three scenarios, interleaved:

* ``failure-free``: 4 hosts throughout;
* ``rank killed``: host 3's rank SIGKILLed a third of the way (its host stays
  up): the job is relaunched on the same 4 hosts and resumes from the last
  snapshot;
* ``host killed, host joins``: every process of host 3 killed a third of the
  way and the host left down (the job goes on with 3 hosts), then a fifth
  host offered by the discovery script two thirds of the way in, joining at
  the next snapshot with a live copy of a neighbour's state;
* ``rank killed, in place`` (only where jaxfog runs on Open MPI with ULFM):
  host 3's rank SIGKILLed a third of the way, under ``--with-ft ulfm`` and
  ``--max-restarts 0``: the survivors go on in place on 3 hosts
  (``jaxfog.elastic.run``), from the state in memory;
* ``rank killed in place, host back`` (the same): as above, then host 3
  offered again by the discovery script two thirds of the way in: the job
  stops at its next snapshot and is relaunched on 4 hosts (Open MPI 5.0.11
  cannot start a rank in place across hosts after a recovery), host 3's new
  rank with a live copy.

Run from an environment whose jaxfog is built against Open MPI, the first
two and the in-place scenario run, into ``elastic_in_place.md``; against
MPICH, the first three, into ``elastic_goodput.md``.

Rank 0 logs its own model's test accuracy at every snapshot with the wall
time (``--log``); the time to the target accuracy is measured from the first
launch. ``goodput`` = failure-free time to target / this scenario's time to
target; ``recovery`` = seconds from the kill to the first step completed after
the resume (the example logs that step too). Writes ``benchmarks/results/elastic_goodput.md`` (or
``elastic_in_place.md``) and a plot.

    sudo python benchmarks/bench_elastic.py [--rounds 2] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


netns_cluster = _load("netns_cluster", ROOT / "scripts" / "netns_cluster.py")
PROGRAM = ROOT / "examples" / "elastic_digits.py"
METHODS = ("atc", "gradient_allreduce", "diloco")
SCENARIOS = ("failure-free", "rank killed", "host killed, host joins")
IN_PLACE = "rank killed, in place"
IN_PLACE_BACK = "rank killed in place, host back"


def _rank_pids(cluster, host: int) -> list[int]:
    found = []
    for pid in cluster.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"elastic_digits.py") for a in argv) and argv[0].endswith(b"python") \
                or (len(argv) > 1 and argv[1].endswith(b"elastic_digits.py")):
            found.append(pid)
    return found


def _log_steps(log: Path) -> list[tuple[float, int, int, float]]:
    rows = []
    if log.exists():
        for line in log.read_text().splitlines():
            t, step, launch, accuracy = line.split()
            rows.append((float(t), int(step), int(launch), float(accuracy)))
    return rows


def run_one(cluster, method: str, scenario: str, steps: int, every: int, pace: float,
            work: Path) -> dict:
    """One run; returns its log and the kill time."""
    log, snapshots = work / "log.txt", work / "snapshots"
    script = work / "discover.sh"
    names = cluster.names
    state = work / "hosts"
    state.write_text("\n".join(f"{n}:1" for n in names[:4]) + "\n")
    script.write_text(f"#!/bin/sh\ncat {state}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    where = {IN_PLACE: ["--max-restarts", "0", "--mpi-args", "--with-ft ulfm", "--hosts",
                        ",".join(f"{n}:1" for n in names[:4])],
             IN_PLACE_BACK: ["--max-restarts", "0", "--mpi-args", "--with-ft ulfm",
                             "--host-discovery-script", str(script)]}.get(
        scenario, ["--max-restarts", "2", "--host-discovery-script", str(script)])
    command = cluster.on_host(0, [
        sys.executable, "-m", "jaxfog.cli", "run", "-np", "4", *where, "--",
        sys.executable, str(PROGRAM),
        "--method", method, "--steps", str(steps), "--every", str(every),
        "--directory", str(snapshots), "--log", str(log), "--pace", str(pace)])
    env = cluster.environment({**os.environ, "JAXFOG_TIMEOUT": "10",
                               "JAXFOG_PROBE_TIMEOUT": "5", "JAXFOG_DISCOVERY_INTERVAL": "1",
                               "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"})
    started = time.time()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(  # each line with its time
        f"{time.time() - started:7.2f} {line}" for line in process.stdout), daemon=True)
    reader.start()
    killed = joined = None
    while process.poll() is None:
        time.sleep(0.05)
        if scenario == "failure-free":
            continue
        done = max((s for _, s, _, _ in _log_steps(log)), default=0)
        if killed is None and done >= steps // 3:
            if scenario in ("rank killed", IN_PLACE, IN_PLACE_BACK):
                pids = _rank_pids(cluster, 3)
                if not pids:  # not seen this time (/proc read mid-change): look again
                    continue
                if scenario == IN_PLACE_BACK:
                    state.write_text("\n".join(f"{n}:1" for n in names[:3]) + "\n")
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
            else:
                state.write_text("\n".join(f"{n}:1" for n in names[:3]) + "\n")
                cluster.never_join(3)
                cluster.kill_host(3)
            killed = time.time()
        if (scenario in (SCENARIOS[2], IN_PLACE_BACK) and killed is not None
                and joined is None and done >= 2 * steps // 3):
            back = names[3] if scenario == IN_PLACE_BACK else names[4]
            state.write_text("\n".join(f"{n}:1" for n in names[:3] + [back]) + "\n")
            joined = time.time()
    reader.join(timeout=10)
    if process.returncode:
        raise RuntimeError(f"{method}, {scenario}: exit status {process.returncode}\n"
                           + "".join(output[-60:]))
    return {"log": _log_steps(log), "started": started, "killed": killed, "joined": joined,
            "ended": time.time(), "output": "".join(output)}


def summarize(run: dict, target: float) -> dict:
    rows = run["log"]
    reached = next((t for t, _, _, a in rows if a >= target), None)
    recovery = None
    if run["killed"] is not None:
        after = [t for t, _, launch, _ in rows if t > run["killed"] and launch > 0]
        recovery = after[0] - run["killed"] if after else None
    stall = None
    if run["joined"] is not None:
        times = [t for t, _, _, _ in rows]
        gaps = np.diff(times)
        after = [g for t, g in zip(times[1:], gaps) if t > run["joined"]]
        stall = max(after) - float(np.median(gaps)) if after else None
    return {"to_target": None if reached is None else reached - run["started"],
            "total": run["ended"] - run["started"], "recovery": recovery, "join": stall,
            "final": rows[-1][3] if rows else float("nan")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--targets", default="atc=0.93,gradient_allreduce=0.96,diloco=0.86",
                        help="method=accuracy,...: reached after the kill and the join "
                             "when failure-free (digits, rank 0's own model)")
    parser.add_argument("--pace", type=float, default=0.1,
                        help="seconds a step lasts at least (a model of that cost)")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args(argv)
    why_not = netns_cluster.permitted()
    if why_not:
        print(f"skipped: {why_not}")
        return 0
    from jaxfog import _machine
    from jaxfog.cli._launcher import find_mpiexec, mpi_flavour

    openmpi = mpi_flavour(find_mpiexec()) == "openmpi"
    scenarios = (*SCENARIOS[:2], IN_PLACE, IN_PLACE_BACK) if openmpi else SCENARIOS
    targets = {k: float(v) for k, v in (t.split("=") for t in args.targets.split(","))}
    results: dict = {}
    runs: dict = {}
    for round_ in range(args.rounds):
        for method in args.methods.split(","):
            for scenario in scenarios:
                netns_cluster.sweep()
                with netns_cluster.Cluster(5, rate=args.rate) as cluster, \
                        tempfile.TemporaryDirectory() as work:
                    run = run_one(cluster, method, scenario, args.steps, args.every,
                                  args.pace, Path(work))
                runs.setdefault((method, scenario), run)
                summary = summarize(run, targets[method])
                results.setdefault((method, scenario), []).append(summary)
                print(f"round {round_}: {method:20s} {scenario:25s} "
                      + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    lines = ["# Elastic training: goodput on the cluster on one machine",
             "",
             f"Machine: {_machine.cpu()}; {time.strftime('%Y-%m-%d')}.",
             "",
             f"4 hosts (network namespaces), one rank each, {args.rate} links; "
             f"`examples/elastic_digits.py` (Flax MLP, digits split by label, float32), "
             f"{args.steps} steps of at least {args.pace} s (`--pace`: a model of that "
             f"cost), a snapshot every {args.every} steps, " +
             ("Open MPI 5.0.11: `jaxfog run --max-restarts 2` (restart), and with "
              "`--mpi-args '--with-ft ulfm' --max-restarts 0` and `jaxfog.elastic.run` "
              "(in place). " if openmpi else
              "`jaxfog run --max-restarts 2` (MPICH 5.0.2, recovery by restart). ") +
             f"Time to rank 0's test accuracy >= the method's target ({args.targets}) "
             "from the first launch "
             f"(median of {args.rounds} round(s), interleaved). `goodput` = failure-free "
             "time to target / this scenario's; `recovery` = seconds from the kill to the "
             "first step completed after the resume (the relaunch: probe, start, imports, "
             "compile, resume; in place: the failure seen, the shrink, the step redone, "
             "compiled for the new size); `join stall` = the longest gap between two "
             "logged snapshots after the new host was offered, less the usual gap (the "
             "job stopping at its snapshot, the relaunch and the newcomer's live copy, "
             "or the spawn in place).",
             "",
             "| method | scenario | time to target (s) | goodput | recovery (s) | join stall (s) "
             "| whole run (s) | final accuracy |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    import statistics

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    for method in args.methods.split(","):
        free = median(r["to_target"] for r in results[(method, "failure-free")])
        for scenario in scenarios:
            rows = results[(method, scenario)]
            to_target = median(r["to_target"] for r in rows)
            goodput = (free / to_target) if free and to_target else None
            recovery = median(r["recovery"] for r in rows)
            fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
            lines.append(f"| {method} | {scenario} | {fmt(to_target)} | "
                         f"{fmt(goodput, '{:.2f}')} | {fmt(recovery)} | "
                         f"{fmt(median(r['join'] for r in rows))} | "
                         f"{fmt(median(r['total'] for r in rows))} | "
                         f"{fmt(median(r['final'] for r in rows), '{:.3f}')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results" / (
        "elastic_in_place.md" if openmpi else "elastic_goodput.md")
    out.write_text(text + f"\n![accuracy against time]({out.stem}.png)\n")
    plot(runs, args, targets, scenarios, out.with_suffix(".png"))
    return 0


def plot(runs: dict, args, targets: dict, scenarios, path: Path) -> None:
    """Rank 0's test accuracy against wall time, first round, one panel a method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = args.methods.split(",")
    figure, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.6), sharey=True)
    for ax, method in zip(list(np.atleast_1d(axes)), methods):
        for scenario in scenarios:
            run = runs[(method, scenario)]
            t = [row[0] - run["started"] for row in run["log"]]
            line, = ax.plot(t, [row[3] for row in run["log"]], ".-", label=scenario, ms=3)
            for moment, style in ((run["killed"], "--"), (run["joined"], ":")):
                if moment is not None:
                    ax.axvline(moment - run["started"], color=line.get_color(), ls=style, lw=1)
        ax.axhline(targets[method], color="grey", lw=0.8)
        ax.set_title(method)
        ax.set_xlabel("seconds from the first launch")
    np.atleast_1d(axes)[0].set_ylabel("rank 0's test accuracy")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    figure.suptitle(f"4 hosts at {args.rate}: kill (--) and join (:)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
