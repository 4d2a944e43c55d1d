#ifdef JAXFOG_WITH_NCCL
#include "nccl_transport.h"

#include <string>
#include <utility>

#include "cuda_util.h"
#include "status.h"
#include "traffic.h"

namespace jaxfog {
namespace {

thread_local cudaStream_t current_stream = nullptr;
thread_local bool stream_set = false;

ffi::ErrorOr<ncclDataType_t> NcclType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F16: return ncclFloat16;
    case ffi::DataType::BF16: return ncclBfloat16;
    case ffi::DataType::F32: return ncclFloat32;
    case ffi::DataType::F64: return ncclFloat64;
    case ffi::DataType::S8: return ncclInt8;
    case ffi::DataType::U8: return ncclUint8;
    case ffi::DataType::S32: return ncclInt32;
    case ffi::DataType::U32: return ncclUint32;
    case ffi::DataType::S64: return ncclInt64;
    case ffi::DataType::U64: return ncclUint64;
    default:
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          "jaxfog: NCCL cannot sum this dtype (" + std::to_string(static_cast<int>(type)) + ")"));
  }
}

}  // namespace

ffi::ErrorOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(
    const ncclUniqueId& id, int device, std::unique_ptr<Transport> checks) {
  JAXFOG_ASSIGN_OR_RETURN(api, Nccl());
  JAXFOG_RETURN_IF_ERROR_OR(CudaError(cudaSetDevice(device), "cudaSetDevice"));
  ncclComm_t comm = nullptr;
  const int rank = checks->rank(), size = checks->size();
  JAXFOG_RETURN_IF_ERROR_OR(NcclError(api->CommInitRank(&comm, size, id, rank),
                                      "ncclCommInitRank (rank " + std::to_string(rank) +
                                          " of " + std::to_string(size) + ", device " +
                                          std::to_string(device) + ")"));
  return std::unique_ptr<NcclTransport>(new NcclTransport(api, comm, std::move(checks)));
}

NcclTransport::~NcclTransport() {
  // A communicator with an asynchronous error cannot be destroyed cleanly.
  ncclResult_t async = ncclSuccess;
  if (api_->CommGetAsyncError(comm_, &async) != ncclSuccess || async != ncclSuccess) {
    api_->CommAbort(comm_);
  } else {
    api_->CommDestroy(comm_);
  }
}

NcclTransport::StreamScope::StreamScope(cudaStream_t stream)
    : previous_(current_stream), previous_set_(stream_set) {
  current_stream = stream;
  stream_set = true;
}

NcclTransport::StreamScope::~StreamScope() {
  current_stream = previous_;
  stream_set = previous_set_;
}

ffi::ErrorOr<cudaStream_t> NcclTransport::Stream(const char* op) const {
  if (!stream_set) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::Internal(
        std::string("jaxfog ") + op + ": no CUDA stream (NCCL transport used off a GPU handler)"));
  }
  return current_stream;
}

ffi::Error NcclTransport::Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                   const std::vector<RecvSpec>& recvs,
                                   const Streaming* streaming) {
  if (streaming) {
    return ffi::Error::Internal("jaxfog: the NCCL transport does not stream on the host");
  }
  JAXFOG_ASSIGN_OR_FAIL(stream, Stream(OpName(info.op)));
  // Headers: the same exchange, without data, over MPI.
  std::vector<SendSpec> header_sends;
  std::vector<RecvSpec> header_recvs;
  for (const SendSpec& send : sends) header_sends.push_back({send.peer, {}});
  for (const RecvSpec& recv : recvs) header_recvs.push_back({recv.peer, {}});
  JAXFOG_RETURN_IF_ERROR(checks_->Exchange(info, header_sends, header_recvs));
  const std::string what = std::string(OpName(info.op)) + ": ncclSend/ncclRecv";
  size_t sent = 0;
  JAXFOG_RETURN_IF_ERROR(Grouped([&]() -> ffi::Error {
    for (const SendSpec& send : sends) {
      for (const ConstPiece& piece : send.pieces) {
        if (!piece.bytes) continue;  // both sides skip it: the sizes agreed above
        sent += piece.bytes;
        JAXFOG_RETURN_IF_ERROR(NcclError(
            api_->Send(piece.data, piece.bytes, ncclUint8, send.peer, comm_, stream), what,
            comm_));
      }
    }
    for (const RecvSpec& recv : recvs) {
      for (const Piece& piece : recv.pieces) {
        if (!piece.bytes) continue;
        JAXFOG_RETURN_IF_ERROR(NcclError(
            api_->Recv(piece.data, piece.bytes, ncclUint8, recv.peer, comm_, stream), what,
            comm_));
      }
    }
    return ffi::Error::Success();
  }));
  traffic::AddData(info.op, static_cast<int64_t>(sent));
  return ffi::Error::Success();
}

ffi::Error NcclTransport::Grouped(const std::function<ffi::Error()>& enqueue) {
  JAXFOG_RETURN_IF_ERROR(NcclError(api_->GroupStart(), "ncclGroupStart", comm_));
  const ffi::Error status = enqueue();
  // The group must be closed even after a failed call; the first error wins.
  const ffi::Error end = NcclError(api_->GroupEnd(), "ncclGroupEnd", comm_);
  return status.success() ? end : status;
}

ffi::Error NcclTransport::Collective(const OpInfo& info, int64_t bytes,
                                     const std::function<ffi::Error(cudaStream_t)>& enqueue) {
  JAXFOG_ASSIGN_OR_FAIL(stream, Stream(OpName(info.op)));
  // Header check: every rank runs the same op and signature (no data).
  JAXFOG_RETURN_IF_ERROR(checks_->Allgather(info, nullptr, nullptr, 0));
  JAXFOG_RETURN_IF_ERROR(Grouped([&] { return enqueue(stream); }));
  traffic::AddData(info.op, bytes);
  return ffi::Error::Success();
}

ffi::Error NcclTransport::EnqueueAllreduce(const void* in, void* out, size_t count,
                                           ffi::DataType type, cudaStream_t stream) {
  JAXFOG_ASSIGN_OR_FAIL(nccl_type, NcclType(type));
  return NcclError(api_->AllReduce(in, out, count, nccl_type, ncclSum, comm_, stream),
                   "ncclAllReduce", comm_);
}

ffi::Error NcclTransport::EnqueueBroadcast(void* data, size_t bytes, int root,
                                           cudaStream_t stream) {
  return NcclError(api_->Broadcast(data, data, bytes, ncclUint8, root, comm_, stream),
                   "ncclBroadcast", comm_);
}

ffi::Error NcclTransport::EnqueueAllgather(const void* in, void* out, size_t bytes,
                                           cudaStream_t stream) {
  return NcclError(api_->AllGather(in, out, bytes, ncclUint8, comm_, stream), "ncclAllGather",
                   comm_);
}

// One buffer each: the Transport interface. comm_stats counts the same
// logical figures as the MPI transport.
ffi::Error NcclTransport::Allreduce(const OpInfo& info, const void* in, void* out, size_t count,
                                    ffi::DataType type) {
  return Collective(info, AllreduceBytes(count * ffi::ByteWidth(type)), [&](cudaStream_t stream) {
    return EnqueueAllreduce(in, out, count, type, stream);
  });
}

ffi::Error NcclTransport::Broadcast(const OpInfo& info, void* data, size_t bytes, int root) {
  return Collective(info, BroadcastBytes(bytes, root), [&](cudaStream_t stream) {
    return EnqueueBroadcast(data, bytes, root, stream);
  });
}

ffi::Error NcclTransport::Allgather(const OpInfo& info, const void* in, void* out,
                                    size_t bytes) {
  return Collective(info, AllgatherBytes(bytes), [&](cudaStream_t stream) {
    return EnqueueAllgather(in, out, bytes, stream);
  });
}

}  // namespace jaxfog
#endif  // JAXFOG_WITH_NCCL
