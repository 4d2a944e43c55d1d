#include "comm_thread.h"

#include <exception>
#include <new>
#include <string>

#include "timeline.h"

namespace jaxfog {
namespace {

thread_local int queue_only = 0;  // live CommThread::QueueOnly on this thread

// Runs `work`, turning an exception into op `op`'s error: one escaping a
// handler or this thread would terminate the process with no word of which op
// failed, while the other ranks wait for it until their timeout.
ffi::Error Guarded(const char* op, const CommThread::Work& work) noexcept {
  try {
    return work();
  } catch (...) {
    return CurrentException(std::string("jaxfog ") + op);
  }
}

}  // namespace

ffi::Error CurrentException(const std::string& where) noexcept {
  try {
    throw;
  } catch (const std::bad_alloc& e) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      where + ": out of memory for its buffers (" + e.what() + ")");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(where + ": failed with an exception: " + e.what());
  } catch (...) {
    return ffi::Error::Internal(where + ": failed with an exception of unknown type");
  }
}

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

CommThread::QueueOnly::QueueOnly() { ++queue_only; }
CommThread::QueueOnly::~QueueOnly() { --queue_only; }

ffi::Future CommThread::Run(const char* op, size_t bytes, Work work) {
  const int64_t threshold = inline_below_.load(std::memory_order_relaxed);
  if (queue_only == 0 && (threshold < 0 || static_cast<int64_t>(bytes) < threshold)) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (queue_.empty() && !busy_) return Done(RunInline(lock, op, work));
  }
  return Enqueue(op, std::move(work));
}

ffi::Error CommThread::RunInline(std::unique_lock<std::mutex>& lock, const char* op,
                                 const Work& work) {
  busy_ = true;  // keeps later work (queued or inline) behind this
  lock.unlock();
  const ffi::Error error = Guarded(op, work);
  lock.lock();
  busy_ = false;
  if (!queue_.empty()) {
    wake_.notify_one();
  } else if (!completing_) {
    idle_.notify_all();
  }
  return error;
}

ffi::Future CommThread::Fence() {
  return Enqueue("fence", [] { return ffi::Error::Success(); });
}

ffi::Future CommThread::Enqueue(const char* op, Work work) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const int64_t queued_at = timeline::Enabled() ? timeline::Now() : -1;
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    queue_.push_back({op, std::move(work), std::move(promise), queued_at});
  } catch (const std::exception& e) {  // std::bad_alloc, std::system_error
    return Done(ffi::Error(
        ffi::ErrorCode::kResourceExhausted,
        std::string("jaxfog ") + op + ": cannot hand it to the communication thread: " + e.what()));
  }
  wake_.notify_one();
  return future;
}

void CommThread::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return queue_.empty() && !busy_ && !completing_; });
}

void CommThread::Loop() {
  timeline::NameThread("jaxfog communication thread");
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return !queue_.empty() && !busy_; });
    Item item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    const ffi::Error error = [&item] {
      // The op's span shows how long the work waited for this thread; scoped
      // to the work, not to the continuations XLA may run in SetAvailable.
      timeline::Queued queued(item.queued_at);
      return Guarded(item.op, item.work);
    }();
    // XLA may run the thunks waiting on the future right here, inside
    // SetAvailable; they can only hand over new work (which may run inline
    // here: this work is done), never wait for it. Drain waits for them too.
    lock.lock();
    busy_ = false;
    completing_ = true;
    lock.unlock();
    if (error.success()) {
      item.promise.SetAvailable();
    } else {
      item.promise.SetError(error);
    }
    lock.lock();
    completing_ = false;
    if (queue_.empty() && !busy_) idle_.notify_all();
  }
}

}  // namespace jaxfog
