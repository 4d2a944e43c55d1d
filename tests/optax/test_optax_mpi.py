"""jaxfog.optax on MPI processes: the exact methods reach the centralized
optimum, and every transformation's iterates match the simulation backend's."""

from __future__ import annotations

from mpi_harness import ONE_RANK_COUNT_ENV, computed_once, mpi_test


@mpi_test(nprocs=(4, 5), timeout=300, x64=True)
def test_optimizers_on_mpi_match_the_optimum_and_the_simulation():
    """The exact methods on both rank counts; every other transformation on
    one of them, alternately (compiling each case on every rank was most of
    this test's 3.6 minutes), on both when only one count runs."""
    import os

    import jax
    import numpy as np

    import jaxfog as jf
    import optax_cases as oc

    jf.init()
    r, n = jf.rank(), jf.size()
    runs = []  # (problem, what, optimizer, topology, steps, exact)
    for problem in (oc.least_squares(n), oc.logistic(n)):
        for name, optimizer, topology, steps in oc.exact_cases(n, problem):
            runs.append((problem, f"{problem.name}, {name}", optimizer, topology, steps, True))
    problem = oc.logistic(n)
    every_case = os.environ.get(ONE_RANK_COUNT_ENV) == "1"
    for i, (name, optimizer, topology) in enumerate(oc.all_cases(n, problem)):
        if every_case or i % 2 == n % 2:
            runs.append((problem, name, optimizer, topology, 40, False))

    def simulated(run):
        problem, _, optimizer, topology, steps, _ = run
        agent = oc.train(optimizer, problem, n, steps)
        return jax.jit(jf.simulate(agent, topology))(problem.A, problem.B)

    for run, want in zip(runs, computed_once(simulated, runs), strict=True):
        problem, what, optimizer, topology, steps, exact = run
        jf.set_topology(topology)
        mine = np.asarray(jax.jit(oc.train(optimizer, problem, n, steps))(
            problem.A[r], problem.B[r]))
        if exact:
            scale = np.linalg.norm(problem.optimum)
            error = np.linalg.norm(mine - problem.optimum) / scale
            assert error < 1e-8, (what, error)
            np.testing.assert_allclose(mine, want[r], rtol=0, atol=1e-10 * scale, err_msg=what)
        else:
            np.testing.assert_allclose(mine, want[r], rtol=1e-11, atol=1e-13, err_msg=what)
            assert np.isfinite(mine).all() and np.abs(mine).max() > 1e-3, what


@mpi_test(nprocs=(2,), timeout=120, x64=True)
def test_atc_unfused_sends_a_message_per_leaf_last_leaf_first():
    import json
    import os
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.optax as jfo
    from jaxfog import ffi

    trace = os.path.join(tempfile.mkdtemp(), "trace.json")  # this rank's own
    os.environ["JAXFOG_TIMELINE"] = trace
    jf.init()
    r = jf.rank()
    sizes = {"a": 3, "b": 500, "c": 20}  # leaves in order a, b, c; float64
    params = {k: jnp.full(m, float(r + 1)) for k, m in sizes.items()}
    sent = {}
    for fused in (True, False):
        opt = jfo.atc(optax.sgd(0.1), fused=fused)
        step = jax.jit(lambda p, s: opt.update(jax.tree.map(jnp.ones_like, p), s, p))
        updates, _ = jax.block_until_ready(step(params, opt.init(params)))
        mixed = optax.apply_updates(params, updates)
        for k in sizes:  # 2 ranks: the mean of (r + 1) - 0.1
            np.testing.assert_allclose(mixed[k], 1.4, rtol=1e-14)
        assert ffi.flush_timeline()
        with open(trace.replace(".json", f".rank{r}.json")) as f:
            spans = [e for e in json.load(f)["traceEvents"]
                     if e["ph"] == "X" and e["name"] == "neighbor_allreduce"]
        sent[fused] = [e["args"]["bytes"] for e in sorted(spans, key=lambda e: e["args"]["seq"])]
    assert sent[True] == [8 * 523], sent  # one message
    assert sent[False][1:] == [8 * 20, 8 * 500, 8 * 3], sent  # c, b, a: the last leaf first
    jf.shutdown()
