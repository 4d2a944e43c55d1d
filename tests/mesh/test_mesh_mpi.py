"""Agents on a JAX device mesh (``simulate(mesh=...)``), across processes.

Each MPI process contributes its one CPU device to a global mesh through
``jax.distributed`` (gloo collectives between CPU processes): the layout CI
can run (in-process host devices deadlock XLA's CPU rendezvous on 2 cores).
Every case of ``one_program_cases`` (every op and argument form, windows,
every optax transformation, the asynchronous trainers in simulated time)
gives the vmapped simulation's values to 1e-12 in float64, with one agent per
device and with several.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mpi_harness import computed_once, mpi_test

pytestmark = pytest.mark.jax_internals


def _compare(got, want, name: str) -> None:
    """Each of this process's rows of the global result against the simulation's."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        for shard in a.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(b)[shard.index],
                                       rtol=1e-12, atol=1e-12, err_msg=name)


def test_processes_sharing_a_gpu_are_refused_by_name():
    """NCCL (XLA's GPU collectives) takes one process per GPU: init_distributed
    refuses a job whose processes share one, the same way on every process."""
    import jaxfog.mesh as M

    assert M.gpu_identity() is None  # JAX on the CPU: nothing to share
    assert M.shared_gpus([None, None]) is None
    assert M.shared_gpus([("a", ["0"]), ("a", ["1"]), ("b", ["0"])]) is None
    why = M.shared_gpus([("a", ["0"]), ("b", ["0"]), ("a", ["1", "0"])])
    assert "processes 0 and 2 share GPU 0 on a" in why and "per_device" in why


def test_gpu_identity_is_decided_without_starting_jax(monkeypatch):
    """Before jax.distributed starts (processes sharing a GPU hung in the GPU
    client's start-up): from jax_platforms and CUDA_VISIBLE_DEVICES alone."""
    import socket

    import jaxfog.mesh as M

    before = jax.config.jax_platforms
    try:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
        jax.config.update("jax_platforms", "cuda,cpu")
        assert M.gpu_identity() == (socket.gethostname(), ["3", "1"])
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        assert M.gpu_identity() is None  # CUDA hidden: nothing to share
        jax.config.update("jax_platforms", "cpu,cuda")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        assert M.gpu_identity() is None
    finally:
        jax.config.update("jax_platforms", before)


@mpi_test(nprocs=(2, 4), env={"JAXFOG_NODES_PER_MACHINE": "2"}, timeout=300, alone=True, x64=True)
def test_every_case_on_the_mesh_matches_the_simulation():
    """4 agents: one per device on 4 processes, two per device on 2."""
    import jaxfog.mesh as M

    M.init_distributed()

    import jaxfog as jf
    import jaxfog.topology as T
    from one_program_cases import cases

    mesh = M.agent_mesh()
    n = 4
    assert len(jax.local_devices()) == 1
    expo = T.exponential(n)
    def simulated(case):
        jf.reset_clocks()
        return jax.jit(jf.simulate(case.fn, expo, local_size=2, delays=case.delays))(*case.args)

    every = cases(n)
    for case, want in zip(every, computed_once(simulated, every), strict=True):
        jf.reset_clocks()
        args = [M.global_array(mesh, M.AXIS, lambda i, a=a: a[i], n) for a in case.args]
        got = jax.jit(jf.simulate(case.fn, expo, local_size=2, delays=case.delays,
                                  mesh=mesh))(*args)
        jf.reset_clocks()
        _compare(got, want, case.name)


@mpi_test(nprocs=(2, 3), timeout=180, alone=True, x64=True)
def test_mesh_ops_grad_scan_and_agents():
    import jax.numpy as jnp

    import jaxfog.mesh as M

    devices = M.init_distributed()

    import jaxfog as jf
    import jaxfog.topology as T

    mesh = M.agent_mesh()
    for n in (devices, 3 * devices):  # 1 and 3 agents per device
        X = np.random.default_rng(n).standard_normal((n, 5))
        schedule = T.one_peer_exponential(n)

        def step(x):  # ops, grad through the adjoint, scan, a schedule
            mixed = jax.lax.scan(lambda c, _: (jf.neighbor_allreduce(c), None), x, None,
                                 length=3)[0]
            g = jax.grad(lambda v: jnp.sum(jf.neighbor_allreduce(v) ** 2))(x)
            peers = jax.lax.fori_loop(0, 3, lambda t, c: jf.neighbor_allreduce(
                c, topology=schedule, step=t), x)
            return (mixed, g, peers, jf.allreduce(x * jf.rank()), jf.broadcast(x, root=n - 1),
                    jf.allgather(x), jf.neighbor_allgather(x))

        for graph in (T.ring(n), T.exponential(n)):
            want = jax.jit(jf.simulate(step, graph))(X)
            got = jax.jit(jf.simulate(step, graph, mesh=mesh))(
                M.global_array(mesh, M.AXIS, lambda i: X[i], n))
            _compare(got, want, f"{graph.name}, {n} agents")
            np.testing.assert_allclose(want[0], np.linalg.matrix_power(graph.weights, 3) @ X,
                                       rtol=1e-12)

    # Agents(mesh=...): the same script as for MPI processes or simulated agents.
    n = devices
    agents = jf.Agents(mesh=mesh, topology=T.ring)
    assert agents.size == n and agents.is_root == (jax.process_index() == 0)
    x = agents.data(lambda r: np.full(3, float(r)))
    x = agents.map(jf.neighbor_allreduce)(x)
    np.testing.assert_allclose(agents.mean(x), np.full(3, (n - 1) / 2), rtol=1e-12)
    rows = np.repeat(np.arange(float(n))[:, None], 3, axis=1)
    np.testing.assert_allclose(agents.gather(x), T.ring(n).weights @ rows, rtol=1e-12)
    pair = agents.data(lambda r: (np.float64(r), np.arange(2.0) * r))
    np.testing.assert_allclose(agents.mean(pair)[1], np.arange(2.0) * (n - 1) / 2)


@mpi_test(nprocs=(2,), timeout=120, alone=True)
def test_mesh_bad_input():
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import jaxfog.mesh as M

    M.init_distributed()
    import jaxfog as jf
    import jaxfog.topology as T

    mesh = M.agent_mesh()
    fn = jf.neighbor_allreduce
    with pytest.raises(ValueError, match=r"3 agents on a mesh axis of 2 devices: each device "
                                         r"holds the same number of agents, so the topology "
                                         r"needs a multiple of 2 agents"):
        jf.simulate(fn, T.ring(3), mesh=mesh)
    two_axes = Mesh(np.array(jax.devices()).reshape(2, 1), ("data", "model"))
    with pytest.raises(ValueError, match=r"the mesh has no axis 'agents' \(its axes: "):
        jf.simulate(fn, T.ring(2), mesh=two_axes)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jf.simulate(fn, T.ring(2), mesh="gpu")
    with pytest.raises(ValueError, match="in_axes must be 0 or None"):
        jf.simulate(fn, T.ring(2), mesh=mesh, in_axes=1)(jnp.ones((3, 2)))
    # An argument on a device outside the mesh (here: the other process's).
    first = M.agent_mesh(jax.devices()[:1])
    if jax.process_index() == 1:
        with pytest.raises(ValueError, match="argument 0 is on .*outside the agents' mesh"):
            jf.simulate(lambda x: x, T.Topology(np.ones((1, 1))), mesh=first)(
                jax.device_put(jnp.ones((1, 2)), jax.local_devices()[0]))


@mpi_test(nprocs=(2,), timeout=180, alone=True)
def test_mesh_checkpoints_are_the_simulated_layout():
    """A mesh of 2 processes saves its global arrays as one checkpoint, in the
    layout of simulated agents, and restores them bit for bit."""
    import json
    import os
    import tempfile

    import jaxfog.mesh as M

    M.init_distributed()
    from mpi4py import MPI

    import jaxfog as jf
    from jaxfog.checkpoint import CheckpointManager

    directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if jax.process_index() == 0 else None)
    agents = jf.Agents(mesh=True)
    state = agents.data(lambda r: {"w": np.arange(3.0) + r, "step": np.int32(r)})
    with CheckpointManager(directory, async_save=False) as manager:
        assert manager.save(5, state)
        assert manager.latest_step() == 5
        restored = manager.restore(5, like=state)
    assert restored["w"].sharding == state["w"].sharding
    np.testing.assert_array_equal(agents.gather(restored["w"]), agents.gather(state["w"]))
    np.testing.assert_array_equal(agents.gather(restored["step"]), np.arange(2))
    with open(os.path.join(directory, "jaxfog.json")) as f:
        assert json.load(f) == {"processes": 1}
