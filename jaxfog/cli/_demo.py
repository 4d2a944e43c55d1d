"""``jaxfog demo``: compare the built-in graphs and schedules by how fast they average.

For n agents (``--n``, default 16) it prints, for each built-in static graph and a few
dynamic schedules, the period, the largest in-degree (per step for schedules), the
spectral gap (for schedules: of the product over one period) and the number of averaging
steps k after which ``||W_k ... W_1 - 1 pi^T||_2 <= tol``, computed from the matrices.
It also simulates averaging from a seeded random ``x0`` and saves one semilogy plot of
the relative consensus error ``||x_k - x_inf|| / ||x_0 - x_inf||`` per step.

Pure numpy + matplotlib (Agg, no display needed); no JAX, no MPI.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional, Sequence, Union

import numpy as np

from jaxfog import topology as T

Graph = Union[T.Topology, T.Schedule]


def _builtins(n: int, local_size: int) -> list[Graph]:
    """The graphs and schedules the demo compares."""
    graphs: list[Graph] = [
        T.exponential(n),
        T.symmetric_exponential(n),
        T.ring(n),
        T.ring(n, style=1),
        T.mesh_grid_2d(n),
        T.star(n),
        T.fully_connected(n),
        T.one_peer_exponential(n),
        T.one_peer(T.exponential(n)),
    ]
    if n % local_size == 0:
        graphs.append(T.inner_outer_ring(n, local_size))
    return graphs


def _as_schedule(graph: Graph) -> T.Schedule:
    """A static Topology as a period-1 Schedule."""
    return graph if isinstance(graph, T.Schedule) else T.Schedule([graph], name=graph.name)


def _max_in_degree(schedule: T.Schedule) -> int:
    """Largest in-degree over all ranks and all steps of one period."""
    w = schedule.stacked_weights != 0
    n = schedule.size
    off = w & ~np.eye(n, dtype=bool)[None]
    return int(off.sum(axis=2).max())


def _second_modulus_gap(m: np.ndarray) -> float:
    """``1 - |lambda_2(m)|`` (1.0 for a 1x1 matrix)."""
    if m.shape[0] == 1:
        return 1.0
    moduli = np.sort(np.abs(np.linalg.eigvals(m)))[::-1]
    return float(1.0 - moduli[1])


def consensus_limit(schedule: T.Schedule) -> np.ndarray:
    """``lim_k W_k ... W_1 = 1 pi^T`` for a row-stochastic periodic schedule.

    pi is the left Perron vector of the product P over one period (``pi^T P = pi^T``,
    ``sum(pi) = 1``), found by least squares; for doubly stochastic steps pi = 1/n.
    The limit along any step k (not only multiples of the period) is the same, since
    every partial product is row-stochastic.

    Raises:
      ValueError: if some step is not row-stochastic.
    """
    if not all(t.is_row_stochastic(1e-10) for t in schedule):
        raise ValueError(f"{schedule.name}: consensus limit needs row-stochastic steps")
    n = schedule.size
    p = schedule.product()
    a = np.vstack([p.T - np.eye(n), np.ones((1, n))])
    b = np.zeros(n + 1)
    b[-1] = 1.0
    pi = np.linalg.lstsq(a, b, rcond=None)[0]
    return np.outer(np.ones(n), pi)


def steps_to_tolerance(schedule: T.Schedule, limit: np.ndarray, tol: float,
                       cap: int) -> Optional[int]:
    """Smallest k <= cap with ``||W_k ... W_1 - limit||_2 <= tol`` (None if none)."""
    n = schedule.size
    prod = np.eye(n)
    stacked = schedule.stacked_weights
    for k in range(1, cap + 1):
        prod = stacked[(k - 1) % schedule.period] @ prod
        err = prod - limit
        # ||E||_2 >= ||E||_F / sqrt(n): skip the SVD while the bound already fails.
        if np.linalg.norm(err) > tol * math.sqrt(n):
            continue
        if np.linalg.norm(err, 2) <= tol:
            return k
    return None


def consensus_errors(schedule: T.Schedule, limit: np.ndarray, x0: np.ndarray,
             steps: int) -> np.ndarray:
    """Relative consensus error ``||x_k - x_inf|| / ||x_0 - x_inf||`` for k = 0..steps."""
    x_inf = limit @ x0
    denom = np.linalg.norm(x0 - x_inf)
    errs = np.empty(steps + 1)
    x = x0.copy()
    for k in range(steps + 1):
        if k:
            x = schedule.stacked_weights[(k - 1) % schedule.period] @ x
        errs[k] = np.linalg.norm(x - x_inf) / denom if denom > 0 else 0.0
    return errs


def _save_plot(curves: dict, path: str, n: int) -> None:
    """One semilogy figure, one curve per graph (``curves[label] = (errs, dynamic)``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    floor = 1e-16
    for label, (errs, dynamic) in curves.items():
        ax.semilogy(np.arange(len(errs)), np.maximum(errs, floor), label=label,
                    linestyle="--" if dynamic else "-")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xlabel("averaging step k")
    ax.set_ylabel("||x_k - x_inf|| / ||x_0 - x_inf||")
    ax.set_title(f"consensus error, n = {n}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=100)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxfog demo",
        description="Compare jaxfog's built-in topologies and schedules by averaging speed.")
    p.add_argument("--n", type=int, default=16, help="number of agents (default 16)")
    p.add_argument("--steps", type=int, default=60,
                   help="simulated averaging steps in the plot (default 60)")
    p.add_argument("--out", default="consensus.png", help="PNG path (default consensus.png)")
    p.add_argument("--tol", type=float, default=1e-6,
                   help="consensus error target for the steps column (default 1e-6)")
    p.add_argument("--cap", type=int, default=10000,
                   help="largest number of steps tried (default 10000)")
    p.add_argument("--local-size", type=int, default=4,
                   help="ranks per machine for inner_outer_ring (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random x0 (default 0)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the demo; returns the process exit code (0)."""
    args = _parser().parse_args(None if argv is None else [str(a) for a in argv])
    if args.n < 1:
        raise SystemExit("--n must be >= 1")
    if args.steps < 1 or args.cap < 1 or args.local_size < 1 or not args.tol > 0:
        raise SystemExit("--steps, --cap, --local-size and --tol must be positive")
    x0 = np.random.default_rng(args.seed).standard_normal(args.n)

    header = (f"{'graph':<32} {'period':>6} {'max in-deg':>10} {'spectral gap':>12} "
              f"{'steps to ' + format(args.tol, 'g'):>16}")
    print(header)
    print("-" * len(header))
    curves = {}
    for graph in _builtins(args.n, args.local_size):
        sched = _as_schedule(graph)
        limit = consensus_limit(sched)
        gap = _second_modulus_gap(sched.product())
        k = steps_to_tolerance(sched, limit, args.tol, args.cap)
        steps = f">{args.cap}" if k is None else str(k)
        print(f"{graph.name:<32} {sched.period:>6} {_max_in_degree(sched):>10} "
              f"{gap:>12.4f} {steps:>16}")
        curves[graph.name] = (consensus_errors(sched, limit, x0, args.steps),
                              isinstance(graph, T.Schedule))
    print("(schedules: spectral gap of the product over one period)")
    _save_plot(curves, args.out, args.n)
    print(f"saved consensus plot to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
