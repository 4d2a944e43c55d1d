// Runs communication off XLA's executor threads.
//
// A handler that blocks in MPI holds its executor thread, so nothing else in
// the computation runs until the messages arrive. Handlers instead hand their
// work to this thread and return an `ffi::Future`: XLA goes on with every
// thunk that does not depend on the result (awc's exchange of x beside the
// forward and backward pass) and resumes the dependants when the future is
// ready. Within a computation the effect token orders every op; across
// computations dispatched one after another (jaxfog.jit calls that are not
// waited for) only PjRt's scheduling does, and it promises nothing about work
// still pending in a future. So work runs in the order it was handed over,
// inline or not: a small op runs inline only when nothing is queued or
// running, otherwise it queues behind what came before it. One sequence, the
// same on every rank.
//
// Work that throws (std::bad_alloc from a scratch buffer, anything else) fails
// its op with an error naming the exception; the thread goes on.
#ifndef JAXFOG_FFI_COMM_THREAD_H_
#define JAXFOG_FFI_COMM_THREAD_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "ops.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

class CommThread {
 public:
  using Work = std::function<ffi::Error()>;

  static CommThread& Global();

  // Messages of fewer than `bytes` run inline on the calling thread (handing
  // them over costs more than overlapping them can save) when no earlier work
  // is queued or running; negative: always (then nothing is ever queued).
  void set_inline_below(int64_t bytes) { inline_below_.store(bytes); }
  int64_t inline_below() const { return inline_below_.load(); }

  // Runs `work`, op `op` (a static string, for errors) on `bytes` of message;
  // the future completes with its error, if any.
  ffi::Future Run(const char* op, size_t bytes, Work work);

  // A future that completes once all work handed over so far has finished,
  // whatever the inline threshold (the fence XLA waits on before shutdown).
  ffi::Future Fence();

  // Blocks until all work handed over so far has finished (before the
  // transports it uses are released).
  void Drain();

  // A future that is already complete.
  static ffi::Future Done(const ffi::Error& error);

  // While one lives on a thread, work handed over from it is always queued,
  // never run inline: a nonblocking op's start returns before its messages
  // move.
  class QueueOnly {
   public:
    QueueOnly();
    ~QueueOnly();
    QueueOnly(const QueueOnly&) = delete;
    QueueOnly& operator=(const QueueOnly&) = delete;
  };

 private:
  CommThread() = default;
  void Loop();
  ffi::Future Enqueue(const char* op, Work work);
  // Runs `work` on the calling thread; `lock` (released meanwhile) held the
  // mutex with the queue empty and nothing running.
  ffi::Error RunInline(std::unique_lock<std::mutex>& lock, const char* op, const Work& work);

  std::atomic<int64_t> inline_below_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  struct Item {
    const char* op;
    Work work;
    ffi::Promise promise;
    int64_t queued_at;  // timeline::Now() at hand-over; -1 when the timeline is off
  };
  std::deque<Item> queue_;
  bool busy_ = false;        // work is running (here or inline on a caller)
  bool completing_ = false;  // the thread is completing a future (see Loop)
  std::thread thread_;       // started on first use; never joined (lives until exit)
};

// The error that the exception being handled becomes for `where` (call it in
// a catch block): out of memory, or the exception's message.
ffi::Error CurrentException(const std::string& where) noexcept;

// `Handle` (an FFI handler, returning an ffi::Error or an ffi::Future) with
// every exception turned into op `op`'s error: one escaping an FFI handler
// while it decodes its call would terminate the process without a word, while
// the other ranks wait for it until their timeout. The exported handlers are
// these.
template <OpCode op, auto Handle>
struct Guard;
template <OpCode op, typename R, typename... Args, R (*Handle)(Args...)>
struct Guard<op, Handle> {
  static R Run(Args... args) noexcept {
    try {
      return Handle(std::move(args)...);
    } catch (...) {
      ffi::Error error = CurrentException(std::string("jaxfog ") + OpName(op));
      if constexpr (std::is_same_v<R, ffi::Future>) {
        return CommThread::Done(error);
      } else {
        return error;
      }
    }
  }
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_COMM_THREAD_H_
