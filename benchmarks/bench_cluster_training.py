"""Time to a target where bandwidth is scarce: the digits MLP of
examples/train_digits.py (widened) or the byte-level language model of
examples/train_lm.py, 4 hosts (network namespaces, one rank each) on shaped
links, per method and link rate; the bytes each rank's interface sent beside
jf.comm_stats(), and the speed-up over gradient allreduce in time to target.

    sudo python benchmarks/bench_cluster_training.py [--rates 100mbit,1gbit]
    sudo python benchmarks/bench_cluster_training.py --model lm
    python benchmarks/bench_cluster_training.py --simulate   # 4 agents in one
                                                             # process: accuracy only

Digits: each run trains until the averaged model's test accuracy reaches
--target (percent) at an epoch's end (or --epochs); writes
benchmarks/results/cluster_training_4hosts.{md,json,png}, about 12 minutes on 2
cores. LM: until the averaged model's validation bits per byte is at or below
--target at an evaluation (every --eval-every steps, or --steps); writes
benchmarks/results/cluster_training_lm_4hosts.{md,json,png}. Bytes per step:
the whole run's (train_digits.Traffic: a nonblocking method's exchanges are
counted whichever window they ran in), evaluations excluded. Needs root
(namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from _examples import example, script  # beside this script

HERE = Path(__file__).resolve().parent

#: What every rank runs: one list of methods, trained one after the other.
METHODS = ("allreduce", "atc exponential", "awc exponential", "atc one-peer", "awc one-peer",
           "atc one-peer delay=1", "awc one-peer delay=1", "choco top_k(0.05) exponential",
           "diloco H=10", "diloco H=50", "streaming diloco H=10", "noloco H=10")
#: The language model's (examples/train_lm.py's labels, and the delayed one-peer atc).
LM_METHODS = ("allreduce", "atc exponential", "awc exponential", "atc one-peer",
              "awc one-peer", "atc one-peer delay=1", "awc one-peer delay=1",
              "choco top_k(0.05) exponential", "diloco H=10", "diloco H=50",
              "streaming diloco H=10 P=4 tau=1", "noloco H=10")
#: The language model's target (validation bits per byte): see the table's text.
LM_TARGET = 3.9


def make_methods(n: int, lr: float, total_steps: int, names=METHODS):
    """train_digits.Method for each name, with the bytes a rank should send per step."""
    import jax
    import optax

    import jaxfog.optax as jfo
    import jaxfog.topology as T
    td = example("train_digits")

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
    for every in (10, 50):
        runs[f"diloco H={every}"] = td.Method(f"diloco H={every}",
                                              jfo.diloco(inner(), every=every),
                                              dense(ring / every))
    runs["streaming diloco H=10"] = td.Method(
        "streaming diloco H=10",
        jfo.streaming_diloco(inner(), every=10, fragments=2, delay=1), dense(ring / 10))
    runs["noloco H=10"] = td.Method("noloco H=10", jfo.noloco(inner(), every=10),
                                    dense(1.0 / 10))
    return [runs[name] for name in names]


def lm_setup(args, n: int):
    """train_lm's corpus, model, size and methods (its command line's defaults
    but for the size's fields given here)."""
    from flax import nnx

    import jaxfog.optax as jfo
    import jaxfog.topology as T
    lm = example("train_lm")

    size = lm.SIZES[args.size]._replace(
        **{k: v for k, v in (("steps", args.steps), ("eval_every", args.eval_every))
           if v is not None})
    options = lm.make_parser().parse_args(["--size", args.size])
    options.lr = size.lr
    names = args.methods.split(",")
    runs = {m.label: m for m in lm.methods(
        n, ["allreduce", "atc", "choco", "diloco", "streaming-diloco", "noloco"], options,
        size.steps)}
    graphs = {"exponential": T.exponential(n), "one-peer": T.one_peer_exponential(n)}
    for label, make, graph, delay in (("awc exponential", jfo.awc, "exponential", 0),
                                      ("awc one-peer", jfo.awc, "one-peer", 0),
                                      ("atc one-peer delay=1", jfo.atc, "one-peer", 1),
                                      ("awc one-peer delay=1", jfo.awc, "one-peer", 1)):
        topology = graphs[graph]
        runs[label] = lm.Method(
            label, make(lm.inner_optimizer(options, size.steps), topology=topology,
                        delay=delay), 1,
            lambda params, topology=topology: lm.out_degree(topology, n) * lm.nbytes(params))
    data = lm.corpus(n, size, data_mb=size.data_mb, iid=False, seed=0)
    model = nnx.split(lm.make_model(size, 0), nnx.Param)
    return size, data, model, [runs[name] for name in names]


def rank_main(args) -> None:
    """One rank (or the simulation): trains every method, writes its own file."""
    if args.model == "lm":
        return lm_rank_main(args)
    import jaxfog as jf
    td = example("train_digits")

    agents = jf.Agents(simulated=4) if args.simulate else jf.Agents()
    n = agents.size
    shards, test = td.load(n)
    total_steps = args.epochs * (len(shards[0][1]) // args.batch)
    results = {}
    for method in make_methods(n, args.lr, total_steps, args.methods.split(",")):
        rows = td.train(agents, method, shards, test, epochs=args.epochs, batch=args.batch,
                        seed=0, progress=False, hidden=args.hidden, target=args.target,
                        wire_bytes=_wire_bytes(args))
        results[method.label] = rows
        if agents.is_root:
            last = rows[-1]
            print(f"{method.label}: {last['test_accuracy']:.2f}% after {last['epoch']} epochs,"
                  f" {last['wall_time']:.1f} s", flush=True)
    _write_rank(args, agents, results)


def _wire_bytes(args):
    """What this host's eth0 has sent (``ip netns exec`` mounts the namespace's
    own /sys); None for simulated agents."""
    counter = Path("/sys/class/net/eth0/statistics/tx_bytes")
    return None if args.simulate else (lambda: int(counter.read_text()))


def _write_rank(args, agents, results: dict) -> None:
    import jaxfog as jf

    rank = 0 if agents.simulated else jf.rank()
    Path(args.rank_out, f"rank{rank}.json").write_text(json.dumps(results))


def lm_rank_main(args) -> None:
    import jaxfog as jf

    agents = jf.Agents(simulated=4) if args.simulate else jf.Agents()
    size, data, model, runs = lm_setup(args, agents.size)
    _write_rank(args, agents, train_lm_runs(agents, runs, data, size, model, args))


def train_lm_runs(agents, runs, data, size, model, args, *, curves: bool = False) -> dict:
    """train_lm.train for each method (to ``args.target``), its rows with the
    model's bytes per step; the root prints each end (and, with ``curves``,
    each evaluation)."""
    lm = example("train_lm")
    results = {}
    for method in runs:
        rows = lm.train(agents, method, data, size, model, steps=size.steps, seed=0,
                        straggler=1.0, message_time=0.0, progress=False, dtype="float32",
                        target=args.target, wire_bytes=_wire_bytes(args))
        for row in rows:
            row["bytes_per_step"] = method.bytes_per_round(model[1]) / method.every
        results[method.label] = rows
        if agents.is_root:
            last = rows[-1]
            print(f"{method.label}: {last['val_bpb']:.3f} bpb after {last['step']} steps,"
                  f" {last['wall_time']:.1f} s", flush=True)
            if curves:
                print("  " + " ".join(f"{row['step']}:{row['val_bpb']:.3f}" for row in rows),
                      flush=True)
    return results


#: Per model: the metric, whether it must rise to the target, the steps key.
METRIC = {"digits": ("test_accuracy", True, "steps"), "lm": ("val_bpb", False, "step")}


def summarise(per_rank: list[dict], target: float, model: str = "digits") -> dict:
    """Per method: time to target (the slowest rank's), steps, bytes per rank per step."""
    key, rising, steps_key = METRIC[model]
    rows = {}
    for label, first in per_rank[0].items():
        final = first[-1][key]
        reached = final >= target if rising else final <= target
        wall = max(r[label][-1]["wall_time"] for r in per_rank)
        steps = first[-1][steps_key]

        def per_step(name):  # the whole run's, the busiest rank's
            values = [r[label][-1][name] / steps for r in per_rank if name in r[label][-1]]
            return max(values) if values else None

        rows[label] = {"reached": reached, "seconds": wall, "steps": steps, "final": final,
                       "interface_bytes_per_step": per_step("run_interface_bytes"),
                       "comm_stats_bytes_per_step": per_step("run_measured_bytes"),
                       "model_bytes_per_step": first[-1]["bytes_per_step"],
                       "by_time": [(row["wall_time"], row[key]) for row in first]}
    return rows


def run_cluster(rate: str, args, hosts: int) -> dict:
    per_rank = run_on_cluster(rate, hosts, Path(__file__).resolve(), forward(args))
    return summarise(per_rank, args.target, args.model)


def run_on_cluster(rate: str, hosts: int, bench: Path, arguments: list[str]) -> list[dict]:
    """``bench --rank --rank-out DIR *arguments`` on ``hosts`` namespaces, one
    rank each, links at ``rate``: each rank's JSON file."""
    import tempfile

    netns_cluster = script("netns_cluster")

    from jaxfog.testing import launch_environment, run_command

    with tempfile.TemporaryDirectory() as out, netns_cluster.Cluster(hosts, rate=rate) as cl:
        command = cl.on_host(0, [
            sys.executable, "-m", "jaxfog.cli", "run", "-np", str(hosts), "--hostfile",
            cl.hostfile(), "--", sys.executable, str(bench), "--rank", "--rank-out", out,
            *arguments])
        result = run_command(command, timeout=3600, env=cl.environment(launch_environment()))
        print(result.output, flush=True)
        if not result.ok:
            raise SystemExit(result.report())
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(hosts)]


def forward(args) -> list[str]:
    common = ["--model", args.model, "--target", str(args.target), "--methods", args.methods]
    if args.model == "lm":
        return [*common, "--size", args.size,
                *(["--steps", str(args.steps)] if args.steps else []),
                *(["--eval-every", str(args.eval_every)] if args.eval_every else [])]
    return [*common, "--epochs", str(args.epochs), "--batch", str(args.batch), "--lr",
            str(args.lr), "--hidden", str(args.hidden)]


def describe(args, hosts: int, model_mb: float | None) -> tuple[str, str, str]:
    """The table's title, the model's sentence and the final metric's column."""
    if args.model == "lm":
        import jax

        lm = example("train_lm")

        size, _, model, _ = lm_setup(args, hosts)
        count = sum(v.size for v in jax.tree.leaves(model[1]))
        model_mb = lm.nbytes(model[1]) / 1e6
        return (f"# Time to {args.target:g} validation bits per byte, byte-level language "
                f"model, {hosts} hosts x 1 rank",
                f"Model: examples/train_lm.py's transformer at its `{args.size}` size"
                + ("" if args.steps is None else f" but {size.steps} steps") +
                f" ({size.depth} blocks of width {size.width}, {size.heads} heads, context "
                f"{size.context}, {count:,} parameters, {model_mb:.2f} MB of float32), "
                f"the first {size.data_mb:g} MB of the standard library's .py files by path "
                f"(every {lm.VALIDATION_EVERY}th held out), contiguous blocks of files per "
                f"rank (heterogeneous), {size.batch} windows per rank and step, AdamW peak "
                f"{size.lr:g} warmup-cosine over {size.steps} steps, clipped at 1; CHOCO's "
                "gamma 0.1; DiLoCo's outer Nesterov step 0.7, momentum 0.9; Streaming "
                "DiLoCo 4 fragments, each waited one step after it started. The target: "
                "what gradient allreduce reaches within the run (chosen from an allreduce "
                f"run). Time: training steps only (the slowest rank; evaluation of the "
                f"averaged model on {size.eval_windows} held-out windows every "
                f"{size.eval_every} steps excluded) until the first evaluation at or below "
                "the target.", "final bpb")
    return (f"# Time to {args.target:g}% test accuracy, digits MLP, {hosts} hosts x 1 rank",
            "Model: examples/train_digits.py's MLP widened to "
            f"{args.hidden} hidden units ({model_mb:.2f} MB of float32 parameters), "
            f"digits split by label over the 4 ranks, minibatches of {args.batch}, SGD "
            f"with momentum 0.9, lr {args.lr:g} cosine-decayed over {args.epochs} epochs. "
            "Time: training steps only (the slowest rank; evaluation of the averaged model at "
            "each epoch's end excluded) until the first epoch end at or above the target.",
            "final acc")


def write(results: dict, args, hosts: int, model_mb: float | None) -> None:
    from jaxfog import _machine

    stem = f"cluster_training_{'lm_' if args.model == 'lm' else ''}{hosts}hosts"
    out = HERE / "results" / stem
    title, model_text, final = describe(args, hosts, model_mb)
    settings = ({"size": args.size, "steps": args.steps, "eval_every": args.eval_every}
                if args.model == "lm" else
                {"hidden": args.hidden, "batch": args.batch, "lr": args.lr,
                 "epochs": args.epochs})
    out.with_suffix(".json").write_text(json.dumps(
        {"machine": _machine.cpu(), "hosts": hosts, "model": args.model,
         "target": args.target, "link": "tc tbf <rate> burst 64kb latency 50ms, both ways",
         **settings, "results": results}, indent=1))
    lines = [title, "",
             f"Machine: {_machine.cpu()} (the 4 ranks share them). Hosts: network "
             "namespaces on one Linux bridge "
             "(scripts/netns_cluster.py), each host's veth capped both ways by `tc tbf "
             "<rate> burst 64kb latency 50ms`; MPICH 5 over UCX TCP, no shared memory "
             f"between hosts. {model_text} Bytes: what the busiest rank's eth0 sent per "
             "training step over the whole run (TCP/IP headers included), beside what "
             "jf.comm_stats() counted and the model's figure; evaluations' traffic "
             "excluded, a nonblocking method's exchanges counted whenever they ran.",
             "",
             f"| link | method | time to target | steps | {final} | MB / rank / step (eth0) "
             "| MB / step (comm_stats) | MB / step (model) | speed-up over allreduce |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for rate, rows in results.items():
        base = rows["allreduce"]["seconds"] if rows["allreduce"]["reached"] else None
        for label, row in rows.items():
            time = f"{row['seconds']:.1f} s" if row["reached"] else \
                f"not reached ({row['seconds']:.1f} s)"
            speed = f"{base / row['seconds']:.2f}x" if base and row["reached"] else "-"
            wire = row["interface_bytes_per_step"]
            stats = row["comm_stats_bytes_per_step"]
            value = f"{row['final']:.3f}" if args.model == "lm" else f"{row['final']:.1f}%"
            lines.append(f"| {rate} | {label} | {time} | {row['steps']} | {value} | "
                         f"{'-' if wire is None else f'{wire / 1e6:.3f}'} | "
                         f"{'-' if stats is None else f'{stats / 1e6:.3f}'} | "
                         f"{row['model_bytes_per_step'] / 1e6:.3f} | {speed} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out.with_suffix(".png"), args, hosts)


def plot(results: dict, path: Path, args, hosts: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = args.model == "lm"
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for axis, (rate, rows) in zip(axes[0], results.items()):
        for label, row in rows.items():
            t, value = zip(*row["by_time"])
            axis.plot(t, value, marker=".", label=label)
        axis.axhline(args.target, color="k", linewidth=0.8, linestyle="--")
        axis.set_title(f"{hosts} hosts, links {rate} (tc tbf)")
        axis.set_xlabel("training wall time (s)")
        if lm:
            axis.set_ylabel("validation bits per byte of the averaged model")
            axis.set_ylim(args.target - 0.5, args.target + 2.0)
        else:
            axis.set_ylabel("test accuracy of the averaged model (%)")
            axis.set_ylim(50, 100)
        axis.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"Language model ({args.size} size), time to {args.target:g} bpb" if lm else
                 f"Digits MLP ({args.hidden} hidden units), time to {args.target:g}%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("digits", "lm"), default="digits")
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--target", type=float, default=None,
                        help="digits: test accuracy, percent (95); lm: validation bits per "
                             f"byte ({LM_TARGET})")
    parser.add_argument("--methods", default=None)
    parser.add_argument("--hidden", type=int, default=512, help="digits")
    parser.add_argument("--epochs", type=int, default=30, help="digits: at most")
    parser.add_argument("--batch", type=int, default=32, help="digits")
    parser.add_argument("--lr", type=float, default=0.05, help="digits")
    parser.add_argument("--size", default="default", help="lm: train_lm's SIZES entry")
    parser.add_argument("--steps", type=int, default=None, help="lm: at most (the size's)")
    parser.add_argument("--eval-every", type=int, default=None, help="lm (the size's)")
    parser.add_argument("--simulate", action="store_true",
                        help="4 simulated agents in this process; prints, writes nothing")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lm = args.model == "lm"
    if args.target is None:
        args.target = LM_TARGET if lm else 95.0
    if args.methods is None:
        args.methods = ",".join(LM_METHODS if lm else METHODS)
    if args.rank or args.simulate:
        if args.simulate:
            import tempfile
            args.rank_out = tempfile.mkdtemp()
        rank_main(args)
        return
    netns_cluster = script("netns_cluster")

    why_not = netns_cluster.permitted()
    if why_not:
        raise SystemExit(f"bench_cluster_training: {why_not}")
    results = {rate: run_cluster(rate, args, args.hosts) for rate in args.rates.split(",")}
    model_mb = None if lm else 4 * (64 * args.hidden + args.hidden * args.hidden
                                    + 10 * args.hidden + 2 * args.hidden + 10) / 1e6
    write(results, args, args.hosts, model_mb)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
