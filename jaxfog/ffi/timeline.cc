#include "timeline.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

namespace jaxfog::timeline {

namespace internal {
std::atomic<bool> enabled{false};
}  // namespace internal

namespace {

enum class Category : uint8_t { kPhase, kOp, kQueue };

struct Event {
  const char* name;
  int64_t start, end;  // ns, steady clock
  int32_t tid;
  int32_t peer;  // >= 0: the name is "<name> <peer>"
  int32_t args;  // index into State::args, or -1
  Category category;
};

struct State {
  std::mutex mutex;
  std::string path;  // empty: never started
  int rank = 0;
  int64_t origin = 0;          // steady ns at Start: ts 0 in the file
  int64_t origin_unix_ns = 0;  // system clock at the same instant (for merging ranks)
  std::vector<Event> events;
  std::vector<OpArgs> args;
  uint64_t dropped = 0;
  std::vector<std::pair<int32_t, const char*>> thread_names;
};

State& GetState() {
  static State* state = new State();  // never destroyed: spans may end during exit
  return *state;
}

int32_t ThreadId() {
  thread_local const int32_t tid = static_cast<int32_t>(syscall(SYS_gettid));
  return tid;
}

// Enqueue time of the work this thread runs now (communication thread only).
thread_local int64_t queued_since = -1;

void Append(const char* name, Category category, int peer, int64_t start, int64_t end,
            OpArgs* args) {
  const int32_t tid = ThreadId();
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.events.size() >= kMaxEvents) {
    if (s.dropped++ == 0) {
      std::fprintf(stderr,
                   "jaxfog timeline: %zu spans recorded, the most kept in memory; "
                   "later spans are dropped\n",
                   kMaxEvents);
    }
    return;
  }
  int32_t index = -1;
  if (args != nullptr) {
    index = static_cast<int32_t>(s.args.size());
    s.args.push_back(std::move(*args));
  }
  s.events.push_back({name, start, end, tid, peer, index, category});
}

std::string FileName(const std::string& tmpl, int rank) {
  const std::string r = std::to_string(rank);
  const std::string key = "{rank}";
  std::string path = tmpl;
  bool replaced = false;
  for (size_t at = path.find(key); at != std::string::npos; at = path.find(key, at + r.size())) {
    path.replace(at, key.size(), r);
    replaced = true;
  }
  if (replaced) return path;
  const std::string suffix = ".json";
  if (path.size() > suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    path.resize(path.size() - suffix.size());
  }
  return path + ".rank" + r + ".json";
}

// Closes on every path; Close() reports what fclose says.
class File {
 public:
  explicit File(const std::string& path) : f_(std::fopen(path.c_str(), "w")) {}
  ~File() {
    if (f_ != nullptr) std::fclose(f_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  FILE* get() const { return f_; }
  bool Close() {
    const int rc = std::fclose(f_);
    f_ = nullptr;
    return rc == 0;
  }

 private:
  FILE* f_;
};

// "12.345": ns as microseconds, exactly (no rounding through a double).
std::string Micros(int64_t ns) {
  char text[32];
  const char* sign = ns < 0 ? "-" : "";
  const uint64_t v = ns < 0 ? 0 - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  std::snprintf(text, sizeof(text), "%s%" PRIu64 ".%03" PRIu64, sign, v / 1000, v % 1000);
  return text;
}

void WriteInts(FILE* f, const std::vector<int>& values) {
  std::fputc('[', f);
  for (size_t i = 0; i < values.size(); ++i) std::fprintf(f, i ? ",%d" : "%d", values[i]);
  std::fputc(']', f);
}

void WriteArgs(FILE* f, const OpArgs& a) {
  const char* sep = "";
  auto field = [&](const char* key, int64_t value) {
    if (value < 0) return;
    std::fprintf(f, "%s\"%s\":%" PRId64, sep, key, value);
    sep = ",";
  };
  field("comm", a.comm);
  field("bytes", a.bytes);
  field("seq", a.seq);
  if (a.signature >= 0) {
    std::fprintf(f, "%s\"signature\":\"0x%" PRIx64 "\"", sep, static_cast<uint64_t>(a.signature));
    sep = ",";
  }
  field("root", a.root);
  if (a.neighbors) {
    std::fprintf(f, "%s\"send_to\":", sep);
    WriteInts(f, a.send_to);
    std::fputs(",\"recv_from\":", f);
    WriteInts(f, a.recv_from);
  }
}

// Writes the whole trace to s.path (lock held). Event names and thread names
// are our own literals, so nothing needs JSON escaping.
bool Write(State& s, std::string* error) {
  // Parents before their phases: by start, the longer first.
  std::sort(s.events.begin(), s.events.end(), [](const Event& a, const Event& b) {
    return a.start != b.start ? a.start < b.start : a.end > b.end;
  });
  const std::string temporary = s.path + ".tmp" + std::to_string(getpid());
  auto fail = [&](const char* what) {
    *error = "jaxfog timeline: cannot " + std::string(what) + " " + temporary + ": " +
             std::strerror(errno);
    std::remove(temporary.c_str());
    return false;
  };
  File file(temporary);
  FILE* f = file.get();
  if (f == nullptr) return fail("create");
  const int pid = s.rank;
  std::fprintf(f,
               "{\"traceEvents\":[\n"
               "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,"
               "\"args\":{\"name\":\"rank %d\"}},\n"
               "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,"
               "\"args\":{\"sort_index\":%d}}",
               pid, s.rank, pid, s.rank);
  for (const auto& [tid, name] : s.thread_names) {
    std::fprintf(f,
                 ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                 "\"args\":{\"name\":\"%s\"}}",
                 pid, tid, name);
  }
  static const char* const kCategories[] = {"phase", "op", "queue"};
  for (const Event& e : s.events) {
    std::fprintf(f, ",\n{\"name\":\"%s", e.name);
    if (e.peer >= 0) std::fprintf(f, " %d", e.peer);
    std::fprintf(f, "\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%s,\"dur\":%s",
                 kCategories[static_cast<int>(e.category)], pid, e.tid,
                 Micros(e.start - s.origin).c_str(), Micros(e.end - e.start).c_str());
    if (e.args >= 0) {
      std::fputs(",\"args\":{", f);
      WriteArgs(f, s.args[e.args]);
      std::fputc('}', f);
    } else if (e.peer >= 0) {
      std::fprintf(f, ",\"args\":{\"peer\":%d}", e.peer);
    }
    std::fputc('}', f);
  }
  // otherData: what `jaxfog timeline merge` needs to put ranks on one clock.
  std::fprintf(f,
               "\n],\n\"displayTimeUnit\":\"ns\",\n\"otherData\":{\"jaxfog_timeline\":1,"
               "\"rank\":%d,\"origin_unix_ns\":%" PRId64 ",\"spans\":%zu,\"dropped_spans\":%" PRIu64
               ",\"max_spans\":%zu}}\n",
               s.rank, s.origin_unix_ns, s.events.size(), s.dropped, kMaxEvents);
  if (std::ferror(f)) return fail("write");
  if (!file.Close()) return fail("write");
  if (std::rename(temporary.c_str(), s.path.c_str()) != 0) {
    *error = "jaxfog timeline: cannot rename " + temporary + " to " + s.path + ": " +
             std::strerror(errno);
    std::remove(temporary.c_str());
    return false;
  }
  return true;
}

}  // namespace

int64_t Now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool Start(const std::string& path_template, int rank, std::string* error) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (path_template.empty()) {  // stop; a later Flush still writes what was recorded
    internal::enabled.store(false, std::memory_order_relaxed);
    return true;
  }
  const std::string path = FileName(path_template, rank);
  if (path == s.path && rank == s.rank) {  // resuming: the file was checked already
    internal::enabled.store(true, std::memory_order_relaxed);
    return true;
  }
  if (!s.path.empty() && !s.events.empty()) {  // do not lose the previous file's spans
    std::string previous;
    if (!Write(s, &previous)) std::fprintf(stderr, "warning: %s\n", previous.c_str());
  }
  s.path = path;
  s.rank = rank;
  s.events.clear();
  s.args.clear();
  s.dropped = 0;
  // Bracket the system clock reading with steady ones: the pair is what
  // aligns ranks, so keep its error to half the bracket.
  const int64_t before = Now();
  s.origin_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  s.origin = before + (Now() - before) / 2;
  if (!Write(s, error)) {
    internal::enabled.store(false, std::memory_order_relaxed);
    s.path.clear();
    return false;
  }
  internal::enabled.store(true, std::memory_order_relaxed);
  return true;
}

bool Flush(std::string* error) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.path.empty()) return true;
  return Write(s, error);
}

void NameThread(const char* name) {
  const int32_t tid = ThreadId();
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const auto& entry : s.thread_names) {
    if (entry.first == tid) return;
  }
  s.thread_names.emplace_back(tid, name);
}

void Span::Begin() {
  start_ = Now();
  if (kind_ == kOp && queued_since >= 0) {
    Append("queued", Category::kQueue, -1, queued_since, start_, nullptr);
    queued_since = -1;
  }
}

int64_t Span::End() {
  if (start_ < 0) return -1;
  const int64_t end = Now();
  Append(name_, kind_ == kOp ? Category::kOp : Category::kPhase, -1, start_, end,
         kind_ == kOp ? &args_ : nullptr);
  start_ = -1;
  return end;
}

void Record(const char* name, int peer, int64_t start, int64_t end) {
  Append(name, Category::kPhase, peer, start, end, nullptr);
}

Queued::Queued(int64_t since) { queued_since = since; }
Queued::~Queued() { queued_since = -1; }

}  // namespace jaxfog::timeline
