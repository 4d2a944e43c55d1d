// What the MPI handlers share. One handler per op of the table in ops.h,
// Handler<OpCode>: it decodes buffers and attributes, lays out the messages,
// and calls the transport.
// Every communicating handler takes and returns the token of jaxfog's ordered
// effect, which fixes the order of all communication identically on every rank.
//
// Communicating handlers are asynchronous: they decode and validate at once
// (bad input fails the call), copy what they need out of the call frame into a
// Job, and hand the Job to the CommThread, returning its future.
//
// The handlers live by concern, each file specialising Handler for its ops:
//   collective_handlers.cc  the process queries, barrier, fence and the
//                           collectives over every rank of a communicator
//   neighbor_handlers.cc    the exchanges with neighbours (and transposes)
//   window_handlers.cc      one-sided windows
//   handler_exports.cc      the exported symbols jaxfog_<name>, per op
// (The NCCL transport's handlers, nccl_handlers.cc, share call.h, not this.)
// Each of those .cc files keeps its message code and job factories in an
// anonymous namespace, and specialises Handler after it, at namespace scope.
//
// Private to those files.
#ifndef JAXFOG_FFI_HANDLER_H_
#define JAXFOG_FFI_HANDLER_H_

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "call.h"
#include "comm_thread.h"
#include "nonblocking.h"
#include "ops.h"
#include "registry.h"
#include "scratch.h"
#include "staging.h"
#include "status.h"
#include "timeline.h"
#include "transport.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

// --- message layouts ---------------------------------------------------------

inline constexpr size_t kAlign = ScratchPool::kAlign;
inline size_t AlignUp(size_t n, size_t align = kAlign) { return (n + align - 1) / align * align; }

// Offsets of the leaves in a contiguous layout, each at a multiple of
// `align`; returns its size. Buffers that kernels read are cache-line
// aligned; a packed message (collectives) is not padded, since padding would
// travel: a compressed payload's few bytes per leaf would grow to 64.
inline size_t Layout(const std::vector<Leaf>& leaves, std::vector<size_t>* offsets,
                     size_t align = kAlign) {
  size_t total = 0;
  offsets->clear();
  for (const Leaf& leaf : leaves) {
    offsets->push_back(total);
    total += AlignUp(leaf.bytes, align);
  }
  return total;
}

// --- jobs and handlers -------------------------------------------------------

// An op decoded out of its call frame (which is gone once the handler has
// returned; the buffers stay alive until the future completes).
struct Job {
  OpCode op;     // names the op in the error an exception becomes
  size_t bytes;  // message size, to decide whether to run inline
  CommThread::Work run;
};

inline ffi::Future Launch(ffi::ErrorOr<Job> job) {
  if (job.has_error()) return CommThread::Done(job.error());
  return CommThread::Global().Run(OpName(job->op), job->bytes, std::move(job->run));
}

// What every pytree op decodes first: its communicator and its leaves.
struct Call {
  Transport* transport;
  std::vector<Leaf> in, out;
};

inline ffi::ErrorOr<Call> Decode(Staging* staging, int64_t comm_id, ffi::RemainingArgs args,
                                 ffi::RemainingRets rets, OpCode op) {
  JAXFOG_ASSIGN_OR_RETURN(transport, LookupTransport(comm_id));
  JAXFOG_ASSIGN_OR_RETURN(in, Inputs(staging, args, OpName(op)));
  JAXFOG_ASSIGN_OR_RETURN(out, Outputs(staging, rets));
  if (staging == nullptr) {  // XLA's fresh host buffers (staged ones come from a pool)
    for (const Leaf& leaf : out) AdviseHugePages(leaf.out, leaf.bytes);
  }
  return Call{transport, std::move(in), std::move(out)};
}

// A Job whose work runs inside the op's timeline span. `work(trace)` gets the
// span's args to add its own (peers, root) while the timeline records, and
// null otherwise, so that off the span costs one flag check.
template <typename Work>
Job TracedJob(OpCode op, int64_t comm_id, Transport* transport, int64_t signature, size_t bytes,
              Work work) {
  return Job{op, bytes, [op, comm_id, transport, signature, bytes, work = std::move(work)] {
               timeline::Span span(OpName(op), timeline::Span::kOp);
               timeline::OpArgs* trace = nullptr;
               if (span) {
                 trace = &span.args();
                 trace->comm = comm_id;
                 trace->bytes = static_cast<int64_t>(bytes);
                 trace->seq =
                     static_cast<int64_t>(transport->sequence() + 1);  // the op about to run
                 trace->signature = signature;
               }
               return work(trace);
             }};
}

// The handler of each op in ops.h: a static Run(staging, args...), the op
// with its buffers staged through `staging` (null: as they are), a static
// Handle(args...) = Run(nullptr, args...), and a static Bind() returning its
// XLA FFI binding (the attributes, arguments and results Handle takes, in
// order). Each concern's .cc specialises it for its ops; an op of the table
// without one does not build (see Exports below).
template <OpCode>
struct Handler;

// Wraps a Job factory as a handler with the same arguments whose job runs on
// the communication thread.
template <auto MakeJob>
struct OnCommThread;
template <typename... Args, ffi::ErrorOr<Job> (*MakeJob)(Staging*, Args...)>
struct OnCommThread<MakeJob> {
  static ffi::Future Run(Staging* staging, Args... args) {
    return Launch(MakeJob(staging, std::move(args)...));
  }
  static ffi::Future Handle(Args... args) { return Run(nullptr, std::move(args)...); }
};

// --- host staging (the GPU path without NCCL) --------------------------------

inline ffi::Error Wait(ffi::Error error) { return error; }

inline ffi::Error Wait(ffi::Future future) {
  std::promise<ffi::Error> done;
  future.OnReady([&done](const std::optional<ffi::Error>& error) {
    done.set_value(error ? *error : ffi::Error::Success());
  });
  return done.get_future().get();
}

// Runs op `op` with its buffers staged through the host by `copier`: its
// inputs are copied to the host as it decodes them, the op runs (on the
// communication thread, in order with every other op) and this thread waits
// for it, then the outputs are copied back. Synchronous: the host scratch
// must outlive the copies.
template <OpCode op, typename Signature = decltype(&Handler<op>::Handle)>
struct Staged;
template <OpCode op, typename R, typename... Args>
struct Staged<op, R (*)(Args...)> {
  static ffi::Error Run(DeviceCopier* copier, Args... args) {
    Staging staging(copier);
    JAXFOG_RETURN_IF_ERROR(Wait(Handler<op>::Run(&staging, std::move(args)...)));
    return staging.Finish();
  }
};

// Op `op` over host memory standing in for a device (JAXFOG_HOST_STAGING=1):
// the staged path's code, testable on CPU machines.
template <OpCode op, typename Signature = decltype(&Handler<op>::Handle)>
struct HostStaged;
template <OpCode op, typename R, typename... Args>
struct HostStaged<op, R (*)(Args...)> {
  static ffi::Error Handle(Args... args) {
    HostCopier copier;
    return Staged<op>::Run(&copier, std::move(args)...);
  }
  static auto Bind() { return Handler<op>::Bind(); }
};

// Op `op` on CUDA buffers, staged on the stream XLA gives the call. Not
// CUDA-graph compatible (no traits): it talks to MPI and waits on the host.
template <OpCode op, typename Signature = decltype(&Handler<op>::Handle)>
struct CudaStaged;
template <OpCode op, typename R, typename... Args>
struct CudaStaged<op, R (*)(Args...)> {
  static ffi::Error Handle(Args... args, void* stream) {
    std::unique_ptr<DeviceCopier> copier = MakeCudaCopier(stream);
    if (!copier) return BuiltWithoutCuda(std::string("jaxfog ") + OpName(op));
    return Staged<op>::Run(copier.get(), std::move(args)...);
  }
  static auto Bind() { return Handler<op>::Bind().template Ctx<ffi::PlatformStream<void*>>(); }
};

// --- the exported handlers ---------------------------------------------------

// The XLA FFI handlers of op `op` that handler_exports.cc exports: Call as
// jaxfog_<name>, CallStaged as jaxfog_<name>_staged (CUDA buffers, staged
// through the host), CallHostStaged as jaxfog_<name>_host_staged (CPU
// buffers through the staged path, for the tests), and the nonblocking start
// forms (nonblocking.h) CallStart as jaxfog_<name>_start (CPU buffers) and
// CallStartStaged as jaxfog_<name>_start_staged (CUDA). Declared here for every
// op of the table; defined with JAXFOG_DEFINE_EXPORTS(Camel) in the .cc that
// specialises the op's Handler, so that an op of the table without its
// definition does not link (hidden: a shared library may not leave a hidden
// symbol undefined, while a default one would be left for the loader to miss).
template <OpCode op>
struct Exports;

#define JAXFOG_DECLARE_EXPORTS(name, Camel, code, label, nccl, form)       \
  template <>                                                              \
  struct __attribute__((visibility("hidden"))) Exports<OpCode::k##Camel> { \
    static XLA_FFI_Error* Call(XLA_FFI_CallFrame* frame);                  \
    static XLA_FFI_Error* CallStaged(XLA_FFI_CallFrame* frame);            \
    static XLA_FFI_Error* CallHostStaged(XLA_FFI_CallFrame* frame);        \
    static XLA_FFI_Error* CallStart(XLA_FFI_CallFrame* frame);             \
    static XLA_FFI_Error* CallStartStaged(XLA_FFI_CallFrame* frame);       \
  };
JAXFOG_OPS(JAXFOG_DECLARE_EXPORTS)
#undef JAXFOG_DECLARE_EXPORTS

// XLA's handler of `Impl` (Handler<op>, or a staged form of it) called on
// `frame`: Impl::Handle behind the exception barrier Guard<op>, bound as
// Impl::Bind() says (made on the first call, as XLA_FFI_DEFINE_HANDLER_SYMBOL
// makes it).
template <OpCode op, typename Impl>
XLA_FFI_Error* CallHandler(XLA_FFI_CallFrame* frame) {
  XLA_FFI_DEFINE_HANDLER(handler, (Guard<op, &Impl::Handle>::Run), Impl::Bind());
  return (*handler)(frame);
}

// Defines Exports<OpCode::k<Camel>> from Handler<OpCode::k<Camel>>, which must
// be complete here (use it at namespace jaxfog scope, after the Handler).
#define JAXFOG_DEFINE_EXPORTS(Camel)                                                   \
  XLA_FFI_Error* Exports<OpCode::k##Camel>::Call(XLA_FFI_CallFrame* frame) {           \
    return CallHandler<OpCode::k##Camel, Handler<OpCode::k##Camel>>(frame);            \
  }                                                                                    \
  XLA_FFI_Error* Exports<OpCode::k##Camel>::CallStaged(XLA_FFI_CallFrame* frame) {     \
    return CallHandler<OpCode::k##Camel, CudaStaged<OpCode::k##Camel>>(frame);         \
  }                                                                                    \
  XLA_FFI_Error* Exports<OpCode::k##Camel>::CallHostStaged(XLA_FFI_CallFrame* frame) { \
    return CallHandler<OpCode::k##Camel, HostStaged<OpCode::k##Camel>>(frame);         \
  }

// Defines the start forms of Exports<OpCode::k<Camel>> (nonblocking.h), for an
// op whose row in ops.h says `nonblocking`.
#define JAXFOG_DEFINE_START_EXPORTS(Camel)                                              \
  XLA_FFI_Error* Exports<OpCode::k##Camel>::CallStart(XLA_FFI_CallFrame* frame) {       \
    return CallStartHandler<OpCode::k##Camel, Start<OpCode::k##Camel>>(frame);          \
  }                                                                                     \
  XLA_FFI_Error* Exports<OpCode::k##Camel>::CallStartStaged(XLA_FFI_CallFrame* frame) { \
    return CallStartHandler<OpCode::k##Camel, CudaStart<OpCode::k##Camel>>(frame);      \
  }

}  // namespace jaxfog

#endif  // JAXFOG_FFI_HANDLER_H_
