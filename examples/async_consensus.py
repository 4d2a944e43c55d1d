"""Asynchronous average consensus: one-sided pushes with push-sum weights.

    jaxfog run -np 4 python examples/async_consensus.py     # 4 MPI processes, rank 0 slowed
    python examples/async_consensus.py --agents 4           # 4 simulated agents (in lockstep)

BlueFog's asynchronous push-sum consensus, with jaxfog's windows. Rank i
holds x_i (its own vector) and a push-sum weight p_i = 1 in a window made
with ``zero_init`` and ``with_weight``. Each step it keeps a share
a_i = 1 / (d_i + 1) of (x_i, p_i) and adds a share into the slot it owns on
each of its d_i out-neighbours (``win_accumulate``: one-sided, the
neighbour makes no call), then collects whatever has arrived in its own
slots (``win_update_then_collect``). The weights are column-stochastic, so
the sums of x and of p over all ranks and slots never change, and
x_i / p_i tends to the average of the initial vectors.

Nobody waits: rank 0 sleeps ``--slow`` seconds per step, the others run on,
and what they push piles up in its slots until it collects. Each rank prints
the relative error ||x_i / p_i - mean|| / ||mean|| after every step. How far
the asynchronous steps get depends on the timing; once they stop, every
rank collects the last pushes and the ranks settle in rounds separated by
barriers (each a synchronous push-sum step) until the error is below 1e-10
on every rank, which it reaches because the mass was conserved all along.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfog as jf
import jaxfog.topology as T

WINDOW = "consensus"


def _mine(matrix: np.ndarray):
    """This rank's row: numpy under MPI (static weights), traced when simulated."""
    r = jf.rank()
    return matrix[r] if isinstance(r, int) else jnp.asarray(matrix)[r]


def collectively(agents: jf.Agents, fn, x) -> None:
    """Runs a window's collective set-up or tear-down on every agent: eagerly
    on this MPI process, or traced once over the simulated agents."""
    if agents.simulated:
        jf.simulate(lambda v: jnp.asarray(fn(v)), agents.topology)(x)
    else:
        fn(x)


def push_sum_step(x, shares: np.ndarray, settle: bool = False):
    """One push-sum step; returns the new x and this rank's p. Asynchronous,
    or with ``settle`` a synchronous round (every push lands before anyone
    collects, and every collect before the next pushes)."""
    n = jf.size()
    pushes = np.where(T.exponential(n).weights.T != 0, shares[:, None], 0.0)  # [i, k]
    np.fill_diagonal(pushes, 0.0)
    x = jf.win_accumulate(x, WINDOW, self_weight=_mine(shares), dst_weights=_mine(pushes),
                          require_mutex=True)  # all in or all out of a collect
    if settle:
        jf.barrier()
    x = jf.win_update_then_collect(x, WINDOW)
    if settle:
        jf.barrier()
    return x, jf.win_weight(WINDOW)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--dim", type=int, default=100)
    parser.add_argument("--slow", type=float, default=0.002, help="rank 0's sleep per step (s)")
    parser.add_argument("--tol", type=float, default=1e-10, help="settle below this error")
    parser.add_argument("--agents", type=int, default=4, help="without a launcher")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    agents = jf.Agents(simulated=args.agents)
    n = agents.size
    out_degree = ((T.exponential(n).weights != 0) & ~np.eye(n, dtype=bool)).sum(axis=0)
    shares = 1.0 / (out_degree + 1)
    x0 = agents.data(lambda r: np.random.default_rng(r).standard_normal(args.dim) + r)
    mean = agents.mean(x0)

    collectively(agents, lambda x: jf.win_create(x, WINDOW, zero_init=True, with_weight=True),
                 x0)
    step = agents.map(lambda x: push_sum_step(x, shares))
    error = agents.map(lambda x, p: jnp.linalg.norm(x / p - mean) / np.linalg.norm(mean))
    errors, x = [], x0
    for t in range(args.steps):
        if not agents.simulated and jf.rank() == 0:
            time.sleep(args.slow)
        x, p = step(x)
        errors.append(np.asarray(error(x, p)))
        print(f"rank {'all' if agents.simulated else jf.rank()} step {t}: relative error "
              f"{np.array2string(errors[-1], precision=2)}", flush=True)
    # The asynchronous steps stop: collect the last pushes, then settle.
    if not agents.simulated:
        jf.barrier()
    x, p = agents.map(lambda x: (jf.win_update_then_collect(x, WINDOW),
                                 jf.win_weight(WINDOW)))(x)
    settle = agents.map(lambda x: push_sum_step(x, shares, settle=True))
    rounds = 0
    while agents.mean(error(x, p)) * n >= args.tol and rounds < 1000:  # sum >= max
        x, p = settle(x)
        rounds += 1
    final = np.asarray(error(x, p))
    mass = agents.mean(agents.map(lambda x, p: jnp.concatenate([x, p[None]]))(x, p)) * n
    print(f"rank {'all' if agents.simulated else jf.rank()} final, after {rounds} settling "
          f"rounds: relative error {np.array2string(final, precision=2)}; total weight "
          f"{mass[-1]:.15f}", flush=True)
    collectively(agents, lambda x: jf.win_free(WINDOW), x)
    return {"errors": errors, "final": final, "mass": mass, "initial": mean * n,
            "rounds": rounds}


if __name__ == "__main__":
    main()
