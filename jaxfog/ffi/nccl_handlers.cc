// The NCCL transport's XLA FFI handlers, for CUDA buffers. They move data
// only: the lowering (jaxfog/ops/nccl.py) leaves weighted sums, means and the
// scaling of sends to XLA, which fuses them around the call. Not CUDA-graph
// compatible (no traits): each call checks headers over MPI on the host.
#ifdef JAXFOG_WITH_NCCL
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "cuda_util.h"
#include "nccl_transport.h"
#include "registry.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {
namespace {

using I64s = ffi::Span<const int64_t>;

struct Buffer {
  ffi::DataType type;
  size_t count;
  size_t bytes;
  void* data;
};

std::vector<Buffer> Buffers(ffi::RemainingArgs args) {
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> b = args.get<ffi::AnyBuffer>(i);
    if (b.has_value()) {
      buffers.push_back({b->element_type(), b->element_count(), b->size_bytes(),
                         b->untyped_data()});
    }
  }
  return buffers;
}

std::vector<Buffer> Buffers(ffi::RemainingRets rets) {
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_value()) {
      ffi::AnyBuffer& buffer = **b;
      buffers.push_back({buffer.element_type(), buffer.element_count(), buffer.size_bytes(),
                         buffer.untyped_data()});
    }
  }
  return buffers;
}

// The NCCL transport registered under `comm_id`, with its leaves.
struct NcclCall {
  NcclTransport* transport;
  std::vector<Buffer> in, out;
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
  NcclCall call{nccl, Buffers(args), Buffers(rets)};
  if (call.in.size() != args.size() || call.out.size() != rets.size() ||
      call.in.size() != call.out.size()) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument(std::string("jaxfog ") + op + ": malformed call"));
  }
  return call;
}

ffi::Error Malformed(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxfog ") + op + ": " + what);
}

// out[l] = the blocks from recv_ranks (in order) of leaf l. With `stacked`,
// in[l] holds one block per send rank (block s goes to send_ranks[s]);
// without, all of in[l] goes to every send rank.
ffi::Error Exchange(int64_t comm_id, int64_t signature, I64s send_ranks, I64s recv_ranks,
                    bool stacked, ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                    ffi::RemainingRets rets, cudaStream_t stream) {
  constexpr const char* kOp = "neighbor exchange (NCCL)";
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, kOp, args, rets));
  const size_t n_send = send_ranks.size(), n_recv = recv_ranks.size();
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  for (size_t s = 0; s < n_send; ++s) sends.push_back({static_cast<int>(send_ranks[s]), {}});
  for (size_t j = 0; j < n_recv; ++j) recvs.push_back({static_cast<int>(recv_ranks[j]), {}});
  for (size_t l = 0; l < call.in.size(); ++l) {
    const Buffer& in = call.in[l];
    const Buffer& out = call.out[l];
    if (stacked && n_send && in.bytes % n_send) return Malformed(kOp, "send blocks");
    if (n_recv && out.bytes % n_recv) return Malformed(kOp, "receive blocks");
    const size_t send_block = stacked ? (n_send ? in.bytes / n_send : 0) : in.bytes;
    const size_t recv_block = n_recv ? out.bytes / n_recv : 0;
    if (n_send && n_recv && send_block != recv_block) return Malformed(kOp, "block sizes");
    for (size_t s = 0; s < n_send; ++s) {
      sends[s].pieces.push_back(
          {static_cast<const char*>(in.data) + (stacked ? s * send_block : 0), send_block});
    }
    for (size_t j = 0; j < n_recv; ++j) {
      recvs[j].pieces.push_back({static_cast<char*>(out.data) + j * recv_block, recv_block});
    }
  }
  NcclTransport::StreamScope scope(stream);
  const OpInfo info{OpCode::kNeighborAllgather, static_cast<uint64_t>(signature)};
  return call.transport->Exchange(info, sends, recvs);
}

// out[l] = the sum over ranks of in[l], all leaves in one NCCL group.
ffi::Error Allreduce(int64_t comm_id, int64_t signature, ffi::Token, ffi::RemainingArgs args,
                     ffi::Result<ffi::Token>, ffi::RemainingRets rets, cudaStream_t stream) {
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, "allreduce (NCCL)", args, rets));
  NcclTransport::StreamScope scope(stream);
  const OpInfo info{OpCode::kAllreduce, static_cast<uint64_t>(signature)};
  NcclTransport::Group group(call.transport->api());
  for (size_t l = 0; l < call.in.size(); ++l) {
    JAXFOG_RETURN_IF_ERROR(call.transport->Allreduce(info, call.in[l].data, call.out[l].data,
                                                     call.in[l].count, call.in[l].type));
  }
  return group.End();
}

// out[l] = root's in[l].
ffi::Error Broadcast(int64_t comm_id, int64_t signature, int64_t root, ffi::Token,
                     ffi::RemainingArgs args, ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                     cudaStream_t stream) {
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, "broadcast (NCCL)", args, rets));
  NcclTransport::StreamScope scope(stream);
  const OpInfo info{OpCode::kBroadcast, static_cast<uint64_t>(signature)};
  if (call.transport->rank() == root) {
    for (size_t l = 0; l < call.in.size(); ++l) {
      if (!call.in[l].bytes) continue;
      JAXFOG_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(call.out[l].data, call.in[l].data,
                                                  call.in[l].bytes, cudaMemcpyDeviceToDevice,
                                                  stream));
    }
  }
  NcclTransport::Group group(call.transport->api());
  for (size_t l = 0; l < call.out.size(); ++l) {
    JAXFOG_RETURN_IF_ERROR(call.transport->Broadcast(info, call.out[l].data, call.out[l].bytes,
                                                     static_cast<int>(root)));
  }
  return group.End();
}

// out[l] = in[l] of ranks 0..n-1, concatenated along axis 0.
ffi::Error Allgather(int64_t comm_id, int64_t signature, ffi::Token, ffi::RemainingArgs args,
                     ffi::Result<ffi::Token>, ffi::RemainingRets rets, cudaStream_t stream) {
  JAXFOG_ASSIGN_OR_FAIL(call, Decode(comm_id, "allgather (NCCL)", args, rets));
  NcclTransport::StreamScope scope(stream);
  const OpInfo info{OpCode::kAllgather, static_cast<uint64_t>(signature)};
  NcclTransport::Group group(call.transport->api());
  for (size_t l = 0; l < call.in.size(); ++l) {
    JAXFOG_RETURN_IF_ERROR(
        call.transport->Allgather(info, call.in[l].data, call.out[l].data, call.in[l].bytes));
  }
  return group.End();
}

auto Keyed() { return ffi::Ffi::Bind().Attr<int64_t>("comm_id").Attr<int64_t>("signature"); }

template <typename Binding>
auto Pytree(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Token>()
      .RemainingArgs()
      .template Ret<ffi::Token>()
      .RemainingRets()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>();
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
