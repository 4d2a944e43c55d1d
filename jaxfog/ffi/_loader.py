"""Loading the compiled FFI library and registering its handlers with XLA
(exported by :mod:`jaxfog.ffi`).

The library is opened ``RTLD_LOCAL``: nothing of it but its ``jaxfog_*`` entry
points is visible to other libraries (a global library that carries a static
libstdc++ crashed every process on a GPU image). Both this library and
``mpi4py`` must use one and the same ``libmpi``. When mpi4py is not loaded yet,
the ``libmpi`` this library was linked against (found through the build-time
rpath, e.g. a system Open MPI) is made global on its own, so that mpi4py and
the MPI's plugins adopt it. If that rpath is gone (a wheel built in pip's
temporary build environment), mpi4py loads its MPI first, the loader reuses it
for this library by soname, and it is made global then. Either way a version
check follows.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from jaxfog.errors import FfiLibraryError

#: Names another build of the FFI library to load instead of the installed one,
#: e.g. one compiled against a second MPI (``tests/ffi/test_openmpi.py`` runs the MPI
#: suites on Open MPI this way, beside the mpich wheel).
LIBRARY_ENV = "JAXFOG_FFI_LIBRARY"
LIBRARY_PATH = (Path(os.environ[LIBRARY_ENV]).resolve() if os.environ.get(LIBRARY_ENV)
                else Path(__file__).resolve().parent / "libjaxfog_ffi.so")


class OpSpec(NamedTuple):
    """One op of the library's op table (``jaxfog/ffi/ops.h``)."""

    name: str    #: e.g. ``"neighbor_allreduce"``
    code: int    #: its op code; a message op's code travels in message headers
    target: str  #: the XLA FFI handler the library exports, e.g. ``"jaxfog_rank"``
    #: the NCCL transport's handler that moves its data on GPU buffers, e.g.
    #: ``"jaxfog_nccl_exchange"``; "" where GPU buffers are staged through the host
    nccl_target: str
    #: whether it has start forms (``<target>_start``): an op with a
    #: ``*_nonblocking`` form, or the adjoint of one
    nonblocking: bool


@functools.cache
def op_table() -> dict[str, OpSpec]:
    """Every op the library exports a typed FFI handler for, by name."""
    entries = json.loads(library().jaxfog_op_table().decode())
    return {entry["name"]: OpSpec(entry["name"], entry["code"], entry["target"],
                                  entry["nccl_target"], entry["nonblocking"])
            for entry in entries}


def nccl_targets() -> list[str]:
    """The NCCL transport's handlers (``jaxfog/ffi/nccl_handlers.cc``) the op
    table names, each once; the library exports them where it has NCCL."""
    return list(dict.fromkeys(spec.nccl_target for spec in op_table().values()
                              if spec.nccl_target))


def build_info() -> dict[str, Any]:
    """What the library was built against (MPI wrapper, CUDA/NCCL detection)."""
    return json.loads(library().jaxfog_build_info().decode())


def _make_global(path: str) -> None:
    """Promotes an already loaded shared library (with its dependencies) to
    global symbol scope, loading nothing new."""
    if path and Path(path).resolve() != LIBRARY_PATH:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)


def _libmpi_global(lib: ctypes.CDLL) -> None:
    """Makes the libmpi ``lib`` uses global (the MPI's own plugins need it there)."""
    lib.jaxfog_link_info.restype = ctypes.c_char_p
    _make_global(json.loads(lib.jaxfog_link_info().decode())["libmpi"])


def link_info() -> dict[str, str]:
    """How the library was linked: for each runtime (``libstdc++``, ``libmpi``,
    ``cudart`` when CUDA was built) ``"static"`` if the library carries its own
    copy, else the path of the shared library it uses."""
    files = json.loads(library().jaxfog_link_info().decode())
    return {name: "static" if path and Path(path).resolve() == LIBRARY_PATH else path or "?"
            for name, path in files.items()}


def mpi_tools() -> tuple[str | None, str | None]:
    """(mpicxx, mpiexec) of the MPI the library was built against, as they are
    now: the wrappers recorded at build time if they still exist, else, for the
    ``mpich`` wheel (pip builds in a temporary environment that it deletes),
    this environment's copies of that wheel's wrappers. None where there is none."""
    info = build_info()
    candidates = [Path(info["mpicxx"])] if info.get("mpicxx") else []
    if not info.get("system_mpi"):
        candidates += [Path(sysconfig.get_path("scripts")) / "mpicxx",
                       Path(sys.executable).parent / "mpicxx"]
    for mpicxx in candidates:
        if mpicxx.exists():
            # mpicxx.openmpi goes with mpiexec.openmpi
            mpiexec = mpicxx.with_name(mpicxx.name.replace("mpicxx", "mpiexec", 1))
            return str(mpicxx), str(mpiexec) if mpiexec.exists() else None
    return None, None


def _string(function, size: int = 8192) -> str:
    buffer = ctypes.create_string_buffer(size)
    if function(buffer, size) != 0:
        raise FfiLibraryError(f"{function.__name__} failed")
    return buffer.value.decode(errors="replace")


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded FFI library, with its C entry points typed."""
    if not LIBRARY_PATH.exists():
        if os.environ.get(LIBRARY_ENV):
            raise FfiLibraryError(f"{LIBRARY_ENV}={os.environ[LIBRARY_ENV]!r}: no such file")
        raise FfiLibraryError(
            f"jaxfog's FFI library is not built ({LIBRARY_PATH} is missing); "
            "install jaxfog with 'pip install .' or 'pip install -e .' from the source tree")
    lib = None
    if "mpi4py.MPI" not in sys.modules:
        try:
            lib = ctypes.CDLL(str(LIBRARY_PATH), mode=ctypes.RTLD_LOCAL)
        except OSError:
            pass  # its libmpi is not where it was built: let mpi4py find one
        else:
            _libmpi_global(lib)  # before mpi4py loads an MPI: it adopts this one
    from mpi4py import MPI  # noqa: F401

    if lib is None:
        lib = ctypes.CDLL(str(LIBRARY_PATH), mode=ctypes.RTLD_LOCAL)
        _libmpi_global(lib)  # mpi4py's, which the loader gave this library too
    lib.jaxfog_register_mpi_comm.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_double,
                                             ctypes.c_int64, ctypes.c_char_p, ctypes.c_int]
    lib.jaxfog_register_mpi_comm.restype = ctypes.c_int
    lib.jaxfog_release_comm.argtypes = [ctypes.c_int64]
    lib.jaxfog_release_comm.restype = ctypes.c_int
    f64s = i64s = ctypes.c_void_p
    lib.jaxfog_define_plan.argtypes = [ctypes.c_int64, f64s, ctypes.c_int64, i64s, i64s, f64s,
                                       ctypes.c_int64, i64s, i64s, f64s, ctypes.c_char_p,
                                       ctypes.c_int]
    lib.jaxfog_define_plan.restype = ctypes.c_int64
    lib.jaxfog_keep_freed_memory.argtypes = [ctypes.c_int64]
    lib.jaxfog_keep_freed_memory.restype = ctypes.c_int
    lib.jaxfog_set_comm_thread_min_bytes.argtypes = [ctypes.c_int64]
    lib.jaxfog_set_comm_thread_min_bytes.restype = None
    lib.jaxfog_set_scratch_keep_bytes.argtypes = [ctypes.c_int64]
    lib.jaxfog_set_scratch_keep_bytes.restype = None
    lib.jaxfog_set_staging_keep_bytes.argtypes = [ctypes.c_int64]
    lib.jaxfog_set_staging_keep_bytes.restype = None
    lib.jaxfog_comm_thread_min_bytes.restype = ctypes.c_int64
    lib.jaxfog_set_send_receipts.argtypes = [ctypes.c_int]
    lib.jaxfog_set_send_receipts.restype = None
    lib.jaxfog_handle_done.argtypes = [ctypes.c_float]  # the handle id's float32
    lib.jaxfog_handle_done.restype = ctypes.c_int
    lib.jaxfog_handles_discard.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    lib.jaxfog_handles_discard.restype = ctypes.c_int
    lib.jaxfog_timeline_start.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                          ctypes.c_int]
    lib.jaxfog_timeline_start.restype = ctypes.c_int
    lib.jaxfog_timeline_flush.argtypes = []
    lib.jaxfog_timeline_flush.restype = ctypes.c_int
    lib.jaxfog_mpi_library_version.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.jaxfog_mpi_library_version.restype = ctypes.c_int
    lib.jaxfog_mpi_query_thread.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    err: list[type[ctypes._SimpleCData[Any]]] = [ctypes.c_char_p, ctypes.c_int]
    lib.jaxfog_win_create.argtypes = [i64, ctypes.c_int, i64, ptr, ptr, ptr, i64, i64, i64,
                                      ctypes.c_double, *err]
    lib.jaxfog_win_fill.argtypes = [i64, ptr, i64, ctypes.c_int, *err]
    lib.jaxfog_win_query.argtypes = [i64, ptr, ctypes.POINTER(ctypes.c_double), *err]
    lib.jaxfog_win_mutex.argtypes = [i64, ptr, i64, ctypes.c_int, *err]
    for function in (lib.jaxfog_win_create, lib.jaxfog_win_fill, lib.jaxfog_win_query,
                     lib.jaxfog_win_mutex):
        function.restype = ctypes.c_int
    lib.jaxfog_win_free.argtypes = [ctypes.c_int64]
    lib.jaxfog_win_free.restype = ctypes.c_int
    lib.jaxfog_build_info.restype = ctypes.c_char_p
    lib.jaxfog_link_info.restype = ctypes.c_char_p
    lib.jaxfog_xla_ffi_api_version.argtypes = [ctypes.POINTER(ctypes.c_int)] * 2
    lib.jaxfog_xla_ffi_api_version.restype = None
    lib.jaxfog_op_table.restype = ctypes.c_char_p
    lib.jaxfog_traffic.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int]
    lib.jaxfog_traffic.restype = ctypes.c_int
    lib.jaxfog_nccl_id_bytes.restype = ctypes.c_int
    lib.jaxfog_nccl_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), *err]
    lib.jaxfog_nccl_unique_id.argtypes = [ctypes.c_char_p, *err]
    lib.jaxfog_register_nccl_comm.argtypes = [i64, ctypes.c_int, ctypes.c_double, i64,
                                              ctypes.c_char_p, ctypes.c_int, *err]
    lib.jaxfog_cuda_device_uuid.argtypes = [ctypes.c_int, ctypes.c_char_p, *err]
    lib.jaxfog_watch_peers.argtypes = [ctypes.c_int, ctypes.c_double, *err]
    lib.jaxfog_say_goodbye.argtypes = [ctypes.c_int, *err]
    lib.jaxfog_unwatch_peers.argtypes = err
    lib.jaxfog_catch_interrupts.argtypes = []
    lib.jaxfog_catch_interrupts.restype = ctypes.c_int
    lib.jaxfog_bound_exit.argtypes = [ctypes.c_double, ctypes.c_int, ctypes.c_int]
    lib.jaxfog_bound_exit.restype = ctypes.c_int
    for function in (lib.jaxfog_watch_peers, lib.jaxfog_say_goodbye, lib.jaxfog_unwatch_peers):
        function.restype = ctypes.c_int
    lib.jaxfog_drop_nccl_comm.argtypes = [i64]
    lib.jaxfog_drop_nccl_comm.restype = ctypes.c_int
    for function in (lib.jaxfog_nccl_load, lib.jaxfog_nccl_unique_id,
                     lib.jaxfog_register_nccl_comm, lib.jaxfog_cuda_device_uuid):
        function.restype = ctypes.c_int
    _check_same_mpi(lib)
    check_ffi_api_version(_ffi_api_version(lib), jaxlib_ffi_api_version(),
                          json.loads(lib.jaxfog_build_info().decode()).get("jaxlib"))
    return lib


def _ffi_api_version(lib: ctypes.CDLL) -> tuple[int, int]:
    major, minor = ctypes.c_int(-1), ctypes.c_int(-1)
    lib.jaxfog_xla_ffi_api_version(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def ffi_api_version() -> tuple[int, int]:
    """The XLA FFI API version (major, minor) the library was compiled against."""
    return _ffi_api_version(library())


def jaxlib_ffi_api_version() -> tuple[int, int] | None:
    """The XLA FFI API version of the running jaxlib: that of the FFI headers it
    ships (``XLA_FFI_API_MAJOR``/``MINOR`` in ``xla/ffi/api/c_api.h``), None
    if they cannot be read."""
    import re

    import jax

    try:
        text = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    except OSError:
        return None
    found = dict(re.findall(r"#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", text))
    if set(found) != {"MAJOR", "MINOR"}:
        return None
    return int(found["MAJOR"]), int(found["MINOR"])


def check_ffi_api_version(built: tuple[int, int], running: tuple[int, int] | None,
                          built_jaxlib: str | None) -> None:
    """Raises FfiLibraryError if XLA would refuse the library's handlers.

    XLA registers a handler whose FFI API has the framework's major version and
    a minor version no newer than the framework's (and not older than a minimum
    XLA does not publish; :func:`register_handlers` reports that case). Another
    major version changes the ABI; a newer minor one may use what this XLA lacks.
    """
    if running is None or (built[0] == running[0] and built[1] <= running[1]):
        return
    raise FfiLibraryError(_api_mismatch(built, running, built_jaxlib))


def _api_mismatch(built: tuple[int, int], running: tuple[int, int] | None,
                  built_jaxlib: str | None) -> str:
    import jaxlib

    def version(v: tuple[int, int] | None) -> str:
        return "?" if v is None else f"{v[0]}.{v[1]}"

    return (f"jaxfog's FFI library was built against jaxlib {built_jaxlib or '?'} "
            f"(XLA FFI API {version(built)}), but this is jaxlib {jaxlib.__version__} "
            f"(XLA FFI API {version(running)}), which does not accept its handlers: "
            f"rebuild jaxfog against this jaxlib, in this environment: 'pip install "
            f"--no-build-isolation --force-reinstall --no-deps .' in the source tree (with "
            f"setuptools, wheel and mpich installed; pip's isolated build would take the "
            f"newest jaxlib instead)")


#: Where each rank writes its op timeline (a Chrome trace / Perfetto JSON file);
#: read by ``jaxfog.init()``. See ``docs/guide/timeline.rst``.
TIMELINE_ENV = "JAXFOG_TIMELINE"


def start_timeline(rank: int) -> None:
    """Starts the op timeline if ``JAXFOG_TIMELINE`` names a file, else stops it.

    A file that cannot be written is a warning, not an error: the job runs on
    without a timeline.
    """
    path = os.environ.get(TIMELINE_ENV, "")
    error = ctypes.create_string_buffer(1024)
    if library().jaxfog_timeline_start(os.fsencode(path), rank, error, len(error)) != 0:
        warnings.warn(f"{TIMELINE_ENV}={path!r}: {error.value.decode(errors='replace')}; "
                      "no timeline is recorded", RuntimeWarning, stacklevel=3)


def flush_timeline() -> bool:
    """Writes the timeline recorded so far (``jaxfog.shutdown()`` does it too).

    Returns False, after a warning on stderr, if the file cannot be written;
    True also when no timeline records.
    """
    return library().jaxfog_timeline_flush() == 0


#: The fields of a row of the library's traffic table (``traffic.h``), in order.
TRAFFIC_FIELDS = ("calls", "messages", "bytes", "header_bytes")


def traffic(reset: bool = False) -> dict[int, tuple[int, ...]]:
    """This process's traffic counters by op code (rows with any call), then
    zeroed if ``reset``."""
    rows = 64
    table = (ctypes.c_int64 * (rows * len(TRAFFIC_FIELDS)))()
    fields = library().jaxfog_traffic(table, rows, int(reset))
    if fields != len(TRAFFIC_FIELDS):
        raise FfiLibraryError(f"the library counts {fields} traffic fields, Python expects "
                              f"{len(TRAFFIC_FIELDS)}: rebuild it")
    values = list(table)
    return {code: tuple(values[code * fields:(code + 1) * fields]) for code in range(rows)
            if values[code * fields]}


def mpi_library_version() -> str:
    """The version string of the MPI library the FFI library is linked to."""
    return _string(library().jaxfog_mpi_library_version).strip()


def _check_same_mpi(lib: ctypes.CDLL) -> None:
    from mpi4py import MPI

    def normal(text: str) -> str:  # some MPIs pad the string with NULs
        return " ".join(text.replace("\0", " ").split())

    ours = _string(lib.jaxfog_mpi_library_version)
    theirs = MPI.Get_library_version()
    if normal(ours) != normal(theirs):
        raise FfiLibraryError(
            "jaxfog's FFI library and mpi4py use different MPI libraries:\n"
            f"  jaxfog: {ours.splitlines()[0] if ours else '?'}\n"
            f"  mpi4py: {theirs.splitlines()[0] if theirs else '?'}\n"
            "rebuild jaxfog against mpi4py's MPI (JAXFOG_MPICXX, see docs/building.rst), or point "
            "mpi4py at jaxfog's MPI with MPI4PY_LIBMPI")


#: Set to 1, CPU ops run through the host-staging path of GPU arrays (with
#: memcpy standing in for the device copies), so CPU tests cover its code.
HOST_STAGING_ENV = "JAXFOG_HOST_STAGING"

def cuda_built() -> bool:
    """Whether the library has the CUDA paths (host staging of GPU arrays)."""
    return bool(build_info().get("cuda_built"))


def nccl_built() -> bool:
    """Whether the library has the NCCL transport."""
    return bool(build_info().get("nccl_built"))


@functools.cache
def register_handlers() -> None:
    """Registers the op table's handlers as custom-call targets; once per process.

    CPU: ``jaxfog_<op>`` (or its host-staged form under ``JAXFOG_HOST_STAGING=1``),
    a nonblocking op's start ``jaxfog_<op>_start``, and ``jaxfog_wait``.
    CUDA, when built: the same names, bound to the host-staged handlers, and
    the NCCL transport's own targets. XLA picks the handler by platform.
    """
    import jax

    lib = library()

    def register(name: str, function: Any, platform: str) -> None:
        try:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(function), platform=platform,
                                        api_version=1)
        except Exception as error:
            # E.g. a library older than the oldest FFI API this XLA supports.
            if "API version" not in str(error):
                raise
            message = _api_mismatch(ffi_api_version(), jaxlib_ffi_api_version(),
                                    build_info().get("jaxlib"))
            raise FfiLibraryError(f"{message}\n(XLA: {error})") from error

    staged = os.environ.get(HOST_STAGING_ENV, "") not in ("", "0")
    cuda = cuda_built()
    for op in op_table().values():
        register(op.target, getattr(lib, op.target + ("_host_staged" if staged else "")), "cpu")
        if op.nonblocking:  # the start (always staged through host scratch)
            register(op.target + "_start", getattr(lib, op.target + "_start"), "cpu")
        if cuda:
            register(op.target, getattr(lib, op.target + "_staged"), "CUDA")
            if op.nonblocking:
                register(op.target + "_start", getattr(lib, op.target + "_start_staged"),
                         "CUDA")
    register("jaxfog_wait", lib.jaxfog_wait, "cpu")
    if cuda:
        register("jaxfog_wait", lib.jaxfog_wait_staged, "CUDA")
    if nccl_built():
        for name in nccl_targets():
            register(name, getattr(lib, name), "CUDA")


def nccl_library_path() -> str:
    """The libnccl to open: ``JAXFOG_NCCL_LIBRARY``, else the nvidia-nccl wheel's,
    else "" (the loader's search path)."""
    chosen = os.environ.get("JAXFOG_NCCL_LIBRARY")
    if chosen:
        return chosen
    try:
        import nvidia.nccl
    except ImportError:
        return ""
    for root in getattr(nvidia.nccl, "__path__", []):
        candidate = Path(root) / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate)
    return ""


def load_nccl() -> int:
    """Opens libnccl (once per process); returns its version code (e.g. 23203).

    Raises FfiLibraryError if jaxfog was built without NCCL or none loads.
    """
    version = ctypes.c_int(0)
    error = ctypes.create_string_buffer(1024)
    if library().jaxfog_nccl_load(os.fsencode(nccl_library_path()), ctypes.byref(version),
                                  error, len(error)):
        raise FfiLibraryError(error.value.decode(errors="replace"))
    return version.value


def cuda_device_uuid(ordinal: int) -> str:
    """The UUID of CUDA device ``ordinal`` ("GPU-xxxxxxxx-xxxx-..." as nvidia-smi
    prints it). Raises FfiLibraryError with CUDA's reason where there is none
    (or jaxfog was built without CUDA)."""
    uuid, error = ctypes.create_string_buffer(16), ctypes.create_string_buffer(1024)
    if library().jaxfog_cuda_device_uuid(ordinal, uuid, error, len(error)):
        raise FfiLibraryError(error.value.decode(errors="replace"))
    h = uuid.raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (after :func:`load_nccl`)."""
    size = library().jaxfog_nccl_id_bytes()
    buffer = ctypes.create_string_buffer(max(size, 1))
    error = ctypes.create_string_buffer(1024)
    if library().jaxfog_nccl_unique_id(buffer, error, len(error)):
        raise FfiLibraryError(error.value.decode(errors="replace"))
    return buffer.raw[:size]
