// Runs communication off XLA's executor threads.
//
// A handler that blocks in MPI holds its executor thread, so nothing else in
// the computation runs until the messages arrive. Handlers instead hand their
// work to this thread and return an `ffi::Future`: XLA goes on with every
// thunk that does not depend on the result (awc's exchange of x beside the
// forward and backward pass) and resumes the dependants when the future is
// ready. All jaxfog ops are ordered by the effect token, so at most one piece
// of work is outstanding and one thread keeps the order every rank expects.
#ifndef JAXFOG_FFI_COMM_THREAD_H_
#define JAXFOG_FFI_COMM_THREAD_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

class CommThread {
 public:
  using Work = std::function<ffi::Error()>;

  static CommThread& Global();

  // Messages of fewer than `bytes` run inline on the calling thread (handing
  // them over costs more than overlapping them can save); negative: always.
  void set_inline_below(int64_t bytes) { inline_below_.store(bytes); }
  int64_t inline_below() const { return inline_below_.load(); }

  // Runs `work`; the future completes with its error, if any.
  ffi::Future Run(size_t bytes, Work work);

  // A future that completes once all work handed over so far has finished,
  // whatever the inline threshold (the fence XLA waits on before shutdown).
  ffi::Future Fence();

  // Blocks until all work handed over so far has finished (before the
  // transports it uses are released).
  void Drain();

  // A future that is already complete.
  static ffi::Future Done(const ffi::Error& error);

 private:
  CommThread() = default;
  void Loop();
  ffi::Future Enqueue(Work work);

  std::atomic<int64_t> inline_below_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  struct Item {
    Work work;
    ffi::Promise promise;
    int64_t queued_at;  // timeline::Now() at hand-over; -1 when the timeline is off
  };
  std::deque<Item> queue_;
  bool busy_ = false;
  std::thread thread_;  // started on first use; never joined (lives until exit)
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_COMM_THREAD_H_
