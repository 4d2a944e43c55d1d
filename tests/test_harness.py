"""The multi-rank harness itself: failures are reported per rank, deadlocks end."""

from __future__ import annotations

from pathlib import Path

from jaxfog.testing import run_mpi

BODIES = Path(__file__).with_name("mpi_bodies.py")


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
