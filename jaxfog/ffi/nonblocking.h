// Nonblocking ops across XLA calls: BlueFog's `*_nonblocking` and `wait`.
//
// jaxfog_<op>_start runs op <op> through host staging (staging.h): its inputs
// are copied to host scratch before the call returns, so the caller may reuse
// or donate them; the op is handed to the communication thread in program
// order, like any op, and writes its results to host scratch. The call
// returns a handle id instead of the results. jaxfog_wait takes the handle id,
// waits for the op and copies its results out. A wait does not communicate,
// so a rank may wait for its handles in any order.
//
// The handle id is a float32 scalar holding a small integer id, so that it can
// carry a cotangent: the adjoint of start/wait is start/wait of the adjoint
// op, and the adjoint start's handle id travels back as the cotangent of the
// forward handle id (jaxfog/ops/_call.py). Handle id 0 is the zero
// cotangent: waiting for it gives zeros, and no op has it.
//
// The start's call frame is the op's own (attributes, token, inputs, token,
// results) with the handle id as one more result at the end; the op's results
// there are placeholders it never writes (its staging redirects them).
#ifndef JAXFOG_FFI_NONBLOCKING_H_
#define JAXFOG_FFI_NONBLOCKING_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "comm_thread.h"
#include "ops.h"
#include "staging.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

template <OpCode>
struct Handler;  // handler.h

// A started op: its staging (host copies of its inputs, host scratch for its
// results) and, once it has finished, its outcome.
class OpHandle {
 public:
  OpHandle(OpCode op, std::unique_ptr<DeviceCopier> copier)
      : op_(op), copier_(std::move(copier)), staging_(copier_.get(), /*with_handle_id=*/true) {}

  OpCode op() const { return op_; }
  Staging* staging() { return &staging_; }
  // Writes `handle_id` to `where` (device or host memory, as the op's buffers).
  ffi::Error WriteHandleId(void* where, float handle_id);

  // Keeps the outcome of the op's future (or of its synchronous run).
  static void Follow(const std::shared_ptr<OpHandle>& self, ffi::Future future);
  void Follow(const ffi::Error& error) { Finish(error); }

  // Calls `then` with the outcome once the op has finished: on this thread if
  // it has, else on the thread that finishes it.
  void Then(std::function<void(const ffi::Error&)> then);
  // The outcome, once the op has finished (blocks).
  ffi::Error Await();
  // The outcome if the op has finished.
  std::optional<ffi::Error> Outcome();

 private:
  void Finish(const ffi::Error& error);

  OpCode op_;
  std::unique_ptr<DeviceCopier> copier_;  // the start's (its stream, on a GPU)
  Staging staging_;
  std::mutex mutex_;
  std::condition_variable finished_;
  std::optional<ffi::Error> outcome_;
  std::function<void(const ffi::Error&)> then_;
};

// Registers a started op and writes its handle id into the start call's handle id
// result (its staging's); an op that already failed (bad input) fails the
// start.
ffi::Error Register(std::shared_ptr<OpHandle> handle);

// The start form of op `op`'s handler: Handler<op>::Run through an OpHandle's
// staging, the messages always handed to the communication thread.
template <OpCode op, typename Signature = decltype(&Handler<op>::Handle)>
struct Start;
template <OpCode op, typename R, typename... Args>
struct Start<op, R (*)(Args...)> {
  static ffi::Error Run(std::unique_ptr<DeviceCopier> copier, Args... args) {
    auto handle = std::make_shared<OpHandle>(op, std::move(copier));
    {
      CommThread::QueueOnly queue_only;  // a start returns before its messages move
      R started = Handler<op>::Run(handle->staging(), std::move(args)...);
      if constexpr (std::is_same_v<R, ffi::Future>) {
        OpHandle::Follow(handle, std::move(started));
      } else {
        handle->Follow(started);
      }
    }
    return Register(std::move(handle));
  }
  static ffi::Error Handle(Args... args) {
    return Run(std::make_unique<HostCopier>(), std::move(args)...);
  }
  static auto Bind() { return Handler<op>::Bind(); }
};

// The start form on CUDA buffers, staged on the stream XLA gives the call.
template <OpCode op, typename Signature = decltype(&Handler<op>::Handle)>
struct CudaStart;
template <OpCode op, typename R, typename... Args>
struct CudaStart<op, R (*)(Args...)> {
  static ffi::Error Handle(Args... args, void* stream) {
    std::unique_ptr<DeviceCopier> copier = MakeCudaCopier(stream);
    if (!copier) return BuiltWithoutCuda(std::string("jaxfog ") + OpName(op) + " (nonblocking)");
    return Start<op>::Run(std::move(copier), std::move(args)...);
  }
  static auto Bind() { return Handler<op>::Bind().template Ctx<ffi::PlatformStream<void*>>(); }
};

// XLA's handler of a start form `Impl` of op `op` on `frame`: the op's
// binding, whose remaining results take the handle id too (Outputs in call.h
// sets it aside).
template <OpCode op, typename Impl>
XLA_FFI_Error* CallStartHandler(XLA_FFI_CallFrame* frame) {
  XLA_FFI_DEFINE_HANDLER(handler, (Guard<op, &Impl::Handle>::Run), Impl::Bind());
  return (*handler)(frame);
}

}  // namespace jaxfog

#endif  // JAXFOG_FFI_NONBLOCKING_H_
