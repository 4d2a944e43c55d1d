// Transport over an NCCL communicator: one GPU per process, messages in
// device memory, every send/receive of an op in one NCCL group enqueued on
// the stream XLA gives the handler, which passes it to every call. Nothing
// waits on the stream: the call returns once the work is enqueued.
//
// The header checks of the MPI transport (op, sequence number, signature,
// sizes) stay, per call: before enqueueing, the same op runs header-only (no
// data) over `checks`, an MPI transport over the same ranks, on the host.
// A mismatch fails the call on every rank involved before NCCL is touched.
#ifndef JAXFOG_FFI_NCCL_TRANSPORT_H_
#define JAXFOG_FFI_NCCL_TRANSPORT_H_
#ifdef JAXFOG_WITH_NCCL

#include <cuda_runtime_api.h>

#include <functional>
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

  // Exchange (see Transport) enqueued on `stream`: one header check over
  // MPI, then every send and receive as one NCCL group.
  ffi::Error Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                      const std::vector<RecvSpec>& recvs, cudaStream_t stream);
  // Enqueues one collective op on several buffers (a pytree's leaves): one
  // header check of `info` over MPI, then `enqueue()`, which issues the NCCL
  // calls (the Enqueue* functions, on `stream`), as one NCCL group. `bytes`
  // is the data each rank hands NCCL (for comm_stats).
  ffi::Error Collective(const OpInfo& info, int64_t bytes,
                        const std::function<ffi::Error()>& enqueue);
  // What comm_stats counts for a collective on `bytes` of input: the MPI
  // transport's logical figures.
  int64_t AllreduceBytes(size_t bytes) const {
    return 2 * (size() - 1) * static_cast<int64_t>(bytes) / size();
  }
  int64_t BroadcastBytes(size_t bytes, int root) const {
    return rank() == root ? (size() - 1) * static_cast<int64_t>(bytes) : 0;
  }
  int64_t AllgatherBytes(size_t bytes) const {
    return (size() - 1) * static_cast<int64_t>(bytes);
  }
  ffi::Error EnqueueAllreduce(const void* in, void* out, size_t count, ffi::DataType type,
                              cudaStream_t stream);
  // In place on `data` (root's is the source).
  ffi::Error EnqueueBroadcast(void* data, size_t bytes, int root, cudaStream_t stream);
  ffi::Error EnqueueAllgather(const void* in, void* out, size_t bytes, cudaStream_t stream);

  int rank() const override { return checks_->rank(); }
  int size() const override { return checks_->size(); }
  uint64_t sequence() const override { return checks_->sequence(); }

  // A host barrier (over MPI); it does not wait for work on the GPU.
  ffi::Error Barrier() override { return checks_->Barrier(); }
  // The Transport interface's data ops have no stream to enqueue on: they
  // fail (an NCCL communicator used by a host handler). GPU handlers call
  // the forms above.
  ffi::Error Exchange(const OpInfo& info, const std::vector<SendSpec>&,
                      const std::vector<RecvSpec>&, const Streaming*) override {
    return NoStream(info);
  }
  ffi::Error Allreduce(const OpInfo& info, const void*, void*, size_t, ffi::DataType) override {
    return NoStream(info);
  }
  ffi::Error Broadcast(const OpInfo& info, void*, size_t, int) override { return NoStream(info); }
  ffi::Error Allgather(const OpInfo& info, const void*, void*, size_t) override {
    return NoStream(info);
  }

 private:
  NcclTransport(const NcclApi* api, ncclComm_t comm, std::unique_ptr<Transport> checks)
      : api_(api), comm_(comm), checks_(std::move(checks)) {}
  static ffi::Error NoStream(const OpInfo& info);
  // Runs `enqueue` between ncclGroupStart and ncclGroupEnd.
  ffi::Error Grouped(const std::function<ffi::Error()>& enqueue);

  const NcclApi* api_;
  ncclComm_t comm_;
  std::unique_ptr<Transport> checks_;
};

}  // namespace jaxfog

#endif  // JAXFOG_WITH_NCCL
#endif  // JAXFOG_FFI_NCCL_TRANSPORT_H_
