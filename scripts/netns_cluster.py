#!/usr/bin/env python3
"""A cluster on one machine: k hosts as network namespaces joined by shaped links.

Each host is a network namespace ``<tag>-h<i>`` with one interface ``eth0``
(address ``10.200.0.<i+1>``, name ``node<i>``), a veth pair whose other end is
a port of a bridge in a switch namespace ``<tag>-sw``. Nothing is added to the
machine's own namespace, so every byte between hosts crosses two veths and the
bridge, and the rig sends traffic only to addresses it created. ``tc tbf`` on
both ends of a host's veth caps what it sends and what it receives.

Processes run "on" host i through ``ip netns exec`` plus ``unshare --uts`` (so
``hostname`` says ``node<i>``, which MPI and JAX use to tell machines apart);
names resolve through ``/etc/netns/<ns>/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts``. MPICH's hydra launches its proxies through a
wrapper it calls like ssh (``HYDRA_LAUNCHER_EXEC``), Open MPI 5's PRRTE its
daemons through the same (``PRTE_MCA_plm_ssh_agent``; give it the hosts
with ``--hosts``: it cannot read hydra's ``host:slots`` hostfile); mpiexec itself runs on
node0, since only addresses inside the rig reach the proxies. Ranks on
different hosts get different hydra node ids, so MPICH uses no shared memory
between them.

Clean-up: :meth:`Cluster.close` (also at exit and from ``with``) deletes the
namespaces; :func:`sweep` deletes those of processes that no longer exist (a
killed test), matched by the ``jfc<pid>`` prefix.

As a script::

    sudo python scripts/netns_cluster.py --hosts 4 --rate 100mbit -- \\
        jaxfog run -np 4 --hostfile '{hostfile}' python train.py

runs the command on node0 with ``{hostfile}`` replaced (one host per line,
``node<i>:<slots>``), prints each host's interface byte counts, and tears the
cluster down. ``--sweep`` only removes leftovers.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

PREFIX = "jfc"
SUBNET = "10.200.0"
NETNS_ETC = Path("/etc/netns")
_TAG = re.compile(rf"^({PREFIX}(\d+)[a-z]+)-")
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _namespaces() -> list[str]:
    out = _ip("-j", "netns", "list", check=False).stdout.strip()
    return [entry["name"] for entry in json.loads(out or "[]")]


def permitted() -> str | None:
    """None where namespaces can be made here, else why not (for a skip)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the 'ip' and 'tc' commands (iproute2) are not installed"
    if shutil.which("unshare") is None:
        return "the 'unshare' command (util-linux) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"{PREFIX}{os.getpid()}probe-x"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Deletes the namespaces (and their /etc/netns files) of rigs whose process
    is gone; returns their names. Live rigs, other users' included, stay."""
    removed = []
    for name in _namespaces():
        match = _TAG.match(name)
        if match and not _alive(int(match.group(2))):
            _delete_namespace(name)
            removed.append(name)
    if NETNS_ETC.is_dir():
        for folder in NETNS_ETC.iterdir():
            match = _TAG.match(folder.name)
            if match and not _alive(int(match.group(2))):
                shutil.rmtree(folder, ignore_errors=True)
    return removed


def _delete_namespace(name: str) -> None:
    # Processes left in it would keep its interfaces (and their traffic) alive.
    for pid in _ip("netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", name, check=False)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


class Cluster:
    """``hosts`` namespaces on a bridge, each link capped at ``rate`` (a tc
    rate such as ``"100mbit"``; None: unshaped). Use as a context manager."""

    def __init__(self, hosts: int, *, rate: str | None = None):
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        self.size = hosts
        self.rate = rate
        self.tag = f"{PREFIX}{os.getpid()}{'abcdefghij'[next(_counter) % 10]}"
        self.switch = f"{self.tag}-sw"
        self.namespaces = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.names = [f"node{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.launcher = self._dir / "netns-ssh"
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # --- set-up and tear-down ------------------------------------------------

    def _build(self) -> None:
        sweep()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts_file)
            # Both ends made inside their namespaces: no name in the machine's own.
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                f"p{i}", "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            for dev in ("lo", "eth0"):
                _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            if self.rate:
                self.shape(i, self.rate)
        names = " ".join(f"{n}) ns={ns} ;;" for n, ns in zip(self.names, self.namespaces))
        # hydra calls it like ssh: [options] HOST COMMAND...; the command is one
        # shell line (ssh joins its words), run on HOST with HOST as hostname.
        self.launcher.write_text(f"""#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in {names} *) echo "netns-ssh: unknown host $host" >&2; exit 255 ;; esac
# A host made unreachable by never_join(): hang as ssh does while it connects
# (inside the host's namespace, so that close() ends it).
[ -e "{self._dir}/down.$host" ] && exec ip netns exec "$ns" sleep 86400
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
        self.launcher.chmod(0o755)

    def close(self) -> None:
        """Deletes the namespaces (killing what still runs in them); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for ns in (*self.namespaces, self.switch):
            _delete_namespace(ns)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- launching -----------------------------------------------------------

    def hostfile(self, slots: int = 1) -> str:
        """A hostfile naming every host with ``slots`` slots (written once per count)."""
        path = self._dir / f"hosts.{slots}"
        path.write_text("".join(f"{n}:{slots}\n" for n in self.names))
        return str(path)

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: this process's) plus what hydra needs to launch here,
        and MPI's transports kept on the network between hosts."""
        return {**(os.environ if env is None else env), "HYDRA_LAUNCHER": "ssh",
                "HYDRA_LAUNCHER_EXEC": str(self.launcher),
                # Open MPI 5's launcher (PRRTE) calls the same wrapper as its ssh.
                "PRTE_MCA_plm_ssh_agent": str(self.launcher),
                # UCX (MPICH's default netmod) sees one kernel and would use shared
                # memory between namespaces: only 16 KB of a 4 MB allreduce crossed.
                "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp"}

    def on_host(self, i: int, command: Sequence[str]) -> list[str]:
        """``command`` as run on host ``i`` (its network, its hostname)."""
        return ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.names[i], *command]

    def popen(self, command: Sequence[str], *, host: int = 0,
              env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Starts ``command`` (e.g. ``jaxfog run ... --hostfile F``) on ``host``."""
        return subprocess.Popen(self.on_host(host, command), env=self.environment(env),
                                **kwargs)

    # --- links and faults ----------------------------------------------------

    def shape(self, i: int, rate: str) -> None:
        """Caps host ``i``'s link at ``rate`` both ways (tbf on each veth end),
        replacing any cap it had (also while traffic flows: a trickle fault)."""
        for ns, dev in ((self.namespaces[i], "eth0"), (self.switch, f"p{i}")):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev",
                            dev, "root", "tbf", "rate", rate, "burst", "64kb", "latency",
                            "50ms"], check=True, capture_output=True, text=True)

    def link(self, i: int, up: bool) -> None:
        """Plugs or unplugs host ``i``'s cable at the switch: the host still sees
        its interface up, and what it sends is lost (as when a switch port dies)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "up" if up else "down")

    def never_join(self, i: int) -> None:
        """Host ``i`` never joins jobs launched from now on: the launcher's
        connection to it hangs (as ssh to a machine that is down), so its
        hydra proxy, and its ranks, never start."""
        (self._dir / f"down.{self.names[i]}").touch()

    def kill_host(self, i: int) -> list[int]:
        """SIGKILLs every process on host ``i`` (a crashed machine); returns the pids."""
        pids = [int(p) for p in _ip("netns", "pids", self.namespaces[i]).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def pids(self, i: int) -> list[int]:
        """The processes running on host ``i``."""
        return [int(p) for p in _ip("netns", "pids", self.namespaces[i]).stdout.split()]

    def counters(self, i: int) -> dict[str, int]:
        """Bytes host ``i``'s interface received and sent so far."""
        out = _ip("-j", "-s", "-n", self.namespaces[i], "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx": stats["rx"]["bytes"], "tx": stats["tx"]["bytes"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts")
    parser.add_argument("--rate", help="link rate, a tc rate such as 100mbit or 1gbit")
    parser.add_argument("--slots", type=int, default=1, help="slots per host in {hostfile}")
    parser.add_argument("--sweep", action="store_true", help="only remove leftovers")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="run on node0; {hostfile} is replaced")
    args = parser.parse_args(argv)
    if args.sweep:
        print("\n".join(sweep()) or "nothing left over")
        return 0
    why_not = permitted()
    if why_not:
        print(f"netns_cluster: {why_not}", file=sys.stderr)
        return 2
    command = [w for w in args.command if w != "--"]
    if not command:
        parser.error("no command")
    with Cluster(args.hosts, rate=args.rate) as cluster:
        hostfile = cluster.hostfile(args.slots)
        command = [w.replace("{hostfile}", hostfile) for w in command]
        print(f"netns_cluster: {args.hosts} hosts {', '.join(cluster.names)}, links "
              f"{args.rate or 'unshaped'}; on node0: {shlex.join(command)}", flush=True)
        status = cluster.popen(command).wait()
        for i, name in enumerate(cluster.names):
            print(f"netns_cluster: {name} eth0 {cluster.counters(i)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
