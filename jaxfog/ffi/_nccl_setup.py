"""Which transport GPU arrays take, and the NCCL communicator's set-up.

On a process whose JAX has CUDA devices, ops on GPU arrays lower for the CUDA
platform to either

* ``"nccl"``: the NCCL transport (grouped ncclSend/ncclRecv and NCCL
  collectives on the stream XLA gives each call), when the library was built
  with NCCL, libnccl loads, and every rank's communicator comes up; or
* ``"mpi"``: host staging (device to host, the MPI op, host to device, on
  the call's stream), when NCCL is not built, ``JAXFOG_BACKEND=mpi``, or
  NCCL refuses (e.g. two ranks on one GPU).

Setting up NCCL is collective, so it happens in ``jaxfog.init()``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import warnings

from jaxfog import ffi
from jaxfog.errors import JaxfogError

#: ``mpi`` forces host staging for GPU arrays; ``nccl`` makes a failure to set
#: NCCL up an error instead of a fallback.
BACKEND_ENV = "JAXFOG_BACKEND"
#: The communicator id of the NCCL transport in the C++ registry.
NCCL_COMM_ID = 3


def has_cuda() -> bool:
    """Whether JAX in this process has CUDA devices (without initialising
    other backends)."""
    import jax

    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def requested() -> str:
    """``JAXFOG_BACKEND``: "" (choose), "mpi" or "nccl"."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if value not in ("", "mpi", "nccl"):
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected 'mpi' or 'nccl'")
    return value


def choose(has_gpu: bool, nccl_built: bool, wanted: str) -> str | None:
    """The GPU transport to try: None without a GPU, else "nccl" or "mpi"."""
    if wanted == "nccl" and not nccl_built:
        raise JaxfogError(f"{BACKEND_ENV}=nccl, but jaxfog was built without NCCL "
                           "(jaxfog info says why); rebuild with nvidia-nccl-cu13 installed")
    if not has_gpu:
        return None
    return "nccl" if nccl_built and wanted != "mpi" else "mpi"


def device_ordinal() -> int:
    """The CUDA ordinal of this process's GPU: JAX's first local CUDA device
    (``jaxfog run`` gives each local rank its own through CUDA_VISIBLE_DEVICES)."""
    import jax

    return jax.local_devices(backend="cuda")[0].local_hardware_id


def gpu_identity() -> tuple[str, str | None, str]:
    """(host, UUID of this process's GPU or None, why not)."""
    host = socket.gethostname()
    try:
        return host, ffi.cuda_device_uuid(device_ordinal()), ""
    except (ffi.FfiLibraryError, RuntimeError, IndexError) as failure:
        return host, None, str(failure)


def shared_gpus(identities: list[tuple[str, str | None, str]]) -> str | None:
    """Why NCCL cannot take these ranks, one ``(host, GPU UUID, error)`` per
    rank (from :func:`gpu_identity`), or None: NCCL refuses two ranks on one
    GPU ("Duplicate GPU detected", or a hang behind an experimental switch),
    so that is decided here, by every rank alike, before NCCL is called."""
    first: dict[tuple[str, str], int] = {}
    for rank, (host, uuid, error) in enumerate(identities):
        if uuid is None:
            return f"rank {rank} cannot identify its GPU ({error})"
        if (host, uuid) in first:
            return (f"ranks {first[host, uuid]} and {rank} share GPU {uuid} on {host}, and "
                    "NCCL takes one rank per GPU (run one rank per GPU, or set "
                    f"{BACKEND_ENV}=mpi)")
        first[host, uuid] = rank
    return None


def start_nccl(lib, comm, timeout: float, max_message: int):
    """Creates the NCCL communicator over ``comm``'s ranks; collective.

    Returns the duplicated MPI communicator its header checks use (registered
    under NCCL_COMM_ID with the NCCL transport), or None, with a warning,
    where NCCL cannot be used on every rank and ``JAXFOG_BACKEND`` allows the
    fallback to host staging. Every rank decides alike before any enters
    NCCL's init (which waits for all), so none is left there alone.
    """
    from mpi4py import MPI

    error, unique = shared_gpus(comm.allgather(gpu_identity())), None
    if error is None:
        try:
            ffi.load_nccl()
            unique = ffi.nccl_unique_id() if comm.Get_rank() == 0 else None
        except ffi.FfiLibraryError as failure:
            error = str(failure)
    # Every rank learns whether all could load NCCL before any enters its init.
    if comm.allreduce(error is None, op=MPI.LAND):
        unique = comm.bcast(unique, root=0)
        checks = comm.Dup()
        message = ctypes.create_string_buffer(1024)
        if lib.jaxfog_register_nccl_comm(NCCL_COMM_ID, checks.py2f(), timeout, max_message,
                                         unique, device_ordinal(), message, len(message)):
            error = message.value.decode(errors="replace")
        if comm.allreduce(error is None, op=MPI.LAND):
            return checks
        if error is None:  # aborted, not fenced: the other ranks have no communicator
            lib.jaxfog_drop_nccl_comm(NCCL_COMM_ID)
            error = "NCCL failed on another rank"
        checks.Free()
    if requested() == "nccl":
        raise JaxfogError(f"jaxfog.init: {BACKEND_ENV}=nccl, but NCCL is unusable: {error}")
    warnings.warn(f"jaxfog.init: NCCL is unusable ({error}); GPU arrays go through MPI "
                  "with host staging", RuntimeWarning, stacklevel=3)
    return None
