"""A user's program, written from the docs alone, on every backend they describe.

``user_digits_program.py`` (beside this file) trains a Flax linen MLP on
scikit-learn's digits with ``jaxfog.optax`` transformations on ``jaxfog.Agents``,
as docs/guide/simulate.rst, flax.rst, optax.rst and mesh.rst present them. It
is run as a user runs it: ``python prog.py`` (simulated agents),
``jaxfog run -np 2 python prog.py`` (MPI processes),
``jaxfog run -np 2 python prog.py --mesh`` (a 2-process device mesh over gloo)
and ``python prog.py --mesh`` with 4 forced host devices. The simulation is the
reference: the other backends must give its per-step losses and final
parameters to float32 tolerance, and the simulation itself must train (loss
down, accuracy up, float32 kept).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from jaxfog.testing import launch_environment, run_command
from paths import TESTS

pytestmark = pytest.mark.numerical

PROGRAM = TESTS / "user_digits_program.py"
METHODS = ["atc", "awc", "gradient_tracking", "exact_diffusion"]
# float32 sums in another order; the measured gap is 5e-7 after 30 steps.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _run(tmp_path, method, *, launch=(), extra=(), env=None, timeout=120):
    out = tmp_path / f"{method}{''.join(extra)}{len(launch)}.npz"
    command = [*launch, sys.executable, str(PROGRAM), str(out), method, *extra]
    result = run_command(command, timeout=timeout, env=launch_environment(env))
    assert result.ok, result.report()
    return dict(np.load(out))


def _mpi(np_):
    return [sys.executable, "-m", "jaxfog.cli", "run", "-np", str(np_)]


def _params(run):
    return {k: v for k, v in run.items() if k.startswith("[")}


def _assert_same_run(run, reference):
    assert int(run["size"]) == int(reference["size"])
    np.testing.assert_allclose(run["losses"], reference["losses"], **TOLERANCE)
    ours, theirs = _params(run), _params(reference)
    assert ours.keys() == theirs.keys() and len(ours) == 4
    for key in theirs:
        assert ours[key].dtype == np.float32, key
        assert ours[key].shape == theirs[key].shape, key
        np.testing.assert_allclose(ours[key], theirs[key], err_msg=key, **TOLERANCE)
    assert abs(float(run["accuracy"]) - float(reference["accuracy"])) <= 2 / 1797  # a digit or two


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("simulated")
    return {method: _run(tmp, method) for method in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_simulated_agents_train_in_float32(simulated, method):
    run = simulated[method]
    losses = run["losses"]
    assert int(run["size"]) == 2 and losses.shape == (30,)
    assert list(run["dtypes"]) == ["float32"]
    assert 2.2 < losses[0] < 2.5                               # ~ log(10) at the start
    assert losses[-1] < losses[0] - 0.3, losses               # it learns
    params = _params(run)
    assert all(v.shape[0] == 2 for v in params.values())      # both agents' models
    if method in ("atc", "awc"):                               # momentum: far by 30 steps
        assert losses[-1] < 0.6 and float(run["accuracy"]) > 0.8, (losses[-1], run["accuracy"])
    else:                                                      # plain steps of 0.1
        assert float(run["accuracy"]) > 0.4, run["accuracy"]


@pytest.mark.parametrize("method", METHODS)
def test_mpi_processes_give_the_simulation(simulated, tmp_path, method):
    _assert_same_run(_run(tmp_path, method, launch=_mpi(2)), simulated[method])


@pytest.mark.parametrize("method", ["atc", "gradient_tracking"])
def test_a_two_process_mesh_gives_the_simulation(simulated, tmp_path, method):
    _assert_same_run(_run(tmp_path, method, launch=_mpi(2), extra=("--mesh",), timeout=180),
                     simulated[method])


def test_four_host_devices_in_one_process_give_the_simulation(tmp_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    mesh = _run(tmp_path, "atc", extra=("--mesh",), env={"XLA_FLAGS": flags.strip()})
    reference = _run(tmp_path, "atc", extra=("--agents=4",))
    assert int(mesh["size"]) == 4
    _assert_same_run(mesh, reference)
