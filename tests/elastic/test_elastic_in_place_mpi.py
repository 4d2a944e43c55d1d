"""In-place recovery under Open MPI 5 with ULFM (``jaxfog.elastic.run``).

Three ranks train on MPI processes launched with ``mpiexec --with-ft ulfm``
(``jaxfog run --mpi-args "--with-ft ulfm"``), and one SIGKILLs itself before
a step. The survivors' ops fail (``rank 2 has failed``), ``elastic.run``
shrinks jaxfog to them and runs the program again on 2 ranks, its State
resumed from memory: no relaunch. The final parameters equal
``jaxfog.elastic.simulate`` with ``Change(leave=[...])`` at the resume step:
a quadratic program (timed: kill to next step), and the digits program of
``examples/elastic_digits.py`` killed in a DiLoCo sync and with a nonblocking
exchange in flight. Skipped, saying why, where jaxfog runs on another MPI
(CI's run 4 runs them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxfog.elastic as je
from jaxfog.cli import _launcher as launcher
from mpi_harness import openmpi_with_ulfm
from test_elastic import _quadratic_program
from test_elastic_mpi import _assert_same, _discovery, _launch, _simulated

STEPS = 60
KILL_AT = 23
#: Seconds from the kill to the survivors' next completed step (re-tracing included).
RECOVERY_BOUND = 5.0


_PROGRAM = """
import json, os, signal, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
import jaxfog as jf, jaxfog.elastic as je, jaxfog.optax as jfo, jaxfog.topology as T

method, out = sys.argv[1], sys.argv[2]
jf.init()
first_rank = jf.rank()
done = []  # (ranks, step, wall time, programs loaded, compiled) of each completed step
cache = []  # JAX's persistent compilation cache events
jax.monitoring.register_event_listener(lambda event, **_: cache.append(event))

def program(n):
    topology = T.exponential(n)
    optimizer = {{"gradient_tracking": lambda: jfo.gradient_tracking(0.2, topology=topology),
                  "gradient_allreduce": lambda: jfo.gradient_allreduce(optax.sgd(0.2)),
                  "atc": lambda: jfo.atc(optax.sgd(0.2), topology=topology)}}[method]()
    r = jf.rank()
    target = jnp.array([r, r * r], jnp.float32) / n

    @jf.jit
    def step(x, s, target):
        updates, s = optimizer.update(x - target, s, x)
        return optax.apply_updates(x, updates), s

    x0 = jnp.zeros(2, jnp.float32)
    state = je.State(params=x0, opt_state=optimizer.init(x0), every=1000,
                     directory=os.path.join(out, "snapshots"))
    for k in state.steps({steps}):
        if k == {kill_at} and n == 3 and jf.rank() == 2:
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        seen = len(cache)
        state.params, state.opt_state = step(state.params, state.opt_state, target)
        jax.block_until_ready(state.params)
        done.append((n, k, time.time(), cache[seen:].count("/jax/compilation_cache/cache_hits"),
                     cache[seen:].count("/jax/compilation_cache/cache_misses")))
    return np.asarray(state.params), state.resumed

params, resumed = je.run(program, max_failures=1)
with open(os.path.join(out, f"rank{{first_rank}}.json"), "w") as f:
    json.dump({{"params": params.tolist(), "resumed_step": resumed.step,
               "members": list(resumed.members), "rank": jf.rank(), "size": jf.size(),
               "done": done}}, f)
""".format(steps=STEPS, kill_at=KILL_AT)


def _simulated_quadratic(method: str, resume_step: int) -> np.ndarray:
    """The oracle: the same program on 3 simulated agents, agent 2 leaving at resume_step."""
    program = _quadratic_program(method, steps=STEPS, every=1000)
    (x, _), resumed = je.simulate(program, 3, {resume_step: je.Change(leave=[2])})
    assert [r.members for r in resumed] == [(0, 1, 2), (0, 1)]
    return x


@pytest.mark.parametrize("method", ["gradient_tracking", "gradient_allreduce", "atc"])
def test_survivors_recover_in_place_as_simulate_says(tmp_path, method):
    """The quadratic program on 3 ranks, rank 2 killed before a step: the
    survivors redo it on 2 ranks within ``RECOVERY_BOUND`` seconds of the kill
    and end equal to the simulation. Each method's step is the same program on
    any number of ranks (its shapes do not depend on it; an allreduce divides
    by the size as it runs, and a neighbour average names its plan, the row
    of W, by an id), so ``elastic.run``'s persistent compilation cache gives
    it back after the shrink: loaded, not compiled (its first step on 3 ranks,
    the control, compiled)."""
    why_not = openmpi_with_ulfm()
    if why_not:
        pytest.skip(why_not)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_PROGRAM))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOG_TIMEOUT": "20",
           "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's: elastic.run's own instead
    command = launcher.build_command([sys.executable, str(script), method, str(tmp_path)], 3,
                                     mpi_args=["--with-ft", "ulfm"], env=env)
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text())
               for r in (0, 1) if (tmp_path / f"rank{r}.json").exists()}
    assert set(results) == {0, 1}, f"rc {done.returncode}\n{output}"
    assert not (tmp_path / "rank2.json").exists()
    assert "Segmentation fault" not in output and "Fatal Python error" not in output, output
    assert "resumed in place at step" in output, output
    for r, result in results.items():
        assert (result["rank"], result["size"]) == (r, 2), result
        assert result["members"] == [0, 1], result
    resume_step = results[0]["resumed_step"]
    assert results[1]["resumed_step"] == resume_step
    assert KILL_AT - 3 <= resume_step <= KILL_AT, resume_step  # kept in memory: <= keep back
    killed = float((tmp_path / "killed").read_text())
    # The first step each survivor completed on 2 ranks (the redone one).
    after = [min(t for n, k, t, *_ in r["done"] if n == 2) - killed for r in results.values()]
    print(f"\n{method}: resumed in place at step {resume_step}; kill -> next completed step "
          f"{max(after):.2f} s (ranks 0, 1: {after[0]:.2f}, {after[1]:.2f}); whole job "
          f"{time.monotonic() - start:.1f} s, rc {done.returncode}\n"
          + "\n".join(line for line in output.splitlines() if "jaxfog.elastic" in line))
    assert max(after) < RECOVERY_BOUND, after
    for result in results.values():
        first = {n: next(d for d in result["done"] if d[0] == n) for n in (3, 2)}
        assert first[3][4] >= 1, first  # the control: compiled on 3 ranks
        assert first[2][3] >= 1 and first[2][4] == 0, first  # loaded on 2
    # The survivors meet at exit, so MPI_Finalize's rare wait after a shrink ends
    # the process with status 0 (runtime._EXIT_BOUND_AFTER_SHRINK_SECONDS).
    assert done.returncode == 0, output
    expected = _simulated_quadratic(method, resume_step)
    got = np.stack([np.asarray(results[r]["params"]) for r in (0, 1)])
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("method, kill, steps", [
    ("atc", "1:23:0", (23,)), ("diloco", "2:24:0", (24,)),
    ("streaming_diloco", "2:23:0", (23, 24))],
    ids=["atc, the middle rank", "diloco, during a sync",
         "streaming_diloco, an exchange in flight"])
def test_the_example_recovers_in_place_as_simulate_says(tmp_path, method, kill, steps):
    """The digits example, 3 ranks, one killed before a step, the steps before
    it done: the middle rank (the survivors renumbered, members 0 and 2);
    rank 2 at DiLoCo's sync step (the survivors fail in its allreduce); rank
    2 while Streaming DiLoCo's fragment exchange (``delay=1``) is in flight.
    The survivors redo the step that failed on 2 ranks (for Streaming
    DiLoCo, the kill's step if the exchange it starts fails at once, else
    the next, which waits for it: the resumed state's exchange in flight is
    made idle either way, as in any resume) and end equal to the simulation
    with that member leaving there."""
    why_not = openmpi_with_ulfm()
    if why_not:
        pytest.skip(why_not)
    mpi, output = _launch(tmp_path, np_=3, method=method, kill=kill, restarts=0,
                          mpi_args="--with-ft ulfm", env={"JAXFOG_TIMEOUT": "20"})
    lost = int(kill.split(":")[0])
    said = re.search(rf"rank\(s\) \[{lost}\] failed; resumed in place at step (\d+) on 2 "
                     r"rank\(s\)", output)
    assert said and int(said[1]) in steps, output
    simulated = _simulated(method, 3, {int(said[1]): je.Change(leave=[lost])})
    assert [r.members for r in simulated[2]][-1] == tuple(m for m in range(3) if m != lost)
    _assert_same(mpi, simulated)


# --- ranks joining in place ---------------------------------------------------------------


def test_a_rank_joins_in_place_and_its_death_is_survived_as_simulate_says(tmp_path):
    """2 ranks; rank 0 asks for one more at step 12 (``request_join``); at the
    snapshot step 20 the job spawns it (``MPI_Comm_spawn``) without stopping:
    the newcomer, rank 2, gets rank 1's state over MPI and gradient
    tracking's trackers are restored. Then the newcomer is SIGKILLed at step
    25: the two others shrink back in place and redo the step. The result
    equals the simulation with one agent joining at 20 and leaving there."""
    why_not = openmpi_with_ulfm()
    if why_not:
        pytest.skip(why_not)
    mpi, output = _launch(tmp_path, np_=2, method="gradient_tracking", kill="2:25:0",
                          restarts=0, mpi_args="--with-ft ulfm", env={"JAXFOG_TIMEOUT": "30"},
                          extra=["--join", "12"])
    assert re.search(r"1 rank\(s\) joined in place at step 20; 3 rank\(s\) \(members \[0, 1, "
                     r"2\], the newcomers' state from rank 1", output), output
    said = re.search(r"rank\(s\) \[2\] failed; resumed in place at step (\d+) on 2 rank\(s\)",
                     output)
    assert said and 22 <= int(said[1]) <= 25, output
    assert "restart" not in output, output  # in place: no relaunch
    simulated = _simulated("gradient_tracking", 2, {20: je.Change(join=1),
                                                    int(said[1]): je.Change(leave=[2])})
    assert [r.members for r in simulated[2]] == [(0, 1), (0, 1, 2), (0, 1)]
    assert simulated[2][1].copied_from == {2: 1}
    _assert_same(mpi, simulated)


def test_a_host_the_discovery_script_adds_joins_in_place(tmp_path):
    """``jaxfog run --host-discovery-script``: this machine offers 2 slots at
    the launch, 3 from then on. The launcher writes the new slot into the
    job's control file; at its next snapshot the job (under ULFM, in
    ``jaxfog.elastic.run``) starts a rank there in place, with no relaunch,
    and the result equals the simulation with one agent joining at that step."""
    why_not = openmpi_with_ulfm()
    if why_not:
        pytest.skip(why_not)
    mpi, output = _launch(tmp_path, np_=3, method="atc", restarts=0,
                          discovery=_discovery(tmp_path, [2, 3]), mpi_args="--with-ft ulfm",
                          env={"JAXFOG_TIMEOUT": "30", "JAXFOG_DISCOVERY_INTERVAL": "1"},
                          extra=["--pace", "0.1"])
    said = re.search(r"1 rank\(s\) joined in place at step (\d+); 3 rank\(s\)", output)
    assert said, output
    assert "relaunch" not in output and "stopped to take in new hosts" not in output, output
    simulated = _simulated("atc", 2, {int(said[1]): je.Change(join=1)})
    _assert_same(mpi, simulated)


_MISMATCH = """
import jax.numpy as jnp, optax
import jaxfog as jf, jaxfog.elastic as je, jaxfog.optax as jfo, jaxfog.runtime as rt

def program(n):
    width = 3 if rt.joined() else 2   # the newcomer's model is not the job's
    optimizer = jfo.atc(optax.sgd(0.1))
    params = jnp.zeros(width)
    state = je.State(params=params, opt_state=optimizer.init(params), every=5,
                     directory="{directory}")
    for step in state.steps(20):
        if step == 2 and jf.rank() == 0:
            je.request_join()
        state.params = state.params + 1.0
    return state.params

je.run(program)
"""


def test_a_newcomer_with_another_model_is_refused_with_a_clear_error(tmp_path):
    """A joining rank whose state has other shapes than the job's: every rank
    raises ``ValueError`` naming it, at the join (not a wrong value, no hang)."""
    why_not = openmpi_with_ulfm()
    if why_not:
        pytest.skip(why_not)
    script = tmp_path / "mismatch.py"
    script.write_text(_MISMATCH.format(directory=tmp_path / "snapshots"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOG_TIMEOUT": "30"}
    command = launcher.build_command([sys.executable, str(script)], 2,
                                     mpi_args=["--with-ft", "ulfm"], env=env)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "ranks [2] hold a state (structure, shapes, dtypes or version) other than rank " \
           "0's; a joining host must run the job's program" in output, output
