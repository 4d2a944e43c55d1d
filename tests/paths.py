"""Where things are, for the test modules in the folders below this one
(each folder mirrors a part of the package; the helpers they share sit here)."""

from __future__ import annotations

from pathlib import Path

#: This folder: the shared helpers (on every rank's PYTHONPATH, see conftest.py).
TESTS = Path(__file__).resolve().parent
#: The repository.
REPO = TESTS.parent
EXAMPLES = REPO / "examples"
DOCS = REPO / "docs"
SCRIPTS = REPO / "scripts"
