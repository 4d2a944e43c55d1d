// Transport over an NCCL communicator: one GPU per process, messages in
// device memory, every send/receive of an op in one NCCL group enqueued on
// the stream XLA gives the handler, which passes it to every call. Nothing
// waits on the stream: a call returns once its work is enqueued.
//
// Its own small interface, not a Transport: NCCL moves device buffers on a
// stream, MPI host buffers on a thread. Each op runs, in this order:
//   1. the watchdog's verdict: once it has aborted the communicator, every
//      op fails with the reason;
//   2. validation of every argument (dtypes, ranks, buffers), so that a
//      local failure never leaves an NCCL group half posted;
//   3. the MPI transport's header checks (op, sequence number, signature,
//      sizes) on the host, over `checks`, an MPI communicator of the same
//      ranks: a mismatch fails the op on every rank involved before NCCL is
//      touched;
//   4. the NCCL calls, as one group, then a CUDA event recorded after them.
// The watchdog thread polls those events and ncclCommGetAsyncError: work not
// finished after the timeout (a peer died after the header check), or an
// asynchronous NCCL error, aborts the communicator, which ends the kernels
// stuck on the GPU, and names the op and the peers on stderr and in every
// later op's error.
#ifndef JAXFOG_FFI_NCCL_TRANSPORT_H_
#define JAXFOG_FFI_NCCL_TRANSPORT_H_
#ifdef JAXFOG_WITH_NCCL

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mpi_transport.h"
#include "nccl_api.h"
#include "transport.h"

namespace jaxfog {

// The CUDA event calls the watchdog needs, as a table (the CUDA runtime's in
// the library; host stand-ins in the C++ unit tests, which have no GPU).
struct EventApi {
  cudaError_t (*Create)(cudaEvent_t* event, unsigned int flags);
  cudaError_t (*Record)(cudaEvent_t event, cudaStream_t stream);
  cudaError_t (*Query)(cudaEvent_t event);
  cudaError_t (*Destroy)(cudaEvent_t event);
};
const EventApi* CudaEvents();

// One leaf of a collective: `count` elements of `type` (`bytes` in all).
struct NcclBuffer {
  const void* in;
  void* out;
  size_t count;
  ffi::DataType type;
  size_t bytes;
};

class NcclTransport {
 public:
  // Collective over the ranks of `checks` (which it takes over): every rank
  // passes the same `id` (from ncclGetUniqueId on one rank). `device` is this
  // process's GPU; `timeout_seconds` the watchdog's (JAXFOG_TIMEOUT).
  static ffi::ErrorOr<std::unique_ptr<NcclTransport>> Create(const ncclUniqueId& id, int device,
                                                             std::unique_ptr<MpiTransport> checks,
                                                             double timeout_seconds);
  // Over an initialised communicator, with the given NCCL and event tables.
  NcclTransport(const NcclApi* api, const EventApi* events, ncclComm_t comm,
                std::unique_ptr<MpiTransport> checks, double timeout_seconds);
  // Destroys the communicator after a successful Fence; aborts it otherwise
  // (no fence, a failed one, the watchdog fired or NCCL reported an error),
  // since destroying waits for peers that may be gone.
  ~NcclTransport();
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const { return checks_->rank(); }
  int size() const { return checks_->size(); }
  // The header checks' op counter (as in MPI message headers).
  uint64_t sequence() const { return checks_->sequence(); }

  // Sends every `sends[s]` to its peer and receives every `recvs[j]` from
  // its, as one NCCL group on `stream`.
  ffi::Error Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                      const std::vector<RecvSpec>& recvs, cudaStream_t stream);
  // out = the sum over ranks of in, for each leaf.
  ffi::Error Allreduce(const OpInfo& info, const std::vector<NcclBuffer>& leaves,
                       cudaStream_t stream);
  // out = root's in, for each leaf.
  ffi::Error Broadcast(const OpInfo& info, const std::vector<NcclBuffer>& leaves, int root,
                       cudaStream_t stream);
  // out = every rank's in, in rank order, for each leaf.
  ffi::Error Allgather(const OpInfo& info, const std::vector<NcclBuffer>& leaves,
                       cudaStream_t stream);

  // Shutdown, collective: waits (up to the timeout) for the work enqueued to
  // finish, then a barrier over MPI. Only a fenced transport is destroyed
  // rather than aborted.
  ffi::Error Fence();

 private:
  struct Enqueued {
    cudaEvent_t event;
    std::string what;  // the op and its peers, for the watchdog's error
    std::chrono::steady_clock::time_point enqueued;
  };

  // The watchdog's error once it fired (every later op fails with it).
  ffi::Error Failed();
  // "jaxfog <op> (NCCL, op #<n> on rank <r>, <peers>)", for errors.
  std::string Describe(const OpInfo& info, const std::string& peers) const;
  // Runs `enqueue` between ncclGroupStart and ncclGroupEnd, then records an
  // event after it for the watchdog.
  template <typename Enqueue>
  ffi::Error Grouped(const std::string& what, cudaStream_t stream, Enqueue enqueue);
  // A collective on every leaf: buffers checked, header check, one group
  // in which `enqueue(leaf)` issues each leaf's NCCL call.
  template <typename Enqueue>
  ffi::Error Collective(const OpInfo& info, const std::vector<NcclBuffer>& leaves,
                        const std::string& what, cudaStream_t stream, Enqueue enqueue);
  void Watch();
  // Under mutex_: the oldest enqueued work's state; aborts on a timeout or an
  // NCCL error. Returns whether everything enqueued has finished.
  bool Poll(std::chrono::steady_clock::time_point now);
  void AbortLocked(const std::string& reason);

  const NcclApi* api_;
  const EventApi* events_;
  ncclComm_t comm_;
  std::unique_ptr<MpiTransport> checks_;
  std::chrono::duration<double> timeout_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Enqueued> enqueued_;   // oldest first
  std::vector<cudaEvent_t> spare_;  // finished events, for reuse
  std::string failure_;             // set once, when the communicator is aborted
  bool aborted_ = false;
  bool fenced_ = false;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace jaxfog

#endif  // JAXFOG_WITH_NCCL
#endif  // JAXFOG_FFI_NCCL_TRANSPORT_H_
