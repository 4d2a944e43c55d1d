// The one table of jaxfog's ops: X(name, Camel, code, label, nccl, form) per op.
//
// From it come OpCode, OpName, the declarations of each op's Exports
// (handler.h), the exported XLA FFI handler jaxfog_<name>
// (handler_exports.cc, from the op's Handler<OpCode::k<Camel>> in the
// *_handlers.cc of its concern: a table entry without its Exports defined
// there does not link) and the table Python reads (jaxfog_op_table in
// c_api.cc).
// `code` travels in message headers: never renumber an op (1..6 are the
// message ops). `label` is how errors and the timeline name the op. `nccl`
// names the NCCL transport's handler jaxfog_nccl_<nccl> (nccl_handlers.cc)
// that moves the op's data on GPU buffers ("": host staging only); the
// lowering that uses it is the op's rule in jaxfog/ops/_nccl.py. `form`:
// `nonblocking` for an op Python starts (its *_nonblocking form, or the
// adjoint of one), which then exports the start handlers jaxfog_<name>_start
// and jaxfog_<name>_start_staged (its *_handlers.cc defines them with
// JAXFOG_DEFINE_START_EXPORTS); `blocking` for the others.
#ifndef JAXFOG_FFI_OPS_H_
#define JAXFOG_FFI_OPS_H_

#include <cstdint>

#define JAXFOG_OPS(X)                                                                        \
  X(rank, Rank, 7, "rank", "", blocking)                                                     \
  X(size, Size, 8, "size", "", blocking)                                                     \
  X(barrier, Barrier, 9, "barrier", "", blocking)                                            \
  X(fence, Fence, 10, "fence", "", blocking)                                                 \
  X(neighbor_allreduce, NeighborAllreduce, 1, "neighbor_allreduce", "exchange", nonblocking) \
  X(neighbor_allgather, NeighborAllgather, 2, "neighbor_allgather", "exchange", nonblocking) \
  X(neighbor_reduce_scatter, NeighborReduceScatter, 3, "neighbor_allgather (transpose)",     \
    "exchange", nonblocking)                                                                 \
  X(allreduce, Allreduce, 4, "allreduce", "allreduce", nonblocking)                          \
  X(broadcast, Broadcast, 5, "broadcast", "broadcast", nonblocking)                          \
  X(allgather, Allgather, 6, "allgather", "allgather", nonblocking)                          \
  X(win_put, WinPut, 11, "win_put", "", nonblocking)                                         \
  X(win_accumulate, WinAccumulate, 12, "win_accumulate", "", nonblocking)                    \
  X(win_update, WinUpdate, 13, "win_update", "", blocking)                                   \
  X(win_get, WinGet, 14, "win_get", "", nonblocking)                                         \
  X(win_state, WinState, 15, "win_state", "", blocking)

namespace jaxfog {

enum class OpCode : uint32_t {
#define JAXFOG_OP_ENUM(name, Camel, code, label, nccl, form) k##Camel = code,
  JAXFOG_OPS(JAXFOG_OP_ENUM)
#undef JAXFOG_OP_ENUM
};

// A code used twice is a duplicate case here, so a compile error.
inline const char* OpName(OpCode op) {
  switch (op) {
#define JAXFOG_OP_CASE(name, Camel, code, label, nccl, form) \
  case OpCode::k##Camel:                                     \
    return label;
    JAXFOG_OPS(JAXFOG_OP_CASE)
#undef JAXFOG_OP_CASE
  }
  return "unknown op";  // a header from something that is not a jaxfog op
}

}  // namespace jaxfog

#endif  // JAXFOG_FFI_OPS_H_
