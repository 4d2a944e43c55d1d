"""A pytest plugin for the GPU check (``-p pytest_progress``, scripts/ on the path).

pytest prints why a test failed only in its final summary, so a step killed at
its time limit loses every reason (the GPU machine's first training run ended
as ``..F.`` and nothing else). This plugin writes each test's outcome, time
and, on failure, its report the moment the test ends, and stamps the end of
the session, so the log shows how long the process then took to exit.
``--first-param-only`` keeps each test function's first parametrization.
"""

from __future__ import annotations

import sys
import time

_start = time.time()


def _say(text: str) -> None:
    sys.__stderr__.write(text + "\n")
    sys.__stderr__.flush()


def pytest_addoption(parser):
    parser.addoption("--first-param-only", action="store_true",
                     help="run each test function with its first parameters only (for "
                          "the MPI suites: the smallest rank count), to fit a time budget")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("first_param_only"):
        return
    seen, kept, dropped = set(), [], []
    for item in items:
        function = item.nodeid.split("[")[0]
        (dropped if function in seen else kept).append(item)
        seen.add(function)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_runtest_logreport(report):
    if report.when != "call" and not report.failed:
        return  # set-up and teardown that passed, or a skip mark: the summary has them
    _say(f"[progress {time.time() - _start:7.1f}s] {report.nodeid} {report.when} "
         f"{report.outcome.upper()} ({report.duration:.1f}s)")
    if report.failed:
        _say(report.longreprtext)
        for name, content in report.sections:
            if "stdout" in name or "stderr" in name:
                _say(f"--- {name} ---\n{content[-4000:]}")


def pytest_unconfigure(config):
    # The step that ran pytest prints its own end time: the difference is the exit.
    _say(f"[progress] pytest finished at {time.time():.3f} (epoch s); the process now exits")
