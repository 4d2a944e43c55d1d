// The small interface every jaxfog op is written against.
//
// A Transport is one communicator of one backend (MPI now; NCCL and MPI-3
// windows plug in beside it). Handlers look a transport up by the integer id
// baked into the custom call's attributes, so no raw pointer ever reaches HLO.
#ifndef JAXFOG_FFI_TRANSPORT_H_
#define JAXFOG_FFI_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "ops.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

// One message's shapes and dtypes in words ("f32[3,4], i32[]"), written at
// trace time (jaxfog/ops/_primitive_machinery.py, which shortens it to fit), so that a
// mismatch shows each side's. Fixed size: it travels in every message header.
struct LayoutText {
  static constexpr size_t kSize = 88;
  char text[kSize] = {};  // NUL-padded; no NUL when full

  static LayoutText From(std::string_view layout) {
    LayoutText result;
    layout.copy(result.text, kSize);
    return result;
  }
  std::string str() const { return std::string(text, strnlen(text, kSize)); }
};

// What one rank believes the current operation is; peers must agree.
struct OpInfo {
  OpCode op;
  // Hash of the shapes and dtypes of one message (computed at trace time).
  uint64_t signature;
  LayoutText layout;  // the same in words, for errors
};

// A message is the concatenation of its pieces, sent without packing.
struct ConstPiece {
  const void* data;
  size_t bytes;
};
struct Piece {
  void* data;
  size_t bytes;
};
struct SendSpec {
  int peer;
  std::vector<ConstPiece> pieces;
};
struct RecvSpec {
  int peer;
  std::vector<Piece> pieces;
};

// Bytes of a list of pieces, leaves, ... (anything with a `bytes` member).
template <typename T>
size_t TotalBytes(const std::vector<T>& items) {
  size_t total = 0;
  for (const T& item : items) total += item.bytes;
  return total;
}

// An exchange whose messages travel in pieces of `chunk_bytes`, so that the
// receiver works on the head of the data while the rest is in flight:
// `arrived(bytes)` runs, on the exchanging thread, each time the first
// `bytes` of every receive have arrived (nondecreasing; kAll once all have).
// Both sides of every message must use the same chunk_bytes.
struct Streaming {
  static constexpr size_t kAll = std::numeric_limits<size_t>::max();
  size_t chunk_bytes;
  std::function<ffi::Error(size_t bytes)> arrived;
};

class Transport {
 public:
  Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sequenced ops run so far (the op number message headers carry; the
  // timeline shows it).
  virtual uint64_t sequence() const = 0;

  // Blocks until every rank of the communicator has entered, or fails once
  // the transport's timeout has passed (a dead or diverged peer).
  virtual ffi::Error Barrier() = 0;

  // One round of point-to-point messages: every send and receive is posted at
  // once and completed together. Each message carries a header with the op,
  // its sequence number, its size and layout; a receive whose header does not
  // match what this rank expects fails with an error naming the peer (for
  // layouts, the rank that differs from the majority of the headers seen). With
  // `streaming`, data is handed over as it arrives (see Streaming).
  virtual ffi::Error Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                              const std::vector<RecvSpec>& recvs,
                              const Streaming* streaming = nullptr) = 0;

  // Collectives. Before moving data they check that every rank runs the same
  // op with the same signature and size, and fail on every rank otherwise
  // (naming the ranks whose layout differs from the majority's).
  // Allreduce sums.
  virtual ffi::Error Allreduce(const OpInfo& info, const void* in, void* out, size_t count,
                               ffi::DataType type) = 0;
  // Broadcast: root's `data` reaches every rank's. `meanwhile` (may be null)
  // runs while the messages move (the root copies its input to its output:
  // it sends from its input, so the copy is off the critical path).
  virtual ffi::Error Broadcast(const OpInfo& info, void* data, size_t bytes, int root,
                               const std::function<void()>& meanwhile = nullptr) = 0;
  virtual ffi::Error Allgather(const OpInfo& info, const void* in, void* out, size_t bytes) = 0;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_TRANSPORT_H_
