"""jaxfog.simulate(..., delays=...): simulated time for simulated agents.

Zero delays reproduce the synchronous iterates; clocks follow a numpy model
of the same rules; puts become visible after their delay; a seed fixes a run."""

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
from jaxfog.simulation import _clock as sc
from optax_cases import directed_graph, least_squares

pytestmark = [pytest.mark.jax_internals, pytest.mark.usefixtures("x64")]

N = 4


@pytest.fixture(autouse=True)
def _fresh_clocks():
    jf.reset_clocks()


def _train(trainer, problem, topo, iterations, x0, delays=None, lr_grad=True):
    loss = problem.loss(topo.size)
    jf.reset_clocks()

    def agent(x, a, b):
        state = trainer.init(x)
        grad_fn = (lambda p, k: jax.grad(loss)(p, a, b)) if lr_grad else (  # noqa: E731
            lambda p, k: jnp.zeros_like(p))
        state = jfa.run(trainer, state, grad_fn, iterations)
        return trainer.params(state), state.iteration, jfa.now()

    out = jax.jit(jf.simulate(agent, topo, delays=delays))(
        x0, jnp.asarray(problem.A), jnp.asarray(problem.B))
    jf.simulate(lambda x: (jf.win_free(), x)[1], topo)(x0)
    return [np.asarray(v) for v in out]


def _x0(problem, n, same=False):
    x = np.random.default_rng(0).standard_normal((1 if same else n, problem.A.shape[-1]))
    return jnp.asarray(np.broadcast_to(x, (n, x.shape[1])))


@pytest.mark.parametrize("delays", [None, jf.Delays(compute=0.5)], ids=["none", "equal"])
def test_equal_speeds_reproduce_the_synchronous_iterates(delays):
    problem, topo = least_squares(N), T.exponential(N)
    lr = 0.5 / problem.lipschitz
    x0, same = _x0(problem, N), _x0(problem, N, same=True)
    atc = jfa.from_optax(jfo.atc(optax.sgd(lr), topology=topo))
    pairs = [
        (jfa.async_push_sum(optax.sgd(lr)),
         jfa.from_optax(jfo.push_sum(optax.sgd(lr), topology=topo)), x0, 0),
        (jfa.hop(optax.sgd(lr), staleness=0, backups=0, skip=False), atc, same, 1),
    ]
    for trainer, synchronous, x, shift in pairs:
        ours, k, now = _train(trainer, problem, topo, 30, x, delays)
        theirs, _, _ = _train(synchronous, problem, topo, 30 - shift, x)
        np.testing.assert_allclose(ours, theirs, rtol=1e-11, atol=1e-12)
        assert (k == 30).all()
        np.testing.assert_allclose(now, 0.0 if delays is None else 15.0)


def test_synchronous_clocks_follow_the_slowest_in_neighbour():
    rng = np.random.default_rng(3)
    topo = T.exponential(5)
    delays = jf.Delays(compute=rng.uniform(1, 3, 5), message=rng.uniform(0, 0.5, (5, 5)),
                       jitter=0.2, seed=4)
    problem = least_squares(5)
    _, _, now = _train(jfa.from_optax(jfo.atc(optax.sgd(0.01), topology=topo)), problem,
                       topo, 12, _x0(problem, 5), delays)
    # The model: t_i = max(t_i + c_i(k), max_j in(i) (t_j + c_j(k) + d[j, i])).
    timing = delays._resolve(5)
    t = np.zeros(5)
    ins = (topo.weights != 0) & ~np.eye(5, dtype=bool)
    for k in range(12):
        c = np.asarray(jax.vmap(lambda r: _compute(timing, r, k))(jnp.arange(5)))
        done = t + c
        t = np.array([max(done[i], *(done[j] + timing.message[j, i]
                                     for j in np.flatnonzero(ins[i]))) for i in range(5)])
    np.testing.assert_allclose(now, t, rtol=1e-12)


def _compute(timing, rank, k):
    u = sc._uniform(timing.seed, rank, k)
    return jnp.asarray(timing.compute)[rank] * (1 + timing.jitter * (2 * u - 1))


def test_a_put_is_visible_after_its_delay():
    topo = T.ring(4)
    x0 = jnp.arange(4.0)[:, None] * jnp.ones((4, 2))

    def agent(x):
        jf.win_create(x, "w", zero_init=True)
        jf.win_put(x + 10.0, "w")                        # leaves at t = 0, arrives at t = 2
        before = jf.win_update(x, "w", self_weight=0.0)  # t = 0: nothing has arrived
        jf.barrier()                                     # the clocks move to 0 + 2
        after = jf.win_update(x, "w", self_weight=0.0)
        t = jfa.now()
        jf.win_free("w")
        return before, after, t

    before, after, t = jax.jit(jf.simulate(agent, topo, delays=jf.Delays(message=2.0)))(x0)
    w = topo.weights * ~np.eye(4, dtype=bool)
    np.testing.assert_allclose(before, 0.0)
    np.testing.assert_allclose(after, w @ (np.asarray(x0) + 10.0), rtol=1e-12)
    np.testing.assert_allclose(t, 2.0)


def test_straggler_runs_are_reproducible_and_asynchronous_agents_do_not_wait():
    problem, topo = least_squares(N), T.exponential(N)
    lr = 0.3 / problem.lipschitz

    def delays(seed):
        return jf.Delays.straggler(N, 4.0, message=np.random.default_rng(seed).uniform(
            0.05, 0.3, (N, N)), jitter=0.3, seed=seed)

    for make in (lambda: jfa.async_push_sum(optax.sgd(lr)),
                 lambda: jfa.adpsgd(optax.sgd(lr), seed=2),
                 lambda: jfa.hop(optax.sgd(lr), staleness=None, backups=1)):
        first = _train(make(), problem, topo, 20, _x0(problem, N), delays(1))
        again = _train(make(), problem, topo, 20, _x0(problem, N), delays(1))
        other = _train(make(), problem, topo, 20, _x0(problem, N), delays(2))
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(first[0], other[0])
        # The fast agents finish their 20 steps of about 1 s in about 20 s.
        assert (first[2][1:] < 20 * 1.3 + 1).all(), first[2]


def test_push_sum_mass_is_exact_once_the_messages_in_flight_land():
    rng = np.random.default_rng(5)
    n = 5
    topo = directed_graph(n, rng)
    x0 = jnp.asarray(rng.standard_normal((n, 3)))
    trainer = jfa.async_push_sum(optax.sgd(0.0))
    delays = jf.Delays.straggler(n, 3.0, message=rng.uniform(0.1, 2.0, (n, n)), jitter=0.5)

    def agent(x):
        state = trainer.init(x)
        state = jfa.run(trainer, state, lambda p, k: jnp.zeros_like(p), 200)
        state = trainer.finish(state)  # past every arrival: what is in flight is collected
        return state.opt_state.numerator, state.opt_state.weight, state.params

    x, p, z = jax.jit(jf.simulate(agent, topo, delays=delays))(x0)
    jf.simulate(lambda v: (jf.win_free(), v)[1], topo)(x0)
    mean = np.asarray(x0).mean(0)
    np.testing.assert_allclose(np.asarray(p).sum(), n, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(x).sum(0) / np.asarray(p).sum(), mean, rtol=1e-12)
    np.testing.assert_allclose(z, np.broadcast_to(mean, z.shape), atol=1e-6)


def test_hop_waits_for_its_bounds_in_simulated_time():
    problem, topo = least_squares(N), T.exponential(N)
    lr = 0.3 / problem.lipschitz
    straggler = jf.Delays.straggler(N, 4.0, message=0.1)
    # Staleness 2, no backups: the fast agents wait for the straggler.
    _, k, now = _train(jfa.hop(optax.sgd(lr), staleness=2, backups=0, skip=False), problem,
                       topo, 20, _x0(problem, N), straggler)
    assert (k == 20).all() and (now[1:] >= 4.0 * (20 - 2 - 1)).all(), now
    # A backup worker and no bound: they do not.
    _, k, now = _train(jfa.hop(optax.sgd(lr), staleness=None, backups=1), problem, topo, 20,
                       _x0(problem, N), jf.Delays.straggler(N, 1e6, message=0.1))
    assert (k >= 20).all() and (now[1:] < 20 * 1.1 + 1).all(), now


def test_bad_delays():
    with pytest.raises(ValueError, match="compute"):
        jf.simulate(lambda x: x, T.ring(4), delays=jf.Delays(compute=[1.0, 2.0]))
    with pytest.raises(ValueError, match="message"):
        jf.simulate(lambda x: x, T.ring(4), delays=jf.Delays(message=-1.0))
    with pytest.raises(ValueError, match="jitter"):
        jf.simulate(lambda x: x, T.ring(4), delays=jf.Delays(jitter=1.0))
    with pytest.raises(TypeError, match="Delays"):
        jf.simulate(lambda x: x, T.ring(4), delays=2.0)


def test_pair_gossip_with_traced_peers():
    x0 = jnp.arange(6.0)[:, None] * jnp.ones((6, 3))
    out = jax.jit(jf.simulate(lambda x: jf.pair_gossip(x, jf.rank() ^ 1), 6))(x0)
    expected = np.asarray(x0)[np.arange(6) ^ 1]
    np.testing.assert_allclose(out, (np.asarray(x0) + expected) / 2)
    # 0 and 1 name 2, who pairs with 3: NaN for them rather than a wrong number.
    bad = np.asarray(jax.jit(jf.simulate(lambda x: jf.pair_gossip(x, jnp.asarray(
        [2, 2, 3, 2])[jf.rank()]), 4))(x0[:4]))
    assert np.isnan(bad[:2]).all()
    np.testing.assert_allclose(bad[2:], np.broadcast_to((x0[2] + x0[3]) / 2, (2, 3)))
    with pytest.raises(ValueError, match="not a rank"):
        jf.simulate(lambda x: jf.pair_gossip(x, 9), 4)(x0[:4])


def test_run_until_a_simulated_time_in_chunks():
    topo = T.exponential(N)
    trainer = jfa.async_push_sum(optax.sgd(0.1))
    x0 = jnp.asarray(np.random.default_rng(6).standard_normal((N, 3)))
    grad_fn = lambda p, k: p  # noqa: E731
    init = jf.simulate(trainer.init, topo)
    step = jax.jit(jf.simulate(lambda s, t: (jfa.run(trainer, s, grad_fn, 10**6, until=t),
                                             jfa.now()), topo,
                               delays=jf.Delays.straggler(N, 4.0), in_axes=(0, None)))
    state = init(x0)
    for until in (10.0, 20.0):
        state, now = step(state, until)
        # Steps of 1 s (4 s for agent 0) start while the clock is below `until`.
        np.testing.assert_allclose(now, [4 * np.ceil(until / 4)] + [until] * 3)
        np.testing.assert_array_equal(state.iteration, [np.ceil(until / 4)] + [until] * 3)
    jf.simulate(lambda v: (jf.win_free(), v)[1], topo)(x0)
    with pytest.raises(ValueError, match="asynchronous"):
        jfa.run(jfa.from_optax(optax.sgd(0.1)), None, grad_fn, 3, until=1.0)


def test_hop_in_a_loop_without_x64():
    # Hop's integer counters are averaged in float64 even with x64 off, also
    # inside the run loop (a dot there once came out float32).
    trainer = jfa.hop(optax.sgd(0.1), staleness=2, backups=1)
    topo = T.exponential(N)
    with jax.enable_x64(False):
        x = jnp.ones((N, 2), jnp.float32)
        out = jax.jit(jf.simulate(lambda v: jfa.run(trainer, trainer.init(v), lambda p, k: p,
                                                    3).iteration, topo,
                                  delays=jf.Delays.straggler(N, 2.0, message=0.5)))(x)
        jf.simulate(lambda v: (jf.win_free(), v)[1], topo)(x)
    assert (np.asarray(out) >= 3).all()


def test_clocks_carry_over_between_simulated_functions_until_reset():
    delays = jf.Delays(message=1.0)
    first = jf.simulate(lambda x: (jf.barrier(), jfa.now())[1], N, delays=delays)
    second = jax.jit(jf.simulate(lambda x: (jf.barrier(), jfa.now())[1], N, delays=delays))
    x = jnp.zeros(N)
    np.testing.assert_allclose(first(x), 1.0)
    np.testing.assert_allclose(second(x), 2.0)
    jf.reset_clocks()
    np.testing.assert_allclose(second(x), 1.0)
