"""The runtime and the FFI custom calls on real MPI processes (2, 4, 5 ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_harness import mpi_test


@mpi_test()
def test_ranks_match_mpi():
    """rank/size/local/machine agree with MPI's own view, without faking."""
    import jaxfog as jf
    from mpi4py import MPI

    jf.init()
    world = MPI.COMM_WORLD
    assert (jf.rank(), jf.size()) == (world.Get_rank(), world.Get_size())
    # All ranks run on this one machine.
    assert (jf.local_rank(), jf.local_size()) == (world.Get_rank(), world.Get_size())
    assert (jf.machine_rank(), jf.machine_size()) == (0, 1)
    assert jf.is_homogeneous()
    # jaxfog talks on its own duplicate, never on the user's COMM_WORLD.
    comm = jf.runtime.communicator()
    assert MPI.Comm.Compare(comm, world) == MPI.CONGRUENT
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


@mpi_test(nprocs=(4, 6), env={"JAXFOG_NODES_PER_MACHINE": "2"})
def test_faked_machines():
    import jaxfog as jf
    from jaxfog import topology as T

    jf.init()
    r, n = jf.rank(), jf.size()
    assert (jf.local_rank(), jf.local_size()) == (r % 2, 2)
    assert (jf.machine_rank(), jf.machine_size()) == (r // 2, n // 2)
    assert jf.load_machine_topology() == T.exponential(n // 2)
    assert jf.set_machine_topology(T.ring(n // 2))
    assert jf.load_machine_topology() == T.ring(n // 2)
    with pytest.raises(ValueError, match=f"{n // 2 + 1} nodes but there are {n // 2} "
                                         "machines"):
        jf.set_machine_topology(T.ring(n // 2 + 1))


@mpi_test(nprocs=(3,), env={"BLUEFOG_NODES_PER_MACHINE": "2"})
def test_faked_machines_must_divide_size():
    import jaxfog as jf

    with pytest.raises(ValueError, match="BLUEFOG_NODES_PER_MACHINE=2 must be a positive "
                                         "divisor of the world size 3"):
        jf.init()
    assert not jf.is_initialized()


@mpi_test()
def test_topology_and_neighbors():
    import jaxfog as jf
    from jaxfog import topology as T

    jf.init()
    r, n = jf.rank(), jf.size()
    # Default: exponential graph; rank r receives from r - 2^k.
    expected_in = sorted({(r - 2**k) % n for k in range(n.bit_length()) if 2**k < n})
    assert jf.in_neighbor_ranks() == expected_in
    assert jf.out_neighbor_ranks() == sorted({(r + 2**k) % n for k in range(n.bit_length())
                                              if 2**k < n})
    assert jf.set_topology(T.ring(n, style=2))
    assert jf.load_topology() == T.ring(n, style=2)
    assert jf.in_neighbor_ranks() == [(r - 1) % n]
    assert jf.out_neighbor_ranks() == [(r + 1) % n]
    with pytest.raises(ValueError, match=f"has {n + 1} nodes but there are {n} ranks"):
        jf.set_topology(T.ring(n + 1))
    with pytest.raises(TypeError, match="Topology or a networkx graph"):
        jf.set_topology(np.eye(n))
    # Ranks disagreeing on the graph get an error on every rank, naming them.
    lazy_ring = T.from_weights(0.75 * np.eye(n) + 0.25 * np.roll(np.eye(n), 1, axis=1))
    mine = lazy_ring if r == 1 else T.ring(n)
    with pytest.raises(ValueError, match=r"ranks \[1\] passed a different topology"):
        jf.set_topology(mine)
    assert jf.load_topology() == T.ring(n, style=2)  # unchanged after the failure
    jf.init(topology=T.star(n))  # a second init only sets the topology
    assert jf.load_topology() == T.star(n)


@mpi_test()
def test_ffi_calls_in_jit():
    """build -> load -> register -> call: the custom calls inside jax.jit."""
    import jax
    import jax.numpy as jnp

    import jaxfog as jf

    jf.init()

    @jax.jit
    def step(x):
        jf.barrier()
        return x * jf.ops.comm_size() + jf.ops.comm_rank()

    for i in range(3):
        assert int(step(jnp.int32(i))) == i * jf.size() + jf.rank()
    text = step.lower(jnp.int32(0)).as_text()
    assert "jaxfog_barrier" in text and "jaxfog_rank" in text
    jf.barrier()


@mpi_test()
def test_barrier_synchronizes():
    """No rank leaves the barrier before the slowest rank entered it."""
    import time

    from mpi4py import MPI

    import jaxfog as jf

    jf.init()
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if jf.rank() == jf.size() - 1:
        time.sleep(0.5)
    entered = time.time()
    jf.barrier()
    left = time.time()
    last_entry = max(comm.allgather(entered))
    assert left >= last_entry - 0.01, (left, last_entry)


@mpi_test(nprocs=(2, 3), env={"JAXFOG_TIMEOUT": "1.5"})
def test_barrier_times_out_with_clear_error():
    """A rank that never arrives turns into an error, not a hang."""
    import time

    from mpi4py import MPI

    import jaxfog as jf

    jf.init()
    assert jf.runtime.timeout() == 1.5
    if jf.rank() != 0:
        start = time.monotonic()
        with pytest.raises(Exception, match=f"barrier on rank {jf.rank()} timed out after "
                                            "1.5 s"):
            jf.barrier()
        assert 1.4 < time.monotonic() - start < 10
    MPI.COMM_WORLD.Barrier()
    if jf.rank() == 0:
        jf.barrier()  # completes the barrier the others gave up on


@mpi_test(nprocs=(2,), alone=True)
def test_shutdown_and_reinit():
    import jaxfog as jf
    from jaxfog import topology as T

    jf.init(T.ring(2))
    jf.shutdown()
    assert not jf.is_initialized()
    with pytest.raises(jf.NotInitializedError, match="call jaxfog.init"):
        jf.rank()
    jf.init()
    assert jf.load_topology() == T.exponential(2)
    jf.barrier()


@mpi_test(nprocs=(2, 3, 5), timeout=180, env={"JAXFOG_COMM_THREAD_MIN_BYTES": "0"})
def test_python_collectives_never_share_a_communicator_with_dispatched_steps():
    """Steps whose collectives run on the communication thread are dispatched
    and not waited for; each Python-side collective follows at once."""
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    import jaxfog as jf
    import jaxfog.topology as T
    from jaxfog import runtime

    jf.init()
    r, n = jf.rank(), jf.size()
    python, transport = runtime.communicator(), runtime._require().comm
    assert MPI.Comm.Compare(python, transport) == MPI.CONGRUENT  # another duplicate

    @jf.jit
    def step(x):  # an allreduce, a broadcast and an allgather on the transport's
        return jf.allreduce(x, "sum"), jf.broadcast(x, root=n - 1), jf.allgather(x[:1])

    x = jnp.full(1 << 14, float(r + 1))
    results = []
    graphs = [T.ring(n), T.exponential(n)]
    for k in range(12):
        results.append(step(x + k))                    # not waited for
        assert jf.set_topology(graphs[k % 2])          # allgather of the digests
        assert python.allgather(r + k) == [q + k for q in range(n)]
        jf.win_create(jnp.zeros(3), "py", zero_init=True)  # allgather, Win_allocate, barrier
        jf.win_free("py")
    for k, (total, root, gathered) in enumerate(jax.block_until_ready(results)):
        np.testing.assert_array_equal(total, np.full(1 << 14, n * (n + 1) / 2 + n * k))
        np.testing.assert_array_equal(root, np.full(1 << 14, n + k))
        np.testing.assert_array_equal(gathered, np.arange(1, n + 1) + k)
