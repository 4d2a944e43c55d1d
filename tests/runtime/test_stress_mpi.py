"""Ordering by construction: many independent large ops per jitted step, random
dynamic graphs and sizes, async dispatch, 150 iterations, 2 to 5 ranks, through
``jaxfog.jit`` (a fresh token inside each call, none across calls) and through
``jax.jit`` (JAX's runtime token across calls).

XLA:CPU runs independent thunks of this size concurrently, in an order that
may differ between ranks; the ordered effect must still make every rank run
the same exchanges in the same order. Every value is checked against numpy.
"""

from __future__ import annotations

from mpi_harness import mpi_test


def _many_independent_ops(jit_name: str):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T
    from cases import random_row_stochastic

    jf.init()
    r, n = jf.rank(), jf.size()
    rng = np.random.default_rng(2024)  # same stream on every rank

    def random_graph():
        return random_row_stochastic(n, rng, 0.5)

    schedules = [T.Schedule([random_graph() for _ in range(int(p))])
                 for p in rng.integers(1, 6, 3)]
    # 22 ops a step: twelve of more than 1 MB (two over 4 MB, which travel in
    # pieces summed as they arrive), small ones of random sizes.
    sizes = [300_000 + int(s) for s in rng.integers(0, 50_000, 10)]
    sizes += [1_100_000 + int(s) for s in rng.integers(0, 50_000, 2)]
    sizes += [int(s) for s in rng.integers(1, 3000, 9)]
    which = [int(k) for k in rng.integers(0, len(schedules), len(sizes))]
    bias = np.linspace(0.0, 0.1, n)[r]

    jit = {"jaxfog.jit": jf.jit, "jax.jit": jax.jit}[jit_name]

    @jit
    def step(xs, t):
        outs = [jf.neighbor_allreduce(x, topology=schedules[k], step=t) + bias
                for x, k in zip(xs[:-1], which[:-1])]
        outs.append(jf.allreduce(xs[-1]) + bias)
        # A third kind of op, independent of the others: rank 0's head of x_0.
        head = jf.broadcast(xs[0][:64], root=0)
        return outs, head

    X = [rng.standard_normal((n, s)).astype(np.float32) for s in sizes]
    xs = [jnp.asarray(x[r]) for x in X]
    bias_all = np.linspace(0.0, 0.1, n)[:, None]
    iterations = 150
    # numpy's reference, in float64 and without iterating over the arrays:
    # x_t = W_t x_{t-1} + b makes x_T = (W_T ... W_1) x_0 + c_T, c_t = W_t c_{t-1} + b.
    average = np.full((n, n), 1.0 / n)
    weights = [[schedules[k].at(t).weights for t in range(iterations)] for k in which[:-1]]
    weights.append([average] * iterations)
    heads = X[0][:, :64].astype(np.float64)  # the head is broadcast before the last step
    for t in range(iterations - 1):
        heads = weights[0][t] @ heads + bias_all
    for t in range(iterations):  # no blocking: JAX dispatches ahead
        xs, head = step(xs, t)
    for got, x, ws in zip(xs, X, weights, strict=True):
        product, offset = np.eye(n), np.zeros((n, 1))
        for w in ws:
            product, offset = w @ product, w @ offset + bias_all
        want = product[r] @ x.astype(np.float64) + offset[r]
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(head), heads[0], rtol=2e-4, atol=2e-4)

@mpi_test(nprocs=(2, 3, 5), timeout=400)
def test_many_independent_ops_random_schedules_async_jaxfog_jit():
    _many_independent_ops("jaxfog.jit")


@mpi_test(nprocs=(2, 3, 5), timeout=400)
def test_many_independent_ops_random_schedules_async_jax_jit():
    _many_independent_ops("jax.jit")
