"""Nonblocking ops on simulated agents: the blocking op's values (numpy on the
global X), handles across jit calls and scan carries, gradients, the clock
charged at the wait under Delays, and the same numbers as MPI processes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
import jaxfog.asynchrony as jfa
import jaxfog.topology as T
from jaxfog.errors import HandleError
from jaxfog.simulation import _clock

pytestmark = [pytest.mark.jax_internals, pytest.mark.usefixtures("x64")]

N = 4


def _X(seed=0, shape=(5,)):
    return np.random.default_rng(seed).standard_normal((N, *shape))


def test_values_equal_the_blocking_ops():
    X, topo = _X(), T.exponential(N)
    W = topo.weights

    def agent(x):
        handles = [jf.neighbor_allreduce_nonblocking(x), jf.allreduce_nonblocking(x, "sum"),
                   jf.broadcast_nonblocking(x, root=2), jf.allgather_nonblocking(x),
                   jf.neighbor_allgather_nonblocking(x)]
        return [jf.wait(h) for h in handles]

    mixed, summed, sent, gathered, neighbours = jax.jit(jf.simulate(agent, topo))(X)
    np.testing.assert_allclose(mixed, W @ X, rtol=1e-13)
    np.testing.assert_allclose(summed, np.broadcast_to(X.sum(0), X.shape), rtol=1e-13)
    np.testing.assert_allclose(sent, np.broadcast_to(X[2], X.shape), rtol=1e-13)
    np.testing.assert_allclose(gathered, np.broadcast_to(X.reshape(-1), (N, X.size)))
    for i in range(N):
        np.testing.assert_allclose(neighbours[i], X[topo.in_neighbors(i)].reshape(-1))


def test_handles_cross_calls_and_scan_carries():
    X, topo = _X(1), T.ring(N)
    W, steps = topo.weights, 5

    def body(carry, _):
        x, handle = carry
        nxt = jf.neighbor_allreduce_nonblocking(x)
        x = 0.5 * x + 0.5 * jf.wait(handle)
        return (x, nxt), x

    def agent(x):
        (x, handle), xs = jax.lax.scan(body, (x, jf.neighbor_allreduce_nonblocking(x)), None,
                                       length=steps)
        return xs, jf.wait(handle)

    xs, last = jax.jit(jf.simulate(agent, topo))(X)
    prev, cur = X, X
    for t in range(steps):
        prev, cur = cur, 0.5 * cur + 0.5 * (W @ prev)
        np.testing.assert_allclose(xs[:, t], cur, rtol=1e-12)
    np.testing.assert_allclose(last, W @ prev, rtol=1e-12)

    # A handle returned by one simulated call and waited for in the next.
    handle = jf.simulate(lambda x: jf.allreduce_nonblocking(x), topo)(X)
    out = jf.simulate(lambda h, x: jf.wait(h) - x, topo)(handle, X)
    np.testing.assert_allclose(out, X.mean(0) - X, rtol=1e-12, atol=1e-15)


def test_gradients_equal_the_blocking_ops():
    X, topo = _X(2), T.exponential(N)

    def loss(x, nonblocking):
        if nonblocking:
            h = jf.neighbor_allreduce_nonblocking(x)
            return jnp.sum(jnp.sin(x).sum() * jf.wait(h) ** 2)
        return jnp.sum(jnp.sin(x).sum() * jf.neighbor_allreduce(x) ** 2)

    grads = [jax.jit(jf.simulate(jax.grad(lambda x: loss(x, nb)), topo))(X)
             for nb in (True, False)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-13)


def test_the_clock_waits_at_the_wait():
    """Compute between start and wait hides the messages' delay: the clock
    after the wait is max(start + compute, arrival), not their sum."""
    topo = T.ring(N)
    d = np.full((N, N), 3.0)
    delays = jf.Delays(message=d)

    def agent(x, nonblocking):
        if nonblocking:
            handle = jf.neighbor_allreduce_nonblocking(x)
            _clock.set_now(_clock.now() + 2.0)  # two seconds of computing
            y = jf.wait(handle)
        else:
            y = jf.neighbor_allreduce(x)
            _clock.set_now(_clock.now() + 2.0)
        return y, jfa.now()

    results = []
    for nonblocking in (True, False):
        jf.reset_clocks()
        results.append(jax.jit(jf.simulate(lambda x: agent(x, nonblocking), topo,
                                           delays=delays))(_X(3)))
    (y_nb, t_nb), (y_b, t_b) = results
    np.testing.assert_allclose(y_nb, y_b, rtol=1e-13)
    np.testing.assert_allclose(t_nb, np.full(N, 3.0))  # max(2, 3)
    np.testing.assert_allclose(t_b, np.full(N, 5.0))  # 3 + 2
    jf.reset_clocks()


def test_a_handle_is_waited_for_once():
    def agent(x):
        handle = jf.allreduce_nonblocking(x)
        jf.wait(handle)
        return jf.wait(handle)

    with pytest.raises(HandleError, match="already waited"):
        jf.simulate(agent, T.ring(N))(_X())
    with pytest.raises(HandleError, match="expected a Handle"):
        jf.simulate(lambda x: jf.wait(x), T.ring(N))(_X())
