"""The examples with a plain ``python`` (no launcher): simulated agents, same results."""

from __future__ import annotations


import jax
import numpy as np
import pytest

from jaxfog.testing import load_module
from paths import EXAMPLES



def _example(name: str):
    """``examples/{name}.py``, as ``python examples/{name}.py`` would find the
    modules beside it (``train_digits``, ``_regression_data``)."""
    return load_module(EXAMPLES / f"{name}.py")


@pytest.fixture(autouse=True)
def restore_x64():
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("agents", [8, 6])
def test_average_consensus_simulated(agents, capsys):
    results = _example("average_consensus").main(["--steps", "4", "--dim", "32",
                                                  "--agents", str(agents)])
    assert f"{agents} simulated agents" in capsys.readouterr().out
    one_peer = results["one-peer exponential"]
    if agents == 8:
        assert one_peer[3] < 1e-14 < one_peer[2]  # exact after log2(8) steps
    for errors in results.values():
        assert errors[-1] < errors[1] < 1.0


def test_exact_diffusion_simulated():
    history = _example("exact_diffusion").main(["--iterations", "1800", "--report-every",
                                                "600", "--agents", "4"])
    assert history[-1][1] < 1e-8


def test_dgd_simulated_stalls_at_the_same_bias_as_mpi():
    history = _example("dgd_linear_regression").main(["--iterations", "800",
                                                      "--report-every", "400",
                                                      "--agents", "4"])
    (_, big), (_, small) = history.items()
    assert abs(big[-1][1] - 9.766e-2) < 1e-4  # the MPI run's bias (4 processes)
    assert small[-1][1] < big[-1][1]


def test_async_consensus_simulated():
    """Simulated agents run in lockstep: the same code is synchronous push-sum."""
    result = _example("async_consensus").main(["--steps", "60", "--dim", "8", "--agents", "5"])
    assert (result["final"] < 1e-10).all()
    np.testing.assert_allclose(result["mass"][-1], 5, rtol=1e-12)
    np.testing.assert_allclose(result["mass"][:-1], result["initial"], rtol=1e-12)


def test_straggler_simulated(tmp_path, capsys):
    out = tmp_path / "straggler.png"
    rows = _example("straggler").main(["--straggler", "4", "--iterations", "40",
                                       "--every", "20", "--chunks", "4",
                                       "--emulated-ms", "20", "--out", str(out),
                                       "--no-progress"])
    assert "simulated agents" in capsys.readouterr().out and out.stat().st_size > 0
    # In simulated time the fast agents of the asynchronous methods do not
    # wait for the 5x slower straggler (push-sum, AD-PSGD), or wait less (Hop).
    sync = rows["atc"]["iterations_per_s"]
    assert rows["allreduce"]["iterations_per_s"] < 1.1 * sync
    assert rows["push-sum"]["iterations_per_s"] > 4 * sync
    assert rows["ad-psgd"]["iterations_per_s"] > 4 * sync
    assert rows["hop s=2 b=1"]["iterations_per_s"] > 1.5 * sync
    assert rows["atc"]["final"] > 60 and rows["push-sum"]["final"] > 60
