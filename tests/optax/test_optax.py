"""jaxfog.optax on simulated agents: exact methods reach the centralized
optimum of heterogeneous least squares and logistic regression; diffusion
stalls at a bias that shrinks with the step size; push-sum averages exactly on
a directed graph."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.optax as jfo
import jaxfog.topology as T
import optax_cases as oc

pytestmark = [pytest.mark.jax_internals, pytest.mark.numerical, pytest.mark.usefixtures("x64")]


def run(optimizer, topology, problem: oc.Problem, steps: int):
    """Relative distance of every agent's iterate to the centralized optimum."""
    n = topology.size
    X = jax.jit(jf.simulate(oc.train(optimizer, problem, n, steps), topology))(
        problem.A, problem.B)
    return np.linalg.norm(X - problem.optimum, axis=1) / np.linalg.norm(problem.optimum)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("make_problem", [oc.least_squares, oc.logistic])
def test_exact_methods_reach_the_centralized_optimum(make_problem, n):
    problem = make_problem(n)
    for name, optimizer, topology, steps in oc.exact_cases(n, problem):
        assert run(optimizer, topology, problem, steps).max() < 1e-8, name


def test_time_varying_graph_in_the_state():
    n = 8
    problem = oc.least_squares(n)
    schedule = T.one_peer_exponential(n)
    optimizer = jfo.exact_diffusion(1.0 / problem.lipschitz, topology=schedule)
    assert run(optimizer, T.exponential(n), problem, 4000).max() < 1e-8


@pytest.mark.parametrize("make_problem", [oc.least_squares, oc.logistic])
@pytest.mark.parametrize("make", [jfo.atc, jfo.awc])
def test_diffusion_stalls_at_a_bias_that_shrinks_with_the_step(make, make_problem):
    n = 4
    problem = make_problem(n)
    lr = 0.5 / problem.lipschitz  # AWC needs lr < (1 + lambda_min(W)) / L
    ring = T.ring(n)
    big = run(make(optax.sgd(lr), topology=ring), ring, problem, 3000)
    small = run(make(optax.sgd(lr / 4), topology=ring), ring, problem, 12000)
    assert 1e-5 < small.max() < 0.5 * big.max() < 0.25
    if make is jfo.atc:  # averaging globally every step is gradient descent: exact
        every = run(make(optax.sgd(lr), topology=ring, global_every=1), ring, problem, 6000)
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


def test_atc_unfused_gives_the_fused_iterates():
    """fused=False gives the fused iterates (numpy: W (x + u)); the messages
    per leaf on MPI processes: tests/optax/test_optax_mpi.py."""
    n, steps = 4, 5
    schedule = T.one_peer_exponential(n)
    X = np.random.default_rng(3).standard_normal((n, 6)).astype(np.float32)

    def split(x):
        return {"a": x[:2], "b": x[2:3], "c": x[3:]}  # leaves in order a, b, c

    def agent(x, fused, global_every=None):
        opt = jfo.atc(optax.sgd(0.1, momentum=0.5), topology=schedule, fused=fused,
                      global_every=global_every)
        params = split(x)
        state = opt.init(params)
        for _ in range(steps):
            grads = jax.tree.map(lambda p: p - 1.0, params)
            updates, state = opt.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return jnp.concatenate([params["a"], params["b"], params["c"]])

    for global_every in (2, None):
        fused = jax.jit(jf.simulate(lambda x: agent(x, True, global_every), n))(X)
        unfused = jax.jit(jf.simulate(lambda x: agent(x, False, global_every), n))(X)
        np.testing.assert_array_equal(unfused, fused)
    x, v = X.astype(np.float64), np.zeros_like(X, np.float64)
    for k in range(steps):
        v = (x - 1.0) + 0.5 * v
        x = schedule.at(k).weights @ (x - 0.1 * v)
    np.testing.assert_allclose(fused, x, rtol=2e-6, atol=1e-6)  # global_every=None

    with pytest.raises(ValueError, match="fused=False starts each leaf's exchange"):
        jfo.atc(optax.sgd(0.1), delay=1, fused=False)
    with pytest.raises(TypeError, match="fused must be True or False"):
        jfo.atc(optax.sgd(0.1), fused=0)


def test_atc_composes_with_chain_and_schedules():
    """atc(chain(clip, sgd(schedule))) is W (x + u) with u from the chain, by numpy."""
    n, steps = 4, 3
    ring = T.ring(n)
    schedule = optax.linear_schedule(0.5, 0.1, steps)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(schedule))
    X = np.random.default_rng(1).standard_normal((n, 3))
    target = np.random.default_rng(2).standard_normal((n, 3))

    def agent(x, t):
        opt = jfo.atc(inner, topology=ring)
        state = opt.init(x)
        for _ in range(steps):
            updates, state = opt.update(x - t, state, x)
            x = optax.apply_updates(x, updates)
        return x

    got = jax.jit(jf.simulate(agent, ring))(X, target)
    x = X.copy()
    for k in range(steps):
        g = x - target
        g = g * np.minimum(1.0, 1.0 / np.linalg.norm(g, axis=1, keepdims=True))
        x = ring.weights @ (x - float(schedule(k)) * g)
    np.testing.assert_allclose(got, x, rtol=1e-6)  # optax schedules compute in float32


def test_gradient_methods_follow_gradient_transformations_in_a_chain():
    """chain(clip, exact_diffusion): the clipping is applied before the step."""
    n = 4
    X = np.zeros((n, 2))
    big = np.full((n, 2), 100.0)

    def agent(x, g):
        opt = optax.chain(optax.clip(0.5), jfo.exact_diffusion(1.0, topology=T.ring(n)))
        updates, _ = opt.update(g, opt.init(x), x)
        return optax.apply_updates(x, updates)

    got = jax.jit(jf.simulate(agent, n))(X, big)
    np.testing.assert_allclose(got, np.full((n, 2), -0.5), rtol=1e-12)
