"""Training the digits MLP with a straggler: synchronous against asynchronous.

    jaxfog run -np 4 python examples/straggler.py --straggler 4   # 4 MPI processes
    python examples/straggler.py --straggler 4                     # 4 simulated agents

Rank 0 sleeps ``--straggler`` times its compute after every step. Each agent
trains the demo's MLP (examples/train_digits.py) on its own slice of the
digits, split by label, with one of

* ``atc`` and ``allreduce`` (synchronous: every step waits for the slowest
  neighbour), for ``--iterations`` steps;
* ``push-sum`` (asynchronous SGP), ``ad-psgd`` (pairwise gossip) and ``hop
  s=2 b=1`` (bounded staleness, one backup worker), for the wall time that
  ``atc`` took.

Switching between them is the one line that makes the trainer
(:mod:`jaxfog.asynchrony`). A step's compute is the jitted local step plus
``--emulated-ms`` of sleep on every rank (a compute-bound model, as on an
accelerator). Every agent records its model every few steps; the mean model's
test accuracy over time gives the table (iterations per second of the fast
ranks, the time to reach ``atc``'s final accuracy, the final accuracy) and
``--out`` (a PNG of accuracy against wall time). With a plain ``python`` the
same per-agent code runs on simulated agents in simulated time
(``jaxfog.simulate(..., delays=jaxfog.Delays(...))``) at this machine's
measured speed.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import train_digits  # beside this script

import jaxfog as jf
import jaxfog.asynchrony as jfa
import jaxfog.optax as jfo
import jaxfog.topology as T

N = 4
SYNCHRONOUS = ("atc", "allreduce")
METHODS = ("atc", "allreduce", "push-sum", "ad-psgd", "hop s=2 b=1")
BATCH = 128
WARMUP = 20  # untimed steps first: every method's compilation happens there


class Problem(NamedTuple):
    """A decentralized problem, as the per-agent code sees it."""

    name: str
    data: Callable[[int], Any]            # rank -> this agent's data (arrays)
    params: Any                           # the initial model (the same on every agent)
    grad: Callable[[Any], Callable]       # data -> grad_fn(params, iteration)
    metric: Callable[[Any], Any]          # mean params -> metric (jax)
    higher_is_better: bool
    optimizer: Callable[[], optax.GradientTransformation]
    unit: str


def digits_problem() -> Problem:
    """The demo's MLP on digits split by label; minibatches of 128 drawn by iteration."""
    shards, (x_test, y_test) = train_digits.load(N)
    model = train_digits.MLP()
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


def trainer(method: str, problem: Problem, topology: T.Topology) -> jfa.Trainer:
    """The one line that picks synchronous or asynchronous training."""
    inner = problem.optimizer()
    if method == "atc":
        return jfa.from_optax(jfo.atc(inner, topology=topology))
    if method == "allreduce":
        return jfa.from_optax(jfo.gradient_allreduce(inner))
    if method == "push-sum":
        return jfa.async_push_sum(inner, topology=topology)
    if method == "ad-psgd":
        return jfa.adpsgd(inner, topology=topology)
    return jfa.hop(inner, staleness=2, backups=1, topology=topology)


def flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(v) for v in jax.tree.leaves(tree)]).astype(np.float32)


def compute_time(problem: Problem, grad_fn: Callable) -> float:
    """Median seconds of one agent's jitted local step (gradient and update)."""
    inner = problem.optimizer()

    @jax.jit
    def local(params, state, k):
        u, state = inner.update(grad_fn(params, k), state, params)
        return optax.apply_updates(params, u), state

    params, state = problem.params, inner.init(problem.params)
    times = []
    for k in range(40):
        start = time.perf_counter()
        params, state = jax.block_until_ready(local(params, state, k))
        times.append(time.perf_counter() - start)
    return float(np.median(times[10:]))


Record = tuple[np.ndarray, np.ndarray, np.ndarray]  # times, iterations, models


def train_mpi(problem: Problem, method: str, grad_fn: Callable, *, pause: float,
              iterations: int, budget: float | None, every: int, warmup: int = WARMUP,
              progress: Callable[[float], None] | None = None) -> Record:
    """One method on this MPI process: ``warmup`` untimed steps (compilation),
    then a synchronous one for ``iterations`` steps, an asynchronous one for
    ``budget`` seconds; each step sleeps ``pause`` first (once the trainer is
    ready); records its model every ``every`` steps."""
    topology = jf.load_topology()
    train = trainer(method, problem, topology)
    state = jfa.run(train, train.init(problem.params), grad_fn, warmup)
    # The emulated compute (and the straggler's sleep) is part of the step,
    # after the ready check: a rank computes only once Hop's bounds let it.
    step = train.step
    train = train._replace(step=lambda state, grad_fn: (time.sleep(pause),
                                                         step(state, grad_fn))[1])
    snaps: list[tuple[float, int, np.ndarray]] = []
    jf.barrier()
    start = time.perf_counter()
    snaps.append((0.0, int(state.iteration), flat(train.params(state))))
    iterations += int(state.iteration)

    def callback(state):
        k = int(state.iteration)
        if not snaps or k >= snaps[-1][1] + every:
            elapsed = time.perf_counter() - start
            snaps.append((elapsed, k, flat(train.params(state))))
            if progress is not None:
                progress(k / iterations if budget is None else elapsed / budget)

    if method in SYNCHRONOUS:
        state = jfa.run(train, state, grad_fn, iterations, callback=callback)
    else:
        state = jfa.run(train, state, grad_fn, 10**9, until=start + budget, callback=callback)
    snaps.append((time.perf_counter() - start, int(state.iteration), flat(train.params(state))))
    jf.barrier()
    train.free()
    return (np.array([s[0] for s in snaps]), np.array([s[1] for s in snaps]),
            np.stack([s[2] for s in snaps]))


def compare_mpi(problem: Problem, *, slowdown: float, iterations: int, every: int,
                emulated_ms: float, progress: Callable[[str, float], None] | None = None
                ) -> tuple[dict[str, Record], np.ndarray]:
    """Every method on this MPI process (rank 0 the straggler, sleeping
    ``slowdown`` times its compute); the asynchronous ones for atc's wall time.
    Returns this rank's records and every rank's compute seconds per step."""
    r = jf.rank()
    grad_fn = problem.grad(problem.data(r))
    compute = compute_time(problem, grad_fn) + emulated_ms / 1e3
    computes = np.asarray(jf.allgather(jnp.asarray([compute]))).ravel()
    pause = float(emulated_ms / 1e3 + (slowdown * computes[0] if r == 0 else 0))
    records, budget = {}, None
    for method in METHODS:
        records[method] = train_mpi(
            problem, method, grad_fn, pause=pause, iterations=iterations, budget=budget,
            every=every, progress=None if progress is None else (
                lambda f, method=method: progress(method, f)))
        if progress is not None:
            progress(method, 1.0)
        if method == "atc":
            end = records[method][0][-1]
            budget = float(np.max(np.asarray(jf.allgather(jnp.asarray([end])))))
    return records, computes


def train_simulated(problem: Problem, speeds: np.ndarray, *, message: float, iterations: int,
                    every: int, warmup: int = WARMUP, chunks: int = 40,
                    progress: Callable[[str, float], None] | None = None
                    ) -> dict[str, list[Record]]:
    """Every method on N simulated agents in simulated time (compute ``speeds[i]``
    seconds a step, ``message`` seconds a message): the same per-agent code,
    run in chunks so that the models can be recorded (every ``every`` steps
    of a synchronous method, ``chunks`` times for an asynchronous one);
    ``warmup`` steps and a barrier first, as on MPI."""
    topology = T.exponential(N)
    delays = jf.Delays(compute=speeds, message=message)
    data = jax.tree.map(lambda *v: jnp.stack(v), *[problem.data(q) for q in range(N)])
    params = jax.tree.map(lambda v: jnp.broadcast_to(v, (N, *v.shape)), problem.params)
    runs: dict[str, list[Record]] = {}
    budget = None
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

        def warm(state, data, train=train):
            state = jfa.run(train, state, problem.grad(data), warmup)
            jf.barrier()
            return state, jfa.now(), train.params(state)

        jf.reset_clocks()
        state = jf.simulate(train.init, topology, delays=delays)(params)
        step = jax.jit(jf.simulate(chunk, topology, delays=delays, in_axes=(0, 0, None)))
        state, origin, model = jax.jit(jf.simulate(warm, topology, delays=delays))(state, data)
        origin = float(np.max(origin))
        stops = (list(range(warmup + every, warmup + iterations + 1, every)) if synchronous
                 else list(origin + np.linspace(budget / chunks, budget, chunks)))
        times, counts, models = [np.zeros(N)], [np.asarray(state.iteration)], [model]
        for i, stop in enumerate(stops):
            state, now, model = step(state, data, stop)
            times.append(np.asarray(now) - origin)
            counts.append(np.asarray(state.iteration))
            models.append(model)
            if progress is not None:
                progress(method, (i + 1) / len(stops))
        jf.simulate(lambda v: (train.free(), v)[1], topology)(speeds)
        if method == "atc":
            budget = float(np.max(times[-1]))
        models = [np.stack([flat(jax.tree.map(lambda v: v[q], m)) for q in range(N)])
                  for m in models]
        runs[method] = [(np.array([t[q] for t in times]), np.array([c[q] for c in counts]),
                         np.stack([m[q] for m in models])) for q in range(N)]
    return runs


def curve(problem: Problem, records: list[Record]) -> tuple[np.ndarray, np.ndarray]:
    """(time grid, metric of the agents' mean model at each time): each agent's
    latest recorded model at that time (its initial model before its first)."""
    unravel = ravel_pytree(problem.params)[1]
    initial = flat(problem.params)
    grid = np.unique(np.concatenate([times for times, _, _ in records]))
    mean = np.zeros((len(grid), initial.size), np.float32)
    for times, _, models in records:
        at = np.searchsorted(times, grid, side="right") - 1
        mean += np.where((at >= 0)[:, None], models[np.maximum(at, 0)], initial)
    mean /= len(records)
    metric = jax.jit(jax.vmap(lambda v: problem.metric(unravel(v))))
    return grid, np.asarray(metric(jnp.asarray(mean)))


def summarize(problem: Problem, runs: dict[str, list[Record]]) -> dict[str, dict]:
    """Per method: the fast ranks' iterations/s, when the mean model first
    reaches atc's final metric, the final metric, and the curve."""
    rows, target = {}, None
    for method, records in runs.items():
        grid, values = curve(problem, records)
        if method == "atc":
            target = float(values[-1])
        hit = (values >= target - 1e-9 if problem.higher_is_better
               else values <= target * (1 + 1e-9))
        fast = [(iters[-1] - iters[0]) / (times[-1] - times[0])
                for times, iters, _ in records[1:]]
        rows[method] = {"iterations_per_s": float(np.mean(fast)),
                        "time_to_target": float(grid[np.argmax(hit)]) if hit.any() else None,
                        "final": float(values[-1]), "wall_time": float(grid[-1]),
                        "straggler_iterations": int(records[0][1][-1] - records[0][1][0]),
                        "curve": [grid.tolist(), values.tolist()]}
    return rows


def table(problem: Problem, rows: dict[str, dict], where: str) -> str:
    sync_time = rows["atc"]["wall_time"]
    lines = [f"| method ({where}) | fast ranks it/s | straggler iterations "
             f"| time to atc's final | final {problem.unit} |", "|---|---:|---:|---:|---:|"]
    for method, row in rows.items():
        reach = ("not reached" if row["time_to_target"] is None else
                 f"{row['time_to_target']:.2f} s ({row['time_to_target'] / sync_time:.2f}x)")
        lines.append(f"| {method} | {row['iterations_per_s']:.1f} | "
                     f"{row['straggler_iterations']} | {reach} | {row['final']:.4g} |")
    return "\n".join(lines)


def plot(rows: dict[str, dict], path: str, title: str, xlabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, row in rows.items():
        grid, values = row["curve"]
        ax.plot(grid, values, label=method, linestyle="--" if method in SYNCHRONOUS else "-")
    ax.set_ylim(50, 100)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy of the mean model (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--straggler", type=float, default=4.0,
                        help="rank 0 sleeps this many times its compute per step")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--emulated-ms", type=float, default=10.0)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--chunks", type=int, default=40,
                        help="records of an asynchronous run on simulated agents")
    parser.add_argument("--out", default="straggler.png")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    jf.init()
    problem = digits_problem()
    if jf.size() == 1:  # simulated agents in simulated time
        one = compute_time(problem, problem.grad(problem.data(0))) + args.emulated_ms / 1e3
        speeds = np.full(N, one)
        speeds[0] *= 1 + args.straggler
        bars = {m: train_digits.Progress(m, 100, not args.no_progress) for m in METHODS}
        try:
            runs = train_simulated(problem, speeds, message=2e-4, iterations=args.iterations,
                                   every=args.every, chunks=args.chunks,
                                   progress=lambda m, f: bars[m](int(round(100 * f))))
        finally:
            for bar in bars.values():
                bar.close()
        rows, where = summarize(problem, runs), "simulated agents, simulated time"
    else:
        if jf.size() != N:
            raise SystemExit(f"run with {N} processes (jaxfog run -np {N}) or with python")
        r = jf.rank()
        jf.set_topology(T.exponential(N))
        bars = {m: train_digits.Progress(m, 100, r == 1 and not args.no_progress)
                for m in METHODS}
        try:
            records, _ = compare_mpi(problem, slowdown=args.straggler,
                                     iterations=args.iterations, every=args.every,
                                     emulated_ms=args.emulated_ms,
                                     progress=lambda m, f: bars[m](min(100, int(100 * f))))
        finally:
            for bar in bars.values():
                bar.close()
        runs = {}
        for method, record in records.items():
            # Every rank's record, gathered (padded to one length) for the evaluation.
            length = int(np.max(np.asarray(jf.allgather(jnp.asarray([len(record[0])])))))
            padded = [np.concatenate([a, np.repeat(a[-1:], length - len(a), axis=0)])
                      for a in record]
            runs[method] = list(zip(*[np.asarray(jf.allgather(jnp.asarray(a)[None])) for a in
                                      padded]))
        rows, where = summarize(problem, runs), f"{N} MPI processes"
    if jf.size() == 1 or jf.rank() == 0:
        print(f"\nstraggler sleeping {args.straggler:g}x its compute, {where}:\n")
        print(table(problem, rows, where))
        plot(rows, args.out, f"digits, straggler {args.straggler:g}x ({where})",
             "simulated time (s)" if jf.size() == 1 else "wall time (s)")
        print(f"\nwrote {os.path.abspath(args.out)}")
    return rows


if __name__ == "__main__":
    main()
