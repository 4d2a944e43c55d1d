// Bytes this process sends, per op: what jaxfog.comm_stats() reports.
//
// Counted where a transport hands data to the network, so the figures are
// what travelled, not what the op was asked to move. Message headers are
// counted apart from data. Relaxed atomics: handlers may run on XLA's threads
// and the communication thread at once, and nobody orders on these.
#ifndef JAXFOG_FFI_TRAFFIC_H_
#define JAXFOG_FFI_TRAFFIC_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "ops.h"

namespace jaxfog {
namespace traffic {

// Op codes are small (ops.h); one row per code.
constexpr int kMaxOps = 64;
enum Field { kCalls, kMessages, kBytes, kHeaderBytes, kFields };

inline std::atomic<int64_t>* Table() {
  static std::atomic<int64_t> table[kMaxOps][kFields] = {};
  return &table[0][0];
}

inline void Add(OpCode op, int64_t messages, int64_t bytes, int64_t header_bytes = 0) {
  const int row = static_cast<int>(op);
  if (row < 0 || row >= kMaxOps) return;
  std::atomic<int64_t>* counters = Table() + row * kFields;
  counters[kCalls].fetch_add(1, std::memory_order_relaxed);
  counters[kMessages].fetch_add(messages, std::memory_order_relaxed);
  counters[kBytes].fetch_add(bytes, std::memory_order_relaxed);
  counters[kHeaderBytes].fetch_add(header_bytes, std::memory_order_relaxed);
}

// Data bytes moved by another channel than the call's messages (NCCL, whose
// header check is the counted call).
inline void AddData(OpCode op, int64_t bytes) {
  const int row = static_cast<int>(op);
  if (row < 0 || row >= kMaxOps) return;
  Table()[row * kFields + kBytes].fetch_add(bytes, std::memory_order_relaxed);
}

}  // namespace traffic
}  // namespace jaxfog

#endif  // JAXFOG_FFI_TRAFFIC_H_
