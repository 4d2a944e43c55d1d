"""Delayed averaging (``atc``/``awc`` with ``delay=d``) on simulated agents,
against a numpy model of the update equations; ``delay=0`` is the plain
method; ``finish`` merges the exchanges in flight as the next ``d`` steps
with no inner update would, and training goes on after it. On 2 MPI
processes: the simulation's iterates, finish included, and no handle left for
``jaxfog.shutdown`` to report. (The delayed cases of
``optax_cases.all_cases`` also run on MPI processes.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.optax as jfo
import jaxfog.topology as T
from mpi_harness import mpi_test
from optax_cases import least_squares, train

pytestmark = [pytest.mark.jax_internals, pytest.mark.numerical, pytest.mark.usefixtures("x64")]

N, STEPS = 4, 25


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


# --- finish ---------------------------------------------------------------------------


def _weights(topology, step):
    return (topology.at(step) if isinstance(topology, T.Schedule) else topology).weights


def _reference_with_finish(problem, topology, lr, delay, mix_params, segments):
    """The delayed recursion with ``finish`` after each segment of steps (the
    iterate after every step and after every finish). An exchange is ``(y,
    W)``: the value sent at step k and W of step k (``init`` sends x^0 with
    W of step 0). A step merges the oldest, ``x+ = W_ii y_i + sum_{j != i}
    W_ij old_j`` (+ u for awc), and sends y; finish merges every exchange in
    flight, oldest first, ``x <- W_ii x + sum_{j != i} W_ij old_j``, and
    leaves idle ones (``None``), which a step merges as ``x+ = y`` (+ u)."""
    A, B = problem.A, problem.B
    grad = jax.vmap(jax.grad(problem.loss(N)))
    x = np.zeros((N, A.shape[-1]))
    queue = [(x, _weights(topology, 0))] * delay
    path, k = [], 0

    def merge(value, exchange):
        if exchange is None:
            return value
        old, W = exchange
        diagonal = np.diag(np.diag(W))
        return diagonal @ value + (W - diagonal) @ old

    for steps in segments:
        for _ in range(steps):
            u = -lr * np.asarray(grad(jnp.asarray(x), A, B))
            y = x if mix_params else x + u
            queue.append((y, _weights(topology, k)))
            x = merge(y, queue.pop(0)) + (u if mix_params else 0)
            path.append(x)
            k += 1
        for exchange in queue:
            x = merge(x, exchange)
        queue = [None] * delay
        path.append(x)
    return np.stack(path, axis=1)


def _with_finish(optimizer, problem, segments):
    """Per-agent training: each segment of steps in a ``lax.scan`` (the state
    carried, handles included), then ``finish``; the iterate after every step
    and after every finish."""
    loss = problem.loss(N)

    def agent(a, b):
        def step(carry, _):
            x, state = carry
            updates, state = optimizer.update(jax.grad(loss)(x, a, b), state, x)
            x = optax.apply_updates(x, updates)
            return (x, state), x

        x = jnp.zeros(problem.A.shape[-1], a.dtype)
        state = optimizer.init(x)
        structure = jax.tree.structure(state)
        path = []
        for steps in segments:
            (x, state), xs = jax.lax.scan(step, (x, state), None, length=steps)
            updates, state = optimizer.finish(state, x)
            assert jax.tree.structure(state) == structure  # scan carries it on
            x = optax.apply_updates(x, updates)
            path += [xs, x[None]]
        return jnp.concatenate(path)

    return agent


@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("method", ["atc", "awc"])
@pytest.mark.parametrize("graph", ["exponential", "one-peer schedule"])
def test_finish_merges_the_exchanges_in_flight_and_training_goes_on(method, delay, graph):
    problem = least_squares(N)
    topology = T.exponential(N) if graph == "exponential" else T.one_peer_exponential(N)
    lr = 0.5 / problem.lipschitz
    optimizer = getattr(jfo, method)(optax.sgd(lr), topology=topology, delay=delay)
    # 1 step: finish merges init's x^0 with step 0's exchange; then finish
    # after finish (nothing in flight: zero updates), then steps after it.
    segments = (1, 6, 0, 5) if delay == 2 else (6, 0, 5)
    got = jax.jit(jf.simulate(_with_finish(optimizer, problem, segments), topology))(
        problem.A, problem.B)
    want = _reference_with_finish(problem, topology, lr, delay, method == "awc", segments)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    # Not the unfinished path: the finish moved the iterates.
    plain = jax.jit(jf.simulate(train(optimizer, problem, N, segments[0], every_step=True),
                                topology))(problem.A, problem.B)
    assert np.abs(np.asarray(got)[:, segments[0]] - np.asarray(plain)[:, -1]).max() > 1e-6


@pytest.mark.parametrize("method", ["atc", "awc"])
def test_finish_of_the_delayed_consensus_is_the_average(method):
    """On a doubly stochastic W, with u = 0 from the start, the recursion keeps
    the agents' mean; a finish then keeps it too."""
    topology = T.ring(N)
    optimizer = getattr(jfo, method)(optax.sgd(0.0), topology=topology, delay=2)

    def agent(x):
        state = optimizer.init(x)
        for _ in range(3):
            updates, state = optimizer.update(jnp.zeros_like(x), state, x)
            x = optax.apply_updates(x, updates)
        updates, state = optimizer.finish(state, x)
        return optax.apply_updates(x, updates)

    X = np.arange(N * 2.0).reshape(N, 2) ** 2
    got = np.asarray(jax.jit(jf.simulate(agent, topology))(X))
    np.testing.assert_allclose(got.mean(0), X.mean(0), rtol=1e-13)


@pytest.mark.parametrize("kwargs", [{}, {"delay": 0}, {"fused": False},
                                    {"communication": "allreduce"}])
@pytest.mark.parametrize("method", ["atc", "awc"])
def test_finish_without_delay_gives_zero_updates_and_the_state(method, kwargs):
    if method == "awc" and "fused" in kwargs:
        kwargs = {"compressor": jf.compress.top_k(0.5)}
    optimizer = getattr(jfo, method)(optax.adam(0.1), **kwargs)

    def agent(x):
        state = optimizer.init(x)
        updates, state = optimizer.update(x, state, x)
        x = optax.apply_updates(x, updates)
        zero, after = optimizer.finish(state, x)
        return zero, state, after

    zero, before, after = jax.jit(jf.simulate(agent, T.ring(N)))(
        np.arange(N * 3.0).reshape(N, 3))
    np.testing.assert_array_equal(zero, 0.0)
    jax.tree.map(np.testing.assert_array_equal, before, after)
    with pytest.raises(ValueError, match="params"):
        jf.simulate(lambda x: optimizer.finish(optimizer.init(x), None), N)(np.ones((N, 3)))


def test_the_transformation_stays_an_optax_one():
    """A Diffusion is an optax.GradientTransformationExtraArgs: it chains (and
    check_chain still finds it), and its finish survives mixes_parameters."""
    import warnings

    for kwargs in ({}, {"delay": 1}):
        optimizer = jfo.atc(optax.sgd(0.1), **kwargs)
        assert isinstance(optimizer, jfo.Diffusion)
        assert isinstance(optimizer, optax.GradientTransformationExtraArgs)
        assert callable(optimizer.finish)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jfo.check_chain(optax.chain(optax.clip(1.0), optimizer))
        with pytest.warns(UserWarning, match="atc is followed by 1 other"):
            jfo.check_chain(optax.chain(optimizer, optax.clip(1.0)))
    chained = optax.chain(optax.clip(1.0), jfo.awc(optax.sgd(0.1), delay=1))

    alone = jfo.atc(optax.sgd(0.1), delay=1)

    def agent(x):
        state = chained.init(x)
        updates, state = chained.update(x, state, x)
        x = optax.apply_updates(x, updates)
        own = alone.init(x)  # jit of the bound methods (a weak reference to update)
        updates, own = jax.jit(alone.update)(x, own, x)
        updates, own = jax.jit(alone.finish)(own, optax.apply_updates(x, updates))
        return x, jf.wait_all(state)

    x, _ = jax.jit(jf.simulate(agent, T.ring(N)))(np.arange(N * 1.0)[:, None])
    assert np.isfinite(np.asarray(x)).all()


@mpi_test(nprocs=(2,), timeout=180, x64=True)
def test_finish_on_mpi_matches_the_simulation_and_leaves_nothing_in_flight():
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.optax as jfo
    import jaxfog.topology as T
    import optax_cases as oc
    from mpi4py import MPI

    jf.init()
    r, n = jf.rank(), jf.size()
    problem = oc.logistic(n)
    loss = problem.loss(n)
    lr = 0.5 / problem.lipschitz
    schedule = T.one_peer_exponential(n)
    cases = [("atc delay=2 one-peer", jfo.atc(optax.sgd(lr), topology=schedule, delay=2)),
             ("awc delay=1 allreduce",
              jfo.awc(optax.sgd(lr), communication="allreduce", delay=1)),
             ("atc delay=1 exponential", jfo.atc(optax.sgd(lr, momentum=0.5), delay=1))]
    segments = (5, 3)

    def run(optimizer, a, b, step, finish):
        """The iterate after every step and every finish: each step and each
        finish a separate call on MPI (the handles cross calls)."""
        x = jnp.zeros(problem.A.shape[-1], a.dtype)
        state = optimizer.init(x)
        path = []
        for steps in segments:
            for _ in range(steps):
                x, state = step(x, state, a, b)
                path.append(x)
            x, state = finish(x, state)
            path.append(x)
        return jnp.stack(path), state

    for name, optimizer in cases:
        def step(x, state, a, b, optimizer=optimizer):
            updates, state = optimizer.update(jax.grad(loss)(x, a, b), state, x)
            return optax.apply_updates(x, updates), state

        def finish(x, state, optimizer=optimizer):
            updates, state = optimizer.finish(state, x)
            return optax.apply_updates(x, updates), state

        jf.set_topology(T.exponential(n))
        mine, state = run(optimizer, problem.A[r], problem.B[r], jf.jit(step),
                          jf.jit(finish))
        jf.wait_all(state)  # after finish every exchange is idle: safe
        every_rank = MPI.COMM_WORLD.gather(np.asarray(mine))
        if r == 0:
            simulated = np.asarray(jax.jit(jf.simulate(
                lambda a, b: run(optimizer, a, b, step, finish)[0], T.exponential(n)))(
                    problem.A, problem.B))
            np.testing.assert_allclose(np.stack(every_rank), simulated, rtol=1e-11,
                                       atol=1e-13, err_msg=name)
            assert np.abs(simulated[:, segments[0]] - simulated[:, segments[0] - 1]).max() \
                > 1e-6, name  # the finish moved the iterates
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a handle never waited for would warn here
        jf.shutdown()


@mpi_test(nprocs=(2,), timeout=120)
def test_without_finish_shutdown_reports_the_exchanges_in_flight():
    import warnings

    import jax
    import jax.numpy as jnp
    import optax

    import jaxfog as jf
    import jaxfog.optax as jfo

    jf.init()
    optimizer = jfo.awc(optax.sgd(0.1), delay=2)
    x = jnp.full(3, float(jf.rank()))
    state = optimizer.init(x)
    updates, state = jax.jit(optimizer.update)(x, state, x)
    jax.block_until_ready(updates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jf.shutdown()
    messages = [str(w.message) for w in caught]
    assert any("2 nonblocking op(s) never waited for" in m for m in messages), messages


def test_a_trainer_of_a_delayed_method_finishes_what_is_in_flight():
    """jaxfog.asynchrony.from_optax: the trainer's finish is the optimizer's."""
    import jaxfog.asynchrony as jfa

    problem, topology = least_squares(N), T.one_peer_exponential(N)
    lr = 0.5 / problem.lipschitz
    loss = problem.loss(N)
    trainer = jfa.from_optax(jfo.atc(optax.sgd(lr), topology=topology, delay=2))

    def agent(a, b):
        state = trainer.init(jnp.zeros(problem.A.shape[-1], a.dtype))
        grad_fn = lambda x, k: jax.grad(loss)(x, a, b)  # noqa: E731
        for _ in range(5):
            state = trainer.step(state, grad_fn)
        return trainer.params(trainer.finish(state))

    got = jax.jit(jf.simulate(agent, topology))(problem.A, problem.B)
    want = _reference_with_finish(problem, topology, lr, 2, False, (5,))[:, -1]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", ["atc", "awc"])
def test_finish_in_float32_as_a_user_writes_it(method):
    """JAX's default dtype, a params dict, optax.adam inside: the float32 run
    (updates and finish) follows the same program in float64, keeps float32,
    and the finish moves the parameters."""
    topology = T.ring(N)
    targets = np.arange(N * 3.0).reshape(N, 3)

    def run(dtype):
        optimizer = getattr(jfo, method)(optax.adam(0.05), topology=topology, delay=1)

        def agent(target):
            params = {"w": jnp.zeros(2, dtype), "b": jnp.zeros((), dtype)}
            loss = lambda p: jnp.sum((p["w"] - target[:2]) ** 2) + (p["b"] - target[2]) ** 2
            state = optimizer.init(params)
            for _ in range(5):
                updates, state = optimizer.update(jax.grad(loss)(params), state, params)
                params = optax.apply_updates(params, updates)
            updates, state = optimizer.finish(state, params)
            return params, optax.apply_updates(params, updates)

        return jax.jit(jf.simulate(agent, topology))(targets.astype(dtype))

    with jax.enable_x64(False):
        before32, after32 = run(jnp.float32)
    before64, after64 = run(jnp.float64)
    for leaf in jax.tree.leaves((before32, after32)):
        assert leaf.dtype == jnp.float32
    for k in ("w", "b"):
        np.testing.assert_allclose(np.asarray(after32[k]), np.asarray(after64[k]),
                                   rtol=1e-5, atol=1e-6)
        assert np.abs(np.asarray(after64[k]) - np.asarray(before64[k])).max() > 1e-3
