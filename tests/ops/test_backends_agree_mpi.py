"""The shared matrix both ways: MPI processes and the simulation backend agree
with each other and with numpy on the same inputs."""

from __future__ import annotations

import pytest
from mpi_harness import mpi_test

pytestmark = pytest.mark.jax_internals


@mpi_test(x64=True)
def test_mpi_and_simulation_agree():
    import jax
    import numpy as np

    import jaxfog as jf
    from cases import cases

    jf.init()
    r, n = jf.rank(), jf.size()
    X = np.random.default_rng(11).standard_normal((n, 6, 3))
    for name, fn, reference in cases(n):
        expected = reference(X)[r]
        on_mpi = jax.jit(fn)(X[r])
        simulated = jax.jit(jf.simulate(fn, n))(X)[r]  # no MPI inside
        np.testing.assert_allclose(on_mpi, expected, rtol=1e-12, atol=1e-14, err_msg=name)
        np.testing.assert_allclose(simulated, on_mpi, rtol=1e-12, atol=1e-14, err_msg=name)


@mpi_test(nprocs=(4,), env={"JAXFOG_NODES_PER_MACHINE": "2"})
def test_integers_agree_with_x64_off_and_on():
    """int32 values past float32's 24 bits: both backends average in float64
    and round half to even, whether jax_enable_x64 is off (the default) or on."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T

    assert not jax.config.jax_enable_x64
    jf.init()
    r, n = jf.rank(), jf.size()
    # Column 2's sum does not fit in int32: means are summed in float64.
    X = np.array([[2**30 + 1, -(2**29) + 3, 2**31 - 9], [2**29 + 7, 12345677, 2**31 - 5],
                  [-(2**30) + 9, 5, 2**30], [-(2**29) + 2, 2**29 - 1, 7]])
    ring = T.ring(n)
    cases = [("neighbor_allreduce", lambda x: jf.neighbor_allreduce(x, topology=ring)),
             ("allreduce mean", jf.allreduce),
             ("allreduce mean, pytree", lambda x: jf.allreduce({"a": x, "b": x[:1]})["a"]),
             ("allreduce sum", lambda x: jf.allreduce(x // 8, op="sum")),
             ("hierarchical", jf.hierarchical_neighbor_allreduce)]
    for x64 in (False, True):
        with jax.enable_x64(x64):
            for name, fn in cases:
                on_mpi = jax.jit(fn)(jnp.asarray(X[r], jnp.int32))
                simulated = jax.jit(jf.simulate(fn, n, local_size=2))(
                    jnp.asarray(X, jnp.int32))[r]
                assert on_mpi.dtype == simulated.dtype == jnp.int32, name
                np.testing.assert_array_equal(on_mpi, simulated, err_msg=f"{name}, x64={x64}")
            np.testing.assert_array_equal(jf.allreduce(jnp.asarray(X[r], jnp.int32)),
                                          np.rint(X.mean(0)))
