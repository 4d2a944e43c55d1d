"""A mistake that is already certain fails in seconds, not at JAXFOG_TIMEOUT.

A rank that shuts down (``jaxfog.shutdown()`` or at exit) says goodbye to the
others; an op waiting for it then fails within a second or two, naming it and
its last op. An op that waits longer than ``JAXFOG_WARN_AFTER`` says once what
it waits for. Wall-clock bounds are wide: CI runs on two shared cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from jaxfog.cli import _launcher as launcher
from jaxfog.testing import run_mpi
from mpi_harness import mpi_test

#: Far beyond what a departure takes to notice (about 1.5 s), far below the timeout.
SOON = 60


@pytest.mark.parametrize("window", [False, True])
def test_collective_on_one_rank_fails_soon_after_the_other_exits(tmp_path, window):
    """The issue's case: ``if rank == 0: allreduce(x)``; rank 1 just ends. With a
    window, rank 1's exit blocks in the collective free of it, after its goodbye."""
    script = tmp_path / "one_rank.py"
    script.write_text(textwrap.dedent(f"""
        import time

        import jax.numpy as jnp
        import jaxfog as jf

        jf.init()
        if {window}:
            jf.win_create(jnp.zeros(4), "w")
        if jf.rank() == 0:
            start = time.monotonic()
            try:
                jf.allreduce(jnp.ones(3))
            except Exception as error:
                print(f"rank 0 failed after {{time.monotonic() - start:.1f}} s: {{error}}",
                      flush=True)
            else:
                print("rank 0: no error", flush=True)
    """))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOG_TIMEOUT": "600",
           "PYTHONUNBUFFERED": "1"}
    command = launcher.build_command([sys.executable, str(script)], 2, env=env)
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "rank 0 failed after" in output, output
    assert ("allreduce (op #1 on rank 0): rank 1 has left: its program ended "
            "(jaxfog.shutdown at exit) before any op on this communicator, and this op "
            "waits for it. It never called this op: an op called on some ranks only") in output, \
        output
    waited = float(output.split("rank 0 failed after ")[1].split(" s")[0])
    assert waited < SOON, output
    assert seconds < 2 * SOON + 60, output  # start-up of two JAX processes included


@mpi_test(nprocs=(3,), env={"JAXFOG_TIMEOUT": "300"}, timeout=240, alone=True)
def test_op_waiting_for_ranks_that_shut_down_fails_naming_them():
    import re

    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    np.testing.assert_allclose(jf.allreduce(jnp.full(2, float(r))), 1.0)  # op #1 everywhere
    if r == 0:
        start = time.monotonic()
        with pytest.raises(Exception) as caught:
            jf.allreduce(jnp.ones(3))  # op #2, on rank 0 only
        assert time.monotonic() - start < SOON
        message = str(caught.value)
        assert re.search(r"allreduce \(op #2 on rank 0\): rank [12] has left: it called "
                         r"jaxfog\.shutdown\(\) after its op #1 \(allreduce\) on this "
                         r"communicator, and this op waits for it\. It never called this op",
                         message), message
    jf.shutdown()


@mpi_test(nprocs=(4,), env={"JAXFOG_TIMEOUT": "300", "JAXFOG_NODES_PER_MACHINE": "2"},
          timeout=240, alone=True)
def test_machine_communicators_name_world_ranks():
    """Machines {0, 1} and {2, 3}; rank 3 leaves. Each failure ends a rank, which
    the next one waiting for it then hears of: 2 (machine allreduce), 0 (leaders'
    exchange), 1 (machine broadcast)."""
    import jax.numpy as jnp

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    if r == 3:
        jf.shutdown()
        return
    expected = {2: r"jaxfog allreduce \(op #1 on rank 0\): rank 1 \(world rank 3\) has left",
                0: r"jaxfog neighbor_allreduce \(op #1 on rank 0\): rank 1 \(world rank 2\) "
                   r"has left",
                1: r"jaxfog broadcast \(op #2 on rank 1\): rank 0 has left: it called "
                   r"jaxfog\.shutdown\(\) after its op #1 \(allreduce\)"}[r]
    start = time.monotonic()
    with pytest.raises(Exception, match=expected):
        jf.hierarchical_neighbor_allreduce(jnp.ones(3))
    assert time.monotonic() - start < SOON
    jf.shutdown()


@mpi_test(nprocs=(3,), env={"JAXFOG_TIMEOUT": "300"}, timeout=240, alone=True)
def test_neighbor_op_outlives_a_rank_it_does_not_talk_to():
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    if r == 2:
        jf.shutdown()  # ranks 0 and 1 go on without it
        return
    other = 1 - r
    if r == 1:
        time.sleep(3)  # rank 0 waits well past the departure checks' grace
    start = time.monotonic()
    y = jf.neighbor_allreduce(jnp.full(3, float(r)), self_weight=0.5,
                              src_weights={other: 0.5}, dst_weights=[other])
    np.testing.assert_allclose(y, 0.5)
    if r == 0:
        assert time.monotonic() - start > 2  # it did wait, with rank 2 gone
    jf.shutdown()


def late_peer_body():
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    if r == 1:
        time.sleep(6)  # three times JAXFOG_WARN_AFTER
    y = jf.neighbor_allreduce(jnp.full(3, float(r)), self_weight=0.5, src_weights={1 - r: 0.5},
                              dst_weights=[1 - r])
    np.testing.assert_allclose(y, 0.5)
    jf.shutdown()


def test_long_wait_says_once_what_it_waits_for_then_succeeds():
    result = run_mpi(2, __file__, "late_peer_body", timeout=240,
                     env={"JAXFOG_WARN_AFTER": "2", "JAXFOG_TIMEOUT": "300"})
    assert result.ok, result.report()
    lines = [line for line in result.output.splitlines() if "JAXFOG_WARN_AFTER" in line]
    assert lines == [
        "jaxfog neighbor_allreduce (op #1 on rank 0) is still waiting after 2 s "
        "(JAXFOG_WARN_AFTER) for the header from rank 1; it fails after 300 s "
        "(JAXFOG_TIMEOUT) unless they come"], result.output


def test_warn_after_is_a_number_of_seconds(monkeypatch):
    from jaxfog import runtime

    def read():
        return runtime._seconds_from_env(runtime.WARN_AFTER_ENV,
                                         runtime.DEFAULT_WARN_AFTER_SECONDS, "never warns")

    monkeypatch.delenv(runtime.WARN_AFTER_ENV, raising=False)
    assert read() == 30.0
    monkeypatch.setenv(runtime.WARN_AFTER_ENV, "0.5")
    assert read() == 0.5
    for text in ("soon", "-1"):
        monkeypatch.setenv(runtime.WARN_AFTER_ENV, text)
        with pytest.raises(ValueError, match="JAXFOG_WARN_AFTER"):
            read()


#: How both signal tests' ranks start: a handler of their own for the signal
#: (``SIGNAL``) when the case asks for one, then op #1 on a ring of 2.
_SIGNAL_RANK_PRELUDE = """
import os, signal, sys, time

import jax.numpy as jnp
import numpy as np
import jaxfog as jf

directory, case = sys.argv[1], sys.argv[2]
if case == "own handler":
    signal.signal(signal.SIGNAL, lambda *_: print("rank 0: own handler ran", flush=True))
jf.init()
r = jf.rank()
ring = dict(self_weight=0.5, src_weights={1 - r: 0.5}, dst_weights=[1 - r])
y = jf.neighbor_allreduce(jnp.ones(3), **ring)  # op #1: both joined
"""


def _signal_job(command: list, env: dict, tmp_path, signum: int) -> tuple:
    """Starts the ranks, sends ``signum`` to rank 0 once it is inside op #2's
    wait (or the sleep between ops); returns (the job, its output, when the
    signal was sent: CLOCK_MONOTONIC, the ranks' clock too)."""
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        pid_file = tmp_path / "pid"
        deadline = time.monotonic() + 200
        while not pid_file.exists() or not pid_file.read_text():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
            time.sleep(0.1)
        time.sleep(1.5)
        sent = time.monotonic()
        os.kill(int(pid_file.read_text()), signum)
        output = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            job.kill()
    return job, output, sent


SIGTERM_RANK = _SIGNAL_RANK_PRELUDE.replace("SIGNAL", "SIGTERM") + """
if r == 1:  # rank 0's op #2 waits for this one's
    if case == "own handler":
        time.sleep(4)
        jf.neighbor_allreduce(jnp.full(3, 2.0), **ring)
    else:  # until rank 0 has ended (a launcher may leave this one running)
        start = time.monotonic()
        while not os.path.exists(os.path.join(directory, "status.0")):
            assert time.monotonic() - start < 200
            time.sleep(0.1)
        os._exit(0)  # MPI_Finalize would wait for rank 0, gone without a word
    sys.exit(0)
with open(os.path.join(directory, "pid"), "w") as f:
    f.write(str(os.getpid()))
if case == "between ops":
    time.sleep(120)
y = jf.neighbor_allreduce(jnp.full(3, 4.0), **ring)
np.testing.assert_allclose(y, 3.0)
print("rank 0: op #2 done", flush=True)
"""


@pytest.mark.parametrize("case", ["in a wait", "between ops", "own handler"])
def test_sigterm_during_a_wait_says_what_it_waited_for_then_ends(tmp_path, case):
    """A launcher ending the job (prterun losing a host, Slurm's scancel) sends
    SIGTERM, then SIGKILL: the rank waiting for a peer says which op waits for
    what before it ends by SIGTERM; between ops, which op it ran last. A
    program's own SIGTERM handler is left to run."""
    import signal

    script = tmp_path / "rank.py"
    script.write_text(SIGTERM_RANK)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOG_TIMEOUT": "600",
           "PYTHONUNBUFFERED": "1"}
    # The shell keeps each rank's exit status (the launcher's words vary),
    # then ends as the rank did, so that the launcher ends the job.
    keep_status = (f'{sys.executable} "$@"; s=$?; '
                   f'echo $s > {tmp_path}/status.${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}; '
                   'if [ $s -gt 128 ]; then kill -$((s - 128)) $$; fi; exit $s')
    command = launcher.build_command(
        ["sh", "-c", keep_status, "sh", str(script), str(tmp_path), case], 2, env=env)
    job, output, sent = _signal_job(command, env, tmp_path, signal.SIGTERM)
    ended = time.monotonic() - sent
    report = ("jaxfog neighbor_allreduce (op #2 on rank 0): this process got SIGTERM (a "
              "launcher ending the job sends it) while waiting for the header from rank 1; "
              "it ends now")
    if case == "own handler":
        assert job.returncode == 0, output
        assert "rank 0: own handler ran" in output and "rank 0: op #2 done" in output, output
        assert "SIGTERM" not in output, output
        return
    between = ("jaxfog (rank 0): this process got SIGTERM (a launcher ending the job sends "
               "it) between ops, none waiting; its last: op #1 (neighbor_allreduce); it ends now")
    # The rank's own status, not the launcher's: hydra's mpiexec once returned 0
    # (CI, 2026-11-29) for a rank that ended by SIGTERM as the other exited 0.
    assert "op #2 done" not in output, output
    assert (report in output) == (case == "in a wait"), output
    assert (between in output) == (case == "between ops"), output
    assert (tmp_path / "status.0").read_text().strip() == str(128 + signal.SIGTERM), output
    assert ended < SOON, output


@mpi_test(nprocs=(3,), env={"JAXFOG_TIMEOUT": "300"}, timeout=240, alone=True)
def test_a_rank_that_left_after_a_failed_op_is_named_so():
    """Rank 2 ends; rank 1's op #2, which waits for it, fails; rank 1 ends too.
    Rank 0's op #3 waits for rank 1: its error says rank 1 had failed, not
    that the program called the op on some ranks only."""
    import jax.numpy as jnp
    import pytest

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    chain = {0: dict(src_weights={1: 0.5}, dst_weights=[]),  # 2 -> 1 -> 0
             1: dict(src_weights={2: 0.5}, dst_weights=[0]),
             2: dict(src_weights={}, dst_weights=[1])}[r]
    jf.neighbor_allreduce(jnp.ones(3), self_weight=0.5, **chain)  # op #1 everywhere
    if r == 1:
        with pytest.raises(Exception, match="op #2 on rank 1.*rank 2 has left"):
            jf.neighbor_allreduce(jnp.ones(3), self_weight=0.5, **chain).block_until_ready()
    elif r == 0:
        jf.neighbor_allreduce(jnp.ones(3), self_weight=0.5, **chain)  # rank 1 sent it
        with pytest.raises(Exception) as failure:
            jf.neighbor_allreduce(jnp.ones(3), self_weight=0.5, **chain).block_until_ready()
        assert ("(op #3 on rank 0): rank 1 has left: it called jaxfog.shutdown() after its "
                "op #2 (neighbor_allreduce) on this communicator, and this op waits for it. "
                "It never called this op: an op of its had failed") in str(failure.value)
    jf.shutdown()


SIGINT_RANK = _SIGNAL_RANK_PRELUDE.replace("SIGNAL", "SIGINT") + """
if r == 1:
    if case == "in a wait":  # never joins op #2: waits until rank 0 is done
        start = time.monotonic()
        while not os.path.exists(os.path.join(directory, "done")):
            assert time.monotonic() - start < 200
            time.sleep(0.1)
        os._exit(0)  # MPI_Finalize would wait for rank 0's abandoned op
    if case == "own handler":
        time.sleep(4)  # rank 0's op #2 waits through its SIGINT
    np.testing.assert_allclose(jf.neighbor_allreduce(jnp.full(3, 2.0), **ring), 3.0)
    sys.exit(0)
with open(os.path.join(directory, "pid"), "w") as f:
    f.write(str(os.getpid()))
try:
    if case == "between ops":
        time.sleep(120)
    y = jf.neighbor_allreduce(jnp.full(3, 4.0), **ring)
    np.testing.assert_allclose(y, 3.0)
    print("rank 0: op #2 done", flush=True)
except KeyboardInterrupt as error:
    print(f"rank 0: KeyboardInterrupt at {time.monotonic():.3f}: {error!r}", flush=True)
    if case == "between ops":  # as before: the ops go on
        np.testing.assert_allclose(jf.neighbor_allreduce(jnp.full(3, 4.0), **ring), 3.0)
        print("rank 0: op #2 done after it", flush=True)
open(os.path.join(directory, "done"), "w").close()
if case == "in a wait":
    os._exit(0)  # the communicator is unusable after an interrupted op
"""


@pytest.mark.parametrize("case", ["in a wait", "between ops", "own handler"])
def test_sigint_during_a_wait_is_a_keyboard_interrupt_naming_the_op(tmp_path, case):
    """Ctrl-C while an op waits for a peer that never comes: a KeyboardInterrupt
    naming the op at once, not at JAXFOG_TIMEOUT (Python alone would run its
    handler only once the op returns). Between ops, Python's plain
    KeyboardInterrupt, and the ops go on. A program's own SIGINT handler is
    left to run (the op then waits on)."""
    import signal

    script = tmp_path / "rank.py"
    script.write_text(SIGINT_RANK)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOG_TIMEOUT": "600",
           "PYTHONUNBUFFERED": "1"}
    command = launcher.build_command([sys.executable, str(script), str(tmp_path), case], 2,
                                     env=env)
    job, output, sent = _signal_job(command, env, tmp_path, signal.SIGINT)
    # In a wait, both ranks end with os._exit (no MPI_Finalize, which would wait
    # for the abandoned op): the launcher takes that for a failure (hydra SIGKILLs
    # the other rank if it has not ended yet, status 9, 3 runs in 8 here; Open
    # MPI's prterun exits with status 1), so only the other cases end cleanly.
    assert job.returncode == 0 or case == "in a wait", output
    caught = [line for line in output.splitlines() if "rank 0: KeyboardInterrupt at" in line]
    if case == "own handler":
        assert "rank 0: own handler ran" in output and "rank 0: op #2 done" in output, output
        assert not caught and "SIGINT" not in output, output
        return
    assert len(caught) == 1, output
    at, error = caught[0].split("rank 0: KeyboardInterrupt at ")[1].split(": ", 1)
    assert float(at) - sent < 3, output  # at once, not at the timeout
    if case == "between ops":
        assert error == "KeyboardInterrupt()", output
        assert "rank 0: op #2 done after it" in output, output
        return
    assert error == (
        'KeyboardInterrupt("jaxfog neighbor_allreduce (op #2 on rank 0): interrupted (SIGINT) '
        "while waiting for the header from rank 1; its messages are abandoned half-way, so "
        "jaxfog's communication in this process may be unusable now: end the program\")"), \
        output
    assert "op #2 done" not in output, output


@mpi_test(nprocs=(3,), env={"JAXFOG_TIMEOUT": "300"}, timeout=240, alone=True)
def test_window_ops_towards_a_rank_that_left_fail_at_once_naming_it():
    """Rank 2 shuts down (its goodbye, then the collective free of its window,
    where it waits for the others): a put, an accumulate, a get or a mutex
    towards it fails at once naming the op and the rank; towards rank 1, the
    window works on."""
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T

    jf.init(topology=T.fully_connected(3))
    r = jf.rank()
    jf.win_create(jnp.zeros(4), "w", zero_init=True)
    if r == 2:
        jf.shutdown()
        return
    time.sleep(2)  # rank 2's goodbye has arrived
    left = ("rank 2 has left: it called jaxfog.shutdown(); its window goes with it, so jaxfog "
            "accesses it no more")
    calls = {
        "win_put (rank {r} to rank 2)":
            lambda: jf.win_put(jnp.ones(4), "w", dst_weights={2: 1.0}),
        "win_accumulate (rank {r} to rank 2)":
            lambda: jf.win_accumulate(jnp.ones(4), "w", dst_weights={2: 1.0}),
        "win_get (rank {r} from rank 2)":
            lambda: jf.win_get("w", src_weights={2: 1.0}),
        "win_mutex (rank {r} taking the mutex of rank 2)":
            lambda: jf.win_mutex("w", ranks=[2]).__enter__(),
    }
    for op, call in calls.items():
        start = time.monotonic()
        with pytest.raises(Exception) as failure:
            jax_block(call())
        assert time.monotonic() - start < 10, op
        assert f"jaxfog {op.format(r=r)}: {left}" in str(failure.value), str(failure.value)
    # Between the two that stay, the window works as before.
    other = 1 - r
    pair = dict(self_weight=0.5, src_weights={other: 0.5}, dst_weights=[other])
    jf.neighbor_allreduce(jnp.ones(1), **pair)  # a barrier of the two
    jf.win_put(jnp.full(4, float(r + 1)), "w", dst_weights={other: 1.0})
    jf.neighbor_allreduce(jnp.ones(1), **pair)
    y = jf.win_update(jnp.zeros(4), "w", self_weight=0.0, src_weights={other: 1.0})
    np.testing.assert_allclose(y, float(other + 1))
    jf.shutdown()


def jax_block(value):
    """Waits for a dispatched value (an op's error surfaces here)."""
    import jax

    return jax.block_until_ready(value)
