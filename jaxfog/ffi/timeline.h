// The op timeline: a Chrome trace / Perfetto JSON file per rank showing where
// each op's time goes (JAXFOG_TIMELINE, see docs/guide/timeline.rst).
//
// Off unless Start() was given a path. Off, a span site costs one relaxed
// atomic load: no clock read, no allocation, no lock. On, finished spans are
// appended to one mutex-protected buffer (ops are serialized by jaxfog's
// effect token, so the lock is not contended), capped at kMaxEvents, and
// Flush() rewrites the file with everything recorded so far.
#ifndef JAXFOG_FFI_TIMELINE_H_
#define JAXFOG_FFI_TIMELINE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jaxfog::timeline {

// Spans beyond this many are dropped (and counted): at most about 70 MB of
// buffer (40 bytes a span, plus the args of op spans).
constexpr size_t kMaxEvents = size_t{1} << 20;

namespace internal {
extern std::atomic<bool> enabled;
}  // namespace internal

inline bool Enabled() { return internal::enabled.load(std::memory_order_relaxed); }

// Nanoseconds on the steady clock (the clock every span is measured with).
int64_t Now();

// Records into the file `path_template` names for `rank` ("{rank}" replaced,
// else ".rank<r>.json" appended after dropping a ".json" suffix); an empty
// template stops recording. A new file gets an empty trace at once, so that a
// path that cannot be written is reported here (false, `error`), not at exit;
// starting again with the same file resumes, keeping what was recorded.
bool Start(const std::string& path_template, int rank, std::string* error);

// Rewrites the file with every span recorded so far (through a temporary
// file and a rename, so the file is always a whole trace). True when off.
bool Flush(std::string* error);

// Names the calling thread in the trace (thread_name metadata).
void NameThread(const char* name);

// What an op's span shows in its args; -1 fields are left out.
struct OpArgs {
  int64_t comm = -1;       // communicator id (0: world)
  int64_t bytes = -1;      // this rank's message (to each peer, for neighbour ops)
  int64_t seq = -1;        // the communicator's op number, as in message headers
  int64_t signature = -1;  // hash of the message's shapes and dtypes
  int64_t root = -1;       // broadcast's root
  bool neighbors = false;  // show send_to / recv_from
  std::vector<int> send_to, recv_from;

  template <typename Ranks>
  void Peers(const Ranks& to, const Ranks& from) {
    neighbors = true;
    send_to.assign(to.begin(), to.end());
    recv_from.assign(from.begin(), from.end());
  }
};

// A span of time on the calling thread, recorded when it ends (RAII).
// `name` must outlive the process: a string literal.
class Span {
 public:
  enum Kind : uint8_t {
    kPhase,  // a part of an op
    kOp,     // a whole op; also records the "queued" span before it, when the
             // communication thread ran it (see Queued)
  };

  explicit Span(const char* name, Kind kind = kPhase) noexcept : name_(name), kind_(kind) {
    if (Enabled()) Begin();
  }
  ~Span() {
    if (start_ >= 0) End();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  // Whether this span is being recorded: fill args() only then.
  explicit operator bool() const { return start_ >= 0; }
  OpArgs& args() { return args_; }

  // Ends the span before the end of its scope; returns when (Now()), or -1
  // when not recording.
  int64_t End();

 private:
  void Begin();

  const char* name_;
  Kind kind_;
  int64_t start_ = -1;
  OpArgs args_;
};

// A finished span measured elsewhere: a "wait <peer>" (peer >= 0) or phase.
void Record(const char* name, int peer, int64_t start, int64_t end);

// Around work the communication thread runs: the next op span on this thread
// first records a "queued" span from `since` (ns, Now()) until it began.
// `since` < 0 (the timeline was off at hand-over): nothing is recorded.
class Queued {
 public:
  explicit Queued(int64_t since);
  ~Queued();
  Queued(const Queued&) = delete;
  Queued& operator=(const Queued&) = delete;
};

}  // namespace jaxfog::timeline

#endif  // JAXFOG_FFI_TIMELINE_H_
