// Host staging's copies on the CUDA stream XLA hands the handler.
#ifdef JAXFOG_WITH_CUDA
#include <memory>

#include "cuda_util.h"
#include "staging.h"
#include "status.h"

namespace jaxfog {
namespace {

// Pinned (page-locked) host memory: copies run at the link's full rate, and
// the pool keeps it between calls since pinning is slow. Where the driver
// refuses (pinned memory is limited), pageable memory: slower, still correct.
ScratchPool::Buffer AllocatePinned(size_t bytes) {
  void* data = nullptr;
  if (cudaHostAlloc(&data, bytes, cudaHostAllocPortable) == cudaSuccess) {
    return ScratchPool::Buffer(static_cast<char*>(data),
                               ScratchPool::Free{[](char* pinned) { cudaFreeHost(pinned); }});
  }
  cudaGetLastError();  // the failure is handled: do not leave it to the next call
  return ScratchPool::AlignedNew(bytes);
}

ScratchPool& PinnedPool() {
  static ScratchPool* pool = new ScratchPool(kDefaultPinnedKeepBytes, &AllocatePinned);
  return *pool;  // lives until exit
}

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
  ScratchPool& Pool() override { return PinnedPool(); }

 private:
  cudaStream_t stream_;
};

}  // namespace

void SetPinnedKeepBytes(size_t bytes) { PinnedPool().set_keep_bytes(bytes); }

std::unique_ptr<DeviceCopier> MakeCudaCopier(void* stream) {
  return std::make_unique<CudaCopier>(static_cast<cudaStream_t>(stream));
}

}  // namespace jaxfog
#endif  // JAXFOG_WITH_CUDA
