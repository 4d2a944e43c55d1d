#include "peer_watch.h"

#include <dlfcn.h>
#include <semaphore.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>
#include <tuple>
#include <utility>

#include "mpi_status.h"
#include "status.h"

namespace jaxfog {

namespace {

constexpr int kGoodbyeTag = 7;
constexpr uint64_t kGoodbyeMagic = 0x6a6178666f67ffull;

std::mutex& CurrentMutex() {
  static std::mutex* mutex = new std::mutex();  // never destroyed: used at exit
  return *mutex;
}

std::shared_ptr<PeerWatch>& CurrentSlot() {
  static auto* slot = new std::shared_ptr<PeerWatch>();
  return *slot;
}

}  // namespace

bool IsProcessFailure(int code) {
  int error_class = code;
  if (MPI_Error_class(code, &error_class) != MPI_SUCCESS) return false;
#if defined(MPI_ERR_PROC_FAILED)  // Open MPI 5 (mpi.h)
  if (error_class == MPI_ERR_PROC_FAILED || error_class == MPI_ERR_PROC_FAILED_PENDING) return true;
#elif defined(MPIX_ERR_PROC_FAILED)  // MPICH
  if (error_class == MPIX_ERR_PROC_FAILED || error_class == MPIX_ERR_PROC_FAILED_PENDING)
    return true;
#endif
  return false;
}

void AcknowledgeFailures(MPI_Comm comm) {
  // ULFM's extensions (Open MPI 5, MPICH), looked up at run time: the newer
  // MPIX_Comm_ack_failed where MPI has it, else MPIX_Comm_failure_ack.
  using AckFailed = int (*)(MPI_Comm, int, int*);
  using FailureAck = int (*)(MPI_Comm);
  static const auto ack_failed =
      reinterpret_cast<AckFailed>(dlsym(RTLD_DEFAULT, "MPIX_Comm_ack_failed"));
  static const auto failure_ack =
      reinterpret_cast<FailureAck>(dlsym(RTLD_DEFAULT, "MPIX_Comm_failure_ack"));
  int size = 0, acknowledged = 0;
  if (ack_failed != nullptr && MPI_Comm_size(comm, &size) == MPI_SUCCESS) {
    ack_failed(comm, size, &acknowledged);
  } else if (failure_ack != nullptr) {
    failure_ack(comm);
  }
}

std::shared_ptr<PeerWatch> PeerWatch::Current() {
  std::lock_guard<std::mutex> lock(CurrentMutex());
  return CurrentSlot();
}

void PeerWatch::SetCurrent(std::shared_ptr<PeerWatch> watch) {
  std::shared_ptr<PeerWatch> old;  // released outside the lock
  std::lock_guard<std::mutex> lock(CurrentMutex());
  old = std::exchange(CurrentSlot(), std::move(watch));
}

PeerWatch::PeerWatch(MPI_Comm comm, int rank, int size, uint64_t generation,
                     double warn_after_seconds)
    : comm_(comm),
      rank_(rank),
      generation_(generation),
      warn_after_seconds_(warn_after_seconds),
      departed_(size),
      failed_(size) {}

ffi::ErrorOr<std::shared_ptr<PeerWatch>> PeerWatch::Create(MPI_Comm comm,
                                                           double warn_after_seconds) {
  int rank = 0, size = 0;
  JAXFOG_RETURN_IF_ERROR_OR(CheckMpi(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN),
                                     "peer watch: MPI_Comm_set_errhandler"));
  JAXFOG_RETURN_IF_ERROR_OR(CheckMpi(MPI_Comm_rank(comm, &rank), "peer watch: MPI_Comm_rank"));
  JAXFOG_RETURN_IF_ERROR_OR(CheckMpi(MPI_Comm_size(comm, &size), "peer watch: MPI_Comm_size"));
  CatchLauncherNotices();
  CatchEndSignal();
  static std::atomic<uint64_t> watches{0};  // this process's inits so far
  std::shared_ptr<PeerWatch> watch(new PeerWatch(comm, rank, size, ++watches, warn_after_seconds));
  std::lock_guard<std::mutex> lock(watch->mutex_);
  JAXFOG_RETURN_IF_ERROR_OR(watch->Post());
  return watch;
}

// MPI results are ignored here: a destructor has no one to tell.
PeerWatch::~PeerWatch() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) Stop();
}

PeerWatch::Progress* PeerWatch::Track(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(progress_mutex_);
  for (auto& [id, progress] : progress_) {
    if (id == comm_id) return &progress;
  }
  return &progress_
              .emplace_back(std::piecewise_construct, std::forward_as_tuple(comm_id),
                            std::forward_as_tuple())
              .second;
}

std::string PeerWatch::LastOps() {
  std::lock_guard<std::mutex> lock(progress_mutex_);
  std::string text;
  for (const auto& [id, progress] : progress_) {
    const LastOp last = progress.Load(id);
    if (last.sequence == 0) continue;
    if (!text.empty()) text += ", ";
    text += "op #" + std::to_string(last.sequence) + " (" + OpName(last.op) + ")";
    if (id != 0) text += " on communicator " + std::to_string(id);
  }
  return text.empty() ? "no op yet" : text;
}

ffi::ErrorOr<std::vector<int>> PeerWatch::WorldRanks(MPI_Comm comm) const {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  JAXFOG_RETURN_IF_ERROR_OR(CheckMpi(MPI_Comm_group(comm, &group), "MPI_Comm_group"));
  ffi::Error status = CheckMpi(MPI_Comm_group(comm_, &world), "MPI_Comm_group");
  int size = 0;
  if (status.success()) status = CheckMpi(MPI_Group_size(group, &size), "MPI_Group_size");
  std::vector<int> ranks(static_cast<size_t>(size)), world_ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[r] = r;
  if (status.success()) {
    status =
        CheckMpi(MPI_Group_translate_ranks(group, size, ranks.data(), world, world_ranks.data()),
                 "MPI_Group_translate_ranks");
  }
  MPI_Group_free(&group);
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
  if (!status.success()) return ffi::Unexpected<ffi::Error>(status);
  return world_ranks;
}

ffi::Error PeerWatch::Post() {
  return CheckMpi(
      MPI_Irecv(&inbox_, sizeof(Wire), MPI_BYTE, MPI_ANY_SOURCE, kGoodbyeTag, comm_, &receive_),
      "peer watch: MPI_Irecv of a goodbye");
}

ffi::Error PeerWatch::Poll() {
  std::lock_guard<std::mutex> lock(mutex_);
  return PollLocked();
}

ffi::Error PeerWatch::PollLocked() {
  while (!stopped_ && receive_ != MPI_REQUEST_NULL) {
    int arrived = 0;
    MPI_Status status;
    if (int code = MPI_Test(&receive_, &arrived, &status); code != MPI_SUCCESS) {
      if (!IsProcessFailure(code)) return CheckMpi(code, "peer watch: MPI_Test of a goodbye");
      // ULFM: a rank that could have sent to this any-source receive died.
      // Acknowledged, the receive goes on waiting for the living.
      AcknowledgeFailures(comm_);
      AskMpiLocked("its process died (MPI said so: MPI_ERR_PROC_FAILED, MPIX_Comm_get_failed)");
      if (receive_ == MPI_REQUEST_NULL) JAXFOG_RETURN_IF_ERROR(Post());
      break;
    }
    if (!arrived) break;
    const int from = status.MPI_SOURCE;
    if (inbox_.magic == kGoodbyeMagic && inbox_.generation == generation_ && from >= 0 &&
        static_cast<size_t>(from) < departed_.size() && !departed_[from]) {
      Departure departure{static_cast<Reason>(inbox_.reason),
                          inbox_.after_failure != 0,
                          {},
                          std::chrono::steady_clock::now()};
      for (uint32_t i = 0; i < std::min<uint32_t>(inbox_.count, kMaxComms); ++i) {
        departure.last.push_back({inbox_.last[i].comm_id, static_cast<OpCode>(inbox_.last[i].op),
                                  inbox_.last[i].sequence});
      }
      departed_[from] = std::move(departure);
    }
    JAXFOG_RETURN_IF_ERROR(Post());
  }
  return ffi::Error::Success();
}

std::optional<PeerWatch::Departure> PeerWatch::Gone(int rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (rank < 0 || static_cast<size_t>(rank) >= departed_.size()) return std::nullopt;
  return departed_[rank];
}

void PeerWatch::MarkFailed(int rank, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (rank < 0 || rank == rank_ || static_cast<size_t>(rank) >= failed_.size()) return;
  if (!failed_[rank]) failed_[rank] = why;
  any_failed_.store(true);
}

std::optional<std::string> PeerWatch::Failed(int rank) {
  if (!any_failed_.load() && LauncherNotices() == 0) return std::nullopt;  // the usual case
  CheckLauncherNotice();
  std::lock_guard<std::mutex> lock(mutex_);
  if (rank < 0 || static_cast<size_t>(rank) >= failed_.size()) return std::nullopt;
  return failed_[rank];
}

void PeerWatch::CheckLauncherNotice() {
  const uint64_t notices = LauncherNotices();
  std::lock_guard<std::mutex> lock(mutex_);
  if (notices == notices_seen_ || stopped_) return;
  // Hydra records the death before it signals; should MPI not know it yet,
  // ask again, at most every 50 ms.
  const auto now = std::chrono::steady_clock::now();
  if (now < next_ask_) return;
  next_ask_ = now + std::chrono::milliseconds(50);
  if (AskMpiLocked("its process died (the launcher said so: MPIX_Comm_get_failed)")) {
    notices_seen_ = notices;
  }
}

void PeerWatch::LearnFailures() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopped_) return;
  AskMpiLocked("its process died (MPI said so: MPI_ERR_PROC_FAILED, MPIX_Comm_get_failed)");
}

bool PeerWatch::AskMpiLocked(const char* why) {
  // An MPICH extension (also in Open MPI 5's ULFM), looked up at run time.
  using GetFailed = int (*)(MPI_Comm, MPI_Group*);
  static const auto get_failed =
      reinterpret_cast<GetFailed>(dlsym(RTLD_DEFAULT, "MPIX_Comm_get_failed"));
  if (get_failed == nullptr) return true;  // nothing to learn from this MPI
  MPI_Group failed = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int count = 0;
  bool asked = false;
  if (get_failed(comm_, &failed) != MPI_SUCCESS || failed == MPI_GROUP_NULL) return false;
  if (MPI_Group_size(failed, &count) == MPI_SUCCESS && count > 0 &&
      MPI_Comm_group(comm_, &world) == MPI_SUCCESS) {
    std::vector<int> ranks(static_cast<size_t>(count)), world_ranks(ranks.size());
    for (int i = 0; i < count; ++i) ranks[i] = i;
    if (MPI_Group_translate_ranks(failed, count, ranks.data(), world, world_ranks.data()) ==
        MPI_SUCCESS) {
      for (int r : world_ranks) {
        if (r >= 0 && r != rank_ && static_cast<size_t>(r) < failed_.size() && !failed_[r]) {
          failed_[r] = why;
          any_failed_.store(true);
        }
      }
      asked = true;
    }
  }
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
  if (failed != MPI_GROUP_NULL && failed != MPI_GROUP_EMPTY) MPI_Group_free(&failed);
  return asked;
}

ffi::Error PeerWatch::SayGoodbye(Reason reason) {
  CheckLauncherNotice();
  std::lock_guard<std::mutex> lock(mutex_);
  // Goodbyes already here: no message to a rank that will never read it.
  JAXFOG_RETURN_IF_ERROR(PollLocked());
  // Never freed: a send released below may still read it (see there).
  static Wire* const outbox = new Wire();
  Wire& out = *outbox;
  out = Wire{};
  out.magic = kGoodbyeMagic;
  out.generation = generation_;
  out.reason = static_cast<uint32_t>(reason);
  out.after_failure = CommFailed() ? 1 : 0;
  {
    std::lock_guard<std::mutex> progress_lock(progress_mutex_);
    for (const auto& [id, progress] : progress_) {
      if (out.count == kMaxComms) break;
      const LastOp last = progress.Load(id);
      out.last[out.count++] = {last.comm_id, static_cast<uint64_t>(last.op), last.sequence};
    }
  }
  std::vector<MPI_Request> sends;
  ffi::Error result = ffi::Error::Success();
  for (int peer = 0; peer < static_cast<int>(departed_.size()); ++peer) {
    // Nor to a rank that failed: MPI may crash sending to a dead process.
    if (peer == rank_ || departed_[peer] || failed_[peer]) continue;
    MPI_Request& request = sends.emplace_back(MPI_REQUEST_NULL);
    if (int code = MPI_Isend(&out, sizeof(Wire), MPI_BYTE, peer, kGoodbyeTag, comm_, &request);
        code != MPI_SUCCESS) {
      result =
          CheckMpi(code, "jaxfog.shutdown: MPI_Isend of a goodbye to rank " + std::to_string(peer));
    }
  }
  // A goodbye is small, so sent eagerly: the sends complete at once. One to
  // a rank that has just finalized may not: it is released, and MPI finishes
  // or drops it (nothing reads it).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  int done = 0;
  while (!sends.empty() && std::chrono::steady_clock::now() < deadline) {
    if (MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE) !=
            MPI_SUCCESS ||
        done) {
      break;
    }
    std::this_thread::yield();
  }
  for (MPI_Request& request : sends) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  }
  return result;
}

ffi::Error PeerWatch::Stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopped_) return ffi::Error::Success();
  stopped_ = true;
  if (receive_ == MPI_REQUEST_NULL) return ffi::Error::Success();
  // A cancelled receive completes at once (or has just matched a goodbye).
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Cancel(&receive_), "peer watch: MPI_Cancel");
  int code = MPI_Wait(&receive_, MPI_STATUS_IGNORE);
  if (code != MPI_SUCCESS && IsProcessFailure(code) && receive_ != MPI_REQUEST_NULL) {
    // ULFM: a rank that could have sent to it died; once that is
    // acknowledged, the cancelled receive completes.
    AcknowledgeFailures(comm_);
    code = MPI_Wait(&receive_, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS && receive_ != MPI_REQUEST_NULL) {
      // Open MPI 5.0.11 still says MPI_ERR_PROC_FAILED_PENDING: released,
      // the cancelled receive is dropped (nothing writes to it any more).
      MPI_Request_free(&receive_);
      code = MPI_SUCCESS;
    }
  }
  return CheckMpi(code, "peer watch: MPI_Wait");
}

namespace {
std::atomic<bool> comm_failed{false};
}  // namespace

void NoteCommFailure() { comm_failed.store(true); }
bool CommFailed() { return comm_failed.load(); }

namespace {
std::atomic<uint64_t> launcher_notices{0};
struct sigaction previous_usr1;

void OnLauncherNotice(int signal, siginfo_t* info, void* context) {
  launcher_notices.fetch_add(1, std::memory_order_relaxed);  // lock-free: signal-safe
  if (previous_usr1.sa_flags & SA_SIGINFO) {
    if (previous_usr1.sa_sigaction != nullptr) previous_usr1.sa_sigaction(signal, info, context);
  } else if (previous_usr1.sa_handler != SIG_DFL && previous_usr1.sa_handler != SIG_IGN) {
    previous_usr1.sa_handler(signal);
  }
}
}  // namespace

void CatchLauncherNotices() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = &OnLauncherNotice;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&action.sa_mask);
    sigaction(SIGUSR1, &action, &previous_usr1);
  });
}

uint64_t LauncherNotices() { return launcher_notices.load(std::memory_order_relaxed); }

namespace {
std::atomic<bool> end_requested{false};
std::atomic<int> waits_in_flight{0};
sem_t end_signalled;  // posted by the handler (sem_post is signal-safe)

// Signal-safe: restores SIGTERM's default action and sends it again; if this
// thread blocks it (inside the handler), another thread, or this one once
// the handler returns, takes it.
void EndBySigterm() {
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  kill(getpid(), SIGTERM);
}

std::atomic<bool> end_reported{false};  // one report a process

void OnEndSignal(int) {
  end_requested.store(true);
  sem_post(&end_signalled);
}

// The handler's thread: gives a wait in flight the moment it needs to
// report (EndNow), otherwise says which ops ran last, and ends the process.
void AwaitEndSignal() {
  while (sem_wait(&end_signalled) != 0) {
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  // The first look after a short pause: a wait may be just starting.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  while (waits_in_flight.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (waits_in_flight.load() == 0) {
    const std::shared_ptr<PeerWatch> watch = PeerWatch::Current();
    if (watch != nullptr) {
      EndNow("jaxfog (rank " + std::to_string(watch->rank()) +
             "): this process got SIGTERM (a launcher ending the job sends it) between "
             "ops, none waiting; its last: " +
             watch->LastOps() + "; it ends now");
    }
  }
  EndBySigterm();
}
}  // namespace

void CatchEndSignal() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current;
    if (sigaction(SIGTERM, nullptr, &current) != 0 || (current.sa_flags & SA_SIGINFO) ||
        current.sa_handler != SIG_DFL || sem_init(&end_signalled, 0, 0) != 0) {
      return;
    }
    std::thread(AwaitEndSignal).detach();
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_handler = &OnEndSignal;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, nullptr);
  });
}

bool EndRequested() { return end_requested.load(std::memory_order_relaxed); }

void EndNow(const std::string& report) {
  if (!end_reported.exchange(true)) {
    std::fputs((report + "\n").c_str(), stderr);  // one write: ranks' lines stay whole
    std::fflush(stderr);
  }
  EndBySigterm();
  for (;;) pause();  // SIGTERM's default action ends the process
}

namespace {
// Counted by the SIGINT handler (lock-free: signal-safe); a wait compares.
std::atomic<uint64_t> interrupts{0};
static_assert(std::atomic<uint64_t>::is_always_lock_free);
std::mutex interrupt_mutex;     // CatchInterrupts (not the handler)
struct sigaction previous_int;  // Python's, written before ours is installed

void OnInterrupt(int signal, siginfo_t* info, void* context) {
  // Python's handler first: its KeyboardInterrupt is pending by the time a
  // wait sees the count, so the one the op's failure becomes replaces it.
  if (previous_int.sa_flags & SA_SIGINFO) {
    if (previous_int.sa_sigaction != nullptr) previous_int.sa_sigaction(signal, info, context);
  } else if (previous_int.sa_handler != SIG_DFL && previous_int.sa_handler != SIG_IGN) {
    previous_int.sa_handler(signal);
  }
  interrupts.fetch_add(1);
}
}  // namespace

bool CatchInterrupts() {
  std::lock_guard<std::mutex> lock(interrupt_mutex);
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0) return false;
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == &OnInterrupt) return true;
  if (!(current.sa_flags & SA_SIGINFO) &&
      (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN)) {
    return false;  // nothing to chain to: SIGINT's default (death) is left as it is
  }
  previous_int = current;
  // The replaced handler's flags and mask: Python's has no SA_RESTART, so
  // that a blocking read returns EINTR and Python runs its handler; kept so.
  struct sigaction action = current;
  action.sa_sigaction = &OnInterrupt;
  action.sa_flags = current.sa_flags | SA_SIGINFO;
  return sigaction(SIGINT, &action, nullptr) == 0;
}

ffi::Error InterruptedError(const std::string& what, const std::string& waiting_for) {
  NoteCommFailure();  // the exit is bounded: MPI_Finalize may wait for the peer
  return ffi::Error(ffi::ErrorCode::kCancelled,
                    what + ": interrupted (SIGINT) while waiting for " + waiting_for +
                        "; its messages are abandoned half-way, so jaxfog's communication "
                        "in this process may be unusable now: end the program");
}

EndableWait::EndableWait() : interrupts_at_start_(interrupts.load()) {
  waits_in_flight.fetch_add(1);
}

bool EndableWait::Interrupted() const {
  return interrupts.load(std::memory_order_relaxed) != interrupts_at_start_;
}

EndableWait::~EndableWait() { waits_in_flight.fetch_sub(1); }

// One op's place inside MPI. `state` is 2 x (its calls so far) + 1 while
// inside a call, + 0 between calls: the hot path reads no clock; the
// watchdog times how long it keeps seeing the same call.
struct InsideMpi::Slot {
  std::atomic<bool> taken{false};
  std::atomic<uint64_t> state{0};
  std::atomic<const char*> call{nullptr};
  std::atomic<int> peer{-1};
  uint64_t calls = 0;  // written by the slot's holder only; kept across holders
  double limit_seconds = 0;
  char what[160] = {};
};

namespace {

constexpr size_t kInsideMpiSlots = 64;
InsideMpi::Slot* inside_mpi_slots = nullptr;  // never freed: the watchdog outlives all

void WatchMpiCalls() {
  using Clock = std::chrono::steady_clock;
  std::vector<uint64_t> seen(kInsideMpiSlots, 0);
  std::vector<Clock::time_point> seen_at(kInsideMpiSlots);
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    const Clock::time_point now = Clock::now();
    for (size_t i = 0; i < kInsideMpiSlots; ++i) {
      InsideMpi::Slot& slot = inside_mpi_slots[i];
      const uint64_t state = slot.state.load(std::memory_order_acquire);
      if (state != seen[i]) {  // another call since the last look (or none)
        seen[i] = state;
        seen_at[i] = now;  // the call began no later than this
        continue;
      }
      if ((state & 1) == 0 ||
          now - seen_at[i] < std::chrono::duration<double>(slot.limit_seconds)) {
        continue;
      }
      std::string line = std::string(slot.what) + ": " + slot.call.load();
      const int peer = slot.peer.load();
      if (peer >= 0) line += " (rank " + std::to_string(peer) + ")";
      if (slot.state.load(std::memory_order_acquire) != state) continue;  // it returned
      char limit[32];
      std::snprintf(limit, sizeof(limit), "%g", slot.limit_seconds);
      line += std::string(" has not returned after ") + limit +
              " s (JAXFOG_TIMEOUT + 2 s): MPI is stuck, a peer died or cannot be reached; "
              "ending this process with status 1\n";
      std::fputs(line.c_str(), stderr);  // one write: ranks' lines stay whole
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
}

}  // namespace

InsideMpi::InsideMpi(const std::string& what, double timeout_seconds) {
  if (timeout_seconds <= 0) return;
  static std::once_flag once;
  std::call_once(once, [] {
    inside_mpi_slots = new Slot[kInsideMpiSlots];
    std::thread(WatchMpiCalls).detach();
  });
  for (size_t i = 0; i < kInsideMpiSlots; ++i) {
    bool free = false;
    if (inside_mpi_slots[i].taken.compare_exchange_strong(free, true, std::memory_order_acquire)) {
      slot_ = &inside_mpi_slots[i];
      break;
    }
  }
  if (slot_ == nullptr) return;
  slot_->limit_seconds = timeout_seconds + 2;
  const size_t length = std::min(what.size(), sizeof(slot_->what) - 1);
  std::memcpy(slot_->what, what.data(), length);
  slot_->what[length] = '\0';
}

InsideMpi::~InsideMpi() {
  if (slot_ == nullptr) return;
  Leave();
  slot_->taken.store(false, std::memory_order_release);
}

void InsideMpi::Enter(const char* call, int peer) {
  if (slot_ == nullptr) return;
  slot_->call.store(call, std::memory_order_relaxed);
  slot_->peer.store(peer, std::memory_order_relaxed);
  slot_->state.store(2 * ++slot_->calls + 1, std::memory_order_release);
}

void InsideMpi::Leave() {
  if (slot_ != nullptr) slot_->state.store(2 * slot_->calls, std::memory_order_release);
}

}  // namespace jaxfog
