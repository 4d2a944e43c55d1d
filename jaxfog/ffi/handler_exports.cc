// The exported XLA FFI handler symbols of the op table (ops.h): per op,
// jaxfog_<name>, its host-staged forms jaxfog_<name>_staged (CUDA buffers)
// and jaxfog_<name>_host_staged (CPU buffers, for tests of the staged path),
// and, for an op whose row says `nonblocking`, its starts jaxfog_<name>_start
// (CPU) and jaxfog_<name>_start_staged (CUDA; nonblocking.h). Each forwards to
// the op's Exports (handler.h), defined where its Handler is: an op of the
// table without them does not link.
#include "handler.h"
#include "ops.h"
#include "xla/ffi/api/c_api.h"

namespace jaxfog {

// The library is built with hidden visibility; export just these (and c_api.cc's).
#pragma GCC visibility push(default)
#define JAXFOG_START_EXPORTS_blocking(name, Camel)
#define JAXFOG_START_EXPORTS_nonblocking(name, Camel)                                \
  extern "C" XLA_FFI_Error* jaxfog_##name##_start(XLA_FFI_CallFrame* frame) {        \
    return Exports<OpCode::k##Camel>::CallStart(frame);                              \
  }                                                                                  \
  extern "C" XLA_FFI_Error* jaxfog_##name##_start_staged(XLA_FFI_CallFrame* frame) { \
    return Exports<OpCode::k##Camel>::CallStartStaged(frame);                        \
  }
#define JAXFOG_EXPORT_HANDLERS(name, Camel, code, label, nccl, form)                \
  extern "C" XLA_FFI_Error* jaxfog_##name(XLA_FFI_CallFrame* frame) {               \
    return Exports<OpCode::k##Camel>::Call(frame);                                  \
  }                                                                                 \
  extern "C" XLA_FFI_Error* jaxfog_##name##_staged(XLA_FFI_CallFrame* frame) {      \
    return Exports<OpCode::k##Camel>::CallStaged(frame);                            \
  }                                                                                 \
  extern "C" XLA_FFI_Error* jaxfog_##name##_host_staged(XLA_FFI_CallFrame* frame) { \
    return Exports<OpCode::k##Camel>::CallHostStaged(frame);                        \
  }                                                                                 \
  JAXFOG_START_EXPORTS_##form(name, Camel)
JAXFOG_OPS(JAXFOG_EXPORT_HANDLERS)
#undef JAXFOG_EXPORT_HANDLERS
#undef JAXFOG_START_EXPORTS_nonblocking
#undef JAXFOG_START_EXPORTS_blocking
#pragma GCC visibility pop

}  // namespace jaxfog
