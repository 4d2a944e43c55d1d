"""Fixtures shared by the test modules (pytest loads this file; the MPI ranks
that run a test's body import only the test's own module)."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def x64():
    """Float64 inside the test (numpy references compared to 1e-12);
    modules use it with ``pytestmark = [..., pytest.mark.usefixtures("x64")]``."""
    with jax.enable_x64(True):
        yield


def pytest_collection_finish(session):
    """Tells ``mpi_harness`` which multi-rank tests run, so that a launch runs
    only selected bodies (``-k``, a node id)."""
    import mpi_harness

    mpi_harness.SELECTED = {
        item.function.mpi_entry.key(item.callspec.params["nprocs"])
        for item in session.items if hasattr(getattr(item, "function", None), "mpi_entry")}
