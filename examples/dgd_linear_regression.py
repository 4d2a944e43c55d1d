"""Decentralized gradient descent (BlueFog paper, Listing 1) for ridge regression.

    jaxfog run -np 4 python examples/dgd_linear_regression.py    # 4 MPI processes
    python examples/dgd_linear_regression.py --agents 4          # 4 simulated agents

Agent i holds rows (A_i, b_i) of scikit-learn's diabetes data and minimises
sum_i f_i(x) (ridge regression, see _regression_data.py) together with the
others over the static exponential graph:

    y_i = x_i - gamma * grad f_i(x_i)      (local update, gamma ~ 1 / L)
    x_i = sum_j W_ij y_j                   (partial averaging)

With a constant step size DGD stalls at a bias away from the centralized
solution x*; the bias shrinks with gamma (exact diffusion removes it:
examples/exact_diffusion.py). Prints ||x - x*|| / ||x*|| averaged over agents.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfog as jf

from _regression_data import gradient, load, smoothness  # beside this script


def run(agents: jf.Agents, gamma: float, iterations: int,
        report_every: int) -> list[tuple[int, float]]:
    n = agents.size
    a, b, x_star = agents.data(lambda r: load(r, n))

    def chunk(a, b, x):
        def one(x, _):
            return jf.neighbor_allreduce(x - gamma * gradient(a, b, x, n)), None
        return jax.lax.scan(one, x, None, length=report_every)[0]

    chunk = agents.map(chunk)
    error = agents.map(lambda x, x_star: jnp.linalg.norm(x - x_star) / jnp.linalg.norm(x_star))
    x, history = jnp.zeros_like(x_star), []
    for k in range(report_every, iterations + 1, report_every):
        x = chunk(a, b, x)
        history.append((k, float(agents.mean(error(x, x_star)))))
    return history


def main(argv=None) -> dict[float, list[tuple[int, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--report-every", type=int, default=200)
    parser.add_argument("--agents", type=int, default=4, help="without a launcher")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    agents = jf.Agents(simulated=args.agents)
    lipschitz = smoothness(agents.size)
    results = {gamma: run(agents, gamma, args.iterations, args.report_every)
               for gamma in (1 / lipschitz, 0.25 / lipschitz)}
    if agents.is_root:
        where = "simulated agents" if agents.simulated else "MPI processes"
        print(f"DGD on {agents.size} {where}, relative error to the centralized solution")
        print(f"{'iteration':>9}  " + "  ".join(f"gamma={g:<8g}" for g in results))
        for row in zip(*results.values()):
            print(f"{row[0][0]:>9}  " + "  ".join(f"{e:>14.3e}" for _, e in row))
    return results


if __name__ == "__main__":
    main()
