// Process-wide table of transports, keyed by the small integer ids that the
// Python runtime hands out at init and that custom calls carry as attributes.
#ifndef JAXFOG_FFI_REGISTRY_H_
#define JAXFOG_FFI_REGISTRY_H_

#include <cstdint>
#include <memory>

#include "transport.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

// Adds (or replaces) the transport registered under `id`.
void RegisterTransport(int64_t id, std::unique_ptr<Transport> transport);
// Drops the transport under `id`; true if there was one.
bool ReleaseTransport(int64_t id);

// The transport under `id`, or an error telling the user to call init().
ffi::ErrorOr<Transport*> LookupTransport(int64_t id);

}  // namespace jaxfog

#endif  // JAXFOG_FFI_REGISTRY_H_
