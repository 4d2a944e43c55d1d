"""Several hosts on one machine: ranks in network namespaces over real TCP links.

The rig (scripts/netns_cluster.py, tests/netns_rig.py) makes every host a
network namespace with its own hostname on a bridge; ``jaxfog run --hostfile``
or ``--hosts`` starts the ranks through hydra's ssh launcher pointed at
``ip netns exec``, so what crosses hosts crosses veth links, where the tests
count it. Values are checked against numpy. Skipped where namespaces cannot
be made (not root).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_harness import openmpi_with_ulfm
from netns_rig import body, launch, rank_processes
from paths import REPO, TESTS

#: A payload big enough that its crossing dwarfs the launch's own traffic.
PAYLOAD = 1 << 20  # float32 elements, 4 MB


def layout_and_hierarchical():
    """2 hosts x 2 ranks: machines and local ranks from MPI, hierarchical
    averaging between the hosts against numpy, ``jaxfog info``'s hosts."""
    import socket

    import jax.numpy as jnp

    import jaxfog as jf
    import jaxfog.topology as T
    from jaxfog.cli._command import info_lines, tcp_settings

    jf.init()
    r, n = jf.rank(), jf.size()
    assert n == 4
    assert socket.gethostname() == f"node{r // 2}"
    assert (jf.local_rank(), jf.local_size()) == (r % 2, 2)
    assert (jf.machine_rank(), jf.machine_size()) == (r // 2, 2)
    assert jf.is_homogeneous()
    W = np.array([[0.75, 0.25], [0.25, 0.75]])
    jf.set_machine_topology(T.from_weights(W))
    X = np.random.default_rng(0).standard_normal((n, PAYLOAD)).astype(np.float32)
    y = jf.hierarchical_neighbor_allreduce(jnp.asarray(X[r]))
    machine_means = X.reshape(2, 2, PAYLOAD).mean(axis=1)
    np.testing.assert_allclose(y, (W @ machine_means)[r // 2], rtol=1e-5, atol=1e-6)
    lines = info_lines()  # collective
    if r == 0:
        assert "hosts: 2: node0 (ranks 0-1), node1 (ranks 2-3)" in lines, lines
        # Both hosts start from the machine's TCP settings: one line for both,
        # pointing to the docs where they are the ones that lose slow links.
        control, idle = tcp_settings()
        assert control == Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        tcp = [line for line in lines if line.startswith("TCP: ")]
        assert tcp and tcp[0].startswith(
            f"TCP: congestion control {control}, slow start after idle {idle}"), lines
        assert ("docs/performance.rst" in tcp[0]) == (control == "bbr" or idle == "on"), tcp
        print("\n".join(lines), flush=True)


def test_two_hosts_layout_hierarchical_and_bytes_on_the_links(netns_cluster_factory):
    cluster = netns_cluster_factory(2)
    before = [cluster.counters(i) for i in range(2)]
    result = body(cluster, 4, __file__, "layout_and_hierarchical", slots=2, timeout=240)
    assert result.ok, result.report()
    after = [cluster.counters(i) for i in range(2)]
    # The leaders exchange the machine means (4 MB each way) over eth0: with
    # shared memory between namespaces (UCX's default) about 16 KB crossed.
    for i in range(2):
        for way in ("rx", "tx"):
            assert after[i][way] - before[i][way] > 4 * PAYLOAD, (i, way, before, after)


def test_windows_across_hosts_with_hosts_option(netns_cluster_factory):
    """Passive-target RMA between hosts: puts and gets complete while the target
    sleeps outside MPI (the progress thread ``jaxfog run`` turns on for hosts),
    and the window semantics match numpy on 2 hosts."""
    cluster = netns_cluster_factory(2)
    windows = str(TESTS / "ops" / "test_window_mpi.py")
    for case in ("test_writes_do_not_wait_for_a_busy_target",
                 "test_put_accumulate_update_against_numpy"):
        result = body(cluster, 2, windows, case, hosts_option=True, timeout=180)
        assert result.ok, result.report()


def test_jax_distributed_mesh_across_hosts(netns_cluster_factory):
    """jax.distributed's coordinator and gloo between hosts named by hostname;
    every op on the device mesh against the simulation and numpy."""
    cluster = netns_cluster_factory(2)
    mesh = str(TESTS / "mesh" / "test_mesh_mpi.py")
    result = body(cluster, 2, mesh, "test_mesh_ops_grad_scan_and_agents", timeout=240)
    assert result.ok, result.report()


#: Seconds an op waits for a peer in the fault tests (JAXFOG_TIMEOUT).
FAULT_TIMEOUT = 5
#: What "within seconds" allows on two shared cores: the timeout, one more
#: step's wait for a neighbour that failed first, and the bounded exit.
FAULT_SLACK = 20
#: Elements per message in the fault tests: 1 MB, a few ms per exchange.
FAULT_ELEMENTS = 1 << 18


def _ring_after(steps: int, n: int, elements: int) -> np.ndarray:
    """The ring averaging of x_r = r, ``steps`` times, in numpy."""
    W = np.zeros((n, n))
    for r in range(n):
        W[r, [r, (r - 1) % n, (r + 1) % n]] = 1 / 3
    return np.repeat(np.linalg.matrix_power(W, steps) @ np.arange(n, dtype=np.float64),
                     elements).reshape(n, elements)


def _restore(directory: str, rank: int, step: int, elements: int) -> np.ndarray:
    """Rank ``rank``'s checkpoint of ``step``, read with orbax in this process."""
    import jax
    import orbax.checkpoint as ocp

    like = {"x": jax.ShapeDtypeStruct((elements,), np.float32)}
    with ocp.CheckpointManager(os.path.join(directory, "ckpt", f"rank_{rank}")) as manager:
        return np.asarray(manager.restore(step, args=ocp.args.StandardRestore(like))["x"])


def _rank_processes(cluster, host: int) -> list[int]:
    return rank_processes(cluster, host, "cluster_fault_rank.py")


def _start_fault_job(cluster, n: int, tmp_path, *, mpi_args=(),
                     hosts_option: bool = False) -> tuple:
    """Launches tests/cluster_fault_rank.py on ``n`` hosts in a thread and
    returns (the thread, a dict that gets the launch's "result") once every
    rank has checkpointed and is exchanging. Each rank's stderr goes to
    DIRECTORY/stderr.<rank> (a launcher that ends the job may drop it)."""
    import shlex
    import threading

    from jaxfog.testing import launch_environment, run_command
    from netns_rig import run_command_args

    script = str(TESTS / "cluster_fault_rank.py")
    rank = shlex.join([sys.executable, script, str(tmp_path), str(FAULT_ELEMENTS)])
    command = run_command_args(
        cluster, n, ["sh", "-c", f"exec {rank} 2> {tmp_path}/stderr."
                     "${PMI_RANK:-$OMPI_COMM_WORLD_RANK}"],
        mpi_args=mpi_args, hosts_option=hosts_option)
    env = cluster.environment(launch_environment({"JAXFOG_TIMEOUT": str(FAULT_TIMEOUT)}))
    done: dict = {}
    launch_thread = threading.Thread(
        target=lambda: done.setdefault("result", run_command(command, timeout=240, env=env)))
    launch_thread.start()
    while launch_thread.is_alive() and not all(
            (tmp_path / f"ready.{r}").exists() for r in range(n)):
        time.sleep(0.1)
    time.sleep(0.5)  # well inside the exchanges
    return launch_thread, done


def test_a_link_pulled_during_an_exchange_fails_every_rank_in_seconds(netns_cluster_factory,
                                                                     tmp_path):
    """4 hosts in a ring exchanging; host 3's cable is pulled at the switch.
    Every rank whose output can reach the launcher fails within the timeout
    naming the op and the peer it waited for, no rank process outlives the
    bound, and the checkpoints saved before the fault load."""
    n = 4
    cluster = netns_cluster_factory(n)
    launch_thread, done = _start_fault_job(cluster, n, tmp_path)
    cluster.link(3, up=False)
    faulted = time.monotonic()
    while time.monotonic() - faulted < 2 * FAULT_TIMEOUT + FAULT_SLACK and any(
            cluster.pids(i) and _rank_processes(cluster, i) for i in range(n - 1)):
        time.sleep(0.5)
    lingering = {i: _rank_processes(cluster, i) for i in range(n - 1)}
    launch_thread.join(timeout=5)  # the ranks' last lines on their way to mpiexec
    cluster.close()  # ends what still runs (the launcher may wait for the lost host)
    launch_thread.join()
    output = done["result"].output
    assert not any(lingering.values()), f"rank processes still running: {lingering}\n{output}"
    for r in range(n - 1):
        line = next((s for s in output.splitlines() if s.startswith(f"RANK {r} ")), None)
        assert line is not None and "FAILED" in line, f"rank {r}:\n{output}"
        waited = float(line.split(" after ")[1].split(" s")[0])
        assert waited < FAULT_TIMEOUT + FAULT_SLACK, line
        # Ranks 0 and 2 wait for rank 3; rank 1 for 0 and 2, which failed first.
        peers = ["rank 3"] if r != 1 else ["rank 0", "rank 2"]
        assert "jaxfog neighbor_allreduce (op #" in line and any(
            p in line for p in peers), line
    for r in range(n):
        np.testing.assert_allclose(_restore(str(tmp_path), r, 2, FAULT_ELEMENTS),
                                   _ring_after(2, n, FAULT_ELEMENTS)[r], rtol=1e-6)


def _reports(directory, ranks) -> dict[int, str]:
    """What each rank wrote to its own report file (DIRECTORY/report.<rank>)."""
    return {r: (directory / f"report.{r}").read_text().strip()
            for r in ranks if (directory / f"report.{r}").exists()}


def test_a_link_shaped_to_a_trickle_fails_every_rank_in_seconds(netns_cluster_factory,
                                                                tmp_path):
    """Host 3's link cut to 8 kbit/s (a congested or failing link, not a cut
    one) mid-exchange of 1 MB messages: every rank, rank 3 included, fails
    within the timeout naming the op and a neighbour, each in its own file."""
    n = 4
    cluster = netns_cluster_factory(n)
    launch_thread, _ = _start_fault_job(cluster, n, tmp_path)
    cluster.shape(3, "8kbit")  # 1 MB would take about 17 minutes
    faulted = time.monotonic()
    while time.monotonic() - faulted < 2 * FAULT_TIMEOUT + FAULT_SLACK and (
            len(_reports(tmp_path, range(n))) < n or any(
                _rank_processes(cluster, i) for i in range(n))):
        time.sleep(0.5)
    lingering = {i: _rank_processes(cluster, i) for i in range(n)}
    reports = _reports(tmp_path, range(n))
    cluster.close()  # mpiexec waits for host 3's proxy, behind the trickle
    launch_thread.join()
    assert not any(lingering.values()), f"rank processes still running: {lingering}"
    # Each rank waits for a neighbour on the ring; 0 and 2 for rank 3 or for the
    # other (whichever failed first), 3 for 0 or 2 behind its own trickle.
    neighbours = {r: [f"rank {(r - 1) % n}", f"rank {(r + 1) % n}"] for r in range(n)}
    for r in range(n):
        line = reports.get(r, "")
        assert "FAILED" in line and "jaxfog neighbor_allreduce (op #" in line and any(
            p in line for p in neighbours[r]), (r, reports)
        waited = float(line.split(" after ")[1].split(" s")[0])
        assert waited < FAULT_TIMEOUT + FAULT_SLACK, line


@pytest.mark.parametrize("whole_host", [False, True], ids=["its rank", "every process"])
def test_a_host_whose_rank_is_killed_fails_the_survivors_under_openmpi_ulfm(
        netns_cluster_factory, tmp_path, whole_host):
    """Host 3's rank SIGKILLed mid-exchange (as by the OOM killer) under Open
    MPI 5 with ULFM (``jaxfog run ... --with-ft ulfm``): MPI fails the
    survivors' requests to it (MPI_ERR_PROC_FAILED) instead of ending the job
    or crashing, and each survivor reports the op and the peer within
    seconds: ranks 0 and 2 that rank 3 died, rank 1 that 0 or 2 left. No
    survivor crashes, none outlives the bound, and the checkpoints load.

    With every process of host 3 killed (its Open MPI daemon too, as when the
    machine dies), prterun ends the job within a second: ranks 0 and 2 have
    reported by then, and rank 1, ended by SIGTERM while it waits, says on
    stderr which op waited for which ranks."""
    why_not = openmpi_with_ulfm()
    if why_not:
        pytest.skip(why_not)
    import signal

    n = 4
    cluster = netns_cluster_factory(n)
    # Open MPI reads no hydra hostfile (node0:1): the hosts go in with --hosts.
    launch_thread, done = _start_fault_job(cluster, n, tmp_path,
                                           mpi_args=["--with-ft", "ulfm"], hosts_option=True)
    for pid in cluster.pids(3) if whole_host else _rank_processes(cluster, 3):
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 2 * FAULT_TIMEOUT + FAULT_SLACK and (
            (not whole_host and len(_reports(tmp_path, range(n - 1))) < n - 1) or any(
                _rank_processes(cluster, i) for i in range(n - 1))):
        time.sleep(0.2)
    ended = time.monotonic() - killed
    lingering = {i: _rank_processes(cluster, i) for i in range(n - 1)}
    reports = _reports(tmp_path, range(n - 1))
    launch_thread.join(timeout=10)  # prterun ends once its ranks have
    cluster.close()
    launch_thread.join()
    output = done["result"].output
    assert not any(lingering.values()), f"rank processes still running: {lingering}\n{output}"
    assert not any(sign in output for sign in ("Segmentation fault", "signal 11", "SIGSEGV",
                                               "Fatal Python error")), output
    peers = {0: ["rank 3 has failed"], 1: ["rank 0", "rank 2"], 2: ["rank 3 has failed"]}
    for r in range(n - 1):
        line = reports.get(r, "")
        said = (tmp_path / f"stderr.{r}").read_text()
        if whole_host and not line:
            # prterun ended the job first (0.6 s after the kill): the rank, ended by
            # its SIGTERM, said on stderr which op waited for what (rank 1: for both
            # neighbours, or what was still to come from or go to one), or, between
            # ops (reporting its error, say), which ops it ran last
            assert re.search(r"jaxfog (neighbor_allreduce \(op #\d+ on rank \d\)|\(rank \d\))"
                             r": this process got SIGTERM \(a launcher ending the job sends "
                             r"it\) (while waiting for [^;]*rank \d|between ops[^;]*; its last: "
                             r"op #\d+ \(neighbor_allreduce\)); it ends now", said), (r, said)
            assert ended < FAULT_TIMEOUT + FAULT_SLACK, (ended, reports)
            continue
        assert "FAILED" in line and "jaxfog neighbor_allreduce (op #" in line and any(
            p in line for p in peers[r]), (r, reports, output)
        waited = float(line.split(" after ")[1].split(" s")[0])
        assert waited < FAULT_TIMEOUT + FAULT_SLACK, line
    for r in range(n):
        np.testing.assert_allclose(_restore(str(tmp_path), r, 2, FAULT_ELEMENTS),
                                   _ring_after(2, n, FAULT_ELEMENTS)[r], rtol=1e-6)


def test_a_host_that_never_joins_ends_the_others_in_init(netns_cluster_factory, tmp_path):
    """Host 3's proxy never starts (the launcher's connection to it hangs, as
    ssh to a machine that is down): ranks 0-2 wait in MPI_Init for a rank
    that never comes, and each ends after JAXFOG_INIT_TIMEOUT saying so (on
    its own stderr file), instead of waiting for ever."""
    import threading

    from jaxfog.testing import launch_environment, run_command
    from netns_rig import run_command_args

    n, bound = 4, 15
    cluster = netns_cluster_factory(n)
    cluster.never_join(3)
    script = str(TESTS / "cluster_fault_rank.py")
    command = run_command_args(cluster, n, ["sh", "-c", f"exec {sys.executable} {script} "
                                            f"{tmp_path} 1024 2> {tmp_path}/stderr.$PMI_RANK"])
    env = cluster.environment(launch_environment({"JAXFOG_INIT_TIMEOUT": str(bound)}))
    launch_thread = threading.Thread(target=run_command, args=(command,),
                                     kwargs={"timeout": 240, "env": env})
    started = time.monotonic()
    launch_thread.start()
    while time.monotonic() - started < 2 * bound + FAULT_SLACK and not all(
            (tmp_path / f"stderr.{r}").exists() for r in range(n - 1)):
        time.sleep(0.2)
    assert all((tmp_path / f"stderr.{r}").exists() for r in range(n - 1)), "ranks not started"
    while time.monotonic() - started < 2 * bound + FAULT_SLACK and any(
            _rank_processes(cluster, i) for i in range(n - 1)):
        time.sleep(0.5)
    ended = time.monotonic() - started
    lingering = {i: _rank_processes(cluster, i) for i in range(n - 1)}
    cluster.close()  # mpiexec still waits for host 3's launch
    launch_thread.join()
    assert not any(lingering.values()), f"rank processes still running: {lingering}"
    assert bound <= ended < 2 * bound + FAULT_SLACK, ended
    for r in range(n - 1):
        said = (tmp_path / f"stderr.{r}").read_text()
        assert f"jaxfog.init (rank {r} of {n}): MPI_Init still waits after {bound} s " \
               "(JAXFOG_INIT_TIMEOUT)" in said, (r, said)
    assert not (tmp_path / "report.0").exists()  # nobody got past init


#: A 4 MB model (float32).
MODEL_ELEMENTS = 1 << 20


def test_one_peer_gossip_beats_allreduce_where_bandwidth_is_scarce(netns_cluster_factory):
    """4 hosts on 100 Mbit/s links: an allreduce sends about 2(n-1)/n = 1.5
    models per rank, one-peer gossip one, so the exchange takes about 2/3 of
    the time. The bytes are counted on the hosts' interfaces, and the speed-up
    is asserted against their ratio: where bandwidth is the limit, time follows
    bytes (measured 1.54x for a byte ratio of 1.49), so at least 3/4 of the
    byte ratio (about 1.12x) leaves a wide margin for a loaded machine and
    still fails if gossip lost its advantage (1.0x)."""
    import json

    n, steps = 4, 3
    cluster = netns_cluster_factory(n, rate="100mbit")
    program = str(REPO / "benchmarks" / "_cluster_exchange.py")
    sent = []
    seconds = {}
    for method in ("allreduce", "one-peer"):
        before = [cluster.counters(i)["tx"] for i in range(n)]
        result = launch(cluster, n, [sys.executable, program, str(MODEL_ELEMENTS), str(steps),
                                     method], timeout=180)
        assert result.ok, result.report()
        sent.append([cluster.counters(i)["tx"] - b for i, b in enumerate(before)])
        line = next(s for s in result.output.splitlines() if s.startswith("EXCHANGE "))
        seconds.update(json.loads(line.split(" ", 1)[1])["seconds"])
    model = 4 * MODEL_ELEMENTS
    exchanges = steps + 1  # the warm-up and the timed steps
    for rank_bytes in sent[1]:  # one model a step per rank, TCP/IP headers, little else
        assert exchanges * model < rank_bytes < exchanges * model * 1.15, sent
    for rank_bytes in sent[0]:
        assert rank_bytes > exchanges * model * 1.4, sent
    speedup = seconds["allreduce"] / seconds["one-peer"]
    byte_ratio = sum(sent[0]) / sum(sent[1])
    assert speedup > 0.75 * byte_ratio, (seconds, byte_ratio)
