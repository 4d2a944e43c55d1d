"""jaxfog's C++ XLA FFI library, as Python sees it: loading it (``RTLD_LOCAL``,
its libmpi made global, checked against mpi4py's MPI and this jaxlib's FFI API),
its build and link info, its op table, its handlers registered with XLA, the
timeline and traffic counters, NCCL set-up. The code is in
:mod:`jaxfog.ffi._loader`; the GPU transport decision in :mod:`jaxfog.ffi._nccl_setup`.
"""

from jaxfog.errors import FfiLibraryError
from jaxfog.ffi._loader import (HOST_STAGING_ENV, LIBRARY_ENV, LIBRARY_PATH, TIMELINE_ENV,
                                TRAFFIC_FIELDS, OpSpec, build_info, check_ffi_api_version,
                                cuda_built, cuda_device_uuid, ffi_api_version, flush_timeline,
                                jaxlib_ffi_api_version, library, link_info, load_nccl,
                                mpi_library_version, mpi_tools, nccl_built, nccl_library_path,
                                nccl_targets, nccl_unique_id, op_table, register_handlers,
                                start_timeline, traffic)

__all__ = ["FfiLibraryError", "HOST_STAGING_ENV", "LIBRARY_ENV", "LIBRARY_PATH", "OpSpec",
           "TIMELINE_ENV", "TRAFFIC_FIELDS", "build_info", "check_ffi_api_version", "cuda_built",
           "cuda_device_uuid", "ffi_api_version", "flush_timeline", "jaxlib_ffi_api_version",
           "library", "link_info", "load_nccl", "mpi_library_version", "mpi_tools", "nccl_built",
           "nccl_library_path", "nccl_targets", "nccl_unique_id", "op_table", "register_handlers",
           "start_timeline", "traffic"]
