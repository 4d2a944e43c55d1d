"""Elastic runs on MPI processes (``jaxfog run --max-restarts``, the default
MPICH): a rank SIGKILLed mid-run, the job relaunched by ``jaxfog run`` itself,
every rank resumed from its snapshot, against the same program on simulated
agents with the same membership changes (``jaxfog.elastic.simulate``). The
digits program of ``examples/elastic_digits.py``, in float32.

A host lost, or a new one, is a change of the hosts a launch gets: here a
``--host-discovery-script`` says how many slots this machine offers at each
launch (the whole-host case across network namespaces is in
``test_cluster_netns.py``)."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import stat
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np

from jaxfog.testing import launch_environment, run_command
from mpi_harness import mpi_test
from paths import REPO

ROOT = REPO
PROGRAM = ROOT / "examples" / "elastic_digits.py"
STEPS, EVERY = 40, 10


def _program():
    spec = importlib.util.spec_from_file_location("elastic_digits", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _discovery(tmp_path: Path, slots: list[int]) -> Path:
    """A discovery script giving this machine ``slots[k]`` slots at its k-th
    call (the last entry thereafter): one call per launch here."""
    script = tmp_path / "discover.sh"
    script.write_text(f"""#!/bin/sh
count=$(cat {tmp_path}/calls 2>/dev/null || echo 0)
echo $((count + 1)) > {tmp_path}/calls
set -- {' '.join(map(str, slots))}
shift $(( count < $# - 1 ? count : $# - 1 ))
echo "{socket.gethostname()}:$1"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _launch(tmp_path, *, np_, method="atc", kill="", discovery=None, restarts=2,
            env=None, timeout=300, mpi_args="", extra=()):
    out = tmp_path / "out.npz"
    command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", str(np_),
               "--max-restarts", str(restarts)]
    if mpi_args:
        command += ["--mpi-args", mpi_args]
    if discovery:
        command += ["--host-discovery-script", str(discovery)]
    command += ["--", sys.executable, str(PROGRAM), "--method", method, "--steps", str(STEPS),
                "--every", str(EVERY), "--out", str(out), "--directory",
                str(tmp_path / "snapshots")]
    if kill:
        command += ["--kill", kill]
    command += list(extra)
    result = run_command(command, timeout=timeout, env=launch_environment(
        {"JAXFOG_DISCOVERY_INTERVAL": "100000", **(env or {})}))
    assert result.ok, result.report()
    return dict(np.load(out)), result.output


def _simulated(method, agents, changes):
    import jaxfog.elastic as je

    (everyone, accuracy), resumed = je.simulate(
        lambda n: _program().main(n, method, STEPS, EVERY), agents, changes)
    return jax.tree.leaves(everyone), accuracy, resumed


def _assert_same(mpi, simulated):
    leaves, accuracy, _ = simulated
    assert int(mpi["agents"]) == leaves[0].shape[0]
    for i, leaf in enumerate(leaves):
        assert mpi[f"p{i}"].dtype == np.float32
        np.testing.assert_allclose(mpi[f"p{i}"], np.asarray(leaf), rtol=2e-4, atol=2e-5)
    assert abs(float(mpi["accuracy"]) - accuracy) <= 2 / 360


def test_a_killed_rank_is_relaunched_and_the_run_equals_the_uninterrupted_one(tmp_path):
    """Rank 2 SIGKILLed at step 23: MPICH ends the job, ``jaxfog run``
    relaunches it on the same 3 slots, every rank resumes at step 20 with the
    same members, and the result is the uninterrupted run's (atc on the
    one-peer schedule)."""
    mpi, output = _launch(tmp_path, np_=3, kill="2:23:0")
    assert "restart 1 of 2" in output and "resumed at step 20 on 3 rank(s)" in output
    assert "members unchanged" in output
    _assert_same(mpi, _simulated("atc", 3, {}))


def test_a_lost_rank_and_two_failures_in_a_row_equal_the_simulated_churn(tmp_path):
    """Launch 0: 3 slots, rank 2 killed at step 23. Launch 1: 2 slots (its
    member is lost), resumed at 20; rank 1 killed at step 35. Launch 2: 3
    slots again, resumed at 30, rank 2 a newcomer with rank 1's live copy.
    gradient tracking (its tracker restored at each change) equals the
    simulation with agent 2 leaving at step 20 and one joining at 30."""
    mpi, output = _launch(tmp_path, np_=3, method="gradient_tracking",
                          kill="2:23:0,1:35:1", discovery=_discovery(tmp_path, [3, 2, 3]))
    assert "resumed at step 20 on 2 rank(s)" in output, output
    assert "resumed at step 30 on 3 rank(s) (1 rank(s) copied from a neighbour" in output
    import jaxfog.elastic as je

    simulated = _simulated("gradient_tracking", 3, {20: je.Change(leave=[2]),
                                                   30: je.Change(join=1)})
    assert [r.members for r in simulated[2]][-1] == (0, 1, 3)
    _assert_same(mpi, simulated)


def test_a_host_that_appears_joins_at_the_next_snapshot_without_a_failure(tmp_path):
    """The discovery script offers a third slot from its second call on, made
    while the first launch starts (every 0.5 s): the job stops at its first
    snapshot, step 10 (exit status 75 on every rank, not counted as a failure:
    --max-restarts 0), and is relaunched on 3 ranks, the newcomer with rank
    1's state. DiLoCo equals the simulation with one agent joining at step 10."""
    mpi, output = _launch(tmp_path, np_=3, method="diloco", restarts=0,
                          discovery=_discovery(tmp_path, [2, 3]),
                          env={"JAXFOG_DISCOVERY_INTERVAL": "0.5"})
    assert "the job stopped to take in new hosts" in output, output
    assert "resumed at step 10 on 3 rank(s) (1 rank(s) copied from a neighbour" in output
    import jaxfog.elastic as je

    _assert_same(mpi, _simulated("diloco", 2, {10: je.Change(join=1)}))


def test_more_failures_than_allowed_end_the_run_with_the_failure(tmp_path):
    out = tmp_path / "out.npz"
    command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", "2", "--max-restarts", "1",
               "--", sys.executable, str(PROGRAM), "--steps", "30", "--every", "10",
               "--agents", "2", "--out", str(out), "--directory", str(tmp_path / "s"),
               "--kill", "1:5:0,0:15:1"]
    result = run_command(command, timeout=240, env=launch_environment())
    assert result.returncode not in (0, None), result.report()
    assert "restart 1 of 1" in result.output
    assert "--max-restarts 1 are spent; giving up" in result.output
    assert not out.exists()
    assert os.path.exists(tmp_path / "s")


def test_a_relaunch_loads_what_the_first_launch_compiled(tmp_path):
    """``--max-restarts`` points JAX's persistent compilation cache at a folder
    of the job's: the relaunched rank finds the programs the first launch
    compiled (a relaunch's start on 2 cores was half compiling), and the
    folder is gone when the job ends."""
    program = tmp_path / "compiles.py"
    program.write_text(textwrap.dedent("""
        import os, sys
        import jax, jax.numpy as jnp
        cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
        launch = os.environ["JAXFOG_ELASTIC_RESTART"]
        before = len(os.listdir(cache)) if os.path.isdir(cache) else 0
        jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
        print(f"launch {launch}: {before} compiled before, in {cache}", flush=True)
        sys.exit(3 if launch == "0" else 0)
    """))
    env = launch_environment()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    result = run_command([sys.executable, "-m", "jaxfog.cli", "run", "-np", "1",
                          "--max-restarts", "1", "--", sys.executable, str(program)],
                         timeout=120, env=env)
    assert result.ok, result.report()
    first = re.search(r"launch 0: 0 compiled before, in (\S+)", result.output)
    again = re.search(r"launch 1: (\d+) compiled before", result.output)
    assert first and again and int(again.group(1)) > 0, result.output
    assert not os.path.exists(first.group(1))


def _flaky_launcher(tmp_path: Path, fail_launches: str) -> Path:
    """This machine's mpiexec behind a wrapper that exits with status 213 at
    once, starting no rank, at the launches (counted from 1) listed in
    ``fail_launches``: an MPI launcher that fails as Open MPI 5.0.11's does
    now and then when the job before left a host a moment ago."""
    from jaxfog.cli._launcher import find_mpiexec

    wrapper = tmp_path / "mpiexec"
    wrapper.write_text(f"""#!/bin/sh
case "$1" in --version) exec {find_mpiexec()} "$@" ;; esac
count=$(( $(cat {tmp_path}/launches 2>/dev/null || echo 0) + 1 ))
echo $count > {tmp_path}/launches
case " {fail_launches} " in *" $count "*) echo "launcher failed" >&2; exit 213 ;; esac
exec {find_mpiexec()} "$@"
""")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


_FAILS_AT_FIRST_LAUNCH = textwrap.dedent("""
    import os, sys
    import jaxfog as jf
    jf.init()
    launch = os.environ["JAXFOG_ELASTIC_RESTART"]
    print(f"launch {launch}: rank {jf.rank()} of {jf.size()} started", flush=True)
    sys.exit(3 if launch == "0" else 0)
""")


def test_a_relaunch_whose_launcher_fails_before_any_rank_starts_is_tried_again(tmp_path):
    """The program fails at its first launch; the relaunch's MPI launcher then
    fails twice before any rank starts (no rank 0 to say it started): `jaxfog
    run` tries that relaunch again, without counting it against --max-restarts 1,
    and the third try runs. A launcher that fails every time uses up the
    retries, then the restarts, and the run ends with its exit status."""
    program = tmp_path / "fails_first.py"
    program.write_text(_FAILS_AT_FIRST_LAUNCH)

    def launch(fail_launches: str):
        env = {**launch_environment(),
               "JAXFOG_MPIEXEC": str(_flaky_launcher(tmp_path, fail_launches))}
        (tmp_path / "launches").unlink(missing_ok=True)
        return run_command([sys.executable, "-m", "jaxfog.cli", "run", "-np", "2",
                            "--max-restarts", "1", "--", sys.executable, str(program)],
                           timeout=180, env=env)

    result = launch("2 3")
    assert result.ok, result.report()
    output = result.output
    for try_ in (1, 2):
        assert (f"relaunch 1 failed before any rank started (exit status 213); trying it "
                f"again in 2 s ({try_} of 2, not counted as a failure)") in output, output
    assert output.count("launch 1: rank") == 2 and "restart 1 of 1" in output, output
    assert (tmp_path / "launches").read_text().strip() == "4"

    result = launch("2 3 4 5 6")
    assert result.returncode == 213, result.report()
    assert "--max-restarts 1 are spent; giving up" in result.output, result.output
    assert (tmp_path / "launches").read_text().strip() == "4"


def test_a_rank_0_that_cannot_see_the_launchers_files_still_starts(tmp_path):
    """Rank 0 on a host without the launcher's folder (the control file's path
    does not exist there): jaxfog.init goes on, and the job runs."""
    program = tmp_path / "starts.py"
    program.write_text("import jaxfog as jf\njf.init()\nprint('rank', jf.rank(), 'up')\n")
    env = {**launch_environment(), "JAXFOG_ELASTIC_CONTROL": str(tmp_path / "absent" / "c")}
    result = run_command([sys.executable, "-m", "jaxfog.cli", "run", "-np", "2", "--",
                          sys.executable, str(program)],
                         timeout=120, env=env)
    assert result.ok, result.report()
    assert "rank 0 up" in result.output and "rank 1 up" in result.output, result.output
    assert not (tmp_path / "absent").exists()


@mpi_test(nprocs=(2,), timeout=120)
def test_a_rank_whose_state_differs_is_refused_on_every_rank():
    """A joining host that runs another program (here rank 1's parameters have
    another shape, then another version): ValueError on every rank, naming it."""
    import tempfile

    import jax.numpy as jnp
    import pytest

    import jaxfog as jf
    import jaxfog.elastic as je

    jf.init()
    directory = jf.runtime.communicator().bcast(tempfile.mkdtemp(), root=0)
    with pytest.raises(ValueError, match=r"ranks \[1\] hold a state .* other than rank 0's"):
        je.State(x=jnp.zeros(2 + jf.rank()), directory=directory)
    with pytest.raises(ValueError, match=r"ranks \[1\] hold a state"):
        je.State(x=jnp.zeros(2), directory=directory, version=f"v{min(jf.rank(), 1)}")
    state = je.State(x=jnp.zeros(2), directory=directory, every=1)
    for _ in state.steps(2):
        state.x = state.x + 1.0
    assert float(state.x[0]) == 2.0
