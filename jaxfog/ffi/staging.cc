#include "staging.h"

#include <cstring>
#include <string>
#include <utility>

#include "status.h"
#include "timeline.h"

namespace jaxfog {

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
void SetPinnedKeepBytes(size_t) {}
#endif

Staging::~Staging() {
  // A failed op may leave copies in flight into scratch that is about to be
  // returned to the pool.
  if (in_flight_) copier_->Wait();
}

char* Staging::Scratch(const std::vector<size_t>& bytes, std::vector<size_t>* offsets) {
  constexpr size_t kAlign = ScratchPool::kAlign;
  size_t total = 0;
  for (size_t b : bytes) {
    offsets->push_back(total);
    total += (b + kAlign - 1) / kAlign * kAlign;
  }
  buffers_.push_back(copier_->Pool().Acquire(total));
  return buffers_.back().data();
}

ffi::Error Staging::Inputs(std::vector<ConstPiece>* pieces) {
  timeline::Span span("stage in");  // around the copies: a HostCopier's are synchronous
  std::vector<size_t> bytes, offsets;
  for (const ConstPiece& piece : *pieces) bytes.push_back(piece.bytes);
  char* host = Scratch(bytes, &offsets);
  for (size_t i = 0; i < pieces->size(); ++i) {
    ConstPiece& piece = (*pieces)[i];
    in_flight_ = true;
    JAXFOG_RETURN_IF_ERROR(copier_->ToHost(host + offsets[i], piece.data, piece.bytes));
    piece.data = host + offsets[i];
  }
  in_flight_ = false;
  return copier_->Wait();
}

void Staging::Outputs(std::vector<Piece>* pieces) {
  std::vector<size_t> bytes, offsets;
  for (const Piece& piece : *pieces) bytes.push_back(piece.bytes);
  char* host = Scratch(bytes, &offsets);
  for (size_t i = 0; i < pieces->size(); ++i) {
    Piece& piece = (*pieces)[i];
    device_outputs_.push_back(piece);
    host_outputs_.push_back({host + offsets[i], piece.bytes});
    piece.data = host + offsets[i];
  }
}

ffi::Error Staging::Finish() {
  timeline::Span span("stage out");
  for (size_t i = 0; i < device_outputs_.size(); ++i) {
    in_flight_ = true;
    JAXFOG_RETURN_IF_ERROR(
        copier_->ToDevice(device_outputs_[i].data, host_outputs_[i].data, host_outputs_[i].bytes));
  }
  in_flight_ = false;
  return copier_->Wait();
}

ffi::Error Staging::FinishInto(DeviceCopier* copier, const std::vector<Piece>& outputs) {
  if (outputs.size() != host_outputs_.size()) {
    return ffi::Error::InvalidArgument(
        "jaxfog.wait: the op has " + std::to_string(host_outputs_.size()) +
        " results, the wait expects " + std::to_string(outputs.size()));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].bytes != host_outputs_[i].bytes) {
      return ffi::Error::InvalidArgument(
          "jaxfog.wait: result " + std::to_string(i) + " of the op has " +
          std::to_string(host_outputs_[i].bytes) + " bytes, the wait expects " +
          std::to_string(outputs[i].bytes));
    }
  }
  timeline::Span span("stage out");
  for (size_t i = 0; i < outputs.size(); ++i) {
    JAXFOG_RETURN_IF_ERROR(
        copier->ToDevice(outputs[i].data, host_outputs_[i].data, host_outputs_[i].bytes));
  }
  return copier->Wait();
}

}  // namespace jaxfog
