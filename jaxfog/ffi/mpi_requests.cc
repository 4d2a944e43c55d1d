#include "mpi_requests.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "mpi_status.h"
#include "ops.h"
#include "timeline.h"

namespace jaxfog {

namespace {

std::string Seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds);
  return text;
}

// Why `comm_rank` (world rank `world_rank`) left, as the sentence an error
// shows: who, why, after which op on this communicator, and what it means
// for this op (number `sequence`).
std::string Departed(const WaitScope& scope, int comm_rank, int world_rank,
                     const PeerWatch::Departure& departure, uint64_t sequence) {
  std::string text = "rank " + std::to_string(comm_rank);
  if (world_rank != comm_rank) text += " (world rank " + std::to_string(world_rank) + ")";
  text += departure.reason == PeerWatch::Reason::kShutdown
              ? " has left: it called jaxfog.shutdown()"
              : " has left: its program ended (jaxfog.shutdown at exit)";
  const PeerWatch::LastOp* last = nullptr;
  for (const PeerWatch::LastOp& op : departure.last) {
    if (op.comm_id == scope.comm_id) last = &op;
  }
  const char* failed = departure.after_failure ? ". An op of its had failed" : "";
  if (last == nullptr) return text + ", and this op waits for it" + failed;
  text += last->sequence == 0 ? " before any op on this communicator"
                              : " after its op #" + std::to_string(last->sequence) + " (" +
                                    OpName(last->op) + ") on this communicator";
  text += ", and this op waits for it";
  if (last->sequence < sequence) {
    text += departure.after_failure
                ? ". It never called this op: an op of its had failed"
                : ". It never called this op: an op called on some ranks only (under `if rank "
                  "== ...`?), or an error on that rank before it";
  } else {
    text += failed;
  }
  return text;
}

std::string RankName(const WaitScope& scope, int comm_rank) {
  std::string text = "rank " + std::to_string(comm_rank);
  if (static_cast<size_t>(comm_rank) < scope.world_ranks.size() &&
      scope.world_ranks[comm_rank] != comm_rank) {
    text += " (world rank " + std::to_string(scope.world_ranks[comm_rank]) + ")";
  }
  return text;
}

}  // namespace

ffi::Error CheckFailedPeers(const WaitScope& scope, const std::string& what,
                            const std::vector<int>& comm_ranks) {
  if (scope.watch == nullptr) return ffi::Error::Success();
  const int size = static_cast<int>(scope.world_ranks.size());
  auto check = [&](int comm_rank) -> ffi::Error {
    if (comm_rank == scope.rank || comm_rank < 0 || comm_rank >= size) {
      return ffi::Error::Success();
    }
    std::optional<std::string> why = scope.watch->Failed(scope.world_ranks[comm_rank]);
    if (!why) return ffi::Error::Success();
    NoteCommFailure();  // the exit is bounded: MPI_Finalize may wait for it
    return ffi::Error(ffi::ErrorCode::kUnavailable, what + ": " + RankName(scope, comm_rank) +
                                                        " has failed: " + *why +
                                                        "; jaxfog posts nothing more to it");
  };
  if (comm_ranks.empty()) {
    for (int r = 0; r < size; ++r) JAXFOG_RETURN_IF_ERROR(check(r));
  }
  for (int r : comm_ranks) JAXFOG_RETURN_IF_ERROR(check(r));
  return ffi::Error::Success();
}

// MPI results are ignored here: a destructor has no one to tell, and the
// error that brought us here is already on its way.
RequestSet::~RequestSet() {
  if (std::all_of(requests_.begin(), requests_.end(),
                  [](MPI_Request r) { return r == MPI_REQUEST_NULL; })) {
    return;  // completed (or never posted)
  }
  for (MPI_Request& request : requests_) {
    if (request != MPI_REQUEST_NULL) MPI_Cancel(&request);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE);
  }
  for (MPI_Request& request : requests_) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  }
}

std::string RequestSet::Waiting() const {
  std::string waiting;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    const std::string& owner = owners_[std::min(i, owners_.size() - 1)].text;
    if (waiting.find(owner) == std::string::npos) {
      waiting += (waiting.empty() ? "" : ", ") + owner;
    }
  }
  return waiting;
}

std::vector<int> RequestSet::WaitedFor(const WaitScope& scope) const {
  std::vector<int> ranks;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    const int rank = owners_[std::min(i, owners_.size() - 1)].rank;
    if (rank == kEveryone) {
      ranks.clear();
      for (int r = 0; r < static_cast<int>(scope.world_ranks.size()); ++r) {
        if (r != scope.rank) ranks.push_back(r);
      }
      return ranks;
    }
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) ranks.push_back(rank);
  }
  return ranks;
}

ffi::Error RequestSet::CheckDepartures(const WaitScope& scope, const std::string& what,
                                       Clock::time_point start) const {
  // A rank that left had completed its sends, but they may still be on the
  // way (MPI orders no messages across communicators): fail only once they
  // had this long to arrive since the goodbye came, or since this wait began.
  constexpr auto kGrace = std::chrono::seconds(1);
  JAXFOG_RETURN_IF_ERROR(scope.watch->Poll());
  const Clock::time_point now = Clock::now();
  auto check = [&](int comm_rank) -> ffi::Error {
    if (comm_rank == scope.rank || comm_rank < 0 ||
        static_cast<size_t>(comm_rank) >= scope.world_ranks.size()) {
      return ffi::Error::Success();
    }
    const int world_rank = scope.world_ranks[comm_rank];
    std::optional<PeerWatch::Departure> gone = scope.watch->Gone(world_rank);
    if (!gone || now - std::max(gone->seen, start) < kGrace) return ffi::Error::Success();
    return ffi::Error(
        ffi::ErrorCode::kUnavailable,
        what + ": " +
            Departed(scope, comm_rank, world_rank, *gone, scope.sequence ? *scope.sequence : 0) +
            " (still waiting for " + Waiting() + ")");
  };
  bool everyone = false;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    const int rank = owners_[std::min(i, owners_.size() - 1)].rank;
    if (rank == kEveryone) {
      everyone = true;
    } else {
      JAXFOG_RETURN_IF_ERROR(check(rank));
    }
  }
  if (everyone) {
    for (int rank = 0; rank < static_cast<int>(scope.world_ranks.size()); ++rank) {
      JAXFOG_RETURN_IF_ERROR(check(rank));
    }
  }
  // A rank that died (the launcher said so) sends nothing more.
  if (ffi::Error failed = CheckFailedPeers(scope, what, WaitedFor(scope)); !failed.success()) {
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      failed.message() + " (still waiting for " + Waiting() + ")");
  }
  return ffi::Error::Success();
}

std::vector<int> RequestSet::Peers(const WaitScope& scope) const {
  std::vector<int> ranks;
  for (const Owner& owner : owners_) {
    if (owner.rank == kEveryone) {
      ranks.clear();
      for (int r = 0; r < static_cast<int>(scope.world_ranks.size()); ++r) {
        if (r != scope.rank) ranks.push_back(r);
      }
      return ranks;
    }
    if (std::find(ranks.begin(), ranks.end(), owner.rank) == ranks.end()) {
      ranks.push_back(owner.rank);
    }
  }
  return ranks;
}

ffi::Error RequestSet::FailedWait(const WaitScope& scope, const std::string& what, int code) {
  // Open MPI's ULFM fails a request whose peer died (MPI_ERR_PROC_FAILED,
  // in a status: MPI_ERR_IN_STATUS): say which peer, as for a launcher's
  // notice, and post nothing more to it.
  if (scope.watch != nullptr) {
    NoteCommFailure();
    scope.watch->LearnFailures();
    if (ffi::Error failed = CheckFailedPeers(scope, what, Peers(scope)); !failed.success()) {
      const std::string waiting = Waiting();
      return ffi::Error(ffi::ErrorCode::kUnavailable,
                        failed.message() + " (MPI: " + MpiErrorString(code) +
                            (waiting.empty() ? "" : "; still waiting for " + waiting) + ")");
    }
  }
  return CheckMpi(code, what);
}

ffi::Error RequestSet::WaitAll(const WaitScope& scope, const std::string& what,
                               std::vector<int64_t>* done_at, const Finished& on_finished) {
  const auto start = Clock::now();
  // MPI makes progress only while polled, so keep polling; yield the core
  // between polls (ranks may outnumber cores), and only sleep once a wait has
  // lasted long enough that latency no longer matters.
  constexpr double kSleepAfterSeconds = 0.05;
  constexpr auto kPause = std::chrono::microseconds(100);
  // A wait this long is no longer the common quick one: from then on it
  // checks now and then whether a rank it waits for has left, and says what
  // it waits for once JAXFOG_WARN_AFTER has passed.
  constexpr double kWatchAfterSeconds = 0.25;
  constexpr auto kWatchEvery = std::chrono::milliseconds(100);
  Clock::time_point next_check = start;
  bool warned = false;
  const double timeout_seconds = scope.timeout_seconds;
  // Testsome rather than Testall: it completes (and nulls) each request as it
  // finishes, so we know which finished when, and a timeout names only the
  // requests still pending.
  const int n = static_cast<int>(requests_.size());
  int pending = static_cast<int>(std::count_if(
      requests_.begin(), requests_.end(), [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
  int few[8];  // indices of finished requests; no allocation for the usual few
  std::vector<int> many(requests_.size() > 8 ? requests_.size() : 0);
  int* finished = many.empty() ? few : many.data();
  if (done_at != nullptr) done_at->assign(requests_.size(), timeline::Now());
  const EndableWait endable;
  InsideMpi inside(what, timeout_seconds);  // a poll that never returns
  for (int polls = 0;; ++polls) {
    if (pending == 0) return ffi::Error::Success();
    int count = 0;
    inside.Enter("MPI_Testsome", -1);
    const int code = MPI_Testsome(n, requests_.data(), &count, finished, MPI_STATUSES_IGNORE);
    inside.Leave();
    if (code != MPI_SUCCESS) return FailedWait(scope, what, code);
    if (count == MPI_UNDEFINED) return ffi::Error::Success();  // none left active
    if (count > 0) {
      pending -= count;
      if (done_at != nullptr) {
        const int64_t now = timeline::Now();
        for (int i = 0; i < count; ++i) (*done_at)[finished[i]] = now;
      }
      if (on_finished) JAXFOG_RETURN_IF_ERROR(on_finished(finished, count));
      continue;  // poll again at once: more may have finished
    }
    if ((polls & 63) != 63) continue;  // the clock and the rest, now and then
    if (endable.Interrupted()) return InterruptedError(what, Waiting());
    if (EndRequested()) {
      EndNow(what +
             ": this process got SIGTERM (a launcher ending the job sends it) "
             "while waiting for " +
             Waiting() + "; it ends now");
    }
    const Clock::time_point now = Clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    if (timeout_seconds > 0 && waited > timeout_seconds) {
      NoteCommFailure();
      // A peer that never answered may have died: nothing more is posted to
      // it (MPI may crash sending to a dead process), the goodbye included.
      // Only peers named one by one: a collective's silence names no one.
      if (scope.watch != nullptr) {
        bool everyone = false;
        for (size_t i = 0; i < requests_.size(); ++i) {
          if (requests_[i] != MPI_REQUEST_NULL &&
              owners_[std::min(i, owners_.size() - 1)].rank == kEveryone) {
            everyone = true;
          }
        }
        if (!everyone) {
          for (int r : WaitedFor(scope)) {
            if (static_cast<size_t>(r) < scope.world_ranks.size()) {
              scope.watch->MarkFailed(scope.world_ranks[r],
                                      "it did not answer " + what + " within " +
                                          Seconds(timeout_seconds) + " s (JAXFOG_TIMEOUT)");
            }
          }
        }
      }
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        what + " timed out after " + Seconds(timeout_seconds) +
                            " s (JAXFOG_TIMEOUT) waiting for " + Waiting() +
                            ": a peer died, or ranks called different operations or "
                            "disagree on who sends to whom");
    }
    if (scope.watch != nullptr && waited > kWatchAfterSeconds && now >= next_check) {
      next_check = now + kWatchEvery;
      if (ffi::Error left = CheckDepartures(scope, what, start); !left.success()) {
        NoteCommFailure();
        return left;
      }
      const double warn_after = scope.watch->warn_after_seconds();
      if (!warned && warn_after > 0 && waited > warn_after) {
        warned = true;  // once per wait: a stuck rank says where it is stuck
        std::string rank =
            scope.world_ranks.empty() || scope.world_ranks[scope.rank] == scope.rank
                ? ""
                : " (world rank " + std::to_string(scope.world_ranks[scope.rank]) + ")";
        const std::string line =
            what + rank + " is still waiting after " + Seconds(warn_after) +
            " s (JAXFOG_WARN_AFTER) for " + Waiting() + "; it fails " +
            (timeout_seconds > 0 ? "after " + Seconds(timeout_seconds) + " s" : "never") +
            " (JAXFOG_TIMEOUT) unless they come\n";
        std::fputs(line.c_str(), stderr);  // one write: ranks' lines stay whole
        std::fflush(stderr);
      }
    }
    if (waited > kSleepAfterSeconds) {
      std::this_thread::sleep_for(kPause);
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jaxfog
