"""jaxfog.asynchrony on MPI processes, one rank slowed: conservation, no
deadlock, Hop's bounds. Every rank checks its own values."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxfog.testing import run_mpi
from mpi_harness import mpi_test


@mpi_test(nprocs=(2, 4, 5), timeout=240, x64=True)
def test_async_push_sum_mass_and_consensus_with_a_sleeping_rank():
    import time

    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.asynchrony as jfa

    jf.init()
    r, n = jf.rank(), jf.size()
    x0 = np.random.default_rng(r).standard_normal(4) + r
    mean = np.mean([np.random.default_rng(q).standard_normal(4) + q for q in range(n)], 0)
    trainer = jfa.async_push_sum(optax.sgd(0.0))
    state = trainer.init(jnp.asarray(x0))
    zero = lambda p, k: jnp.zeros_like(p)  # noqa: E731
    nap = (lambda s: time.sleep(0.003)) if r == 0 else None
    state = jfa.run(trainer, state, zero, 60, callback=nap)
    state = trainer.finish(state)  # every push has landed and is collected
    x, p = state.opt_state.numerator, state.opt_state.weight
    totals = np.asarray(jf.allreduce(jnp.concatenate([x, jnp.array([p])]), "sum"))
    np.testing.assert_allclose(totals[:-1] / totals[-1], mean, rtol=1e-12)
    np.testing.assert_allclose(totals[-1], n, rtol=1e-12)
    jf.barrier()
    trainer.free()


@mpi_test(nprocs=(2, 5), timeout=240, x64=True)
def test_adpsgd_conserves_pairs_and_never_deadlocks():
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.asynchrony as jfa
    import jaxfog.topology as T

    jf.init()
    r, n = jf.rank(), jf.size()
    jf.set_topology(T.ring(n) if n > 2 else T.exponential(n))
    x0 = np.random.default_rng(r).standard_normal(5)
    starts = [np.random.default_rng(q).standard_normal(5) for q in range(n)]
    total = sum(starts)
    trainer = jfa.adpsgd(optax.sgd(0.0), seed=r)
    state = trainer.init(jnp.asarray(x0))
    zero = jax.jit(lambda p, k: jnp.zeros_like(p))
    nap = (lambda s: time.sleep(0.001)) if r == 0 else None
    state = jfa.run(trainer, state, zero, 300, callback=nap)  # random peers, contended
    jf.barrier()
    x = np.asarray(trainer.params(state))
    np.testing.assert_allclose(np.asarray(jf.allreduce(jnp.asarray(x), "sum")), total,
                               rtol=1e-12)
    # How close the agents get depends on how their steps interleave (ranks that
    # finish early stop averaging), so only a bound that holds whatever the
    # timing: in the worst case, the others agree before rank 0 steps at all
    # and then average with it, and every agent is within 1/2 of the farthest
    # starting point's distance from the mean.
    farthest = max(np.linalg.norm(s - total / n) for s in starts)
    assert np.linalg.norm(x - total / n) < 0.5 * farthest, (x, total / n)
    jf.barrier()
    trainer.free()


@mpi_test(nprocs=(4,), timeout=240, x64=True)
def test_hop_keeps_its_staleness_bound_and_backups_survive_a_stopped_rank():
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.asynchrony as jfa
    import jaxfog.topology as T

    jf.init()
    r, n = jf.rank(), jf.size()
    topo = T.exponential(n)
    jf.set_topology(topo)
    ins = list(topo.in_neighbors(r))
    grad = jax.jit(lambda p, k: p - float(r))
    # Bounded staleness, rank 0 slow: log (k, neighbours' counters) at each step.
    trainer = jfa.hop(optax.sgd(0.1), staleness=2, backups=1)
    state = trainer.init(jnp.zeros(3))
    log = []
    nap = (lambda s: time.sleep(0.004)) if r == 0 else None

    def record(s):
        log.append((int(s.iteration), np.asarray(s.seen)))
        if nap:
            nap(s)

    state = jfa.run(trainer, state, grad, 40, callback=record)
    k_prev = 0
    for k, seen in log:
        assert min(seen[j] for j in ins) >= k_prev - 2, (k_prev, seen)
        k_prev = k
    jf.barrier()
    trainer.free()
    # Backup workers without a staleness bound: rank 0 stops, the others go on.
    trainer = jfa.hop(optax.sgd(0.1), staleness=None, backups=1, name="hop2")
    state = trainer.init(jnp.zeros(3))
    if r != 0:
        state = jfa.run(trainer, state, grad, 30)
        assert int(state.iteration) >= 30
    jf.barrier()
    trainer.free()


@mpi_test(nprocs=(2, 4, 5), timeout=180, x64=True)
def test_pair_gossip_averages_pairs_like_the_simulation():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.asynchrony as jfa

    jf.init()
    r, n = jf.rank(), jf.size()
    values = [{"a": np.arange(3.0) + 10 * q, "b": np.full((2, 2), -q, np.float32)}
              for q in range(n)]
    step = jf.jit(jf.pair_gossip, static_argnums=1)
    for k, pairs in enumerate([[q ^ 1 for q in range(n)], [(-q - 1) % n for q in range(n)]]):
        pairs = [p if p < n and pairs[p] == q else q for q, p in enumerate(pairs)]
        got = step(jax.tree.map(jnp.asarray, values[r]), pairs[r])
        expected = jax.tree.map(lambda a, b: (a + b) / 2, values[r], values[pairs[r]])
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-7), got, expected)
        simulated = jax.jit(jf.simulate(lambda x: jf.pair_gossip(x, jnp.asarray(pairs)[
            jf.rank()]), n))(jax.tree.map(lambda *v: jnp.stack(v), *values))
        jax.tree.map(lambda g, s: np.testing.assert_array_equal(g, s[r]), got, simulated)
    # AD-PSGD's pairs from pick(): same draw on both backends.
    mate = jfa.pick(0, r, 0, n)
    assert 0 <= mate < n
    jf.barrier()


def _peer_dies_mid_run():
    import os

    import jax.numpy as jnp
    import optax

    import jaxfog as jf
    import jaxfog.asynchrony as jfa

    jf.init()
    make = {"push_sum": jfa.async_push_sum, "adpsgd": jfa.adpsgd,
            "hop": lambda inner: jfa.hop(inner, staleness=1)}[os.environ["TRAINER"]]
    trainer = make(optax.sgd(0.01))
    state = trainer.init(jnp.ones(1000))

    def die(state):
        if jf.rank() == 1 and int(state.iteration) == 5:
            os._exit(3)

    jfa.run(trainer, state, lambda p, k: p, 10**6, callback=die)


@pytest.mark.parametrize("trainer", ["push_sum", "adpsgd", "hop"])
def test_a_peer_dying_mid_run_ends_the_job(trainer):
    result = run_mpi(3, Path(__file__), "_peer_dies_mid_run", timeout=120,
                     env={"JAXFOG_TIMEOUT": "5", "TRAINER": trainer})
    assert not result.ok
    assert result.returncode is not None, result.report()  # ended, not killed by the harness
    assert result.seconds < 90, result.report()


@mpi_test(nprocs=(3,), timeout=240)
def test_the_warm_up_compiles_every_piece_of_a_step_before_the_clock_starts():
    import jax
    import jax.numpy as jnp
    import optax
    from jax import monitoring

    import jaxfog as jf
    import jaxfog.asynchrony as jfa

    jf.init()
    events = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append((name, kw))
        if "/jax/core/compile/" in name else None)
    grad_fn = lambda p, k: 0.1 * p  # noqa: E731
    for make in (lambda: jfa.async_push_sum(optax.sgd(0.1)), lambda: jfa.adpsgd(optax.sgd(0.1)),
                 lambda: jfa.hop(optax.sgd(0.1), staleness=None, backups=1)):
        trainer = make()
        state = trainer.init(jnp.arange(4.0) + jf.rank())
        trainer.compile(state, grad_fn)
        events.clear()
        state = jfa.run(trainer, state, grad_fn, 30, warmup=False)
        trainer.params(state)
        assert not events, (trainer, events)  # nothing left to trace or compile
        jf.barrier()
        trainer.free()
    # run() warms up by default, once, before the first step.
    calls = []
    trainer = jfa.async_push_sum(optax.sgd(0.1))
    state = trainer.init(jnp.zeros(4))
    spy = trainer._replace(compile=lambda s, g: calls.append(int(s.iteration)))
    jfa.run(spy, state, grad_fn, 3)
    assert calls == [0], calls
    jax.block_until_ready(state)
    jf.barrier()
    trainer.free()
