"""setup.py's build of the FFI library: a folder built once is rebuilt when the
MPI, compiler, jaxlib or CUDA/NCCL detection changed (it used to keep the first
MPI's library whatever ``JAXFOG_MPICXX`` said), and the MPI is linked by path."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

from jaxfog import ffi
from paths import REPO



@pytest.fixture(scope="module")
def build():
    """setup.py's namespace, without running setup()."""
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: None
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        return runpy.run_path(str(REPO / "setup.py"), run_name="jaxfog_setup")
    finally:
        setuptools.setup = real
        os.chdir(cwd)


INFO = {"mpicxx": "/opt/mpi/bin/mpicxx", "mpi_flags": ["-I/opt/mpi/include", "-lmpi"],
        "mpi_libraries": {}, "cuda_home": None, "cudart": None, "nccl_include": None,
        "cuda_built": False, "nccl_built": False}


def test_fingerprint_follows_mpi_compiler_jaxlib_and_cuda(build):
    fingerprint = build["build_fingerprint"]
    base = fingerprint(INFO, jaxlib_version="0.10.2", compiler=["g++"])
    assert base == fingerprint(dict(INFO), jaxlib_version="0.10.2", compiler=["g++"])
    changed = [
        {**INFO, "mpicxx": "/usr/bin/mpicxx.openmpi"},
        {**INFO, "mpi_flags": ["-I/opt/mpi/include", "-lmpi", "-lmpi_cxx"]},
        {**INFO, "mpi_libraries": {"mpi": "/usr/lib/libmpi.so"}},
        {**INFO, "cuda_built": True, "cuda_home": "/usr/local/cuda"},
        {**INFO, "nccl_include": "/x/nccl/include"},
    ]
    for info in changed:
        assert fingerprint(info, jaxlib_version="0.10.2", compiler=["g++"]) != base, info
    assert fingerprint(INFO, jaxlib_version="0.11.2", compiler=["g++"]) != base
    assert fingerprint(INFO, jaxlib_version="0.10.2", compiler=["clang++"]) != base


def test_fingerprint_ignores_the_temporary_prefix_of_the_mpich_wheel(build, tmp_path):
    # pip's isolated builds put the mpich wheel into a new folder every time.
    def wheel_info(prefix):
        return {**INFO, "system_mpi": False, "mpicxx": f"{prefix}/bin/mpicxx",
                "mpi_flags": [f"-I{prefix}/include", f"-L{prefix}/lib", "-lmpi"],
                "mpi_libraries": {"mpi": f"{prefix}/lib/libmpi.so"}}

    fingerprint = build["build_fingerprint"]
    one, two = (fingerprint(wheel_info(tmp_path / name), jaxlib_version="0.10.2",
                            compiler=["g++"]) for name in ("env1", "env2"))
    assert one == two
    # A system MPI's folder is part of what was built (the library's rpath).
    system = [fingerprint({**wheel_info(tmp_path / name), "system_mpi": True},
                          jaxlib_version="0.10.2", compiler=["g++"])
              for name in ("env1", "env2")]
    assert system[0] != system[1]


def test_rebuild_decision(build, tmp_path):
    needs_rebuild, fingerprint = build["needs_rebuild"], "ab" * 32
    library = tmp_path / "libjaxfog_ffi.so"
    assert not needs_rebuild(library, fingerprint)  # nothing built: a normal build
    library.write_bytes(b"\x7fELF...{\"builder\": \"setuptools\"}...")
    assert needs_rebuild(library, fingerprint)  # built before fingerprints existed
    library.write_bytes(b"\x7fELF...{\"fingerprint\": \"" + fingerprint.encode() + b"\"}...")
    assert not needs_rebuild(library, fingerprint)
    assert needs_rebuild(library, "cd" * 32)


def test_installed_library_carries_its_fingerprint(build):
    info = ffi.build_info()
    if info.get("builder") != "setuptools" or "fingerprint" not in info:
        pytest.skip("the installed library was not built by this setup.py")
    assert build["built_fingerprint"](ffi.LIBRARY_PATH) == info["fingerprint"]


def _build_probe(build, tmp_path: Path, mpicxx: str, monkeypatch) -> Path:
    """Runs setup.py's build_ext on a one-file stand-in for the FFI library
    (its build info and nothing else) with ``JAXFOG_MPICXX=mpicxx``."""
    source = tmp_path / "probe.cc"
    if not source.exists():  # a test may write its own
        source.write_text('#include "build_info.h"\n'
                          'extern "C" const char* probe_info() { return JAXFOG_BUILD_INFO; }\n')
    monkeypatch.setenv("JAXFOG_MPICXX", mpicxx)
    monkeypatch.setenv("JAXFOG_NO_CUDA", "1")
    extension = setuptools.Extension(build["FFI_EXT_NAME"], sources=[str(source)],
                                     language="c++")
    command = build["BuildFfi"](setuptools.Distribution({"name": "probe",
                                                         "ext_modules": [extension]}))
    command.build_lib, command.build_temp = str(tmp_path / "lib"), str(tmp_path / "temp")
    command.ensure_finalized()
    command.run()
    return Path(command.get_ext_fullpath(build["FFI_EXT_NAME"]))


def test_a_second_build_with_another_mpicxx_rebuilds(build, tmp_path, monkeypatch):
    monkeypatch.delenv("JAXFOG_MPICXX", raising=False)
    try:
        first = build["_find_mpicxx"]()
    except RuntimeError as err:
        pytest.skip(str(err))
    # Another wrapper: the same MPI behind another path is enough to differ.
    second = tmp_path / "bin" / "mpicxx"
    second.parent.mkdir()
    second.write_text(f'#!/bin/sh\nexec "{first}" "$@"\n')
    second.chmod(second.stat().st_mode | stat.S_IXUSR)
    library = _build_probe(build, tmp_path, first, monkeypatch)
    assert f'"mpicxx": "{first}"'.encode() in library.read_bytes()
    library = _build_probe(build, tmp_path, str(second), monkeypatch)
    assert f'"mpicxx": "{second}"'.encode() in library.read_bytes(), \
        "the library of the first build was kept"
    # Nothing changed: no rebuild (the library is not touched).
    before = library.stat().st_mtime_ns
    _build_probe(build, tmp_path, str(second), monkeypatch)
    assert library.stat().st_mtime_ns == before


def test_mpi_libraries_are_linked_by_path(build, tmp_path):
    mpi = tmp_path / "mpi" / "lib"
    mpi.mkdir(parents=True)
    (mpi / "libmpi.so").write_text("")
    found = build["_mpi_library_paths"]([str(tmp_path / "none"), str(mpi)], ["mpi", "pthread"])
    assert found == {"mpi": str(mpi / "libmpi.so")}  # -lpthread stays a -l


# --- what the library exports -------------------------------------------------

def _exports(library: Path) -> list[tuple[str, str]]:
    """(type, demangled name) of every symbol the library defines for others
    (nm's type ``u`` is a GNU_UNIQUE symbol: one copy per process)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is needed: the linker that built jaxfog has it")
    out = subprocess.run([nm, "-D", "--defined-only", "-C", str(library)], check=True,
                         capture_output=True, text=True).stdout
    return [tuple(line.split(None, 2)[1:]) for line in out.splitlines() if line.strip()]


def _leaks(exports: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(kind, name) for kind, name in exports
            if kind == "u" or "std::" in name or not name.startswith("jaxfog_")]


def test_installed_library_exports_only_its_entry_points():
    exports = _exports(ffi.LIBRARY_PATH)
    assert not _leaks(exports), _leaks(exports)[:20]
    names = {name for _, name in exports}
    assert {"jaxfog_build_info", "jaxfog_link_info"} <= names
    assert {op.target for op in ffi.op_table().values()} <= names


# Pulls in libstdc++'s streams and locale facets: what ml_dtypes ran inside
# jaxfog's copy of libstdc++ when that copy was exported.
_STATIC_PROBE = r'''
#include <locale>
#include <sstream>
#include <string>
#include "build_info.h"
extern "C" __attribute__((visibility("default"))) const char* jaxfog_probe(double x) {
  static std::string text;
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out << x << JAXFOG_BUILD_INFO;
  text = out.str();
  return text.c_str();
}
'''


def test_a_static_libstdcxx_build_exports_no_std_symbol(build, tmp_path, monkeypatch):
    """The GPU image's compiler links libstdc++ statically; -static-libstdc++
    does the same here. setup.py's link keeps that copy private."""
    monkeypatch.delenv("JAXFOG_MPICXX", raising=False)
    try:
        mpicxx = build["_find_mpicxx"]()
    except RuntimeError as err:
        pytest.skip(str(err))
    source = tmp_path / "probe.cc"
    source.write_text(_STATIC_PROBE)
    monkeypatch.setenv("LDFLAGS", "-static-libstdc++ -static-libgcc")
    library = _build_probe(build, tmp_path, mpicxx, monkeypatch)
    needed = subprocess.run(["readelf", "-d", str(library)], check=True, capture_output=True,
                            text=True).stdout
    assert "libstdc++" not in needed, "the probe did not link libstdc++ statically"
    exports = _exports(library)
    assert [name for _, name in exports] == ["jaxfog_probe"], _leaks(exports)[:20]
    # The hazard is real: the same object linked without setup.py's export
    # rules exports libstdc++, GNU_UNIQUE locale ids included.
    objects = list((tmp_path / "temp").rglob("probe.o"))
    bare = tmp_path / "bare.so"
    subprocess.run([mpicxx, "-shared", "-static-libstdc++", "-static-libgcc", *map(str, objects),
                    "-o", str(bare)], check=True, capture_output=True, text=True)
    leaked = _leaks(_exports(bare))
    assert any(kind == "u" for kind, _ in leaked) and any("std::" in n for _, n in leaked)


@pytest.mark.parametrize("first", ["jaxfog", "mpi4py"])
def test_library_is_loaded_locally_and_its_mpi_globally(first):
    """Only libmpi (for mpi4py and the MPI's plugins) enters the global symbol
    scope; the library itself stays local. Also when mpi4py loaded the MPI
    first (as after an isolated pip build, whose libmpi path is gone)."""
    probe = ("import ctypes, json\n"
             + ("from mpi4py import MPI\n" if first == "mpi4py" else "")
             + "from jaxfog import ffi\n"
             "ffi.library()\n"
             "scope = ctypes.CDLL(None)\n"
             "print(hasattr(scope, 'jaxfog_build_info'),\n"
             "      hasattr(scope, 'MPI_Get_library_version'))\n"
             "print(json.dumps(ffi.link_info()))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    first, links = done.stdout.splitlines()[:2]
    assert first == "False True", done.stdout
    links = json.loads(links)
    assert links["libmpi"] != "static" and "libmpi" in Path(links["libmpi"]).name
    assert links["libstdc++"] == "static" or "libstdc++" in links["libstdc++"]
