"""Training with a straggler: synchronous against asynchronous (issue 12).

Run with ``python benchmarks/bench_straggler.py`` (from the repository root).
For each slowdown s (default 1, 2, 4) it launches 4 MPI processes (``jaxfog
run -np 4 ... --worker``) that train, one method after another, on
heterogeneous data (rows sorted by label or target, dealt in blocks):

* ``digits``: the demo's MLP on scikit-learn's digits, minibatches of 128,
  SGD with momentum 0.9 (``examples/straggler.py``, whose per-agent code this
  runs); the metric is the test accuracy of the agents' mean model;
* ``least squares``: the examples' ridge regression on the diabetes data,
  full gradients, plain SGD; the metric is ``||x_mean - x*|| / ||x*||``.

A step's compute is the jitted local step (measured) plus ``--emulated-ms``
of sleep on every rank (default 10 ms: a model whose step is compute bound,
as on an accelerator; ``--emulated-ms 0`` is the raw digits MLP, where this
2-core VM is bound by communication instead). Rank 0 then sleeps s times its
compute per step: the straggler (a sleep takes no CPU, so this is fair with 4
processes on 2 cores).

The methods, on the exponential graph: synchronous ``atc`` and ``allreduce``
(gradient allreduce) run ``--iterations`` steps; ``push-sum`` (asynchronous
SGP), ``ad-psgd`` and ``hop s=2 b=1`` run for the wall time that ``atc``
took. Every rank records (time, iteration, model) every few steps in its own
file; the launching process evaluates the mean model over time and reports,
per method: the fast ranks' iterations per second, the wall time to reach
``atc``'s final metric (the synchronous run's), and the final metric. Then it
runs the same methods on simulated agents (``jaxfog.simulate(...,
delays=Delays(...))``) with the speeds measured on MPI, and reports the same
columns in simulated time. Writes ``benchmarks/results/straggler_4procs.md``,
``.json`` and ``.png``; ``--quick`` is a smoke run (no files).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfog as jf
import jaxfog.topology as T
from _examples import example  # beside this script
from jaxfog import _machine

ROOT = Path(__file__).resolve().parents[1]
regression = example("_regression_data")
straggler = example("straggler")

RESULTS = ROOT / "benchmarks" / "results"
N = straggler.N


def least_squares_problem() -> straggler.Problem:
    _, _, x_star = regression.load(0, N)
    lr = 0.5 / regression.smoothness(N)

    def grad(data):
        a, b = data
        return lambda x, k: regression.gradient(a, b, x, N)

    def metric(x):
        return jnp.linalg.norm(x - x_star) / np.linalg.norm(x_star)

    return straggler.Problem(
        "least squares",
        lambda r: tuple(jnp.asarray(v, jnp.float32) for v in regression.load(r, N)[:2]),
        jnp.zeros(x_star.shape, jnp.float32), grad, metric, False, lambda: optax.sgd(lr),
        "||x - x*|| / ||x*||")


PROBLEMS = {"digits": straggler.digits_problem, "least squares": least_squares_problem}


def worker(args: argparse.Namespace) -> None:
    jf.init()
    r = jf.rank()
    jf.set_topology(T.exponential(N))
    out = {}
    for name in args.problems:
        records, computes = straggler.compare_mpi(
            PROBLEMS[name](), slowdown=args.slowdown, iterations=args.iterations,
            every=args.every, emulated_ms=args.emulated_ms)
        for method, (times, iterations, models) in records.items():
            out.update({f"{name}/{method}/time": times, f"{name}/{method}/iteration": iterations,
                        f"{name}/{method}/params": models})
        out[f"{name}/compute"] = computes
    np.savez(Path(args.out) / f"rank{r}.npz", **out)


def load_mpi(directory: Path, name: str):
    ranks = [np.load(directory / f"rank{q}.npz") for q in range(N)]
    runs = {m: [tuple(ranks[q][f"{name}/{m}/{key}"] for key in ("time", "iteration", "params"))
                for q in range(N)] for m in straggler.METHODS}
    return runs, ranks[0][f"{name}/compute"]


def table(problem: straggler.Problem, slowdown: float, mpi: dict, sim: dict) -> list[str]:
    def reach(row, sync_time):
        t = row["time_to_target"]
        return "not reached" if t is None else f"{t:.2f} ({t / sync_time:.2f}x)"

    lines = [f"### {problem.name}, straggler sleeping {slowdown:g}x its compute", "",
             f"| method | fast ranks it/s | straggler iterations | time to atc's final (s) "
             f"| final {problem.unit} | simulated it/s | simulated time to atc's final (s) "
             "| simulated final |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for method in mpi:
        a, b = mpi[method], sim[method]
        lines.append(f"| {method} | {a['iterations_per_s']:.1f} | {a['straggler_iterations']} "
                     f"| {reach(a, mpi['atc']['wall_time'])} | {a['final']:.4g} "
                     f"| {b['iterations_per_s']:.1f} | {reach(b, sim['atc']['wall_time'])} "
                     f"| {b['final']:.4g} |")
    return lines + [""]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slowdowns = sorted({float(k.split("@")[1]) for k in results if k.startswith("digits")})
    fig, axes = plt.subplots(2, len(slowdowns), figsize=(5 * len(slowdowns), 8),
                             squeeze=False)
    for col, s in enumerate(slowdowns):
        for row, source in enumerate(("mpi", "simulated")):
            ax = axes[row, col]
            for method, summary in results[f"digits@{s:g}"][source].items():
                grid, values = summary["curve"]
                ax.plot(grid, values, label=method,
                        linestyle="--" if method in straggler.SYNCHRONOUS else "-")
            ax.set_ylim(50, 100)
            ax.set_title(f"{'4 MPI processes' if source == 'mpi' else 'simulated agents'}: "
                         f"straggler {s:g}x")
            ax.set_xlabel("wall time (s)" if source == "mpi" else "simulated time (s)")
            ax.set_ylabel("digits: test accuracy of the mean model (%)")
            ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--slowdown", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--emulated-ms", type=float, default=10.0)
    parser.add_argument("--message-s", type=float, default=2e-4,
                        help="simulated seconds per message (default 0.2 ms)")
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS))
    parser.add_argument("--out", default="")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.slowdowns, args.iterations, args.problems = [4.0], 40, ["least squares"]
    from jaxfog.cli import _launcher as launcher

    results, lines = {}, []
    for s in args.slowdowns:
        with tempfile.TemporaryDirectory() as directory:
            command = launcher.build_command(
                [sys.executable, str(Path(__file__).resolve()), "--worker", "--slowdown",
                 str(s), "--iterations", str(args.iterations), "--every", str(args.every),
                 "--emulated-ms", str(args.emulated_ms), "--out", directory,
                 "--problems", *args.problems], N)
            start = time.perf_counter()
            if subprocess.call(command):
                raise SystemExit(f"the MPI run with slowdown {s:g} failed")
            print(f"(MPI runs, straggler {s:g}x: {time.perf_counter() - start:.0f} s)",
                  flush=True)
            for name in args.problems:
                problem = PROBLEMS[name]()
                runs, computes = load_mpi(Path(directory), name)
                speeds = computes.copy()
                speeds[0] *= 1 + s
                mpi = straggler.summarize(problem, runs)
                sim = straggler.summarize(problem, straggler.train_simulated(
                    problem, speeds, message=args.message_s, iterations=args.iterations,
                    every=args.every))
                results[f"{name}@{s:g}"] = {"mpi": mpi, "simulated": sim,
                                            "compute_s": computes.tolist()}
                part = table(problem, s, mpi, sim)
                print("\n".join(part), flush=True)
                lines += part
    if args.quick:
        return None
    header = ["# Training with a straggler: 4 MPI processes and 4 simulated agents", "",
              f"Machine: {_machine.cpu()}; jax {jax.__version__}; "
              f"{args.iterations} synchronous iterations, a record every {args.every}; "
              f"{args.emulated_ms:g} ms of emulated compute per step on every rank; "
              f"simulated messages take {args.message_s * 1e3:g} ms. "
              "Produced by `python benchmarks/bench_straggler.py`.", "",
              "Every method takes 20 untimed steps first (compilation), then the clock "
              "starts after a barrier. "
              "The asynchronous methods run for atc's wall time. 'time to atc's final': "
              "when the agents' mean model first reaches the metric atc ended with "
              "(in parentheses: the ratio to atc's wall time).", ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "straggler_4procs.md").write_text("\n".join(header + lines))
    (RESULTS / "straggler_4procs.json").write_text(json.dumps(results))
    plot(results, RESULTS / "straggler_4procs.png")
    print(f"wrote {RESULTS / 'straggler_4procs.md'}")
    return None


if __name__ == "__main__":
    os.environ.setdefault("JAXFOG_TIMEOUT", "120")
    main()
