#include "mpi_window.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtype.h"
#include "mpi_status.h"
#include "peer_watch.h"

namespace jaxfog {

ffi::ErrorOr<std::unique_ptr<MpiWindow>> MpiWindow::Create(MPI_Comm comm, WindowLayout layout,
                                                           int64_t slots,
                                                           double timeout_seconds) {
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
  if (int code = MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, comm, &base,
                                  &data);
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
  return std::unique_ptr<MpiWindow>(new MpiWindow(std::move(layout), data, base, control,
                                                  control_base, rank, std::move(peer_slots),
                                                  timeout_seconds));
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
  const std::string what = std::string(accumulate ? "win_accumulate" : "win_put") +
                           " to rank " + std::to_string(peer);
  const MPI_Aint start = static_cast<MPI_Aint>(region * region_bytes());
  for (const TypedRun& run : runs) {
    if (run.bytes == 0) continue;
    const MPI_Aint at = start + static_cast<MPI_Aint>(run.offset);
    if (!accumulate) {
      if (run.bytes > INT_MAX) {
        return ffi::Error::InvalidArgument(what + ": a leaf over 2 GB");
      }
      const int n = static_cast<int>(run.bytes);
      JAXFOG_RETURN_IF_MPI_ERROR(MPI_Put(run.data, n, MPI_BYTE, peer, at, n, MPI_BYTE, data_),
                                 what + ": MPI_Put");
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
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Accumulate(run.data, n, type, peer, at, n, type, MPI_SUM, data_),
        what + ": MPI_Accumulate");
  }
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_flush(peer, data_), what + ": MPI_Win_flush");
  if (count) JAXFOG_RETURN_IF_ERROR(CountVersion(peer, region));
  return ffi::Error::Success();
}

ffi::Error MpiWindow::Get(int peer, int64_t region, void* out) {
  JAXFOG_RETURN_IF_ERROR(CheckRegion(peer, region));
  const std::string what = "win_get from rank " + std::to_string(peer);
  if (region_bytes() > INT_MAX) return ffi::Error::InvalidArgument(what + ": over 2 GB");
  const int n = static_cast<int>(region_bytes());
  JAXFOG_RETURN_IF_MPI_ERROR(
      MPI_Get(out, n, MPI_BYTE, peer, static_cast<MPI_Aint>(region * region_bytes()), n,
              MPI_BYTE, data_),
      what + ": MPI_Get");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_flush(peer, data_), what + ": MPI_Win_flush");
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
  const std::string what = "jaxfog window: version count on rank " + std::to_string(peer);
  const int64_t one = 1;
  JAXFOG_RETURN_IF_MPI_ERROR(
      MPI_Accumulate(&one, 1, MPI_INT64_T, peer, region, 1, MPI_INT64_T, MPI_SUM, control_),
      what + ": MPI_Accumulate");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_flush(peer, control_), what + ": MPI_Win_flush");
  return ffi::Error::Success();
}

ffi::Error MpiWindow::ReadVersions(int64_t* versions) {
  const int64_t unused = 0;
  for (int64_t s = 0; s < slots(); ++s) {
    JAXFOG_RETURN_IF_MPI_ERROR(MPI_Fetch_and_op(&unused, versions + s, MPI_INT64_T, rank_,
                                                1 + s, MPI_NO_OP, control_),
                               "jaxfog window: MPI_Fetch_and_op (versions)");
  }
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_flush(rank_, control_), "jaxfog window: MPI_Win_flush");
  return ffi::Error::Success();
}

ffi::Error MpiWindow::ResetVersions(const std::vector<int64_t>& regions) {
  const int64_t zero = 0;
  for (int64_t region : regions) {
    JAXFOG_RETURN_IF_ERROR(CheckRegion(rank_, region));
    JAXFOG_RETURN_IF_MPI_ERROR(MPI_Accumulate(&zero, 1, MPI_INT64_T, rank_, region, 1,
                                              MPI_INT64_T, MPI_REPLACE, control_),
                               "jaxfog window: MPI_Accumulate (versions)");
  }
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_flush(rank_, control_), "jaxfog window: MPI_Win_flush");
  return ffi::Error::Success();
}

ffi::ErrorOr<bool> MpiWindow::TryAcquire(int peer) {
  const std::string what = "win_mutex of rank " + std::to_string(peer);
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
  if (int code = MPI_Compare_and_swap(&mine, &free, &found, MPI_INT32_T, peer, 0, control_);
      code != MPI_SUCCESS) {
    return ffi::Unexpected<ffi::Error>(CheckMpi(code, what + ": MPI_Compare_and_swap"));
  }
  if (int code = MPI_Win_flush(peer, control_); code != MPI_SUCCESS) {
    return ffi::Unexpected<ffi::Error>(CheckMpi(code, what + ": MPI_Win_flush"));
  }
  return found == free;
}

ffi::Error MpiWindow::Acquire(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<int> taken;
  for (int peer : ranks) {
    if (ffi::Error bad = CheckRegion(peer, 0); !bad.success()) {
      Release(taken);
      return bad;
    }
    std::lock_guard<std::mutex> taking(taking_[peer]);  // see taking_
    {
      std::lock_guard<std::mutex> guard(held_mutex_);
      if (auto it = held_.find(peer); it != held_.end()) {
        ++it->second;
        taken.push_back(peer);
        continue;
      }
    }
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    auto pause = std::chrono::microseconds(20);
    while (true) {
      ffi::ErrorOr<bool> got = TryAcquire(peer);
      if (got.has_error() || *got) {
        if (got.has_error()) {
          Release(taken);
          return got.error();
        }
        break;
      }
      if (timeout_seconds_ > 0 &&
          std::chrono::duration<double>(Clock::now() - start).count() > timeout_seconds_) {
        Release(taken);
        NoteCommFailure();
        return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                          "jaxfog win_mutex: rank " + std::to_string(rank_) +
                              " waited more than " + std::to_string(timeout_seconds_) +
                              " s (JAXFOG_TIMEOUT) for the mutex of rank " +
                              std::to_string(peer));
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
    const std::string what = "win_mutex release on rank " + std::to_string(peer);
    const int32_t free = 0;  // 32-bit like TryAcquire's compare-and-swap (atomicity
    int32_t previous = 0;    // holds only between accesses of one basic type)
    if (int code = MPI_Fetch_and_op(&free, &previous, MPI_INT32_T, peer, 0, MPI_REPLACE,
                                    control_);
        code != MPI_SUCCESS) {
      result = CheckMpi(code, what + ": MPI_Fetch_and_op");
      continue;
    }
    if (int code = MPI_Win_flush(peer, control_); code != MPI_SUCCESS) {
      result = CheckMpi(code, what + ": MPI_Win_flush");
    }
  }
  return result;
}

}  // namespace jaxfog
