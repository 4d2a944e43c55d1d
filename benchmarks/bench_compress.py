"""Compressed gossip on 4 MPI processes: accuracy, bytes and time per step, and MergeComp.

    python benchmarks/bench_compress.py            # both parts, ~5 minutes on 2 cores
    python benchmarks/bench_compress.py --quick    # a smoke run, nothing written

Part 1 runs ``examples/train_digits.py`` on 4 MPI processes (the Flax MLP on
digits split by label, the exponential graph): uncompressed gradient
allreduce and ATC against CHOCO-SGD with top-1%, scaled sign, 4-bit QSGD
(buckets of 128) and rank-4 PowerGossip-style low rank, every leaf merged
into one group (low rank: per leaf). It reports the final test accuracy of
the averaged model, the bytes each agent sends per step (the compressors'
figure and what ``jaxfog.comm_stats`` counted on the wire), the measured
time per step, and a modelled time per step on a 1 Gbit/s network: the
measured step (two ranks on one machine exchange through shared memory, so
it is almost all compute and compression) plus the bytes at 125 MB/s.

Part 2 times, on 2 MPI processes (one per core), one compiled round of
compress + exchange with the neighbour + decompress of a 100-leaf model (50
dense layers of 128 x 128 and their biases) for groupings of y = 1 ... 100
balanced groups, with a message per group (MergeComp's setting) and with all
groups in one fused message (what jaxfog's optimizers send), and runs
``jaxfog.compress.search`` (MergeComp's Algorithm 2) on the first.

Writes ``benchmarks/results/compress_4procs.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxfog import _machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
EXAMPLE = HERE.parent / "examples" / "train_digits.py"
N = 4
BANDWIDTH = 125e6  # bytes per second: 1 Gbit/s
COMPRESSORS = "top_k:0.01,sign,qsgd:7,low_rank:4"
GROUPINGS = (1, 2, 4, 8, 16, 32, 50, 100)


def mergecomp_worker(out: Path, repeats: int) -> None:
    """On every rank: the round trip's time per grouping, and the search."""
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.compress as C

    jf.init()
    jf.set_topology(jf.topology.exponential(jf.size()))
    rng = np.random.default_rng(0)
    tree = []
    for _ in range(50):
        tree += [jnp.asarray(rng.standard_normal((128, 128)), jnp.float32),
                 jnp.asarray(rng.standard_normal(128), jnp.float32)]
    rows = {}
    for compressor in (C.top_k(0.01), C.sign()):
        timer = C.exchange_timer(compressor, tree, repeats=repeats, fused=False)
        fused = C.exchange_timer(compressor, tree, repeats=repeats)
        times = {y: timer(C.balanced(tree, y)) for y in GROUPINGS}
        found = C.search(compressor, tree, timer)
        chosen = len(found.groups)
        rows[compressor.name] = {
            "times": times, "fused": {y: fused(C.balanced(tree, y)) for y in GROUPINGS},
            "searched_y": chosen, "searched_time": times.get(chosen) or timer(found.groups),
            "search_timings": found.timings,
            "bytes": {y: C.tree_bytes(compressor, tree, C.balanced(tree, y)) for y in GROUPINGS}}
    if jf.rank() == 0:
        (out / "mergecomp.json").write_text(json.dumps(rows))


def launch(args: list[str], n: int = N) -> None:
    from jaxfog.cli import _launcher as launcher

    command = launcher.build_command([sys.executable, *args], n)
    if subprocess.call(command):
        raise SystemExit(f"the MPI run failed: {' '.join(command)}")


def digits_table(results: dict) -> list[str]:
    base_atc = results["atc exponential"][-1]["test_accuracy"]
    dense = results["atc exponential"][-1]["bytes_per_step"]
    lines = ["| method | test acc | vs ATC | KB / step / agent (figure) | measured on the wire "
             "| fewer bytes than ATC | ms / step (measured) | ms / step at 1 Gbit/s (modelled) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, rows in results.items():
        last = rows[-1]
        step_s = last["wall_time"] / last["steps"]
        sent = last["bytes_per_step"]
        lines.append(
            f"| {label} | {last['test_accuracy']:.2f}% | {last['test_accuracy'] - base_atc:+.2f} "
            f"| {sent / 1e3:.2f} | {last.get('measured_bytes_per_step', float('nan')) / 1e3:.2f} "
            f"| {dense / sent:.1f}x | {1e3 * step_s:.2f} "
            f"| {1e3 * (step_s + sent / BANDWIDTH):.2f} |")
    return lines


def mergecomp_table(rows: dict) -> list[str]:
    lines = []
    for name, row in rows.items():
        times = {int(y): t for y, t in row["times"].items()}
        per_leaf, single = times[100], times[1]
        searched = row["searched_time"]
        fused = {int(y): t for y, t in row["fused"].items()}
        timed = ", ".join(f"y={y}: {1e3 * t:.2f} ms" for y, t in row["search_timings"])
        lines += [f"**{name}** on 100 leaves, 2 MPI processes (826,000 float32 entries): "
                  f"with one message per group, MergeComp's search chose "
                  f"y = {row['searched_y']} (timed {timed}): "
                  f"{per_leaf / searched:.1f}x faster than per-leaf (y = 100), "
                  f"{single / searched:.2f}x the speed of one group.", "",
                  "| y (groups) | ms per round, a message per group (MergeComp's setting) "
                  "| vs per-leaf | ms per round, one fused message (jaxfog's optimizers) "
                  "| payload bytes (all groups) |", "|---:|---:|---:|---:|---:|"]
        for y in sorted(times):
            lines.append(f"| {y} | {1e3 * times[y]:.2f} | {per_leaf / times[y]:.1f}x "
                         f"| {1e3 * fused[y]:.2f} | {row['bytes'][str(y)]} |")
        lines.append("")
    return lines


def plot(results: dict, rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, merge) = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, epochs in results.items():
        sent = epochs[-1]["bytes_per_step"]
        acc.plot([e["steps"] * sent / 1e6 for e in epochs], [e["test_accuracy"] for e in epochs],
                 label=f"{label} ({sent / 1e3:.1f} KB/step)")
    acc.set_xscale("log")
    acc.set_xlabel("MB sent per agent (log)")
    acc.set_ylabel("test accuracy of the averaged model (%)")
    acc.set_ylim(80, 100)
    acc.grid(True, alpha=0.3)
    acc.legend(fontsize=7)
    acc.set_title("digits MLP, 4 MPI processes: accuracy against bytes sent")
    for name, row in rows.items():
        for key, style in (("times", "-o"), ("fused", "--x")):
            times = {int(y): t for y, t in row[key].items()}
            ys = sorted(times)
            merge.plot(ys, [1e3 * times[y] for y in ys], style,
                       label=f"{name}, {'a message per group' if key == 'times' else 'fused'}")
    merge.set_xscale("log")
    merge.set_xlabel("groups y (1 = all leaves merged, 100 = per leaf)")
    merge.set_ylabel("ms per compress + exchange + decompress")
    merge.grid(True, alpha=0.3)
    merge.legend()
    merge.set_title("MergeComp: 100-leaf model, 2 MPI processes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker == "mergecomp":
        return mergecomp_worker(Path(args.out), args.repeats)
    epochs = 2 if args.quick else args.epochs
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        launch([str(EXAMPLE), "--methods", "allreduce,atc", "--graphs", "exponential",
                "--compress", COMPRESSORS, "--gamma", "0.05", "--groups", "1", "--batch", "8",
                "--epochs", str(epochs), "--quiet", "--no-progress", "--out", directory])
        print(f"(digits runs: {time.perf_counter() - start:.0f} s)", flush=True)
        results = json.loads((Path(directory) / "train_digits.json").read_text())["results"]
        # Two processes, one per core: with four, the ranks' contention for
        # the two cores would swamp the differences between groupings.
        launch([str(Path(__file__).resolve()), "--worker", "mergecomp", "--out", directory,
                "--repeats", str(2 if args.quick else args.repeats)], n=2)
        rows = json.loads((Path(directory) / "mergecomp.json").read_text())
    import jax

    digits = digits_table(results)
    merged = mergecomp_table(rows)
    print("\n".join(digits + [""] + merged))
    if args.quick:
        return None
    header = ["# Compressed gossip: 4 MPI processes", "",
              f"Machine: {_machine.cpu()}; jax {jax.__version__}. "
              "Produced by `python benchmarks/bench_compress.py`.", "",
              "## CHOCO-SGD on the digits MLP", "",
              f"`examples/train_digits.py` on 4 MPI processes, the exponential graph, "
              f"{epochs} epochs of minibatches of 8 "
              f"({results['atc exponential'][-1]['steps']} steps), SGD with momentum 0.9 and "
              "a cosine decay from 0.05; CHOCO with gamma = 0.05 and all leaves merged into "
              "one group (low rank: per leaf, biases uncompressed). 'figure': the "
              "compressors' payload bytes times the out-degree; 'measured': what "
              "`jaxfog.comm_stats` counted leaving rank 0 during the training steps "
              "(allreduce: a ring's 2 (n-1)/n of the data). The modelled column adds the "
              "bytes at 1 Gbit/s to the measured step: on one machine the exchange goes "
              "through shared memory, so the measured step is almost all compute and "
              "compression.", ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compress_4procs.md").write_text(
        "\n".join(header + digits + ["", "## MergeComp on a 100-leaf model", "",
                                     "One compiled round per grouping, the median of "
                                     f"{args.repeats} (mean over the ranks); balanced "
                                     "contiguous groups.", ""] + merged) + "\n")
    (RESULTS / "compress_4procs.json").write_text(json.dumps(
        {"digits": results, "mergecomp": rows, "machine": _machine.cpu()}))
    plot(results, rows, RESULTS / "compress_4procs.png")
    print(f"wrote {RESULTS}/compress_4procs.{{md,json,png}}")


if __name__ == "__main__":
    main()
