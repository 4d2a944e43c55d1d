"""Flax NNX with jaxfog: the fast split/merge pattern under ``jaxfog.jit`` trains
the same on MPI processes as on simulated agents, and the in-place NNX step
that a compiled function would silently drop is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxfog as jf
import jaxfog.optax as jfo
from mpi_harness import mpi_test
from test_examples_sim import _example
from paths import EXAMPLES

pytestmark = pytest.mark.jax_internals


class _Linear(nnx.Module):
    def __init__(self):
        self.layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.layer(x)


def _in_place_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def test_an_in_place_nnx_step_is_an_error_not_a_silent_no_op():
    jf.init()  # one process: one rank
    model = _Linear()
    optimizer = nnx.Optimizer(model, jfo.atc(optax.sgd(0.1)), wrt=nnx.Param)
    x = jnp.ones((4, 3))
    with pytest.raises(TypeError, match=r"argument 0 \(_Linear\), argument 1 \(Optimizer\) "
                                        r"in place without returning it.*nnx.split"):
        jf.jit(_in_place_step)(model, optimizer, x)
    assert int(optimizer.step[...]) == 0
    # Reading a module is fine, and so is returning what was updated.
    np.testing.assert_allclose(jf.jit(lambda m, x: m(x))(model, x), model(x), rtol=1e-6)

    def returned(model, optimizer, x):
        _in_place_step(model, optimizer, x)
        return model, optimizer

    model, optimizer = jf.jit(returned)(model, optimizer, x)
    assert int(optimizer.step[...]) == 1


def test_the_fast_pattern_trains_in_place_under_jaxfog_jit():
    model = _Linear()
    optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x = jnp.ones((4, 3))

    @jf.jit
    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss = _in_place_step(model, optimizer, x)
        return nnx.state((model, optimizer)), loss

    losses = []
    for _ in range(3):
        state, loss = step(state, x)
        losses.append(float(loss))
    nnx.update((model, optimizer), state)
    assert int(optimizer.step[...]) == 3 and losses[2] < losses[0]


def test_agents_mean_takes_a_pytree_and_an_nnx_state():
    agents = jf.Agents(simulated=4)
    tree = agents.data(lambda r: {"a": np.full(3, float(r)), "b": (np.float32(r),)})
    mean = agents.mean(tree)
    np.testing.assert_allclose(mean["a"], np.full(3, 1.5))
    np.testing.assert_allclose(mean["b"][0], 1.5)
    state = agents.data(lambda r: nnx.state(_Linear(), nnx.Param))
    np.testing.assert_allclose(agents.mean(state)["layer"]["bias"][...],
                               np.asarray(nnx.state(_Linear())["layer"]["bias"][...]))
    with pytest.raises(TypeError, match="Agents.mean: needs numbers"):
        agents.mean({"a": "text"})


def test_nnx_example_on_mpi_processes_matches_the_simulated_agents(tmp_path):
    args = ["--epochs", "3", "--out"]
    simulated = _example("train_digits_nnx").main([*args, str(tmp_path / "sim")])
    assert simulated["steps"] == 30 and simulated["rows"][-1]["test_accuracy"] > 85
    command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", "4", sys.executable,
               str(EXAMPLES / "train_digits_nnx.py"), *args, str(tmp_path / "mpi")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "JAXFOG_TIMEOUT": "60"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 MPI processes: 30 steps per agent" in run.stdout
    on_mpi = np.load(tmp_path / "mpi" / "train_digits_nnx.npz")
    here = np.load(tmp_path / "sim" / "train_digits_nnx.npz")
    assert sorted(on_mpi) == sorted(here) and len(here) == 6
    for key in here:  # float32, summed in another order: the same training to rounding
        np.testing.assert_allclose(on_mpi[key], here[key], rtol=1e-3, atol=1e-4, err_msg=key)


def _integer_leaves():
    agents = jf.Agents(simulated=4)
    tree = agents.data(lambda r: {"int32": np.int32(r), "uint32": np.uint32(2 * r),
                                  "float": np.float32(r)})
    mean = agents.mean(tree)
    np.testing.assert_allclose(mean["int32"], 1.5)
    np.testing.assert_allclose(mean["uint32"], 3.0)
    assert mean["int32"].dtype == mean["uint32"].dtype == mean["float"].dtype == np.float32


def test_agents_mean_of_integer_leaves_is_a_float_mean_simulated():
    _integer_leaves()


@mpi_test([4])
def test_agents_mean_of_integer_leaves_is_a_float_mean_on_mpi():
    """The same script as 4 processes: the same means and dtypes (an NNX
    optimizer's uint32 step counter once failed here, and int32 rounded)."""
    _integer_leaves()
