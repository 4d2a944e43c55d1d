// Transport over an NCCL communicator: one GPU per process, messages in
// device memory, every send/receive of an op in one NCCL group enqueued on
// the stream XLA gives the handler (set with StreamScope). Nothing waits on
// the stream: the call returns once the work is enqueued.
//
// The header checks of the MPI transport (op, sequence number, signature,
// sizes) stay, per call: before enqueueing, the same op runs header-only (no
// data) over `checks`, an MPI transport over the same ranks, on the host.
// A mismatch fails the call on every rank involved before NCCL is touched.
#ifndef JAXFOG_FFI_NCCL_TRANSPORT_H_
#define JAXFOG_FFI_NCCL_TRANSPORT_H_
#ifdef JAXFOG_WITH_NCCL

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "nccl_api.h"
#include "transport.h"

namespace jaxfog {

class NcclTransport final : public Transport {
 public:
  // Collective over the ranks of `checks` (which it takes over): every rank
  // passes the same `id` (from ncclGetUniqueId on one rank). `device` is this
  // process's GPU.
  static ffi::ErrorOr<std::unique_ptr<NcclTransport>> Create(
      const ncclUniqueId& id, int device, std::unique_ptr<Transport> checks);
  ~NcclTransport() override;

  // The stream the calls of this thread enqueue on, while in scope.
  class StreamScope {
   public:
    explicit StreamScope(cudaStream_t stream);
    ~StreamScope();

   private:
    cudaStream_t previous_;
    bool previous_set_;
  };

  // One NCCL group around several calls (a pytree's leaves).
  class Group {
   public:
    explicit Group(const NcclApi* api);
    ~Group();
    // Ends the group, launching its work; an error if NCCL fails.
    ffi::Error End();

   private:
    const NcclApi* api_;
    bool open_;
  };

  int rank() const override { return checks_->rank(); }
  int size() const override { return checks_->size(); }
  uint64_t sequence() const override { return checks_->sequence(); }
  const NcclApi* api() const { return api_; }

  // A host barrier (over MPI); it does not wait for work on the GPU.
  ffi::Error Barrier() override { return checks_->Barrier(); }
  ffi::Error Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                      const std::vector<RecvSpec>& recvs,
                      const Streaming* streaming = nullptr) override;
  ffi::Error Allreduce(const OpInfo& info, const void* in, void* out, size_t count,
                       ffi::DataType type) override;
  ffi::Error Broadcast(const OpInfo& info, void* data, size_t bytes, int root) override;
  ffi::Error Allgather(const OpInfo& info, const void* in, void* out,
                       size_t bytes) override;

 private:
  NcclTransport(const NcclApi* api, ncclComm_t comm, std::unique_ptr<Transport> checks)
      : api_(api), comm_(comm), checks_(std::move(checks)) {}
  ffi::ErrorOr<cudaStream_t> Stream(const char* op) const;
  ffi::Error CheckCollective(const OpInfo& info);

  const NcclApi* api_;
  ncclComm_t comm_;
  std::unique_ptr<Transport> checks_;
};

}  // namespace jaxfog

#endif  // JAXFOG_WITH_NCCL
#endif  // JAXFOG_FFI_NCCL_TRANSPORT_H_
