"""Time to a target test accuracy where bandwidth is scarce: the digits MLP of
examples/train_digits.py (widened), 4 hosts (network namespaces, one rank
each) on shaped links, per method and link rate; the bytes each rank's
interface sent beside jf.comm_stats(), and the speed-up over gradient
allreduce in time to target.

    sudo python benchmarks/bench_cluster_training.py [--rates 100mbit,1gbit]
    python benchmarks/bench_cluster_training.py --simulate   # 4 agents in one
                                                             # process: accuracy only

Each run trains until the averaged model's test accuracy reaches --target at
an epoch's end (or --epochs). Writes benchmarks/results/cluster_training_4hosts
.{md,json,png}. Needs root (namespaces). About 12 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

#: What every rank runs: one list of methods, trained one after the other.
METHODS = ("allreduce", "atc exponential", "awc exponential", "atc one-peer", "awc one-peer",
           "atc one-peer delay=1", "awc one-peer delay=1", "choco top_k(0.05) exponential",
           "diloco H=10", "streaming diloco H=10", "noloco H=10")


def make_methods(n: int, lr: float, total_steps: int, names=METHODS):
    """train_digits.Method for each name, with the bytes a rank should send per step."""
    import jax
    import optax

    import jaxfog.optax as jfo
    import jaxfog.topology as T
    import train_digits as td

    def inner():  # train_digits' inner optimizer
        return optax.sgd(optax.cosine_decay_schedule(lr, total_steps), momentum=0.9)

    def dense(factor):
        return lambda params: factor * sum(v.nbytes for v in jax.tree.leaves(params))

    ring = 2 * (n - 1) / n  # a ring allreduce sends 2 (n - 1) / n of the message
    one_peer = T.one_peer_exponential(n)
    runs = {m.label: m for m in td.methods(n, ["allreduce", "atc", "awc"],
                                           ["exponential", "one-peer"], lr, 0.9, total_steps)}
    choco, = td.methods(n, [], ["exponential"], lr, 0.9, total_steps, ["top_k:0.05"], 0.5)
    runs["choco top_k(0.05) exponential"] = choco._replace(label="choco top_k(0.05) exponential")
    for name, make in (("atc", jfo.atc), ("awc", jfo.awc)):
        label = f"{name} one-peer delay=1"
        runs[label] = td.Method(label, make(inner(), topology=one_peer, delay=1), dense(1.0))
    runs["diloco H=10"] = td.Method("diloco H=10", jfo.diloco(inner(), every=10),
                                    dense(ring / 10))
    runs["streaming diloco H=10"] = td.Method(
        "streaming diloco H=10",
        jfo.streaming_diloco(inner(), every=10, fragments=2, delay=1), dense(ring / 10))
    runs["noloco H=10"] = td.Method("noloco H=10", jfo.noloco(inner(), every=10),
                                    dense(1.0 / 10))
    return [runs[name] for name in names]


def rank_main(args) -> None:
    """One rank (or the simulation): trains every method, writes its own file."""
    import jaxfog as jf
    import train_digits as td

    agents = jf.Agents(simulated=4) if args.simulate else jf.Agents()
    n = agents.size
    shards, test = td.load(n)
    total_steps = args.epochs * (len(shards[0][1]) // args.batch)
    # ip netns exec mounts the namespace's own /sys: this is the host's eth0.
    counter = Path("/sys/class/net/eth0/statistics/tx_bytes")
    wire = None if args.simulate else (lambda: int(counter.read_text()))
    results = {}
    for method in make_methods(n, args.lr, total_steps, args.methods.split(",")):
        rows = td.train(agents, method, shards, test, epochs=args.epochs, batch=args.batch,
                        seed=0, progress=False, hidden=args.hidden, target=args.target,
                        wire_bytes=wire)
        results[method.label] = rows
        if agents.is_root:
            last = rows[-1]
            print(f"{method.label}: {last['test_accuracy']:.2f}% after {last['epoch']} epochs,"
                  f" {last['wall_time']:.1f} s", flush=True)
    rank = 0 if args.simulate else jf.rank()
    Path(args.rank_out, f"rank{rank}.json").write_text(json.dumps(results))


def summarise(per_rank: list[dict], target: float) -> dict:
    """Per method: time to target (the slowest rank's), steps, bytes per rank per step."""
    rows = {}
    for label, first in per_rank[0].items():
        reached = first[-1]["test_accuracy"] >= target
        epochs = len(first)
        wall = max(r[label][-1]["wall_time"] for r in per_rank)
        steps = first[-1]["steps"]

        def per_step(key):
            values = [sum(row[key] for row in r[label]) / epochs
                      for r in per_rank if key in r[label][0]]
            return max(values) if values else None

        rows[label] = {"reached": reached, "seconds": wall, "steps": steps,
                       "accuracy": first[-1]["test_accuracy"],
                       "interface_bytes_per_step": per_step("interface_bytes_per_step"),
                       "comm_stats_bytes_per_step": per_step("measured_bytes_per_step"),
                       "model_bytes_per_step": first[0]["bytes_per_step"],
                       "accuracy_by_time": [(row["wall_time"], row["test_accuracy"])
                                            for row in first]}
    return rows


def run_cluster(rate: str, args, hosts: int) -> dict:
    import tempfile

    import netns_cluster

    from jaxfog.testing import launch_environment, run_command

    with tempfile.TemporaryDirectory() as out, netns_cluster.Cluster(hosts, rate=rate) as cl:
        command = cl.on_host(0, [
            sys.executable, "-m", "jaxfog.cli", "run", "-np", str(hosts), "--hostfile",
            cl.hostfile(), "--", sys.executable, str(Path(__file__).resolve()), "--rank",
            "--rank-out", out, *forward(args)])
        result = run_command(command, timeout=1800, env=cl.environment(launch_environment()))
        print(result.output, flush=True)
        if not result.ok:
            raise SystemExit(result.report())
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(hosts)]
    return summarise(per_rank, args.target)


def forward(args) -> list[str]:
    return ["--epochs", str(args.epochs), "--batch", str(args.batch), "--lr", str(args.lr),
            "--hidden", str(args.hidden), "--target", str(args.target),
            "--methods", args.methods]


def write(results: dict, args, hosts: int, model_mb: float) -> None:
    import _machine

    out = HERE / "results" / f"cluster_training_{hosts}hosts"
    out.with_suffix(".json").write_text(json.dumps(
        {"machine": _machine.cpu(), "hosts": hosts, "hidden": args.hidden,
         "target": args.target, "batch": args.batch, "lr": args.lr,
         "results": results}, indent=1))
    lines = [f"# Time to {args.target:g}% test accuracy, digits MLP, {hosts} hosts x 1 rank",
             "",
             f"Machine: {_machine.cpu()}. Hosts: network namespaces on one Linux bridge "
             "(scripts/netns_cluster.py), each host's veth capped both ways by `tc tbf "
             "<rate> burst 64kb latency 50ms`; MPICH 5 over UCX TCP, no shared memory "
             "between hosts. Model: examples/train_digits.py's MLP widened to "
             f"{args.hidden} hidden units ({model_mb:.2f} MB of float32 parameters), "
             f"digits split by label over the 4 ranks, minibatches of {args.batch}, SGD "
             f"with momentum 0.9, lr {args.lr:g} cosine-decayed over {args.epochs} epochs. "
             "Time: training steps only (the slowest rank; evaluation of the averaged model at "
             "each epoch's end excluded) until the first epoch end at or above the target. "
             "Bytes: what the busiest rank's eth0 sent per training step (TCP/IP headers "
             "included), beside what jf.comm_stats() counted.",
             "",
             "| link | method | time to target | steps | final acc | MB / rank / step (eth0) "
             "| MB / step (comm_stats) | speed-up over allreduce |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for rate, rows in results.items():
        base = rows["allreduce"]["seconds"] if rows["allreduce"]["reached"] else None
        for label, row in rows.items():
            time = f"{row['seconds']:.1f} s" if row["reached"] else \
                f"not reached ({row['seconds']:.1f} s)"
            speed = f"{base / row['seconds']:.2f}x" if base and row["reached"] else "-"
            wire = row["interface_bytes_per_step"]
            stats = row["comm_stats_bytes_per_step"]
            lines.append(f"| {rate} | {label} | {time} | {row['steps']} | "
                         f"{row['accuracy']:.1f}% | "
                         f"{'-' if wire is None else f'{wire / 1e6:.3f}'} | "
                         f"{'-' if stats is None else f'{stats / 1e6:.3f}'} | {speed} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out.with_suffix(".png"), args, hosts)


def plot(results: dict, path: Path, args, hosts: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for axis, (rate, rows) in zip(axes[0], results.items()):
        for label, row in rows.items():
            t, acc = zip(*row["accuracy_by_time"])
            axis.plot(t, acc, marker=".", label=label)
        axis.axhline(args.target, color="k", linewidth=0.8, linestyle="--")
        axis.set_title(f"{hosts} hosts, links {rate} (tc tbf)")
        axis.set_xlabel("training wall time (s)")
        axis.set_ylabel("test accuracy of the averaged model (%)")
        axis.set_ylim(50, 100)
        axis.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"Digits MLP ({args.hidden} hidden units), time to {args.target:g}%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--target", type=float, default=95.0, help="test accuracy, percent")
    parser.add_argument("--epochs", type=int, default=30, help="at most")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--simulate", action="store_true",
                        help="4 simulated agents in this process; prints, writes nothing")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank or args.simulate:
        if args.simulate:
            import tempfile
            args.rank_out = tempfile.mkdtemp()
        rank_main(args)
        return
    import netns_cluster

    why_not = netns_cluster.permitted()
    if why_not:
        raise SystemExit(f"bench_cluster_training: {why_not}")
    results = {rate: run_cluster(rate, args, args.hosts) for rate in args.rates.split(",")}
    model_mb = 4 * (64 * args.hidden + args.hidden * args.hidden + 10 * args.hidden
                    + 2 * args.hidden + 10) / 1e6
    write(results, args, args.hosts, model_mb)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
