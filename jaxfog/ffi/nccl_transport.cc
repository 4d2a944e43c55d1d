#ifdef JAXFOG_WITH_NCCL
#include "nccl_transport.h"

#include <string>
#include <utility>

#include "cuda_util.h"
#include "status.h"
#include "traffic.h"

namespace jaxfog {
namespace {

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

ffi::Error NcclTransport::NoStream(const OpInfo& info) {
  return ffi::Error::Internal(std::string("jaxfog ") + OpName(info.op) +
                              ": an NCCL communicator used off a GPU handler (no CUDA stream)");
}

ffi::Error NcclTransport::Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                   const std::vector<RecvSpec>& recvs, cudaStream_t stream) {
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
                                     const std::function<ffi::Error()>& enqueue) {
  // Header check: every rank runs the same op and signature (no data).
  JAXFOG_RETURN_IF_ERROR(checks_->Allgather(info, nullptr, nullptr, 0));
  JAXFOG_RETURN_IF_ERROR(Grouped(enqueue));
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

}  // namespace jaxfog
#endif  // JAXFOG_WITH_NCCL
