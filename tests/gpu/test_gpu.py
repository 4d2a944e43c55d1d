"""jaxfog on GPU arrays; needs a CUDA GPU (``scripts/gpu_check.sh`` runs it).

* simulated agents on one GPU against numpy ``W @ X``, and the column-tiled
  kernel (Triton) against the gather path;
* MPI processes sharing the GPU with host staging (``JAXFOG_BACKEND=mpi``);
* one process with a forced self exchange, host-staged and over NCCL (with
  one rank the default exchange is empty);
* NCCL with two ranks: refused before NCCL is called where they share a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
from jaxfog import runtime
from jaxfog.ffi import _nccl_setup as nccl_setup
from jaxfog import topology as T
from jaxfog.testing import run_mpi

pytestmark = [pytest.mark.jax_internals,
              pytest.mark.skipif(not nccl_setup.has_cuda(),
                                 reason="needs a CUDA GPU (scripts/gpu_check.sh)")]
CUDA = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@pytest.mark.parametrize("graph", [T.ring, T.exponential])
def test_simulated_agents_on_the_gpu(graph):
    n, d = 16, 1000
    topo = graph(n)
    x = jax.random.normal(jax.random.key(0), (n, d))
    assert x.devices().pop().platform == "gpu"
    mixed = jf.simulate(jf.neighbor_allreduce, topo)(x)
    np.testing.assert_allclose(np.asarray(mixed), topo.weights @ np.asarray(x), rtol=1e-5,
                               atol=1e-5)
    back = jf.simulate(jax.grad(lambda v: (jf.neighbor_allreduce(v) ** 2).sum()), topo)(x)
    w = topo.weights
    np.testing.assert_allclose(np.asarray(back), 2 * w.T @ (w @ np.asarray(x)), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_simulated_agents_tiled_kernel_on_the_gpu(dtype):
    """The column-tiled kernel compiled by Triton (JAXFOG_SIM_MIXING=tiled,
    issue 45) against the gather path, numpy and W^T, ragged last tile included."""
    from jaxfog.simulation import _tiled

    n, d = 16, 3000
    x = jax.random.normal(jax.random.key(1), (n, d)) * (100 if dtype == jnp.int32 else 1)
    x = x.astype(dtype)
    for topo, kwargs in ((T.exponential(n), {}), (T.one_peer_exponential(n).at(3), {}),
                         (n, {"local_size": 4})):
        fn = (jf.hierarchical_neighbor_allreduce if kwargs else jf.neighbor_allreduce)
        out = {}
        for path in ("tiled", "gather"):
            with _tiled.forcing(path):
                out[path] = jax.jit(jf.simulate(fn, topo, **kwargs))(x)
        assert out["tiled"].dtype == dtype
        tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == jnp.bfloat16 else {"rtol": 1e-5,
                                                                          "atol": 1e-5}
        np.testing.assert_allclose(np.asarray(out["tiled"], np.float64),
                                   np.asarray(out["gather"], np.float64), **tol)
    if dtype == jnp.float32:
        topo = T.one_peer_exponential(n).at(3)
        with _tiled.forcing("tiled"):
            back = jax.jit(jf.simulate(jax.grad(lambda v: (jf.neighbor_allreduce(v) ** 2)
                                                .sum()), topo))(x)
        w = topo.weights
        np.testing.assert_allclose(np.asarray(back), 2 * w.T @ (w @ np.asarray(x)),
                                   rtol=1e-4, atol=1e-4)


def _values_on_gpu(expect_backend: str) -> None:
    jf.init()
    assert runtime.gpu_backend() == expect_backend, runtime.gpu_backend()
    n, r = jf.size(), jf.rank()
    rows = np.stack([np.arange(6.0, dtype=np.float32).reshape(3, 2) * (k + 1) for k in range(n)])
    x = jnp.asarray(rows[r])
    assert x.devices().pop().platform == "gpu"
    w = jf.load_topology().weights
    step = jax.jit(lambda x: (jf.neighbor_allreduce(x), jf.neighbor_allgather(x),
                              jf.allreduce(x), jf.broadcast(x, n - 1), jf.allgather(x)))
    mixed, gathered, mean, root, everyone = step(x)
    assert mixed.devices().pop().platform == "gpu"
    np.testing.assert_allclose(mixed, np.tensordot(w[r], rows, 1), rtol=1e-6)
    sources = jf.in_neighbor_ranks()
    np.testing.assert_allclose(gathered, np.concatenate([rows[s] for s in sources])
                               if sources else np.zeros((0, 2)))
    np.testing.assert_allclose(mean, rows.mean(0), rtol=1e-6)
    np.testing.assert_allclose(root, rows[n - 1])
    np.testing.assert_allclose(everyone, rows.reshape(-1, 2))
    grad = jax.grad(lambda v: (jf.neighbor_allreduce(v) ** 2).sum())(x)
    mixed_all = w @ rows.reshape(n, -1)
    np.testing.assert_allclose(np.asarray(grad).ravel(), 2 * (w.T @ mixed_all)[r], rtol=1e-5)


def self_exchange_values() -> None:
    """One rank sending to itself (with one rank and the default topology the
    exchange is empty, so NCCL's send/recv would never run): push-pull weights
    through the primitive, in every dtype NCCL moves, against numpy."""
    import ml_dtypes

    from jaxfog.ops import _plan
    from jaxfog.ops.neighbor import neighbor_allreduce_p

    assert jf.size() == 1
    plan = _plan.Plan((0.25,), sends=(((0, 2.0),),), recvs=(((0, 0.5),),))
    mix = jax.jit(lambda *xs: neighbor_allreduce_p.bind(jnp.int32(0), *xs, plan=plan,
                                                        comm_id=0))
    rows = np.arange(12.0).reshape(3, 4) - 6  # exact in every dtype
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16, np.int32):
        (got,) = mix(jnp.asarray(rows.astype(dtype)))
        want = 0.25 * rows + 0.5 * (2.0 * rows)
        if dtype == np.int32:
            want = np.round(want)  # half to even (1.25 * 2 = 2.5 -> 2), as on CPU
        np.testing.assert_array_equal(np.asarray(got, np.float64), want, err_msg=str(dtype))
    # A pytree of two leaves travels as one message.
    a, b = mix(jnp.ones(3), jnp.full((2, 2), 4.0, jnp.bfloat16))
    np.testing.assert_allclose(a, 1.25), np.testing.assert_allclose(b.astype(float), 5.0)
    x = jnp.asarray(rows, jnp.float32)
    assert x.devices().pop().platform == jax.default_backend()
    np.testing.assert_allclose(jf.allreduce(x), rows)
    np.testing.assert_allclose(jf.allreduce(x, op="sum"), rows)
    np.testing.assert_allclose(jf.broadcast(x, 0), rows)
    np.testing.assert_allclose(jf.allgather(x), rows)


def staged_body():
    _values_on_gpu("mpi")


def one_process_staged_body():
    jf.init()
    assert runtime.gpu_backend() == "mpi"
    self_exchange_values()


def nccl_body():
    _values_on_gpu("nccl")
    if jf.size() == 1:
        self_exchange_values()


def test_one_process_staged():
    result = run_mpi(1, __file__, "one_process_staged_body", timeout=300,
                     env={**CUDA, "JAXFOG_BACKEND": "mpi"})
    assert result.ok, result.report()


@pytest.mark.parametrize("nprocs", [2, 4])
def test_host_staged_mpi_on_gpu_arrays(nprocs):
    result = run_mpi(nprocs, __file__, "staged_body", timeout=300,
                     env={**CUDA, "JAXFOG_BACKEND": "mpi"})
    assert result.ok, result.report()


def test_nccl_one_rank():
    result = run_mpi(1, __file__, "nccl_body", timeout=300,
                     env={**CUDA, "JAXFOG_BACKEND": "nccl"})
    assert result.ok, result.report()


def test_nccl_two_ranks_on_one_gpu():
    """NCCL takes one rank per GPU: with one GPU, init refuses on every rank,
    naming the shared GPU, before any rank calls NCCL (never a hang); with
    two, the values are right."""
    result = run_mpi(2, __file__, "nccl_body", timeout=300,
                     env={**CUDA, "JAXFOG_BACKEND": "nccl"})
    if jax.device_count("gpu") > 1:
        assert result.ok, result.report()
    else:
        assert not result.ok
        assert result.output.count("ranks 0 and 1 share GPU GPU-") >= 2, result.report()
