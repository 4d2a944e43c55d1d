"""The example programs' and scripts' code, for the benchmarks that measure it,
without a ``sys.path`` edit (issue 46.6).

``example("train_digits")`` is ``examples/train_digits.py`` and
``script("netns_cluster")`` is ``scripts/netns_cluster.py``, each loaded by
file (``importlib``) under its own name in ``sys.modules``, as running it as
a script makes it importable: a second call gives the same module. While it
loads, its own imports of the modules beside it (``train_lm`` and
``straggler`` import ``train_digits``, as a script imports a file in its
folder) are looked for in its folder, after every other place, and loaded
the same way; nothing stays on ``sys.path`` or ``sys.meta_path``, so an
``import`` elsewhere never finds an example by accident.

This file sits beside the benchmarks, so ``python benchmarks/bench_x.py``
imports it as the script's neighbour.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = ROOT / "scripts"


class _Beside(importlib.abc.MetaPathFinder):
    """Finds a top-level module in ``folder``: last on ``sys.meta_path``, so only
    what no other finder has (installed packages, the standard library) comes
    from there."""

    def __init__(self, folder: Path):
        self.folder = str(folder)

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [self.folder])


@contextlib.contextmanager
def _beside(folder: Path) -> Iterator[None]:
    finder = _Beside(folder)
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _load(folder: Path, name: str) -> ModuleType:
    file = folder / f"{name}.py"
    module = sys.modules.get(name)
    if module is not None:  # loaded before (or imported by an example loaded before)
        if Path(getattr(module, "__file__", None) or "").resolve() != file:
            raise ImportError(f"a module named {name!r} is already imported, from "
                              f"{getattr(module, '__file__', None)}, not from {folder}")
        return module
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or not file.is_file():
        raise ModuleNotFoundError(f"no {name}.py in {folder}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: its own imports may refer to it
    try:
        with _beside(folder):
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (e.g. ``example("train_digits")``)."""
    return _load(EXAMPLES, name)


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (e.g. ``script("netns_cluster")``)."""
    return _load(SCRIPTS, name)
