"""The meshes JAX users make, in one process: ``jax.make_mesh`` (Explicit axes
by default), Auto and Explicit axes named, with arrays on any placement.

One device only: in-process collectives over several host devices deadlock
XLA:CPU's rendezvous on the 2-core CI machines (meshes of several processes:
``test_mesh_mpi.py``). Four agents share the device, so the vmap inside
``shard_map`` carries the ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfog as jf
import jaxfog.topology as T

pytestmark = [pytest.mark.jax_internals, pytest.mark.usefixtures("x64")]

N = 4
W = T.ring(N).weights


def _mesh(kind):
    if kind == "default":  # what users write; Explicit since jax 0.10
        return jax.make_mesh((1,), ("agents",))
    return jax.make_mesh((1,), ("agents",), axis_types=(kind,))


MESHES = ["default", AxisType.Explicit, AxisType.Auto]


def agent(x):
    """A pytree in, a pytree out: neighbour averaging, a per-agent sum, a collective."""
    return {"mixed": jf.neighbor_allreduce(x["a"]),
            "own": jnp.sum(x["b"]) + jf.rank(),
            "mean": jf.allreduce(x["a"])}


def data():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((N, 3)), "b": rng.standard_normal((N, 2, 2))}


def expected(x):
    return {"mixed": W @ x["a"], "own": x["b"].sum(axis=(1, 2)) + np.arange(N),
            "mean": np.broadcast_to(x["a"].mean(axis=0), (N, 3))}


def _placements(mesh, x):
    return {"numpy": x, "plain": jax.tree.map(jnp.asarray, x),
            "on the mesh": jax.device_put(x, NamedSharding(mesh, P("agents"))),
            "replicated": jax.device_put(x, NamedSharding(mesh, P()))}


def _check(got, want):
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=1e-12, atol=1e-14,
                                   err_msg=key)


@pytest.mark.parametrize("kind", MESHES, ids=str)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("on_mesh", [True, False], ids=["mesh=", "vmap"])
def test_make_mesh_any_placement(kind, jit, on_mesh):
    """simulate(mesh=) and the vmapped simulate take every placement of the
    input on every kind of mesh, with the values numpy gives."""
    mesh = _mesh(kind)
    x = data()
    fn = jf.simulate(agent, T.ring(N), mesh=mesh if on_mesh else None)
    fn = jax.jit(fn) if jit else fn
    placements = _placements(mesh, x)
    if on_mesh and not jit:  # eager shard_map compiles op by op: seconds a call
        placements = {k: placements[k] for k in ("numpy", "on the mesh")}
    for where, value in placements.items():
        got = fn(value)
        _check(got, expected(x))
        if on_mesh:  # the agents come back laid along the mesh axis
            assert got["mixed"].sharding.is_equivalent_to(
                NamedSharding(mesh, P("agents")), 2), where


def test_vmapped_keeps_an_explicit_agent_sharding():
    """On an Explicit mesh the vmapped simulation's outputs keep the agent
    sharding of its inputs (and stay unsharded for plain inputs)."""
    mesh = _mesh("default")
    x = data()
    fn = jax.jit(jf.simulate(agent, T.ring(N)))
    placed = fn(jax.device_put(x, NamedSharding(mesh, P("agents"))))
    assert jax.typeof(placed["mixed"]).sharding.spec == P("agents", None)
    plain = fn(x)
    assert jax.typeof(plain["mixed"]).sharding.mesh.empty


def test_issue_reproduction():
    """The two failures a user met (issue 34)."""
    mesh = jax.make_mesh((1,), ("agents",))
    x = jnp.arange(8.0).reshape(N, 2)
    got = jax.jit(jf.simulate(jf.neighbor_allreduce, T.ring(N), mesh=mesh))(x)
    np.testing.assert_allclose(got, W @ np.asarray(x), rtol=1e-12)
    placed = jax.device_put(x, NamedSharding(mesh, P("agents")))
    got = jf.simulate(jf.neighbor_allreduce, T.ring(N))(placed)
    np.testing.assert_allclose(got, W @ np.asarray(x), rtol=1e-12)


@pytest.mark.parametrize("kind", MESHES, ids=str)
def test_under_set_mesh_grad_scan_and_unmapped_args(kind):
    """jax.set_mesh (JAX's advice for Explicit meshes), grad through the
    adjoint W^T, scan, and an argument every agent shares (in_axes None)."""
    mesh = _mesh(kind)
    x = np.random.default_rng(1).standard_normal((N, 3))

    def step(x, scale):
        mixed = jax.lax.scan(lambda c, _: (jf.neighbor_allreduce(c), None), x, None,
                             length=2)[0]
        return mixed * scale

    def loss(x, on):
        sim = jf.simulate(step, T.ring(N), in_axes=(0, None), mesh=on)
        return jnp.sum(sim(x, jnp.float64(3.0)) ** 2)

    W2 = W @ W
    want_grad = 2 * 9.0 * W2.T @ W2 @ x
    placed = jax.device_put(x, NamedSharding(mesh, P("agents")))
    with jax.set_mesh(mesh):
        for on in (mesh, None):
            for value in (x, placed):
                np.testing.assert_allclose(jax.jit(jax.grad(loss), static_argnums=1)(value, on),
                                           want_grad, rtol=1e-12)


@pytest.mark.parametrize("kind", MESHES, ids=str)
def test_windows_and_delays_on_an_explicit_mesh(kind):
    """Window state and simulated clocks kept across calls live on the mesh."""
    mesh = _mesh(kind)
    x = np.random.default_rng(2).standard_normal((N, 2))

    def put_and_update(x):
        jf.win_create(x, "mesh_w")
        y = jf.win_update(jf.win_put(x, "mesh_w"), "mesh_w")
        jf.win_free("mesh_w")
        return y

    for on in (mesh, None):
        value = jax.device_put(x, NamedSharding(mesh, P("agents")))
        got = jax.jit(jf.simulate(put_and_update, T.ring(N), mesh=on))(value)
        np.testing.assert_allclose(got, W @ x, rtol=1e-12)
        timed = jax.jit(jf.simulate(jf.neighbor_allreduce, T.ring(N), mesh=on,
                                    delays=jf.Delays(compute=1.0)))
        np.testing.assert_allclose(timed(value), W @ x, rtol=1e-12)
        jf.reset_clocks()


@pytest.mark.parametrize("kind", MESHES, ids=str)
def test_agents_on_a_make_mesh(kind):
    """Agents(mesh=) with jax.make_mesh: data, map, mean and gather, pytrees too."""
    mesh = _mesh(kind)
    agents = jf.Agents(mesh=mesh, topology=T.ring, per_device=N)
    assert agents.size == N and agents.simulated
    x = agents.data(lambda r: np.full(3, float(r)))
    rows = np.repeat(np.arange(float(N))[:, None], 3, axis=1)
    y = agents.map(jf.neighbor_allreduce)(x)
    np.testing.assert_allclose(agents.gather(y), W @ rows, rtol=1e-12)
    np.testing.assert_allclose(agents.mean(y), np.full(3, (N - 1) / 2), rtol=1e-12)
    # A plain array the script made itself goes in as well.
    np.testing.assert_allclose(agents.gather(agents.map(jf.neighbor_allreduce)(rows)),
                               W @ rows, rtol=1e-12)
    pair = agents.data(lambda r: (np.float64(r), np.arange(2.0) * r))
    mean = agents.mean(agents.map(lambda p: (jf.neighbor_allreduce(p[0]), p[1]))(pair))
    np.testing.assert_allclose(mean[0], (N - 1) / 2, rtol=1e-12)
    np.testing.assert_allclose(mean[1], np.arange(2.0) * (N - 1) / 2, rtol=1e-12)

