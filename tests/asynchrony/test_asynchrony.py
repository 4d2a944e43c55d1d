"""jaxfog.asynchrony on simulated agents: each trainer against its synchronous
counterpart or a numpy model, with every agent stepping together."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.asynchrony as jfa
import jaxfog.optax as jfo
import jaxfog.topology as T
from optax_cases import directed_graph, least_squares

pytestmark = [pytest.mark.jax_internals, pytest.mark.usefixtures("x64")]

N = 4


def _train(trainer, problem, topo, steps, x0):
    loss = problem.loss(topo.size)

    def agent(x, a, b):
        state = trainer.init(x)
        grad_fn = lambda p, k: jax.grad(loss)(p, a, b)  # noqa: E731
        state = jax.lax.fori_loop(0, steps, lambda _, s: trainer.step(s, grad_fn), state)
        return trainer.params(state), state

    out = jax.jit(jf.simulate(agent, topo))(x0, jnp.asarray(problem.A), jnp.asarray(problem.B))
    jf.simulate(lambda x: (jf.win_free(), x)[1], topo)(x0)
    return out


def _x0(problem, n, same=False):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1 if same else n, problem.A.shape[-1]))
    return jnp.asarray(np.broadcast_to(x, (n, x.shape[1])))


def test_async_push_sum_is_push_sum_when_agents_step_together():
    problem, topo = least_squares(N), T.exponential(N)
    lr = 0.5 / problem.lipschitz
    x0 = _x0(problem, N)
    ours, _ = _train(jfa.async_push_sum(optax.sgd(lr)), problem, topo, 40, x0)
    theirs, _ = _train(jfa.from_optax(jfo.push_sum(optax.sgd(lr), topology=topo)), problem,
                       topo, 40, x0)
    np.testing.assert_allclose(ours, theirs, rtol=1e-11, atol=1e-12)


def test_push_sum_is_the_deprecated_name_of_async_push_sum():
    """jaxfog.asynchrony.push_sum, the old name (it read as the synchronous
    jaxfog.optax.push_sum), still gives async_push_sum, and warns."""
    with pytest.warns(FutureWarning, match="jaxfog.asynchrony.async_push_sum"):
        old = jfa.push_sum
    assert old is jfa.async_push_sum
    with pytest.warns(FutureWarning):
        from jaxfog.asynchrony import push_sum
    assert push_sum is old
    assert "push_sum" not in jfa.__all__
    with pytest.raises(AttributeError):
        jfa.no_such_trainer


def test_async_push_sum_consensus_conserves_mass_on_a_directed_graph():
    rng = np.random.default_rng(1)
    n = 5
    topo = directed_graph(n, rng)
    x0 = jnp.asarray(rng.standard_normal((n, 3)))
    trainer = jfa.async_push_sum(optax.sgd(0.0))

    def agent(x):
        state = trainer.init(x)
        zero = lambda p, k: jnp.zeros_like(p)  # noqa: E731
        state = jax.lax.fori_loop(0, 300, lambda _, s: trainer.step(s, zero), state)
        return state.params, state.opt_state.numerator, state.opt_state.weight

    z, x, p = jax.jit(jf.simulate(agent, topo))(x0)
    jf.simulate(lambda v: (jf.win_free(), v)[1], topo)(x0)
    mean = np.asarray(x0).mean(0)
    np.testing.assert_allclose(np.asarray(x).sum(0) / np.asarray(p).sum(), mean, rtol=1e-12)
    np.testing.assert_allclose(z, np.broadcast_to(mean, z.shape), atol=1e-10)
    assert not np.allclose(np.asarray(p), 1.0)  # a non-regular graph: the weights moved


def test_hop_with_no_slack_is_atc():
    problem, topo = least_squares(N), T.exponential(N)
    lr = 0.5 / problem.lipschitz
    x0 = _x0(problem, N, same=True)  # the first combine of equal models is the model
    hop, _ = _train(jfa.hop(optax.sgd(lr), staleness=0, backups=0, skip=False), problem,
                    topo, 30, x0)
    atc, _ = _train(jfa.from_optax(jfo.atc(optax.sgd(lr), topology=topo)), problem, topo, 29,
                    x0)
    np.testing.assert_allclose(hop, atc, rtol=1e-11, atol=1e-12)


def _adpsgd_reference(x0, grads, topo, steps, lr, seed):
    """AD-PSGD with every agent stepping together: reads, then the pairwise
    averages in rank order, then the gradient steps."""
    table, count = jfa._neighbors(topo)
    x = np.array(x0, dtype=np.float64)
    for k in range(steps):
        g = np.stack([grads(i, x[i]) for i in range(len(x))])
        for a in range(len(x)):
            b = table[a, jfa.pick(seed, a, k, int(count[a]))]
            x[a] = x[b] = (x[a] + x[b]) / 2
        x -= lr * g
    return x


def test_adpsgd_against_numpy():
    problem, topo = least_squares(N), T.ring(N)
    lr = 0.3 / problem.lipschitz
    x0 = _x0(problem, N)
    ours, _ = _train(jfa.adpsgd(optax.sgd(lr), seed=3), problem, topo, 25, x0)
    A, B, ridge = problem.A, problem.B, problem.ridge / N
    expected = _adpsgd_reference(
        x0, lambda i, x: A[i].T @ (A[i] @ x - B[i]) + ridge * x, topo, 25, lr, 3)
    np.testing.assert_allclose(ours, expected, rtol=1e-10, atol=1e-12)


def test_adpsgd_pair_averages_conserve_the_sum():
    topo = T.ring(5)
    x0 = jnp.asarray(np.random.default_rng(2).standard_normal((5, 7)))
    trainer = jfa.adpsgd(optax.sgd(0.0), seed=11)

    def agent(x):
        state = trainer.init(x)
        zero = lambda p, k: jnp.zeros_like(p)  # noqa: E731
        state = jax.lax.fori_loop(0, 200, lambda _, s: trainer.step(s, zero), state)
        return trainer.params(state)

    x = jax.jit(jf.simulate(agent, topo))(x0)
    jf.simulate(lambda v: (jf.win_free(), v)[1], topo)(x0)
    np.testing.assert_allclose(np.asarray(x).sum(0), np.asarray(x0).sum(0), rtol=1e-12)
    np.testing.assert_allclose(x, np.broadcast_to(np.asarray(x0).mean(0), x.shape), atol=1e-8)


@pytest.mark.parametrize("x64", [True, False])
def test_pick_is_the_same_in_numpy_and_jax(x64):
    with jax.enable_x64(x64):
        got = jax.jit(jax.vmap(lambda r, k: jfa.pick(7, r, k, 3)))(
            jnp.arange(50) % 5, jnp.arange(50))
    assert [int(v) for v in got] == [jfa.pick(7, r % 5, r, 3) for r in range(50)]
    assert set(int(v) for v in got) == {0, 1, 2}


def test_bad_arguments():
    with pytest.raises(ValueError, match="staleness"):
        jfa.hop(optax.sgd(0.1), staleness=-1)
    with pytest.raises(ValueError, match="backups"):
        jfa.hop(optax.sgd(0.1), backups=-2)
    trainer = jfa.hop(optax.sgd(0.1), backups=2)
    with pytest.raises(ValueError, match="in-degree"):
        jf.simulate(trainer.init, T.ring(4))(jnp.zeros((4, 2)))
    schedule = T.Schedule([T.ring(4), T.star(4)])
    with pytest.raises(TypeError, match="static Topology"):
        jf.simulate(jfa.adpsgd(optax.sgd(0.1)).init, schedule)(jnp.zeros((4, 2)))


def test_adpsgd_least_squares_reaches_a_neighbourhood_that_shrinks_with_the_step():
    # Lian et al.: with full gradients and a constant step gamma, AD-PSGD on
    # heterogeneous data settles within O(gamma) of the optimum (no exact
    # convergence); halving gamma about halves the distance.
    problem, topo = least_squares(N), T.ring(N)
    loss = problem.loss(N)

    def distance(lr):
        trainer = jfa.adpsgd(optax.sgd(lr), seed=1)

        def agent(x, a, b):
            state = jfa.run(trainer, trainer.init(x), lambda p, k: jax.grad(loss)(p, a, b),
                            4000)
            return trainer.params(state)

        x = np.asarray(jax.jit(jf.simulate(agent, topo))(
            jnp.zeros((N, problem.A.shape[-1])), jnp.asarray(problem.A),
            jnp.asarray(problem.B)))
        jf.simulate(lambda v: (jf.win_free(), v)[1], topo)(jnp.zeros(N))
        return np.linalg.norm(x.mean(0) - problem.optimum) / np.linalg.norm(problem.optimum)

    big, small = distance(0.2 / problem.lipschitz), distance(0.1 / problem.lipschitz)
    assert big < 0.1 and 0.3 * big < small < 0.75 * big, (big, small)
