// Transport over an MPI communicator duplicated by the Python runtime.
#ifndef JAXFOG_FFI_MPI_TRANSPORT_H_
#define JAXFOG_FFI_MPI_TRANSPORT_H_

#include <mpi.h>

#include <string>
#include <vector>

#include "transport.h"

namespace jaxfog {

class MpiTransport final : public Transport {
 public:
  // Does not take ownership: the runtime that duplicated `comm` frees it
  // after the transport is gone.
  MpiTransport(MPI_Comm comm, double timeout_seconds);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  ffi::Error Barrier() override;

  // Completes `requests`, polling so that a peer that never answers turns
  // into an error after the timeout instead of a hang. `what` names the
  // operation in that error.
  ffi::Error WaitAll(std::vector<MPI_Request>& requests, const std::string& what);

  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_seconds_;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_MPI_TRANSPORT_H_
