"""One program, any scale: the same per-agent functions, with every argument
form, give the same numbers on MPI processes and on simulated agents.

Every op and every form of its arguments (numbers, ``{rank: w}`` dicts,
lists of ranks, rows of n weights, rank-indexed (n,) and (n, n) tables,
(n, k) tables of ranks, tables of peers), the window ops, every optax
transformation and the asynchronous trainers run as one per-agent function
on 4 MPI ranks; the reference is ``jaxfog.simulate`` (each case simulated by
one rank, shared with the others), and each rank compares its row, to 1e-12 in
float64. The asynchronous trainers run in simulated time (distinct compute
times), and MPI replays the simulation's order of events with barriers, one
step at a time.
"""

from __future__ import annotations

from mpi_harness import computed_once, mpi_test


@mpi_test(nprocs=(4,), env={"JAXFOG_NODES_PER_MACHINE": "2"}, timeout=300, x64=True)
def test_same_per_agent_functions_on_both_backends():
    import jax

    import jax.numpy as jnp
    import numpy as np
    import pytest

    import jaxfog as jf
    import jaxfog.topology as T
    from one_program_cases import cases

    jf.init()
    n, r = jf.size(), jf.rank()
    expo = T.exponential(n)
    comm = jf.runtime.communicator()

    def replay(name, make, loss, compute, iterations):
        """The trainer's run on this rank, in the simulation's order of events."""
        def on_mpi(a, b):
            """The simulation's event loop, replayed with barriers: the one
            step that ends first goes; an agent that is not ready waits, its
            clock moving with every step that ends (messages take no time)."""
            trainer = make()
            state = trainer.init(jnp.zeros(3))
            grad_fn = lambda x, k: jax.grad(loss)(x, a, b)  # noqa: E731
            clock = 0.0
            while True:
                todo = int(state.iteration) < iterations
                ready = todo and bool(trainer.ready(state))
                ends = np.array(comm.allgather(clock + compute[r] if ready else np.inf))
                if not any(comm.allgather(todo)):
                    break
                t = ends.min()
                assert np.isfinite(t) and (ends == t).sum() == 1, (name, ends)
                if ends[r] == t:
                    state = trainer.step(state, grad_fn)
                if ends[r] == t or (todo and not ready):
                    clock = max(clock, t)
                jf.barrier()  # the step has landed before anyone reads
            out = trainer.params(state), state.iteration
            jf.barrier()
            trainer.free()
            return out

        return on_mpi

    def simulate(case):
        jf.reset_clocks()
        return jax.jit(jf.simulate(case.fn, expo, local_size=2, delays=case.delays))(
            *case.args)

    every = cases(n)
    for case, simulated in zip(every, computed_once(simulate, every), strict=True):
        jf.reset_clocks()
        mine = [a[r] for a in case.args]
        fn = (replay(case.name, *case.trainer) if case.trainer is not None
              else jax.jit(case.fn) if case.jit else case.fn)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b)[r], rtol=1e-12, atol=1e-12, err_msg=case.name),
            fn(*mine), simulated)

    # A weight picked with the rank inside jit is traced: on MPI, a TypeError
    # naming the argument (the C++ op takes its ranks when it is compiled).
    table, x = jnp.ones((n, n)) - jnp.eye(n), jnp.ones(6)
    with pytest.raises(TypeError, match="src_weights is a traced value.*must be concrete"):
        jax.jit(lambda x: jf.neighbor_allreduce(x, self_weight=0.5, src_weights=table[jf.rank()],
                                                dst_weights=np.asarray(table)))(x)
    with pytest.raises(TypeError, match="peer is a traced value"):
        jax.jit(lambda x, p: jf.pair_gossip(x, p))(x, r ^ 1)
