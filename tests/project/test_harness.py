"""The multi-rank harness itself: failures are reported per rank, deadlocks end."""

from __future__ import annotations

from pathlib import Path

from jaxfog.testing import run_mpi
from paths import TESTS

BODIES = TESTS / "mpi_bodies.py"


def test_success_exits_zero():
    result = run_mpi(3, BODIES, "succeeds", timeout=60)
    assert result.ok, result.report()


def test_failing_rank_is_reported_and_the_rest_aborted():
    result = run_mpi(3, BODIES, "fails_on_rank_1", timeout=60)
    assert not result.ok
    assert result.returncode is not None  # aborted, not killed at the timeout
    assert "===== rank 1 failed =====" in result.output
    assert "AssertionError: rank 1 disagrees" in result.output
    assert "rank 0 failed" not in result.output and "rank 2 failed" not in result.output
    assert result.seconds < 30


def test_every_failing_rank_shows_its_traceback():
    result = run_mpi(4, BODIES, "fails_everywhere", timeout=60)
    assert not result.ok
    for rank in range(4):
        assert f"===== rank {rank} failed =====" in result.output
        assert f"ValueError: bad value on rank {rank}" in result.output


def test_deadlock_is_killed_at_the_timeout():
    result = run_mpi(2, BODIES, "deadlocks", timeout=8)
    assert result.returncode is None
    assert 8 <= result.seconds < 20
    assert "timed out (killed)" in result.report()


def _alive(pid: int, grace: float = 5.0) -> bool:
    """Whether ``pid`` still runs ``grace`` seconds on (SIGKILL is not instant)."""
    import time

    deadline = time.monotonic() + grace
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":  # dead, not yet reaped by its new parent
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)


def test_processes_in_sessions_of_their_own_die_with_the_launch(tmp_path):
    """MPI launchers start ranks in new sessions, which a kill of the
    launch's own session misses: on the GPU machine, ranks of a timed-out
    launch outlived it and hung the next test. A grandchild in its own session
    must be gone once run_command returns, at the timeout and after a normal end."""
    import sys

    from jaxfog.testing import run_command

    for hang, timeout in (("; time.sleep(60)", 3), ("", 30)):
        pid_file = tmp_path / f"pid{timeout}"
        script = ("import subprocess, sys, time; "
                  "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                  "start_new_session=True, stdout=subprocess.DEVNULL, "
                  "stderr=subprocess.DEVNULL); "
                  f"open({str(pid_file)!r}, 'w').write(str(p.pid))" + hang)
        result = run_command([sys.executable, "-c", script], timeout=timeout)
        assert (result.returncode is None) == bool(hang), result.report()
        grandchild = int(pid_file.read_text())
        assert not _alive(grandchild), f"process {grandchild} outlived run_command"


# --- several bodies in one launch (tests/mpi_harness.py) -------------------------------

def _batched(names_and_timeouts, nprocs=2):
    """Runs the bodies in one launch; returns each one's outcome (missing: not run)."""
    import mpi_harness

    batch = [mpi_harness._Body(str(BODIES), name, (nprocs,), timeout, {}, False)
             for name, timeout in names_and_timeouts]
    mpi_harness._launch(batch, nprocs)
    return {body.name: mpi_harness._OUTCOMES.pop(body.key(nprocs), "not run")
            for body in batch}


def test_bodies_sharing_a_launch_each_start_afresh():
    outcomes = _batched([("leaves_float64_a_topology_and_a_variable", 60),
                         ("starts_afresh", 60), ("succeeds", 60)])
    assert outcomes == {"leaves_float64_a_topology_and_a_variable": None,
                        "starts_afresh": None, "succeeds": None}, outcomes


def test_a_failing_body_is_named_and_the_ones_after_it_run_later():
    outcomes = _batched([("succeeds", 60), ("fails_on_rank_1", 60), ("succeeds_too", 60)],
                        nprocs=3)
    assert outcomes["succeeds"] is None and outcomes["succeeds_too"] == "not run"
    failure = outcomes["fails_on_rank_1"]
    assert "(one launch ran succeeds, fails_on_rank_1, succeeds_too; 1 passed)" in failure
    assert "AssertionError: rank 1 disagrees" in failure


def test_a_body_that_hangs_fails_at_its_own_timeout():
    import time

    start = time.monotonic()
    outcomes = _batched([("succeeds", 60), ("deadlocks", 6), ("succeeds_too", 60)])
    assert time.monotonic() - start < 40  # not the launch's 126 s
    assert outcomes["succeeds"] is None and outcomes["succeeds_too"] == "not run"
    assert "deadlocks did not end within its timeout (6 s)" in outcomes["deadlocks"]
