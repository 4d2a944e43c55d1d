"""``benchmarks/bench_gpu.py``'s exchange part on CPU arrays: the code the GPU
check runs (the staged floor on pinned host memory included) must not first
run on a GPU machine, where device time is scarce."""

from __future__ import annotations

import json
import subprocess
import sys
from paths import REPO

ROOT = REPO


def test_exchange_part_runs_on_cpu_with_a_pinned_floor(tmp_path):
    sizes = [1024, 65536]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"),
                          "--part", "exchange", "--platform", "cpu", "--sizes",
                          *map(str, sizes), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "exchange_gpu.json").read_text())
    assert [(r["backend"], r["ranks"], r["bytes"]) for r in rows] == [
        ("cpu", 2, n) for n in sizes]
    for r in rows:
        # The floor's host buffers are page-locked, as staging's are.
        assert r["host_memory"] == "pinned_host"
        for key in ("copy_ms", "host_round_trip_ms", "allgather_ms",
                    "neighbor_allgather_ms", "d2h_ms", "host_allgather_ms", "h2d_ms"):
            assert 0 < r[key] < 1000, (key, r)
    table = (tmp_path / "exchange_gpu.md").read_text()
    assert "| D2H pinned (ms) |" in table
    floor_rows = [line for line in table.splitlines() if line.startswith("| 2 | ")]
    assert len(floor_rows) == len(sizes)
    for line, r in zip(floor_rows, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        floor = r["d2h_ms"] + r["host_allgather_ms"] + r["h2d_ms"]
        assert float(cells[5]) == round(floor, 3)
        assert float(cells[7]) == round(r["allgather_ms"] / floor, 2) > 0


def test_simulate_part_runs_on_cpu_with_a_tiled_column(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"),
                          "--part", "simulate", "--platform", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "simulate_cpu.json").read_text())["rows"]
    assert [r["graph"] for r in rows] == ["exponential", "ring", "one-peer", "regular4"]
    assert [r["degree"] for r in rows] == [3, 2, 1, 4]
    for r in rows:
        assert r["n"] == 5 and r["d"] == 1000
        for key in ("simulate_ms", "tiled_ms", "bound_ms", "dense_ms"):
            assert 0 < r[key] < 1000, (key, r)
    assert "| tiled (ms) | tiled % of bound |" in (tmp_path / "simulate_cpu.md").read_text()
