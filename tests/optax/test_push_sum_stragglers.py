"""Asynchronous push-sum with extreme stragglers stays finite and exact, in
float32 and bfloat16 parameters, on simulated agents and on MPI processes.

A fast agent gives a share of its mass to every out-neighbour each step;
while they do not collect, its weight decays geometrically (0/0 = NaN after
about 80 steps in float32). ``async_push_sum`` keeps the share below
``min_push_weight``: the weights stay normal numbers, and since keeping is
still a column-stochastic step the average over agents and slots stays exact.
With zero gradients that average is the mean of the starting values, which
every test checks after draining the slots."""

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
from mpi_harness import mpi_test
from optax_cases import least_squares

N = 4
DTYPES = [jnp.float32, jnp.bfloat16]


def _run_simulated(dtype, delays, until, learn):
    problem, topo = least_squares(N), T.exponential(N)
    loss = problem.loss(N)
    lr = 0.5 / problem.lipschitz if learn else 0.0
    trainer = jfa.async_push_sum(optax.sgd(lr))
    jf.reset_clocks()

    def agent(x, a, b):
        state = trainer.init(x)
        grad_fn = lambda p, k: jax.grad(lambda q: loss(q.astype(jnp.float32), a, b))(p)  # noqa: E731
        state = jfa.run(trainer, state, grad_fn, 10**9, until=until)
        lowest = state.opt_state.weight
        state = trainer.finish(state)  # collects what is in flight
        opt = state.opt_state
        return state.iteration, lowest, trainer.params(state), opt.numerator, opt.weight

    x0 = jnp.asarray(np.random.default_rng(0).standard_normal((N, problem.A.shape[-1])), dtype)
    out = jax.jit(jf.simulate(agent, topo, delays=delays))(
        x0, jnp.asarray(problem.A, jnp.float32), jnp.asarray(problem.B, jnp.float32))
    jf.simulate(lambda v: (jf.win_free(), v)[1], topo)(x0)
    return x0, problem, [np.asarray(v, np.float64) for v in out]


def _check_exact_average(x0, x, p):
    mean = np.asarray(x0, np.float64).mean(0)
    np.testing.assert_allclose(p.sum(), N, rtol=1e-5)
    np.testing.assert_allclose(x.sum(0) / p.sum(), mean, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("learn", [False, True], ids=["consensus", "least-squares"])
def test_a_100x_straggler_leaves_every_agent_finite(dtype, learn):
    # Agents 1 and 2 take 100 times as long a step as agents 0 and 3.
    delays = jf.Delays(compute=[0.01, 1.0, 1.0, 0.01], message=2e-4)
    # Ends midway between step starts (0.01 apart), never on one: a step that
    # starts at 5.0 - eps by float rounding would count.
    x0, problem, (steps, lowest, z, x, p) = _run_simulated(dtype, delays, 4.995, learn)
    np.testing.assert_array_equal(steps, [500, 5, 5, 500])
    floor = jfo.min_push_weight([np.float32])
    assert np.isfinite(z).all() and np.isfinite(x).all()
    assert (lowest >= floor / 3).all(), lowest  # a share is 1/3 on exponential(4)
    assert (lowest[[0, 3]] < 1e-6).all(), lowest  # the fast ones did give their mass away
    if learn:
        start = np.sum((np.asarray(x0, np.float64) - problem.optimum) ** 2, 1)
        assert (np.sum((z - problem.optimum) ** 2, 1) < 0.5 * start).all()
    else:
        _check_exact_average(x0, x, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_peer_that_collects_after_10000_steps(dtype):
    # Agent 2 collects first at t = 10,000, after the others' 10,000 steps, then at 20,000.
    delays = jf.Delays(compute=[1.0, 1.0, 1e4, 1.0])
    x0, _, (steps, lowest, z, x, p) = _run_simulated(dtype, delays, 1e4 + 0.5, False)
    np.testing.assert_array_equal(steps, [10001, 10001, 2, 10001])
    assert np.isfinite(z).all() and (lowest >= jfo.min_push_weight([np.float32]) / 3).all()
    _check_exact_average(x0, x, p)


@mpi_test(nprocs=(4,), timeout=300)
def test_stragglers_on_mpi_processes():
    import os
    import time

    from mpi4py import MPI

    jf.init()
    r, n = jf.rank(), jf.size()
    slow = n - 1
    steps = int(os.environ.get("JAXFOG_STRAGGLER_STEPS", "10000"))
    talk = MPI.COMM_WORLD.Dup()  # the fast ranks tell the slow one they are done
    zero = lambda p, k: jnp.zeros_like(p)  # noqa: E731

    def drain_and_check(trainer, state, x0, what):
        lowest = float(state.opt_state.weight)
        state = trainer.finish(state)
        x, p = state.opt_state.numerator, state.opt_state.weight
        assert np.isfinite(np.asarray(x, np.float64)).all(), (what, x)
        assert lowest >= jfo.min_push_weight([np.float32]) / 3, (what, lowest)
        totals = np.asarray(jf.allreduce(jnp.append(x, p), "sum"), np.float64)
        mean = np.mean([np.asarray(v, np.float64) for v in x0], 0)
        np.testing.assert_allclose(totals[-1], n, rtol=1e-5, err_msg=what)
        np.testing.assert_allclose(totals[:-1] / totals[-1], mean, rtol=1e-4, atol=1e-5,
                                   err_msg=what)
        jf.barrier()
        return lowest

    for dtype in (jnp.float32, jnp.bfloat16):
        x0 = [jnp.asarray(np.random.default_rng(q).standard_normal(6) + q, dtype)
              for q in range(n)]
        # A straggler 100 times as slow: ~0.1 s a step against ~1 ms.
        trainer = jfa.async_push_sum(optax.sgd(0.0))
        state = trainer.init(x0[r])
        nap = (lambda s: time.sleep(0.1)) if r == slow else None
        state = jfa.run(trainer, state, zero, 3 if r == slow else 300, callback=nap)
        drain_and_check(trainer, state, x0, f"{dtype.__name__}, 100x")
        trainer.free()
        # A peer that collects only once the others have done 10,000 steps.
        trainer = jfa.async_push_sum(optax.sgd(0.0))
        state = trainer.init(x0[r])
        if r == slow:
            for q in range(n - 1):
                talk.recv(source=q)
            state = jfa.run(trainer, state, zero, 1)
        else:
            state = jfa.run(trainer, state, zero, steps)
            talk.send(None, dest=slow)
        weight = drain_and_check(trainer, state, x0, f"{dtype.__name__}, {steps} steps")
        # Mass only flowed into the slow rank's slots: the fast ranks gave theirs
        # away, down to the floor (on this graph, whatever the timing).
        assert r == slow or weight < 1e-6, weight
        trainer.free()
    talk.Free()
