"""The runtime in one plain process (no launcher) and the `jaxfog info` report."""

from __future__ import annotations

import subprocess
import sys

import pytest

import jaxfog as jf
from jaxfog import cli, ffi
from jaxfog import topology as T


@pytest.fixture
def fresh():
    jf.shutdown()
    yield
    jf.shutdown()


@pytest.mark.parametrize("call", [
    jf.rank, jf.size, jf.local_rank, jf.machine_size, jf.load_topology, jf.in_neighbor_ranks,
    lambda: jf.set_topology(T.ring(1)), lambda: jf.barrier(),
])
def test_ops_before_init_are_a_clear_error(fresh, call):
    with pytest.raises(jf.NotInitializedError, match=r"call jaxfog.init\(\) before"):
        call()


def test_size_one_without_a_launcher(fresh):
    jf.init()
    assert (jf.rank(), jf.size(), jf.local_size(), jf.machine_size()) == (0, 1, 1, 1)
    assert jf.load_topology() == T.exponential(1)
    assert jf.in_neighbor_ranks() == [] and jf.out_neighbor_ranks() == []
    jf.barrier()
    assert int(jf.ops.comm_rank()) == 0 and int(jf.ops.comm_size()) == 1


def test_plain_python_process_exits_cleanly():
    code = "import jaxfog as jf; jf.init(); jf.barrier(); print('ok', jf.size())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok 1"


def test_bad_timeout_is_rejected(fresh, monkeypatch):
    monkeypatch.setenv("JAXFOG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="JAXFOG_TIMEOUT='soon' is not a number"):
        jf.init()
    monkeypatch.setenv("JAXFOG_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="must be >= 0"):
        jf.init()


def test_info_reports_versions_mpi_and_library():
    import jax
    from mpi4py import MPI

    lines = cli.info_lines()
    assert lines[:3] == [f"jaxfog {jf.__version__}", f"jax {jax.__version__}",
                         f"jaxlib {__import__('jaxlib').__version__}"]
    text = "\n".join(lines)
    assert f"MPI library: {MPI.Get_library_version().splitlines()[0]}" in text
    assert "MPI thread level: MPI_THREAD_MULTIPLE" in text
    assert f"FFI library: {ffi.LIBRARY_PATH}" in text and ffi.LIBRARY_PATH.exists()
    assert "NCCL support built: no" in text


def test_build_info_names_the_mpi_built_against():
    info = ffi.build_info()
    assert info["nccl_built"] is False
    assert info["mpicxx"].endswith("mpicxx")
    assert "-lmpi" in info["mpi_flags"]
