// MPI requests owned until they complete, and the wait for them: it fails
// at JAXFOG_TIMEOUT, says what it waits for at JAXFOG_WARN_AFTER, and fails
// soon after a rank it waits for has left (the peer watch).
#ifndef JAXFOG_FFI_MPI_REQUESTS_H_
#define JAXFOG_FFI_MPI_REQUESTS_H_

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "peer_watch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

// What a wait needs besides its requests: its limit, and who the ranks of
// its communicator are (to name them, and to check whether they have left).
struct WaitScope {
  double timeout_seconds = 0;          // JAXFOG_TIMEOUT; 0: forever
  PeerWatch* watch = nullptr;          // null: no departure checks, no warning
  std::vector<int> world_ranks;        // of each rank of the communicator (with a watch)
  int64_t comm_id = 0;                 // the runtime's id of the communicator
  int rank = 0;                        // this rank in the communicator
  const uint64_t* sequence = nullptr;  // the op number of the current op
};

// The rank of an owner whose requests wait for every other rank of the
// communicator (a collective).
constexpr int kEveryone = -1;

// Fails (kUnavailable) if one of `comm_ranks` (ranks of the scope's
// communicator; empty: every other rank) is known to have failed (the peer
// watch's MarkFailed, or the launcher's notice): an op checks this before it
// posts anything, since MPI may crash sending to a dead process. Success
// without a watch.
ffi::Error CheckFailedPeers(const WaitScope& scope, const std::string& what,
                            const std::vector<int>& comm_ranks = {});

// MPI requests, owned until they complete. Owners say what the requests are
// for, so that a timeout says which peers never answered and a long wait
// knows which ranks it waits for: request i is for owners[min(i, last)]
// (requests that all wait for the same ranks name them once).
//
// Destroying a set with requests still pending (an error path) abandons
// them. Their receive buffers are about to be reused, so cancellations are
// given up to a second to complete (a cancelled receive completes at once);
// what is still pending after that (a send that cannot be cancelled) is
// released to finish on its own. Declare a set after the buffers it uses.
class RequestSet {
 public:
  using Finished = std::function<ffi::Error(const int* indices, int count)>;
  struct Owner {
    std::string text;
    int rank;  // in the communicator, or kEveryone
  };

  RequestSet() = default;
  explicit RequestSet(std::string owner, int rank = kEveryone) {
    owners_.push_back({std::move(owner), rank});
  }
  RequestSet(const RequestSet&) = delete;
  RequestSet& operator=(const RequestSet&) = delete;
  ~RequestSet();

  // A null request to post into, for the last owner given.
  MPI_Request* Add() { return &requests_.emplace_back(MPI_REQUEST_NULL); }
  MPI_Request* Add(std::string owner, int rank) {
    owners_.push_back({std::move(owner), rank});
    return Add();
  }
  size_t size() const { return requests_.size(); }

  // Completes every request (each becomes MPI_REQUEST_NULL), or fails once
  // `scope.timeout_seconds` (> 0) have passed, or soon after a rank that a
  // pending request waits for has left (with `scope.watch`). With
  // `done_at`, it also records when each request completed (timeline::Now();
  // for the timeline). `finished(indices, count)`, when given, runs as
  // requests complete.
  ffi::Error WaitAll(const WaitScope& scope, const std::string& what,
                     std::vector<int64_t>* done_at = nullptr, const Finished& finished = nullptr);

 private:
  // Every rank this set's requests are for (kEveryone: every other rank).
  std::vector<int> Peers(const WaitScope& scope) const;
  // The error of a wait whose MPI_Testsome failed with `code`: a peer known
  // to have died (asked of MPI), named, or else MPI's error.
  ffi::Error FailedWait(const WaitScope& scope, const std::string& what, int code);
  using Clock = std::chrono::steady_clock;
  // The owners of the requests still pending, in words ("rank 1, the header
  // to rank 2").
  std::string Waiting() const;
  // The ranks the pending requests wait for (kEveryone: every other rank).
  std::vector<int> WaitedFor(const WaitScope& scope) const;
  // The first rank a pending request waits for that has left, after a
  // moment's grace for its last messages, or that failed (CheckFailedPeers),
  // as an error; success otherwise.
  ffi::Error CheckDepartures(const WaitScope& scope, const std::string& what,
                             Clock::time_point start) const;

  std::vector<MPI_Request> requests_;
  std::vector<Owner> owners_;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_MPI_REQUESTS_H_
