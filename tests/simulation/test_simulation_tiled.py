"""The column-tiled mixing (jaxfog/simulation/_tiled.py, issue 45) on CPU: Pallas'
interpreter against numpy ``W @ X`` and today's gather path (the oracle), and
its Triton lowering built for CUDA without a GPU. Its speed is the GPU check's
(benchmarks/bench_gpu.py --part simulate)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
import jaxfog.topology as T
from jaxfog.simulation import _tiled
from jaxfog.testing import load_module
from paths import REPO

# in- and out-degree 4
random_regular = load_module(REPO / "benchmarks"
                             / "bench_simulate.py").random_regular

pytestmark = [pytest.mark.jax_internals, pytest.mark.numerical]

D = 300  # not a multiple of the interpreter's 128-column tile: a ragged last tile


GRAPHS = {
    "exponential": T.exponential,
    "ring": T.ring,
    "one-peer entry": lambda n: T.one_peer_exponential(n).at(1),
    "regular-4": random_regular,
}


def both(fn, topology, *args, **kwargs):
    """fn simulated on the tiled path and on the gather path, jitted."""
    out = []
    for path in ("tiled", "gather"):
        with _tiled.forcing(path):
            out.append(jax.jit(jf.simulate(fn, topology, **kwargs))(*args))
    return out


@pytest.mark.parametrize("graph,n", [("exponential", 1), ("ring", 2), ("exponential", 5),
                                     ("ring", 8), ("one-peer entry", 8), ("regular-4", 7)])
def test_equals_numpy_and_the_gather_path(graph, n):
    topology = GRAPHS[graph](n)
    X = np.random.default_rng(n).standard_normal((n, D)).astype(np.float32)
    tiled, gather = both(jf.neighbor_allreduce, topology, X)
    np.testing.assert_allclose(tiled, topology.weights @ X, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tiled, gather, rtol=1e-6, atol=1e-7)
    # The kernel alone, on a leaf with trailing dims.
    src, wt = _tiled.table(topology.weights)
    got = jax.jit(lambda x: _tiled.mix_stacked(x, src, wt))(X.reshape(n, 3, 100))
    np.testing.assert_allclose(got.reshape(n, D), topology.weights @ X, rtol=1e-5, atol=1e-6)


def test_table_rows_follow_the_gather_order():
    w = random_regular(9).weights
    src, wt = _tiled.table(w)
    dense = np.zeros_like(w)
    for i in range(9):
        assert src[i, 0] == i  # the agent itself first
        offsets = (i - src[i, 1:]) % 9
        assert (np.diff(offsets[wt[i, 1:] != 0]) > 0).all()
        np.add.at(dense[i], src[i], wt[i])
    np.testing.assert_array_equal(dense, w)


def test_dtypes_follow_the_rounding_rules():
    n = 6
    topology = T.exponential(n)
    rng = np.random.default_rng(3)
    # Integers averaged in float64, rounded half to even: weights 1/2 give ties.
    ring = T.from_weights(np.eye(n) / 2 + np.roll(np.eye(n), 1, axis=1) / 2)
    ints = rng.integers(-1000, 1000, (n, 37)).astype(np.int32)
    for topo in (topology, ring):
        tiled, gather = both(jf.neighbor_allreduce, topo, ints)
        assert tiled.dtype == jnp.int32
        np.testing.assert_array_equal(tiled, gather)
        np.testing.assert_array_equal(tiled, np.round(topo.weights @ ints.astype(np.float64)))
    half = jnp.asarray(rng.standard_normal((n, 2, 70)), jnp.bfloat16)
    tiled, gather = both(jf.neighbor_allreduce, topology, half)
    assert tiled.dtype == jnp.bfloat16
    np.testing.assert_array_equal(tiled.astype(np.float32), gather.astype(np.float32))
    scalars = np.arange(n, dtype=np.float32)  # one value per agent
    tiled, gather = both(jf.neighbor_allreduce, topology, scalars)
    np.testing.assert_allclose(tiled, topology.weights @ scalars, rtol=1e-6)


def test_round_half_even_matches_jnp_round():
    v = np.array([-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4999, 2.5001, -7.2, 1e15 + 0.5,
                  0.0])
    np.testing.assert_array_equal(_tiled._round_half_even(jnp.asarray(v, jnp.float32)),
                                  np.round(v.astype(np.float32)))


def test_grad_mixes_with_the_transpose():
    n = 7
    topology = random_regular(n, seed=1)  # W is not symmetric
    W = topology.weights
    X = np.random.default_rng(4).standard_normal((n, 40)).astype(np.float32)

    def loss(x):
        return jnp.sum(jnp.sin(jf.simulate(jf.neighbor_allreduce, topology)(x)))

    with _tiled.forcing("tiled"):
        outside = jax.jit(jax.grad(loss))(X)

        def agent(x):  # the gradient taken inside the agent's code
            return jax.grad(lambda v: jnp.sum(jnp.sin(jf.neighbor_allreduce(v))))(x)

        inside = jax.jit(jf.simulate(agent, topology))(X)
    want = W.T @ np.cos(W @ X)
    np.testing.assert_allclose(outside, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inside, want, rtol=1e-5, atol=1e-6)


def test_vmap_outside_and_inside_the_agents():
    n = 5
    topology = T.exponential(n)
    W = topology.weights
    X = np.random.default_rng(5).standard_normal((3, n, 50)).astype(np.float32)
    with _tiled.forcing("tiled"):
        outer = jax.jit(jax.vmap(jf.simulate(jf.neighbor_allreduce, topology)))(X)
        # A vmap inside the agent's code: its axis becomes more columns.
        inner = jax.jit(jf.simulate(jax.vmap(jf.neighbor_allreduce), topology))(
            X.transpose(1, 0, 2))
    want = np.einsum("ij,bjd->bid", W, X)
    np.testing.assert_allclose(outer, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inner, want.transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


def test_schedule_with_traced_steps_and_a_static_local_view():
    n = 8
    schedule = T.one_peer_exponential(n)
    X = np.random.default_rng(6).standard_normal((n, 20)).astype(np.float32)

    def agent(x):
        return jax.lax.fori_loop(
            0, 3, lambda t, c: jf.neighbor_allreduce(c, topology=schedule, step=t), x)

    tiled, gather = both(agent, n, X)
    np.testing.assert_allclose(tiled, np.tile(X.mean(0), (n, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tiled, gather, rtol=1e-6, atol=1e-7)
    # A static local view: rank-indexed tables.
    rng = np.random.default_rng(7)
    src = rng.uniform(0, 1, (n, n)) * (rng.random((n, n)) < 0.4)
    sw = rng.uniform(0.1, 1, n)
    w = src.copy()
    np.fill_diagonal(w, sw)
    tiled, gather = both(lambda x: jf.neighbor_allreduce(x, self_weight=sw, src_weights=src),
                         n, X)
    np.testing.assert_allclose(tiled, w @ X, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tiled, gather, rtol=1e-6, atol=1e-7)


def test_hierarchical_form():
    n, local = 8, 2
    X = np.random.default_rng(8).standard_normal((n, 30)).astype(np.float32)
    wm = T.exponential(n // local).weights
    want = np.kron(wm, np.ones((local, local)) / local) @ X
    tiled, gather = both(jf.hierarchical_neighbor_allreduce, n, X, local_size=local)
    np.testing.assert_allclose(tiled, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tiled, gather, rtol=1e-6, atol=1e-6)
    ints = np.random.default_rng(9).integers(-99, 99, (n, 11)).astype(np.int32)
    tiled, gather = both(jf.hierarchical_neighbor_allreduce, n, ints, local_size=local)
    np.testing.assert_array_equal(tiled, gather)
    tiled, gather = both(jf.hierarchical_neighbor_allreduce, 4, ints[:4], local_size=1)
    np.testing.assert_array_equal(tiled, gather)  # one agent a machine

    def loss(x):
        return jnp.sum(jnp.sin(jf.simulate(jf.hierarchical_neighbor_allreduce, n,
                                           local_size=local)(x)))

    with _tiled.forcing("tiled"):
        grad = jax.jit(jax.grad(loss))(X)
    A = np.kron(wm, np.ones((local, local)) / local)
    np.testing.assert_allclose(grad, A.T @ np.cos(A @ X), rtol=1e-5, atol=1e-6)


def _uses_kernel(fn, *args) -> bool:
    # A fresh function each time: JAX caches traces, and the switch is read
    # when a simulation is traced.
    return "pallas_call" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def test_the_switch(monkeypatch):
    n = 4
    step = jf.simulate(jf.neighbor_allreduce, n)
    X = np.zeros((n, 10), np.float32)
    monkeypatch.delenv(_tiled.ENV, raising=False)
    assert _tiled.mode() == "auto"
    assert not _uses_kernel(step, X)  # auto on CPU: the gather path, untouched
    monkeypatch.setenv(_tiled.ENV, "tiled")
    assert _uses_kernel(step, X)
    monkeypatch.setenv(_tiled.ENV, "gather")
    assert not _uses_kernel(step, X)
    with _tiled.forcing("tiled"):
        assert _uses_kernel(step, X)
    monkeypatch.setenv(_tiled.ENV, "fast")
    with pytest.raises(ValueError, match="JAXFOG_SIM_MIXING='fast'"):
        step(X)
    # auto on a GPU too: the gather path until the kernel is measured there;
    # a traced self weight keeps the gather path even when tiled is asked for.
    monkeypatch.setenv(_tiled.ENV, "auto")
    monkeypatch.setattr(_tiled, "_on_gpu", lambda: True)
    assert not _uses_kernel(step, X)
    monkeypatch.setenv(_tiled.ENV, "tiled")
    assert not _uses_kernel(jf.simulate(lambda x, s: jf.neighbor_allreduce(
        x, self_weight=s, src_weights=np.full((n, n), 0.1)), n), X, np.ones(n, np.float32))


def test_explicit_meshes_keep_the_gather_path():
    """Pallas takes no sharding-typed operands: under jax.set_mesh with an
    Explicit axis (tests/mesh/test_mesh.py's case) the gather path runs."""
    n = 4
    X = np.random.default_rng(10).standard_normal((n, 6)).astype(np.float32)
    mesh = jax.make_mesh((1,), ("agents",), axis_types=(jax.sharding.AxisType.Explicit,))
    with _tiled.forcing("tiled"), jax.set_mesh(mesh):
        step = jf.simulate(jf.neighbor_allreduce, n)
        assert not _uses_kernel(step, X)
        np.testing.assert_allclose(jax.jit(step)(X), T.exponential(n).weights @ X, rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.skipif(jax.__version_info__ >= (0, 12),
                    reason="jax >= 0.12 lowers Pallas' Triton backend only for a GPU it "
                           "can see (or an abstract device): tests/gpu/test_gpu.py compiles "
                           "the kernel on the GPU machine")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_triton_lowering_builds_without_a_gpu(dtype):
    n = 6
    tables = [_tiled.table(random_regular(n).weights),
              _tiled.machine_table(T.exponential(3).weights, 2)]
    with jax.enable_x64(dtype == jnp.int32):
        for src, wt in tables:
            lowered = jax.jit(lambda x, src=src, wt=wt: _tiled.mix_stacked(
                x, src, wt, interpret=False)).trace(
                jax.ShapeDtypeStruct((n, 3000), dtype)).lower(lowering_platforms=("cuda",))
            text = lowered.as_text()
            assert "xla.gpu.triton" in text and "grid_x = 6" in text  # rows: program_id(0)
