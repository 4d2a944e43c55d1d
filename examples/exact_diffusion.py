"""Exact diffusion (BlueFog paper, appendix A, Listing 6) for ridge regression.

    jaxfog run -np 4 python examples/exact_diffusion.py    # 4 MPI processes
    python examples/exact_diffusion.py --agents 4          # 4 simulated agents

The same decentralized problem as examples/dgd_linear_regression.py, with
the bias correction of exact diffusion (Yuan et al.), over the ring with
W_bar = (I + W) / 2:

    psi_i = x_i - gamma * grad f_i(x_i)     (local update)
    phi_i = psi_i + x_i - psi_i_prev        (bias correction)
    x_i   = sum_j W_bar_ij phi_j            (partial averaging)

It converges to the centralized solution itself: the relative error falls
below 1e-8 (float64).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxfog as jf
import jaxfog.topology as T

from _regression_data import gradient, load, smoothness  # beside this script


def w_bar(n: int) -> T.Topology:
    return T.from_weights((np.eye(n) + T.ring(n).weights) / 2, name="(I + ring) / 2")


def main(argv=None) -> list[tuple[int, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--report-every", type=int, default=300)
    parser.add_argument("--gamma", type=float, default=None,
                        help="step size (default: 1 / max_i L_i)")
    parser.add_argument("--agents", type=int, default=4, help="without a launcher")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    agents = jf.Agents(simulated=args.agents, topology=w_bar)
    n = agents.size
    gamma = args.gamma or 1.0 / smoothness(n)
    a, b, x_star = agents.data(lambda r: load(r, n))

    def chunk(a, b, x, psi_prev):
        def one(state, _):
            x, psi_prev = state
            psi = x - gamma * gradient(a, b, x, n)
            phi = psi + x - psi_prev
            return (jf.neighbor_allreduce(phi), psi), None
        return jax.lax.scan(one, (x, psi_prev), None, length=args.report_every)[0]

    chunk = agents.map(chunk)
    error = agents.map(lambda x, x_star: jnp.linalg.norm(x - x_star) / jnp.linalg.norm(x_star))
    x = jnp.zeros_like(x_star)
    psi_prev, history = x, []  # psi_{-1} = x_0 makes the first step plain diffusion
    for k in range(args.report_every, args.iterations + 1, args.report_every):
        x, psi_prev = chunk(a, b, x, psi_prev)
        history.append((k, float(agents.mean(error(x, x_star)))))
    if agents.is_root:
        where = "simulated agents" if agents.simulated else "MPI processes"
        print(f"exact diffusion on {n} {where} (ring, W_bar = (I + W) / 2, gamma = {gamma:.3g}), "
              "relative error to the centralized solution")
        for k, err in history:
            print(f"{k:>9}  {err:.3e}")
    return history


if __name__ == "__main__":
    main()
