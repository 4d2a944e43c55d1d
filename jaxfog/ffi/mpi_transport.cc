#include "mpi_transport.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "status.h"

namespace jaxfog {

MpiTransport::MpiTransport(MPI_Comm comm, double timeout_seconds)
    : comm_(comm), timeout_seconds_(timeout_seconds) {
  // Validity of `comm` was checked by the registry before construction.
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

ffi::Error MpiTransport::Barrier() {
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  if (ffi::Error err = CheckMpi(MPI_Ibarrier(comm_, &requests[0]), "MPI_Ibarrier");
      !err.success()) {
    return err;
  }
  return WaitAll(requests, "barrier");
}

ffi::Error MpiTransport::WaitAll(std::vector<MPI_Request>& requests,
                                 const std::string& what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Spin briefly for latency, then back off so that oversubscribed ranks
  // (more ranks than cores) leave the CPU to the peers they wait for.
  auto pause = std::chrono::microseconds(0);
  constexpr auto kMaxPause = std::chrono::microseconds(1000);
  for (int polls = 0;; ++polls) {
    int done = 0;
    if (ffi::Error err = CheckMpi(
            MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                        MPI_STATUSES_IGNORE),
            "MPI_Testall in " + what);
        !err.success()) {
      return err;
    }
    if (done) return ffi::Error::Success();
    if (timeout_seconds_ > 0 &&
        std::chrono::duration<double>(Clock::now() - start).count() > timeout_seconds_) {
      char seconds[32];
      std::snprintf(seconds, sizeof(seconds), "%g", timeout_seconds_);
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        "jaxfog: " + what + " on rank " + std::to_string(rank_) +
                            " timed out after " + seconds +
                            " s (JAXFOG_TIMEOUT): a peer died, or ranks called "
                            "different operations");
    }
    if (polls > 1000) {
      pause = std::min(kMaxPause, pause + std::chrono::microseconds(10));
      std::this_thread::sleep_for(pause);
    }
  }
}

}  // namespace jaxfog
