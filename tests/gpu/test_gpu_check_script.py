"""``scripts/gpu_check.sh`` on this CPU machine: the GPU check must fit one device
call (a global deadline, at most 8 files back, a log per stage written as it
goes), and a process that used jaxfog must exit within seconds
(``scripts/exit_probe.py``, which the check also runs on the GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxfog.testing import load_module
from paths import REPO

ROOT = REPO
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
DEFAULT = ["build", "gpu-tests", "exit", "mpi-suite", "bench-exchange", "bench-sim", "lm",
           "overlap", "training"]
LOGS = {"build": "build.log", "gpu-tests": "gpu.log", "exit": "gpu.log",
        "mpi-suite": "suites.log", "training": "suites.log", "bench-sim": "bench.log",
        "lm": "bench.log", "overlap": "bench.log",
        "bench-exchange": "bench.log"}
MAX_FILES = 8

exit_probe = load_module(ROOT / "scripts" / "exit_probe.py")


def _check(out: Path, *args: str, timeout: float,
           **env: str) -> tuple[subprocess.CompletedProcess, float]:
    full = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_NO_BUILD": "1",
            # This checkout's jaxfog, whichever is installed.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **env}
    start = time.monotonic()
    run = subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True,
                         timeout=timeout, start_new_session=True)
    return run, time.monotonic() - start


def _steps(text: str, kind: str) -> list[str]:
    return re.findall(rf"^== \[\d+s\] {kind} ([^\s:]+)", text, re.M)


def test_the_plan_runs_every_stage_in_priority_order(tmp_path):
    run, _ = _check(tmp_path, timeout=60, GPU_CHECK_PLAN="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.findall(r"^== \[\d+s\] stage (\S+)", run.stdout, re.M) == DEFAULT
    planned = _steps(run.stdout, "PLAN")
    assert planned[:3] == ["library-current", "info", "exported-symbols"]  # the crash check
    assert planned.index("gpu-tests") < planned.index("exit-nccl") < planned.index("mpi-suite")
    # Every step's limit fits the default 420 s deadline less the kill grace.
    limits = [int(x) for x in re.findall(r"^== \[\d+s\] PLAN \S+ \(limit (\d+) s\)", run.stdout,
                                         re.M)]
    assert limits and max(limits) <= 415
    # Per-test timeouts shorter than their step, with or without pytest-timeout.
    for line in re.findall(r"^== .*PLAN (?:gpu-tests|mpi-suite|training) .*$", run.stdout, re.M):
        limit = int(re.search(r"limit (\d+) s", line).group(1))
        per_test = int(re.search(r"(?:--timeout=|faulthandler_timeout=)(\d+)", line).group(1))
        assert per_test < limit, line
    assert not list(tmp_path.glob("*.md"))  # a plan writes no table
    # Every default stage has a time budget, and the budgets fit the deadline:
    # with the deadline alone, a slow stage took the later stages' time (the
    # 2026-11-27 run never reached training and gave lm 46 s).
    budgets = dict(re.findall(r"^== \[\d+s\] stage (\S+) \(budget (\d+) s\)$", run.stdout,
                              re.M))
    assert list(budgets) == DEFAULT
    assert all(int(b) > 0 for b in budgets.values())
    assert sum(int(b) for b in budgets.values()) <= 420
    # No step's limit exceeds its stage's budget.
    stage = None
    for line in run.stdout.splitlines():
        if match := re.match(r"== \[\d+s\] stage (\S+)", line):
            stage = match[1]
        elif match := re.match(r"== \[\d+s\] PLAN \S+ \(limit (\d+) s\)", line):
            assert int(match[1]) <= int(budgets[stage]), line
    # The GPU sizes are cut to fit: short benchmark grids, the MPI suites at one
    # rank count per test, the language model in both dtypes.
    for name, words in (("bench-exchange", "--short"), ("bench-sim", "--short"),
                        ("mpi-suite", "--first-param-only"),
                        ("training", "--first-param-only"),
                        ("lm-float32", "--dtype float32"), ("lm-bfloat16", "--dtype bfloat16")):
        assert re.search(rf"PLAN {name} \(limit \d+ s\): .*{words}", run.stdout), name
    run, _ = _check(tmp_path, "lm", timeout=60, GPU_CHECK_PLAN="1", GPU_CHECK_BUDGETS="0")
    assert re.search(r"^== \[\d+s\] stage lm$", run.stdout, re.M), run.stdout


def test_explicit_stages_and_unknown_ones(tmp_path):
    run, _ = _check(tmp_path, "nccl", "probe", timeout=60, GPU_CHECK_PLAN="1")
    assert run.returncode == 0
    assert re.findall(r"^== \[\d+s\] stage (\S+)", run.stdout, re.M) == ["nccl", "probe"]
    run, _ = _check(tmp_path, "no-such-stage", timeout=60)
    assert run.returncode == 2 and "unknown stage no-such-stage" in run.stdout


def test_a_tiny_deadline_ends_the_whole_check_in_time(tmp_path):
    """No argument, a 30 s deadline, on a CPU machine: the stages that need a
    GPU fail or are cut at the deadline, the rest are skipped and named, every
    stage has its log, and at most 8 files are written."""
    deadline = 30
    run, took = _check(tmp_path, timeout=deadline + 60, GPU_CHECK_DEADLINE=str(deadline))
    text = run.stdout
    assert took < deadline + 10, text  # the kill grace and the shell's own start
    assert run.returncode == 1, text  # cuda cannot start here: the check fails
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert 0 < len(files) <= MAX_FILES, files
    summary = (tmp_path / "summary.log").read_text()
    assert summary.strip().splitlines()[-1] == text.strip().splitlines()[-1]
    for stage in DEFAULT:
        log = (tmp_path / LOGS[stage]).read_text()
        assert f"stage {stage}" in log, stage
    skipped = _steps(text, "SKIP")
    assert skipped and "bench-exchange" in skipped, text
    assert f"skipped (deadline): {' '.join(skipped)}" in text
    for name in skipped:  # a skip says how much time was left
        assert re.search(rf"SKIP {name}: \d+ s left of the {deadline} s deadline", text)
    # The crash check ran first, and logged what it ran.
    build = (tmp_path / "build.log").read_text()
    assert "jaxfog " in build and "exported: std::" in build
    # A step cut at the deadline kept its output, and left no process behind
    # (MPI launches start sessions of their own, out of timeout's reach).
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    for name in re.findall(r"^== \[\d+s\] (\S+) TIMED OUT", text, re.M):
        assert f"step {name} ended at" in logs
    assert not _processes_with(f"OUT={tmp_path}")


def _processes_with(variable: str) -> list[str]:
    """Processes whose environment holds ``variable`` (NAME=value)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if variable.encode() in environ:
            found.append(pid)
    return found


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_process_that_ran_ops_exits_within_seconds(ranks):
    """From its last op (with one computation still in flight) to the end of
    the launch: jaxfog's shutdown, JAX's atexit hooks, MPI_Finalize."""
    result = exit_probe.measure(ranks=ranks, platform="cpu", timeout=120)
    lines, worst = exit_probe.report(result)
    assert result["rc"] == 0, result["output"]
    assert sorted(result["ranks"]) == [str(r) for r in range(ranks)], result["output"]
    for marks in result["ranks"].values():
        assert set(exit_probe.PHASES) <= set(marks), result["output"]
    assert worst < 8.0, "\n".join(lines)


def test_first_param_only_keeps_each_tests_smallest_rank_count():
    """The MPI suites' cut in the GPU check (scripts/pytest_progress.py)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "pytest_progress", "--first-param-only",
         "--collect-only", "-q", "-p", "no:cacheprovider", "tests/ops/test_ops_mpi.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), str(ROOT)])})
    assert run.returncode == 0, run.stdout + run.stderr
    ids = re.findall(r"^tests/ops/test_ops_mpi.py::(\w+)\[(\d+)\]$", run.stdout, re.M)
    functions = [name for name, _ in ids]
    assert len(functions) == len(set(functions)) >= 10
    assert dict(ids)["test_collectives"] == "2"
    assert dict(ids)["test_hierarchical_with_faked_machines"] == "4"
