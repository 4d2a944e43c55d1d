"""The ``netns_cluster`` fixture: hosts as network namespaces (scripts/netns_cluster.py).

Tests using it skip, saying why, where namespaces cannot be made (not root, no
iproute2, a container that refuses ``ip netns add``). Each cluster is deleted
at the test's end; leftovers of a killed run are swept when the next starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping, Sequence

import pytest

from jaxfog.testing import MpiResult, beside, launch_environment, load_module, run_command
from paths import SCRIPTS

netns_cluster = load_module(SCRIPTS / "netns_cluster.py")


@pytest.fixture
def netns_cluster_factory():
    """``make(hosts, rate=None) -> Cluster``; every cluster made is closed after the test."""
    why_not = netns_cluster.permitted()
    if why_not:
        pytest.skip(f"network namespaces not available: {why_not}")
    netns_cluster.sweep()
    made: list[netns_cluster.Cluster] = []

    def make(hosts: int, rate: str | None = None) -> netns_cluster.Cluster:
        made.append(netns_cluster.Cluster(hosts, rate=rate))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


def run_command_args(cluster, np: int, command: Sequence[str], *, slots: int = 1,
                     hosts_option: bool = False, mpi_args: Sequence[str] = ()) -> list[str]:
    """``jaxfog run`` on node0 with every host (``--hostfile``, or ``--hosts``)."""
    where = (["--hosts", ",".join(f"{n}:{slots}" for n in cluster.names)] if hosts_option
             else ["--hostfile", cluster.hostfile(slots)])
    return cluster.on_host(0, [sys.executable, "-m", "jaxfog.cli", "run", "-np", str(np),
                               *where, *mpi_args, "--", *command])


def rank_processes(cluster, host: int, script: str) -> list[int]:
    """Pids of the rank programs (``python .../<script>``, not the launchers or
    rank shims naming it) still on ``host``."""
    found = []
    for pid in cluster.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if len(argv) > 1 and argv[1].endswith(script.encode()):
                found.append(pid)
        except OSError:
            pass
    return found


def launch(cluster, np: int, command: Sequence[str], *, timeout: float, slots: int = 1,
           hosts_option: bool = False, env: Mapping[str, str] | None = None) -> MpiResult:
    """Runs ``command`` on ``np`` ranks over the cluster's hosts; never past ``timeout``."""
    return run_command(run_command_args(cluster, np, command, slots=slots,
                                        hosts_option=hosts_option),
                       timeout=timeout, env=cluster.environment(launch_environment(env)))


def body(cluster, np: int, file: str, function: str, *, env: Mapping[str, str] | None = None,
         **options) -> MpiResult:
    """Runs test body ``function`` of ``file`` (as ``@mpi_test`` would) on the cluster."""
    return launch(cluster, np, [sys.executable, "-m", "jaxfog.testing",
                                str(Path(file).resolve()), function],
                  env=beside(file, launch_environment(env)), **options)
