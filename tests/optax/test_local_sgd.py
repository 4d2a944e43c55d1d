"""Local SGD, DiLoCo and NoLoCo (jaxfog.optax): every update against a numpy
reference written from the papers' equations, the identities between them,
convergence on heterogeneous least squares, argument errors, and on 4 MPI
processes the simulation's iterates with no traffic between synchronisations."""

from __future__ import annotations

import functools
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


def path(optimizer, problem, steps, topology=None):
    """Every agent's iterate after each step, (n, steps, d), simulated."""
    n = problem.A.shape[0]
    agent = oc.train(optimizer, problem, n, steps, every_step=True)
    graph = T.exponential(n) if topology is None else topology
    return np.asarray(jax.jit(jf.simulate(agent, graph))(problem.A, problem.B))


# --- numpy references, from the papers' equations -------------------------------------


def mixing(communication, n, t, topology=None, period=16, seed=0):
    if communication == "allreduce":
        return np.full((n, n), 1.0 / n)
    if communication == "gossip":
        rng = np.random.default_rng(seed)
        for _ in range(t % period + 1):
            order = rng.permutation(n)
        w = np.eye(n)
        for a, b in zip(order[0::2], order[1::2]):
            w[a, a] = w[b, b] = w[a, b] = w[b, a] = 0.5
        return w
    graph = topology.at(t) if isinstance(topology, T.Schedule) else topology
    return graph.weights


def reference(method, problem, steps, every, inner_lr, communication, topology=None,
              compress=None, decay=1.0, **outer):
    """The iterates of local SGD / DiLoCo / NoLoCo written from the equations."""
    n, d = problem.A.shape[0], problem.A.shape[-1]
    X = np.zeros((n, d))
    inner = oc.HeavyBall(inner_lr, 0.5)
    anchor, residual, momentum = X.copy(), np.zeros((n, d)), np.zeros((n, d))
    public = None
    if method == "diloco":
        outer_opt = oc.HeavyBall(outer.get("lr", 0.7), outer.get("momentum", 0.9),
                              outer.get("nesterov", True))
    out = []
    for k in range(steps):
        X = X + inner(oc.local_gradients(problem, X))
        if (k + 1) % every == 0:
            t = k // every
            W = mixing(communication, n, t, topology)
            if method == "local_sgd":
                X = W @ X
            elif method == "diloco":
                delta = anchor - X                       # pseudo-gradient
                if compress is not None:                 # error feedback
                    p = delta + decay * residual
                    sent = np.stack([compress(p[i], i, t) for i in range(n)])
                    residual = p - sent
                    delta_bar, anchor_bar = W @ sent, anchor
                else:
                    delta_bar, anchor_bar = W @ delta, W @ anchor
                anchor = anchor_bar + outer_opt(delta_bar)
                X = anchor.copy()
            else:  # noloco
                alpha, beta = outer["momentum"], outer["lr"]
                beta = beta(t) if callable(beta) else beta
                gamma = beta if outer.get("gamma") is None else outer["gamma"]
                if compress is None:
                    anchor_bar, theta_bar = W @ anchor, W @ X
                else:  # public copies of theta (and of the anchor with gamma)
                    y = np.stack([X] if outer.get("gamma") is None else [anchor, X], 1)
                    public = np.zeros_like(y) if public is None else public
                    public = public + np.stack([compress(y[i] - public[i], i, t)
                                                for i in range(n)])
                    bar = y + np.einsum("ij,jgd->igd", W, public) - public
                    theta_bar = bar[:, -1]
                    anchor_bar = bar[:, 0] if bar.shape[1] == 2 else W @ anchor
                momentum = (alpha * momentum - beta * (anchor_bar - theta_bar)
                            - gamma * (anchor - anchor_bar))
                anchor = anchor + momentum
                X = anchor.copy()
        out.append(X)
    return np.stack(out, axis=1)


def check(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * max(1.0, np.abs(want).max()))


# --- the updates against the references ---------------------------------------------------


SCHEDULE = T.one_peer_exponential(N)
COMMUNICATIONS = [("allreduce", None), ("neighbor", T.ring(N)), ("neighbor", SCHEDULE),
                  ("gossip", None)]


def test_local_sgd_matches_the_reference(problem):
    lr = 0.3 / problem.lipschitz
    for communication, topology in COMMUNICATIONS:
        got = path(jfo.local_sgd(optax.sgd(lr, momentum=0.5), every=3,
                                 communication=communication, topology=topology), problem, 14)
        check(got, reference("local_sgd", problem, 14, 3, lr, communication, topology))


def test_diloco_matches_the_reference(problem):
    lr = 0.3 / problem.lipschitz
    for communication, topology in COMMUNICATIONS:
        got = path(jfo.diloco(optax.sgd(lr, momentum=0.5), every=3,
                              communication=communication, topology=topology), problem, 14)
        check(got, reference("diloco", problem, 14, 3, lr, communication, topology))
    outer = optax.sgd(0.5, momentum=0.8)  # heavy ball, not the default Nesterov
    got = path(jfo.diloco(optax.sgd(lr, momentum=0.5), outer, every=2), problem, 9)
    check(got, reference("diloco", problem, 9, 2, lr, "allreduce", lr=0.5, momentum=0.8,
                         nesterov=False))


def test_diloco_error_feedback_matches_the_reference(problem):
    lr = 0.3 / problem.lipschitz
    for compressor in (C.top_k(0.3), C.sign(), C.quantize(4, chunk=4),
                       C.chunked_top_k(0.5, chunk=4, bits=2)):
        seed = 3

        def compress(p, rank, t):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), rank), t)
            [payload] = C.compress_groups(compressor, [jnp.asarray(p)], key)
            return np.asarray(compressor.decompress(payload))

        got = path(jfo.diloco(optax.sgd(lr, momentum=0.5), every=3, compressor=compressor,
                              seed=seed), problem, 14)
        want = reference("diloco", problem, 14, 3, lr, "allreduce", compress=compress)
        check(got, want)
        assert np.abs(got - path(jfo.diloco(optax.sgd(lr, momentum=0.5), every=3),
                                 problem, 14)).max() > 1e-6, compressor.name
    # SparseLoCo: the decayed residual in place of the outer momentum.
    got = path(jfo.diloco(optax.sgd(lr, momentum=0.5), optax.sgd(0.9), every=3,
                          compressor=compressor, error_decay=0.8, seed=seed), problem, 14)
    check(got, reference("diloco", problem, 14, 3, lr, "allreduce", compress=compress,
                         decay=0.8, lr=0.9, momentum=0.0, nesterov=False))


def test_noloco_matches_the_reference(problem):
    lr = 0.3 / problem.lipschitz
    for communication, topology, gamma in [("gossip", None, None), ("gossip", None, 0.2),
                                           ("neighbor", SCHEDULE, None),
                                           ("allreduce", None, 0.2)]:
        if gamma is None:  # a schedule of the round, gamma following it
            outer_lr = optax.piecewise_constant_schedule(0.6, {2: 0.5})
        else:
            outer_lr = 0.6
        got = path(jfo.noloco(optax.sgd(lr, momentum=0.5), every=3, gamma=gamma,
                              learning_rate=outer_lr, momentum=0.4, communication=communication,
                              topology=topology), problem, 14)
        want = reference("noloco", problem, 14, 3, lr, communication, topology, lr=outer_lr,
                         momentum=0.4, gamma=gamma)
        check(got, want)


def group_compressor(compressor, seed):
    """``compress(y, rank, t)``: each row of ``y`` (one group each) compressed
    and decompressed with the key jaxfog gives agent ``rank`` in round ``t``."""
    def compress(y, rank, t):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), rank), t)
        payloads = C.compress_groups(compressor, [jnp.asarray(g) for g in y], key)
        return np.stack([np.asarray(compressor.decompress(p)) for p in payloads])
    return compress


def test_noloco_compressed_matches_the_reference(problem):
    """Public copies as CHOCO keeps them, on random pairs and on a one-peer
    schedule, folded (theta travels) and with gamma ((phi, theta) travel)."""
    lr, seed = 0.3 / problem.lipschitz, 0  # the seed of the pairs too
    for compressor in (C.top_k(0.3), C.quantize(4, chunk=4),
                       C.chunked_top_k(0.5, chunk=4, bits=2)):
        for communication, topology, gamma in [("gossip", None, None), ("gossip", None, 0.2),
                                               ("neighbor", SCHEDULE, None)]:
            make = functools.partial(jfo.noloco, optax.sgd(lr, momentum=0.5), every=3,
                                     gamma=gamma, learning_rate=0.6, momentum=0.4,
                                     communication=communication, topology=topology)
            got = path(make(compressor=compressor, seed=seed), problem, 14)
            want = reference("noloco", problem, 14, 3, lr, communication, topology, lr=0.6,
                             momentum=0.4, gamma=gamma,
                             compress=group_compressor(compressor, seed))
            check(got, want)
            assert np.abs(got - path(make(), problem, 14)).max() > 1e-6, compressor.name
    # identity(): the uncompressed iterates (to rounding: y - (y - 0) is not y)
    got = path(jfo.noloco(optax.sgd(lr), every=3, compressor=C.identity()), problem, 14)
    np.testing.assert_allclose(got, path(jfo.noloco(optax.sgd(lr), every=3), problem, 14),
                               rtol=0, atol=1e-12)


def test_noloco_compressed_converges_as_the_dense_run(problem):
    """With top-k of 10% of the differences, NoLoCo reaches the neighbourhood
    of the optimum that the dense run reaches (the public copies carry what
    compression leaves out)."""
    lr, every = 0.3 / problem.lipschitz, 4
    scale = np.linalg.norm(problem.optimum)

    def error(compressor):
        X = path(jfo.noloco(optax.sgd(lr), every=every, compressor=compressor), problem,
                 1600)[:, -1]
        return np.linalg.norm(X - problem.optimum, axis=1).max() / scale

    dense, sparse = error(None), error(C.top_k(0.1))
    assert sparse < 1.25 * dense and dense < 0.4, (dense, sparse)


def test_random_pairs_are_perfect_matchings():
    for n in (6, 7):
        schedule = jfo.random_pairs(n, period=5, seed=1)
        assert schedule.period == 5
        for t, entry in enumerate(schedule):
            w = entry.weights
            np.testing.assert_array_equal(w, mixing("gossip", n, t, seed=1))
            assert (w == w.T).all() and np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1)
            assert (np.diag(w) == 1).sum() == n % 2  # the one left alone


# --- identities -------------------------------------------------------------------------------


def test_every_one_with_plain_outer_steps_is_averaging_after_every_step(problem):
    lr = 0.3 / problem.lipschitz
    inner = optax.sgd(lr, momentum=0.5)
    want = path(jfo.atc(inner, communication="allreduce"), problem, 12)
    check(path(jfo.local_sgd(inner, every=1), problem, 12), want)
    check(path(jfo.diloco(inner, optax.sgd(1.0), every=1), problem, 12), want)
    # Any H: DiLoCo with an outer sgd(1.0) is local SGD (also with the anchors mixed),
    # and so is NoLoCo without momentum and with gamma = beta = 1.
    local = {c: path(jfo.local_sgd(inner, every=4, communication=c, topology=t), problem, 12)
             for c, t in COMMUNICATIONS[2:]}
    for communication, topology in COMMUNICATIONS[2:]:
        check(path(jfo.diloco(inner, optax.sgd(1.0), every=4, communication=communication,
                              topology=topology), problem, 12), local[communication])
    check(path(jfo.noloco(inner, every=4, learning_rate=1.0, momentum=0.0), problem, 12),
          local["gossip"])


def test_identity_compressor_is_uncompressed(problem):
    inner = optax.adam(1e-2)
    check(path(jfo.diloco(inner, every=3, compressor=C.identity()), problem, 12),
          path(jfo.diloco(inner, every=3), problem, 12))


def test_float32_parameters_keep_their_dtype_under_x64():
    """Schedules do not leak float64 into float32 parameters (the two branches
    of the round's lax.cond must agree on dtypes)."""
    schedule = optax.piecewise_constant_schedule(0.7, {1: 0.5})
    for optimizer in (jfo.noloco(optax.sgd(0.1), every=2, learning_rate=schedule, gamma=0.3),
                      jfo.diloco(optax.adam(0.1), optax.adam(schedule), every=2)):
        def agent(x):
            state = optimizer.init(x)
            for _ in range(4):
                updates, state = optimizer.update(x, state, x)
                assert updates.dtype == jnp.float32
                x = optax.apply_updates(x, updates)
            return x

        X = jax.jit(jf.simulate(agent, 4))(jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2))
        assert X.dtype == jnp.float32 and np.isfinite(np.asarray(X)).all()


# --- convergence ------------------------------------------------------------------------------


def local_fixed_point(problem, lr, every):
    """The fixed point of local SGD with plain SGD steps on least squares: every
    agent's ``every`` steps are an affine map ``x -> M_i x + c_i``, and the
    average ``x = mean_i (M_i x + c_i)`` is reached where ``(I - mean M) x =
    mean c``. DiLoCo's outer step (any momentum) stops where the mean
    pseudo-gradient vanishes: the same point."""
    n, d = problem.A.shape[0], problem.A.shape[-1]
    M, c = np.zeros((d, d)), np.zeros(d)
    for a, b in zip(problem.A, problem.B):
        step = np.eye(d) - lr * (a.T @ a + problem.ridge / n * np.eye(d))
        m, v = np.eye(d), np.zeros(d)
        for _ in range(every):
            m, v = step @ m, step @ v + lr * (a.T @ b)
        M, c = M + m / n, c + v / n
    return np.linalg.solve(np.eye(d) - M, c)


def test_heterogeneous_least_squares_reaches_the_predicted_neighbourhood(problem):
    """Local SGD and DiLoCo reach local SGD's fixed point, at a distance from the
    optimum proportional to the step size (client drift, about lr (H - 1) times
    the gradients' dissimilarity); NoLoCo's random pairs add a consensus error
    that also shrinks with the step size."""
    lr, every = 0.3 / problem.lipschitz, 4
    scale = np.linalg.norm(problem.optimum)
    fixed = local_fixed_point(problem, lr, every)
    bias = np.linalg.norm(fixed - problem.optimum) / scale
    smaller = np.linalg.norm(local_fixed_point(problem, lr / 4, every) - problem.optimum) / scale
    assert 0.05 < bias < 0.2 and 0.2 < smaller / bias < 0.3, (bias, smaller)
    for optimizer in (jfo.local_sgd(optax.sgd(lr), every=every),
                      jfo.diloco(optax.sgd(lr), every=every)):
        X = path(optimizer, problem, 4800)[:, -1]
        assert np.abs(X - fixed).max() < 1e-8 * scale

    def error(lr, steps):
        X = path(jfo.noloco(optax.sgd(lr), every=every), problem, steps)[:, -1]
        return np.linalg.norm(X - problem.optimum, axis=1).max() / scale

    big, small = error(lr, 1600), error(lr / 4, 6400)
    assert small < 0.5 * big < 0.2, (big, small)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [jfo.local_sgd, jfo.diloco, jfo.noloco])
def test_bad_arguments_raise_at_construction(make):
    with pytest.raises(ValueError, match="every must be >= 1"):
        make(optax.sgd(0.1), every=0)
    with pytest.raises(TypeError, match="every must be an int"):
        make(optax.sgd(0.1), every=2.0)
    with pytest.raises(TypeError, match="inner must be an optax"):
        make(lambda g: g, every=2)
    with pytest.raises(ValueError, match="communication must be one of"):
        make(optax.sgd(0.1), every=2, communication="ring")
    with pytest.raises(ValueError, match="topology= is the graph"):
        make(optax.sgd(0.1), every=2, communication="allreduce", topology=T.ring(4))
    with pytest.raises(TypeError, match=r"jaxfog.optax.\w+: topology must be a Topology, a "
                                        "Schedule or None"):
        make(optax.sgd(0.1), every=2, communication="neighbor", topology="ring")


def test_bad_outer_and_compressor_raise():
    with pytest.raises(TypeError, match="outer must be an optax GradientTransformation"):
        jfo.diloco(optax.sgd(0.1), optax.sgd, every=2)
    with pytest.raises(TypeError, match="compressor must be"):
        jfo.diloco(optax.sgd(0.1), every=2, compressor="top_k")
    with pytest.raises(ValueError, match="compressor compresses"):
        jfo.diloco(optax.sgd(0.1), every=2, communication="gossip", compressor=C.sign())
    with pytest.raises(ValueError, match=r"error_decay must be in \[0.0, 1.0\]"):
        jfo.diloco(optax.sgd(0.1), every=2, compressor=C.sign(), error_decay=1.5)
    with pytest.raises(ValueError, match="without a compressor there is none"):
        jfo.diloco(optax.sgd(0.1), every=2, error_decay=0.9)
    with pytest.raises(ValueError, match="momentum must be in"):
        jfo.noloco(optax.sgd(0.1), every=2, momentum=1.5)
    with pytest.raises(TypeError, match="noloco: compressor must be"):
        jfo.noloco(optax.sgd(0.1), every=2, compressor="top_k")
    with pytest.raises(ValueError, match="noloco: with communication='allreduce'"):
        jfo.noloco(optax.sgd(0.1), every=2, communication="allreduce", compressor=C.sign())
    with pytest.raises(TypeError, match="noloco: groups must be"):
        jfo.noloco(optax.sgd(0.1), every=2, compressor=C.sign(), groups="all")
    with pytest.raises(ValueError, match="update\\(\\) needs params"):
        optimizer = jfo.local_sgd(optax.sgd(0.1), every=2)
        optimizer.update(jnp.ones(2), optimizer.init(jnp.ones(2)))


def test_a_chain_after_them_warns():
    with pytest.warns(UserWarning, match="jaxfog.optax.diloco is followed"):
        jfo.check_chain(optax.chain(jfo.diloco(optax.sgd(0.1), every=2),
                                    optax.clip(1.0)))


# --- MPI -----------------------------------------------------------------------------------------


@mpi_test(nprocs=(4,), timeout=300, x64=True)
def test_mpi_processes_give_the_simulated_iterates_and_send_only_at_syncs():
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
    topology = T.exponential(n)
    jf.set_topology(topology)
    problem = oc.least_squares(n)
    loss = problem.loss(n)
    lr = 0.3 / problem.lipschitz
    every, steps = 3, 6
    d = problem.A.shape[-1]
    inner = optax.sgd(lr, momentum=0.5)
    cases = [("local_sgd gossip", jfo.local_sgd(inner, every=every, communication="gossip"),
              "neighbor_allreduce", d),
             ("diloco", jfo.diloco(inner, every=every), "allreduce", d),
             ("diloco neighbor", jfo.diloco(inner, every=every, communication="neighbor",
                                            topology=T.one_peer_exponential(n)),
              "neighbor_allreduce", 2 * d),
             ("diloco top_k", jfo.diloco(inner, every=every, compressor=C.top_k(0.3)),
              "allgather", C.tree_bytes(C.top_k(0.3), np.zeros(d)) / 8),
             ("noloco", jfo.noloco(inner, every=every), "neighbor_allreduce", d),
             # to every agent it is ever paired with (3 on 4 agents), as choco does
             ("noloco top_k", jfo.noloco(inner, every=every, compressor=C.top_k(0.3)),
              "neighbor_allgather", C.tree_bytes(C.top_k(0.3), np.zeros(d)) / 8)]
    peers = {"allgather": n - 1, "neighbor_allgather": n - 1}
    for name, optimizer, op, floats in cases:
        def one_step(x, state, a, b):
            updates, state = optimizer.update(jax.grad(loss)(x, a, b), state, x)
            return optax.apply_updates(x, updates), state

        def agent(a, b):
            def body(carry, _):
                carry = one_step(*carry, a, b)
                return carry, carry[0]

            x = jnp.zeros(d, a.dtype)
            return jax.lax.scan(body, (x, optimizer.init(x)), None, length=steps)[1]

        step = jf.jit(one_step)
        x = jnp.zeros(d)
        state = optimizer.init(x)
        mine, sent = [], []
        for k in range(steps):
            jf.comm_stats(reset=True)
            x, state = jax.block_until_ready(step(x, state, problem.A[r], problem.B[r]))
            sent.append({o: s for o, s in jf.comm_stats().items() if s.calls})
            mine.append(np.asarray(x))
        for k, stats in enumerate(sent):
            if (k + 1) % every:
                assert stats == {}, (name, k, stats)  # nothing at all between syncs
            else:
                assert set(stats) == {op} and stats[op].calls == 1, (name, k, stats)
                if op == "allreduce":
                    assert stats[op].bytes > 0, (name, stats)
                else:  # one message per peer; the allgather's payload to every other rank
                    assert stats[op].bytes == floats * 8 * stats[op].messages, (name, stats)
                    assert stats[op].messages == peers.get(op, 1), stats
        every_rank = MPI.COMM_WORLD.gather(np.stack(mine))
        if r == 0:
            simulated = np.asarray(jax.jit(jf.simulate(agent, topology))(problem.A, problem.B))
            np.testing.assert_allclose(np.stack(every_rank), simulated, rtol=0,
                                       atol=1e-12 * np.abs(simulated).max(), err_msg=name)
            assert np.abs(simulated[:, -1]).max() > 1e-3, name
