// A window over MPI-3 RMA: MPI_Win_allocate'd memory, one passive-target
// epoch for the window's life (MPI_Win_lock_all at creation), each operation
// completed with MPI_Win_flush. Per-operation MPI_Win_lock/unlock would make
// a write wait until its target enters MPI (measured with MPICH: a put to a
// rank computing for 1 ms took 1 ms), which is not one-sided.
//
// Failed peers: every access to another rank's window first checks with the
// peer watch that the rank has neither left (its goodbye) nor failed (an op
// timed out waiting for it, or the launcher or MPI said it died), and fails
// at once naming the op and the rank; and each MPI call towards a peer runs
// under the watchdog of MPI calls (InsideMpi, peer_watch.h), which ends the
// process when one has not returned JAXFOG_TIMEOUT + 2 s after it began. A
// flush may legitimately wait for a live target where the transport needs
// the target's progress for RMA (no shared memory, no progress thread): the
// same bound then applies as to a peer that does not answer a message, so a
// rank that spends longer than JAXFOG_TIMEOUT outside MPI needs a larger
// JAXFOG_TIMEOUT (docs/launching.rst).
#ifndef JAXFOG_FFI_MPI_WINDOW_H_
#define JAXFOG_FFI_MPI_WINDOW_H_

#include <mpi.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "mpi_requests.h"
#include "peer_watch.h"
#include "window.h"

namespace jaxfog {

class MpiWindow final : public Window {
 public:
  // Collective over `comm`: every rank allocates (1 + slots) regions and
  // (1 + slots) control words, in two MPI windows. The mutex gives up after
  // `timeout_seconds` (0: never).
  static ffi::ErrorOr<std::unique_ptr<MpiWindow>> Create(MPI_Comm comm, WindowLayout layout,
                                                         int64_t slots, double timeout_seconds);
  // Collective: ends the epochs and frees the MPI windows (MPI_Win_free
  // waits for every rank).
  ~MpiWindow() override;

  int rank() const override { return rank_; }
  int64_t slots() const override { return peer_slots_[rank_]; }

  ffi::Error Put(int peer, int64_t region, const std::vector<TypedRun>& runs, bool accumulate,
                 bool count) override;
  ffi::Error Get(int peer, int64_t region, void* out) override;
  ffi::Error Local(const std::function<ffi::Error(char* base)>& access) override;
  ffi::Error CountVersion(int peer, int64_t region) override;
  ffi::Error ReadVersions(int64_t* versions) override;
  ffi::Error ResetVersions(const std::vector<int64_t>& regions) override;
  ffi::Error Acquire(std::vector<int> ranks) override;
  ffi::Error Release(std::vector<int> ranks) override;

 private:
  MpiWindow(WindowLayout layout, MPI_Win data, char* base, MPI_Win control, int64_t* control_base,
            int rank, std::vector<int64_t> peer_slots, double timeout_seconds,
            std::shared_ptr<PeerWatch> watch, std::vector<int> world_ranks)
      : Window(std::move(layout)),
        data_(data),
        base_(base),
        control_(control),
        control_base_(control_base),
        rank_(rank),
        peer_slots_(std::move(peer_slots)),
        timeout_seconds_(timeout_seconds),
        watch_(std::move(watch)),
        taking_(peer_slots_.size()) {
    scope_.timeout_seconds = timeout_seconds;
    scope_.watch = watch_.get();
    scope_.world_ranks = std::move(world_ranks);
    scope_.rank = rank;
  }
  ffi::Error CheckRegion(int peer, int64_t region) const;
  // "jaxfog win_put (rank 0 to rank 1)": an op towards `peer`, for errors
  // and the watchdog.
  std::string Describe(const char* op, const char* towards, int peer) const;
  // Fails (kUnavailable) if `peer` has left or is known to have failed: its
  // window is gone, or MPI may hang or crash accessing it.
  ffi::Error CheckPeer(int peer, const std::string& what) const;
  // Tries once to take `peer`'s mutex; true when taken.
  ffi::ErrorOr<bool> TryAcquire(int peer, const std::string& what, InsideMpi& inside);
  // Adds 1 to `peer`'s version count of `region` (for op `what`).
  ffi::Error Count(int peer, int64_t region, const std::string& what, InsideMpi& inside);
  // The error of MPI call `call` towards `peer` that returned `code`: the
  // peer named as failed where MPI says it died (ULFM), else MPI's error.
  ffi::Error MpiFailure(int code, int peer, const std::string& what, const char* call) const;

  MPI_Win data_;
  char* base_;
  MPI_Win control_;
  int64_t* control_base_;
  int rank_;
  std::vector<int64_t> peer_slots_;  // every rank's slot count
  double timeout_seconds_;
  std::shared_ptr<PeerWatch> watch_;  // null: no checks (no watch at win_create)
  WaitScope scope_;                   // for CheckFailedPeers: world ranks, this rank
  // Acquire and Release come from two threads: the communication thread (ops
  // with require_mutex) and Python (win_mutex). Taking a peer's mutex is one
  // step under taking_[peer]: look at held_, compare-and-swap until taken,
  // record it in held_. Were the look and the record separate, both threads
  // could find it not held here, and the one that lost the compare-and-swap
  // would wait for its own rank until the timeout. held_mutex_ guards held_
  // alone (Release takes only it, so it never waits behind a spinning Acquire).
  std::vector<std::mutex> taking_;  // one per rank of the communicator
  std::mutex held_mutex_;
  std::map<int, int> held_;  // mutexes this rank holds, with their hold counts
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_MPI_WINDOW_H_
