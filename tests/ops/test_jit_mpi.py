"""jaxfog.jit on MPI processes: values against numpy, ordering that holds when
XLA would reorder, composition with transformations, and shutdown while
dispatched steps still communicate."""

from __future__ import annotations

import pytest
from mpi_harness import mpi_test

pytestmark = pytest.mark.jax_internals


@mpi_test(nprocs=(2, 3), timeout=240)
def test_order_holds_when_each_rank_would_start_a_different_op_first():
    """Rank r delays the input of op r % 2 behind a long chain of matmuls, so
    an executor free to reorder would start the other op first on that rank
    and a different one on its neighbour; the token keeps program order."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T

    jf.init()
    r, n = jf.rank(), jf.size()
    ring = T.ring(n)
    m = jnp.eye(256) * 0.5 + 0.5 / 256

    def slow(x):  # many thunks, buffers well over 512 bytes
        for _ in range(40):
            x = jnp.tanh(m @ x)
        return x

    def step(a, b):
        a = slow(a) if r % 2 == 0 else a
        b = slow(b) if r % 2 == 1 else b
        mixed = jf.neighbor_allreduce(a, topology=ring)
        total = jf.allreduce(b, op="sum")
        gathered = jf.allgather(a[:4, 0])
        return mixed, total, gathered

    rng = np.random.default_rng(0)
    A = rng.standard_normal((n, 256, 64)).astype(np.float32)
    B = rng.standard_normal((n, 256, 64)).astype(np.float32)
    for jit in (jf.jit, jax.jit):
        fn = jit(step)
        ref = jax.jit(slow)
        slow_a = np.stack([np.asarray(ref(A[k])) if k % 2 == 0 else A[k] for k in range(n)])
        slow_b = np.stack([np.asarray(ref(B[k])) if k % 2 == 1 else B[k] for k in range(n)])
        for _ in range(20):
            mixed, total, gathered = fn(A[r], B[r])
        np.testing.assert_allclose(mixed, (ring.weights @ slow_a.reshape(n, -1))[r].reshape(
            256, 64), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(total, slow_b.sum(0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gathered, slow_a[:, :4, 0].reshape(-1), rtol=1e-6)


@mpi_test(nprocs=(2, 3), timeout=240, x64=True)
def test_transformations_static_donated_and_aot_against_numpy():
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T
    from reference import global_values

    jf.init()
    r, n = jf.rank(), jf.size()
    X = global_values(n, (6,), seed=3)
    C = global_values(n, (6,), seed=4)
    topo = T.exponential(n)
    W = topo.weights

    def loss(x, c):  # sum over ranks of <c_r, (W X)_r>: its gradient is W^T C
        return jnp.vdot(c, jf.neighbor_allreduce(x))

    grad = jf.jit(jax.grad(loss))
    np.testing.assert_allclose(grad(X[r], C[r]), (W.T @ C)[r], rtol=1e-12)
    # jaxfog.jit under grad, vmap and an enclosing jit: exactly jax.jit.
    inner = jf.jit(loss)
    np.testing.assert_allclose(jax.grad(inner)(X[r], C[r]), (W.T @ C)[r], rtol=1e-12)
    batch = jnp.stack([X[r], 2 * X[r]])
    np.testing.assert_allclose(jax.vmap(jf.jit(jf.neighbor_allreduce))(batch),
                               np.stack([(W @ X)[r], (W @ (2 * X))[r]]), rtol=1e-12)
    np.testing.assert_allclose(jax.jit(lambda x: inner(x, C[r]) * 2)(X[r]),
                               2 * (C * (W @ X)).sum(1)[r], rtol=1e-12)

    @functools.partial(jf.jit, static_argnames="topology", donate_argnums=0)
    def mix(x, topology):
        return jf.neighbor_allreduce(x, topology=topology)

    for graph in (T.ring(n), T.fully_connected(n)):
        x = jnp.asarray(X[r])
        np.testing.assert_allclose(mix(x, topology=graph), (graph.weights @ X)[r], rtol=1e-12)
        assert x.is_deleted()
    compiled = mix.lower(jnp.asarray(X[r]), topology=T.ring(n)).compile()
    x = jnp.asarray(X[r])
    for _ in range(4):  # repeated AOT calls keep their order and values
        x = compiled(x)
    np.testing.assert_allclose(x, (np.linalg.matrix_power(T.ring(n).weights, 4) @ X)[r],
                               rtol=1e-12)
    # A topology set after tracing retraces.
    step = jf.jit(jf.neighbor_allreduce)
    step(jnp.asarray(X[r]))
    jf.set_topology(T.star(n))
    np.testing.assert_allclose(step(jnp.asarray(X[r])), (T.star(n).weights @ X)[r],
                               rtol=1e-12)


def _dispatch_then_stop(explicit_shutdown: bool):
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T

    jf.init()
    r, n = jf.rank(), jf.size()

    @jf.jit
    def step(x):
        return jf.neighbor_allreduce(x) * 0.5 + jf.allreduce(x[:1000])[0]

    x = jnp.full(1 << 19, float(r))  # 2 MiB: above the async threshold
    for _ in range(30):  # returns long before the communication has run
        x = step(x)
    if explicit_shutdown:
        jf.shutdown()  # waits for the 30 steps' communication first
        X = np.arange(n, dtype=np.float64)
        for _ in range(30):
            X = T.exponential(n).weights @ X * 0.5 + X.mean()
        np.testing.assert_allclose(np.asarray(x[::4096]), X[r], rtol=1e-5)
    # Otherwise the process exits now; shutdown runs at exit before JAX's teardown.


@mpi_test(nprocs=(2, 4), timeout=180, alone=True)
def test_shutdown_right_after_async_dispatch():
    _dispatch_then_stop(explicit_shutdown=True)


@mpi_test(nprocs=(2, 4), timeout=180, alone=True)
def test_exit_right_after_async_dispatch():
    _dispatch_then_stop(explicit_shutdown=False)


@mpi_test(nprocs=(3, 4), timeout=180)
def test_a_program_names_its_plan_so_one_program_serves_every_graph():
    """neighbor_allreduce's program names its plan (this rank's row of W) by an
    id in the process's table, emptied when jaxfog is set up again: the same
    step lowered for a ring and, after shutdown and init, for another graph is
    the same program text, and each computes its own graph's W @ X (numpy).
    A program compiled before the set-up fails clearly, naming the plan."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    import jaxfog as jf
    import jaxfog.topology as T

    X = np.arange(4 * 5, dtype=np.float32).reshape(4, 5) ** 1.5
    texts = []
    for graph in (T.ring, T.exponential, T.star):
        jf.init()
        r, n = jf.rank(), jf.size()
        topology = graph(n)

        def step(x, topology=topology):
            return jf.neighbor_allreduce(jnp.sin(x), topology=topology) * 2.0

        lowered = jax.jit(step).lower(X[r])
        texts.append(lowered.as_text())
        compiled = lowered.compile()
        expected = (topology.weights @ np.sin(X[:n]))[r] * 2.0
        np.testing.assert_allclose(compiled(X[r]), expected, rtol=1e-5)
        jf.shutdown()
    assert texts[0] == texts[1] == texts[2]
    jf.init()
    with pytest.raises(Exception, match="communication plan 0 is not defined"):
        jax.block_until_ready(compiled(X[r]))
    jf.barrier()
