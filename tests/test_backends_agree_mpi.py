"""The shared matrix both ways: MPI processes and the simulation backend agree
with each other and with numpy on the same inputs."""

from __future__ import annotations

from mpi_harness import mpi_test


@mpi_test()
def test_mpi_and_simulation_agree():
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
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
