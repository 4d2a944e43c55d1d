"""Build script: the C++ XLA FFI library (the package's metadata is pyproject.toml's).

The FFI library (``jaxfog/ffi/libjaxfog_ffi.so``) is compiled against
jaxlib's FFI headers and an MPI found as follows:

* ``JAXFOG_MPICXX=/path/to/mpicxx``: a system MPI (Open MPI, MPICH, Intel MPI).
  The ``mpich`` wheel is then not a runtime dependency; install mpi4py against
  the same MPI.
* otherwise the ``mpicxx`` of the ``mpich`` wheel in the (build) environment.

The GPU paths (host staging of CUDA buffers, the NCCL transport) are built when
a CUDA toolkit is found (``JAXFOG_CUDA_HOME``, ``CUDA_HOME``, ``CUDA_PATH``,
``/usr/local/cuda``; never derived from where ``nvcc`` is, which on some
machines is a wrapper script outside the toolkit) and, for NCCL, ``nccl.h``
(``JAXFOG_NCCL_HOME``, the toolkit, or the ``nvidia-nccl-cu13`` wheel, a build
requirement). The CUDA runtime is linked statically and libnccl is opened at
run time, so the same library loads on machines without a GPU.

A library built before in the same folder is rebuilt when the MPI, the compiler,
jaxlib or the CUDA/NCCL detection changed (a fingerprint of them is baked into
the library's build info; setuptools alone compares only file times).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
FFI_DIR = Path("jaxfog") / "ffi"
FFI_EXT_NAME = "jaxfog.ffi.libjaxfog_ffi"
FFI_SOURCES = sorted(str(p) for p in FFI_DIR.glob("*.cc"))
#: The linker version script: the library exports its own ``jaxfog_*`` entry
#: points and nothing else (not the libstdc++ or CUDA runtime that a toolchain
#: may link in statically: exported, they crashed every process on a GPU image).
FFI_EXPORTS = HERE / FFI_DIR / "exports.lds"


def _system_mpicxx() -> str | None:
    return os.environ.get("JAXFOG_MPICXX") or None


def _find_mpicxx() -> str:
    chosen = _system_mpicxx()
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            raise RuntimeError(f"JAXFOG_MPICXX={chosen!r} is not an executable")
        return path
    # The mpich wheel puts its wrappers in this environment's scripts folder;
    # look there first so a stray system MPI on PATH is not picked by accident.
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "mpicxx"
        if candidate.exists():
            return str(candidate)
    path = shutil.which("mpicxx")
    if path is None:
        raise RuntimeError(
            "no mpicxx found: install the 'mpich' wheel (pip install mpich) or "
            "point JAXFOG_MPICXX at your MPI's C++ compiler wrapper")
    return path


def _from_mpich_wheel(mpicxx: str) -> bool:
    """Whether ``mpicxx`` is the installed ``mpich`` wheel's wrapper (not an MPI
    found on PATH, such as the GPU image's Open MPI in /usr/bin)."""
    try:
        files = importlib.metadata.distribution("mpich").files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    target = os.path.realpath(mpicxx)
    return any(os.path.realpath(f.locate()) == target for f in files if f.name == "mpicxx")


def _mpi_flags(mpicxx: str) -> list[str]:
    """Compile and link flags of an MPI wrapper (MPICH -show, Open MPI --showme)."""
    for option in ("-show", "--showme"):
        try:
            out = subprocess.run([mpicxx, option], capture_output=True, text=True,
                                 check=True, timeout=60).stdout
        except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired):
            continue
        words = shlex.split(out)
        if words:
            return words[1:]  # drop the underlying compiler
    raise RuntimeError(f"cannot read compile flags from {mpicxx} (-show / --showme)")


def _jaxlib_include() -> str:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("jaxlib is needed to build jaxfog (it ships the XLA FFI headers)")
    include = Path(list(spec.submodule_search_locations)[0]) / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"XLA FFI headers not found under {include}")
    return str(include)


def _cuda_static_runtime(cuda_home: str) -> str | None:
    for folder in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        candidate = Path(cuda_home) / folder / "libcudart_static.a"
        if candidate.exists():
            return str(candidate)
    return None


def _detect_cuda_nccl() -> dict:
    """Where CUDA and NCCL are, if anywhere. Absence is not an error: the GPU
    paths are then not built (``JAXFOG_NO_CUDA=1`` skips them on purpose)."""
    cuda_home = cudart = None
    if not os.environ.get("JAXFOG_NO_CUDA"):
        for candidate in (os.environ.get("JAXFOG_CUDA_HOME"), os.environ.get("CUDA_HOME"),
                          os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if candidate and (Path(candidate) / "include" / "cuda_runtime.h").exists():
                cudart = _cuda_static_runtime(candidate)
                if cudart:
                    cuda_home = candidate
                    break
    nccl_include = None
    for candidate in filter(None, (os.environ.get("JAXFOG_NCCL_HOME"), cuda_home)):
        if (Path(candidate) / "include" / "nccl.h").exists():
            nccl_include = str(Path(candidate) / "include")
            break
    if nccl_include is None:
        spec = importlib.util.find_spec("nvidia")
        for root in (spec.submodule_search_locations if spec else []) or []:
            header = Path(root) / "nccl" / "include" / "nccl.h"
            if header.exists():
                nccl_include = str(header.parent)
                break
    return {
        "cuda_home": cuda_home,
        "cudart": cudart,
        "nccl_include": nccl_include,
        # The CUDA runtime is linked statically; libnccl is opened at run time,
        # so the library loads on machines with neither.
        "cuda_built": cuda_home is not None,
        "nccl_built": cuda_home is not None and nccl_include is not None,
    }


def _split_flags(flags: list[str]) -> dict:
    parts = {"include_dirs": [], "library_dirs": [], "libraries": [], "link_args": [],
             "compile_args": []}
    for flag in flags:
        if flag.startswith("-I"):
            parts["include_dirs"].append(flag[2:])
        elif flag.startswith("-L"):
            parts["library_dirs"].append(flag[2:])
        elif flag.startswith("-l"):
            parts["libraries"].append(flag[2:])
        elif flag.startswith("-Wl,") or flag in ("-pthread",):
            parts["link_args"].append(flag)
        else:
            parts["compile_args"].append(flag)
    return parts


def _mpi_library_paths(library_dirs: list[str], libraries: list[str]) -> dict[str, str]:
    """The shared libraries (``-lNAME``) of the MPI wrapper found in its own ``-L``
    folders, by name.

    They are linked by path, not with ``-lNAME``: Python's own link line
    (``LDSHARED``) puts Python's library folder first, and a Python whose prefix
    holds the ``mpich`` wheel (pyenv, conda base) has MPICH's ``libmpi.so`` there,
    so ``-lmpi`` linked MPICH into a build against Open MPI (``JAXFOG_MPICXX``).
    """
    found = {}
    for name in libraries:
        for folder in library_dirs:
            candidate = Path(folder) / f"lib{name}.so"
            if candidate.exists():
                found[name] = str(candidate)
                break
    return found


def _jaxlib_version() -> str | None:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None


#: Where a build records what it was built with (see :func:`needs_rebuild`).
FINGERPRINT_KEY = "fingerprint"


def build_fingerprint(info: dict, *, jaxlib_version: str | None = None,
                      compiler: list[str] | None = None) -> str:
    """A digest of everything a built library depends on besides its sources:
    the MPI wrapper and its flags, the MPI libraries it links (resolved), the
    C++ compiler, jaxlib's version (its FFI headers) and the CUDA/NCCL detection."""
    import hashlib

    if jaxlib_version is None:
        jaxlib_version = _jaxlib_version()
    if compiler is None:
        compiler = [os.environ.get("CXX", ""), os.environ.get("CC", ""),
                    str(sysconfig.get_config_var("CXX") or "")]
    libraries = {name: os.path.realpath(path)
                 for name, path in sorted(info.get("mpi_libraries", {}).items())}
    record = {
        "mpicxx": os.path.realpath(info["mpicxx"]) if info.get("mpicxx") else None,
        "mpi_flags": info.get("mpi_flags"),
        "mpi_libraries": libraries,
        "compiler": compiler,
        "jaxlib": jaxlib_version,
        **{key: info.get(key) for key in ("cuda_home", "cudart", "nccl_include",
                                          "cuda_built", "nccl_built")},
    }
    text = json.dumps(record, sort_keys=True)
    if not info.get("system_mpi") and info.get("mpicxx"):
        # The mpich wheel: pip's isolated builds install it into a fresh temporary
        # prefix each time; its version, not that folder, is what matters.
        try:
            version = importlib.metadata.version("mpich")
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        prefix = str(Path(os.path.realpath(info["mpicxx"])).parent.parent)
        text = text.replace(prefix, f"<mpich wheel {version}>")
    return hashlib.sha256(text.encode()).hexdigest()


def built_fingerprint(library: str | os.PathLike) -> str | None:
    """The fingerprint baked into an existing library's build info, if any."""
    import re

    try:
        data = Path(library).read_bytes()
    except OSError:
        return None
    match = re.search(rb'"' + FINGERPRINT_KEY.encode() + rb'": "([0-9a-f]{64})"', data)
    return match.group(1).decode() if match else None


def needs_rebuild(library: str | os.PathLike, fingerprint: str) -> bool:
    """Whether an existing library must be rebuilt even if its sources did not
    change: it was built with another MPI, compiler, jaxlib or CUDA/NCCL
    detection (or records none). setuptools alone only compares file times, so
    a folder that was built once kept its first MPI whatever JAXFOG_MPICXX said."""
    return Path(library).exists() and built_fingerprint(library) != fingerprint


def _object_cache() -> Path | None:
    """Where compiled objects are kept between builds (``JAXFOG_BUILD_CACHE``;
    ``off``: nowhere)."""
    chosen = os.environ.get("JAXFOG_BUILD_CACHE", "")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxfog" / "objects"


def _without_paths(args: list[str]) -> list[str]:
    """Compiler arguments less the include folders, which differ between
    environments with the same headers (the preprocessed text has the headers)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-isystem", "-I"):
            skip = True
        elif not arg.startswith("-I"):
            kept.append(arg)
    return kept


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> bytes:
    return subprocess.run([compiler, "--version"], check=True, capture_output=True).stdout


def _object_key(compiler, source: str, cc_args: list[str], extra_postargs: list[str],
                pp_opts: list[str]) -> str:
    """What an object depends on, as ccache reads it: the compiler, its version,
    the flags and the source after the preprocessor (without line markers, whose
    paths name the environment). -g objects record the build folder in their
    debug information; that is all a cached one can differ in."""
    command = [*compiler.compiler_so, *cc_args, *pp_opts, *extra_postargs]
    preprocess = [arg for arg in command if arg != "-c"] + ["-E", "-P", source]
    preprocessed = subprocess.run(preprocess, check=True, capture_output=True).stdout
    digest = hashlib.sha256()
    for part in (_compiler_version(compiler.compiler_so[0]),
                 json.dumps(_without_paths(command)).encode(), preprocessed):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def _compile_in_parallel(compiler, sources, output_dir=None, macros=None, include_dirs=None,
                         debug=False, extra_preargs=None, extra_postargs=None, depends=None):
    """``CCompiler.compile`` with one compiler process per core (the library's
    16 sources take about 2 minutes one after another, 16 s on 16 cores) and
    the objects kept in :func:`_object_cache` by :func:`_object_key`: a build
    whose sources, headers, flags and compiler did not change (CI builds the
    same library in four environments) copies them instead."""
    macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
    cache = _object_cache()

    def one(obj):
        source, ext = build[obj]
        if cache is None:
            return compiler._compile(obj, source, ext, cc_args, extra_postargs, pp_opts)
        cached = cache / (_object_key(compiler, source, cc_args, extra_postargs, pp_opts)
                          + ".o")
        if cached.exists():
            shutil.copyfile(cached, obj)
            return
        compiler._compile(obj, source, ext, cc_args, extra_postargs, pp_opts)
        cache.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(obj, partial)
        os.replace(partial, cached)  # whole or absent, with builds running side by side

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(one, [obj for obj in objects if obj in build]))  # re-raises a failure
    return objects


class BuildFfi(build_ext):
    """Compiles the FFI library against jaxlib's headers and the chosen MPI."""

    def build_extensions(self) -> None:
        mpicxx = _find_mpicxx()
        flags = _mpi_flags(mpicxx)
        mpi = _split_flags(flags)
        by_path = _mpi_library_paths(mpi["library_dirs"], mpi["libraries"])
        info = {"builder": "setuptools", "mpicxx": mpicxx,
                "system_mpi": _system_mpicxx() is not None or not _from_mpich_wheel(mpicxx),
                "mpi_flags": flags, "mpi_libraries": by_path, **_detect_cuda_nccl()}
        info["jaxlib"] = _jaxlib_version()  # named when loaded under another jaxlib
        info[FINGERPRINT_KEY] = build_fingerprint(info)
        for ext in self.extensions:
            if needs_rebuild(self.get_ext_fullpath(ext.name), info[FINGERPRINT_KEY]):
                self.announce("jaxfog: the MPI, compiler, jaxlib or CUDA/NCCL differ from the "
                              "previous build: rebuilding", level=3)
                self.force = True
                self.compiler.force = True
        generated = Path(self.build_temp) / "generated"
        generated.mkdir(parents=True, exist_ok=True)
        # Baked into the library so that it travels with it (editable or not).
        (generated / "build_info.h").write_text(
            "#define JAXFOG_BUILD_INFO " + json.dumps(json.dumps(info)) + "\n")
        for ext in self.extensions:
            ext.include_dirs += [str(generated), *mpi["include_dirs"]]
            ext.library_dirs += mpi["library_dirs"]
            ext.libraries += [name for name in mpi["libraries"] if name not in by_path]
            ext.extra_objects += list(by_path.values())
            if info["system_mpi"]:
                # Load the MPI it was built against, wherever the loader looks first.
                ext.runtime_library_dirs += sorted({str(Path(p).parent)
                                                    for p in by_path.values()})
            # -isystem: jaxlib's headers are not ours to warn about.
            ext.extra_compile_args += ["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall",
                                       "-isystem", _jaxlib_include(), *mpi["compile_args"]]
            ext.extra_link_args += [*mpi["link_args"], f"-Wl,--version-script={FFI_EXPORTS}",
                                    # archives (libstdc++.a, libcudart_static.a) stay private
                                    "-Wl,--exclude-libs,ALL", "-ldl"]
            ext.depends.append(str(FFI_EXPORTS))
            if info["cuda_built"]:
                ext.define_macros.append(("JAXFOG_WITH_CUDA", "1"))
                ext.extra_compile_args += ["-isystem", str(Path(info["cuda_home"]) / "include")]
                ext.extra_link_args += [info["cudart"], "-ldl", "-lrt", "-lpthread"]
            if info["nccl_built"]:
                ext.define_macros.append(("JAXFOG_WITH_NCCL", "1"))
                ext.extra_compile_args += ["-isystem", info["nccl_include"]]
        if all(hasattr(self.compiler, name) for name in ("_setup_compile", "_get_cc_args",
                                                          "_compile")):
            self.compiler.compile = functools.partial(_compile_in_parallel, self.compiler)
        super().build_extensions()

    def get_ext_filename(self, fullname: str) -> str:
        # Called with the full dotted name and with its last part alone.
        *package, name = fullname.split(".")
        if name == FFI_EXT_NAME.rsplit(".", 1)[1]:
            # A plain shared library loaded with ctypes, not a Python module.
            return os.path.join(*package, name + ".so")
        return super().get_ext_filename(fullname)


def _install_requires() -> list[str]:
    # The last three minor jax releases (docs/building.rst: the support window);
    # private JAX API is confined to jaxfog/ops/_jax_compat.py.
    requires = ["jax>=0.10,<0.13", "jaxlib>=0.10,<0.13", "numpy>=1.24", "mpi4py>=4.0", "optax"]
    if _system_mpicxx() is None:
        requires.append("mpich")
    return requires


# The package's metadata is pyproject.toml's [project]; this adds the FFI library
# and the dependencies that depend on the build's MPI.
setup(
    ext_modules=[Extension(FFI_EXT_NAME, sources=FFI_SOURCES, language="c++",
                           depends=[str(p) for p in FFI_DIR.glob("*.h")])],
    cmdclass={"build_ext": BuildFfi},
    install_requires=_install_requires(),
)
