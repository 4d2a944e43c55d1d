"""Average consensus: every agent repeatedly averages with its neighbours.

    jaxfog run -np 4 python examples/average_consensus.py    # 4 MPI processes
    python examples/average_consensus.py --agents 8          # 8 simulated agents

For the static exponential graph, the ring, and the one-peer exponential
schedule, prints the relative consensus error ||x_k - mean|| / ||x_0 - mean||
(over all agents) after each averaging step. With one peer per step on 2^k
agents the error reaches machine precision after exactly k steps: the product
of the k matrices is the exact average 11^T / n.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxfog as jf
import jaxfog.topology as T


def relative_errors(agents: jf.Agents, topology, x0, steps: int) -> list[float]:
    """Consensus error after 0..steps averaging steps (the same on every rank)."""
    def average(x, t):
        if isinstance(topology, T.Schedule):
            return jf.neighbor_allreduce(x, topology=topology, step=t)
        return jf.neighbor_allreduce(x, topology=topology)

    step = agents.map(average, in_axes=(0, None))
    spread = agents.map(lambda x: jnp.sum((x - jf.allreduce(x)) ** 2))
    scale = float(agents.mean(spread(x0))) ** 0.5
    errors, x = [1.0 if scale > 0 else 0.0], x0
    for t in range(steps):
        x = step(x, t)
        errors.append(float(agents.mean(spread(x))) ** 0.5 / scale if scale > 0 else 0.0)
    return errors


def main(argv=None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=8, help="without a launcher")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    agents = jf.Agents(simulated=args.agents)
    n = agents.size
    x0 = agents.data(lambda r: np.random.default_rng(r).standard_normal(args.dim))
    graphs = {"exponential": T.exponential(n), "ring": T.ring(n),
              "one-peer exponential": T.one_peer_exponential(n)}
    results = {name: relative_errors(agents, topo, x0, args.steps)
               for name, topo in graphs.items()}
    if agents.is_root:
        where = "simulated agents" if agents.simulated else "MPI processes"
        print(f"relative consensus error, {n} {where}")
        print(f"{'step':>4}  " + "  ".join(f"{name:>22}" for name in results))
        for k in range(args.steps + 1):
            print(f"{k:>4}  " + "  ".join(f"{errs[k]:>22.3e}" for errs in results.values()))
    return results


if __name__ == "__main__":
    main()
