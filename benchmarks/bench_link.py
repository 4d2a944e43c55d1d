"""Where a step's exchange loses the link: MPI's allreduce and a one-peer
exchange against raw TCP between the same hosts, on 4 hosts (network
namespaces, one rank each) at 10 and 100 Mbit/s.

    sudo python benchmarks/bench_link.py [--rates 10mbit,100mbit] [--mb 1.3]

Each configuration is one launch; in it every rank times, as whole loops
(no per-step barrier, see ../shared/ENVIRONMENT.md), ``--reps`` exchanges of
``--mb`` MB of float32 with a gap between them that stands for a step's
compute: none, or a busy one (the rank computing, as a training step does on
these 2 shared cores). Exchanges:

* ``tcp pair``: raw sockets, ranks 0-2 and 1-3 each sending the buffer to the
  other at once over one connection (the floor a pairwise exchange can reach
  on these links);
* ``tcp shift``: raw sockets, each rank sending to rank + 1 while receiving from
  rank - 1 (two connections: each one's acknowledgements travel alone);
* ``tcp one-peer``: raw sockets on the one-peer exponential schedule below
  (a connection set per hop, each idle while another carries a step);
  ``tcp one-peer receipted``: the same, then a byte back to the sender once
  its data is in, awaited before the next step (what receipts add);
* ``mpi pair``, ``mpi shift``: the same through MPI_Sendrecv;
* ``mpi one-peer``: MPI_Sendrecv on a one-peer exponential schedule (to rank +
  2^k, from rank - 2^k, k alternating: the peer changes every step);
* ``mpi one-peer receipted``: the same, then an empty message back to the
  sender, awaited before the next step (``JAXFOG_SEND_RECEIPTS``' pattern);
* ``mpi allreduce``: MPI_Allreduce over the 4 ranks (gradient allreduce);
* ``mpi iallreduce``: MPI_Iallreduce then MPI_Wait (the nonblocking form);
* ``jaxfog allreduce``, ``jaxfog one-peer``: the jitted ops of gradient
  allreduce and of ``atc`` on a one-peer exponential schedule;
* ``jaxfog one-peer delay=1``: ``delay=1``'s pattern, each exchange started,
  then waited a step later (in flight during the gap: its seconds are what
  the gap did not hide).

The floor of an exchange is the bytes one rank sends over the link's rate
(allreduce: 2 (n - 1) / n times the buffer, what MPICH's reduce-scatter plus
allgather sends). Configurations: MPICH's default; its ring allreduce
(blocking and nonblocking); ``tcp_slow_start_after_idle=0`` on every host (the kernel
otherwise restarts a connection idle for one RTO in slow start); MPICH's
progress thread off (``jaxfog run`` turns it on across hosts); UCX's TCP
send buffers capped at 128 KB (about the shaper's queue); the ring with the
progress thread off; and that with ``JAXFOG_SEND_RECEIPTS=1``, with TCP
congestion control cubic in place of the machine's (BBR here) and with slow
start after idle off, alone and together. ``--rounds K`` runs the chosen
configurations K times, interleaved, and tables each round. Writes
benchmarks/results/link_4hosts.{md,json}. Needs root (namespaces; congestion
control is set on the machine, as a namespace may not set it here, and set
back after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from _examples import script

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "link_4hosts"
HOSTS = 4
GAPS = (("none", 0.0), ("busy 0.3 s", -0.3))
#: configuration -> (environment of the launch, sysctls set on every host, whether
#: jaxfog's own exchanges run too: in the configurations that matter)
RING_NO_PROGRESS = {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring",
                    "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "tsp_ring",
                    "MPIR_CVAR_ASYNC_PROGRESS": "0"}
RECEIPTS = {**RING_NO_PROGRESS, "JAXFOG_SEND_RECEIPTS": "1"}
CONFIGS = {
    "MPICH default": ({}, {}, True),
    "allreduce ring": ({"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring",
                        "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "tsp_ring"}, {}, True),
    "no slow start after idle": ({}, {"net.ipv4.tcp_slow_start_after_idle": "0"}, True),
    "no async progress": ({"MPIR_CVAR_ASYNC_PROGRESS": "0"}, {}, True),
    "send buffer 128k": ({"UCX_TCP_SNDBUF": "128k"}, {}, True),
    "rendezvous above 16k": ({"UCX_RNDV_THRESH": "16k"}, {}, True),
    "ring + no async progress": (RING_NO_PROGRESS, {}, True),
    "ring + no async progress + cubic": (
        RING_NO_PROGRESS, {"net.ipv4.tcp_congestion_control": "cubic"}, True),
    "ring + no async progress + cubic + no slow start after idle": (
        RING_NO_PROGRESS, {"net.ipv4.tcp_congestion_control": "cubic",
                           "net.ipv4.tcp_slow_start_after_idle": "0"}, True),
    "ring + no async progress + receipts": (RECEIPTS, {}, True),
    "receipts + no slow start after idle": (
        RECEIPTS, {"net.ipv4.tcp_slow_start_after_idle": "0"}, True),
    "receipts + cubic": (RECEIPTS, {"net.ipv4.tcp_congestion_control": "cubic"}, True),
    "receipts + cubic + no slow start after idle": (
        RECEIPTS, {"net.ipv4.tcp_congestion_control": "cubic",
                   "net.ipv4.tcp_slow_start_after_idle": "0"}, True),
}
#: sysctls a namespace may not set here: set on the machine before the hosts are
#: made (a namespace starts with the machine's), and set back after
MACHINE_WIDE = ("net.ipv4.tcp_congestion_control",)
PORT = 47011


# --- one rank ------------------------------------------------------------------

def _gap(seconds: float) -> None:
    """The stand-in for a step's compute: the rank spinning for ``-seconds``."""
    end = time.perf_counter() - seconds
    while time.perf_counter() < end:
        pass


def _tcp_counters() -> dict[str, int]:
    """This host's TCP counters (the process's network namespace): segments
    sent and retransmitted, retransmission timeouts."""
    values = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(path).read_text().splitlines()
        for names, numbers in zip(lines[0::2], lines[1::2]):
            values.update(zip(names.split()[1:], map(int, numbers.split()[1:])))
    return {"sent": values["OutSegs"], "retransmitted": values["RetransSegs"],
            "timeouts": values["TCPTimeouts"]}


def _timed(comm, reps: int, gap: float, exchange) -> dict:
    """Seconds per exchange over a whole loop of ``reps`` (gaps taken out), and
    this host's TCP counters over the loop."""
    exchange()  # connections made, buffers touched
    comm.Barrier()
    before = _tcp_counters()
    start = time.perf_counter()
    for _ in range(reps):
        _gap(gap)
        exchange()
    comm.Barrier()
    seconds = (time.perf_counter() - start - reps * abs(gap)) / reps
    after = _tcp_counters()
    getattr(exchange, "drain", lambda: None)()  # an exchange still in flight, untimed
    return {"seconds": seconds, **{k: after[k] - before[k] for k in after}}


def _bytes(text: str) -> int:
    """``"128k"`` -> 131072 (UCX's memory units)."""
    units = {"k": 1 << 10, "m": 1 << 20}
    return int(text[:-1]) * units[text[-1].lower()] if text[-1].lower() in units else int(text)


def _connect(comm, sender: int, receiver: int, port: int) -> socket.socket | None:
    """A TCP connection from rank ``sender`` to rank ``receiver`` (collective:
    every rank calls it); this rank's end, or None where it is neither."""
    rank = comm.Get_rank()
    names = comm.allgather(socket.gethostname())
    server = socket.create_server(("", port)) if rank == receiver else None
    comm.Barrier()
    conn = None
    if rank == sender:
        conn = socket.create_connection((names[receiver], port))
    if server is not None:
        conn, _ = server.accept()
        server.close()
    if conn is not None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if os.environ.get("UCX_TCP_SNDBUF"):  # the raw socket capped as UCX's are
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                            _bytes(os.environ["UCX_TCP_SNDBUF"]))
    return conn


def _tcp_exchange(comm, nbytes: int, hop: int, port: int, receipt: bool = False):
    """A function sending ``nbytes`` to rank + ``hop`` while receiving as many
    from rank - ``hop``, over raw sockets (hop n/2: a pair on one connection,
    each end's data carrying its acknowledgements; else a ring shift on two,
    the acknowledgements travelling alone behind the other direction's data);
    with ``receipt``, one byte back to the sender once its data is all in,
    awaited before the function returns."""
    rank, n = comm.Get_rank(), comm.Get_size()
    ends: dict[int, socket.socket] = {}
    for sender in range(n):
        receiver = (sender + hop) % n
        if hop * 2 == n and sender > receiver:
            continue  # a pair: one connection, both ways
        conn = _connect(comm, sender, receiver, port + sender)
        if conn is not None:
            ends[receiver if rank == sender else sender] = conn
    out, inbox = ends[(rank + hop) % n], ends[(rank - hop) % n]
    payload, buffer = bytearray(nbytes), bytearray(nbytes)

    def receive():
        view = memoryview(buffer)
        got = 0
        while got < nbytes:
            got += inbox.recv_into(view[got:])
        if receipt:
            inbox.sendall(b"r")

    def exchange():
        reader = threading.Thread(target=receive)
        reader.start()
        out.sendall(payload)
        reader.join()  # first: in a pair, the receipt follows the data on one socket
        if receipt and not out.recv(1):
            raise ConnectionError("the receiver closed before its receipt")

    return exchange


def _tcp_one_peer(comm, nbytes: int, port: int, receipt: bool = False):
    """Raw sockets on the one-peer exponential schedule of ``_one_peer`` (one
    connection set per hop, so each idles while the others carry a step)."""
    n = comm.Get_size()
    hops = [1 << k for k in range(max(1, (n - 1).bit_length()))]
    by_hop = [_tcp_exchange(comm, nbytes, hop, port + 10 * k, receipt)
              for k, hop in enumerate(hops)]
    step = [0]

    def exchange():
        step[0] += 1
        by_hop[step[0] % len(by_hop)]()

    return exchange


def _mpi_shift(comm, x, y):
    """MPI_Sendrecv to rank + 1, from rank - 1."""
    rank, n = comm.Get_rank(), comm.Get_size()
    return lambda: comm.Sendrecv(x, dest=(rank + 1) % n, recvbuf=y, source=(rank - 1) % n)


def _one_peer(comm, x, y):
    """MPI_Sendrecv on a one-peer exponential schedule: at step t, to rank + 2^(t mod
    log2 n) and from rank - 2^(t mod log2 n) (the peer changes every step)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    hops = [1 << k for k in range(max(1, (n - 1).bit_length()))]
    step = [0]

    def exchange():
        hop = hops[step[0] % len(hops)]
        step[0] += 1
        comm.Sendrecv(x, dest=(rank + hop) % n, recvbuf=y, source=(rank - hop) % n)

    return exchange


def _one_peer_receipted(comm, x, y):
    """As ``_one_peer``, then an empty receipt back to the sender (what
    ``JAXFOG_SEND_RECEIPTS=1`` adds): the next step's flow, to another peer,
    starts only once this one's data has arrived."""
    import numpy as np

    rank, n = comm.Get_rank(), comm.Get_size()
    hops = [1 << k for k in range(max(1, (n - 1).bit_length()))]
    step = [0]
    empty_out, empty_in = np.zeros(0, np.uint8), np.zeros(0, np.uint8)

    def exchange():
        hop = hops[step[0] % len(hops)]
        step[0] += 1
        comm.Sendrecv(x, dest=(rank + hop) % n, recvbuf=y, source=(rank - hop) % n)
        comm.Sendrecv(empty_out, dest=(rank - hop) % n, recvbuf=empty_in,
                      source=(rank + hop) % n, sendtag=7, recvtag=7)

    return exchange


def _jaxfog_exchanges(count: int) -> dict:
    """jaxfog's own exchanges of ``count`` float32, jitted, as a training step
    makes them: the allreduce of gradient allreduce, a one-peer exponential
    step (the step's peer alternating as the schedule's does), and the same
    started, then waited after the gap (``delay=1``: the gap overlaps it)."""
    import jax
    import jax.numpy as jnp

    import jaxfog as jf
    import jaxfog.topology as T

    jf.init()
    schedule = T.one_peer_exponential(jf.size())
    x = jnp.ones(count, jnp.float32)
    allreduce = jf.jit(lambda x: jf.allreduce(x))
    one_peer = jf.jit(lambda x, t: jf.neighbor_allreduce(x, topology=schedule, step=t))
    start = jf.jit(lambda x, t: jf.neighbor_allreduce_nonblocking(x, topology=schedule,
                                                                  step=t))
    wait = jf.jit(jf.wait)
    step = [0]
    pending = [None]

    def ticking(f):
        def run():
            step[0] += 1
            return jax.block_until_ready(f(x, step[0]))
        return run

    def drain():
        if pending[0] is not None:
            jax.block_until_ready(wait(pending[0]))
            pending[0] = None

    def started():  # waits for the exchange the previous step started, starts this one's
        step[0] += 1
        drain()
        pending[0] = start(x, step[0])

    started.drain = drain  # type: ignore[attr-defined]  # the last one, after the loop

    return {"jaxfog allreduce": lambda: jax.block_until_ready(allreduce(x)),
            "jaxfog one-peer": ticking(one_peer),
            "jaxfog one-peer delay=1": started}


def rank_main(args) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    count = int(args.mb * 1e6) // 4
    x = np.ones(count, np.float32)
    y = np.empty_like(x)
    peer = (rank + comm.Get_size() // 2) % comm.Get_size()
    exchanges = {
        "tcp pair": _tcp_exchange(comm, x.nbytes, comm.Get_size() // 2, PORT),
        "tcp shift": _tcp_exchange(comm, x.nbytes, 1, PORT + 100),
        "tcp one-peer": _tcp_one_peer(comm, x.nbytes, PORT + 200),
        "tcp one-peer receipted": _tcp_one_peer(comm, x.nbytes, PORT + 300, receipt=True),
        "mpi pair": lambda: comm.Sendrecv(x, dest=peer, recvbuf=y, source=peer),
        "mpi shift": _mpi_shift(comm, x, y),
        "mpi one-peer": _one_peer(comm, x, y),
        "mpi one-peer receipted": _one_peer_receipted(comm, x, y),
        "mpi allreduce": lambda: comm.Allreduce(x, y),
        "mpi iallreduce": lambda: comm.Iallreduce(x, y).Wait(),
    }
    if args.jaxfog:
        exchanges.update(_jaxfog_exchanges(count))
    times = {}
    for name, exchange in exchanges.items():
        if args.ops and name not in args.ops.split(","):
            continue
        for label, gap in GAPS:
            times[f"{name}|{label}"] = _timed(comm, args.reps, gap, exchange)
    every = comm.gather(times)
    if rank == 0:  # the slowest rank's seconds, the hosts' TCP counters summed
        Path(args.rank_out).write_text(json.dumps({key: {
            "seconds": max(r[key]["seconds"] for r in every),
            **{c: sum(r[key][c] for r in every) for c in ("sent", "retransmitted", "timeouts")}}
            for key in times}))


# --- the driver ------------------------------------------------------------------

@contextlib.contextmanager
def _machine_sysctls(sysctls: dict):
    """The machine-wide sysctls of a configuration, for the hosts made under it."""
    saved = {key: subprocess.run(["sysctl", "-n", key], check=True, capture_output=True,
                                 text=True).stdout.strip()
             for key in sysctls if key in MACHINE_WIDE}
    try:
        for key in saved:
            subprocess.run(["sysctl", "-qw", f"{key}={sysctls[key]}"], check=True)
        yield
    finally:
        for key, value in saved.items():
            subprocess.run(["sysctl", "-qw", f"{key}={value}"], check=True)


def run_config(rate: str, env: dict, sysctls: dict, jaxfog: bool, args) -> dict:
    import tempfile

    from jaxfog.testing import launch_environment, run_command
    netns_cluster = script("netns_cluster")
    with tempfile.TemporaryDirectory() as out, _machine_sysctls(sysctls), \
            netns_cluster.Cluster(HOSTS, rate=rate) as cl:
        for ns in cl.namespaces:
            for key, value in sysctls.items():
                if key in MACHINE_WIDE:
                    continue
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"],
                               check=True)
        result_file = Path(out, "times.json")
        command = cl.on_host(0, [
            sys.executable, "-m", "jaxfog.cli", "run", "-np", str(HOSTS), "--hostfile",
            cl.hostfile(), "--", sys.executable, str(Path(__file__).resolve()), "--rank",
            "--rank-out", str(result_file), "--mb", str(args.mb), "--reps", str(args.reps),
            *(["--ops", args.ops] if args.ops else []),
            *(["--jaxfog"] if jaxfog or "jaxfog" in args.ops else [])])
        result = run_command(command, timeout=1800,
                             env=cl.environment(launch_environment({**env,
                                                                    "JAXFOG_TIMEOUT": "600"})))
        if not result.ok:
            raise SystemExit(result.report())
        return json.loads(result_file.read_text())


def floor(rate: str, op: str, mb: float) -> float:
    """Seconds the bytes one rank sends take at the link's rate."""
    bits = float(rate.removesuffix("mbit")) * 1e6
    sent = mb * 1e6 * (2 * (HOSTS - 1) / HOSTS if op.endswith("allreduce") else 1.0)
    return sent * 8 / bits


SUMMARY = ("tcp pair", "tcp one-peer receipted", "mpi allreduce", "jaxfog allreduce",
           "jaxfog one-peer", "jaxfog one-peer delay=1")


def _rounds_lines(rounds: list[dict], mb: float) -> list[str]:
    """Each cell of the rounds, side by side: x floor with the busy gap (none in
    brackets), one column a round."""
    keys = dict.fromkeys((rate, config, key.split("|")[0])
                         for one in rounds for rate in one for config in one[rate]
                         for key in one[rate][config])
    lines = ["## Rounds", "",
             f"These configurations and exchanges ran {len(rounds)} times, interleaved "
             "(each round every configuration once); x floor with a busy gap (none in "
             "brackets). The tables above hold the last round's cells.", "",
             "| link | configuration | exchange | " + " | ".join(
                 f"round {i + 1}" for i in range(len(rounds))) + " |",
             "|---|---|---|" + "---:|" * len(rounds)]
    for rate, config, op in keys:
        cells = []
        for one in rounds:
            times = one.get(rate, {}).get(config, {})
            busy, idle = times.get(f"{op}|busy 0.3 s"), times.get(f"{op}|none")
            f = floor(rate, op, mb)
            cells.append("-" if busy is None or idle is None else
                         f"{busy['seconds'] / f:.2f}x ({idle['seconds'] / f:.2f}x)")
        lines.append(f"| {rate} | {config} | {op} | " + " | ".join(cells) + " |")
    return lines


def write(results: dict, mb: float, reps: int, rounds: list[dict] | None = None) -> None:
    from jaxfog import _machine

    rates = list(results)
    configs = list(dict.fromkeys(c for rate in rates for c in results[rate]))
    lines = [
        f"# A step's exchange against the link: {mb:g} MB of float32, 4 hosts x 1 rank",
        "",
        f"Machine: {_machine.cpu()} (the 4 ranks share its cores); 2026-11-29, the "
        "receipts and cubic configurations 2026-11-30. Hosts: "
        "network namespaces on one Linux bridge (scripts/netns_cluster.py), each host's "
        "veth capped both ways by `tc tbf "
        "<rate> burst 64kb latency 50ms`; MPICH 5.0.2 over UCX TCP; TCP congestion control "
        "BBR (the machine's) unless a configuration names cubic. Each cell: seconds per "
        f"exchange over a loop of {reps} (the slowest rank), a gap before each exchange "
        "(busy: the rank spinning 0.3 s, as a step's compute); `x floor`: over the bytes one "
        "rank sends at the link's rate (payload only; TCP/IP headers add about 3%; for "
        "`delay=1` the part of the exchange the gap did not hide, so below 1 with a gap); "
        "`retransmitted`: the hosts' TCP RetransSegs over OutSegs during the loop; "
        "`timeouts`: their retransmission timeouts per exchange. Written by "
        "benchmarks/bench_link.py.",
        "",
        "## Summary: x floor with a busy gap (none in brackets)",
        "",
        "| configuration | " + " | ".join(f"{op} {rate}" for rate in rates for op in SUMMARY)
        + " |",
        "|---|" + "---:|" * (len(rates) * len(SUMMARY)),
    ]
    for config in configs:
        cells = []
        for rate in rates:
            for op in SUMMARY:
                times = results[rate].get(config, {})
                busy, idle = times.get(f"{op}|busy 0.3 s"), times.get(f"{op}|none")
                f = floor(rate, op, mb)
                cells.append("-" if busy is None else
                             f"{busy['seconds'] / f:.2f}x ({idle['seconds'] / f:.2f}x)")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    lines += ["", "## Every cell", "",
              "| link | configuration | exchange | gap | seconds | x floor | retransmitted | "
              "timeouts |",
              "|---|---|---|---|---:|---:|---:|---:|"]
    for rate in rates:
        for config, times in results[rate].items():
            for key, cell in times.items():
                op, gap = key.split("|")
                seconds = cell["seconds"]
                lines.append(f"| {rate} | {config} | {op} | {gap} | {seconds:.3f} | "
                             f"{seconds / floor(rate, op, mb):.2f}x | "
                             f"{cell['retransmitted'] / max(1, cell['sent']):.1%} | "
                             f"{cell['timeouts'] / reps:.1f} |")
    if rounds:
        lines += ["", *_rounds_lines(rounds, mb)]
    OUT.parent.mkdir(exist_ok=True)
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    OUT.with_suffix(".json").write_text(json.dumps({"mb": mb, "reps": reps,
                                                    "results": results, "rounds": rounds or []},
                                                   indent=1))
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10mbit,100mbit")
    parser.add_argument("--mb", type=float, default=1.3, help="MB exchanged per step")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ops", default="", help="only these exchanges (comma-separated)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the configurations this many times, interleaved; more "
                             "than 1 replaces the committed rounds with these")
    parser.add_argument("--table", action="store_true",
                        help="write the table again from the committed JSON")
    parser.add_argument("--add", action="store_true",
                        help="keep the committed JSON's cells, adding (or replacing) these")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    parser.add_argument("--jaxfog", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    saved = (json.loads(OUT.with_suffix(".json").read_text())
             if OUT.with_suffix(".json").exists() else {})
    if args.table:
        write(saved["results"], saved["mb"], saved["reps"], saved.get("rounds"))
        return
    why_not = script("netns_cluster").permitted()
    if why_not:
        raise SystemExit(f"bench_link: {why_not}")
    # --add: more cells for the committed table (and its rounds, unless new ones)
    results: dict = saved.get("results", {}) if args.add else {}
    kept = saved.get("rounds", []) if args.add and args.rounds == 1 else []
    rounds: list[dict] = [{} for _ in range(args.rounds)] if args.rounds > 1 else []
    for one in rounds or [{}]:
        for rate in args.rates.split(","):
            for config in args.configs.split(","):
                cells = run_config(rate, *CONFIGS[config], args)
                results.setdefault(rate, {}).setdefault(config, {}).update(cells)
                one.setdefault(rate, {})[config] = cells
                write(results, args.mb, args.reps, rounds or kept)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
