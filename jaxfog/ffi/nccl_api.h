// NCCL, opened at run time with dlopen: the library compiles against NCCL's
// header alone, and loads on machines without libnccl (every CPU machine).
#ifndef JAXFOG_FFI_NCCL_API_H_
#define JAXFOG_FFI_NCCL_API_H_
#ifdef JAXFOG_WITH_NCCL

#include <nccl.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

// The NCCL entry points jaxfog uses, typed by NCCL's own header.
struct NcclApi {
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclGetLastError) GetLastError;
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRank) CommInitRank;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclSend) Send;
  decltype(&ncclRecv) Recv;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclBroadcast) Broadcast;
  decltype(&ncclAllGather) AllGather;
};

// Opens `path` (a libnccl.so.2; empty: the loader's search path) the first
// time; later calls return the same table, whatever the path.
::xla::ffi::ErrorOr<const NcclApi*> LoadNccl(const std::string& path);

// The loaded table, or an error telling how to load it.
::xla::ffi::ErrorOr<const NcclApi*> Nccl();

// ncclSuccess, or an error naming `what` with NCCL's reason.
::xla::ffi::Error NcclError(ncclResult_t code, const std::string& what, ncclComm_t comm = nullptr);

}  // namespace jaxfog

#endif  // JAXFOG_WITH_NCCL
#endif  // JAXFOG_FFI_NCCL_API_H_
