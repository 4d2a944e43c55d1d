"""Fixtures shared by the test modules, which sit in folders that mirror the
package (``ops/``, ``optax/``, ...; ``examples/`` for the docs and examples,
``project/`` for the tree's own rules). The helpers they share sit in this
folder; the MPI harness (``mpi_harness``) and the cluster of namespaces
(``netns_rig``) are plugins. The MPI ranks that run a test's bodies import
only the test's own module, with its folder and this one on PYTHONPATH."""

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

# The processes the tests start (MPI ranks, scripts) import the shared helpers
# from here: an environment variable, so that nothing edits sys.path.
_HELPERS = os.path.dirname(os.path.abspath(__file__))
if _HELPERS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_HELPERS, *filter(None, [os.environ.get("PYTHONPATH")])])

import jax  # noqa: E402
import pytest  # noqa: E402

#: ``@mpi_test`` (its collection hook), and the cluster-of-namespaces fixture
#: (``netns_cluster_factory``), for any module.
pytest_plugins = ("mpi_harness", "netns_rig")


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

