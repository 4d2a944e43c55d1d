// Knowing when a peer has left, so that a wait for it fails at once instead
// of at JAXFOG_TIMEOUT.
//
// At shutdown every rank sends a small goodbye (what it ran last on each
// communicator) to every other rank, over a communicator of its own that
// init() duplicated from COMM_WORLD; every rank keeps a receive posted for
// goodbyes. A wait that has lasted a little polls it now and then
// (RequestSet::WaitAll in mpi_requests.cc) and fails when a rank it waits
// for has said goodbye. A rank killed outright says nothing: mpiexec tears
// the job down then, unless told not to (hydra's -disable-auto-cleanup).
//
// The watch also keeps the ranks this process knows to have failed, to which
// jaxfog posts nothing more (MPICH 5.0.2's ch4:ucx segfaults in MPI_Isend to a
// rank whose process died): a rank an op timed out waiting for, and a rank
// the launcher reported dead. Hydra tells the surviving processes that one
// died with SIGUSR1 (with -disable-auto-cleanup); the watch catches it (a
// process would die of it) and asks MPI which (MPIX_Comm_get_failed).
// Open MPI's ULFM (mpiexec --with-ft ulfm) instead fails the calls that
// involve a dead rank with MPI_ERR_PROC_FAILED (the goodbye receive, from any
// source, with MPI_ERR_PROC_FAILED_PENDING, which the watch acknowledges so
// that it goes on); a wait that fails so asks MPI which ranks died.
#ifndef JAXFOG_FFI_PEER_WATCH_H_
#define JAXFOG_FFI_PEER_WATCH_H_

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

class PeerWatch {
 public:
  // Why a rank left: jaxfog.shutdown() called by the program, or at exit.
  enum class Reason : uint32_t { kShutdown = 1, kExit = 2 };

  // The op a rank ran last on the communicator with runtime id `comm_id`.
  struct LastOp {
    int64_t comm_id;
    OpCode op;
    uint64_t sequence;  // 0: none yet
  };

  struct Departure {
    Reason reason;
    bool after_failure;  // an op of that rank had failed (CommFailed) before it left
    std::vector<LastOp> last;
    std::chrono::steady_clock::time_point seen;  // when this rank received it
  };

  // What a goodbye reports for one communicator: updated by its transport at
  // the start of each op (the ops of one communicator run one at a time).
  class Progress {
   public:
    void Record(OpCode op, uint64_t sequence) {
      op_.store(static_cast<uint32_t>(op), std::memory_order_relaxed);
      sequence_.store(sequence, std::memory_order_relaxed);
    }
    LastOp Load(int64_t comm_id) const {
      return {comm_id, static_cast<OpCode>(op_.load(std::memory_order_relaxed)),
              sequence_.load(std::memory_order_relaxed)};
    }

   private:
    std::atomic<uint32_t> op_{0};
    std::atomic<uint64_t> sequence_{0};
  };

  // Watches for goodbyes on `comm`, a duplicate of COMM_WORLD that the
  // runtime made for this alone and frees after Stop(). `warn_after_seconds`
  // (JAXFOG_WARN_AFTER; 0: never) is when a long wait says what it waits for.
  static ffi::ErrorOr<std::shared_ptr<PeerWatch>> Create(MPI_Comm comm, double warn_after_seconds);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // The watch init() started, for the C API that registers communicators;
  // null before init and after shutdown.
  static std::shared_ptr<PeerWatch> Current();
  static void SetCurrent(std::shared_ptr<PeerWatch> watch);

  int rank() const { return rank_; }
  double warn_after_seconds() const { return warn_after_seconds_; }

  // The progress record of communicator `comm_id` (owned by the watch).
  Progress* Track(int64_t comm_id);
  // The world rank of each rank of `comm` (a sub-communicator numbers its
  // ranks its own way; goodbyes come from world ranks).
  ffi::ErrorOr<std::vector<int>> WorldRanks(MPI_Comm comm) const;

  // Takes in the goodbyes that have arrived. Thread-safe; a few MPI_Tests.
  ffi::Error Poll();
  // World rank `rank`'s goodbye, if it has said one (as of the last Poll).
  std::optional<Departure> Gone(int rank) const;

  // Ranks this process knows to have failed (world ranks), and why, in
  // words ("timed out in jaxfog neighbor_allreduce (op #5 on rank 0)", "its
  // process died (the launcher said so)"). Marked by a wait that timed out,
  // or learnt from MPI after the launcher's SIGUSR1 (checked by each call).
  void MarkFailed(int rank, const std::string& why);
  std::optional<std::string> Failed(int rank);
  // Asks MPI which processes died, if the launcher said one did since the
  // last time. Thread-safe; cheap when nothing was said.
  void CheckLauncherNotice();
  // Asks MPI which processes died, now: after an MPI call failed (Open MPI's
  // ULFM, mpiexec --with-ft ulfm, reports a dead peer as MPI_ERR_PROC_FAILED
  // and sends no SIGUSR1). Thread-safe.
  void LearnFailures();

  // The last op of each communicator this rank ran ops on, in words
  // ("op #5 (neighbor_allreduce)"); "no op yet" if none.
  std::string LastOps();

  // Sends this rank's goodbye to every rank not known to have left. Once
  // every op of this rank has finished; best effort (a peer that left
  // meanwhile gets an eager message it never reads).
  ffi::Error SayGoodbye(Reason reason);
  // Cancels the posted receive: before the runtime frees the communicator
  // and MPI is finalized. Poll does nothing after.
  ffi::Error Stop();

 private:
  static constexpr size_t kMaxComms = 8;
  struct Wire {
    uint64_t magic;
    // Which init() of the sender: MPI may give a later communicator the
    // context of a freed one, and a goodbye that arrived as the old watch
    // stopped would otherwise reach the new one. Every rank inits alike.
    uint64_t generation;
    uint32_t reason;
    uint32_t count;
    uint32_t after_failure;
    struct {
      int64_t comm_id;
      uint64_t op;
      uint64_t sequence;
    } last[kMaxComms];
  };

  PeerWatch(MPI_Comm comm, int rank, int size, uint64_t generation, double warn_after_seconds);
  // Posts the receive for the next goodbye (mutex_ held).
  ffi::Error Post();
  // Marks the ranks MPIX_Comm_get_failed names as failed, saying `why`;
  // false if MPI could not say (mutex_ held).
  bool AskMpiLocked(const char* why);
  ffi::Error PollLocked();

  const MPI_Comm comm_;
  const int rank_;
  const uint64_t generation_;
  const double warn_after_seconds_;
  mutable std::mutex mutex_;
  MPI_Request receive_ = MPI_REQUEST_NULL;
  Wire inbox_{};
  bool stopped_ = false;
  std::vector<std::optional<Departure>> departed_;  // by world rank
  std::vector<std::optional<std::string>> failed_;  // by world rank (mutex_)
  // Whether failed_ holds anyone: with it false and no launcher notice ever,
  // Failed() (every op, every peer) answers without the mutex.
  std::atomic<bool> any_failed_{false};
  uint64_t notices_seen_ = 0;  // launcher notices (SIGUSR1) already asked about (mutex_)
  std::chrono::steady_clock::time_point next_ask_{};  // (mutex_)
  std::mutex progress_mutex_;
  std::deque<std::pair<int64_t, Progress>> progress_;  // a deque: stable addresses
};

// Whether an op of this process failed waiting for a peer (a timeout, a
// departure): then MPI_Finalize may wait forever (MPICH's ends with a barrier
// through the launcher, which a host cut off never joins), so the exit is
// bounded (jaxfog_bound_exit).
void NoteCommFailure();

// Whether MPI error `code` says a process failed (ULFM's MPI_ERR_PROC_FAILED,
// MPI_ERR_PROC_FAILED_PENDING; MPIX_ in MPICH).
bool IsProcessFailure(int code);
// Acknowledges the failures MPI reported on `comm` (MPIX_Comm_failure_ack,
// where MPI has it), so that receives from any source go on.
void AcknowledgeFailures(MPI_Comm comm);
bool CommFailed();

// Installs (once per process) the SIGUSR1 handler that counts the launcher's
// notices that a process of the job died; a handler installed before it
// (one of Python's, say) still runs. The default action (death) does not.
void CatchLauncherNotices();
uint64_t LauncherNotices();

// Where this thread is inside MPI for an op, for a watchdog that ends the
// process when an MPI call has not returned `timeout_seconds` + 2 s after it
// began (JAXFOG_TIMEOUT; 0: never): a dead peer can block a call for ever in
// some transports (MPICH 5.0.2's ch4:ofi over tcp: MPI_Isend retrying a
// connection to a dead process), where no jaxfog wait runs to time out. The
// watchdog then says on stderr which op, which call and which peer, and ends
// the process with status 1. Cheap: Enter and Leave are plain stores (no
// clock: the watchdog times how long it sees the same call).
class InsideMpi {
 public:
  // `what` names the op ("jaxfog neighbor_allreduce (op #5 on rank 0)").
  InsideMpi(const std::string& what, double timeout_seconds);
  ~InsideMpi();
  InsideMpi(const InsideMpi&) = delete;
  InsideMpi& operator=(const InsideMpi&) = delete;
  // Before an MPI call that may block: `call` (a literal) for `peer` (-1: none).
  void Enter(const char* call, int peer);
  void Leave();

  struct Slot;  // (peer_watch.cc)

 private:
  Slot* slot_ = nullptr;  // null: no watchdog (no timeout, or every slot taken)
};

// A launcher ending a job (Open MPI's prterun when a host is lost, Slurm's
// scancel or time limit) sends SIGTERM, then SIGKILL a moment later. By
// SIGTERM's default action a rank waiting for a peer would end without a
// word; with this handler (installed once, only where SIGTERM still has its
// default action: a program's own handler is left alone) the process first
// says on stderr what it was doing, then ends by SIGTERM as before: the op
// waiting says what it waited for; with no op waiting, a thread of the
// handler's says which ops ran last. Within a second at most (a wait that
// does not come round to it is not waited for).
void CatchEndSignal();
// Whether a SIGTERM came while a wait was in flight: the wait then reports
// and calls EndNow.
bool EndRequested();
// Writes `report` (one line) to stderr and ends the process by SIGTERM.
[[noreturn]] void EndNow(const std::string& report);
// Ctrl-C (SIGINT) while an op waits for a peer. Python runs its SIGINT
// handler (KeyboardInterrupt) only between bytecodes of the main thread, so
// a main thread blocked on an op that waits for a peer that never comes
// would stay blocked until JAXFOG_TIMEOUT. This handler (installed from
// Python at init, only while Python's default handler is in place: a
// program's own is left alone) runs the handler it replaced first, so that
// Python's KeyboardInterrupt is pending as before, then counts the signal:
// a wait in flight sees the count change and fails at once (its error says
// "interrupted (SIGINT)", which jaxfog's Python side raises as a
// KeyboardInterrupt). Between waits nothing else changes. A later
// signal.signal(SIGINT, ...) replaces it (Python installs its own C handler
// then). Returns whether it is installed (false: SIGINT has no handler to
// chain to, SIG_DFL or SIG_IGN).
bool CatchInterrupts();
// The error of a wait that a SIGINT interrupted: `what` (the op, "jaxfog
// neighbor_allreduce (op #5 on rank 0)") was waiting for `waiting_for`
// ("the header from rank 1"). Its requests are abandoned half-way, so
// jaxfog's communicators may be unusable after it; the exit is bounded.
// jaxfog's Python side raises it as a KeyboardInterrupt (jaxfog/_interrupt.py
// looks for "interrupted (SIGINT)").
ffi::Error InterruptedError(const std::string& what, const std::string& waiting_for);
// Held by a wait while it runs, so that a SIGTERM lets it report first; on
// leaving, it ends the process if one came meanwhile. It also notes the
// SIGINT count at its start: Interrupted() is whether one came since.
class EndableWait {
 public:
  EndableWait();
  ~EndableWait();
  EndableWait(const EndableWait&) = delete;
  EndableWait& operator=(const EndableWait&) = delete;
  bool Interrupted() const;

 private:
  uint64_t interrupts_at_start_;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_PEER_WATCH_H_
