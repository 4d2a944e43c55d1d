#ifdef JAXFOG_WITH_NCCL
#include "nccl_transport.h"

#include <cstdio>
#include <sstream>
#include <string>
#include <utility>

#include "cuda_util.h"
#include "dtype.h"
#include "status.h"
#include "traffic.h"

namespace jaxfog {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollInterval = std::chrono::milliseconds(20);

ffi::ErrorOr<ncclDataType_t> NcclType(ffi::DataType type, const std::string& what) {
  switch (type) {
    case ffi::DataType::F16:
      return ncclFloat16;
    case ffi::DataType::BF16:
      return ncclBfloat16;
    case ffi::DataType::F32:
      return ncclFloat32;
    case ffi::DataType::F64:
      return ncclFloat64;
    case ffi::DataType::S8:
      return ncclInt8;
    case ffi::DataType::U8:
      return ncclUint8;
    case ffi::DataType::S32:
      return ncclInt32;
    case ffi::DataType::U32:
      return ncclUint32;
    case ffi::DataType::S64:
      return ncclInt64;
    case ffi::DataType::U64:
      return ncclUint64;
    default:
      return ffi::Unexpected<ffi::Error>(
          ffi::Error::InvalidArgument(what + ": NCCL cannot sum dtype " + DTypeName(type) +
                                      " (the lowering sends it through host staging)"));
  }
}

std::string Ranks(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << "]";
  return out.str();
}

ffi::Error CheckBuffer(const void* data, size_t bytes, const std::string& what) {
  if (bytes && data == nullptr) {
    return ffi::Error::InvalidArgument(what + ": a buffer of " + std::to_string(bytes) +
                                       " bytes has no address");
  }
  return ffi::Error::Success();
}

}  // namespace

const EventApi* CudaEvents() {
  static const EventApi api{&cudaEventCreateWithFlags, &cudaEventRecord, &cudaEventQuery,
                            &cudaEventDestroy};
  return &api;
}

ffi::ErrorOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(
    const ncclUniqueId& id, int device, std::unique_ptr<MpiTransport> checks,
    double timeout_seconds) {
  JAXFOG_ASSIGN_OR_RETURN(api, Nccl());
  JAXFOG_RETURN_IF_ERROR_OR(CudaError(cudaSetDevice(device), "cudaSetDevice"));
  ncclComm_t comm = nullptr;
  const int rank = checks->rank(), size = checks->size();
  JAXFOG_RETURN_IF_ERROR_OR(NcclError(api->CommInitRank(&comm, size, id, rank),
                                      "ncclCommInitRank (rank " + std::to_string(rank) + " of " +
                                          std::to_string(size) + ", device " +
                                          std::to_string(device) + ")"));
  return std::make_unique<NcclTransport>(api, CudaEvents(), comm, std::move(checks),
                                         timeout_seconds);
}

NcclTransport::NcclTransport(const NcclApi* api, const EventApi* events, ncclComm_t comm,
                             std::unique_ptr<MpiTransport> checks, double timeout_seconds)
    : api_(api),
      events_(events),
      comm_(comm),
      checks_(std::move(checks)),
      timeout_(timeout_seconds),
      watchdog_([this] { Watch(); }) {}

NcclTransport::~NcclTransport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  watchdog_.join();
  if (!aborted_) {
    ncclResult_t async = ncclSuccess;
    const bool healthy =
        fenced_ && api_->CommGetAsyncError(comm_, &async) == ncclSuccess && async == ncclSuccess;
    // Destroying waits for the peers; aborting does not.
    if (healthy) {
      api_->CommDestroy(comm_);
    } else {
      api_->CommAbort(comm_);
    }
  }
  for (const Enqueued& work : enqueued_) events_->Destroy(work.event);
  for (cudaEvent_t event : spare_) events_->Destroy(event);
}

ffi::Error NcclTransport::Failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kAborted, failure_);
}

std::string NcclTransport::Describe(const OpInfo& info, const std::string& peers) const {
  return std::string("jaxfog ") + OpName(info.op) + " (NCCL, op #" +
         std::to_string(sequence() + 1) + " on rank " + std::to_string(rank()) +
         (peers.empty() ? "" : ", " + peers) + ")";
}

template <typename Enqueue>
ffi::Error NcclTransport::Grouped(const std::string& what, cudaStream_t stream, Enqueue enqueue) {
  JAXFOG_RETURN_IF_ERROR(NcclError(api_->GroupStart(), what + ": ncclGroupStart", comm_));
  const ffi::Error status = enqueue();
  // The group is closed even after a failed call; the first error wins.
  const ffi::Error end = NcclError(api_->GroupEnd(), what + ": ncclGroupEnd", comm_);
  JAXFOG_RETURN_IF_ERROR(status);
  JAXFOG_RETURN_IF_ERROR(end);
  // An event after the group tells the watchdog when it has finished.
  cudaEvent_t event = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!spare_.empty()) {
      event = spare_.back();
      spare_.pop_back();
    }
  }
  if (event == nullptr) {
    JAXFOG_RETURN_IF_ERROR(
        CudaError(events_->Create(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags"));
  }
  const cudaError_t recorded = events_->Record(event, stream);
  if (recorded != cudaSuccess) {
    events_->Destroy(event);
    return CudaError(recorded, "cudaEventRecord");
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    enqueued_.push_back({event, what, Clock::now()});
  }
  return ffi::Error::Success();
}

ffi::Error NcclTransport::Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                   const std::vector<RecvSpec>& recvs, cudaStream_t stream) {
  JAXFOG_RETURN_IF_ERROR(Failed());
  std::vector<int> to, from;
  for (const SendSpec& send : sends) to.push_back(send.peer);
  for (const RecvSpec& recv : recvs) from.push_back(recv.peer);
  const std::string what =
      Describe(info, "sends to ranks " + Ranks(to) + ", receives from ranks " + Ranks(from));
  for (int peer : to) {
    if (peer < 0 || peer >= size()) {
      return ffi::Error::InvalidArgument(what + ": rank " + std::to_string(peer) +
                                         " is out of range");
    }
  }
  for (int peer : from) {
    if (peer < 0 || peer >= size()) {
      return ffi::Error::InvalidArgument(what + ": rank " + std::to_string(peer) +
                                         " is out of range");
    }
  }
  size_t sent = 0;
  for (const SendSpec& send : sends) {
    for (const ConstPiece& piece : send.pieces) {
      JAXFOG_RETURN_IF_ERROR(CheckBuffer(piece.data, piece.bytes, what));
      sent += piece.bytes;
    }
  }
  for (const RecvSpec& recv : recvs) {
    for (const Piece& piece : recv.pieces) {
      JAXFOG_RETURN_IF_ERROR(CheckBuffer(piece.data, piece.bytes, what));
    }
  }
  // Headers over MPI; a mismatch stops every rank involved here.
  JAXFOG_RETURN_IF_ERROR(checks_->CheckExchange(info, sends, recvs));
  JAXFOG_RETURN_IF_ERROR(Grouped(what, stream, [&]() -> ffi::Error {
    for (const SendSpec& send : sends) {
      for (const ConstPiece& piece : send.pieces) {
        if (!piece.bytes) continue;  // both sides skip it: the sizes agreed above
        JAXFOG_RETURN_IF_ERROR(
            NcclError(api_->Send(piece.data, piece.bytes, ncclUint8, send.peer, comm_, stream),
                      what + ": ncclSend", comm_));
      }
    }
    for (const RecvSpec& recv : recvs) {
      for (const Piece& piece : recv.pieces) {
        if (!piece.bytes) continue;
        JAXFOG_RETURN_IF_ERROR(
            NcclError(api_->Recv(piece.data, piece.bytes, ncclUint8, recv.peer, comm_, stream),
                      what + ": ncclRecv", comm_));
      }
    }
    return ffi::Error::Success();
  }));
  traffic::AddData(info.op, static_cast<int64_t>(sent));
  return ffi::Error::Success();
}

template <typename Enqueue>
ffi::Error NcclTransport::Collective(const OpInfo& info, const std::vector<NcclBuffer>& leaves,
                                     const std::string& what, cudaStream_t stream,
                                     Enqueue enqueue) {
  for (const NcclBuffer& leaf : leaves) {
    JAXFOG_RETURN_IF_ERROR(CheckBuffer(leaf.in, leaf.bytes, what));
    JAXFOG_RETURN_IF_ERROR(CheckBuffer(leaf.out, leaf.bytes, what));
  }
  JAXFOG_RETURN_IF_ERROR(checks_->CheckCollective(info, TotalBytes(leaves)));
  return Grouped(what, stream, [&]() -> ffi::Error {
    for (const NcclBuffer& leaf : leaves) JAXFOG_RETURN_IF_ERROR(enqueue(leaf));
    return ffi::Error::Success();
  });
}

ffi::Error NcclTransport::Allreduce(const OpInfo& info, const std::vector<NcclBuffer>& leaves,
                                    cudaStream_t stream) {
  JAXFOG_RETURN_IF_ERROR(Failed());
  const std::string what = Describe(info, "");
  std::vector<ncclDataType_t> types;
  for (const NcclBuffer& leaf : leaves) {
    JAXFOG_ASSIGN_OR_FAIL(type, NcclType(leaf.type, what));
    types.push_back(type);
  }
  size_t l = 0;
  JAXFOG_RETURN_IF_ERROR(Collective(info, leaves, what, stream, [&](const NcclBuffer& leaf) {
    return NcclError(
        api_->AllReduce(leaf.in, leaf.out, leaf.count, types[l++], ncclSum, comm_, stream),
        what + ": ncclAllReduce", comm_);
  }));
  // What a bandwidth-optimal (ring) allreduce sends per rank, as MPI counts it.
  const int64_t n = size(), bytes = static_cast<int64_t>(TotalBytes(leaves));
  traffic::Add(info.op, 2 * (n - 1), 2 * (n - 1) * bytes / n);
  return ffi::Error::Success();
}

ffi::Error NcclTransport::Broadcast(const OpInfo& info, const std::vector<NcclBuffer>& leaves,
                                    int root, cudaStream_t stream) {
  JAXFOG_RETURN_IF_ERROR(Failed());
  const std::string what = Describe(info, "root " + std::to_string(root));
  if (root < 0 || root >= size()) {
    return ffi::Error::InvalidArgument(what + ": the root is out of range");
  }
  JAXFOG_RETURN_IF_ERROR(Collective(info, leaves, what, stream, [&](const NcclBuffer& leaf) {
    if (rank() == root && leaf.bytes && leaf.in != leaf.out) {
      JAXFOG_RETURN_IF_ERROR(CudaError(
          cudaMemcpyAsync(leaf.out, leaf.in, leaf.bytes, cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync"));
    }
    return NcclError(
        api_->Broadcast(leaf.out, leaf.out, leaf.bytes, ncclUint8, root, comm_, stream),
        what + ": ncclBroadcast", comm_);
  }));
  const int64_t peers = rank() == root ? size() - 1 : 0;
  traffic::Add(info.op, peers, peers * static_cast<int64_t>(TotalBytes(leaves)));
  return ffi::Error::Success();
}

ffi::Error NcclTransport::Allgather(const OpInfo& info, const std::vector<NcclBuffer>& leaves,
                                    cudaStream_t stream) {
  JAXFOG_RETURN_IF_ERROR(Failed());
  const std::string what = Describe(info, "");
  JAXFOG_RETURN_IF_ERROR(Collective(info, leaves, what, stream, [&](const NcclBuffer& leaf) {
    return NcclError(api_->AllGather(leaf.in, leaf.out, leaf.bytes, ncclUint8, comm_, stream),
                     what + ": ncclAllGather", comm_);
  }));
  const int64_t peers = size() - 1;
  traffic::Add(info.op, peers, peers * static_cast<int64_t>(TotalBytes(leaves)));
  return ffi::Error::Success();
}

ffi::Error NcclTransport::Fence() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!aborted_ && !Poll(Clock::now())) wake_.wait_for(lock, kPollInterval);
  }
  JAXFOG_RETURN_IF_ERROR(Failed());
  JAXFOG_RETURN_IF_ERROR(checks_->Barrier());
  std::lock_guard<std::mutex> lock(mutex_);
  fenced_ = true;
  return ffi::Error::Success();
}

void NcclTransport::Watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, kPollInterval);
    if (!stop_ && !aborted_) Poll(Clock::now());
  }
}

bool NcclTransport::Poll(Clock::time_point now) {
  if (aborted_) return false;
  const std::string during = enqueued_.empty() ? "" : " during " + enqueued_.front().what;
  ncclResult_t async = ncclSuccess;
  const ncclResult_t asked = api_->CommGetAsyncError(comm_, &async);
  if (asked != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
    const ncclResult_t code = asked != ncclSuccess ? asked : async;
    AbortLocked("NCCL reported an error" + during + ": " + api_->GetErrorString(code));
    return false;
  }
  while (!enqueued_.empty()) {
    const cudaError_t state = events_->Query(enqueued_.front().event);
    if (state == cudaErrorNotReady) break;
    if (state != cudaSuccess) {
      AbortLocked(enqueued_.front().what + ": the GPU reported " + cudaGetErrorName(state) + " (" +
                  cudaGetErrorString(state) + ")");
      return false;
    }
    spare_.push_back(enqueued_.front().event);
    enqueued_.pop_front();
  }
  if (enqueued_.empty()) return true;
  const std::chrono::duration<double> waited = now - enqueued_.front().enqueued;
  if (waited > timeout_) {
    std::ostringstream seconds;
    seconds << timeout_.count();
    AbortLocked(enqueued_.front().what + " timed out after " + seconds.str() +
                " s (JAXFOG_TIMEOUT): its NCCL work has not finished on the GPU (a peer "
                "stopped, or is stuck in another op)");
  }
  return false;
}

void NcclTransport::AbortLocked(const std::string& reason) {
  failure_ = reason + "; the NCCL communicator was aborted, and every later op on it fails";
  std::fprintf(stderr, "jaxfog watchdog: %s\n", failure_.c_str());
  std::fflush(stderr);
  api_->CommAbort(comm_);
  aborted_ = true;
}

}  // namespace jaxfog
#endif  // JAXFOG_WITH_NCCL
