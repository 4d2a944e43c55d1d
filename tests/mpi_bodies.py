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
