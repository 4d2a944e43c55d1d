"""Exchange time where bandwidth is scarce: 4 hosts (network namespaces, one
rank each) on shaped links, per method and link rate; the speed-up over
allreduce and the bytes each rank sent, counted on its interface.

    sudo python benchmarks/bench_cluster.py [--rates 100mbit,1gbit] [--mb 4]

Writes benchmarks/results/cluster_4hosts.{md,json}. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _examples import script  # beside this script
from jaxfog import _machine
from jaxfog.testing import launch_environment, run_command

HERE = Path(__file__).resolve().parent
netns_cluster = script("netns_cluster")

METHODS = ("allreduce", "exponential", "one-peer", "one-peer-nonblocking")


def measure(rate: str, elements: int, steps: int, hosts: int) -> dict:
    rows = {}
    with netns_cluster.Cluster(hosts, rate=rate) as cluster:
        for method in METHODS:
            before = [cluster.counters(i)["tx"] for i in range(hosts)]
            command = cluster.on_host(0, [
                sys.executable, "-m", "jaxfog.cli", "run", "-np", str(hosts), "--hostfile",
                cluster.hostfile(), "--", sys.executable, str(HERE / "_cluster_exchange.py"),
                str(elements), str(steps), method])
            result = run_command(command, timeout=600,
                                 env=cluster.environment(launch_environment()))
            if not result.ok:
                raise SystemExit(result.report())
            line = next(s for s in result.output.splitlines() if s.startswith("EXCHANGE "))
            sent = [cluster.counters(i)["tx"] - b for i, b in enumerate(before)]
            rows[method] = {"seconds": json.loads(line.split(" ", 1)[1])["seconds"][method],
                            # the warm-up exchange and the timed ones
                            "bytes_per_rank_per_step": max(sent) / (steps + 1)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--mb", type=float, default=4.0, help="model size in MB (float32)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hosts", type=int, default=4)
    args = parser.parse_args()
    why_not = netns_cluster.permitted()
    if why_not:
        raise SystemExit(f"bench_cluster: {why_not}")
    elements = int(args.mb * (1 << 20) / 4)
    results = {rate: measure(rate, elements, args.steps, args.hosts)
               for rate in args.rates.split(",")}
    out = HERE / "results" / f"cluster_{args.hosts}hosts"
    out.with_suffix(".json").write_text(json.dumps(
        {"machine": _machine.cpu(), "hosts": args.hosts, "elements": elements,
         "steps": args.steps, "results": results}, indent=1))
    lines = [f"# Exchange of a {args.mb:g} MB model, {args.hosts} hosts x 1 rank",
             "",
             f"Machine: {_machine.cpu()}. Hosts: network namespaces on one Linux bridge "
             "(scripts/netns_cluster.py), each host's veth capped both ways by `tc tbf "
             "<rate> burst 64kb latency 50ms`; MPICH 5 over UCX TCP (`UCX_TLS=tcp,self`), "
             f"no shared memory between hosts. Median of {args.steps} steps, the slowest "
             "rank's time each step; bytes are what the busiest rank's eth0 sent per step "
             "(TCP/IP headers included).",
             "",
             "| link | method | s / step | MB sent / rank / step | speed-up over allreduce |",
             "|---|---|---|---|---|"]
    for rate, rows in results.items():
        base = rows["allreduce"]["seconds"]
        for method, row in rows.items():
            lines.append(f"| {rate} | {method} | {row['seconds']:.3f} | "
                         f"{row['bytes_per_rank_per_step'] / 1e6:.2f} | "
                         f"{base / row['seconds']:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
