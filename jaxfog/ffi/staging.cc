#include "staging.h"

#include <cstring>
#include <utility>

#include "status.h"
#include "timeline.h"

namespace jaxfog {
namespace {
thread_local Staging* current_staging = nullptr;
}  // namespace

ffi::Error HostCopier::ToHost(void* host, const void* device, size_t bytes) {
  if (bytes) std::memcpy(host, device, bytes);
  return ffi::Error::Success();
}

ffi::Error HostCopier::ToDevice(void* device, const void* host, size_t bytes) {
  if (bytes) std::memcpy(device, host, bytes);
  return ffi::Error::Success();
}

#ifndef JAXFOG_WITH_CUDA
std::unique_ptr<DeviceCopier> MakeCudaCopier(void*) { return nullptr; }
#endif

Staging::Staging(DeviceCopier* copier) : copier_(copier), previous_(current_staging) {
  current_staging = this;
}

Staging::~Staging() {
  // A failed op may leave copies in flight into scratch that is about to be
  // returned to the pool.
  if (in_flight_) copier_->Wait();
  current_staging = previous_;
}

Staging* Staging::Current() { return current_staging; }

const void* Staging::Input(const void* data, size_t bytes) {
  buffers_.push_back(ScratchPool::Global().Acquire(bytes));
  char* host = buffers_.back().data();
  if (status_.success()) status_ = copier_->ToHost(host, data, bytes);
  in_flight_ = true;
  return host;
}

void* Staging::Output(void* data, size_t bytes) {
  buffers_.push_back(ScratchPool::Global().Acquire(bytes));
  char* host = buffers_.back().data();
  outputs_.push_back({data, host, bytes});
  return host;
}

ffi::Error Staging::InputsReady() {
  JAXFOG_RETURN_IF_ERROR(status_);
  timeline::Span span("stage in");
  in_flight_ = false;
  return copier_->Wait();
}

ffi::Error Staging::Finish() {
  JAXFOG_RETURN_IF_ERROR(status_);
  timeline::Span span("stage out");
  for (const Back& back : outputs_) {
    in_flight_ = true;
    JAXFOG_RETURN_IF_ERROR(copier_->ToDevice(back.device, back.host, back.bytes));
  }
  in_flight_ = false;
  return copier_->Wait();
}

const void* HostInput(const void* data, size_t bytes) {
  Staging* staging = Staging::Current();
  return staging ? staging->Input(data, bytes) : data;
}

void* HostOutput(void* data, size_t bytes) {
  Staging* staging = Staging::Current();
  return staging ? staging->Output(data, bytes) : data;
}

ffi::Error HostInputsReady() {
  Staging* staging = Staging::Current();
  return staging ? staging->InputsReady() : ffi::Error::Success();
}

}  // namespace jaxfog
