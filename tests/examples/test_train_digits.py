"""The README's main job: the Flax digits demo, on simulated agents and as 4
MPI processes under ``jaxfog run``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from test_examples_sim import _example

from jaxfog.cli import _launcher as launcher
from jaxfog.testing import launch_environment, platforms, run_command
from paths import EXAMPLES

SHORT = ["--epochs", "6", "--methods", "allreduce,atc,awc", "--graphs", "one-peer",
         "--compress", "sign", "--no-progress", "--quiet"]


def _results(out: Path) -> dict:
    return json.loads((out / "train_digits.json").read_text())["results"]


def test_decentralized_training_is_within_one_point_of_allreduce(tmp_path, capsys):
    results = _example("train_digits").main(["--out", str(tmp_path), "--no-progress"])
    text = capsys.readouterr().out
    assert "### Summary (4 simulated agents)" in text and "| 60 |" in text
    for name in ("train_digits.png", "train_digits.md", "train_digits.json"):
        assert (tmp_path / name).stat().st_size > 1000, name
    assert set(results) == {"allreduce", "atc exponential", "awc exponential",
                            "atc one-peer", "awc one-peer"}
    baseline = results["allreduce"][-1]["test_accuracy"]
    assert baseline > 95.0
    for label, rows in results.items():
        assert rows[-1]["test_accuracy"] >= baseline - 1.0, label
        assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], label
        if label != "allreduce":  # the agents agree more as the step size decays
            assert rows[-1]["spread"] < 0.5 * rows[0]["spread"], label
    kb = {label: rows[0]["bytes_per_step"] for label, rows in results.items()}
    assert kb["atc exponential"] == 2 * kb["atc one-peer"]  # two out-neighbours vs one


def test_mpi_processes_train_like_the_simulated_agents(tmp_path):
    command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", "4", sys.executable,
               str(EXAMPLES / "train_digits.py"), "--out", str(tmp_path / "mpi"), *SHORT]
    run = run_command(command, timeout=280, env=launch_environment({"JAXFOG_TIMEOUT": "60"}))
    assert run.ok, run.report()
    assert "### Summary (4 MPI processes)" in run.output
    _example("train_digits").main(["--out", str(tmp_path / "sim"), *SHORT])
    on_mpi, simulated = _results(tmp_path / "mpi"), _results(tmp_path / "sim")
    assert set(on_mpi) == set(simulated) == {"allreduce", "atc one-peer", "awc one-peer",
                                             "choco sign() one-peer"}
    for label in on_mpi:
        # What went on the wire (jaxfog.comm_stats) is the bytes figure.
        for row in on_mpi[label]:
            assert row["measured_bytes_per_step"] == row["bytes_per_step"], label
        for mpi_row, sim_row in zip(on_mpi[label], simulated[label]):
            # float32, summed in another order: the same training to rounding
            # (a sign flips on a near-zero entry now and then: choco's looser bound;
            # tests/compress/test_compressed_mpi.py checks it to 1e-10 in float64).
            np.testing.assert_allclose(mpi_row["step_losses"], sim_row["step_losses"],
                                       rtol=2e-2 if label.startswith("choco") else 1e-3,
                                       err_msg=label)
            assert abs(mpi_row["test_accuracy"] - sim_row["test_accuracy"]) <= 0.5, label


MESH_SHORT = ["--epochs", "3", "--methods", "atc,awc", "--graphs", "one-peer", "--no-progress",
              "--quiet"]


def _mesh_trains_like_the_simulation(out: Path) -> None:
    _example("train_digits").main(["--out", str(out / "sim"), *MESH_SHORT])
    on_mesh, simulated = _results(out / "mesh"), _results(out / "sim")
    assert set(on_mesh) == set(simulated) == {"atc one-peer", "awc one-peer"}
    for label in on_mesh:
        for mesh_row, sim_row in zip(on_mesh[label], simulated[label], strict=True):
            np.testing.assert_allclose(mesh_row["step_losses"], sim_row["step_losses"],
                                       rtol=1e-4, err_msg=label)
            assert mesh_row["test_accuracy"] == sim_row["test_accuracy"], label


def test_a_device_mesh_trains_like_the_simulated_agents(tmp_path):
    """``--mesh`` under ``jaxfog run -np 4``: one agent per device of 4
    processes (jax.distributed; gloo between CPU processes, NCCL between GPUs),
    the same training as the simulation. Where the processes outnumber the
    GPUs (one GPU: NCCL takes one process per GPU) every process refuses at
    start-up, by name, instead of failing in its first collective."""
    command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", "4", sys.executable,
               str(EXAMPLES / "train_digits.py"), "--out", str(tmp_path / "mesh"), "--mesh",
               *MESH_SHORT]
    run = run_command(command, timeout=280, env=launch_environment())
    if platforms() == "cuda" and len(launcher.visible_gpus(launch_environment())) < 4:
        assert not run.ok and run.returncode is not None, run.report()
        assert "share GPU" in run.output and "one process per GPU" in run.output, run.report()
        return
    assert run.ok, run.report()
    assert "### Summary (4 agents on a device mesh)" in run.output
    _mesh_trains_like_the_simulation(tmp_path)


def test_one_process_mesh_holds_several_agents_per_device(tmp_path):
    """``--mesh`` without a launcher: the 4 agents on this process's devices
    (all 4 on one GPU, or on the one CPU device), the same training as the
    simulation: what a single GPU can show of the mesh path."""
    command = [sys.executable, str(EXAMPLES / "train_digits.py"), "--out",
               str(tmp_path / "mesh"), "--mesh", "--agents", "4", *MESH_SHORT]
    run = run_command(command, timeout=280, env=launch_environment())
    assert run.ok, run.report()
    assert "### Summary (4 agents on a device mesh)" in run.output
    _mesh_trains_like_the_simulation(tmp_path)
