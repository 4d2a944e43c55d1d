"""Fixtures shared by the test modules (pytest loads this file; the MPI ranks
that run a test's body import only the test's own module)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Before JAX is imported: the suite's compiled programs go to a persistent
# cache of its own, which the test processes and every rank of the launches
# share (``jaxfog run`` gives each rank of a host a folder of its own): the
# same programs compiled again in another test, launch or rank count are
# loaded instead (three example-heavy test files: 341 s -> 267 s on 2 cores).
# Unless the caller chose a cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="jaxfog-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # The last thing at exit (registered first): JAX may still compile in exit handlers.
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

#: The cluster-of-namespaces fixture (``netns_cluster_factory``), for any module.
pytest_plugins = ("netns_rig",)


@pytest.fixture
def x64():
    """Float64 inside the test (numpy references compared to 1e-12);
    modules use it with ``pytestmark = [..., pytest.mark.usefixtures("x64")]``."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def problem():
    """optax_cases' least squares (diabetes) dealt to 4 agents: the problem of
    the optimizers' tests against numpy models of their equations."""
    import optax_cases

    return optax_cases.least_squares(4)


def pytest_collection_finish(session):
    """Tells ``mpi_harness`` which multi-rank tests run, so that a launch runs
    only selected bodies (``-k``, a node id)."""
    import mpi_harness

    mpi_harness.SELECTED = {
        item.function.mpi_entry.key(item.callspec.params["nprocs"])
        for item in session.items if hasattr(getattr(item, "function", None), "mpi_entry")}
