"""The documentation builds: the API reference is generated from the docstrings,
with warnings as errors (a docstring that does not render, a page or a
``jaxfog`` name that no longer exists fails here)."""

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
