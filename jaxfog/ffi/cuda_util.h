// CUDA runtime calls with their errors turned into ffi::Error (with context).
#ifndef JAXFOG_FFI_CUDA_UTIL_H_
#define JAXFOG_FFI_CUDA_UTIL_H_

#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

inline ::xla::ffi::Error CudaError(cudaError_t code, const char* what) {
  if (code == cudaSuccess) return ::xla::ffi::Error::Success();
  return ::xla::ffi::Error(::xla::ffi::ErrorCode::kInternal,
                           std::string("jaxfog: ") + what + " failed: " + cudaGetErrorName(code) +
                               " (" + cudaGetErrorString(code) + ")");
}

}  // namespace jaxfog

#define JAXFOG_CUDA_RETURN_IF_ERROR(call) JAXFOG_RETURN_IF_ERROR(::jaxfog::CudaError((call), #call))

#endif  // JAXFOG_FFI_CUDA_UTIL_H_
