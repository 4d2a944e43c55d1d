// C entry points of the NCCL transport for the Python runtime (init and
// shutdown only). Built without NCCL they exist and fail with a reason.
#include <mpi.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "mpi_transport.h"
#include "registry.h"
#ifdef JAXFOG_WITH_NCCL
#include "nccl_api.h"
#include "nccl_transport.h"
#endif

namespace {

int Fail(const std::string& message, char* buffer, int length) {
  if (buffer != nullptr && length > 0) {
    std::strncpy(buffer, message.c_str(), static_cast<size_t>(length) - 1);
    buffer[length - 1] = '\0';
  }
  return 1;
}

[[maybe_unused]] constexpr const char* kNotBuilt =
    "jaxfog was built without NCCL (no nccl.h at build time: install nvidia-nccl-cu13 "
    "before building, or set JAXFOG_NCCL_HOME)";

}  // namespace

extern "C" {

// Size of an NCCL unique id (NCCL_UNIQUE_ID_BYTES), 0 without NCCL.
__attribute__((visibility("default"))) int jaxfog_nccl_id_bytes() {
#ifdef JAXFOG_WITH_NCCL
  return NCCL_UNIQUE_ID_BYTES;
#else
  return 0;
#endif
}

// Loads libnccl (`path`, or the loader's search path when empty) and writes
// its version code (e.g. 23203) to `version`.
__attribute__((visibility("default"))) int jaxfog_nccl_load(const char* path, int* version,
                                                            char* error, int error_length) {
#ifdef JAXFOG_WITH_NCCL
  auto api = jaxfog::LoadNccl(path ? path : "");
  if (api.has_error()) return Fail(api.error().message(), error, error_length);
  ::xla::ffi::Error status =
      jaxfog::NcclError((*api)->GetVersion(version), "ncclGetVersion");
  return status.success() ? 0 : Fail(status.message(), error, error_length);
#else
  (void)path, (void)version;
  return Fail(kNotBuilt, error, error_length);
#endif
}

// Writes a fresh NCCL unique id (jaxfog_nccl_id_bytes() bytes) to `id`.
__attribute__((visibility("default"))) int jaxfog_nccl_unique_id(char* id, char* error,
                                                                 int error_length) {
#ifdef JAXFOG_WITH_NCCL
  auto api = jaxfog::Nccl();
  if (api.has_error()) return Fail(api.error().message(), error, error_length);
  ncclUniqueId unique;
  ::xla::ffi::Error status = jaxfog::NcclError((*api)->GetUniqueId(&unique), "ncclGetUniqueId");
  if (!status.success()) return Fail(status.message(), error, error_length);
  std::memcpy(id, unique.internal, NCCL_UNIQUE_ID_BYTES);
  return 0;
#else
  (void)id;
  return Fail(kNotBuilt, error, error_length);
#endif
}

// Registers under `id` an NCCL communicator over the ranks of MPI
// communicator `fortran_comm` (collective over them; every rank passes the
// same `unique_id`), on GPU `device`. Header checks travel over that MPI
// communicator, which the runtime duplicated for this purpose.
__attribute__((visibility("default"))) int jaxfog_register_nccl_comm(
    int64_t id, int fortran_comm, double timeout_seconds, int64_t max_message_bytes,
    const char* unique_id, int device, char* error, int error_length) {
#ifdef JAXFOG_WITH_NCCL
  auto checks = jaxfog::MpiTransport::Create(MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_comm)),
                                             timeout_seconds,
                                             static_cast<size_t>(max_message_bytes));
  if (checks.has_error()) return Fail(checks.error().message(), error, error_length);
  ncclUniqueId unique;
  std::memcpy(unique.internal, unique_id, NCCL_UNIQUE_ID_BYTES);
  auto transport = jaxfog::NcclTransport::Create(unique, device, std::move(*checks));
  if (transport.has_error()) return Fail(transport.error().message(), error, error_length);
  jaxfog::Registry<jaxfog::Transport>::Global().Add(id, std::move(*transport));
  return 0;
#else
  (void)id, (void)fortran_comm, (void)timeout_seconds, (void)max_message_bytes,
      (void)unique_id, (void)device;
  return Fail(kNotBuilt, error, error_length);
#endif
}

}  // extern "C"
