// The NCCL transport's XLA FFI handlers, for CUDA buffers. They move data
// only: the lowering (jaxfog/ops/nccl.py) leaves weighted sums, means and the
// scaling of sends to XLA, which fuses them around the call. Not CUDA-graph
// compatible (no traits): each call checks headers over MPI on the host.
#ifdef JAXFOG_WITH_NCCL
#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "call.h"
#include "cuda_util.h"
#include "nccl_transport.h"
#include "registry.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {
namespace {

// The NCCL transport registered under `comm_id`, with its leaves.
struct NcclCall {
  NcclTransport* transport;
  std::vector<Leaf> in, out;
};

ffi::ErrorOr<NcclCall> Decode(int64_t comm_id, const char* op, ffi::RemainingArgs args,
                              ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(transport, LookupTransport(comm_id));
  auto* nccl = dynamic_cast<NcclTransport*>(transport);
  if (!nccl) {
    return ffi::Unexpected<ffi::Error>(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string("jaxfog ") + op + ": communicator " + std::to_string(comm_id) +
            " is not an NCCL communicator"));
  }
  JAXFOG_ASSIGN_OR_RETURN(in, Inputs(/*staging=*/nullptr, args, op));
  JAXFOG_ASSIGN_OR_RETURN(out, Outputs(/*staging=*/nullptr, rets));
  if (in.size() != out.size()) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument(std::string("jaxfog ") + op + ": malformed call"));
  }
  return NcclCall{nccl, std::move(in), std::move(out)};
}

ffi::Error Malformed(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxfog ") + op + ": " + what);
}

// out[l] = the blocks from recv_ranks (in order) of leaf l. With `stacked`,
// in[l] holds one block per send rank (block s goes to send_ranks[s]);
// without, all of in[l] goes to every send rank.
ffi::Error Exchange(int64_t comm_id, int64_t signature, std::string_view layout,
                    I64s send_ranks, I64s recv_ranks, bool stacked, ffi::Token,
                    ffi::RemainingArgs args, ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                    cudaStream_t stream) {
  constexpr const char* kOp = "neighbor exchange (NCCL)";
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, kOp, args, rets));
  const size_t n_send = send_ranks.size(), n_recv = recv_ranks.size();
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  for (size_t s = 0; s < n_send; ++s) sends.push_back({static_cast<int>(send_ranks[s]), {}});
  for (size_t j = 0; j < n_recv; ++j) recvs.push_back({static_cast<int>(recv_ranks[j]), {}});
  for (size_t l = 0; l < call.in.size(); ++l) {
    const Leaf& in = call.in[l];
    const Leaf& out = call.out[l];
    if (stacked && n_send && in.bytes % n_send) return Malformed(kOp, "send blocks");
    if (n_recv && out.bytes % n_recv) return Malformed(kOp, "receive blocks");
    const size_t send_block = stacked ? (n_send ? in.bytes / n_send : 0) : in.bytes;
    const size_t recv_block = n_recv ? out.bytes / n_recv : 0;
    if (n_send && n_recv && send_block != recv_block) return Malformed(kOp, "block sizes");
    for (size_t s = 0; s < n_send; ++s) {
      sends[s].pieces.push_back(
          {static_cast<const char*>(in.in) + (stacked ? s * send_block : 0), send_block});
    }
    for (size_t j = 0; j < n_recv; ++j) {
      recvs[j].pieces.push_back({static_cast<char*>(out.out) + j * recv_block, recv_block});
    }
  }
  return call.transport->Exchange(Info(OpCode::kNeighborAllgather, signature, layout), sends,
                                  recvs, stream);
}

// A collective op on every leaf: one header check, one NCCL group; `enqueue`
// issues leaf l's NCCL call; `figure(nccl, bytes)` is what comm_stats counts
// for `bytes` of input.
template <typename Figure, typename Enqueue>
ffi::Error Collective(OpCode op, int64_t comm_id, int64_t signature, std::string_view layout,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, cudaStream_t stream,
                      Figure figure, Enqueue enqueue) {
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, OpName(op), args, rets));
  NcclTransport* nccl = call.transport;
  const OpInfo info = Info(op, signature, layout);
  return nccl->Collective(info, std::invoke(figure, *nccl, TotalBytes(call.in)),
                          [&]() -> ffi::Error {
                            for (size_t l = 0; l < call.in.size(); ++l) {
                              JAXFOG_RETURN_IF_ERROR(
                                  enqueue(nccl, call.in[l], call.out[l], stream));
                            }
                            return ffi::Error::Success();
                          });
}

// out[l] = the sum over ranks of in[l].
ffi::Error Allreduce(int64_t comm_id, int64_t signature, std::string_view layout, ffi::Token,
                     ffi::RemainingArgs args, ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                     cudaStream_t stream) {
  return Collective(OpCode::kAllreduce, comm_id, signature, layout, args, rets, stream,
                    &NcclTransport::AllreduceBytes,
                    [](NcclTransport* nccl, const Leaf& in, const Leaf& out, cudaStream_t s) {
                      return nccl->EnqueueAllreduce(in.in, out.out, in.count, in.type, s);
                    });
}

// out[l] = root's in[l].
ffi::Error Broadcast(int64_t comm_id, int64_t signature, std::string_view layout, int64_t root,
                     ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                     ffi::RemainingRets rets, cudaStream_t stream) {
  return Collective(
      OpCode::kBroadcast, comm_id, signature, layout, args, rets, stream,
      [root](const NcclTransport& nccl, size_t bytes) {
        return nccl.BroadcastBytes(bytes, static_cast<int>(root));
      },
      [root](NcclTransport* nccl, const Leaf& in, const Leaf& out, cudaStream_t s) {
        if (nccl->rank() == root && in.bytes) {
          JAXFOG_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(out.out, in.in, in.bytes, cudaMemcpyDeviceToDevice, s));
        }
        return nccl->EnqueueBroadcast(out.out, out.bytes, static_cast<int>(root), s);
      });
}

// out[l] = in[l] of ranks 0..n-1, concatenated along axis 0.
ffi::Error Allgather(int64_t comm_id, int64_t signature, std::string_view layout, ffi::Token,
                     ffi::RemainingArgs args, ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                     cudaStream_t stream) {
  return Collective(OpCode::kAllgather, comm_id, signature, layout, args, rets, stream,
                    &NcclTransport::AllgatherBytes,
                    [](NcclTransport* nccl, const Leaf& in, const Leaf& out, cudaStream_t s) {
                      return nccl->EnqueueAllgather(in.in, out.out, in.bytes, s);
                    });
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
                                         .Attr<bool>("stacked")));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_nccl_allreduce, Allreduce, Pytree(Keyed()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_nccl_broadcast, Broadcast,
                              Pytree(Keyed().Attr<int64_t>("root")));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfog_nccl_allgather, Allgather, Pytree(Keyed()));
#pragma GCC visibility pop

}  // namespace jaxfog
#endif  // JAXFOG_WITH_NCCL
