"""The simulation backend in one process, against numpy; no MPI involved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
import jaxfog.topology as T
from cases import cases

pytestmark = [pytest.mark.jax_internals, pytest.mark.numerical, pytest.mark.usefixtures("x64")]


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_shared_matrix_against_numpy(n):
    X = np.random.default_rng(n).standard_normal((n, 6, 3))
    for name, fn, reference in cases(n):
        got = jax.jit(jf.simulate(fn, n))(X)
        np.testing.assert_allclose(got, reference(X), rtol=1e-12, atol=1e-14, err_msg=name)


def test_rank_size_and_machines():
    def agent(x):
        return jnp.stack([jf.rank(), jf.size(), jf.local_rank(), jf.machine_rank(),
                          jf.local_size(), jf.machine_size()]) + 0 * x

    out = jf.simulate(agent, 6, local_size=3)(jnp.zeros((6, 6), jnp.int32))
    r = np.arange(6)
    np.testing.assert_array_equal(out, np.stack([r, 6 + 0 * r, r % 3, r // 3, 3 + 0 * r,
                                                 2 + 0 * r], axis=1))


def test_every_schedule_entry_and_traced_steps_in_scan():
    n = 8
    X = np.random.default_rng(1).standard_normal((n, 4))
    for schedule in (T.one_peer_exponential(n), T.inner_outer_ring(n, 4), T.one_peer(T.ring(n))):
        run = jax.jit(jf.simulate(lambda x: jax.lax.scan(
            lambda c, t: (jf.neighbor_allreduce(c, topology=schedule, step=t), None),
            x, jnp.arange(5))[0], n))
        expected = X
        for t in range(5):
            expected = schedule.at(t).weights @ expected
        np.testing.assert_allclose(run(X), expected, rtol=1e-12)
    S = T.one_peer_exponential(n)
    exact = jf.simulate(lambda x: jax.lax.fori_loop(
        0, 3, lambda t, c: jf.neighbor_allreduce(c, topology=S, step=t), x), n)(X)
    np.testing.assert_allclose(exact, np.tile(X.mean(0), (n, 1)), rtol=1e-14)


def test_local_view_from_rank_indexed_arrays():
    n = 5
    X = np.random.default_rng(2).standard_normal((n, 3))
    rng = np.random.default_rng(3)
    src = rng.uniform(0, 1, (n, n)) * (rng.random((n, n)) < 0.5)
    dst = rng.uniform(0.5, 2, (n, n))
    sw = rng.uniform(0.1, 1, n)
    w = src * dst.T
    np.fill_diagonal(w, sw)
    out = jf.simulate(lambda x: jf.neighbor_allreduce(x, self_weight=sw, src_weights=src,
                                                      dst_weights=dst), n)(X)
    np.testing.assert_allclose(out, w @ X, rtol=1e-13)
    # A dict is one agent's view, the same for every agent: agent 1 cannot name itself.
    with pytest.raises(ValueError, match="agent 1 cannot be its own neighbor.*rank-indexed"):
        jf.simulate(lambda x: jf.neighbor_allreduce(x, self_weight=0.5,
                                                    src_weights={1: 0.5}), n)(X)


def test_dtypes_match_the_mpi_rounding_rules():
    n = 4
    W = T.exponential(n).weights
    ints = (np.random.default_rng(4).standard_normal((n, 7)) * 1000).astype(np.int64)
    out = jf.simulate(jf.neighbor_allreduce, n)(jnp.asarray(ints, jnp.int32))
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out, np.rint(W @ ints))
    half = jf.simulate(jf.neighbor_allreduce, n)(jnp.asarray(ints / 1000, jnp.bfloat16))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(np.float64), W @ (ints / 1000), atol=3e-2)


def test_hierarchical_with_declared_machines():
    n = 6
    X = np.random.default_rng(5).standard_normal((n, 4))
    means = X.reshape(3, 2, 4).mean(1)
    ring = T.ring(3, style=1)
    out = jf.simulate(jf.hierarchical_neighbor_allreduce, n, local_size=2,
                      machine_topology=ring)(X)
    np.testing.assert_allclose(out, np.repeat(ring.weights @ means, 2, axis=0), rtol=1e-13)


def test_errors():
    with pytest.raises(ValueError, match="local_size=4 must be a positive divisor"):
        jf.simulate(jf.allreduce, 6, local_size=4)
    with pytest.raises(TypeError, match="needs a Topology, a Schedule or a number of agents"):
        jf.simulate(jf.allreduce, "eight")
    with pytest.raises(RuntimeError, match="cannot be used inside jaxfog.simulate"):
        jf.simulate(lambda x: x + len(jf.in_neighbor_ranks()), 3)(np.zeros(3))
    with pytest.raises(ValueError, match="has 4 nodes but there are 3 ranks"):
        jf.simulate(lambda x: jf.neighbor_allreduce(x, topology=T.ring(4)), 3)(np.zeros(3))


def test_simulate_takes_a_schedule():
    n = 8
    schedule = T.one_peer_exponential(n)
    X = np.random.default_rng(6).standard_normal((n, 3))

    def agent(x):  # no topology=: the simulation's schedule, at the step given
        return jax.lax.scan(lambda c, t: (jf.neighbor_allreduce(c, step=t), None), x,
                            jnp.arange(5))[0]

    expected = X
    for t in range(5):
        expected = schedule.at(t).weights @ expected
    np.testing.assert_allclose(jax.jit(jf.simulate(agent, schedule))(X), expected, rtol=1e-12)
    # optax's transformations follow it too (the step is their counter).
    assert jf.simulate(lambda x: jf.size() + 0 * x, schedule)(X)[0, 0] == n
    with pytest.raises(ValueError, match="a Schedule needs step=.*the simulation's topology"):
        jf.simulate(jf.neighbor_allreduce, schedule)(X)
    with pytest.raises(ValueError, match="needs src_ranks when the simulation's topology is "
                                         "a Schedule"):
        jf.simulate(jf.neighbor_allgather, schedule)(X)


@pytest.mark.parametrize("x64", [True, False], ids=["x64", "x32"])
def test_integers_average_in_float64_with_x64_on_and_off(x64):
    """The C++ handlers average integers in float64 whatever jax_enable_x64
    says; so does the simulation (int32 values beyond float32's 24 bits)."""
    n = 5
    big = np.array([2**30 + 1, 2**30 + 7, -(2**29) + 3, 12345677, 2**31 - 9])
    ring = T.ring(n)
    with jax.enable_x64(x64):
        x = jnp.asarray(big, jnp.int32)
        mixed = jax.jit(jf.simulate(lambda v: jf.neighbor_allreduce(v, topology=ring), n))(x)
        mean = jf.simulate(jf.allreduce, n)(x)
        total = jf.simulate(lambda v: jf.allreduce(v, op="sum"), n)(x // 8)
        hier = jf.simulate(jf.hierarchical_neighbor_allreduce, n - 1, local_size=2)(x[:4])
    assert mixed.dtype == mean.dtype == jnp.int32
    np.testing.assert_array_equal(mixed, np.rint(ring.weights @ big))
    np.testing.assert_array_equal(mean, np.full(n, np.rint(big.mean())))
    np.testing.assert_array_equal(total, np.full(n, (big // 8).sum()))
    # Rounded after the machine mean and after the mixing, as the C++ path does.
    machine_means = np.rint(big[:4].reshape(2, 2).mean(1))
    np.testing.assert_array_equal(
        hier, np.repeat(np.rint(T.exponential(2).weights @ machine_means), 2))
