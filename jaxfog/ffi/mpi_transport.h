// Transport over an MPI communicator duplicated by the Python runtime: every
// message preceded by its header (message_header.h), every wait a RequestSet
// (mpi_requests.h).
#ifndef JAXFOG_FFI_MPI_TRANSPORT_H_
#define JAXFOG_FFI_MPI_TRANSPORT_H_

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpi_requests.h"
#include "peer_watch.h"
#include "transport.h"

namespace jaxfog {

// Whether an exchange ends only when every peer it sent to has received all
// of it (an empty receipt from each, JAXFOG_SEND_RECEIPTS): MPI ends a send
// once its data is handed to the network stack, so without receipts the next
// exchange's flows start while the last one's still drain, and on a slow
// link with a shallow queue the two lose packets to each other.
void SetSendReceipts(bool on);

class MpiTransport final : public Transport {
 public:
  // Does not take ownership: the runtime that duplicated `comm` frees it
  // after the transport is gone. Messages larger than `max_message_bytes`
  // travel in several pieces (MPI counts are ints). With `watch`, waits
  // fail soon after a rank they wait for has left, and goodbyes report this
  // communicator (the runtime's `comm_id`) by its last op. Fails if MPI does.
  static ffi::ErrorOr<std::unique_ptr<MpiTransport>> Create(
      MPI_Comm comm, double timeout_seconds, size_t max_message_bytes,
      std::shared_ptr<PeerWatch> watch = nullptr, int64_t comm_id = 0);
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t sequence() const override { return sequence_; }

  ffi::Error Barrier() override;
  ffi::Error Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                      const std::vector<RecvSpec>& recvs,
                      const Streaming* streaming = nullptr) override;
  ffi::Error Allreduce(const OpInfo& info, const void* in, void* out, size_t count,
                       ffi::DataType type) override;
  ffi::Error Broadcast(const OpInfo& info, void* data, size_t bytes, int root,
                       const std::function<void()>& meanwhile = nullptr) override;
  ffi::Error Allgather(const OpInfo& info, const void* in, void* out, size_t bytes) override;

  // The header checks alone, for ops whose data another channel moves (the
  // NCCL transport): each counts as this communicator's next op and fails,
  // on every rank involved, where Exchange or a collective would (another
  // op, another order, other sizes or signature, naming who differs).
  // `sends`' and `recvs`' pieces give the sizes; their data is not touched.
  ffi::Error CheckExchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                           const std::vector<RecvSpec>& recvs);
  // `bytes`: each rank's input, which must be the same everywhere.
  ffi::Error CheckCollective(const OpInfo& info, uint64_t bytes);

 private:
  MpiTransport(MPI_Comm comm, double timeout_seconds, size_t max_message_bytes,
               std::shared_ptr<PeerWatch> watch, int64_t comm_id);
  ffi::Error ExchangeReceipts(const std::vector<SendSpec>& sends,
                              const std::vector<RecvSpec>& recvs, const std::string& what);
  // The MPI calls construction needs (a constructor cannot fail).
  ffi::Error Init();
  // Counts the next op (its sequence number), which goodbyes report.
  void Begin(OpCode op);
  // Exchange, with its data or (`with_data` false) its headers only.
  ffi::Error Messages(const OpInfo& info, const std::vector<SendSpec>& sends,
                      const std::vector<RecvSpec>& recvs, const Streaming* streaming,
                      bool with_data);
  std::string Describe(const OpInfo& info) const;

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_seconds_;
  std::shared_ptr<PeerWatch> watch_;         // keeps scope_.watch alive
  PeerWatch::Progress* progress_ = nullptr;  // owned by watch_
  WaitScope scope_;
  size_t max_message_bytes_;
  uint64_t sequence_ = 0;  // ops run so far on this communicator
  MPI_Op half_sum_ = MPI_OP_NULL;
  MPI_Op bfloat16_sum_ = MPI_OP_NULL;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_MPI_TRANSPORT_H_
