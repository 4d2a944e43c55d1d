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

// Barrier. The int32 operand/result pair is a sequencing value: threading it
// from one op to the next fixes their order in the compiled program.
ffi::Error BarrierImpl(int64_t comm_id, ffi::BufferR0<ffi::S32> order_in,
                       ffi::Result<ffi::BufferR0<ffi::S32>> order_out) {
  ffi::ErrorOr<Transport*> transport = LookupTransport(comm_id);
  if (transport.has_error()) return transport.error();
  if (ffi::Error err = (*transport)->Barrier(); !err.success()) return err;
  order_out->typed_data()[0] = order_in.typed_data()[0] + 1;
  return ffi::Error::Success();
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
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>());

#pragma GCC visibility pop
