"""Ordering across computations: small ops (inline) and large ones (the
communication thread) from many ``jaxfog.jit`` calls dispatched without
waiting keep one order on every rank.

Each call is its own computation with its own token; nothing orders a call
after the previous one's communication except the communication thread: a
small op must not run inline while a large op handed over before it is still
queued or running (issue 23). Every value is checked against numpy.

With jax 0.10 PjRt happens not to start a call before the previous one's
communication has run (a timeline of the old library showed no overlap, and
this test passed with it), so this guards the order against changes there;
tests/ffi/test_ffi_units.py checks the communication thread's order directly.
"""

from __future__ import annotations

import pytest
from mpi_harness import mpi_test

pytestmark = pytest.mark.jax_internals

# Large messages go to the communication thread, small ones would run inline.
COMM_THREAD_MIN_BYTES = 1 << 16


def _mixed_dispatches():
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    from cases import random_row_stochastic

    jf.init()
    r, n = jf.rank(), jf.size()
    rng = np.random.default_rng(23)  # same stream on every rank

    def random_graph():
        return random_row_stochastic(n, rng, 0.6)

    graphs = [random_graph() for _ in range(3)]
    # float32: 256 B, and 2 MiB, so that large ops queue up behind each other.
    small, large = 64, 1 << 19
    # Chains that share nothing: each call depends only on its own chain's
    # previous call, so PjRt may run calls of different chains in any order.
    chains = []  # (function, numpy update, size)
    for k, g in enumerate(graphs):
        for size in (small, large):
            fn = jf.jit(lambda x, g=g: jf.neighbor_allreduce(x, topology=g) * 1.01)
            chains.append((fn, lambda X, g=g: (g.weights.astype(np.float32) @ X) * 1.01, size))
    for size in (small, large):
        fn = jf.jit(lambda x: jf.allreduce(x) + 0.5)
        chains.append((fn, lambda X: np.repeat(X.mean(0, keepdims=True), n, 0) + 0.5, size))
    X = [rng.standard_normal((n, size)).astype(np.float32) for _, _, size in chains]
    xs = [jnp.asarray(x[r]) for x in X]
    # Alternate small and large calls; in each round the chains come in a
    # different (but on every rank the same) order.
    order = np.arange(len(chains))
    for _ in range(60):
        rng.shuffle(order)
        ordered = sorted(order, key=lambda c: chains[c][2] == large)  # smalls first
        mixed = [c for pair in zip(ordered[:len(ordered) // 2], ordered[len(ordered) // 2:])
                 for c in pair] + ordered[2 * (len(ordered) // 2):]
        for c in mixed:  # no blocking: JAX dispatches ahead
            xs[c] = chains[c][0](xs[c])
            X[c] = chains[c][1](X[c])
    for got, want in zip(xs, X):
        np.testing.assert_allclose(np.asarray(got), want[r], rtol=1e-4, atol=1e-4)


@mpi_test(nprocs=(2, 3, 5), timeout=400,
          env={"JAXFOG_COMM_THREAD_MIN_BYTES": str(COMM_THREAD_MIN_BYTES), "JAXFOG_TIMEOUT": "120"})
def test_small_and_large_ops_of_independent_calls_keep_one_order():
    _mixed_dispatches()
