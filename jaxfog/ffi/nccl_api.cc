#ifdef JAXFOG_WITH_NCCL
#include "nccl_api.h"

#include <dlfcn.h>

#include <mutex>

namespace jaxfog {
namespace {

std::mutex load_mutex;
const NcclApi* loaded = nullptr;

template <typename F>
bool Resolve(void* handle, const char* name, F* slot, std::string* missing) {
  *slot = reinterpret_cast<F>(dlsym(handle, name));
  if (!*slot) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *slot != nullptr;
}

}  // namespace

::xla::ffi::ErrorOr<const NcclApi*> LoadNccl(const std::string& path) {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (loaded) return loaded;
  const std::string file = path.empty() ? "libnccl.so.2" : path;
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* reason = dlerror();
    return ::xla::ffi::Unexpected<::xla::ffi::Error>(::xla::ffi::Error(
        ::xla::ffi::ErrorCode::kNotFound,
        "jaxfog: cannot load NCCL from " + file + ": " + (reason ? reason : "?")));
  }
  auto* api = new NcclApi();  // lives until exit, like the library
  std::string missing;
  Resolve(handle, "ncclGetVersion", &api->GetVersion, &missing);
  Resolve(handle, "ncclGetErrorString", &api->GetErrorString, &missing);
  Resolve(handle, "ncclGetLastError", &api->GetLastError, &missing);
  Resolve(handle, "ncclGetUniqueId", &api->GetUniqueId, &missing);
  Resolve(handle, "ncclCommInitRank", &api->CommInitRank, &missing);
  Resolve(handle, "ncclCommDestroy", &api->CommDestroy, &missing);
  Resolve(handle, "ncclCommAbort", &api->CommAbort, &missing);
  Resolve(handle, "ncclCommGetAsyncError", &api->CommGetAsyncError, &missing);
  Resolve(handle, "ncclGroupStart", &api->GroupStart, &missing);
  Resolve(handle, "ncclGroupEnd", &api->GroupEnd, &missing);
  Resolve(handle, "ncclSend", &api->Send, &missing);
  Resolve(handle, "ncclRecv", &api->Recv, &missing);
  Resolve(handle, "ncclAllReduce", &api->AllReduce, &missing);
  Resolve(handle, "ncclBroadcast", &api->Broadcast, &missing);
  Resolve(handle, "ncclAllGather", &api->AllGather, &missing);
  if (!missing.empty()) {
    delete api;
    dlclose(handle);
    return ::xla::ffi::Unexpected<::xla::ffi::Error>(::xla::ffi::Error(
        ::xla::ffi::ErrorCode::kNotFound,
        "jaxfog: " + file + " lacks NCCL functions (" + missing + "): NCCL >= 2.19 is needed"));
  }
  loaded = api;
  return loaded;
}

::xla::ffi::ErrorOr<const NcclApi*> Nccl() {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (loaded) return loaded;
  return ::xla::ffi::Unexpected<::xla::ffi::Error>(
      ::xla::ffi::Error(::xla::ffi::ErrorCode::kFailedPrecondition,
                        "jaxfog: NCCL is not loaded (jaxfog.init() loads it on a GPU machine)"));
}

::xla::ffi::Error NcclError(ncclResult_t code, const std::string& what, ncclComm_t comm) {
  if (code == ncclSuccess) return ::xla::ffi::Error::Success();
  std::string reason = "NCCL error " + std::to_string(static_cast<int>(code));
  if (loaded) {
    reason = loaded->GetErrorString(code);
    const char* last = loaded->GetLastError(comm);
    if (last && *last) reason += std::string(": ") + last;
  }
  return ::xla::ffi::Error(::xla::ffi::ErrorCode::kInternal,
                           "jaxfog: " + what + " failed: " + reason);
}

}  // namespace jaxfog
#endif  // JAXFOG_WITH_NCCL
