// The small interface every jaxfog op is written against.
//
// A Transport is one communicator of one backend (MPI now; NCCL and MPI-3
// windows plug in beside it). Handlers look a transport up by the integer id
// baked into the custom call's attributes, so no raw pointer ever reaches HLO.
#ifndef JAXFOG_FFI_TRANSPORT_H_
#define JAXFOG_FFI_TRANSPORT_H_

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Human-readable backend name, used in error messages ("mpi", "nccl").
  virtual std::string backend() const = 0;

  // Blocks until every rank of the communicator has entered, or fails once
  // the transport's timeout has passed (a dead or diverged peer).
  virtual ffi::Error Barrier() = 0;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_TRANSPORT_H_
