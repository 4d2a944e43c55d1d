"""jaxfog.optax on simulated agents: exact methods reach the centralized
optimum of heterogeneous least squares; diffusion stalls at a bias that
shrinks with the step size; push-sum averages exactly on a directed graph."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.optax as jfo
import jaxfog.topology as T


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def least_squares(n: int):
    """scikit-learn's diabetes rows, sorted by target and split into n blocks
    (heterogeneous), zero-padded to one length; a small ridge for conditioning."""
    from sklearn.datasets import load_diabetes

    features, target = load_diabetes(return_X_y=True)
    a = np.hstack([(features - features.mean(0)) / features.std(0), np.ones((442, 1))])
    b = (target - target.mean()) / target.std()
    order = np.argsort(b, kind="stable")
    a, b = a[order], b[order]
    ridge = 30.0
    x_star = np.linalg.solve(a.T @ a + ridge * np.eye(11), a.T @ b)
    rows = -(-442 // n)
    A, B = np.zeros((n, rows, 11)), np.zeros((n, rows))
    for i, block in enumerate(np.array_split(np.arange(442), n)):
        A[i, :len(block)], B[i, :len(block)] = a[block], b[block]
    lipschitz = max(np.linalg.eigvalsh(A[i].T @ A[i])[-1] for i in range(n)) + ridge / n
    return A, B, x_star, ridge, lipschitz


def run(optimizer, topology, n: int, steps: int):
    """Relative distance of every agent's iterate to the centralized optimum."""
    A, B, x_star, ridge, _ = least_squares(n)

    def agent(a, b):
        def loss(x):
            return 0.5 * jnp.sum((a @ x - b) ** 2) + 0.5 * ridge / n * jnp.sum(x ** 2)

        x0 = jnp.zeros(11)
        state = optimizer.init(x0)

        def step(carry, _):
            x, state = carry
            updates, state = optimizer.update(jax.grad(loss)(x), state, x)
            return (optax.apply_updates(x, updates), state), None

        return jax.lax.scan(step, (x0, state), None, length=steps)[0][0]

    X = jax.jit(jf.simulate(agent, topology))(A, B)
    return np.linalg.norm(X - x_star, axis=1) / np.linalg.norm(x_star)


@pytest.mark.parametrize("n", [4, 8])
def test_exact_methods_reach_the_centralized_optimum(n):
    lr = 1.0 / least_squares(n)[4]
    ring = T.ring(n)
    assert run(jfo.exact_diffusion(lr, topology=ring), ring, n, 2500).max() < 1e-8
    assert run(jfo.gradient_tracking(lr / 2, topology=ring), ring, n, 3000).max() < 1e-8
    assert run(jfo.gradient_allreduce(optax.sgd(lr)), ring, n, 1500).max() < 1e-8
    expo = T.exponential(n)  # directed
    assert run(jfo.push_diging(lr / 4, topology=expo), expo, n, 6000).max() < 1e-8


def test_time_varying_graph_in_the_state():
    n = 8
    lr = 1.0 / least_squares(n)[4]
    schedule = T.one_peer_exponential(n)
    assert run(jfo.exact_diffusion(lr, topology=schedule), n, n, 4000).max() < 1e-8


@pytest.mark.parametrize("make", [jfo.atc, jfo.awc])
def test_diffusion_stalls_at_a_bias_that_shrinks_with_the_step(make):
    n = 4
    lr = 0.5 / least_squares(n)[4]  # AWC needs lr < (1 + lambda_min(W)) / L
    ring = T.ring(n)
    big = run(make(optax.sgd(lr), topology=ring), ring, n, 3000)
    small = run(make(optax.sgd(lr / 4), topology=ring), ring, n, 12000)
    assert 1e-4 < small.max() < big.max() < 0.5
    if make is jfo.atc:  # averaging globally every step is gradient descent: exact
        every = run(make(optax.sgd(lr), topology=ring, global_every=1), ring, n, 6000)
        assert every.max() < 1e-8


def test_push_sum_averages_exactly_on_a_directed_irregular_graph():
    n = 5
    w = np.zeros((n, n))
    for j, outs in {0: [1, 2, 3], 1: [2], 2: [3], 3: [4], 4: [0]}.items():
        for i in outs:
            w[i, j] = 1.0
    directed = T.from_weights(w + np.eye(n), check_connected=False)  # strongly connected
    X = np.random.default_rng(0).standard_normal((n, 3))
    none = optax.GradientTransformation(lambda p: (), lambda g, s, p=None: (g, s))

    def agent(x):
        opt = jfo.push_sum(none, topology=directed)
        state = opt.init(x)

        def step(carry, _):
            x, state = carry
            updates, state = opt.update(jax.tree.map(jnp.zeros_like, x), state, x)
            return (optax.apply_updates(x, updates), state), None

        return jax.lax.scan(step, (x, state), None, length=200)[0][0]

    pushed = jf.simulate(agent, directed)(X)
    np.testing.assert_allclose(pushed, np.tile(X.mean(0), (n, 1)), rtol=1e-10)
    # Plain row-stochastic averaging on the same graph is biased.
    pulled = np.linalg.matrix_power(directed.weights, 200) @ X
    assert np.abs(pulled - X.mean(0)).max() > 1e-2


def test_update_needs_params():
    opt = jfo.exact_diffusion(0.1)
    state = opt.init(jnp.zeros(2))
    with pytest.raises(ValueError, match="needs params"):
        opt.update(jnp.zeros(2), state)
    with pytest.raises(ValueError, match="communication must be one of"):
        jf.simulate(lambda x: jfo.atc(optax.sgd(0.1), communication="gossip").update(
            x, jfo.atc(optax.sgd(0.1)).init(x), x)[0], 2)(jnp.zeros((2, 2)))
