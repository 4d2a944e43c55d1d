"""Streaming DiLoCo (jaxfog.optax.streaming_diloco): every update against a
numpy reference written from the paper's algorithm (fragments synchronised at
staggered steps, each exchange finished tau steps later, the merge with
alpha), the reduction to DiLoCo, ``finish``, argument errors, and on 2 MPI
processes the simulation's iterates, with the exchanges started only at the
sync steps and no handle left in flight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.compress as C
import jaxfog.optax as jfo
import jaxfog.topology as T
import optax_cases as oc
from mpi_harness import mpi_test

pytestmark = [pytest.mark.jax_internals, pytest.mark.numerical, pytest.mark.usefixtures("x64")]

N = 4
#: The parameters, a vector of 11, as a tuple of three leaves of 4, 2 and 5 entries.
CUTS = (4, 6)


def split(x):
    return tuple(jnp.split(x, CUTS))


def agent_fn(optimizer, problem, steps, finish_at=()):
    """Per-agent training on the parameters as three leaves; returns the iterate
    (joined into one vector) after each step, and after ``finish`` at the
    steps of ``finish_at`` (finish replaces that step's iterate)."""
    loss = problem.loss(problem.A.shape[0])
    d = problem.A.shape[-1]

    def agent(a, b):
        x = split(jnp.zeros(d, a.dtype))
        state = optimizer.init(x)
        out = []
        for k in range(steps):  # unrolled: finish at chosen steps
            g = split(jax.grad(loss)(jnp.concatenate(x), a, b))
            updates, state = optimizer.update(g, state, x)
            x = optax.apply_updates(x, updates)
            if k + 1 in finish_at:
                updates, state = optimizer.finish(state, x)
                x = optax.apply_updates(x, updates)
            out.append(jnp.concatenate(x))
        return jnp.stack(out)

    return agent


def scanned(optimizer, problem, steps):
    """The same as ``agent_fn`` without finish, in a ``lax.scan`` (the state,
    handles included, carried)."""
    loss = problem.loss(problem.A.shape[0])
    d = problem.A.shape[-1]

    def agent(a, b):
        def body(carry, _):
            x, state = carry
            g = split(jax.grad(loss)(jnp.concatenate(x), a, b))
            updates, state = optimizer.update(g, state, x)
            x = optax.apply_updates(x, updates)
            return (x, state), jnp.concatenate(x)

        x = split(jnp.zeros(d, a.dtype))
        return jax.lax.scan(body, (x, optimizer.init(x)), None, length=steps)[1]

    return agent


def simulated(agent, problem):
    return np.asarray(jax.jit(jf.simulate(agent, T.exponential(N)))(problem.A, problem.B))


# --- the numpy reference, from the paper's algorithm ------------------------------------------


def reference(problem, steps, *, every, fragments, delay, alpha, inner_lr, coords,
              compress=None, finish_at=(), outer=(0.7, 0.9, True), phase="start"):
    """Streaming DiLoCo's iterates: ``coords[p]`` are fragment p's coordinates.

    Fragment p starts its exchange at the steps t (from 1) with t = o_p mod H,
    o_p = floor((p + 1) H / P), with the mean over agents of phi_p - theta_p;
    at t + tau it takes the outer step phi_p += OuterOpt(mean) and merges
    theta_p = alpha theta_p + (1 - alpha) phi_p. ``compress(q, rank, key_index)``
    gives what agent ``rank`` sends of ``q`` (error feedback keeps the rest).
    With ``phase="merge"`` (torchft's schedule) each exchange starts tau steps
    earlier, so that it is merged at t = o_p mod H.
    """
    n, d = problem.A.shape[0], problem.A.shape[-1]
    H, P = every, fragments
    offsets = [int(np.floor((p + 1) * H / P)) - (delay if phase == "merge" else 0)
               for p in range(P)]
    X = np.zeros((n, d))
    phi = np.zeros(d)  # the global parameters: the same on every agent
    inner = oc.HeavyBall(inner_lr, 0.5)
    outers = [oc.HeavyBall(*outer) for _ in range(P)]
    residual = [np.zeros((n, len(c))) for c in coords]
    flight = {}  # fragment -> (the step its mean arrives, the mean)

    def arrive(p, mean):
        c = coords[p]
        phi[c] = phi[c] + outers[p](mean)
        X[:, c] = alpha * X[:, c] + (1 - alpha) * phi[c]

    out = []
    for k in range(steps):
        t = k + 1
        X = X + inner(oc.local_gradients(problem, X))
        for p, c in enumerate(coords):
            if p in flight and flight[p][0] == t:
                arrive(p, flight.pop(p)[1])
            if t >= offsets[p] and (t - offsets[p]) % H == 0:
                delta = phi[c] - X[:, c]
                if compress is not None:
                    r = (t - offsets[p]) // H
                    q = delta + residual[p]
                    sent = np.stack([compress(q[i], i, r * P + p) for i in range(n)])
                    residual[p] = q - sent
                    delta = sent
                flight[p] = (t + delay, delta.mean(0))
                if delay == 0:
                    arrive(p, flight.pop(p)[1])
        if t in finish_at:
            for p in list(flight):
                arrive(p, flight.pop(p)[1])
        out.append(X.copy())
    return np.stack(out, axis=1)


def check(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * max(1.0, np.abs(want).max()))


def coordinates(fragments_of_leaves):
    """Fragments of leaves (indices into the three leaves) as coordinates."""
    bounds = [(0, CUTS[0]), (CUTS[0], CUTS[1]), (CUTS[1], 11)]
    return [np.concatenate([np.arange(*bounds[i]) for i in leaves])
            for leaves in fragments_of_leaves]


def strided(params):
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [k % 2 for k in range(len(leaves))])


# (every, fragments, delay, alpha, fragment_of, the fragments' leaves)
CASES = [
    (4, 2, 1, 0.0, None, [[0, 1], [2]]),      # contiguous, balanced: 6 and 5 entries
    (6, 3, 2, 0.5, None, [[0], [1], [2]]),    # fragment 1 starts as fragment 0 finishes
    (5, 2, 2, 0.5, strided, [[0, 2], [1]]),   # the paper's strided pattern
    (3, 3, 2, 0.5, None, [[0], [1], [2]]),    # two exchanges in flight at every step
    (4, 2, 0, 0.5, None, [[0, 1], [2]]),      # no overlap
]


@pytest.mark.parametrize("every,fragments,delay,alpha,fragment_of,leaves", CASES)
def test_streaming_diloco_matches_the_reference(problem, every, fragments, delay, alpha,
                                                fragment_of, leaves):
    lr = 0.3 / problem.lipschitz
    optimizer = jfo.streaming_diloco(optax.sgd(lr, momentum=0.5), every=every,
                                     fragments=fragments, delay=delay, alpha=alpha,
                                     fragment_of=fragment_of)
    got = simulated(scanned(optimizer, problem, 30), problem)
    want = reference(problem, 30, every=every, fragments=fragments, delay=delay, alpha=alpha,
                     inner_lr=lr, coords=coordinates(leaves))
    check(got, want)
    assert np.abs(want[:, -1]).max() > 1e-2  # it moved


def test_a_heavy_ball_outer_optimizer_and_a_pytree_fragment_of(problem):
    lr = 0.3 / problem.lipschitz
    optimizer = jfo.streaming_diloco(optax.sgd(lr, momentum=0.5), optax.sgd(0.5, momentum=0.8),
                                     every=4, fragments=2, delay=1, alpha=0.5,
                                     fragment_of=(1, 0, 1))
    got = simulated(scanned(optimizer, problem, 20), problem)
    want = reference(problem, 20, every=4, fragments=2, delay=1, alpha=0.5, inner_lr=lr,
                     coords=coordinates([[1], [0, 2]]), outer=(0.5, 0.8, False))
    check(got, want)


def test_error_feedback_matches_the_reference(problem):
    lr, seed = 0.3 / problem.lipschitz, 3
    compressor = C.top_k(0.3)

    def compress(q, rank, index):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), rank), index)
        [payload] = C.compress_groups(compressor, [jnp.asarray(q)], key)
        return np.asarray(compressor.decompress(payload))

    for delay in (0, 2):
        optimizer = jfo.streaming_diloco(optax.sgd(lr, momentum=0.5), every=4, fragments=2,
                                         delay=delay, alpha=0.5, compressor=compressor,
                                         groups=1, seed=seed)
        got = simulated(scanned(optimizer, problem, 20), problem)
        want = reference(problem, 20, every=4, fragments=2, delay=delay, alpha=0.5,
                         inner_lr=lr, coords=coordinates([[0, 1], [2]]), compress=compress)
        check(got, want)
        dense = reference(problem, 20, every=4, fragments=2, delay=delay, alpha=0.5,
                          inner_lr=lr, coords=coordinates([[0, 1], [2]]))
        assert np.abs(want - dense).max() > 1e-6  # compression changed something


def test_one_fragment_without_delay_is_diloco(problem):
    lr = 0.3 / problem.lipschitz
    inner = optax.sgd(lr, momentum=0.5)
    for every in (1, 3):
        for kwargs in ({}, {"compressor": C.top_k(0.3), "seed": 2}):
            want = simulated(scanned(jfo.diloco(inner, every=every, **kwargs), problem, 14),
                             problem)
            got = simulated(scanned(jfo.streaming_diloco(inner, every=every, fragments=1,
                                                         delay=0, alpha=0.0, **kwargs),
                                    problem, 14), problem)
            np.testing.assert_array_equal(got, want)


def test_finish_takes_the_outer_steps_in_flight_and_training_goes_on(problem):
    lr = 0.3 / problem.lipschitz
    optimizer = jfo.streaming_diloco(optax.sgd(lr, momentum=0.5), every=6, fragments=3,
                                     delay=2, alpha=0.5)
    # Offsets 2, 4, 6. After step 5 fragment 1 (started at 4) is in flight: finish
    # takes its outer step a step early, and its finish due at 6 is skipped. After
    # step 11 fragment 1 (started at 10) is in flight; after step 14, fragment 0,
    # started in that step.
    finish_at = (5, 11, 14)
    got = simulated(agent_fn(optimizer, problem, 14, finish_at), problem)
    want = reference(problem, 14, every=6, fragments=3, delay=2, alpha=0.5, inner_lr=lr,
                     coords=coordinates([[0], [1], [2]]), finish_at=finish_at)
    check(got, want)
    plain = reference(problem, 14, every=6, fragments=3, delay=2, alpha=0.5, inner_lr=lr,
                      coords=coordinates([[0], [1], [2]]))
    assert np.abs(want - plain).max() > 1e-6


@pytest.mark.parametrize("every,fragments,delay", [(6, 2, 2), (6, 3, 1), (4, 2, 0)])
def test_torchfts_phase_merges_at_the_sync_steps(problem, every, fragments, delay):
    lr = 0.3 / problem.lipschitz
    optimizer = jfo.streaming_diloco(optax.sgd(lr, momentum=0.5), every=every,
                                     fragments=fragments, delay=delay, alpha=0.5,
                                     phase="merge")
    leaves = [[0, 1], [2]] if fragments == 2 else [[0], [1], [2]]
    got = simulated(scanned(optimizer, problem, 24), problem)
    want = reference(problem, 24, every=every, fragments=fragments, delay=delay, alpha=0.5,
                     inner_lr=lr, coords=coordinates(leaves), phase="merge")
    check(got, want)
    if delay:
        start = reference(problem, 24, every=every, fragments=fragments, delay=delay,
                          alpha=0.5, inner_lr=lr, coords=coordinates(leaves))
        assert np.abs(want - start).max() > 1e-6  # the phases differ


def test_finish_without_delay_has_nothing_to_wait_for(problem):
    """delay=0 waits in the step that starts: finish gives zero updates and
    the state back (it used to call wait on the empty slot and raise)."""
    lr = 0.3 / problem.lipschitz
    for fragments, alpha in ((1, 0.0), (2, 0.5)):
        optimizer = jfo.streaming_diloco(optax.sgd(lr, momentum=0.5), every=4,
                                         fragments=fragments, delay=0, alpha=alpha)
        got = simulated(agent_fn(optimizer, problem, 9, finish_at=(3, 9)), problem)
        want = reference(problem, 9, every=4, fragments=fragments, delay=0, alpha=alpha,
                         inner_lr=lr, coords=coordinates([[0, 1, 2]] if fragments == 1
                                                         else [[0, 1], [2]]))
        check(got, want)


def test_the_state_keeps_one_structure_and_float32_stays_float32():
    optimizer = jfo.streaming_diloco(optax.adam(0.1), optax.adam(0.05), every=3, fragments=2,
                                     delay=1, alpha=0.5)

    def agent(x):
        params = (x[:1], x[1:])
        state = optimizer.init(params)
        structure = jax.tree.structure(state)
        for _ in range(7):
            updates, state = optimizer.update(params, state, params)
            assert jax.tree.structure(state) == structure
            assert all(u.dtype == jnp.float32 for u in updates)
            params = optax.apply_updates(params, updates)
        updates, state = optimizer.finish(state, params)
        return optax.apply_updates(params, updates)

    X = jax.jit(jf.simulate(agent, 4))(jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3))
    assert all(x.dtype == jnp.float32 and np.isfinite(np.asarray(x)).all() for x in X)


def test_offsets_spread_the_syncs_over_the_round():
    assert jfo.streaming_offsets(12, 4) == (3, 6, 9, 12)
    assert jfo.streaming_offsets(10, 3) == (3, 6, 10)
    assert jfo.streaming_offsets(5, 1) == (5,)


# --- bad input --------------------------------------------------------------------------------


def test_bad_arguments_raise_with_clear_messages():
    make = jfo.streaming_diloco
    inner = optax.sgd(0.1)
    with pytest.raises(ValueError, match="fragments must be >= 1"):
        make(inner, every=4, fragments=0)
    with pytest.raises(ValueError, match=r"fragments must be in \[1, every=4\]"):
        make(inner, every=4, fragments=5)
    with pytest.raises(ValueError, match=r"delay must be in \[0, every=4\)"):
        make(inner, every=4, fragments=2, delay=4)
    with pytest.raises(ValueError, match=r"phase='merge' needs delay < every // fragments = 2"):
        make(inner, every=4, fragments=2, delay=2, phase="merge")
    with pytest.raises(ValueError, match="phase must be 'start'"):
        make(inner, every=4, fragments=2, phase="torchft")
    with pytest.raises(ValueError, match="delay must be >= 0"):
        make(inner, every=4, fragments=2, delay=-1)
    for alpha in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"alpha must be in \[0.0, 1.0\]"):
            make(inner, every=4, fragments=2, alpha=alpha)
    with pytest.raises(ValueError, match="every must be >= 1"):
        make(inner, every=0, fragments=1)
    with pytest.raises(TypeError, match="fragments must be an int"):
        make(inner, every=4, fragments=2.0)
    with pytest.raises(TypeError, match="alpha must be a number"):
        make(inner, every=4, fragments=2, alpha="0.5")
    with pytest.raises(TypeError, match="outer must be an optax"):
        make(inner, optax.sgd, every=4, fragments=2)
    with pytest.raises(TypeError, match="compressor must be"):
        make(inner, every=4, fragments=2, compressor="top_k")
    params = (jnp.ones(2), jnp.ones(3))
    with pytest.raises(ValueError, match="fragments=3 but the parameters have only 2 leaves"):
        make(inner, every=4, fragments=3).init(params)
    with pytest.raises(ValueError, match=r"fragment_of gave 2 for leaf 1"):
        make(inner, every=4, fragments=2, fragment_of=(0, 2)).init(params)
    with pytest.raises(ValueError, match=r"fragment\(s\) \[1\] without leaves"):
        make(inner, every=4, fragments=2, fragment_of=lambda p: (0, 0)).init(params)
    with pytest.raises(ValueError, match="one int per leaf"):
        make(inner, every=4, fragments=2, fragment_of=(0, 1, 1)).init(params)
    with pytest.raises(TypeError, match="must give Python ints"):
        make(inner, every=4, fragments=2, fragment_of=(0, 1.0)).init(params)
    with pytest.raises(ValueError, match="update\\(\\) needs params"):
        make(inner, every=4, fragments=2).update(params, None)


def test_a_chain_after_it_warns():
    with pytest.warns(UserWarning, match="jaxfog.optax.streaming_diloco is followed"):
        jfo.check_chain(optax.chain(jfo.streaming_diloco(optax.sgd(0.1), every=2,
                                                         fragments=2), optax.clip(1.0)))


# --- MPI ------------------------------------------------------------------------------------


@mpi_test(nprocs=(2,), timeout=300, x64=True)
def test_mpi_processes_give_the_simulated_iterates_and_start_only_at_syncs():
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.compress as C
    import jaxfog.optax as jfo
    import jaxfog.topology as T
    import optax_cases as oc

    from mpi4py import MPI

    jf.init()
    r, n = jf.rank(), jf.size()
    problem = oc.least_squares(n)
    loss = problem.loss(n)
    lr = 0.3 / problem.lipschitz
    d = problem.A.shape[-1]
    steps, every = 16, 4

    def split(x):
        return tuple(jnp.split(x, (4, 6)))

    def one_step(x, state, a, b):
        g = split(jax.grad(loss)(jnp.concatenate(x), a, b))
        updates, state = optimizer.update(g, state, x)
        return optax.apply_updates(x, updates), state

    def agent(a, b):
        def body(carry, _):
            carry = one_step(*carry, a, b)
            return carry, jnp.concatenate(carry[0])

        x = split(jnp.zeros(d, a.dtype))
        x, path = jax.lax.scan(body, (x, optimizer.init(x)), None, length=steps)
        return path

    cases = [("2 fragments, delay 1", dict(fragments=2, delay=1, alpha=0.5), "allreduce"),
             ("1 fragment, delay 0", dict(fragments=1, delay=0, alpha=0.0), "allreduce"),
             ("3 fragments, delay 3", dict(fragments=3, delay=3, alpha=0.0), "allreduce"),
             ("2 fragments, delay 2, top_k", dict(fragments=2, delay=2, alpha=0.5,
                                                  compressor=C.top_k(0.3), groups=1),
              "allgather")]
    for name, kwargs, op in cases:
        optimizer = jfo.streaming_diloco(optax.sgd(lr, momentum=0.5), every=every, **kwargs)
        starts = jfo.streaming_offsets(every, kwargs["fragments"])
        step = jf.jit(one_step)
        x = split(jnp.zeros(d))
        state = optimizer.init(x)
        mine, sent = [], []
        jf.comm_stats(reset=True)
        for k in range(steps):  # one jitted step per call: the handles cross calls
            x, state = jax.block_until_ready(step(x, state, problem.A[r], problem.B[r]))
            sent.append({o: s.calls for o, s in jf.comm_stats().items() if s.calls})
            mine.append(np.asarray(jnp.concatenate(x)))
        # The communication thread counts an exchange when it runs it, between its
        # start and its wait: after step t, at least the exchanges waited for and
        # at most those started are counted, and no other op ran.
        delay = kwargs["delay"]
        for k, calls in enumerate(sent):
            t = k + 1
            started = sum(s <= t for o in starts for s in range(o, steps + 1, every))
            waited = sum(s + delay <= t for o in starts for s in range(o, steps + 1, every))
            assert set(calls) <= {op}, (name, t, calls)
            assert waited <= calls.get(op, 0) <= started, (name, t, calls, waited, started)
        if op == "allreduce":  # finish: waits for what is in flight, takes its outer steps
            updates, state = jax.jit(optimizer.finish)(state, x)
            assert not np.asarray(state.pending).any()
        # Every slot is in flight or idle (handle id 0), never spent: wait_all is safe,
        # after finish (all idle) or instead of it (drops what is in flight).
        jf.wait_all(state)
        every_rank = MPI.COMM_WORLD.gather(np.stack(mine))
        if r == 0:
            simulated = np.asarray(jax.jit(jf.simulate(agent, T.exponential(n)))(
                problem.A, problem.B))
            np.testing.assert_allclose(np.stack(every_rank), simulated, rtol=0,
                                       atol=1e-12 * np.abs(simulated).max(), err_msg=name)
            assert np.abs(simulated[:, -1]).max() > 1e-3, name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a handle never waited for would warn here
        jf.shutdown()
