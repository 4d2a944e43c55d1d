// The NCCL transport's XLA FFI handlers, for CUDA buffers. They move data
// only: the lowering (jaxfog/ops/_nccl.py) leaves weighted sums, means and the
// scaling of sends to XLA, which fuses them around the call. Not CUDA-graph
// compatible (no traits): each call checks headers over MPI on the host. Each
// records the op's timeline span (enqueueing, not the GPU's work). The op
// table (ops.h) names the handler of each op NCCL serves; Python registers
// those with XLA.
#ifdef JAXFOG_WITH_NCCL
#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "call.h"
#include "comm_thread.h"
#include "cuda_util.h"
#include "nccl_transport.h"
#include "registry.h"
#include "status.h"
#include "timeline.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {
namespace {

// The NCCL transport registered under `comm_id`, with its leaves.
struct NcclCall {
  NcclTransport* transport;
  std::vector<Leaf> in, out;
};

ffi::ErrorOr<NcclTransport*> LookupNccl(int64_t id) {
  return Registry<NcclTransport>::Global().Find(
      id, "jaxfog: NCCL communicator " + std::to_string(id) +
              " is not registered (jaxfog.init() sets it up where NCCL came up on every "
              "rank; the op was compiled before jaxfog.shutdown()?)");
}

ffi::ErrorOr<NcclCall> Decode(int64_t comm_id, const char* op, ffi::RemainingArgs args,
                              ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(transport, LookupNccl(comm_id));
  JAXFOG_ASSIGN_OR_RETURN(in, Inputs(/*staging=*/nullptr, args, op));
  JAXFOG_ASSIGN_OR_RETURN(out, Outputs(/*staging=*/nullptr, rets));
  if (in.size() != out.size()) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument(std::string("jaxfog ") + op + " (NCCL): malformed call"));
  }
  return NcclCall{transport, std::move(in), std::move(out)};
}

ffi::Error Malformed(OpCode op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxfog ") + OpName(op) + " (NCCL): " + what);
}

// The op's timeline span, with what a CPU op's span shows.
void Trace(timeline::Span& span, int64_t comm_id, const NcclTransport& nccl, int64_t signature,
           size_t bytes) {
  if (!span) return;
  timeline::OpArgs& args = span.args();
  args.comm = comm_id;
  args.bytes = static_cast<int64_t>(bytes);
  args.seq = static_cast<int64_t>(nccl.sequence() + 1);  // the op about to run
  args.signature = signature;
}

// out[l] = the blocks from recv_ranks (in order) of leaf l. With `stacked`,
// in[l] holds one block per send rank (block s goes to send_ranks[s]);
// without, all of in[l] goes to every send rank. `op` is the op the exchange
// serves (neighbor_allreduce, neighbor_allgather or its transpose), which
// headers, comm_stats, the timeline and errors name.
ffi::Error ExchangeAs(OpCode op, int64_t comm_id, int64_t signature, std::string_view layout,
                      I64s send_ranks, I64s recv_ranks, bool stacked, ffi::RemainingArgs args,
                      ffi::RemainingRets rets, cudaStream_t stream) {
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, OpName(op), args, rets));
  const size_t n_send = send_ranks.size(), n_recv = recv_ranks.size();
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  for (size_t s = 0; s < n_send; ++s) sends.push_back({static_cast<int>(send_ranks[s]), {}});
  for (size_t j = 0; j < n_recv; ++j) recvs.push_back({static_cast<int>(recv_ranks[j]), {}});
  size_t message = 0;
  for (size_t l = 0; l < call.in.size(); ++l) {
    const Leaf& in = call.in[l];
    const Leaf& out = call.out[l];
    if (stacked && n_send && in.bytes % n_send) return Malformed(op, "send blocks");
    if (n_recv && out.bytes % n_recv) return Malformed(op, "receive blocks");
    const size_t send_block = stacked ? (n_send ? in.bytes / n_send : 0) : in.bytes;
    const size_t recv_block = n_recv ? out.bytes / n_recv : 0;
    if (n_send && n_recv && send_block != recv_block) return Malformed(op, "block sizes");
    message += n_send ? send_block : recv_block;
    for (size_t s = 0; s < n_send; ++s) {
      sends[s].pieces.push_back(
          {static_cast<const char*>(in.in) + (stacked ? s * send_block : 0), send_block});
    }
    for (size_t j = 0; j < n_recv; ++j) {
      recvs[j].pieces.push_back({static_cast<char*>(out.out) + j * recv_block, recv_block});
    }
  }
  timeline::Span span(OpName(op), timeline::Span::kOp);
  Trace(span, comm_id, *call.transport, signature, message);
  if (span) span.args().Peers(send_ranks, recv_ranks);
  return call.transport->Exchange(Info(op, signature, layout), sends, recvs, stream);
}

// The exchange's handler: an exception names the op it served (Guard names one op).
ffi::Error Exchange(int64_t comm_id, int64_t signature, std::string_view layout, I64s send_ranks,
                    I64s recv_ranks, bool stacked, int64_t op_code, ffi::Token,
                    ffi::RemainingArgs args, ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                    cudaStream_t stream) noexcept {
  const auto op = static_cast<OpCode>(op_code);
  if (op != OpCode::kNeighborAllreduce && op != OpCode::kNeighborAllgather &&
      op != OpCode::kNeighborReduceScatter) {
    return ffi::Error::InvalidArgument("jaxfog NCCL exchange: op " + std::to_string(op_code) +
                                       " is not a neighbour op");
  }
  try {
    return ExchangeAs(op, comm_id, signature, layout, send_ranks, recv_ranks, stacked,
                      std::move(args), std::move(rets), stream);
  } catch (...) {
    return CurrentException(std::string("jaxfog ") + OpName(op));
  }
}

std::vector<NcclBuffer> Buffers(const NcclCall& call) {
  std::vector<NcclBuffer> leaves;
  for (size_t l = 0; l < call.in.size(); ++l) {
    const Leaf& in = call.in[l];
    leaves.push_back({in.in, call.out[l].out, in.count, in.type, in.bytes});
  }
  return leaves;
}

// out[l] = the sum over ranks of in[l].
ffi::Error Allreduce(int64_t comm_id, int64_t signature, std::string_view layout, ffi::Token,
                     ffi::RemainingArgs args, ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                     cudaStream_t stream) {
  constexpr OpCode kOp = OpCode::kAllreduce;
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, OpName(kOp), args, rets));
  timeline::Span span(OpName(kOp), timeline::Span::kOp);
  Trace(span, comm_id, *call.transport, signature, TotalBytes(call.in));
  return call.transport->Allreduce(Info(kOp, signature, layout), Buffers(call), stream);
}

// out[l] = root's in[l].
ffi::Error Broadcast(int64_t comm_id, int64_t signature, std::string_view layout, int64_t root,
                     ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                     ffi::RemainingRets rets, cudaStream_t stream) {
  constexpr OpCode kOp = OpCode::kBroadcast;
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, OpName(kOp), args, rets));
  timeline::Span span(OpName(kOp), timeline::Span::kOp);
  Trace(span, comm_id, *call.transport, signature, TotalBytes(call.in));
  if (span) span.args().root = root;
  return call.transport->Broadcast(Info(kOp, signature, layout), Buffers(call),
                                   static_cast<int>(root), stream);
}

// out[l] = in[l] of ranks 0..n-1, concatenated along axis 0.
ffi::Error Allgather(int64_t comm_id, int64_t signature, std::string_view layout, ffi::Token,
                     ffi::RemainingArgs args, ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                     cudaStream_t stream) {
  constexpr OpCode kOp = OpCode::kAllgather;
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, OpName(kOp), args, rets));
  timeline::Span span(OpName(kOp), timeline::Span::kOp);
  Trace(span, comm_id, *call.transport, signature, TotalBytes(call.in));
  return call.transport->Allgather(Info(kOp, signature, layout), Buffers(call), stream);
}

// A pytree op on the stream XLA gives the call.
template <typename Binding>
auto Pytree(Binding binding) {
  return PytreeOp(std::move(binding)).template Ctx<ffi::PlatformStream<cudaStream_t>>();
}

}  // namespace

#pragma GCC visibility push(default)
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_nccl_exchange, Exchange,
                              Pytree(Keyed()
                                         .Attr<I64s>("send_ranks")
                                         .Attr<I64s>("recv_ranks")
                                         .Attr<bool>("stacked")
                                         .Attr<int64_t>("op")));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_nccl_allreduce, (Guard<OpCode::kAllreduce, &Allreduce>::Run),
                              Pytree(Keyed()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_nccl_broadcast, (Guard<OpCode::kBroadcast, &Broadcast>::Run),
                              Pytree(Keyed().Attr<int64_t>("root")));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_nccl_allgather, (Guard<OpCode::kAllgather, &Allgather>::Run),
                              Pytree(Keyed()));
#pragma GCC visibility pop

}  // namespace jaxfog
#endif  // JAXFOG_WITH_NCCL
