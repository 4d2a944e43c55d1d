"""Tests for ``jaxfog demo`` (jaxfog/cli/demo.py)."""

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from jaxfog.cli import _demo as demo  # noqa: E402
from jaxfog import topology as T  # noqa: E402


def _table(out):
    """{graph name: row fields} from the printed table."""
    rows = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 5 and "(" in fields[0]:
            rows[fields[0]] = fields
    return rows


def test_demo_main(tmp_path, capsys):
    png = tmp_path / "c.png"
    assert demo.main(["--out", png, "--steps", "20"]) == 0
    assert png.exists() and png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    rows = _table(out)
    assert rows["fully_connected(16)"][-1] == "1"
    assert rows["one_peer_exponential(16)"][-1] == "4"
    assert rows["one_peer(exponential(16))"][-1] == "4"
    # columns: name, period, max in-degree, spectral gap, steps
    assert rows["exponential(16)"][1:3] == ["1", "4"]
    assert rows["star(16)"][2] == "15"
    assert rows["one_peer_exponential(16)"][1:3] == ["4", "1"]
    assert float(rows["fully_connected(16)"][3]) == pytest.approx(1.0)
    assert {"ring(16)", "ring(16,style=1)", "mesh_grid_2d(16,4x4)",
            "symmetric_exponential(16)", "inner_outer_ring(16,4)"} <= set(rows)
    assert str(png) in out


def test_steps_to_tolerance_against_eigenvalues():
    # ring(8) is symmetric, so ||W^k - 11^T/n||_2 = |lambda_2|^k exactly
    topo = T.ring(8)
    sched = T.Schedule([topo])
    lam = 1 - topo.spectral_gap()
    expected = int(np.ceil(np.log(1e-6) / np.log(lam)))
    limit = demo.consensus_limit(sched)
    np.testing.assert_allclose(limit, np.full((8, 8), 1 / 8), atol=1e-12)
    k = demo.steps_to_tolerance(sched, limit, 1e-6, 10000)
    assert k in (expected - 1, expected, expected + 1)
    assert demo.steps_to_tolerance(sched, limit, 1e-6, 5) is None


def test_consensus_limit_row_stochastic_only():
    # row-stochastic, not doubly: pi is the left Perron vector
    sched = T.Schedule([T.from_weights([[0.5, 0.5], [0.25, 0.75]])])
    limit = demo.consensus_limit(sched)
    np.testing.assert_allclose(limit, [[1 / 3, 2 / 3], [1 / 3, 2 / 3]], atol=1e-12)
    errs = demo.consensus_errors(sched, limit, np.array([1.0, 0.0]), 5)
    assert errs[0] == 1.0 and np.all(np.diff(errs) < 0)
    with pytest.raises(ValueError, match="row-stochastic"):
        demo.consensus_limit(T.Schedule([T.from_weights([[0.5, 0.25], [0.5, 0.75]])]))
