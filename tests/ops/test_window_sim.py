"""Windows on simulated agents: the same per-agent code as under MPI, against
the numpy model of the windows (tests/window_cases.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
import jaxfog.topology as T
from jaxfog.ops import window as W
from window_cases import agent_sequence, model_outputs, random_sequence

pytestmark = [pytest.mark.jax_internals, pytest.mark.usefixtures("x64")]


def _graphs(n):
    rng = np.random.default_rng(n)
    directed = (rng.random((n, n)) < 0.5).astype(float)
    np.fill_diagonal(directed, 0)
    for i in range(n):
        directed[i, (i - 1) % n] = 1.0
    directed += np.eye(n)
    directed /= directed.sum(axis=1, keepdims=True)
    return [T.exponential(n), T.ring(n), T.star(n), T.from_weights(directed)]


def _sources(topo):
    return (topo.weights != 0) & ~np.eye(topo.size, dtype=bool)


@pytest.mark.parametrize("n", [2, 4, 5])
@pytest.mark.parametrize("graph", range(4))
def test_random_sequences_match_the_model(n, graph):
    topo = _graphs(n)[graph]
    X = np.random.default_rng(graph).standard_normal((n, 3))
    sequence = random_sequence(10 * n + graph, _sources(topo), steps=12)
    got = jax.jit(jf.simulate(lambda x: agent_sequence(x, sequence), topo))(jnp.asarray(X))
    np.testing.assert_allclose(np.swapaxes(np.asarray(got), 0, 1),
                               model_outputs(X, _sources(topo), sequence), rtol=1e-12,
                               atol=1e-12)


def test_put_then_update_is_neighbor_averaging_in_scan():
    n, topo = 5, T.exponential(5)
    X = np.random.default_rng(1).standard_normal((n, 2, 3))

    def agent(x):
        W.win_create({"a": x}, "w")

        def step(c, _):
            W.win_put(c, "w")
            return W.win_update(c, "w"), None

        out = jax.lax.scan(step, {"a": x}, None, length=3)[0]
        W.win_free("w")
        return out["a"]

    got = jax.jit(jf.simulate(agent, topo))(jnp.asarray(X))
    expected = np.einsum("ij,jkl->ikl", np.linalg.matrix_power(topo.weights, 3), X)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_windows_outlive_a_call_and_push_sum_conserves_mass():
    n, topo = 4, T.from_weights(np.array([[1, 0, 0, 1], [1, 1, 0, 0], [1, 1, 1, 0],
                                           [0, 0, 1, 1]], float) / 2)
    X = np.random.default_rng(2).standard_normal((n, 3))
    jf.simulate(lambda x: W.win_create(x, "ps", zero_init=True, with_weight=True), topo)(
        jnp.asarray(X))
    out_degree = ((topo.weights != 0) & ~np.eye(n, dtype=bool)).sum(axis=0)
    share = 1.0 / (out_degree + 1)  # column-stochastic: keep one share, send one per edge

    def step(x):
        a = jnp.asarray(share)[jf.rank()]
        x = W.win_accumulate(x, "ps", self_weight=a,
                             dst_weights=jnp.where(jnp.asarray(_sources(topo).T)[jf.rank()],
                                                   a, 0.0))
        return W.win_update_then_collect(x, "ps"), W.win_weight("ps")

    run = jax.jit(jf.simulate(step, topo))
    x = jnp.asarray(X)
    for _ in range(60):
        x, p = run(x)
        np.testing.assert_allclose(np.sum(p), n, rtol=1e-13)
        np.testing.assert_allclose(np.sum(x, axis=0), X.sum(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(x / p[:, None], np.broadcast_to(X.mean(axis=0), X.shape),
                               rtol=1e-10, atol=1e-10)
    jf.simulate(lambda x: W.win_free("ps") and x, topo)(x)


def test_errors():
    n, topo = 3, T.ring(3)
    x = jnp.ones((n, 4))
    sim = lambda fn: jf.simulate(fn, topo)(x)  # noqa: E731
    cases = [
        ("no window named 'nope'", lambda v: W.win_put(v, "nope")),
        ("does not match window 'e'", lambda v: W.win_create(v, "e") and W.win_update(
            v[:2], "e")),
        ("holds no slot for rank", lambda v: W.win_create(v, "e", src_ranks=[0]) and W.win_put(
            v, "e", dst_weights=[1])),
        ("without with_weight", lambda v: W.win_create(v, "e") and W.win_weight("e")),
        ("exists already", lambda v: W.win_create(v, "e") and W.win_create(v, "e")),
    ]
    for message, body in cases:
        with pytest.raises(ValueError, match=message):
            sim(body)


def test_a_window_created_under_jit_serves_later_jitted_calls():
    n, topo = 4, T.ring(4)
    X = np.arange(n * 2.0).reshape(n, 2)
    jax.jit(jf.simulate(lambda x: jnp.asarray(W.win_create(x, "k")), topo))(jnp.asarray(X))
    put = jax.jit(jf.simulate(lambda x: W.win_put(2 * x, "k"), topo))
    update = jax.jit(jf.simulate(lambda x: W.win_update(x, "k"), topo))
    np.testing.assert_allclose(update(jnp.asarray(X)), X, rtol=1e-12)  # slots hold copies
    put(jnp.asarray(X))
    w = topo.weights
    expected = np.diag(np.diag(w)) @ X + (w - np.diag(np.diag(w))) @ (2 * X)
    np.testing.assert_allclose(update(jnp.asarray(X)), expected, rtol=1e-12)
    jf.simulate(lambda x: jnp.asarray(W.win_free("k")), topo)(jnp.asarray(X))
    with pytest.raises(ValueError, match="no window named 'k'"):
        update(jnp.asarray(X) + 1)  # a new trace (a new input) sees the window gone


def test_a_window_over_a_schedule_reads_from_every_entry_in_neighbour():
    """Without src_ranks, a window made under a Schedule has a slot for each
    in-neighbour of any of its entries (win_create once raised AttributeError)."""
    n, schedule = 4, T.one_peer_exponential(4)
    X = np.random.default_rng(2).standard_normal((n, 3))

    def agent(x):
        W.win_create(x, "w", zero_init=True)
        W.win_get("w")
        out = W.win_update_then_collect(x, "w")
        W.win_free("w")
        return out

    got = jax.jit(jf.simulate(agent, schedule))(jnp.asarray(X))
    sources = np.any([_sources(t) for t in schedule], axis=0)
    np.testing.assert_allclose(got, X + sources.astype(float) @ X, rtol=1e-12)
