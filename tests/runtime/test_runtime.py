"""The runtime in one plain process (no launcher) and the `jaxfog info` report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import subprocess
import sys

import warnings

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


def test_keep_freed_bytes_must_be_a_number(fresh, monkeypatch):
    monkeypatch.setenv("JAXFOG_KEEP_FREED_BYTES", "lots")
    with pytest.raises(ValueError, match="JAXFOG_KEEP_FREED_BYTES='lots' must be a number"):
        jf.init()
    assert not jf.is_initialized()


def test_scratch_keep_bytes_must_be_a_number(fresh, monkeypatch):
    monkeypatch.setenv("JAXFOG_SCRATCH_KEEP_BYTES", "1GB")
    with pytest.raises(ValueError, match="JAXFOG_SCRATCH_KEEP_BYTES='1GB' must be a number"):
        jf.init()
    assert not jf.is_initialized()


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


def test_bad_comm_thread_threshold_is_rejected(fresh, monkeypatch):
    monkeypatch.setenv("JAXFOG_COMM_THREAD_MIN_BYTES", "1MB")
    with pytest.raises(ValueError, match="JAXFOG_COMM_THREAD_MIN_BYTES='1mb' must be a number"):
        jf.init()


def test_comm_thread_threshold_can_change_between_ops(fresh):
    import jax
    import jax.numpy as jnp
    import numpy as np

    jf.init()
    x = jnp.arange(50000.0)
    total = jax.jit(jf.allreduce)
    for threshold in (0, None, 1 << 30, 0):
        jf.set_comm_thread_min_bytes(threshold)
        assert jf.comm_thread_min_bytes() == threshold
        np.testing.assert_array_equal(total(x), x)
    with pytest.raises(ValueError, match="min_bytes must be >= 0"):
        jf.set_comm_thread_min_bytes(-1)
    for bad in (1.5, "64k", True):
        with pytest.raises(TypeError, match="min_bytes must be an int"):
            jf.set_comm_thread_min_bytes(bad)


@pytest.mark.parametrize("text, cores, local_size, expected", [
    ("", 8, 4, 1 << 16),  # two cores per rank: the communication thread has one
    ("", 4, 4, -1),  # one core per rank: polling would steal it from XLA
    ("0", 1, 4, 0),
    ("off", 64, 1, -1),
    (" 4096 ", 1, 1, 4096),
])
def test_comm_thread_threshold_from_environment(monkeypatch, text, cores, local_size, expected):
    from jaxfog import runtime

    monkeypatch.setenv("JAXFOG_COMM_THREAD_MIN_BYTES", text)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda _: set(range(cores)))
    assert runtime._comm_thread_min_bytes_from_env(local_size) == expected


def test_the_old_async_names_of_the_comm_thread_threshold_still_work_and_warn(fresh, monkeypatch):
    """``JAXFOG_ASYNC_MIN_BYTES`` and ``(set_)async_min_bytes``, its names until
    0.1 ("async" now names the asynchronous algorithms only)."""
    from jaxfog import runtime

    monkeypatch.delenv("JAXFOG_COMM_THREAD_MIN_BYTES", raising=False)
    monkeypatch.setenv("JAXFOG_ASYNC_MIN_BYTES", "4096")
    with pytest.warns(FutureWarning, match="JAXFOG_ASYNC_MIN_BYTES is deprecated: set "
                      "JAXFOG_COMM_THREAD_MIN_BYTES"):
        assert runtime._comm_thread_min_bytes_from_env(1) == 4096
    monkeypatch.setenv("JAXFOG_COMM_THREAD_MIN_BYTES", "off")  # the new name wins, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime._comm_thread_min_bytes_from_env(1) == -1
    monkeypatch.delenv("JAXFOG_COMM_THREAD_MIN_BYTES")
    monkeypatch.delenv("JAXFOG_ASYNC_MIN_BYTES")  # init reads the environment too
    jf.init()
    with pytest.warns(FutureWarning, match="jaxfog.set_async_min_bytes is deprecated: call "
                      "jaxfog.set_comm_thread_min_bytes"):
        jf.set_async_min_bytes(123)
    with pytest.warns(FutureWarning, match="jaxfog.async_min_bytes is deprecated"):
        assert jf.async_min_bytes() == 123 == jf.comm_thread_min_bytes()


def test_info_reports_versions_mpi_and_library():
    import jax
    from mpi4py import MPI

    lines = cli.info_lines()
    assert lines[:3] == [f"jaxfog {jf.__version__}", f"jax {jax.__version__}",
                         f"jaxlib {__import__('jaxlib').__version__}"]
    text = "\n".join(lines)
    assert f"MPI library: {MPI.Get_library_version().splitlines()[0]}" in text
    assert "MPI thread level: MPI_THREAD_MULTIPLE" in text
    # One host: its own TCP settings, read from the kernel, and no pointer.
    control = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    idle = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip()
    assert (f"TCP: congestion control {control}, slow start after idle "
            f"{'on' if idle == '1' else 'off'}") in lines, lines
    assert f"FFI library: {ffi.LIBRARY_PATH}" in text and ffi.LIBRARY_PATH.exists()
    build = ffi.build_info()
    # Built here, against this jaxlib's headers: the same XLA FFI API.
    major, minor = ffi.jaxlib_ffi_api_version()
    assert (f"XLA FFI API: {major}.{minor} (built against jaxlib {build['jaxlib']}; "
            f"this jaxlib's: {major}.{minor})") in text
    assert f"CUDA support built: {'yes' if build['cuda_built'] else 'no'}" in text
    assert f"NCCL support built: {'yes' if build['nccl_built'] else 'no'}" in text
    links = ffi.link_info()
    assert (f"libstdc++: shared ({links['libstdc++']})" in text
            or "libstdc++: static (private to the library)" in text), text
    assert f"MPI library file: shared ({links['libmpi']})" in text
    assert ("CUDA runtime: static (private to the library)" if build["cuda_built"]
            else "CUDA runtime: not linked") in text
    if build["nccl_built"] and importlib.util.find_spec("nvidia.nccl"):
        version = importlib.metadata.version("nvidia-nccl-cu13")
        assert f"NCCL library: {version} (" in text, text


def test_build_info_names_the_mpi_built_against():
    info = ffi.build_info()
    assert info["nccl_built"] == (info["cuda_built"] and info["nccl_include"] is not None)
    assert info["mpicxx"].endswith("mpicxx")
    assert "-lmpi" in info["mpi_flags"]


def test_init_bound_ends_a_process_stuck_in_mpi_init_and_spares_one_that_is_not():
    """The watchdog of ``jf.init``'s MPI_Init (JAXFOG_INIT_TIMEOUT) is a process
    of its own, so it acts even while the stuck call holds the GIL; a block
    that returns in time leaves the process alone."""
    import os
    import subprocess
    import sys
    import time

    program = ("import sys, time; from jaxfog.runtime import _bounded_mpi_init\n"
               "with _bounded_mpi_init(float(sys.argv[1])):\n"
               "    time.sleep(float(sys.argv[2]))\n"
               "print('returned')\n")
    env = {**os.environ, "PMI_RANK": "2", "PMI_SIZE": "4"}
    started = time.monotonic()
    stuck = subprocess.run([sys.executable, "-c", program, "1", "30"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert time.monotonic() - started < 15
    assert stuck.returncode == -9 and "returned" not in stuck.stdout, stuck
    assert ("jaxfog.init (rank 2 of 4): MPI_Init still waits after 1 s "
            "(JAXFOG_INIT_TIMEOUT)") in stuck.stderr, stuck.stderr
    fine = subprocess.run([sys.executable, "-c", program, "20", "0.1"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert fine.returncode == 0 and fine.stdout == "returned\n" and not fine.stderr, fine
