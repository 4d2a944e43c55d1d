// Transport over an MPI communicator duplicated by the Python runtime.
#ifndef JAXFOG_FFI_MPI_TRANSPORT_H_
#define JAXFOG_FFI_MPI_TRANSPORT_H_

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "transport.h"

namespace jaxfog {

class MpiTransport final : public Transport {
 public:
  // Does not take ownership: the runtime that duplicated `comm` frees it
  // after the transport is gone. Messages larger than `max_message_bytes`
  // travel in several pieces (MPI counts are ints).
  MpiTransport(MPI_Comm comm, double timeout_seconds, size_t max_message_bytes);
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t sequence() const override { return sequence_; }

  ffi::Error Barrier() override;
  ffi::Error Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                      const std::vector<RecvSpec>& recvs,
                      const Streaming* streaming = nullptr) override;
  ffi::Error Allreduce(const OpInfo& info, const void* in, void* out, size_t count,
                       ffi::DataType type) override;
  ffi::Error Broadcast(const OpInfo& info, void* data, size_t bytes, int root) override;
  ffi::Error Allgather(const OpInfo& info, const void* in, void* out,
                       size_t bytes) override;

 private:
  // Completes `requests`; `owners[i]` names what request i is for, so that a
  // timeout says which peers never answered. With `done_at`, it also records
  // when each request completed (timeline::Now(); for the timeline).
  // `finished(indices, count)`, when given, runs as requests complete.
  using Finished = std::function<ffi::Error(const int* indices, int count)>;
  ffi::Error WaitAll(std::vector<MPI_Request>& requests,
                     const std::vector<std::string>& owners, const std::string& what,
                     std::vector<int64_t>* done_at = nullptr,
                     const Finished& finished = nullptr);
  // Checks that all ranks agree on (op, sequence number, signature, bytes).
  ffi::Error Agree(const OpInfo& info, uint64_t bytes, const std::string& what);
  std::string Describe(const OpInfo& info) const;

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_seconds_;
  size_t max_message_bytes_;
  uint64_t sequence_ = 0;  // ops run so far on this communicator
  MPI_Op half_sum_ = MPI_OP_NULL;
  MPI_Op bfloat16_sum_ = MPI_OP_NULL;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_MPI_TRANSPORT_H_
