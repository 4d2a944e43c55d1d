// Host staging's copies on the CUDA stream XLA hands the handler.
#ifdef JAXFOG_WITH_CUDA
#include <memory>

#include "cuda_util.h"
#include "staging.h"
#include "status.h"

namespace jaxfog {
namespace {

class CudaCopier final : public DeviceCopier {
 public:
  explicit CudaCopier(cudaStream_t stream) : stream_(stream) {}
  ffi::Error ToHost(void* host, const void* device, size_t bytes) override {
    if (!bytes) return ffi::Error::Success();
    JAXFOG_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
    return ffi::Error::Success();
  }
  ffi::Error ToDevice(void* device, const void* host, size_t bytes) override {
    if (!bytes) return ffi::Error::Success();
    JAXFOG_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
    return ffi::Error::Success();
  }
  // The copies follow the work XLA queued before the call on the same stream,
  // so the inputs are complete when their copies are.
  ffi::Error Wait() override {
    JAXFOG_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return ffi::Error::Success();
  }

 private:
  cudaStream_t stream_;
};

}  // namespace

std::unique_ptr<DeviceCopier> MakeCudaCopier(void* stream) {
  return std::make_unique<CudaCopier>(static_cast<cudaStream_t>(stream));
}

}  // namespace jaxfog
#endif  // JAXFOG_WITH_CUDA
