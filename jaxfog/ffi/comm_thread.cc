#include "comm_thread.h"

#include "timeline.h"

namespace jaxfog {

CommThread& CommThread::Global() {
  static CommThread* thread = new CommThread();  // never destroyed: see thread_
  return *thread;
}

ffi::Future CommThread::Done(const ffi::Error& error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(error);
  }
  return future;
}

ffi::Future CommThread::Run(size_t bytes, Work work) {
  const int64_t threshold = inline_below_.load();
  if (threshold < 0 || static_cast<int64_t>(bytes) < threshold) return Done(work());
  return Enqueue(std::move(work));
}

ffi::Future CommThread::Fence() {
  return Enqueue([] { return ffi::Error::Success(); });
}

ffi::Future CommThread::Enqueue(Work work) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const int64_t queued_at = timeline::Enabled() ? timeline::Now() : -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    queue_.push_back({std::move(work), std::move(promise), queued_at});
  }
  wake_.notify_one();
  return future;
}

void CommThread::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

void CommThread::Loop() {
  timeline::NameThread("jaxfog communication thread");
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return !queue_.empty(); });
    auto [work, promise, queued_at] = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    const ffi::Error error = [&, queued_at = queued_at] {
      // The op's span shows how long the work waited for this thread; scoped
      // to the work, not to the continuations XLA may run in SetAvailable.
      timeline::Queued queued(queued_at);
      return work();
    }();
    // XLA may run the thunks waiting on the future right here, inside
    // SetAvailable; they can only hand this thread new work, never wait for it.
    if (error.success()) {
      promise.SetAvailable();
    } else {
      promise.SetError(error);
    }
    lock.lock();
    busy_ = false;
    if (queue_.empty()) idle_.notify_all();
  }
}

}  // namespace jaxfog
