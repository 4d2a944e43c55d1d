"""Where bandwidth is the scarcest thing: DiLoCo's outer gradients compressed
(int8, 4 bits, SparseLoCo's 2-bit chunked top-k, Streaming DiLoCo's 4-bit
fragments) against gradient allreduce and the best gossip method, on 4 hosts
(network namespaces, one rank each) at 10 and 100 Mbit/s.

    sudo python benchmarks/bench_lowband.py [--rates 100mbit,10mbit] [--target 4.1]
    python benchmarks/bench_lowband.py --simulate   # 4 agents in one process:
                                                    # the curves, no times
    python benchmarks/bench_lowband.py --table      # the table again from the JSON

The model: examples/train_lm.py's byte-level transformer widened to 2.5 MB of
float32 parameters (width 128, 3 blocks), so that the exchange, not the
compute, sets a step's time on these links. Every method runs until the
averaged model's validation bits per byte is at or below ``--target`` at an
evaluation (every 10 steps), or ``--steps``. Writes
benchmarks/results/lowband_4hosts.{md,json,png}; about an hour on 2 cores,
most of it gradient allreduce at 10 Mbit/s. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import bench_cluster_training as cluster  # beside this script
from _examples import example, script

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "lowband_4hosts"

#: examples/train_lm.py's default size, widened (2.54 MB of float32 parameters).
WIDTH, DEPTH, STEPS = 128, 3, 300
#: DiLoCo's round length (inner steps per exchange).
EVERY = 30
METHODS = ("allreduce", "atc one-peer delay=1", f"diloco H={EVERY}",
           f"diloco H={EVERY} int8", f"diloco H={EVERY} 4-bit", f"sparseloco H={EVERY}",
           f"streaming diloco H={EVERY} P=4 4-bit")
#: Validation bits per byte: what every method reaches within the run (4 simulated
#: agents: allreduce at step 100, DiLoCo and its compressed forms at 170-180, their
#: plateau 3.99-4.06 where allreduce ends at 3.81; the table's text).
TARGET = 4.1


def size(args):
    lm = example("train_lm")
    return lm.SIZES["default"]._replace(width=WIDTH, depth=DEPTH, steps=args.steps)


def methods(n: int, names: list[str], steps: int):
    """train_lm.Method for each label, with the bytes an agent sends per round."""
    import optax

    import jaxfog.compress as C
    import jaxfog.optax as jfo
    import jaxfog.topology as T
    lm = example("train_lm")
    options = lm.make_parser().parse_args([])
    options.lr = lm.SIZES["default"].lr

    def inner():
        return lm.inner_optimizer(options, steps)

    def nesterov():  # DiLoCo's outer step (the paper's: 0.7, momentum 0.9)
        return optax.sgd(0.7, momentum=0.9, nesterov=True)

    ring = 2 * (n - 1) / n  # a ring allreduce sends 2 (n - 1) / n of the message

    def gathered(c):  # an allgather of payloads: n - 1 of them, one group
        return lambda params: (n - 1) * C.tree_bytes(c, params, C.balanced(params, 1))

    int8, four = C.quantize(8, chunk=256), C.quantize(4, chunk=64)
    sparse = C.chunked_top_k(2 / 64, chunk=64, bits=2)
    one_peer = T.one_peer_exponential(n)
    runs = {
        "allreduce": lm.Method("allreduce", jfo.gradient_allreduce(inner()), 1,
                               lambda params: ring * lm.nbytes(params)),
        "atc one-peer delay=1": lm.Method(
            "atc one-peer delay=1", jfo.atc(inner(), topology=one_peer, delay=1), 1,
            lambda params: lm.out_degree(one_peer, n) * lm.nbytes(params)),
        f"diloco H={EVERY}": lm.Method(
            f"diloco H={EVERY}", jfo.diloco(inner(), nesterov(), every=EVERY), EVERY,
            lambda params: ring * lm.nbytes(params)),
        f"diloco H={EVERY} int8": lm.Method(
            f"diloco H={EVERY} int8",
            jfo.diloco(inner(), nesterov(), every=EVERY, compressor=int8, groups=1), EVERY,
            gathered(int8)),
        f"diloco H={EVERY} 4-bit": lm.Method(
            f"diloco H={EVERY} 4-bit",
            jfo.diloco(inner(), nesterov(), every=EVERY, compressor=four, groups=1), EVERY,
            gathered(four)),
        # SparseLoCo: the decayed residual in place of the outer momentum.
        f"sparseloco H={EVERY}": lm.Method(
            f"sparseloco H={EVERY}",
            jfo.diloco(inner(), optax.sgd(1.0), every=EVERY, compressor=sparse, groups=1,
                       error_decay=0.95), EVERY, gathered(sparse)),
        # Every fragment once a round: a quarter of the payloads at a time.
        f"streaming diloco H={EVERY} P=4 4-bit": lm.Method(
            f"streaming diloco H={EVERY} P=4 4-bit",
            jfo.streaming_diloco(inner(), nesterov(), every=EVERY, fragments=4, delay=1,
                                 compressor=four), EVERY,
            lambda params: (n - 1) * C.tree_bytes(four, params)),
    }
    return [runs[name] for name in names]


def rank_main(args) -> None:
    """One rank (or the simulation): trains every method, writes its own file."""
    from flax import nnx

    import jaxfog as jf
    lm = example("train_lm")

    agents = jf.Agents(simulated=4) if args.simulate else jf.Agents()
    n, shape = agents.size, size(args)
    data = lm.corpus(n, shape, data_mb=shape.data_mb, iid=args.iid, seed=0)
    model = nnx.split(lm.make_model(shape, 0), nnx.Param)
    results = cluster.train_lm_runs(agents, methods(n, args.methods.split(","), shape.steps),
                                    data, shape, model, args, curves=args.simulate)
    if args.simulate:
        return
    Path(args.rank_out, f"rank{jf.rank()}.json").write_text(json.dumps(results))


def forward(args) -> list[str]:
    return ["--target", str(args.target), "--methods", args.methods, "--steps",
            str(args.steps), *(["--iid"] if args.iid else [])]


def summarise(per_rank: list[dict]) -> dict:
    """Per method: the slowest rank's time, the busiest rank's bytes."""
    rows = {}
    for label, first in per_rank[0].items():
        last = [r[label][-1] for r in per_rank]
        rows[label] = {
            "seconds": max(row["wall_time"] for row in last), "steps": first[-1]["step"],
            "final": first[-1]["val_bpb"],
            "interface_bytes": max(row.get("run_interface_bytes", 0.0) for row in last),
            "comm_stats_bytes": max(row.get("run_measured_bytes", 0.0) for row in last),
            "model_bytes_per_step": first[-1]["bytes_per_step"],
            "by_time": [(row["wall_time"], row["val_bpb"]) for row in first]}
    return rows


def table(results: dict, target: float, machine: str) -> str:
    lines = [f"# Time to {target:g} validation bits per byte over slow links, byte-level "
             "language model of 2.5 MB, 4 hosts x 1 rank", "",
             f"Machine: {machine} (the 4 ranks share them). Hosts: network namespaces on one "
             "Linux bridge (scripts/netns_cluster.py), each host's veth capped both ways by "
             "`tc tbf <rate> burst 64kb latency 50ms`; MPICH 5 over UCX TCP. Model: "
             f"examples/train_lm.py's transformer, width {WIDTH}, {DEPTH} blocks, 4 heads, "
             "context 64 (636,032 parameters, 2.54 MB of float32); the first 4 MB of the "
             "standard library's .py files, contiguous blocks of files per rank "
             "(heterogeneous); 4 windows per rank and step; AdamW peak 0.01, warmup-cosine "
             f"over {STEPS} steps, clipped at 1. DiLoCo: outer Nesterov 0.7, momentum 0.9, "
             f"H={EVERY}; int8: `quantize(8, chunk=256)`, 4-bit: `quantize(4, chunk=64)`, "
             "each with error feedback, the payloads in one allgather; SparseLoCo: "
             "`chunked_top_k(2/64, chunk=64, bits=2)`, error feedback decayed by 0.95 in "
             "place of the outer momentum (outer SGD, step 1); Streaming DiLoCo: 4 "
             "fragments, 4-bit, each waited one step after it started. Time: training "
             "steps only (the slowest rank), evaluations of the averaged model every 10 "
             "steps excluded, until the first evaluation at or below the target. MB / rank "
             "/ step: the busiest rank's eth0 over the run (TCP/IP headers included) and "
             "the model's count (what jf.comm_stats() counts). `bytes vs allreduce`: "
             "the bytes eth0 sent until the target, over allreduce's.", "",
             "| link | method | MB / rank / step (eth0) | MB / rank / step (model) "
             "| bytes vs allreduce | time to target | steps | final bpb "
             "| speed-up over allreduce |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for rate, rows in results.items():
        base = rows.get("allreduce")
        base_ok = base is not None and base["final"] <= target
        for label, row in rows.items():
            reached = row["final"] <= target
            wire = row["interface_bytes"] / row["steps"] / 1e6
            relative = (f"{row['interface_bytes'] / base['interface_bytes']:.4f}x"
                        if base_ok and reached and base["interface_bytes"] else "-")
            time = f"{row['seconds']:.1f} s" if reached else \
                f"not reached ({row['seconds']:.1f} s)"
            speed = f"{base['seconds'] / row['seconds']:.2f}x" if base_ok and reached \
                else "-"
            lines.append(f"| {rate} | {label} | {wire:.3f} | "
                         f"{row['model_bytes_per_step'] / 1e6:.4f} | {relative} | {time} | "
                         f"{row['steps']} | {row['final']:.3f} | {speed} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for axis, (rate, rows) in zip(axes[0], results.items()):
        for label, row in rows.items():
            t, value = zip(*row["by_time"])
            axis.plot(t, value, marker=".", label=label)
        axis.axhline(target, color="k", linewidth=0.8, linestyle="--")
        axis.set_xscale("log")
        axis.set_title(f"4 hosts, links {rate} (tc tbf)")
        axis.set_xlabel("training wall time (s, log scale)")
        axis.set_ylabel("validation bits per byte of the averaged model")
        axis.set_ylim(target - 0.5, target + 2.5)
        axis.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"Byte-level LM (2.5 MB), time to {target:g} bpb")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(results: dict, target: float) -> None:
    from jaxfog import _machine

    machine = _machine.cpu()
    OUT.with_suffix(".json").write_text(json.dumps(
        {"machine": machine, "hosts": 4, "target": target, "width": WIDTH, "depth": DEPTH,
         "steps": STEPS, "every": EVERY,
         "link": "tc tbf <rate> burst 64kb latency 50ms, both ways", "results": results},
        indent=1))
    text = table(results, target, machine)
    OUT.with_suffix(".md").write_text(text)
    print(text)
    plot(results, target, OUT.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,10mbit")
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--steps", type=int, default=STEPS, help="at most")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--iid", action="store_true",
                        help="each rank's files dealt in a random order (default: "
                             "contiguous blocks, heterogeneous)")
    parser.add_argument("--simulate", action="store_true",
                        help="4 simulated agents in this process; prints, writes nothing")
    parser.add_argument("--table", action="store_true",
                        help="write the table and plot again from the committed JSON")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank or args.simulate:
        rank_main(args)
        return
    if args.table:
        saved = json.loads(OUT.with_suffix(".json").read_text())
        write(saved["results"], saved["target"])
        return
    netns_cluster = script("netns_cluster")
    why_not = netns_cluster.permitted()
    if why_not:
        raise SystemExit(f"bench_lowband: {why_not}")
    results = {}
    for rate in args.rates.split(","):
        per_rank = cluster.run_on_cluster(rate, 4, Path(__file__).resolve(), forward(args))
        results[rate] = summarise(per_rank)
        write(results, args.target)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
