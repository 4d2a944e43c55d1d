"""The documentation builds: the API reference is generated from the docstrings,
with warnings as errors (a docstring that does not render, a page or a
``jaxfog`` name that no longer exists fails here). Every ``JAXFOG_*``
variable is in the environment-variable reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_docs_build_without_warnings(tmp_path):
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                          "html", "-d", str(tmp_path / "doctrees"), str(DOCS),
                          str(tmp_path / "html")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (tmp_path / "html" / "architecture.html").exists()
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("jaxfog.neighbor_allreduce", "jaxfog.simulate", "jaxfog.optax.atc",
                 "jaxfog.optax.diloco"):
        assert f'id="{name}"' in api, name



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
