"""Every page of ``docs/`` with Python on it runs, as a reader would run it.

A page's ``.. code-block:: python`` blocks, in order, are one program. What a
page leaves to the reader (a model, data, a loss) comes from hidden setup
blocks, RST comments the rendered page does not show::

    .. doc-snippet setup:
       params = {"w": jnp.zeros(3)}

``.. doc-snippet run: jaxfog run -np 4`` starts a new program, run on 4 MPI
processes instead of one plain ``python`` (``.. doc-snippet run: python`` starts
a new plain one): the blocks after it, up to the next such line, are that
program. A ``.. code-block:: text`` right after a Python block is the output
the page promises: the program must print it (numbers compared to 1e-5). The
README's Python is its quickstart, run both ways by ``tests/examples/test_docs.py``; the
install commands are what ``.ci/run`` runs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from typing import NamedTuple

import numpy as np
import pytest
from paths import DOCS, REPO

MARK = "doc-snippet"


class Program(NamedTuple):
    code: str             #: setup and code blocks, in page order
    command: list[str]    #: how to run it, before the program's file name
    output: list[str]     #: text blocks that follow a code block


def _indented(lines: list[str], start: int) -> tuple[str, int]:
    """The indented body that starts at ``lines[start]`` (blank lines kept), and
    the index after it."""
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end])).strip("\n") + "\n", end


def _command(words: list[str]) -> list[str]:
    if words[:2] == ["jaxfog", "run"]:
        return [sys.executable, "-m", "jaxfog.cli", *words[1:], sys.executable]
    assert words == ["python"], f"a {MARK} run line names jaxfog run or python, not {words}"
    return [sys.executable]


def parse(text: str) -> list[Program]:
    """The programs of a page: the blocks up to each ``run:`` line and after it."""
    lines = text.splitlines()
    programs: list[tuple[list[str], list[str], list[str]]] = [([], _command(["python"]), [])]
    last = None
    i = 0
    while i < len(lines):
        line = lines[i]
        code, _, output = programs[-1]
        if line.startswith(f".. {MARK} setup:"):
            body, i = _indented(lines, i + 1)
            code.append(body)
            continue
        if line.startswith(f".. {MARK} run:"):
            programs.append(([], _command(shlex.split(line.split(":", 1)[1])), []))
            if not programs[-2][0]:
                del programs[-2]
        elif line.startswith(".. code-block::"):
            language = line.split("::", 1)[1].strip()
            body, i = _indented(lines, i + 1)
            if language == "python":
                code.append(body)
            elif language == "text" and last == "python":
                output.append(body)
            last = language
            continue
        elif line.strip():
            last = None
        i += 1
    return [Program("\n".join(code), command, output) for code, command, output in programs
            if code]


PAGES = sorted(p for p in DOCS.rglob("*.rst") if ".. code-block:: python" in p.read_text())


def test_the_parser_reads_setup_run_and_output():
    programs = parse(textwrap.dedent("""\
        Title
        =====

        .. doc-snippet run: jaxfog run -np 2
        .. doc-snippet setup:
           a = 1

        .. code-block:: python

           print(a + 1)

           print(a + 2)

        .. code-block:: text

           2
           3

        Text.

        .. code-block:: text

           not output: no code block right before

        .. doc-snippet run: python

        .. code-block:: python

           b = 2
        """))
    assert programs == [
        Program("a = 1\n\nprint(a + 1)\n\nprint(a + 2)\n",
                [sys.executable, "-m", "jaxfog.cli", "run", "-np", "2", sys.executable],
                ["2\n3\n"]),
        Program("b = 2\n", [sys.executable], [])]


def _numbers(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", text)]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_runs(path, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOG_TIMEOUT": "60",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    for number, program in enumerate(parse(path.read_text())):
        script = tmp_path / f"program{number}.py"
        script.write_text(program.code)
        run = subprocess.run([*program.command, script.name], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (f"{path.name}, program {number}, does not run:\n"
                                     f"{program.code}\n{run.stdout[-3000:]}\n"
                                     f"{run.stderr[-3000:]}")
        printed = _numbers(run.stdout)
        for shown in program.output:
            assert _numbers(shown), f"{path.name}: an output block with no number to check"
            np.testing.assert_allclose(printed[:len(_numbers(shown))], _numbers(shown),
                                       rtol=1e-5, err_msg=run.stdout)
            printed = printed[len(_numbers(shown)):]
