// Host staging: an op whose buffers live on a device runs through a host
// transport (MPI). The handler's inputs are copied to host scratch, the op
// runs exactly as on CPU, and its outputs are copied back.
//
// The staged forms of the handlers pass a Staging to the handler code, which
// reads and writes every buffer through StageInputs/StageOutputs; plain CPU
// calls pass none, and the pointers are left alone. So the staged path is the
// CPU path plus copies, not a second implementation of the ops.
#ifndef JAXFOG_FFI_STAGING_H_
#define JAXFOG_FFI_STAGING_H_

#include <cstddef>
#include <memory>
#include <string>
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
  // Where the host side of staged buffers comes from (kept between calls).
  virtual ScratchPool& Pool() { return ScratchPool::Global(); }
};

// Copies with memcpy: "device" memory that is host memory. It lets the CPU
// test suite run the staged path (JAXFOG_HOST_STAGING=1).
class HostCopier final : public DeviceCopier {
 public:
  ffi::Error ToHost(void* host, const void* device, size_t bytes) override;
  ffi::Error ToDevice(void* device, const void* host, size_t bytes) override;
  ffi::Error Wait() override { return ffi::Error::Success(); }
};

// Copies on a CUDA stream (the one XLA gives the handler), to and from
// pinned host buffers (pageable memory halves the copies' rate and faults in
// fresh pages on each large call); null when jaxfog was built without CUDA.
std::unique_ptr<DeviceCopier> MakeCudaCopier(void* stream);

// The error of `what` (e.g. "jaxfog allreduce") on CUDA buffers when
// MakeCudaCopier gave none: the library was built without CUDA.
inline ffi::Error BuiltWithoutCuda(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    what +
                        ": this library was built without CUDA; rebuild jaxfog with the "
                        "CUDA toolkit (JAXFOG_CUDA_HOME) to run ops on GPU arrays");
}

// The most bytes of free pinned staging buffers kept for reuse
// (JAXFOG_STAGING_KEEP_BYTES); nothing to set without CUDA.
void SetPinnedKeepBytes(size_t bytes);
constexpr size_t kDefaultPinnedKeepBytes = size_t{2} << 30;

// The host side of one staged call: its scratch buffers and the copies back.
class Staging {
 public:
  // `with_handle_id`: a nonblocking start's staging, whose call's last result is
  // the start's handle id (see Outputs in call.h).
  explicit Staging(DeviceCopier* copier, bool with_handle_id = false)
      : copier_(copier), with_handle_id_(with_handle_id) {}
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // Points `pieces` (device inputs) at host copies, in one scratch buffer;
  // the copies are complete when it returns.
  ffi::Error Inputs(std::vector<ConstPiece>* pieces);
  // Points `pieces` (device outputs) at host memory, in one scratch buffer,
  // that Finish() copies back.
  void Outputs(std::vector<Piece>* pieces);
  // Copies the outputs back to the device and waits for the copies.
  ffi::Error Finish();
  // Copies the outputs to `outputs` instead (the same count and sizes: a
  // nonblocking op's wait), through `copier`, and waits for the copies.
  ffi::Error FinishInto(DeviceCopier* copier, const std::vector<Piece>& outputs);

  // A start's handle id result: XLA's buffer itself (never staged), set aside by
  // the decoding of the call's results; null until then.
  bool with_handle_id() const { return with_handle_id_; }
  void set_handle_id(void* where) { handle_id_ = where; }
  void* handle_id() const { return handle_id_; }

 private:
  // One scratch buffer for `pieces`, each at a multiple of 64 bytes.
  char* Scratch(const std::vector<size_t>& bytes, std::vector<size_t>* offsets);

  DeviceCopier* copier_;
  bool with_handle_id_;
  void* handle_id_ = nullptr;
  bool in_flight_ = false;  // copies enqueued, not waited for
  std::vector<ScratchPool::Lease> buffers_;
  std::vector<Piece> device_outputs_;
  std::vector<ConstPiece> host_outputs_;
};

// What handler code reads and writes: the pieces as given without a staging
// (null: plain CPU calls), host stand-ins with one.
inline ffi::Error StageInputs(Staging* staging, std::vector<ConstPiece>* pieces) {
  return staging ? staging->Inputs(pieces) : ffi::Error::Success();
}
inline void StageOutputs(Staging* staging, std::vector<Piece>* pieces) {
  if (staging) staging->Outputs(pieces);
}

}  // namespace jaxfog

#endif  // JAXFOG_FFI_STAGING_H_
