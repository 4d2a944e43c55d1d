"""The documentation builds: the API reference is generated from the docstrings,
with warnings as errors (a docstring that does not render, a page or a
``jaxfog`` name that no longer exists fails here). The README's quick start
prints what the README shows, and every ``JAXFOG_*`` variable is in the
environment-variable reference."""

from __future__ import annotations

import subprocess
import sys
from paths import DOCS



def test_docs_build_without_warnings(tmp_path):
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                          "html", "-d", str(tmp_path / "doctrees"), str(DOCS),
                          str(tmp_path / "html")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (tmp_path / "html" / "architecture.html").exists()
    api = (tmp_path / "html" / "api.html").read_text()
    # Every public name is in the reference (the lists are the packages'
    # own: jaxfog.__all__, jaxfog.ops.OPS, jaxfog.optax and compress __all__).
    import jaxfog
    import jaxfog.compress
    import jaxfog.optax

    names = ([f"jaxfog.{n}" for n in jaxfog.__all__ if n not in ("topology",)
              and not n.startswith("win_")]
             + [f"jaxfog.ops.window.{n}" for n, family in jaxfog.ops.OPS.items()
                if family == "window"]
             + [f"jaxfog.optax.{n}" for n in jaxfog.optax.__all__]
             + [f"jaxfog.compress.{n}" for n in jaxfog.compress.__all__ if n != "Groups"])
    missing = [name for name in names if f'id="{name}"' not in api]
    assert not missing, f"not in docs/api.rst: {missing}"


README = DOCS.parent / "README.md"


def _quickstart() -> tuple[str, list[float], str, list[float]]:
    """The README's quick start: (simulated program, its printed numbers, the
    MPI program, its printed numbers)."""
    import re

    section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    assert [lang for lang, _ in blocks] == ["python", "text", "python", "bash", "text"], blocks
    (_, simulated), (_, printed), (_, tail), (_, command), (_, printed_mpi) = blocks
    assert command.strip() == "jaxfog run -np 4 python quickstart.py"
    lines = simulated.rstrip().splitlines()
    assert lines[-2].startswith("x = jax.jit(jf.simulate("), lines[-2]  # "the last two lines"
    mpi = "\n".join(lines[:-2]) + "\n" + tail
    return simulated, _numbers(printed), mpi, _numbers(printed_mpi)


def _numbers(output: str) -> list[float]:
    """The numbers on the last line of ``output``."""
    import re

    return [float(v) for v in re.findall(r"-?\d+\.\d*", output.strip().splitlines()[-1])]


def test_readme_quickstart_prints_what_the_readme_shows(tmp_path):
    import os

    import numpy as np

    simulated, expected, mpi, expected_mpi = _quickstart()
    # This checkout's jaxfog, whichever one is installed.
    path = os.pathsep.join([str(DOCS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOG_TIMEOUT": "60", "PYTHONPATH": path}
    (tmp_path / "quickstart.py").write_text(simulated)
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    np.testing.assert_allclose(_numbers(run.stdout), expected, rtol=1e-5)

    (tmp_path / "quickstart.py").write_text(mpi)
    run = subprocess.run([sys.executable, "-m", "jaxfog.cli", "run", "-np", "4",
                          sys.executable, "quickstart.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    np.testing.assert_allclose(_numbers(run.stdout), expected_mpi, rtol=1e-5)


# C preprocessor macros that setup.py passes to the compiler: not environment variables.
_MACROS = {"JAXFOG_WITH_CUDA", "JAXFOG_WITH_NCCL", "JAXFOG_BUILD_INFO"}


def test_every_environment_variable_is_in_the_reference():
    import re

    root = DOCS.parent
    files = [root / "setup.py", *root.glob("scripts/*.sh")]
    for folder in ("jaxfog", "scripts", "tests", "benchmarks", "examples"):
        files += (root / folder).rglob("*.py")
    names = {name for f in files for name in re.findall(r"JAXFOG_[A-Z0-9_]*[A-Z0-9]",
                                                         f.read_text())} - _MACROS
    assert len(names) > 15, names
    reference = (DOCS / "environment.rst").read_text()
    missing = sorted(name for name in names if f"``{name}``" not in reference)
    assert not missing, f"not in docs/environment.rst: {missing}"
