"""The package's layout: the layers of ``LAYERS`` (which docs/architecture.rst
shows), imports that only point down them, no cycles, no import of jaxfog
inside a function, every module importing alone, and one rule for what is
public."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

PACKAGE = REPO / "jaxfog"

# layers-begin
#: jaxfog's layers, bottom first: (what, modules). A module imports only from
#: its own layer and the layers below it; a name ending in ``.*`` is a whole
#: package. Every module of the package is in exactly one layer.
LAYERS = [
    ("pure data, errors, argument checks",
     ["jaxfog.errors", "jaxfog.topology.*", "jaxfog._validate", "jaxfog._interrupt"]),
    ("the C++ library, loaded with ctypes; NCCL's set-up",
     ["jaxfog.ffi._loader", "jaxfog.ffi", "jaxfog.ffi._nccl_setup"]),
    ("who the agents are: the MPI runtime, or the simulation being traced",
     ["jaxfog._context", "jaxfog.runtime", "jaxfog.traffic"]),
    ("what the ops share: arguments, plans, numerics, the primitives' machinery, the MPI call",
     ["jaxfog.ops._jax_compat", "jaxfog.ops._plan", "jaxfog.ops._args", "jaxfog.ops._numerics",
      "jaxfog.ops._window_spec", "jaxfog.ops._primitive_machinery", "jaxfog.ops.jit",
      "jaxfog.ops._nccl", "jaxfog.ops._sync_primitives", "jaxfog.ops._call"]),
    ("the rules ops share on each backend; the backend protocol, the backends, the choice",
     ["jaxfog.ops._windows_mpi", "jaxfog.simulation._clock", "jaxfog.simulation._tiled",
      "jaxfog.simulation._mixing", "jaxfog.simulation._windows", "jaxfog.ops._backends",
      "jaxfog.ops._backends.mpi", "jaxfog.simulation._backend", "jaxfog.ops._dispatch"]),
    ("the ops, each in one block: arguments, primitive, rules, MPI call, public functions",
     ["jaxfog.ops.neighbor", "jaxfog.ops.collective", "jaxfog.ops.hierarchical",
      "jaxfog.ops.process", "jaxfog.ops.window", "jaxfog.ops.nonblocking",
      "jaxfog.ops._training_loop", "jaxfog.ops"]),
    ("one program, any scale: simulated agents, a device mesh",
     ["jaxfog.mesh", "jaxfog.simulation.agents", "jaxfog.simulation"]),
    ("algorithms",
     ["jaxfog.compress.*", "jaxfog.optax.*", "jaxfog.asynchrony", "jaxfog.checkpoint",
      "jaxfog.elastic"]),
    ("the package's public names (lazy)",
     ["jaxfog"]),
    ("tools: the jaxfog command, the timeline, the multi-rank test harness, the machine line",
     ["jaxfog.timeline", "jaxfog.testing", "jaxfog._machine", "jaxfog.cli.*"]),
]
# layers-end


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


def _layer_of(module: str) -> int | None:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and (
                    module == member[:-2] or module.startswith(member[:-1]))):
                return index
    return None


def test_every_module_has_one_layer():
    unplaced = [m for m in _modules() if _layer_of(m) is None]
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"
    listed = [m for _, members in LAYERS for m in members if not m.endswith(".*")]
    assert len(listed) == len(set(listed)), "a module listed twice"
    assert not set(listed) - set(_modules()), f"no such module: {set(listed) - set(_modules())}"


def test_imports_point_down_the_layers():
    offenders = []
    for module, path in _modules().items():
        for name, line in _jaxfog_imports(ast.parse(path.read_text()), module):
            if name in _modules() and _layer_of(name) > _layer_of(module):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} "
                                 f"({LAYERS[_layer_of(module)][0]}) imports {name} "
                                 f"({LAYERS[_layer_of(name)][0]})")
    assert not offenders, "\n".join(offenders)


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


_IMPORT_ALONE = """
import importlib, os, sys, traceback
import jax, numpy  # what every module imports, once: each child imports jaxfog afresh
for name in sys.stdin.read().split():
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    status = os.waitpid(pid, 0)[1]
    if status:
        print(f"FAILED {name} (status {status})", flush=True)
"""


def test_every_module_imports_alone():
    """Each module first, in a process of its own, forked from one that has
    imported only JAX and numpy (what starting an interpreter and importing
    those would cost each module 66 times over)."""
    names = sorted(_modules())
    run = subprocess.run([sys.executable, "-c", _IMPORT_ALONE], input=" ".join(names),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "FAILED" not in run.stdout, run.stdout + run.stderr[-4000:]


def test_public_names_resolve_and_backends_implement_every_op():
    import jaxfog
    import jaxfog.ops
    from jaxfog.ops import _backends as backends
    from jaxfog.ops._backends import mpi
    from jaxfog.simulation._backend import SimulatedBackend

    for name in jaxfog.__all__:
        assert getattr(jaxfog, name) is not None, name
    for name in jaxfog.ops.__all__:
        assert callable(getattr(jaxfog.ops, name)), name
    assert set(jaxfog.ops.OPS) - set(jaxfog.__all__) == {"comm_rank", "comm_size"}
    ops = {name for name in dir(backends.Backend) if not name.startswith("_")}
    assert {"apply", "start", "wait", "poll"} <= ops
    for backend in (mpi.MpiBackend, SimulatedBackend):
        missing = {op for op in ops if not callable(getattr(backend, op, None))}
        assert not missing, f"{backend.__name__} lacks {sorted(missing)}"
        # One class per concern (Ops, TrainingLoop, SharedValues), each
        # implementing its protocol, and the backend their union.
        assert len(backend.__bases__) == len(backends.CONCERNS), backend.__bases__
        for concern, part in zip(backends.CONCERNS, backend.__bases__):
            names = {n for n in vars(concern) if not n.startswith("_")}
            missing = {n for n in names if not callable(getattr(part, n, None))}
            assert not missing, f"{part.__name__} ({concern.__name__}) lacks {sorted(missing)}"
    # Every op is one record, with its rule on simulated agents and one on MPI
    # processes (a call, or a run of its own); exactly the ops that start have
    # an MPI call to start.
    records = _op_records()
    assert len({op.name for op in records}) == len(records)
    for op in records:
        assert callable(op.simulated), op.name
        assert (op.mpi is None) != (op.mpi_run is None), op.name
    nonblocking = {op.removesuffix("_nonblocking") for op in jaxfog.ops.OPS
                   if op.endswith("_nonblocking")}
    assert {op.name for op in records if op.mpi is not None} == nonblocking - {"win_accumulate"}


def _op_records() -> list:
    import jaxfog.ops
    from jaxfog.ops._backends import Op

    return [value for family in sorted(set(jaxfog.ops.OPS.values()))
            for value in vars(importlib.import_module(f"jaxfog.ops.{family}")).values()
            if isinstance(value, Op)]


# new-op-begin
#: The files a new message op on an existing transport call touches (see "How
#: to add an op"): a pattern stands for the one file of the op's family or
#: concern. Every message op is named in each; no other code in the package
#: names them all.
NEW_OP_FILES = [
    "jaxfog/ffi/ops.h",  # its row of the op table
    "jaxfog/ffi/*_handlers.cc",  # its handler
    "jaxfog/ops/*.py",  # its block: arguments, primitive and rules, both backends' rules, record
    "jaxfog/ops/__init__.py",  # its public names
    "jaxfog/__init__.py",  # the same, for type checkers
    "tests/cases.py",  # a case, against numpy, on both backends
    "tests/ops/test_op_table.py",  # its code
    "tests/ops/test_ops_errors_mpi.py",  # its errors
    "docs/api.rst",  # its functions
    "docs/architecture.rst",  # its row in "Where each op lives"
]
# new-op-end


def _message_ops() -> list[str]:
    """The public ops with a handler of their own in the C++ op table."""
    import jaxfog.ops

    table = (PACKAGE / "ffi" / "ops.h").read_text()
    rows = re.findall(r"^\s*X\((\w+),", table, re.MULTILINE)
    return [op for op in rows if f"{op}_nonblocking" in jaxfog.ops.OPS
            and not op.startswith("win_")]


def _code(path: Path) -> str:
    """The code of a Python or C++ file, without its comments and docstrings."""
    text = path.read_text()
    if path.suffix != ".py":
        return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0].value.value = ""
    return ast.unparse(tree)


def test_a_new_op_touches_the_files_the_page_says():
    ops = _message_ops()
    assert {"neighbor_allreduce", "allreduce", "broadcast"} <= set(ops), ops
    for pattern in NEW_OP_FILES:
        for op in ops:
            naming = [path for path in sorted(REPO.glob(pattern))
                      if re.search(rf"\b{op}\b", path.read_text())]
            assert naming, f"{op} is in no file {pattern}"
    listed = {path for pattern in NEW_OP_FILES for path in REPO.glob(pattern)
              if "*" not in pattern}
    naming_all = [path for path in sorted(PACKAGE.rglob("*"))
                  if path.suffix in (".py", ".h", ".cc")
                  and all(re.search(rf"\b{op}\b", _code(path)) for op in ops)]
    unlisted = [str(path.relative_to(REPO)) for path in naming_all if path not in listed]
    assert not unlisted, f"code naming every op, not in NEW_OP_FILES: {unlisted}"
    page = (REPO / "docs" / "architecture.rst").read_text()
    assert f"touches {len(NEW_OP_FILES)} files" in page

def test_op_modules_import_no_backend_and_the_protocol_imports_none():
    """An op's rules travel in its record: the backends call them, and no op
    module reaches for a backend; the protocol knows no implementation."""
    backends = {"jaxfog.ops._backends.mpi", "jaxfog.simulation._backend"}
    import jaxfog.ops
    for family in sorted(set(jaxfog.ops.OPS.values())):
        module = f"jaxfog.ops.{family}"
        tree = ast.parse(_modules()[module].read_text())
        reached = {name for name, _ in _jaxfog_imports(tree, module)} & backends
        assert not reached, f"{module} imports {sorted(reached)}"
    protocol = "jaxfog.ops._backends"
    assert _jaxfog_imports(ast.parse(_modules()[protocol].read_text()), protocol) == []

def _documented_objects() -> list:
    """What docs/api.rst documents: the members of each ``automodule`` (those
    listed, else its ``__all__``) and each ``autofunction``, ``autoclass``,
    ``autoexception`` and ``autodata``."""
    lines = (PACKAGE.parent / "docs" / "api.rst").read_text().splitlines()
    current, found = "jaxfog", []
    for number, line in enumerate(lines):
        directive = re.fullmatch(r"\.\. (\w+):: (\S+)", line.strip())
        if directive is None:
            continue
        kind, name = directive.groups()
        if kind == "currentmodule":
            current = name
        elif kind == "automodule":
            module = importlib.import_module(name)
            members = next((option.split(":members:")[1] for option in lines[number + 1:number + 4]
                            if ":members:" in option), "")
            listed = [member.strip() for member in members.split(",") if member.strip()]
            found += [getattr(module, member) for member in listed or module.__all__]
        elif kind in ("autofunction", "autoclass", "autoexception", "autodata"):
            module_name, _, attribute = (name if name.startswith("jaxfog")
                                         else f"{current}.{name}").rpartition(".")
            found.append(getattr(importlib.import_module(module_name), attribute))
    return found


def test_every_module_is_private_or_public_and_documented():
    """The rule: a module whose dotted name has a part starting with ``_`` is
    private (no user imports it). Every other module is public: it lists its
    public names in ``__all__``, and docs/api.rst documents them, unless it is
    a package, whose ``__init__`` gathers names from its modules."""
    documented = {id(obj) for obj in _documented_objects()}
    offenders = []
    for module, path in _modules().items():
        if any(part.startswith("_") for part in module.split(".")):
            continue
        tree = ast.parse(path.read_text())
        if not any(isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__"
                                                        for target in node.targets)
                   for node in tree.body):
            offenders.append(f"{module}: public, with no __all__")
        elif path.name != "__init__.py":
            public = importlib.import_module(module).__all__
            missing = [name for name in public
                       if id(getattr(importlib.import_module(module), name)) not in documented]
            if missing:
                offenders.append(f"{module}: {missing} are not in docs/api.rst (document "
                                 "them, or underscore the module if no user imports it)")
    assert not offenders, "\n".join(offenders)

#: Modules that may ask which backend runs: the ops (where the backends live)
#: and what sits below them (the runtime's queries, the simulation's context,
#: the traffic counters), plus the simulation's entry point.
_MAY_ASK = ("jaxfog.ops", "jaxfog.simulation", "jaxfog.runtime", "jaxfog._context",
            "jaxfog.traffic")


def test_no_module_above_the_ops_branches_on_the_backend():
    """One program: what differs between backends is behind the Backend
    protocol (jaxfog.ops._backends); no other module imports a backend or
    asks whether it runs on simulated agents."""
    offenders = []
    for module, path in _modules().items():
        if any(module == m or module.startswith(m + ".") for m in _MAY_ASK):
            continue
        source = path.read_text()
        for name, line in _jaxfog_imports(ast.parse(source), module):
            if name.startswith("jaxfog.ops._backends") or name == "jaxfog._context":
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
        for number, text in enumerate(source.splitlines(), 1):
            if "_context.current(" in text or "_simulated(" in text or "_on_mpi(" in text:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {text.strip()}")
    assert not offenders, "\n".join(offenders)


def test_architecture_page_names_every_cpp_file():
    """docs/architecture.rst's table of the C++ library stays true: every
    source file is in it (the Python modules are, through LAYERS)."""
    page = (PACKAGE.parent / "docs" / "architecture.rst").read_text()
    missing = [p.name for p in sorted((PACKAGE / "ffi").glob("*.[ch]*"))
               if p.suffix in (".h", ".cc")
               and p.name not in page and f"{p.stem}.{{h,cc}}" not in page]
    assert not missing, f"not in docs/architecture.rst: {missing}"


def test_import_jaxfog_and_its_op_list_stay_light():
    """``import jaxfog`` (what ``jaxfog run`` imports) and the op list load
    neither JAX nor mpi4py (which initialises MPI); the first op used does."""
    code = ("import sys, jaxfog, jaxfog.ops\n"
            "names = dir(jaxfog) + list(jaxfog.__all__) + dir(jaxfog.ops)\n"
            "assert 'neighbor_allreduce' in names and 'win_put' in names, names\n"
            "bad = [m for m in ('jax', 'mpi4py') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "jaxfog.neighbor_allreduce\n"
            "assert 'jax' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_exception_class_is_in_errors_and_nothing_raises_a_bare_runtime_error():
    """One error family (jaxfog/errors.py, every class under JaxfogError): no
    module defines an exception class of its own or raises a bare
    RuntimeError/Exception, which ``except jaxfog.JaxfogError`` would miss."""
    import builtins

    builtin_errors = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}
    import jaxfog.errors as errors

    ours = {name for name, value in vars(errors).items()
            if isinstance(value, type) and issubclass(value, BaseException)
            and value.__module__ == errors.__name__}
    offenders = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ClassDef) and module != "jaxfog.errors":
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in node.bases}
                if bases & (builtin_errors | ours):
                    offenders.append(f"{where}: class {node.name} (define it in errors.py)")
            if isinstance(node, ast.Raise) and node.exc is not None:
                called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(called, ast.Name) and called.id in ("RuntimeError", "Exception"):
                    offenders.append(f"{where}: raise {called.id} (raise a JaxfogError)")
    assert not offenders, "\n".join(offenders)
    from jaxfog.errors import JaxfogError

    assert all(issubclass(getattr(errors, name), (JaxfogError, Warning)) for name in ours), ours


def test_type_checkers_see_every_lazy_name():
    """jaxfog, jaxfog.ops and jaxfog.simulation hand their names out lazily (``__getattr__``); their
    ``if TYPE_CHECKING:`` imports give type checkers the same names, from the
    modules that define them."""
    import jaxfog
    import jaxfog.ops
    import jaxfog.simulation

    for package, lazy in ((jaxfog, jaxfog._LAZY),
                          (jaxfog.ops, {name: f"jaxfog.ops.{module}"
                                        for name, module in jaxfog.ops.OPS.items()}),
                          (jaxfog.simulation, dict.fromkeys(jaxfog.simulation._NAMES,
                                                            "jaxfog.simulation.agents"))):
        tree = ast.parse(Path(package.__file__).read_text())
        [block] = [node for node in tree.body if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING"]
        seen = {}
        for node in block.body:
            assert isinstance(node, ast.ImportFrom), ast.unparse(node)
            for alias in node.names:
                seen[alias.name] = node.module
        assert set(seen) == set(lazy), (package.__name__, set(seen) ^ set(lazy))
        for name, module in seen.items():
            assert getattr(importlib.import_module(module), name) is getattr(package, name)


def test_architecture_page_names_every_python_module():
    """docs/architecture.rst's "Where things live" names every module of the
    package (as ``name.py`` or ``name``), and every ``*.py`` it names exists."""
    page = (PACKAGE.parent / "docs" / "architecture.rst").read_text()
    named = set(re.findall(r"``([^`]+)``", page))
    unnamed = [str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "__init__.py"
               and not any(path.name in n or n == path.stem for n in named)]
    assert not unnamed, f"modules the architecture page does not name: {unnamed}"
    files = {path.name for path in PACKAGE.parent.rglob("*.py")}
    absent = sorted(n for n in named if n.endswith(".py") and Path(n).name not in files)
    assert not absent, f"the architecture page names files that do not exist: {absent}"


def test_nothing_edits_sys_path():
    """Programs beside each other load with jaxfog.testing.load_module (tests,
    benchmarks, scripts, docs' snippets) and the ranks of a test launch find
    its helpers through PYTHONPATH: no file puts a folder on sys.path."""
    edit = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*(\+=|=[^=])")
    files = [p for folder in ("jaxfog", "tests", "benchmarks", "scripts", "examples", "docs")
             for p in (PACKAGE.parent / folder).rglob("*") if p.suffix in (".py", ".rst", ".sh")
             and "_build" not in p.parts]
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{n}" for p in files
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if edit.search(line) and "edit = re.compile" not in line]
    assert not offenders, offenders


#: Test folders that are not a part of the package: the docs and examples as a
#: user runs them, what the GPU machine runs (scripts/gpu_check.sh), and the
#: tree's own rules (this file).
_TEST_FOLDERS_BEYOND_THE_PACKAGE = {"examples", "gpu", "project"}


def test_test_folders_mirror_the_package():
    """Every test module sits in a folder named after the part of the package
    it tests (a subpackage, or a module of jaxfog/ itself), or in examples/, gpu/
    or project/; the shared helpers sit in tests/ and no test module does; no two
    test modules share a name (pytest imports them by name, and the MPI ranks
    by folder)."""
    tests = PACKAGE.parent / "tests"
    parts = {p.stem for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"test modules outside a folder: {loose}"
    folders = sorted(p.name for p in tests.iterdir()
                     if p.is_dir() and not p.name.startswith((".", "_")))
    unknown = [f for f in folders if f not in parts | _TEST_FOLDERS_BEYOND_THE_PACKAGE]
    assert not unknown, f"test folders that name no part of jaxfog: {unknown}"
    names = [p.name for p in tests.glob("*/test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    helpers = [p.name for p in tests.glob("*/*.py") if not p.name.startswith("test_")]
    assert not helpers, f"helpers belong in tests/ (shared), not in a folder: {helpers}"


#: The words the architecture page's "Words" replaced, and where each may
#: still appear (its deprecated alias, the test of that alias).
_REPLACED_WORDS = {
    r"\bticket": (),
    r"\bStartedCall\b|\bSimulatedStart\b|\bclass Pending\b|\bstruct Pending\b": (),
    r"\bAsync<": (),
    r"\bops\._agent\b|\b_agent\.py\b": (),
    r"JAXFOG_ASYNC_MIN_BYTES|\basync_min_bytes\b": (
        "jaxfog/runtime.py", "jaxfog/__init__.py", "docs/api.rst", "docs/environment.rst",
        "tests/runtime/test_runtime.py"),
}


def test_one_word_per_concept():
    """The words of the architecture page's glossary are the only ones: the
    words they replaced appear nowhere in the code, the tests or the docs, but
    for the deprecated aliases that keep users' programs working (and the
    benchmarks' committed results, which record what was measured then)."""
    root = PACKAGE.parent
    files = [p for folder in ("jaxfog", "tests", "docs", "benchmarks", "examples", "scripts")
             for p in (root / folder).rglob("*")
             if p.suffix in (".py", ".rst", ".cc", ".h", ".sh", ".md") and "_build" not in p.parts
             and p.name != "test_layout.py"
             and "results" not in p.relative_to(root).parts[:2]]  # records of the past
    files.append(root / "README.md")
    page = (root / "docs" / "architecture.rst").read_text()
    assert "\nWords\n-----\n" in page
    # The glossary itself names the words it replaced.
    glossary = range(page[:page.index("\nWords\n")].count("\n") + 1,
                     page[:page.index("\nWhere things live\n")].count("\n") + 2)
    offenders = []
    for pattern, allowed in _REPLACED_WORDS.items():
        word = re.compile(pattern, re.IGNORECASE if pattern == r"\bticket" else 0)
        for path in files:
            where = str(path.relative_to(root))
            if where in allowed:
                continue
            offenders += [f"{where}:{n}: {line.strip()}"
                          for n, line in enumerate(path.read_text().splitlines(), 1)
                          if word.search(line)
                          and not (where == "docs/architecture.rst" and n in glossary)]
    assert not offenders, offenders
