"""The GPU paths as far as a CPU machine can check them.

* the build: CUDA staging and the NCCL transport compiled in, with neither
  libcudart nor libnccl a load-time dependency;
* NCCL loaded at run time from the nvidia-nccl-cu13 wheel (version, ids);
* the backend choice and the CUDA lowerings (NCCL targets with the weighted
  sums left to XLA, or the host-staged generic targets);
* the host-staging code itself, on MPI ranks, with memcpy standing in for the
  device copies (``JAXFOG_HOST_STAGING=1``): op results against numpy.

What needs a GPU is in ``tests/gpu/test_gpu.py`` (run by ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
from jaxfog import ffi, runtime
from jaxfog.ffi import _nccl_setup as nccl_setup
from jaxfog.ops import _plan
from jaxfog.ops.neighbor import neighbor_allreduce_p
from jaxfog.testing import load_module, run_mpi
from mpi_harness import mpi_test
from paths import SCRIPTS, TESTS

# The ops' and windows' multi-rank bodies, run again host-staged.
test_ops_mpi = load_module(TESTS / "ops" / "test_ops_mpi.py")
test_window_mpi = load_module(TESTS / "ops" / "test_window_mpi.py")

pytestmark = pytest.mark.jax_internals

CUDA = Path("/usr/local/cuda")
HAS_TOOLKIT = (CUDA / "include" / "cuda_runtime.h").exists() and any(
    (CUDA / d / "libcudart_static.a").exists() for d in ("lib64", "lib"))
HAS_NCCL_WHEEL = importlib.util.find_spec("nvidia.nccl") is not None
STAGED = {"JAXFOG_HOST_STAGING": "1"}


@pytest.mark.skipif(not HAS_TOOLKIT, reason="no CUDA toolkit on this machine")
def test_gpu_paths_are_built():
    info = ffi.build_info()
    assert info["cuda_built"], info
    assert info["nccl_built"] == HAS_NCCL_WHEEL, info


def test_library_needs_neither_cudart_nor_nccl_to_load():
    dynamic = subprocess.run(["readelf", "-d", str(ffi.LIBRARY_PATH)], capture_output=True,
                             text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", dynamic)
    assert needed and not [n for n in needed if "cuda" in n or "nccl" in n], needed


@pytest.mark.skipif(not (HAS_NCCL_WHEEL and ffi.nccl_built()), reason="NCCL not built")
def test_nccl_loads_from_the_wheel_and_makes_ids():
    major, minor, patch = importlib.metadata.version("nvidia-nccl-cu13").split(".")[:3]
    assert ffi.load_nccl() == int(major) * 10000 + int(minor) * 100 + int(patch)
    first, second = ffi.nccl_unique_id(), ffi.nccl_unique_id()
    assert len(first) == len(second) == 128 and first != second


def test_backend_choice():
    assert nccl_setup.choose(False, True, "") is None
    assert nccl_setup.choose(True, True, "") == "nccl"
    assert nccl_setup.choose(True, True, "mpi") == "mpi"
    assert nccl_setup.choose(True, False, "") == "mpi"
    with pytest.raises(RuntimeError, match="built without NCCL"):
        nccl_setup.choose(True, False, "nccl")


def test_ranks_sharing_a_gpu_are_refused_before_nccl():
    one, other = "GPU-0a1b", "GPU-9f8e"
    assert nccl_setup.shared_gpus([("a", one, ""), ("a", other, ""), ("b", one, "")]) is None
    assert nccl_setup.shared_gpus([("a", one, ""), ("b", other, ""), ("a", one, "")]) == (
        f"ranks 0 and 2 share GPU {one} on a, and NCCL takes one rank per GPU (run one rank "
        "per GPU, or set JAXFOG_BACKEND=mpi)")
    assert nccl_setup.shared_gpus([("a", one, ""), ("a", None, "no driver")]) == (
        "rank 1 cannot identify its GPU (no driver)")


@pytest.mark.skipif(nccl_setup.has_cuda(), reason="a GPU is here")
def test_gpu_identity_without_a_gpu_says_why():
    host, uuid, why = nccl_setup.gpu_identity()
    assert uuid is None and why, (host, why)
    if ffi.cuda_built():
        with pytest.raises(ffi.FfiLibraryError, match="cudaGetDeviceProperties failed"):
            ffi.cuda_device_uuid(0)


@mpi_test(nprocs=(2,))
def test_nccl_set_up_is_decided_together():
    """Every rank learns, before any calls NCCL, that it cannot be used (here:
    no GPU to identify): all fall back with the reason, or all raise under
    JAXFOG_BACKEND=nccl; none waits in NCCL's init."""
    import os
    import warnings

    from jaxfog.errors import JaxfogError

    jf.init()
    comm = runtime.communicator()
    lib = ffi.library()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert nccl_setup.start_nccl(lib, comm, 10.0, 1 << 20) is None
    assert any("rank 0 cannot identify its GPU" in str(w.message) for w in caught), caught
    os.environ[nccl_setup.BACKEND_ENV] = "nccl"
    try:
        with pytest.raises(JaxfogError, match="NCCL is unusable: rank 0 cannot identify"):
            nccl_setup.start_nccl(lib, comm, 10.0, 1 << 20)
    finally:
        del os.environ[nccl_setup.BACKEND_ENV]
    np.testing.assert_allclose(jf.allreduce(jnp.ones(2)), 1.0)  # still in step


def test_backend_variable_is_checked(monkeypatch):
    monkeypatch.setenv(nccl_setup.BACKEND_ENV, "gloo")
    with pytest.raises(ValueError, match="JAXFOG_BACKEND='gloo'"):
        nccl_setup.requested()


def _cuda_targets(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"custom_call @(\w+)", text)


@pytest.fixture
def nccl_state(monkeypatch):
    """The runtime as after init() on a GPU machine whose NCCL came up (only the
    lowering reads it here; nothing runs)."""
    jf.init()
    monkeypatch.setattr(runtime._state, "gpu_backend", "nccl")


def test_cuda_lowering_without_nccl_is_host_staged(monkeypatch):
    jf.init()
    monkeypatch.setattr(runtime._state, "gpu_backend", "mpi")  # also on a GPU machine
    x = jnp.ones((3, 2))
    assert _cuda_targets(lambda x: jf.neighbor_allreduce(x), x) == ["jaxfog_neighbor_allreduce"]
    assert _cuda_targets(lambda x: jf.allreduce(x), x) == ["jaxfog_allreduce"]
    assert _cuda_targets(lambda x: jf.neighbor_allgather(x), x) == ["jaxfog_neighbor_allgather"]


def test_cuda_lowering_with_nccl(nccl_state):
    x = jnp.ones((3, 2))
    assert _cuda_targets(lambda x: jf.neighbor_allreduce(x), x) == ["jaxfog_nccl_exchange"]
    assert _cuda_targets(lambda x: jf.neighbor_allgather(x), x) == ["jaxfog_nccl_exchange"]
    assert _cuda_targets(lambda x: jf.allreduce(x), x) == ["jaxfog_nccl_allreduce"]
    assert _cuda_targets(lambda x: jf.broadcast(x, 0), x) == ["jaxfog_nccl_broadcast"]
    assert _cuda_targets(lambda x: jf.allgather(x), x) == ["jaxfog_nccl_allgather"]
    # grad: the adjoint exchange; scan: one exchange in the loop body.
    grad = jax.grad(lambda x: (jf.neighbor_allreduce(x) ** 2).sum())
    assert _cuda_targets(grad, x) == ["jaxfog_nccl_exchange"] * 2
    body = lambda c, _: (jf.neighbor_allreduce(c), None)  # noqa: E731
    assert _cuda_targets(lambda x: jax.lax.scan(body, x, None, length=4)[0], x) == [
        "jaxfog_nccl_exchange"]
    # What NCCL does not cover keeps the host-staged call: integer means and
    # neighbour averages (rounded as on CPU), complex sums, periodic schedules.
    ints = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)
    assert _cuda_targets(lambda x: jf.allreduce(x), ints) == ["jaxfog_allreduce"]
    assert _cuda_targets(lambda x: jf.allreduce(x, op="sum"), ints) == ["jaxfog_nccl_allreduce"]
    assert _cuda_targets(lambda x: jf.neighbor_allreduce(x), ints) == [
        "jaxfog_neighbor_allreduce"]
    assert _cuda_targets(lambda x: jf.neighbor_allgather(x), ints) == ["jaxfog_nccl_exchange"]
    z = jnp.ones(3, jnp.complex64)
    assert _cuda_targets(lambda x: jf.allreduce(x, op="sum"), z) == ["jaxfog_allreduce"]
    assert _cuda_targets(lambda x: jf.neighbor_allreduce(x), z) == ["jaxfog_nccl_exchange"]
    schedule = _plan.Plan((0.5, 0.5), sends=((), ()), recvs=((), ()))
    staged = lambda x: neighbor_allreduce_p.bind(jnp.int32(0), x, plan=schedule, comm_id=0)  # noqa: E731
    assert _cuda_targets(staged, x) == ["jaxfog_neighbor_allreduce"]


def test_nccl_lowering_leaves_the_weighted_sum_to_xla(nccl_state):
    """Push-pull weights: each destination gets its own scaled block, and
    self and receive weights appear as XLA multiplies around one exchange."""
    plan = _plan.Plan((0.375,), sends=(((1, 0.25), (2, 1.0)),), recvs=(((1, 0.125), (3, 0.5)),))
    x = jnp.ones((3, 2), jnp.float32)  # float32 also where another test enabled x64
    fn = lambda x: neighbor_allreduce_p.bind(jnp.int32(0), x, plan=plan, comm_id=0)  # noqa: E731
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "custom_call" in line]
    assert len(call) == 1 and "stacked = true" in call[0], call
    code = ffi.op_table()["neighbor_allreduce"].code  # the op the exchange serves
    assert f"op = {code} : i64" in call[0], call
    assert "send_ranks = dense<[1, 2]>" in call[0] and "recv_ranks = dense<[1, 3]>" in call[0]
    signature = "(!stablehlo.token, tensor<2x3x2xf32>) -> (!stablehlo.token, tensor<2x3x2xf32>)"
    assert signature in call[0]
    constants = [[float(v) for v in c.strip("[]").split(",")]
                 for c in re.findall(r"constant dense<([^>]+)>", text)]
    # Send weights and receive weights as one vector each (a fused reduction
    # over the received blocks, not a sum per neighbour), and the self weight.
    assert [0.25, 1.0] in constants and [0.125, 0.5] in constants and [0.375] in constants
    assert re.search(r"stablehlo.reduce.*across dimensions = \[0\].*tensor<2x3x2xf32>", text)


# --- the host-staged path on MPI ranks (memcpy for the device copies) ---------

def _staged(test, nprocs=(3,)):
    return mpi_test(nprocs, env=STAGED)(test.mpi_body)


test_staged_static_topologies = _staged(test_ops_mpi.test_static_topologies_match_w_at_x)
test_staged_schedules = _staged(test_ops_mpi.test_scheduled_under_control_flow_compiles_once)
test_staged_pytrees_dtypes = _staged(test_ops_mpi.test_pytrees_dtypes_scalars_and_empty)
test_staged_collectives = _staged(test_ops_mpi.test_collectives)
test_staged_windows = _staged(test_window_mpi.test_put_accumulate_update_against_numpy)
test_staged_window_state = _staged(test_window_mpi.test_get_versions_and_collect)


@mpi_test(nprocs=(1,), env=STAGED)
def test_staged_self_exchange():
    """The GPU check's self exchange (tests/gpu/test_gpu.py), host-staged on CPU."""
    jf.init()
    load_module(TESTS / "gpu" / "test_gpu.py").self_exchange_values()


def test_gpu_check_stages_are_complete():
    """Every stage the GPU check names runs, and anything else is refused."""
    script = SCRIPTS / "gpu_check.sh"
    text = script.read_text()
    stages = re.search(r'STAGES="([^"]+)"', text).group(1).split()
    assert stages[0] == "probe" and "nccl" in stages and "bench-exchange" in stages
    for stage in stages:
        assert f"stage_{stage.replace('-', '_')}() {{" in text, stage
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    refused = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown stage nope" in refused.stdout
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in text


def test_staged_calls_show_their_copies(tmp_path):
    """The staged handlers ran (not the plain ones): their copy spans are in
    the timeline, inside each op."""
    trace = tmp_path / "trace.json"
    result = run_mpi(2, __file__, "_body_for_timeline", timeout=120,
                     env={**STAGED, "JAXFOG_TIMELINE": str(trace)})
    assert result.ok, result.report()
    events = json.loads((tmp_path / "trace.rank0.json").read_text())["traceEvents"]
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert names.count("stage in") >= 2 and names.count("stage out") >= 2, names


def _body_for_timeline():
    jf.init()
    x = jnp.arange(4.0) + jf.rank()
    np.testing.assert_allclose(jf.allreduce(x), np.arange(4.0) + 0.5)
    np.testing.assert_allclose(jf.neighbor_allreduce(x), np.arange(4.0) + 0.5)
