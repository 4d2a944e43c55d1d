"""Decentralized gradient descent (BlueFog paper, Listing 1) for ridge regression.

    jaxfog run -np 4 python examples/dgd_linear_regression.py

Rank i holds rows (A_i, b_i) of scikit-learn's diabetes data and minimises
sum_i f_i(x) (ridge regression, see _regression_data.py) together with the others over the static
exponential graph:

    y_i = x_i - gamma * grad f_i(x_i)      (local update, gamma ~ 1 / L)
    x_i = sum_j W_ij y_j                           (partial averaging)

With a constant step size DGD stalls at a bias away from the centralized
solution x*; the bias shrinks with gamma (exact diffusion removes
it: examples/exact_diffusion.py). Prints ||x - x*|| / ||x*|| averaged over ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

import jaxfog as jf
import jaxfog.topology as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _regression_data import gradient, load, smoothness  # noqa: E402


def run(gamma: float, iterations: int, report_every: int) -> list[tuple[int, float]]:
    a, b, x_star = load(jf.rank(), jf.size())
    a, b, x_star = jnp.asarray(a), jnp.asarray(b), jnp.asarray(x_star)

    def one(x, _):
        grad = gradient(a, b, x, jf.size())
        return jf.neighbor_allreduce(x - gamma * grad), None

    chunk = jax.jit(lambda x: jax.lax.scan(one, x, None, length=report_every)[0])
    x, history = jnp.zeros_like(x_star), []
    for k in range(report_every, iterations + 1, report_every):
        x = chunk(x)
        error = jf.allreduce(jnp.linalg.norm(x - x_star) / jnp.linalg.norm(x_star))
        history.append((k, float(error)))
    return history


def main(argv=None) -> dict[float, list[tuple[int, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--report-every", type=int, default=200)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    jf.init(topology=None)
    jf.set_topology(T.exponential(jf.size()))
    a, _, _ = load(jf.rank(), jf.size())
    lipschitz = float(jnp.max(jf.allgather(jnp.asarray(smoothness(a, jf.size())))))
    results = {gamma: run(gamma, args.iterations, args.report_every)
               for gamma in (1 / lipschitz, 0.25 / lipschitz)}
    if jf.rank() == 0:
        print(f"DGD on {jf.size()} ranks, relative error to the centralized solution")
        print(f"{'iteration':>9}  " + "  ".join(f"gamma={g:<8g}" for g in results))
        for row in zip(*results.values()):
            print(f"{row[0][0]:>9}  " + "  ".join(f"{e:>14.3e}" for _, e in row))
    return results


if __name__ == "__main__":
    main()
