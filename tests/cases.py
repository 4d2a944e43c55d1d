"""The shared test matrix: per-agent functions run on both backends.

Each case is ``(name, per_agent_fn, reference)``: ``per_agent_fn(x)`` is the
same code under ``jaxfog run`` (rank = process) and under ``jaxfog.simulate``
(rank = traced agent index); ``reference(X)`` computes the stacked expected
result with numpy from the global ``X`` (row r = rank r's value). Later ops join
this list.
"""

from __future__ import annotations

import numpy as np

import jaxfog.topology as T


def cases(n: int):
    import jax
    import jax.numpy as jnp

    import jaxfog as jf

    expo, ring, star = T.exponential(n), T.ring(n), T.star(n)
    schedule = T.one_peer_exponential(n)
    w_push = np.random.default_rng(7).uniform(0.5, 1.5, (n, n))

    def matrix(w):
        return lambda X: np.einsum("ij,j...->i...", w, X)

    def scheduled(x):
        return jax.lax.fori_loop(
            0, 3, lambda t, c: jf.neighbor_allreduce(c, topology=schedule, step=t), x)

    sched_product = schedule.at(2).weights @ schedule.at(1).weights @ schedule.at(0).weights
    local = expo.weights != 0
    push_w = np.where(local, 1.0, 0.0) * w_push.T
    np.fill_diagonal(push_w, 0.3)
    yield "static default", jf.neighbor_allreduce, matrix(expo.weights)
    yield "static ring", lambda x: jf.neighbor_allreduce(x, topology=ring), matrix(ring.weights)
    yield "static star", lambda x: jf.neighbor_allreduce(x, topology=star), matrix(star.weights)
    yield "scheduled in fori_loop", scheduled, matrix(sched_product)
    yield "allreduce mean", jf.allreduce, lambda X: np.broadcast_to(X.mean(0), X.shape)
    yield ("allreduce sum", lambda x: jf.allreduce(x, op="sum"),
           lambda X: np.broadcast_to(X.sum(0), X.shape))
    yield ("broadcast", lambda x: jf.broadcast(x, root=n - 1),
           lambda X: np.broadcast_to(X[n - 1], X.shape))
    yield ("allgather", jf.allgather,
           lambda X: np.broadcast_to(X.reshape(1, -1, *X.shape[2:]),
                                     (n, n * X.shape[1], *X.shape[2:])))
    yield ("neighbor_allgather", jf.neighbor_allgather,
           lambda X: np.stack([X[expo.in_neighbors(r)].reshape(-1, *X.shape[2:])
                               for r in range(n)]))
    yield ("grad of sum(cos(W x))",
           jax.grad(lambda x: jnp.sum(jnp.cos(jf.neighbor_allreduce(x)))),
           lambda X: matrix(expo.weights.T)(-np.sin(matrix(expo.weights)(X))))
    yield ("vmap inside the agent", jax.vmap(jf.neighbor_allreduce, in_axes=1, out_axes=1),
           matrix(expo.weights))


def random_row_stochastic(n: int, rng: np.random.Generator, density: float) -> T.Topology:
    """A random graph (each edge with probability ``density``) with random
    row-stochastic weights, not necessarily connected: the same on every rank
    that draws it from the same ``rng`` stream."""
    mask = rng.random((n, n)) < density
    w = np.where(mask, rng.uniform(0.1, 1.0, (n, n)), 0.0)
    np.fill_diagonal(w, rng.uniform(0.2, 1.0, n))
    return T.from_weights(w / w.sum(1, keepdims=True), check_connected=False)
