"""Low-communication training on 16 simulated agents and 4 MPI processes: accuracy against bytes.

    python benchmarks/bench_local_sgd.py            # both parts, ~8 minutes on 2 cores
    python benchmarks/bench_local_sgd.py --part sim # or --part mpi
    python benchmarks/bench_local_sgd.py --quick    # a smoke run, nothing written

The digits MLP of ``examples/train_digits.py`` (two hidden layers of 128,
scikit-learn's digits sorted by label and dealt to the agents, so that each of
16 agents sees one or two digits: strongly heterogeneous data), every agent
starting from the same model, inner optimizer SGD with momentum 0.9 and a
cosine-decayed step size, minibatches of 8. Compared: gradient allreduce at
every step, ATC on the one-peer exponential schedule (one neighbour per step),
local SGD (H = 10), DiLoCo (H = 10 and 50, the paper's outer Nesterov step;
H = 10 also with the pseudo-gradients compressed with error feedback, top-1%
and scaled sign, and with neighbour averaging on the one-peer schedule),
Streaming DiLoCo (H = 10: P = 2 fragments with tau = 1 overlapped step and
alpha = 0.5 or 0, and P = 4 with tau = 2; the default fragments, contiguous
runs of leaves of about equal size) and NoLoCo (H = 10, one random peer per
round).

Bytes per agent are modelled, not measured (simulated agents send nothing):
a ring allreduce sends ``2 (n - 1) / n`` times the message, an allgather
``n - 1`` payloads, a neighbour averaging one message per out-neighbour; the
methods with rounds send at one step in ``H``. The accuracy is the test
accuracy of the agents' averaged model. The modelled wall time of one agent
is its compute, measured as the simulation's training time (compilation
excluded) divided by the 16 agents it runs one after the other, plus its
bytes at 1 Gbit/s or 100 Mbit/s; latency and any overlap are left out.
The peak is modelled the same way: the bytes of the busiest step, all of a
round's at its sync for the methods with rounds, and for Streaming DiLoCo its
largest fragment's (each step starts one fragment's exchange at most; the
fragments are whole leaves, so the MLP's largest kernel, 128 x 128 of its
26,122 parameters, bounds the peak at 63% of DiLoCo's).

The MPI part runs the same methods on 4 MPI processes (``jaxfog run -np 4``;
each agent holds a quarter of the digits, two or three labels) for fewer
epochs, and reports next to the modelled bytes what ``jaxfog.comm_stats``
counted leaving rank 0 during the training steps: on MPI processes only the
steps that end a round communicate.

Writes ``benchmarks/results/local_sgd_16agents.{md,json,png}`` and
``benchmarks/results/local_sgd_4procs.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _examples import example  # beside this script
from jaxfog import _machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
N = 16


def methods(n: int, lr: float, total_steps: int):
    """(method, peak): the runs, each with the bytes one agent sends at its
    busiest step (a function of one agent's parameters, as the method's
    average bytes per step are)."""
    import jax
    import optax

    import jaxfog.compress as C
    import jaxfog.optax as jfo
    import jaxfog.topology as T
    Method = example("train_digits").Method

    def inner():
        return optax.sgd(optax.cosine_decay_schedule(lr, total_steps), momentum=0.9)

    def dense(factor):
        return lambda params: factor * sum(v.nbytes for v in jax.tree.leaves(params))

    def once_in(h, per_step):  # all of a round's bytes at its last step
        return lambda params: h * per_step(params)

    def largest_fragment(fragments):  # streaming_diloco's default fragments
        def peak(params):
            leaves = jax.tree.leaves(params)
            return ring * max(sum(v.nbytes for v in leaves[a:b])
                              for a, b in C.balanced(params, fragments))
        return peak

    ring = 2 * (n - 1) / n  # a ring allreduce sends 2 (n - 1) / n of the message
    one_peer = T.one_peer_exponential(n)
    top = C.top_k(0.01)
    yield Method("allreduce every step", jfo.gradient_allreduce(inner()), dense(ring)), dense(ring)
    yield Method("atc one-peer", jfo.atc(inner(), topology=one_peer), dense(1.0)), dense(1.0)
    yield (Method("local SGD H=10", jfo.local_sgd(inner(), every=10), dense(ring / 10)),
           dense(ring))
    yield Method("DiLoCo H=10", jfo.diloco(inner(), every=10), dense(ring / 10)), dense(ring)
    # Streaming DiLoCo, H = 10: the fragments' syncs spread over the round, each
    # exchange finished tau steps later, merged with alpha.
    for fragments, delay, alpha in ((2, 1, 0.5), (2, 1, 0.0), (4, 2, 0.5)):
        yield (Method(f"Streaming DiLoCo H=10 P={fragments} tau={delay} alpha={alpha:g}",
                      jfo.streaming_diloco(inner(), every=10, fragments=fragments,
                                           delay=delay, alpha=alpha),
                      dense(ring / 10)), largest_fragment(fragments))
    yield Method("DiLoCo H=50", jfo.diloco(inner(), every=50), dense(ring / 50)), dense(ring)
    topk = lambda params: (n - 1) * C.tree_bytes(top, params, C.balanced(params, 1)) / 10  # noqa: E731
    yield (Method("DiLoCo H=10 top-1% EF",
                  jfo.diloco(inner(), every=10, compressor=top, groups=1), topk),
           once_in(10, topk))
    sign = C.sign()
    signs = lambda params: (n - 1) * C.tree_bytes(sign, params, C.balanced(params, 1)) / 10  # noqa: E731
    yield (Method("DiLoCo H=10 sign EF",
                  jfo.diloco(inner(), every=10, compressor=sign, groups=1), signs),
           once_in(10, signs))
    yield (Method("DiLoCo H=10 one-peer", jfo.diloco(inner(), every=10, communication="neighbor",
                                                     topology=one_peer),
                  dense(2.0 / 10)),  # anchors and pseudo-gradients, one peer
           dense(2.0))
    yield Method("NoLoCo H=10", jfo.noloco(inner(), every=10), dense(1.0 / 10)), dense(1.0)


def run_methods(agents, epochs: int, batch: int, lr: float, echo: bool
                ) -> tuple[dict, dict, dict, str]:
    import jax
    import numpy as np

    td = example("train_digits")
    MLP, load, train = td.MLP, td.load, td.train

    n = agents.size
    shards, test = load(n)
    total = epochs * (len(shards[0][1]) // batch)
    kind = "simulated agents" if agents.simulated else "MPI processes"
    where = f"{n} {kind}, {total} steps of minibatch {batch}"
    one = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(
        lambda: MLP().init(jax.random.key(0), shards[0][0][:1])))  # one agent's parameters
    results, times, peaks = {}, {}, {}
    for method, peak in methods(n, lr, total):
        start = time.perf_counter()
        results[method.label] = train(agents, method, shards, test, epochs=epochs,
                                      batch=batch, seed=0, progress=False)
        times[method.label] = time.perf_counter() - start
        peaks[method.label] = peak(one)
        last = results[method.label][-1]
        if echo:
            print(f"{method.label:<24} {last['test_accuracy']:6.2f}%  "
                  f"{total * last['bytes_per_step'] / 1e6:9.2f} MB  "
                  f"peak {peaks[method.label] / 1e3:7.1f} KB  "
                  f"{times[method.label]:.0f} s", flush=True)
    return results, times, peaks, where


def mpi_worker(out: Path, epochs: int, batch: int, lr: float) -> None:
    import jaxfog as jf

    agents = jf.Agents()
    results, times, peaks, where = run_methods(agents, epochs, batch, lr, agents.is_root)
    if agents.is_root:
        out.write_text(json.dumps({"where": where, "results": results, "seconds": times,
                                   "peak_bytes_per_step": peaks}))


def mpi_part(epochs: int, batch: int, lr: float, quick: bool) -> None:
    from jaxfog.cli import _launcher as launcher

    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "mpi.json"
        command = launcher.build_command(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(out),
             "--epochs", str(epochs), "--batch", str(batch), "--lr", str(lr)], 4)
        if subprocess.call(command):
            raise SystemExit(f"the MPI run failed: {' '.join(command)}")
        data = json.loads(out.read_text())
    if quick:
        return
    results, where = data["results"], data["where"]
    base = results["allreduce every step"][-1]
    lines = [f"# Low-communication training: {where}", "",
             f"Machine: {_machine.cpu()}. `python benchmarks/bench_local_sgd.py --part mpi`. "
             "'modelled': the formula of the script's docstring; 'measured': what "
             "`jaxfog.comm_stats` counted leaving rank 0 during the training steps "
             "(MPI's allreduce algorithm, not a ring, decides its bytes).", "",
             "| method | test acc | vs allreduce | KB / step / agent, modelled | measured "
             "| fewer bytes (measured) | peak KB / step / agent, modelled |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    full = base["measured_bytes_per_step"]
    for label, rows in results.items():
        last = rows[-1]
        measured = last["measured_bytes_per_step"]
        lines.append(f"| {label} | {last['test_accuracy']:.2f}% "
                     f"| {last['test_accuracy'] - base['test_accuracy']:+.2f} "
                     f"| {last['bytes_per_step'] / 1e3:.2f} | {measured / 1e3:.2f} "
                     f"| {full / measured:.0f}x | {data['peak_bytes_per_step'][label] / 1e3:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "local_sgd_4procs.md").write_text("\n".join(lines) + "\n")
    plot(results, RESULTS / "local_sgd_4procs.png", where)
    (RESULTS / "local_sgd_4procs.json").write_text(json.dumps({**data,
                                                               "machine": _machine.cpu()}))
    print("\n".join(lines))


def plot(results: dict, path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    for label, rows in results.items():
        sent = [r["steps"] * r["bytes_per_step"] / 1e6 for r in rows]
        axis.plot(sent, [r["test_accuracy"] for r in rows], label=label, marker=".", ms=3)
    axis.set_xscale("log")
    axis.set_xlabel("MB sent per agent (modelled)")
    axis.set_ylabel("test accuracy of the averaged model (%)")
    axis.set_ylim(0, 100)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(f"Digits MLP, {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--mpi-epochs", type=int, default=30,
                        help="epochs of the MPI part (4 agents: 42 steps per epoch)")
    parser.add_argument("--part", choices=("sim", "mpi", "both"), default="both")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        return mpi_worker(Path(args.worker), args.epochs, args.batch, args.lr)
    if args.quick:
        args.epochs = args.mpi_epochs = 2
    if args.part in ("mpi", "both"):
        mpi_part(args.mpi_epochs, args.batch, args.lr, args.quick)
    if args.part == "mpi":
        return

    import jaxfog as jf

    results, times, peaks, where = run_methods(jf.Agents(simulated=N), args.epochs, args.batch,
                                               args.lr, True)
    total = results["allreduce every step"][-1]["steps"]
    if args.quick:
        return
    base = results["allreduce every step"][-1]
    lines = [f"# Low-communication training: {where}", "",
             f"Machine: {_machine.cpu()}. `python benchmarks/bench_local_sgd.py --part sim` "
             "(the defaults); bytes modelled (see the script's docstring).", "",
             "One seed; the test set has 450 images, so 0.22% is one image.", "",
             "| method | test acc | vs allreduce | best test acc | MB sent / agent "
             "| fewer bytes | peak KB / step / agent | compute / agent "
             "| modelled time, 1 Gbit/s | 100 Mbit/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    full = total * base["bytes_per_step"]
    for label, rows in results.items():
        last = rows[-1]
        sent = total * last["bytes_per_step"]
        best = max(r["test_accuracy"] for r in rows)
        compute = last["wall_time"] / N
        lines.append(f"| {label} | {last['test_accuracy']:.2f}% "
                     f"| {last['test_accuracy'] - base['test_accuracy']:+.2f} | {best:.2f}% "
                     f"| {sent / 1e6:.2f} | {full / sent:.0f}x | {peaks[label] / 1e3:.1f} "
                     f"| {compute:.2f} s "
                     f"| {compute + sent / 125e6:.2f} s | {compute + sent / 12.5e6:.2f} s |")
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / "local_sgd_16agents"
    (stem.with_suffix(".md")).write_text("\n".join(lines) + "\n")
    (stem.with_suffix(".json")).write_text(json.dumps(
        {"where": where, "machine": _machine.cpu(), "results": results,
         "seconds": times, "peak_bytes_per_step": peaks}))
    plot(results, stem.with_suffix(".png"), where)
    print("\n".join(lines))
    print(f"wrote {stem}.md, .json and .png")


if __name__ == "__main__":
    main()
