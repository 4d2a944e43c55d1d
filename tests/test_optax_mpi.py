"""jaxfog.optax on MPI processes: the exact methods reach the centralized
optimum, and every transformation's iterates match the simulation backend's."""

from __future__ import annotations

from mpi_harness import mpi_test


@mpi_test(nprocs=(4, 5), timeout=300)
def test_optimizers_on_mpi_match_the_optimum_and_the_simulation():
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    import jaxfog as jf
    import optax_cases as oc

    from mpi4py import MPI

    jf.init()
    r, n = jf.rank(), jf.size()

    def both(optimizer, topology, problem, steps):
        """Every rank's MPI iterate and, on rank 0, the simulated ones."""
        jf.set_topology(topology)
        agent = oc.train(optimizer, problem, n, steps)
        on_mpi = MPI.COMM_WORLD.gather(np.asarray(jax.jit(agent)(problem.A[r], problem.B[r])))
        if r == 0:
            return np.stack(on_mpi), np.asarray(
                jax.jit(jf.simulate(agent, topology))(problem.A, problem.B))
        return None, None

    for problem in (oc.least_squares(n), oc.logistic(n)):
        scale = np.linalg.norm(problem.optimum)
        for name, optimizer, topology, steps in oc.exact_cases(n, problem):
            on_mpi, simulated = both(optimizer, topology, problem, steps)
            if r == 0:
                what = f"{problem.name}, {name}"
                error = np.linalg.norm(on_mpi - problem.optimum, axis=1).max() / scale
                assert error < 1e-8, (what, error)
                np.testing.assert_allclose(on_mpi, simulated, rtol=0, atol=1e-10 * scale,
                                           err_msg=what)
    problem = oc.logistic(n)
    for name, optimizer, topology in oc.all_cases(n, problem):
        on_mpi, simulated = both(optimizer, topology, problem, 40)
        if r == 0:
            np.testing.assert_allclose(on_mpi, simulated, rtol=1e-11, atol=1e-13, err_msg=name)
            assert np.isfinite(on_mpi).all() and np.abs(on_mpi).max() > 1e-3, name
