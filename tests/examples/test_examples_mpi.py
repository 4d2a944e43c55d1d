"""The examples, run as MPI processes, reach what their docstrings promise."""

from __future__ import annotations

from mpi_harness import mpi_test


def _example(name: str):
    from test_examples_sim import _example  # beside this file: on the ranks' sys.path

    return _example(name)


@mpi_test(nprocs=(2, 4, 5))
def test_average_consensus():
    import jaxfog as jf

    results = _example("average_consensus").main(["--steps", "8", "--dim", "64"])
    n = jf.size()
    for name, errors in results.items():
        assert errors[0] == 1.0
        assert errors[-1] <= errors[1] + 1e-15 and errors[1] < 1.0, name  # contracts
    if n & (n - 1) == 0:  # one peer on 2^k ranks: exact after k steps
        k = n.bit_length() - 1
        assert results["one-peer exponential"][k] < 1e-14
        assert results["one-peer exponential"][k - 1] > 1e-3


@mpi_test(nprocs=(4,), timeout=180)
def test_dgd_stalls_at_a_bias_that_shrinks_with_the_step():
    history = _example("dgd_linear_regression").main(["--iterations", "1600",
                                                       "--report-every", "400"])
    (big_step, big), (small_step, small) = history.items()
    assert small_step < big_step
    assert abs(big[-1][1] - big[-2][1]) < 1e-3 * big[-1][1]  # stalled
    assert 1e-3 < small[-1][1] < big[-1][1] < 0.5  # biased, less so with a smaller step


@mpi_test(nprocs=(3, 4), timeout=180)
def test_exact_diffusion_reaches_the_centralized_solution():
    history = _example("exact_diffusion").main(["--iterations", "1800",
                                                 "--report-every", "600"])
    assert history[-1][1] < 1e-8


@mpi_test(nprocs=(2, 4, 5), timeout=240)
def test_async_consensus_reaches_the_average_with_a_slow_rank():
    import numpy as np

    import jaxfog as jf

    result = _example("async_consensus").main(["--steps", "120", "--dim", "16"])
    assert result["final"] < 1e-10, result["final"]
    assert result["rounds"] < 200
    np.testing.assert_allclose(result["mass"][-1], jf.size(), rtol=1e-12)  # sum of p
    np.testing.assert_allclose(result["mass"][:-1], result["initial"], rtol=1e-12)


@mpi_test(nprocs=(4,), timeout=300)
def test_straggler():
    import os
    import tempfile

    import jaxfog as jf

    out = os.path.join(tempfile.gettempdir(), f"jaxfog_straggler_{os.getppid()}.png")
    rows = _example("straggler").main(["--straggler", "4", "--iterations", "30", "--every",
                                       "5", "--emulated-ms", "5", "--out", out,
                                       "--no-progress"])
    assert set(rows) == {"atc", "allreduce", "push-sum", "ad-psgd", "hop s=2 b=1"}
    for method, row in rows.items():
        assert row["final"] > 20, (method, row["final"])  # it trained (10 classes)
    # Without waiting, push-sum's fast ranks step several times per straggler step.
    push = rows["push-sum"]
    assert push["straggler_iterations"] < 0.8 * push["iterations_per_s"] * push["wall_time"]
    if jf.rank() == 0:
        assert os.path.getsize(out) > 0
        os.remove(out)
