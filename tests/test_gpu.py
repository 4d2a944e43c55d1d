"""jaxfog on GPU arrays; needs a CUDA GPU (``scripts/gpu_check.sh`` runs it).

* simulated agents on one GPU against numpy ``W @ X``;
* MPI processes sharing the GPU with host staging (``JAXFOG_BACKEND=mpi``);
* NCCL with one rank, and with two ranks on the one GPU: either the values
  are right or init fails with NCCL's reason (ENVIRONMENT.md believes NCCL
  refuses two ranks on one device; this test records which it is).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
from jaxfog import _gpu, runtime
from jaxfog import topology as T
from jaxfog.testing import run_mpi

pytestmark = pytest.mark.skipif(not _gpu.has_cuda(),
                                reason="needs a CUDA GPU (scripts/gpu_check.sh)")
CUDA = {"JAX_PLATFORMS": "cuda"}


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


def staged_body():
    _values_on_gpu("mpi")


def nccl_body():
    _values_on_gpu("nccl")


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
    """Either NCCL takes two ranks on the one GPU and the values are right, or
    init fails on every rank with NCCL's reason (never a hang)."""
    result = run_mpi(2, __file__, "nccl_body", timeout=300,
                     env={**CUDA, "JAXFOG_BACKEND": "nccl"})
    if jax.device_count("gpu") > 1 or result.ok:
        assert result.ok, result.report()
        print("NCCL accepted 2 ranks on one GPU")
    else:
        assert "NCCL is unusable" in result.output, result.report()
        print("NCCL refused 2 ranks on one GPU:",
              [line for line in result.output.splitlines() if "NCCL" in line][:2])
