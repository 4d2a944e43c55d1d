"""``@mpi_test``: a test whose body runs on N MPI ranks, launched from pytest."""

from __future__ import annotations

import inspect
from typing import Callable, Mapping, Sequence

import pytest

from jaxfog.testing import run_mpi

#: Rank counts every multi-rank test runs with by default: even, power of 2, odd.
DEFAULT_NPROCS = (2, 4, 5)
#: Runs on this many ranks send every message from the communication thread
#: (``JAXFOG_ASYNC_MIN_BYTES=0``); the others use the default for the machine, which
#: is inline on a machine with fewer than two cores per rank.
ALL_ASYNC_NPROCS = 2


def mpi_test(nprocs: Sequence[int] = DEFAULT_NPROCS, *, timeout: float = 120,
             env: Mapping[str, str] | None = None) -> Callable:
    """Turns ``body()`` into a pytest test run on each rank count in ``nprocs``.

    The body runs in every rank (it calls ``jaxfog.init()`` itself); the test
    fails, showing each failing rank's traceback, if any rank fails, and fails
    within ``timeout`` seconds if the ranks deadlock.
    """
    def decorate(body: Callable[[], None]) -> Callable:
        file = inspect.getsourcefile(body)

        @pytest.mark.parametrize("nprocs", nprocs)
        def test(nprocs: int) -> None:
            mode = {"JAXFOG_ASYNC_MIN_BYTES": "0"} if nprocs == ALL_ASYNC_NPROCS else {}
            result = run_mpi(nprocs, file, body.__name__, timeout=timeout,
                             env={**mode, **(env or {})})
            if not result.ok:
                pytest.fail(result.report(), pytrace=False)

        test.mpi_body = body
        test.__name__ = body.__name__
        test.__doc__ = body.__doc__
        return test

    return decorate
