"""Bodies the harness tests run under mpiexec (not collected by pytest)."""

from __future__ import annotations


def succeeds():
    from mpi4py import MPI

    assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()


def fails_on_rank_1():
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 1:
        raise AssertionError("rank 1 disagrees")
    MPI.COMM_WORLD.recv(source=1)  # waits forever for the failed rank


def fails_everywhere():
    from mpi4py import MPI

    raise ValueError(f"bad value on rank {MPI.COMM_WORLD.Get_rank()}")


def deadlocks():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    comm.recv(source=(comm.Get_rank() + 1) % comm.Get_size())  # everyone receives


def succeeds_too():
    succeeds()


def leaves_float64_a_topology_and_a_variable():
    import os

    import jax

    import jaxfog as jf
    import jaxfog.topology as T

    jax.config.update("jax_enable_x64", True)
    os.environ["HARNESS_TEST_LEFT_BEHIND"] = "1"
    jf.init()
    jf.set_topology(T.ring(jf.size()))


def starts_afresh():
    """What the previous body of its launch left is undone."""
    import os

    import jax
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T

    jf.init()
    assert not jax.config.jax_enable_x64 and "HARNESS_TEST_LEFT_BEHIND" not in os.environ
    np.testing.assert_array_equal(jf.load_topology().weights,
                                  T.exponential(jf.size()).weights)
