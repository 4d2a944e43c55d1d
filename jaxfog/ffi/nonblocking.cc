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

// Tickets are integers a float32 holds exactly.
constexpr uint32_t kTicketLimit = uint32_t{1} << 24;

// The started ops not yet waited for, by ticket (process-wide).
class Handles {
 public:
  static Handles& Global() {
    static Handles* handles = new Handles();  // never destroyed: handlers may run at exit
    return *handles;
  }

  ffi::ErrorOr<uint32_t> Add(std::shared_ptr<Pending> pending) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_.size() >= kTicketLimit - 1) {
      return ffi::Unexpected<ffi::Error>(
          ffi::Error(ffi::ErrorCode::kResourceExhausted,
                     "jaxfog: " + std::to_string(pending_.size()) +
                         " nonblocking ops are pending, none waited for: wait for their handles"));
    }
    do {
      next_ = next_ + 1 < kTicketLimit ? next_ + 1 : 1;
    } while (pending_.count(next_));
    pending_[next_] = std::move(pending);
    return next_;
  }

  std::shared_ptr<Pending> Take(uint32_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(ticket);
    if (it == pending_.end()) return nullptr;
    std::shared_ptr<Pending> pending = std::move(it->second);
    pending_.erase(it);
    return pending;
  }

  std::shared_ptr<Pending> Find(uint32_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(ticket);
    return it == pending_.end() ? nullptr : it->second;
  }

  std::map<uint32_t, std::shared_ptr<Pending>> TakeAll() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(pending_);
  }

  std::map<std::string, int> Count() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, int> count;
    for (const auto& [ticket, pending] : pending_) ++count[OpName(pending->op())];
    return count;
  }

 private:
  std::mutex mutex_;
  uint32_t next_ = 0;
  std::map<uint32_t, std::shared_ptr<Pending>> pending_;
};

ffi::ErrorOr<uint32_t> TicketOf(float value) {
  if (!(value >= 0 && value < float(kTicketLimit)) || value != static_cast<uint32_t>(value)) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument("jaxfog.wait: " + std::to_string(value) +
                                    " is not a handle's ticket (a handle's arrays were changed)"));
  }
  return static_cast<uint32_t>(value);
}

ffi::Error NotPending(uint32_t ticket) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxfog.wait: handle " + std::to_string(ticket) +
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

// Zeros into `outputs` through `copier` (the wait of ticket 0).
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
ffi::Future WaitOnHost(ffi::Token, ffi::AnyBuffer ticket_buffer, ffi::RemainingArgs,
                       ffi::Result<ffi::Token>, ffi::RemainingRets rets) {
  ffi::Error error = ffi::Error::Success();
  std::vector<Piece> outputs = OutputPieces(rets, &error);
  if (!error.success()) return CommThread::Done(error);
  float value;
  std::memcpy(&value, ticket_buffer.untyped_data(), sizeof(value));
  auto ticket = TicketOf(value);
  if (ticket.has_error()) return CommThread::Done(ticket.error());
  HostCopier copier;
  if (*ticket == 0) return CommThread::Done(Zeros(&copier, outputs));
  std::shared_ptr<Pending> pending = Handles::Global().Take(*ticket);
  if (!pending) return CommThread::Done(NotPending(*ticket));
  auto promise = std::make_shared<ffi::Promise>();
  ffi::Future future(*promise);
  const int64_t waiting_since = timeline::Enabled() ? timeline::Now() : -1;
  pending->Then([pending, outputs, promise, waiting_since](const ffi::Error& outcome) {
    if (waiting_since >= 0) {  // how long the wait waited for the op (0 if it had finished)
      timeline::Record("wait for the op", -1, waiting_since, timeline::Now());
    }
    HostCopier copier;
    ffi::Error error =
        outcome.success() ? pending->staging()->FinishInto(&copier, outputs) : outcome;
    if (error.success()) {
      promise->SetAvailable();
    } else {
      promise->SetError(error);
    }
  });
  return future;
}

// jaxfog_wait on CUDA buffers (the ticket on the device too): synchronous.
ffi::Error WaitOnDevice(ffi::Token, ffi::AnyBuffer ticket_buffer, ffi::RemainingArgs,
                        ffi::Result<ffi::Token>, ffi::RemainingRets rets, void* stream) {
  std::unique_ptr<DeviceCopier> copier = MakeCudaCopier(stream);
  if (!copier) return BuiltWithoutCuda("jaxfog.wait");
  ffi::Error error = ffi::Error::Success();
  std::vector<Piece> outputs = OutputPieces(rets, &error);
  JAXFOG_RETURN_IF_ERROR(error);
  float value;
  JAXFOG_RETURN_IF_ERROR(copier->ToHost(&value, ticket_buffer.untyped_data(), sizeof(value)));
  JAXFOG_RETURN_IF_ERROR(copier->Wait());
  JAXFOG_ASSIGN_OR_FAIL(ticket, TicketOf(value));
  if (ticket == 0) return Zeros(copier.get(), outputs);
  std::shared_ptr<Pending> pending = Handles::Global().Take(ticket);
  if (!pending) return NotPending(ticket);
  JAXFOG_RETURN_IF_ERROR(pending->Await());
  return pending->staging()->FinishInto(copier.get(), outputs);
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

ffi::Error Pending::WriteTicket(void* where, float ticket) {
  JAXFOG_RETURN_IF_ERROR(copier_->ToDevice(where, &ticket, sizeof(ticket)));
  return copier_->Wait();
}

void Pending::Follow(const std::shared_ptr<Pending>& self, ffi::Future future) {
  future.OnReady([self](const std::optional<ffi::Error>& error) {
    self->Finish(error ? *error : ffi::Error::Success());
  });
}

void Pending::Finish(const ffi::Error& error) {
  std::function<void(const ffi::Error&)> then;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    outcome_ = error;
    then = std::move(then_);
  }
  finished_.notify_all();
  if (then) then(error);
}

void Pending::Then(std::function<void(const ffi::Error&)> then) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!outcome_) {
    then_ = std::move(then);
    return;
  }
  const ffi::Error outcome = *outcome_;
  lock.unlock();
  then(outcome);
}

ffi::Error Pending::Await() {
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [this] { return outcome_.has_value(); });
  return *outcome_;
}

std::optional<ffi::Error> Pending::Outcome() {
  std::lock_guard<std::mutex> lock(mutex_);
  return outcome_;
}

ffi::Error Register(std::shared_ptr<Pending> pending) {
  // An op that failed as it decoded its call (bad input) fails its start.
  if (std::optional<ffi::Error> outcome = pending->Outcome(); outcome && !outcome->success()) {
    return *outcome;
  }
  void* where = pending->staging()->ticket();
  if (where == nullptr) {
    return ffi::Error::Internal("jaxfog: a nonblocking start without its ticket result");
  }
  Pending* started = pending.get();
  JAXFOG_ASSIGN_OR_FAIL(ticket, Handles::Global().Add(std::move(pending)));
  return started->WriteTicket(where, static_cast<float>(ticket));
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

// Whether the op of `ticket` has finished: 1 yes, 0 not yet, -1 not pending.
extern "C" int jaxfog_handle_done(float ticket) {
  if (!(ticket >= 1 && ticket < float(jaxfog::kTicketLimit))) return -1;
  auto pending = jaxfog::Handles::Global().Find(static_cast<uint32_t>(ticket));
  if (!pending) return -1;
  return pending->Outcome().has_value() ? 1 : 0;
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
