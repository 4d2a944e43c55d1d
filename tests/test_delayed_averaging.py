"""Delayed averaging (``atc``/``awc`` with ``delay=d``) on simulated agents,
against a numpy model of the update equations; ``delay=0`` is the plain
method. (On MPI processes: the delayed cases of ``optax_cases.all_cases``.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.optax as jfo
import jaxfog.topology as T
from optax_cases import least_squares, train

pytestmark = [pytest.mark.jax_internals, pytest.mark.numerical]

N, STEPS = 4, 25


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _reference(problem, W, lr, delay, mix_params, steps):
    """x^{k+1} = W_ii y_i^k + sum_{j != i} W_ij y_j^{k-d} (+ u^k for awc),
    y = x (awc) or x + u (atc), y^j = x^0 for j < 0; u = -lr * grad."""
    A, B = problem.A, problem.B
    grad = jax.vmap(jax.grad(problem.loss(N)))
    diagonal = np.diag(np.diag(W))
    x = np.zeros((N, A.shape[-1]))
    sent = [x] * delay
    path = []
    for _ in range(steps):
        u = -lr * np.asarray(grad(jnp.asarray(x), A, B))
        y = x if mix_params else x + u
        sent.append(y)
        old = sent.pop(0)
        x = diagonal @ y + (W - diagonal) @ old + (u if mix_params else 0)
        path.append(x)
    return np.stack(path, axis=1)


@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("method", ["atc", "awc"])
def test_delayed_mixing_matches_the_equations(method, delay):
    problem, topo = least_squares(N), T.exponential(N)
    lr = 0.5 / problem.lipschitz
    optimizer = getattr(jfo, method)(optax.sgd(lr), delay=delay)
    path = jax.jit(jf.simulate(train(optimizer, problem, N, STEPS, every_step=True), topo))(
        problem.A, problem.B)
    want = _reference(problem, topo.weights, lr, delay, method == "awc", STEPS)
    np.testing.assert_allclose(path, want, rtol=1e-12, atol=1e-14)
    # It converges, more slowly, to the neighbourhood of the optimum the plain
    # method reaches (2,000 steps: 0.0266 against 0.0268 of |x| for atc with
    # d = 2; 0.0826 and 0.0826 for awc).
    plain, delayed = (
        jax.jit(jf.simulate(train(getattr(jfo, method)(optax.sgd(lr), delay=d), problem, N,
                                  2000), topo))(problem.A, problem.B)
        for d in (0, delay))
    error = [np.linalg.norm(x.mean(0) - problem.optimum) for x in (plain, delayed)]
    assert abs(error[1] - error[0]) < 0.02 * error[0], error


@pytest.mark.parametrize("method", ["atc", "awc"])
def test_delay_zero_is_the_plain_method(method):
    problem, topo = least_squares(N), T.ring(N)
    lr = 0.5 / problem.lipschitz
    runs = [jax.jit(jf.simulate(train(getattr(jfo, method)(optax.sgd(lr), **kw), problem, N,
                                      10), topo))(problem.A, problem.B)
            for kw in ({}, {"delay": 0})]
    np.testing.assert_array_equal(runs[0], runs[1])


def test_bad_delays_are_refused():
    with pytest.raises(ValueError, match="delay"):
        jfo.atc(optax.sgd(0.1), delay=-1)
    with pytest.raises(ValueError, match="global_every"):
        jfo.atc(optax.sgd(0.1), delay=1, global_every=3)
    with pytest.raises(ValueError, match="communication"):
        jfo.awc(optax.sgd(0.1), delay=1, communication="hierarchical")
    with pytest.raises(ValueError, match="compressor"):
        import jaxfog.compress as C
        jfo.awc(optax.sgd(0.1), delay=1, compressor=C.top_k(0.1))
    with pytest.raises((TypeError, ValueError), match="delay"):
        jfo.awc(optax.sgd(0.1), delay=1.5)


def test_wait_all_waits_for_the_exchanges_left_in_flight():
    problem, topo = least_squares(N), T.ring(N)
    optimizer = jfo.awc(optax.sgd(0.01), delay=2)

    def agent(a, b):
        x = jnp.zeros(problem.A.shape[-1])
        state = optimizer.init(x)
        _, state = optimizer.update(jax.grad(problem.loss(N))(x, a, b), state, x)
        done = jf.wait_all(state)
        return [pair[0] for pair in done.in_flight.exchanges]  # the mixes of what was sent

    first, second = jf.simulate(agent, topo)(problem.A, problem.B)
    np.testing.assert_array_equal(first, 0.0)  # init sent x^0 = 0
    np.testing.assert_allclose(second, 0.0)  # and so did step 0
