"""Training with a straggler: synchronous against asynchronous (issue 12).

Run with ``python benchmarks/bench_straggler.py`` (from the repository root).
For each slowdown s (default 1, 2, 4) it launches 4 MPI processes (``jaxfog
run -np 4 ... --worker``) that train, one method after another, on
heterogeneous data (rows sorted by label or target, dealt in blocks):

* ``digits``: the demo's MLP (examples/train_digits.py) on scikit-learn's
  digits, minibatches of 128, SGD with momentum 0.9; the metric is the test
  accuracy of the agents' mean model;
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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _machine  # noqa: E402
import _regression_data as regression  # noqa: E402
import train_digits as digits  # noqa: E402

import jaxfog as jf  # noqa: E402
import jaxfog.asynchrony as jfa  # noqa: E402
import jaxfog.optax as jfo  # noqa: E402
import jaxfog.topology as T  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
N = 4
SYNCHRONOUS = ("atc", "allreduce")
METHODS = ("atc", "allreduce", "push-sum", "ad-psgd", "hop s=2 b=1")


# --- the problems: the same per-agent code on MPI and on simulated agents ------------------


class Problem(NamedTuple):
    name: str
    data: Callable[[int], Any]            # rank -> this agent's data (arrays)
    params: Any                           # the initial model (the same on every agent)
    grad: Callable[[Any], Callable]       # data -> grad_fn(params, iteration)
    metric: Callable[[Any], Any]          # mean params -> metric (jax)
    higher_is_better: bool
    optimizer: Callable[[], optax.GradientTransformation]
    unit: str


BATCH = 128


def digits_problem() -> Problem:
    shards, (x_test, y_test) = digits.load(N)
    model = digits.MLP()
    rng = np.random.default_rng(0)
    shards = [(x[p], y[p]) for x, y in shards for p in [rng.permutation(len(y))]]

    def grad(data):
        xs, ys = data

        def loss(params, take):
            logits = model.apply(params, xs[take])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ys[take]).mean()

        def grad_fn(params, k):
            take = (k * BATCH + jnp.arange(BATCH)) % xs.shape[0]
            return jax.grad(loss)(params, take)

        return grad_fn

    def metric(params):
        return 100 * jnp.mean(jnp.argmax(model.apply(params, x_test), -1) == y_test)

    return Problem("digits", lambda r: tuple(map(jnp.asarray, shards[r])),
                   model.init(jax.random.key(0), jnp.zeros((1, 64))), grad, metric, True,
                   lambda: optax.sgd(0.05, momentum=0.9), "test accuracy %")


def least_squares_problem() -> Problem:
    _, _, x_star = regression.load(0, N)
    lr = 0.5 / regression.smoothness(N)

    def grad(data):
        a, b = data
        return lambda x, k: regression.gradient(a, b, x, N)

    def metric(x):
        return jnp.linalg.norm(x - x_star) / np.linalg.norm(x_star)

    return Problem("least squares",
                   lambda r: tuple(jnp.asarray(v, jnp.float32) for v in regression.load(r, N)[:2]),
                   jnp.zeros(x_star.shape, jnp.float32), grad, metric, False,
                   lambda: optax.sgd(lr), "||x - x*|| / ||x*||")


PROBLEMS = {"digits": digits_problem, "least squares": least_squares_problem}


def trainer(method: str, problem: Problem, topology: T.Topology) -> jfa.Trainer:
    inner = problem.optimizer()
    if method == "atc":
        return jfa.from_optax(jfo.atc(inner, topology=topology))
    if method == "allreduce":
        return jfa.from_optax(jfo.gradient_allreduce(inner))
    if method == "push-sum":
        return jfa.push_sum(inner, topology=topology)
    if method == "ad-psgd":
        return jfa.adpsgd(inner, topology=topology)
    return jfa.hop(inner, staleness=2, backups=1, topology=topology)


def flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(v) for v in jax.tree.leaves(tree)]).astype(np.float32)


# --- one MPI rank -------------------------------------------------------------------------


def compute_time(problem: Problem, grad_fn: Callable, data_params: Any) -> float:
    """Median seconds of this rank's jitted local step (gradient and update)."""
    inner = problem.optimizer()

    @jax.jit
    def local(params, state, k):
        u, state = inner.update(grad_fn(params, k), state, params)
        return optax.apply_updates(params, u), state

    params, state = data_params, inner.init(data_params)
    times = []
    for k in range(40):
        start = time.perf_counter()
        params, state = jax.block_until_ready(local(params, state, k))
        times.append(time.perf_counter() - start)
    return float(np.median(times[10:]))


def worker(args: argparse.Namespace) -> None:
    jf.init()
    r = jf.rank()
    topology = T.exponential(N)
    jf.set_topology(topology)
    out: dict[str, Any] = {}
    for name in args.problems:
        problem = PROBLEMS[name]()
        grad_fn = problem.grad(problem.data(r))
        compute = compute_time(problem, grad_fn, problem.params) + args.emulated_ms / 1e3
        computes = np.asarray(jf.allgather(jnp.asarray([compute])))
        pause = float(args.emulated_ms / 1e3 + (args.slowdown * computes[0] if r == 0 else 0.0))
        budget = None
        for method in args.methods:
            train = trainer(method, problem, topology)
            state = train.init(problem.params)
            snaps: list[tuple[float, int, np.ndarray]] = []
            jf.barrier()
            start = time.perf_counter()

            def callback(state, train=train, snaps=snaps, start=start):
                time.sleep(pause)  # the emulated compute, and the straggler's sleep
                k = int(state.iteration)
                if not snaps or k >= snaps[-1][1] + args.every:
                    snaps.append((time.perf_counter() - start, k, flat(train.params(state))))

            if method in SYNCHRONOUS:
                state = jfa.run(train, state, grad_fn, args.iterations, callback=callback)
            else:
                state = jfa.run(train, state, grad_fn, 10**9, until=start + budget,
                                callback=callback)
            end = time.perf_counter() - start
            snaps.append((end, int(state.iteration), flat(train.params(state))))
            jf.barrier()
            train.free()
            if method == "atc":
                budget = float(np.max(np.asarray(jf.allgather(jnp.asarray([end])))))
            out[f"{name}/{method}/time"] = np.array([s[0] for s in snaps])
            out[f"{name}/{method}/iteration"] = np.array([s[1] for s in snaps])
            out[f"{name}/{method}/params"] = np.stack([s[2] for s in snaps])
        out[f"{name}/compute"] = computes.ravel()
    np.savez(Path(args.out) / f"rank{r}.npz", **out)


# --- the launching process: evaluation, simulation, tables ----------------------------------


def curve(problem: Problem, times: list[np.ndarray], models: list[np.ndarray]):
    """(time grid, metric of the agents' mean model at each time): each agent's
    latest recorded model at that time (its initial model before its first)."""
    unravel = ravel_pytree(problem.params)[1]
    initial = flat(problem.params)
    grid = np.unique(np.concatenate(times))
    mean = np.zeros((len(grid), initial.size), np.float32)
    for t, m in zip(times, models):
        at = np.searchsorted(t, grid, side="right") - 1
        mean += np.where((at >= 0)[:, None], m[np.maximum(at, 0)], initial)
    mean /= len(times)
    metric = jax.jit(jax.vmap(lambda v: problem.metric(unravel(v))))
    return grid, np.asarray(metric(jnp.asarray(mean)))


def reached(problem: Problem, grid: np.ndarray, values: np.ndarray, target: float):
    hit = values >= target - 1e-9 if problem.higher_is_better else values <= target * (1 + 1e-9)
    return float(grid[np.argmax(hit)]) if hit.any() else None


def summarize(problem: Problem, runs: dict[str, dict]) -> dict[str, dict]:
    """Per method: fast ranks' iterations/s, time to atc's final metric, final metric."""
    rows, target = {}, None
    for method, run in runs.items():
        grid, values = curve(problem, run["time"], run["params"])
        if method == "atc":
            target = float(values[-1])
        fast = [run["iteration"][q][-1] / run["time"][q][-1] for q in range(1, N)]
        rows[method] = {"iterations_per_s": float(np.mean(fast)),
                        "time_to_target": reached(problem, grid, values, target),
                        "final": float(values[-1]), "wall_time": float(grid[-1]),
                        "curve": [grid.tolist(), values.tolist()],
                        "straggler_iterations": int(run["iteration"][0][-1])}
    return rows


def simulate_runs(problem: Problem, speeds: np.ndarray, iterations: int, every: int,
                  message: float) -> dict[str, dict]:
    """The same methods on simulated agents at the measured speeds."""
    topology = T.exponential(N)
    delays = jf.Delays(compute=speeds, message=message)
    data = jax.tree.map(lambda *v: jnp.stack(v), *[problem.data(q) for q in range(N)])
    params = jax.tree.map(lambda v: jnp.broadcast_to(v, (N, *v.shape)), problem.params)
    runs, budget = {}, None
    for method in METHODS:
        train = trainer(method, problem, topology)
        synchronous = method in SYNCHRONOUS

        def chunk(state, data, stop, train=train, synchronous=synchronous):
            grad_fn = problem.grad(data)
            if synchronous:
                state = jfa.run(train, state, grad_fn, stop)
            else:
                state = jfa.run(train, state, grad_fn, 10**9, until=stop)
            return state, jfa.now(), train.params(state)

        state = jf.simulate(train.init, topology, delays=delays)(params)
        step = jax.jit(jf.simulate(chunk, topology, delays=delays, in_axes=(0, 0, None)))
        times, models, counts = [], [], []
        stops = (range(every, iterations + 1, every) if synchronous
                 else np.linspace(budget / 40, budget, 40))
        for stop in stops:
            state, now, model = step(state, data, stop)
            times.append(np.asarray(now))
            models.append(np.stack([flat(jax.tree.map(lambda v: v[q], model))
                                    for q in range(N)]))
            counts.append(np.asarray(state.iteration))
        jf.simulate(lambda v: (train.free(), v)[1], topology)(speeds)
        if method == "atc":
            budget = float(np.max(times[-1]))
        runs[method] = {"time": [np.array([t[q] for t in times]) for q in range(N)],
                        "params": [np.stack([m[q] for m in models]) for q in range(N)],
                        "iteration": [np.array([c[q] for c in counts]) for q in range(N)]}
    return runs


def load_mpi(directory: Path, name: str, methods) -> tuple[dict, np.ndarray]:
    ranks = [np.load(directory / f"rank{q}.npz") for q in range(N)]
    runs = {m: {key: [ranks[q][f"{name}/{m}/{key}"] for q in range(N)]
                for key in ("time", "iteration", "params")} for m in methods}
    return runs, ranks[0][f"{name}/compute"]


def fmt(value: float | None, digits_: int = 2) -> str:
    return "not reached" if value is None else f"{value:.{digits_}f}"


def table(problem: Problem, slowdown: float, mpi: dict, sim: dict) -> list[str]:
    lines = [f"### {problem.name}, straggler sleeping {slowdown:g}x its compute", "",
             "| method | fast ranks it/s | time to atc's final (s) | final "
             f"{problem.unit} | simulated it/s | simulated time to atc's final (s) "
             f"| simulated final |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    sync_time = mpi["atc"]["wall_time"]
    for method in mpi:
        a, b = mpi[method], sim[method]
        ratio = ("" if a["time_to_target"] is None
                 else f" ({a['time_to_target'] / sync_time:.2f}x)")
        lines.append(f"| {method} | {a['iterations_per_s']:.1f} | "
                     f"{fmt(a['time_to_target'])}{ratio} | {a['final']:.4g} | "
                     f"{b['iterations_per_s']:.1f} | {fmt(b['time_to_target'])} | "
                     f"{b['final']:.4g} |")
    return lines + [""]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slowdowns = sorted({float(k.split("@")[1]) for k in results})
    fig, axes = plt.subplots(2, len(slowdowns), figsize=(5 * len(slowdowns), 8), squeeze=False)
    for col, s in enumerate(slowdowns):
        for row, source in enumerate(("mpi", "simulated")):
            ax = axes[row, col]
            for method, summary in results[f"digits@{s:g}"][source].items():
                grid, values = summary["curve"]
                ax.plot(grid, values, label=method,
                        linestyle="--" if method in SYNCHRONOUS else "-")
            ax.set_ylim(50, 100)
            ax.set_title(f"{'MPI, 4 processes' if source == 'mpi' else 'simulated'}: "
                         f"straggler {s:g}x")
            ax.set_xlabel("wall time (s)" if source == "mpi" else "simulated time (s)")
            ax.set_ylabel("test accuracy of the mean model (%)")
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
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", default="")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.slowdowns, args.iterations, args.problems = [4.0], 40, ["least squares"]
    from jaxfog import launcher

    results, lines = {}, []
    for s in args.slowdowns:
        with tempfile.TemporaryDirectory() as directory:
            command = launcher.build_command(
                [sys.executable, str(Path(__file__).resolve()), "--worker", "--slowdown", str(s),
                 "--iterations", str(args.iterations), "--every", str(args.every),
                 "--emulated-ms", str(args.emulated_ms), "--out", directory,
                 "--problems", *args.problems], N)
            start = time.perf_counter()
            if subprocess.call(command):
                raise SystemExit(f"the MPI run with slowdown {s:g} failed")
            print(f"(MPI runs, straggler {s:g}x: {time.perf_counter() - start:.0f} s)",
                  flush=True)
            for name in args.problems:
                problem = PROBLEMS[name]()
                runs, computes = load_mpi(Path(directory), name, METHODS)
                speeds = computes.copy()
                speeds[0] *= 1 + s
                mpi = summarize(problem, runs)
                sim = summarize(problem, simulate_runs(problem, speeds, args.iterations,
                                                       args.every, args.message_s))
                results[f"{name}@{s:g}"] = {"mpi": mpi, "simulated": sim,
                                            "compute_s": computes.tolist()}
                part = table(problem, s, mpi, sim)
                print("\n".join(part), flush=True)
                lines += part
    if args.quick:
        return None
    header = ["# Training with a straggler: 4 MPI processes and 4 simulated agents", "",
              f"Machine: {_machine.cpu()}; jax {jax.__version__}; "
              f"{args.iterations} synchronous iterations, a record every {args.every}, "
              f"{args.emulated_ms:g} ms of emulated compute per step on every rank; "
              f"simulated messages take {args.message_s * 1e3:g} ms.", "",
              "The asynchronous methods run for atc's wall time. 'time to atc's final': "
              "when the agents' mean model first reaches the metric atc ended with "
              "(and its ratio to atc's wall time).", ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "straggler_4procs.md").write_text("\n".join(header + lines))
    (RESULTS / "straggler_4procs.json").write_text(json.dumps(results))
    plot(results, RESULTS / "straggler_4procs.png")
    print(f"wrote {RESULTS / 'straggler_4procs.md'}")
    return None


if __name__ == "__main__":
    os.environ.setdefault("JAXFOG_TIMEOUT", "120")
    main()
