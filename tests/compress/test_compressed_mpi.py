"""Compressed gossip on MPI processes: the same iterates as the simulation
for every compressor, and the bytes on the wire equal the compressors' figures."""

from __future__ import annotations

from mpi_harness import mpi_test


@mpi_test(nprocs=(4,), timeout=300, x64=True)
def test_compressed_iterates_match_the_simulation_and_bytes_match_the_payloads():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.compress as C
    import jaxfog.optax as jfo
    import jaxfog.topology as T
    import optax_cases as oc

    from mpi4py import MPI

    jf.init()
    r, n = jf.rank(), jf.size()
    topology = T.exponential(n)
    jf.set_topology(topology)
    problem = oc.logistic(n)
    x0 = np.zeros(problem.A.shape[-1])
    steps = 20
    outs = len(topology.out_neighbors(r))
    for name, optimizer, compressor, copies in oc.compressed_cases(n, problem):
        agent = oc.train(optimizer, problem, n, steps)
        run = jax.jit(agent)
        jax.block_until_ready(run(problem.A[r], problem.B[r]))  # compile, run once, finish
        jf.comm_stats(reset=True)
        mine = np.asarray(run(problem.A[r], problem.B[r]))
        sent = jf.comm_stats()
        # Bytes: every step sends one payload message per out-neighbour (BEER: two
        # quantities in one message), or one allgather block to every other rank.
        payload = C.tree_bytes(compressor, x0) * copies
        if name.startswith("gradient_allreduce"):
            assert set(sent) == {"allgather"}, (name, sent)
            assert sent["allgather"].bytes == steps * (n - 1) * payload, (name, sent)
        else:
            assert set(sent) == {"neighbor_allgather"}, (name, sent)
            stats = sent["neighbor_allgather"]
            assert (stats.calls, stats.messages) == (steps, steps * outs), (name, stats)
            assert stats.bytes == steps * outs * payload, (name, stats, payload)
            dense = x0.nbytes * copies
            if name != "choco identity()":
                assert stats.bytes < steps * outs * dense, name
        every = MPI.COMM_WORLD.gather(mine)
        if r == 0:
            simulated = np.asarray(jax.jit(jf.simulate(agent, topology))(problem.A, problem.B))
            np.testing.assert_allclose(np.stack(every), simulated, rtol=1e-10, atol=1e-12,
                                       err_msg=name)
            assert np.isfinite(simulated).all() and np.abs(simulated).max() > 1e-4, name
    # Low-rank on matrices (warm-started power iteration), zero gradients.
    X = np.random.default_rng(0).standard_normal((n, 6, 5))
    optimizer = jfo.choco(optax.sgd(0.0), compressor=C.low_rank(2), gamma=0.3)

    def gossip(x):
        def step(carry, _):
            x, state = carry
            u, state = optimizer.update(jnp.zeros_like(x), state, x)
            return (optax.apply_updates(x, u), state), None
        return jax.lax.scan(step, (x, optimizer.init(x)), None, length=steps)[0][0]

    jf.comm_stats(reset=True)
    mine = np.asarray(jax.jit(gossip)(X[r]))
    assert jf.comm_stats()["neighbor_allgather"].bytes == steps * outs * (6 + 5) * 2 * 8
    every = MPI.COMM_WORLD.gather(mine)
    if r == 0:
        simulated = np.asarray(jax.jit(jf.simulate(gossip, topology))(X))
        np.testing.assert_allclose(np.stack(every), simulated, rtol=1e-10, atol=1e-12)
        assert np.abs(simulated.mean(0) - X.mean(0)).max() < 1e-12
