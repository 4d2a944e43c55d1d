#include "nonblocking.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "call.h"
#include "status.h"
#include "timeline.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace {

// Handle ids are integers a float32 holds exactly.
constexpr uint32_t kHandleIdLimit = uint32_t{1} << 24;

// The started ops not yet waited for, by handle id (process-wide).
class Handles {
 public:
  static Handles& Global() {
    static Handles* handles = new Handles();  // never destroyed: handlers may run at exit
    return *handles;
  }

  ffi::ErrorOr<uint32_t> Add(std::shared_ptr<OpHandle> handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (handles_.size() >= kHandleIdLimit - 1) {
      return ffi::Unexpected<ffi::Error>(
          ffi::Error(ffi::ErrorCode::kResourceExhausted,
                     "jaxfog: " + std::to_string(handles_.size()) +
                         " nonblocking ops are handle, none waited for: wait for their handles"));
    }
    do {
      next_ = next_ + 1 < kHandleIdLimit ? next_ + 1 : 1;
    } while (handles_.count(next_));
    handles_[next_] = std::move(handle);
    return next_;
  }

  std::shared_ptr<OpHandle> Take(uint32_t handle_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = handles_.find(handle_id);
    if (it == handles_.end()) return nullptr;
    std::shared_ptr<OpHandle> handle = std::move(it->second);
    handles_.erase(it);
    return handle;
  }

  std::shared_ptr<OpHandle> Find(uint32_t handle_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = handles_.find(handle_id);
    return it == handles_.end() ? nullptr : it->second;
  }

  std::map<uint32_t, std::shared_ptr<OpHandle>> TakeAll() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(handles_);
  }

  std::map<std::string, int> Count() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, int> count;
    for (const auto& [handle_id, handle] : handles_) ++count[OpName(handle->op())];
    return count;
  }

 private:
  std::mutex mutex_;
  uint32_t next_ = 0;
  std::map<uint32_t, std::shared_ptr<OpHandle>> handles_;
};

ffi::ErrorOr<uint32_t> HandleIdOf(float value) {
  if (!(value >= 0 && value < float(kHandleIdLimit)) || value != static_cast<uint32_t>(value)) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument("jaxfog.wait: " + std::to_string(value) +
                                    " is not a handle's id (a handle's arrays were changed)"));
  }
  return static_cast<uint32_t>(value);
}

ffi::Error NotPending(uint32_t handle_id) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxfog.wait: handle " + std::to_string(handle_id) +
                        " is not pending on this process: it was already waited for (wait "
                        "for each handle once), or started before jaxfog.shutdown()");
}

std::vector<Piece> OutputPieces(ffi::RemainingRets rets, ffi::Error* error) {
  std::vector<Piece> pieces;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto result = rets.get<ffi::AnyBuffer>(i);
    if (result.has_error()) {
      *error = result.error();
      return {};
    }
    pieces.push_back({(*result)->untyped_data(), (*result)->size_bytes()});
  }
  return pieces;
}

// Zeros into `outputs` through `copier` (the wait of handle id 0).
ffi::Error Zeros(DeviceCopier* copier, const std::vector<Piece>& outputs) {
  size_t most = 0;
  for (const Piece& piece : outputs) most = std::max(most, piece.bytes);
  std::vector<char> zeros(most, 0);
  for (const Piece& piece : outputs) {
    JAXFOG_RETURN_IF_ERROR(copier->ToDevice(piece.data, zeros.data(), piece.bytes));
  }
  return copier->Wait();
}

// jaxfog_wait on host buffers: completes when the op has and its results are copied out.
ffi::Future WaitOnHost(ffi::Token, ffi::AnyBuffer handle_id_buffer, ffi::RemainingArgs,
                       ffi::Result<ffi::Token>, ffi::RemainingRets rets) {
  ffi::Error error = ffi::Error::Success();
  std::vector<Piece> outputs = OutputPieces(rets, &error);
  if (!error.success()) return CommThread::Done(error);
  float value;
  std::memcpy(&value, handle_id_buffer.untyped_data(), sizeof(value));
  auto handle_id = HandleIdOf(value);
  if (handle_id.has_error()) return CommThread::Done(handle_id.error());
  HostCopier copier;
  if (*handle_id == 0) return CommThread::Done(Zeros(&copier, outputs));
  std::shared_ptr<OpHandle> handle = Handles::Global().Take(*handle_id);
  if (!handle) return CommThread::Done(NotPending(*handle_id));
  auto promise = std::make_shared<ffi::Promise>();
  ffi::Future future(*promise);
  const int64_t waiting_since = timeline::Enabled() ? timeline::Now() : -1;
  handle->Then([handle, outputs, promise, waiting_since](const ffi::Error& outcome) {
    if (waiting_since >= 0) {  // how long the wait waited for the op (0 if it had finished)
      timeline::Record("wait for the op", -1, waiting_since, timeline::Now());
    }
    HostCopier copier;
    ffi::Error error =
        outcome.success() ? handle->staging()->FinishInto(&copier, outputs) : outcome;
    if (error.success()) {
      promise->SetAvailable();
    } else {
      promise->SetError(error);
    }
  });
  return future;
}

// jaxfog_wait on CUDA buffers (the handle id on the device too): synchronous.
ffi::Error WaitOnDevice(ffi::Token, ffi::AnyBuffer handle_id_buffer, ffi::RemainingArgs,
                        ffi::Result<ffi::Token>, ffi::RemainingRets rets, void* stream) {
  std::unique_ptr<DeviceCopier> copier = MakeCudaCopier(stream);
  if (!copier) return BuiltWithoutCuda("jaxfog.wait");
  ffi::Error error = ffi::Error::Success();
  std::vector<Piece> outputs = OutputPieces(rets, &error);
  JAXFOG_RETURN_IF_ERROR(error);
  float value;
  JAXFOG_RETURN_IF_ERROR(copier->ToHost(&value, handle_id_buffer.untyped_data(), sizeof(value)));
  JAXFOG_RETURN_IF_ERROR(copier->Wait());
  JAXFOG_ASSIGN_OR_FAIL(handle_id, HandleIdOf(value));
  if (handle_id == 0) return Zeros(copier.get(), outputs);
  std::shared_ptr<OpHandle> handle = Handles::Global().Take(handle_id);
  if (!handle) return NotPending(handle_id);
  JAXFOG_RETURN_IF_ERROR(handle->Await());
  return handle->staging()->FinishInto(copier.get(), outputs);
}

auto WaitBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Token>()
      .Arg<ffi::AnyBuffer>()
      .RemainingArgs()
      .Ret<ffi::Token>()
      .RemainingRets();
}

}  // namespace

ffi::Error OpHandle::WriteHandleId(void* where, float handle_id) {
  JAXFOG_RETURN_IF_ERROR(copier_->ToDevice(where, &handle_id, sizeof(handle_id)));
  return copier_->Wait();
}

void OpHandle::Follow(const std::shared_ptr<OpHandle>& self, ffi::Future future) {
  future.OnReady([self](const std::optional<ffi::Error>& error) {
    self->Finish(error ? *error : ffi::Error::Success());
  });
}

void OpHandle::Finish(const ffi::Error& error) {
  std::function<void(const ffi::Error&)> then;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    outcome_ = error;
    then = std::move(then_);
  }
  finished_.notify_all();
  if (then) then(error);
}

void OpHandle::Then(std::function<void(const ffi::Error&)> then) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!outcome_) {
    then_ = std::move(then);
    return;
  }
  const ffi::Error outcome = *outcome_;
  lock.unlock();
  then(outcome);
}

ffi::Error OpHandle::Await() {
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [this] { return outcome_.has_value(); });
  return *outcome_;
}

std::optional<ffi::Error> OpHandle::Outcome() {
  std::lock_guard<std::mutex> lock(mutex_);
  return outcome_;
}

ffi::Error Register(std::shared_ptr<OpHandle> handle) {
  // An op that failed as it decoded its call (bad input) fails its start.
  if (std::optional<ffi::Error> outcome = handle->Outcome(); outcome && !outcome->success()) {
    return *outcome;
  }
  void* where = handle->staging()->handle_id();
  if (where == nullptr) {
    return ffi::Error::Internal("jaxfog: a nonblocking start without its handle id result");
  }
  OpHandle* started = handle.get();
  JAXFOG_ASSIGN_OR_FAIL(handle_id, Handles::Global().Add(std::move(handle)));
  return started->WriteHandleId(where, static_cast<float>(handle_id));
}

}  // namespace jaxfog

// --- exported: the waits and what the Python runtime asks -------------------

#pragma GCC visibility push(default)

extern "C" XLA_FFI_Error* jaxfog_wait(XLA_FFI_CallFrame* frame) {
  XLA_FFI_DEFINE_HANDLER(handler, jaxfog::WaitOnHost, jaxfog::WaitBinding());
  return (*handler)(frame);
}

extern "C" XLA_FFI_Error* jaxfog_wait_staged(XLA_FFI_CallFrame* frame) {
  XLA_FFI_DEFINE_HANDLER(handler, jaxfog::WaitOnDevice,
                         jaxfog::WaitBinding().Ctx<xla::ffi::PlatformStream<void*>>());
  return (*handler)(frame);
}

// Whether the op of `handle_id` has finished: 1 yes, 0 not yet, -1 not pending.
extern "C" int jaxfog_handle_done(float handle_id) {
  if (!(handle_id >= 1 && handle_id < float(jaxfog::kHandleIdLimit))) return -1;
  auto handle = jaxfog::Handles::Global().Find(static_cast<uint32_t>(handle_id));
  if (!handle) return -1;
  return handle->Outcome().has_value() ? 1 : 0;
}

// Forgets every pending op (their work must have finished: fence first) and
// writes "<count> <op>" per op into `text`; returns how many there were.
extern "C" int jaxfog_handles_discard(char* text, int64_t size) {
  std::map<std::string, int> count = jaxfog::Handles::Global().Count();
  jaxfog::Handles::Global().TakeAll();
  std::string summary;
  int total = 0;
  for (const auto& [op, n] : count) {
    summary += (summary.empty() ? "" : ", ") + std::to_string(n) + " " + op;
    total += n;
  }
  if (size > 0) {
    std::snprintf(text, static_cast<size_t>(size), "%s", summary.c_str());
  }
  return total;
}

#pragma GCC visibility pop
