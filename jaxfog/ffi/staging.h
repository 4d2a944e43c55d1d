// Host staging: an op whose buffers live on a device runs through a host
// transport (MPI). The handler's inputs are copied to host scratch, the op
// runs exactly as on CPU, and its outputs are copied back.
//
// A Staging installs itself for the calling thread; the handler code reads
// and writes every buffer through StageInputs/StageOutputs, which leave the
// pointers alone when no Staging is installed (plain CPU calls). So the staged
// path is the CPU path plus copies, not a second implementation of the ops.
#ifndef JAXFOG_FFI_STAGING_H_
#define JAXFOG_FFI_STAGING_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "scratch.h"
#include "transport.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

// How bytes move between device and host memory. Copies are enqueued in
// order; Wait() returns once all enqueued so far have completed.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  virtual ffi::Error ToHost(void* host, const void* device, size_t bytes) = 0;
  virtual ffi::Error ToDevice(void* device, const void* host, size_t bytes) = 0;
  virtual ffi::Error Wait() = 0;
};

// Copies with memcpy: "device" memory that is host memory. It lets the CPU
// test suite run the staged path (JAXFOG_HOST_STAGING=1).
class HostCopier final : public DeviceCopier {
 public:
  ffi::Error ToHost(void* host, const void* device, size_t bytes) override;
  ffi::Error ToDevice(void* device, const void* host, size_t bytes) override;
  ffi::Error Wait() override { return ffi::Error::Success(); }
};

// Copies on a CUDA stream (the one XLA gives the handler); null when jaxfog
// was built without CUDA.
std::unique_ptr<DeviceCopier> MakeCudaCopier(void* stream);

class Staging {
 public:
  // Installs this staging for the calling thread (until destroyed).
  explicit Staging(DeviceCopier* copier);
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // The staging installed for this thread, or null.
  static Staging* Current();

  // Points `pieces` (device inputs) at host copies, in one scratch buffer;
  // the copies are complete when it returns.
  ffi::Error Inputs(std::vector<ConstPiece>* pieces);
  // Points `pieces` (device outputs) at host memory, in one scratch buffer,
  // that Finish() copies back.
  void Outputs(std::vector<Piece>* pieces);
  // Copies the outputs back to the device and waits for the copies.
  ffi::Error Finish();

 private:
  // One scratch buffer for `pieces`, each at a cache-line multiple.
  char* Scratch(const std::vector<size_t>& bytes, std::vector<size_t>* offsets);

  DeviceCopier* copier_;
  Staging* previous_;
  bool in_flight_ = false;  // copies enqueued, not waited for
  std::vector<ScratchPool::Lease> buffers_;
  std::vector<Piece> device_outputs_;
  std::vector<ConstPiece> host_outputs_;
};

// What handler code reads and writes: the pieces as given without a Staging
// (plain CPU calls), host stand-ins under one.
ffi::Error StageInputs(std::vector<ConstPiece>* pieces);
void StageOutputs(std::vector<Piece>* pieces);

}  // namespace jaxfog

#endif  // JAXFOG_FFI_STAGING_H_
