// The exported XLA FFI handler symbols of the op table (ops.h): per op,
// jaxfog_<name>, its host-staged forms jaxfog_<name>_staged (CUDA buffers)
// and jaxfog_<name>_host_staged (CPU buffers, for tests of the staged path),
// and its nonblocking starts jaxfog_<name>_start (CPU) and
// jaxfog_<name>_start_staged (CUDA; nonblocking.h). Each forwards to the op's Exports (handler.h), defined where
// its Handler is: an op of the table without them does not link.
#include "handler.h"
#include "ops.h"
#include "xla/ffi/api/c_api.h"

namespace jaxfog {

// The library is built with hidden visibility; export just these (and c_api.cc's).
#pragma GCC visibility push(default)
#define JAXFOG_EXPORT_HANDLERS(name, Camel, code, label, nccl)                                \
  extern "C" XLA_FFI_Error* jaxfog_##name(XLA_FFI_CallFrame* frame) {                         \
    return Exports<OpCode::k##Camel>::Call(frame);                                            \
  }                                                                                           \
  extern "C" XLA_FFI_Error* jaxfog_##name##_staged(XLA_FFI_CallFrame* frame) {                \
    return Exports<OpCode::k##Camel>::CallStaged(frame);                                      \
  }                                                                                           \
  extern "C" XLA_FFI_Error* jaxfog_##name##_host_staged(XLA_FFI_CallFrame* frame) {           \
    return Exports<OpCode::k##Camel>::CallHostStaged(frame);                                  \
  }                                                                                           \
  extern "C" XLA_FFI_Error* jaxfog_##name##_start(XLA_FFI_CallFrame* frame) {                 \
    return Exports<OpCode::k##Camel>::CallStart(frame);                                       \
  }                                                                                           \
  extern "C" XLA_FFI_Error* jaxfog_##name##_start_staged(XLA_FFI_CallFrame* frame) {          \
    return Exports<OpCode::k##Camel>::CallStartStaged(frame);                                 \
  }
JAXFOG_OPS(JAXFOG_EXPORT_HANDLERS)
#undef JAXFOG_EXPORT_HANDLERS
#pragma GCC visibility pop

}  // namespace jaxfog
