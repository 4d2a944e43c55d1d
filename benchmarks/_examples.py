"""The example programs' and scripts' code, for the benchmarks that measure it,
without a ``sys.path`` edit: ``example("train_digits")`` is
``examples/train_digits.py`` and ``script("netns_cluster")`` is
``scripts/netns_cluster.py``, each loaded by :func:`jaxfog.testing.load_module`
(its neighbours importable while it loads, nothing left on ``sys.path``).

This file sits beside the benchmarks, so ``python benchmarks/bench_x.py``
imports it as the script's neighbour.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from jaxfog.testing import load_module

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = ROOT / "scripts"


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (e.g. ``example("train_digits")``)."""
    return load_module(EXAMPLES / f"{name}.py")


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (e.g. ``script("netns_cluster")``)."""
    return load_module(SCRIPTS / f"{name}.py")
