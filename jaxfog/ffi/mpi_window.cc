#include "mpi_window.h"

#include <climits>
#include <string>
#include <utility>
#include <vector>

#include "dtype.h"
#include "mpi_status.h"

namespace jaxfog {
namespace {

// Holds a passive-target lock on one rank's window for a scope: released on
// every path (MPI_Win_unlock also completes the operations at the target).
class ScopedLock {
 public:
  ScopedLock(MPI_Win win, int lock_type, int rank) : win_(win), rank_(rank) {
    code_ = MPI_Win_lock(lock_type, rank, 0, win);
  }
  ScopedLock(const ScopedLock&) = delete;
  ScopedLock& operator=(const ScopedLock&) = delete;
  int code() const { return code_; }
  // Ends the epoch, returning MPI's code (after which the destructor does nothing).
  int Unlock() {
    if (code_ != MPI_SUCCESS) return code_;
    code_ = -1;
    return MPI_Win_unlock(rank_, win_);
  }
  ~ScopedLock() {
    if (code_ == MPI_SUCCESS) MPI_Win_unlock(rank_, win_);  // an error is already returned
  }

 private:
  MPI_Win win_;
  int rank_;
  int code_;
};

}  // namespace

ffi::ErrorOr<std::unique_ptr<MpiWindow>> MpiWindow::Create(MPI_Comm comm, size_t region_bytes,
                                                           int64_t slots) {
  auto fail = [](int code, const char* call) {
    return ffi::Unexpected<ffi::Error>(CheckMpi(code, std::string("win_create: ") + call));
  };
  int rank = 0;
  if (int code = MPI_Comm_rank(comm, &rank); code != MPI_SUCCESS) {
    return fail(code, "MPI_Comm_rank");
  }
  const size_t bytes = region_bytes * static_cast<size_t>(1 + slots);
  if (bytes > static_cast<size_t>(LLONG_MAX)) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument("win_create: too large"));
  }
  // Every rank's slot count, to check a region before touching a peer's window.
  int size = 0;
  if (int code = MPI_Comm_size(comm, &size); code != MPI_SUCCESS) {
    return fail(code, "MPI_Comm_size");
  }
  std::vector<int64_t> peer_slots(static_cast<size_t>(size));
  if (int code = MPI_Allgather(&slots, 1, MPI_INT64_T, peer_slots.data(), 1, MPI_INT64_T, comm);
      code != MPI_SUCCESS) {
    return fail(code, "MPI_Allgather");
  }
  char* base = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  if (int code = MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, comm, &base,
                                  &win);
      code != MPI_SUCCESS) {
    return fail(code, "MPI_Win_allocate");
  }
  if (int code = MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN); code != MPI_SUCCESS) {
    MPI_Win_free(&win);
    return fail(code, "MPI_Win_set_errhandler");
  }
  return std::unique_ptr<MpiWindow>(
      new MpiWindow(win, base, rank, region_bytes, std::move(peer_slots)));
}

MpiWindow::~MpiWindow() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Win_free(&win_);
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
                          bool accumulate) {
  JAXFOG_RETURN_IF_ERROR(CheckRegion(peer, region));
  const std::string what = std::string(accumulate ? "win_accumulate" : "win_put") +
                           " to rank " + std::to_string(peer);
  ScopedLock lock(win_, MPI_LOCK_SHARED, peer);
  JAXFOG_RETURN_IF_MPI_ERROR(lock.code(), what + ": MPI_Win_lock");
  const MPI_Aint start = static_cast<MPI_Aint>(region * region_bytes_);
  for (const TypedRun& run : runs) {
    if (run.bytes == 0) continue;
    const MPI_Aint at = start + static_cast<MPI_Aint>(run.offset);
    if (!accumulate) {
      if (run.bytes > INT_MAX) {
        return ffi::Error::InvalidArgument(what + ": a leaf over 2 GB");
      }
      const int n = static_cast<int>(run.bytes);
      JAXFOG_RETURN_IF_MPI_ERROR(MPI_Put(run.data, n, MPI_BYTE, peer, at, n, MPI_BYTE, win_),
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
        MPI_Accumulate(run.data, n, type, peer, at, n, type, MPI_SUM, win_),
        what + ": MPI_Accumulate");
  }
  JAXFOG_RETURN_IF_MPI_ERROR(lock.Unlock(), what + ": MPI_Win_unlock");
  return ffi::Error::Success();
}

ffi::Error MpiWindow::Get(int peer, int64_t region, void* out) {
  JAXFOG_RETURN_IF_ERROR(CheckRegion(peer, region));
  const std::string what = "win_get from rank " + std::to_string(peer);
  if (region_bytes_ > INT_MAX) return ffi::Error::InvalidArgument(what + ": over 2 GB");
  const int n = static_cast<int>(region_bytes_);
  ScopedLock lock(win_, MPI_LOCK_SHARED, peer);
  JAXFOG_RETURN_IF_MPI_ERROR(lock.code(), what + ": MPI_Win_lock");
  JAXFOG_RETURN_IF_MPI_ERROR(
      MPI_Get(out, n, MPI_BYTE, peer, static_cast<MPI_Aint>(region * region_bytes_), n,
              MPI_BYTE, win_),
      what + ": MPI_Get");
  JAXFOG_RETURN_IF_MPI_ERROR(lock.Unlock(), what + ": MPI_Win_unlock");
  return ffi::Error::Success();
}

ffi::Error MpiWindow::Local(const std::function<ffi::Error(char* base)>& access) {
  // An exclusive lock on our own window keeps remote puts out while we read
  // and write it; MPI_Win_sync makes their completed writes visible.
  ScopedLock lock(win_, MPI_LOCK_EXCLUSIVE, rank_);
  JAXFOG_RETURN_IF_MPI_ERROR(lock.code(), "jaxfog window: MPI_Win_lock (local)");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_sync(win_), "jaxfog window: MPI_Win_sync");
  JAXFOG_RETURN_IF_ERROR(access(base_));
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Win_sync(win_), "jaxfog window: MPI_Win_sync");
  JAXFOG_RETURN_IF_MPI_ERROR(lock.Unlock(), "jaxfog window: MPI_Win_unlock (local)");
  return ffi::Error::Success();
}

}  // namespace jaxfog
