#include "mpi_window.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtype.h"
#include "mpi_status.h"
#include "peer_watch.h"

namespace jaxfog {

ffi::ErrorOr<std::unique_ptr<MpiWindow>> MpiWindow::Create(MPI_Comm comm, WindowLayout layout,
                                                           int64_t slots, double timeout_seconds) {
  auto fail = [](int code, const char* call) {
    return ffi::Unexpected<ffi::Error>(CheckMpi(code, std::string("win_create: ") + call));
  };
  int rank = 0, size = 0;
  if (int code = MPI_Comm_rank(comm, &rank); code != MPI_SUCCESS) {
    return fail(code, "MPI_Comm_rank");
  }
  if (int code = MPI_Comm_size(comm, &size); code != MPI_SUCCESS) {
    return fail(code, "MPI_Comm_size");
  }
  const size_t bytes = layout.region_bytes() * static_cast<size_t>(1 + slots);
  if (bytes > static_cast<size_t>(LLONG_MAX)) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument("win_create: too large"));
  }
  // Every rank's slot count, to check a region before touching a peer's window.
  std::vector<int64_t> peer_slots(static_cast<size_t>(size));
  if (int code = MPI_Allgather(&slots, 1, MPI_INT64_T, peer_slots.data(), 1, MPI_INT64_T, comm);
      code != MPI_SUCCESS) {
    return fail(code, "MPI_Allgather");
  }
  char* base = nullptr;
  MPI_Win data = MPI_WIN_NULL;
  if (int code =
          MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, comm, &base, &data);
      code != MPI_SUCCESS) {
    return fail(code, "MPI_Win_allocate");
  }
  int64_t* control_base = nullptr;
  MPI_Win control = MPI_WIN_NULL;
  if (int code = MPI_Win_allocate(static_cast<MPI_Aint>((1 + slots) * sizeof(int64_t)),
                                  sizeof(int64_t), MPI_INFO_NULL, comm, &control_base, &control);
      code != MPI_SUCCESS) {
    MPI_Win_free(&data);
    return fail(code, "MPI_Win_allocate (control)");
  }
  std::fill(control_base, control_base + 1 + slots, 0);
  for (MPI_Win* win : {&data, &control}) {
    if (int code = MPI_Win_set_errhandler(*win, MPI_ERRORS_RETURN); code != MPI_SUCCESS) {
      MPI_Win_free(&data);
      MPI_Win_free(&control);
      return fail(code, "MPI_Win_set_errhandler");
    }
  }
  for (MPI_Win win : {data, control}) {
    if (int code = MPI_Win_lock_all(MPI_MODE_NOCHECK, win); code != MPI_SUCCESS) {
      MPI_Win_free(&data);
      MPI_Win_free(&control);
      return fail(code, "MPI_Win_lock_all");
    }
  }
  // The peer watch init() started, and who this communicator's ranks are to
  // it (goodbyes and failures are by world rank).
  std::shared_ptr<PeerWatch> watch = PeerWatch::Current();
  std::vector<int> world_ranks;
  if (watch != nullptr) {
    ffi::ErrorOr<std::vector<int>> ranks = watch->WorldRanks(comm);
    if (ranks.has_error()) {
      MPI_Win_free(&data);
      MPI_Win_free(&control);
      return ffi::Unexpected<ffi::Error>(
          ffi::Error::Internal("win_create: " + ranks.error().message()));
    }
    world_ranks = std::move(*ranks);
  }
  return std::unique_ptr<MpiWindow>(new MpiWindow(
      std::move(layout), data, base, control, control_base, rank, std::move(peer_slots),
      timeout_seconds, std::move(watch), std::move(world_ranks)));
}

// In MpiWindow's functions returning ffi::Error, with `inside` (InsideMpi)
// and `what` in scope: `call` towards `peer` under the watchdog, and its
// failure as an error naming the op (a peer MPI says died, named so).
#define JAXFOG_WINDOW_CALL(peer, name, call)                    \
  do {                                                          \
    inside.Enter(name, peer);                                   \
    if (int jaxfog_code_ = (call); jaxfog_code_ != MPI_SUCCESS) \
      return MpiFailure(jaxfog_code_, peer, what, name);        \
  } while (false)

std::string MpiWindow::Describe(const char* op, const char* towards, int peer) const {
  return std::string("jaxfog ") + op + " (rank " + std::to_string(rank_) + " " + towards +
         " rank " + std::to_string(peer) + ")";
}

ffi::Error MpiWindow::CheckPeer(int peer, const std::string& what) const {
  if (watch_ == nullptr || peer == rank_ || peer < 0 ||
      static_cast<size_t>(peer) >= scope_.world_ranks.size()) {
    return ffi::Error::Success();
  }
  JAXFOG_RETURN_IF_ERROR(CheckFailedPeers(scope_, what, {peer}));
  // One-sided: no message of its can still be on the way, so no grace as
  // for an exchange; its window is freed, or about to be, once it has left.
  JAXFOG_RETURN_IF_ERROR(watch_->Poll());
  const int world_rank = scope_.world_ranks[peer];
  std::optional<PeerWatch::Departure> gone = watch_->Gone(world_rank);
  if (!gone) return ffi::Error::Success();
  NoteCommFailure();  // the exit is bounded: MPI_Finalize may wait for it
  std::string rank = "rank " + std::to_string(peer);
  if (world_rank != peer) rank += " (world rank " + std::to_string(world_rank) + ")";
  return ffi::Error(ffi::ErrorCode::kUnavailable,
                    what + ": " + rank +
                        (gone->reason == PeerWatch::Reason::kShutdown
                             ? " has left: it called jaxfog.shutdown()"
                             : " has left: its program ended (jaxfog.shutdown at exit)") +
                        "; its window goes with it, so jaxfog accesses it no more");
}

ffi::Error MpiWindow::MpiFailure(int code, int peer, const std::string& what,
                                 const char* call) const {
  // Open MPI's ULFM fails an access to a dead process (MPI_ERR_PROC_FAILED):
  // ask MPI which ranks died, and name this one if it is among them.
  if (watch_ != nullptr && IsProcessFailure(code)) {
    NoteCommFailure();
    watch_->LearnFailures();
    if (ffi::Error failed = CheckFailedPeers(scope_, what, {peer}); !failed.success()) {
      return ffi::Error(ffi::ErrorCode::kUnavailable,
                        failed.message() + " (MPI: " + call + ": " + MpiErrorString(code) + ")");
    }
  }
  return CheckMpi(code, what + ": " + call);
}

MpiWindow::~MpiWindow() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) {
    for (MPI_Win* win : {&control_, &data_}) {
      MPI_Win_unlock_all(*win);
      MPI_Win_free(win);
    }
  }
}

ffi::Error MpiWindow::CheckRegion(int peer, int64_t region) const {
  if (peer < 0 || static_cast<size_t>(peer) >= peer_slots_.size() || region < 0 ||
      region > peer_slots_[peer]) {
    return ffi::Error::InvalidArgument("jaxfog window: region " + std::to_string(region) +
                                       " of rank " + std::to_string(peer) + " out of range");
  }
  return ffi::Error::Success();
}

ffi::Error MpiWindow::Put(int peer, int64_t region, const std::vector<TypedRun>& runs,
                          bool accumulate, bool count) {
  JAXFOG_RETURN_IF_ERROR(CheckRegion(peer, region));
  const std::string what = Describe(accumulate ? "win_accumulate" : "win_put", "to", peer);
  JAXFOG_RETURN_IF_ERROR(CheckPeer(peer, what));
  InsideMpi inside(what, timeout_seconds_);  // a call to a dead rank that never returns
  const MPI_Aint start = static_cast<MPI_Aint>(region * region_bytes());
  for (const TypedRun& run : runs) {
    if (run.bytes == 0) continue;
    const MPI_Aint at = start + static_cast<MPI_Aint>(run.offset);
    if (!accumulate) {
      if (run.bytes > INT_MAX) {
        return ffi::Error::InvalidArgument(what + ": a leaf over 2 GB");
      }
      const int n = static_cast<int>(run.bytes);
      JAXFOG_WINDOW_CALL(peer, "MPI_Put",
                         MPI_Put(run.data, n, MPI_BYTE, peer, at, n, MPI_BYTE, data_));
      continue;
    }
    const MPI_Datatype type = MpiType(run.type);
    if (type == MPI_DATATYPE_NULL || run.type == ffi::DataType::F16 ||
        run.type == ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument(what + ": dtype " + DTypeName(run.type) +
                                         " cannot be accumulated by MPI");
    }
    const size_t count = run.bytes / ffi::ByteWidth(run.type);
    if (count > INT_MAX) return ffi::Error::InvalidArgument(what + ": a leaf too large");
    const int n = static_cast<int>(count);
    JAXFOG_WINDOW_CALL(peer, "MPI_Accumulate",
                       MPI_Accumulate(run.data, n, type, peer, at, n, type, MPI_SUM, data_));
  }
  JAXFOG_WINDOW_CALL(peer, "MPI_Win_flush", MPI_Win_flush(peer, data_));
  if (count) JAXFOG_RETURN_IF_ERROR(Count(peer, region, what, inside));
  return ffi::Error::Success();
}

ffi::Error MpiWindow::Get(int peer, int64_t region, void* out) {
  JAXFOG_RETURN_IF_ERROR(CheckRegion(peer, region));
  const std::string what = Describe("win_get", "from", peer);
  if (region_bytes() > INT_MAX) return ffi::Error::InvalidArgument(what + ": over 2 GB");
  JAXFOG_RETURN_IF_ERROR(CheckPeer(peer, what));
  InsideMpi inside(what, timeout_seconds_);
  const int n = static_cast<int>(region_bytes());
  JAXFOG_WINDOW_CALL(peer, "MPI_Get",
                     MPI_Get(out, n, MPI_BYTE, peer, static_cast<MPI_Aint>(region * region_bytes()),
                             n, MPI_BYTE, data_));
  JAXFOG_WINDOW_CALL(peer, "MPI_Win_flush", MPI_Win_flush(peer, data_));
  return ffi::Error::Success();
}

ffi::Error MpiWindow::Local(const std::function<ffi::Error(char* base)>& access) {
  // The unified memory model: MPI_Win_sync orders our loads and stores with
  // the completed remote accesses (before) and for later remote reads (after).
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_sync(data_), "jaxfog window: MPI_Win_sync");
  JAXFOG_RETURN_IF_ERROR(access(base_));
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_sync(data_), "jaxfog window: MPI_Win_sync");
  return ffi::Error::Success();
}

ffi::Error MpiWindow::CountVersion(int peer, int64_t region) {
  JAXFOG_RETURN_IF_ERROR(CheckRegion(peer, region));
  const std::string what = Describe("win_get", "counting a version on", peer);
  JAXFOG_RETURN_IF_ERROR(CheckPeer(peer, what));
  InsideMpi inside(what, timeout_seconds_);
  return Count(peer, region, what, inside);
}

ffi::Error MpiWindow::Count(int peer, int64_t region, const std::string& what, InsideMpi& inside) {
  JAXFOG_RETURN_IF_ERROR(CheckRegion(peer, region));
  const int64_t one = 1;
  JAXFOG_WINDOW_CALL(
      peer, "MPI_Accumulate (version count)",
      MPI_Accumulate(&one, 1, MPI_INT64_T, peer, region, 1, MPI_INT64_T, MPI_SUM, control_));
  JAXFOG_WINDOW_CALL(peer, "MPI_Win_flush (version count)", MPI_Win_flush(peer, control_));
  return ffi::Error::Success();
}

ffi::Error MpiWindow::ReadVersions(int64_t* versions) {
  const int64_t unused = 0;
  for (int64_t s = 0; s < slots(); ++s) {
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Fetch_and_op(&unused, versions + s, MPI_INT64_T, rank_, 1 + s, MPI_NO_OP, control_),
        "jaxfog window: MPI_Fetch_and_op (versions)");
  }
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_flush(rank_, control_), "jaxfog window: MPI_Win_flush");
  return ffi::Error::Success();
}

ffi::Error MpiWindow::ResetVersions(const std::vector<int64_t>& regions) {
  const int64_t zero = 0;
  for (int64_t region : regions) {
    JAXFOG_RETURN_IF_ERROR(CheckRegion(rank_, region));
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Accumulate(&zero, 1, MPI_INT64_T, rank_, region, 1, MPI_INT64_T, MPI_REPLACE, control_),
        "jaxfog window: MPI_Accumulate (versions)");
  }
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_flush(rank_, control_), "jaxfog window: MPI_Win_flush");
  return ffi::Error::Success();
}

ffi::ErrorOr<bool> MpiWindow::TryAcquire(int peer, const std::string& what, InsideMpi& inside) {
  // The mutex is the low 32-bit half of control word 0 (the high half stays 0),
  // and every access to it is 32-bit: Open MPI <= 4.1.4's osc/rdma (the
  // default one-sided component on one node) runs a 64-bit compare-and-swap
  // as a BTL atomic even when the target's window is mapped in this process;
  // btl/vader emulates that atomic by sending the address *as mapped here* to
  // the target, which dereferences it in its own address space: SIGSEGV
  // (open-mpi/ompi#7967, fixed in 4.1.5 by "RDMA osc: perform CAS in shared
  // memory if possible"). A 32-bit compare-and-swap is done in shared memory
  // under osc/rdma's accumulate lock instead, and is atomic on every MPI.
  const int32_t free = 0, mine = 1 + rank_;
  int32_t found = -1;
  auto attempt = [&]() -> ffi::Error {
    JAXFOG_WINDOW_CALL(peer, "MPI_Compare_and_swap",
                       MPI_Compare_and_swap(&mine, &free, &found, MPI_INT32_T, peer, 0, control_));
    JAXFOG_WINDOW_CALL(peer, "MPI_Win_flush", MPI_Win_flush(peer, control_));
    inside.Leave();
    return ffi::Error::Success();
  };
  if (ffi::Error error = attempt(); !error.success()) return ffi::Unexpected<ffi::Error>(error);
  return found == free;
}

ffi::Error MpiWindow::Acquire(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<int> taken;
  // Gives back what this call took, on an error path.
  auto fail = [&](ffi::Error error) {
    Release(taken);
    return error;
  };
  for (int peer : ranks) {
    if (ffi::Error bad = CheckRegion(peer, 0); !bad.success()) return fail(std::move(bad));
    std::lock_guard<std::mutex> taking(taking_[peer]);  // see taking_
    {
      std::lock_guard<std::mutex> guard(held_mutex_);
      if (auto it = held_.find(peer); it != held_.end()) {
        ++it->second;
        taken.push_back(peer);
        continue;
      }
    }
    const std::string what = Describe("win_mutex", "taking the mutex of", peer);
    if (ffi::Error gone = CheckPeer(peer, what); !gone.success()) return fail(std::move(gone));
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    Clock::time_point next_check = start;
    auto pause = std::chrono::microseconds(20);
    const EndableWait endable;  // Ctrl-C and SIGTERM while the mutex is held elsewhere
    InsideMpi inside(what, timeout_seconds_);
    const std::string waiting = "the mutex of rank " + std::to_string(peer);
    while (true) {
      ffi::ErrorOr<bool> got = TryAcquire(peer, what, inside);
      if (got.has_error()) return fail(got.error());
      if (*got) break;
      if (endable.Interrupted()) return fail(InterruptedError(what, waiting));
      if (EndRequested()) {
        EndNow(what +
               ": this process got SIGTERM (a launcher ending the job sends it) "
               "while waiting for " +
               waiting + "; it ends now");
      }
      const Clock::time_point now = Clock::now();
      if (timeout_seconds_ > 0 &&
          std::chrono::duration<double>(now - start).count() > timeout_seconds_) {
        NoteCommFailure();
        return fail(ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                               what + ": waited more than " + std::to_string(timeout_seconds_) +
                                   " s (JAXFOG_TIMEOUT) for " + waiting));
      }
      if (now >= next_check) {  // the rank may leave (or die) while we wait
        next_check = now + std::chrono::milliseconds(100);
        if (ffi::Error gone = CheckPeer(peer, what); !gone.success()) {
          return fail(std::move(gone));
        }
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    std::lock_guard<std::mutex> guard(held_mutex_);
    held_.emplace(peer, 1);
    taken.push_back(peer);
  }
  return ffi::Error::Success();
}

ffi::Error MpiWindow::Release(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  ffi::Error result = ffi::Error::Success();
  for (int peer : ranks) {
    {
      std::lock_guard<std::mutex> guard(held_mutex_);
      auto it = held_.find(peer);
      if (it == held_.end() || it->second == 0) continue;  // not held: nothing to give back
      if (--it->second > 0) continue;
      held_.erase(it);
    }
    const std::string what = Describe("win_mutex", "releasing the mutex of", peer);
    // A rank that left or failed: nothing is posted to it (its mutex is gone).
    if (ffi::Error gone = CheckPeer(peer, what); !gone.success()) {
      result = std::move(gone);
      continue;
    }
    InsideMpi inside(what, timeout_seconds_);
    auto release = [&]() -> ffi::Error {
      const int32_t free = 0;  // 32-bit like TryAcquire's compare-and-swap (atomicity
      int32_t previous = 0;    // holds only between accesses of one basic type)
      JAXFOG_WINDOW_CALL(
          peer, "MPI_Fetch_and_op",
          MPI_Fetch_and_op(&free, &previous, MPI_INT32_T, peer, 0, MPI_REPLACE, control_));
      JAXFOG_WINDOW_CALL(peer, "MPI_Win_flush", MPI_Win_flush(peer, control_));
      return ffi::Error::Success();
    };
    if (ffi::Error error = release(); !error.success()) result = std::move(error);
  }
  return result;
}

#undef JAXFOG_WINDOW_CALL

}  // namespace jaxfog
