"""The package's layout: every module imports alone, and jaxfog's modules
import each other without cycles and only at module level."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxfog"


@functools.cache
def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _jaxfog_imports(node: ast.AST, module: str) -> list[tuple[str, int]]:
    """(imported jaxfog module, line) for the imports directly in ``node``'s body."""
    package = module if (_modules()[module].name == "__init__.py") else module.rpartition(".")[0]
    found = []
    for statement in ast.walk(node) if isinstance(node, ast.FunctionDef) else node.body:
        if isinstance(statement, ast.Import):
            found += [(a.name, statement.lineno) for a in statement.names]
        elif isinstance(statement, ast.ImportFrom):
            base = statement.module or ""
            if statement.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - statement.level
                                                  + 1] + ([base] if base else []))
            for alias in statement.names:
                name = f"{base}.{alias.name}"
                found.append((name if name in _modules() else base, statement.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] == "jaxfog"]


def test_no_import_of_jaxfog_inside_functions():
    """Function-level imports of jaxfog modules would hide cycles."""
    offenders = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for name, line in _jaxfog_imports(node, module):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                                     f"{name}")
    assert not offenders, "\n".join(offenders)


def test_module_imports_have_no_cycle():
    modules = _modules()
    graph = {m: {name for name, _ in _jaxfog_imports(ast.parse(p.read_text()), m)
                 if name in modules and name != m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(path + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_every_module_imports_alone():
    """Each module in a fresh interpreter (two at a time: CI has two cores)."""
    names = sorted(_modules())
    failures = []
    for i in range(0, len(names), 2):
        runs = [(m, subprocess.Popen([sys.executable, "-c", f"import {m}"],
                                     stderr=subprocess.PIPE, text=True))
                for m in names[i:i + 2]]
        for m, run in runs:
            _, err = run.communicate(timeout=120)
            if run.returncode:
                failures.append(f"{m}:\n{err[-2000:]}")
    assert not failures, "\n".join(failures)


def test_public_names_resolve_and_backends_implement_every_op():
    import jaxfog
    import jaxfog.ops
    from jaxfog.ops import backends

    for name in jaxfog.__all__:
        assert getattr(jaxfog, name) is not None, name
    assert set(jaxfog._OPS) | set(jaxfog._WINDOW_OPS) == set(jaxfog.ops.__all__) - {
        "comm_rank", "comm_size"}
    ops = {name for name in dir(backends.Backend) if not name.startswith("_")}
    assert set(jaxfog._OPS) <= ops
    for backend in (backends.mpi.MpiBackend, backends.simulated.SimulatedBackend):
        missing = {op for op in ops if not callable(getattr(backend, op, None))}
        assert not missing, f"{backend.__name__} lacks {sorted(missing)}"


#: Modules that may ask which backend runs: the ops (where the backends live)
#: and what sits below them (the runtime's queries, the simulation's context,
#: the traffic counters), plus the simulation's entry point.
_MAY_ASK = ("jaxfog.ops", "jaxfog.sim", "jaxfog.runtime", "jaxfog._context", "jaxfog.traffic")


def test_no_module_above_the_ops_branches_on_the_backend():
    """One program: what differs between backends is behind the Backend
    protocol (jaxfog.ops.backends); no other module imports a backend or
    asks whether it runs on simulated agents."""
    offenders = []
    for module, path in _modules().items():
        if any(module == m or module.startswith(m + ".") for m in _MAY_ASK):
            continue
        source = path.read_text()
        for name, line in _jaxfog_imports(ast.parse(source), module):
            if name.startswith("jaxfog.ops.backends") or name == "jaxfog._context":
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
        for number, text in enumerate(source.splitlines(), 1):
            if "_context.current(" in text or "_simulated(" in text or "_on_mpi(" in text:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {text.strip()}")
    assert not offenders, "\n".join(offenders)
