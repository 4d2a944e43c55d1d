"""Average consensus: every rank repeatedly averages with its neighbours.

    jaxfog run -np 4 python examples/average_consensus.py

For the static exponential graph, the ring, and the one-peer exponential
schedule, prints the relative consensus error ||x_k - mean|| / ||x_0 - mean||
(over all ranks) after each averaging step. With one peer per step on 2^k
ranks the error reaches machine precision after exactly k steps: the product
of the k matrices is the exact average 11^T / n.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxfog as jf
import jaxfog.topology as T


def relative_errors(topology, x0: jax.Array, steps: int) -> list[float]:
    """Consensus error after 0..steps averaging steps (same on every rank)."""
    mean = jf.allreduce(x0)
    scale = float(jf.allreduce(jnp.sum((x0 - mean) ** 2), op="sum")) ** 0.5

    @jax.jit
    def step(x, t):
        if isinstance(topology, T.Schedule):
            return jf.neighbor_allreduce(x, topology=topology, step=t)
        return jf.neighbor_allreduce(x, topology=topology)

    errors, x = [1.0 if scale > 0 else 0.0], x0
    for t in range(steps):
        x = step(x, t)
        spread = float(jf.allreduce(jnp.sum((x - mean) ** 2), op="sum")) ** 0.5
        errors.append(spread / scale if scale > 0 else 0.0)
    return errors


def main(argv=None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1000)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    jf.init()
    r, n = jf.rank(), jf.size()
    x0 = jnp.asarray(np.random.default_rng(r).standard_normal(args.dim))
    graphs = {"exponential": T.exponential(n), "ring": T.ring(n),
              "one-peer exponential": T.one_peer_exponential(n)}
    results = {name: relative_errors(topo, x0, args.steps) for name, topo in graphs.items()}
    if r == 0:
        print(f"relative consensus error, {n} ranks")
        print(f"{'step':>4}  " + "  ".join(f"{name:>22}" for name in results))
        for k in range(args.steps + 1):
            print(f"{k:>4}  " + "  ".join(f"{errs[k]:>22.3e}" for errs in results.values()))
    return results


if __name__ == "__main__":
    main()
