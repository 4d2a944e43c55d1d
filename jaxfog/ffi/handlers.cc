// Typed XLA FFI handlers (api_version 1). One handler per op, each a thin
// shell that decodes buffers and attributes and calls the transport.
#include <cstdint>

#include "registry.h"
#include "transport.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {
namespace {

// Rank of this process in communicator `comm_id`, as an int32 scalar.
ffi::Error RankImpl(int64_t comm_id, ffi::Result<ffi::BufferR0<ffi::S32>> out) {
  ffi::ErrorOr<Transport*> transport = LookupTransport(comm_id);
  if (transport.has_error()) return transport.error();
  out->typed_data()[0] = (*transport)->rank();
  return ffi::Error::Success();
}

ffi::Error SizeImpl(int64_t comm_id, ffi::Result<ffi::BufferR0<ffi::S32>> out) {
  ffi::ErrorOr<Transport*> transport = LookupTransport(comm_id);
  if (transport.has_error()) return transport.error();
  out->typed_data()[0] = (*transport)->size();
  return ffi::Error::Success();
}

// Barrier. Like every communicating handler it takes and returns the token
// of jaxfog's ordered effect, which fixes the order of all communication in
// the compiled program, identically on every rank.
ffi::Error BarrierImpl(int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>) {
  ffi::ErrorOr<Transport*> transport = LookupTransport(comm_id);
  if (transport.has_error()) return transport.error();
  return (*transport)->Barrier();
}

}  // namespace
}  // namespace jaxfog

// The library is built with hidden visibility; export just the handlers.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_rank, jaxfog::RankImpl,
                              xla::ffi::Ffi::Bind()
                                  .Attr<int64_t>("comm_id")
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_size, jaxfog::SizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Attr<int64_t>("comm_id")
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_barrier, jaxfog::BarrierImpl,
                              xla::ffi::Ffi::Bind()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::Token>());

#pragma GCC visibility pop
