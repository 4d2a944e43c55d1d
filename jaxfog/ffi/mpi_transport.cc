#include "mpi_transport.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtype.h"
#include "message_header.h"
#include "mpi_status.h"
#include "timeline.h"
#include "traffic.h"

namespace jaxfog {

namespace {

constexpr int kHeaderTag = 1;
constexpr int kDataTag = 2;
constexpr int kReceiptTag = 3;

std::atomic<bool> send_receipts{false};

// MPI reduction ops for the 16-bit floats MPI has no type for (summed in float).
void HalfSum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const _Float16*>(in);
  auto* b = static_cast<_Float16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<_Float16>(float(a[i]) + float(b[i]));
}

void BFloat16Sum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = FloatToBFloat16(BFloat16ToFloat(a[i]) + BFloat16ToFloat(b[i]));
  }
}

// A message cut into chunks of at most `max_bytes`, each a list of
// (address, length) runs over the message's pieces.
using Run = std::pair<char*, size_t>;
std::vector<std::vector<Run>> Chunks(const std::vector<Run>& pieces, size_t max_bytes) {
  std::vector<std::vector<Run>> chunks;
  size_t room = 0;
  for (auto [data, bytes] : pieces) {
    while (bytes > 0) {
      if (room == 0) {
        chunks.emplace_back();
        room = max_bytes;
      }
      const size_t take = std::min(bytes, room);
      chunks.back().emplace_back(data, take);
      data += take;
      bytes -= take;
      room -= take;
    }
  }
  return chunks;
}

template <typename PieceT>
std::vector<Run> Runs(const std::vector<PieceT>& pieces) {
  std::vector<Run> runs;
  runs.reserve(pieces.size());
  for (const auto& p : pieces) {
    if (p.bytes > 0) runs.emplace_back(static_cast<char*>(const_cast<void*>(p.data)), p.bytes);
  }
  return runs;
}

// A derived datatype, freed on every path out of the scope that made it (MPI
// keeps it alive for requests still using it).
class ScopedType {
 public:
  explicit ScopedType(MPI_Datatype type) : type_(type) {}
  // The result is ignored: a destructor has no one to tell.
  ~ScopedType() { MPI_Type_free(&type_); }
  ScopedType(const ScopedType&) = delete;
  ScopedType& operator=(const ScopedType&) = delete;
  MPI_Datatype& get() { return type_; }

 private:
  MPI_Datatype type_;
};

// Posts one chunk: a plain byte run, or an hindexed datatype over several
// runs (MPI reads/writes them in place, no packing by us).
int PostChunk(const std::vector<Run>& runs, bool send, int peer, MPI_Comm comm,
              MPI_Request* request) {
  if (runs.size() == 1) {
    return send ? MPI_Isend(runs[0].first, static_cast<int>(runs[0].second), MPI_BYTE, peer,
                            kDataTag, comm, request)
                : MPI_Irecv(runs[0].first, static_cast<int>(runs[0].second), MPI_BYTE, peer,
                            kDataTag, comm, request);
  }
  std::vector<int> lengths(runs.size());
  std::vector<MPI_Aint> displacements(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    lengths[i] = static_cast<int>(runs[i].second);
    if (int rc = MPI_Get_address(runs[i].first, &displacements[i]); rc != MPI_SUCCESS) return rc;
  }
  MPI_Datatype created;
  if (int rc = MPI_Type_create_hindexed(static_cast<int>(runs.size()), lengths.data(),
                                        displacements.data(), MPI_BYTE, &created);
      rc != MPI_SUCCESS) {
    return rc;
  }
  ScopedType type(created);
  if (int rc = MPI_Type_commit(&type.get()); rc != MPI_SUCCESS) return rc;
  return send ? MPI_Isend(MPI_BOTTOM, 1, type.get(), peer, kDataTag, comm, request)
              : MPI_Irecv(MPI_BOTTOM, 1, type.get(), peer, kDataTag, comm, request);
}

// Turns completed data requests into Streaming::arrived calls: receive i
// (requests [first[i], first[i + 1]), chunks in message order) has its first
// `done * chunk_bytes` bytes once its first `done` chunks completed (MPI
// matches messages between two ranks in order, but may complete them in any).
std::function<ffi::Error(const int*, int)> StreamArrivals(const Streaming& streaming,
                                                          const std::vector<size_t>& first,
                                                          size_t chunk_bytes) {
  const size_t receives = first.size() - 1;
  auto complete = std::make_shared<std::vector<bool>>(first.back(), false);
  auto prefix = std::make_shared<std::vector<size_t>>(receives, 0);
  auto reported = std::make_shared<size_t>(0);
  return [&streaming, &first, chunk_bytes, receives, complete, prefix, reported](
             const int* indices, int count) -> ffi::Error {
    for (int i = 0; i < count; ++i) {
      if (static_cast<size_t>(indices[i]) < complete->size()) (*complete)[indices[i]] = true;
    }
    size_t arrived = Streaming::kAll;
    for (size_t r = 0; r < receives; ++r) {
      size_t& done = (*prefix)[r];
      const size_t chunks = first[r + 1] - first[r];
      while (done < chunks && (*complete)[first[r] + done]) ++done;
      if (done < chunks) arrived = std::min(arrived, done * chunk_bytes);
    }
    if (arrived == Streaming::kAll || arrived <= *reported) return ffi::Error::Success();
    *reported = arrived;
    return streaming.arrived(arrived);
  };
}

}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm, double timeout_seconds, size_t max_message_bytes,
                           std::shared_ptr<PeerWatch> watch, int64_t comm_id)
    : comm_(comm),
      timeout_seconds_(timeout_seconds),
      watch_(std::move(watch)),
      max_message_bytes_(std::clamp<size_t>(max_message_bytes, 1, INT_MAX)) {
  scope_.timeout_seconds = timeout_seconds;
  scope_.watch = watch_.get();
  scope_.comm_id = comm_id;
  scope_.sequence = &sequence_;
  if (watch_) progress_ = watch_->Track(comm_id);
}

ffi::ErrorOr<std::unique_ptr<MpiTransport>> MpiTransport::Create(MPI_Comm comm,
                                                                 double timeout_seconds,
                                                                 size_t max_message_bytes,
                                                                 std::shared_ptr<PeerWatch> watch,
                                                                 int64_t comm_id) {
  std::unique_ptr<MpiTransport> transport(
      new MpiTransport(comm, timeout_seconds, max_message_bytes, std::move(watch), comm_id));
  if (ffi::Error err = transport->Init(); !err.success()) {
    return ffi::Unexpected<ffi::Error>(std::move(err));
  }
  return std::move(transport);
}

ffi::Error MpiTransport::Init() {
  // Validity of `comm_` was checked by the caller.
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  scope_.rank = rank_;
  if (watch_) {
    JAXFOG_ASSIGN_OR_FAIL(world_ranks, watch_->WorldRanks(comm_));
    scope_.world_ranks = std::move(world_ranks);
  }
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Op_create(&HalfSum, /*commute=*/1, &half_sum_), "MPI_Op_create");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Op_create(&BFloat16Sum, /*commute=*/1, &bfloat16_sum_),
                             "MPI_Op_create");
  return ffi::Error::Success();
}

// MPI results are ignored here: a destructor has no one to tell.
MpiTransport::~MpiTransport() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;
  if (half_sum_ != MPI_OP_NULL) MPI_Op_free(&half_sum_);
  if (bfloat16_sum_ != MPI_OP_NULL) MPI_Op_free(&bfloat16_sum_);
}

void MpiTransport::Begin(OpCode op) {
  ++sequence_;
  if (progress_ != nullptr) progress_->Record(op, sequence_);
}

std::string MpiTransport::Describe(const OpInfo& info) const {
  return std::string("jaxfog ") + OpName(info.op) + " (op #" + std::to_string(sequence_) +
         " on rank " + std::to_string(rank_) + ")";
}

ffi::Error MpiTransport::Barrier() {
  timeline::Span span("MPI_Ibarrier");
  JAXFOG_RETURN_IF_ERROR(
      CheckFailedPeers(scope_, "jaxfog barrier on rank " + std::to_string(rank_)));
  RequestSet requests("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Ibarrier(comm_, requests.Add()), "MPI_Ibarrier");
  return requests.WaitAll(scope_, "jaxfog barrier on rank " + std::to_string(rank_));
}

ffi::Error MpiTransport::Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                  const std::vector<RecvSpec>& recvs, const Streaming* streaming) {
  return Messages(info, sends, recvs, streaming, /*with_data=*/true);
}

ffi::Error MpiTransport::CheckExchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                       const std::vector<RecvSpec>& recvs) {
  return Messages(info, sends, recvs, /*streaming=*/nullptr, /*with_data=*/false);
}

ffi::Error MpiTransport::CheckCollective(const OpInfo& info, uint64_t bytes) {
  Begin(info.op);
  JAXFOG_RETURN_IF_ERROR(CheckFailedPeers(scope_, Describe(info)));
  return Agree(comm_, rank_, size_, scope_, info, sequence_, bytes, Describe(info));
}

ffi::Error MpiTransport::Messages(const OpInfo& info, const std::vector<SendSpec>& sends,
                                  const std::vector<RecvSpec>& recvs, const Streaming* streaming,
                                  bool with_data) {
  Begin(info.op);
  const std::string what = Describe(info);
  {
    std::vector<int> peers;
    for (const RecvSpec& recv : recvs) peers.push_back(recv.peer);
    for (const SendSpec& send : sends) peers.push_back(send.peer);
    if (!peers.empty()) JAXFOG_RETURN_IF_ERROR(CheckFailedPeers(scope_, what, peers));
  }
  size_t sent = 0;
  if (with_data) {
    for (const SendSpec& send : sends) sent += TotalBytes(send.pieces);
  }
  traffic::Add(info.op, static_cast<int64_t>(sends.size()), static_cast<int64_t>(sent),
               static_cast<int64_t>(sends.size() * sizeof(Header)));
  // The header buffers outlive the requests using them; on an error path
  // pending headers are abandoned before pending data (destroyed in reverse).
  std::vector<Header> out_headers(sends.size());
  std::vector<Header> in_headers(recvs.size());
  RequestSet data_requests;
  RequestSet header_requests;
  timeline::Span post("post");
  const bool timed = static_cast<bool>(post);      // the one check for the whole exchange
  std::vector<int> data_peers;                     // peer of each data request, when timed
  InsideMpi inside(what, scope_.timeout_seconds);  // a post that never returns
  // Receives first, so that eager sends find them posted.
  for (size_t i = 0; i < recvs.size(); ++i) {
    const int peer = recvs[i].peer;
    inside.Enter("MPI_Irecv of a header", peer);
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Irecv(&in_headers[i], sizeof(Header), MPI_BYTE, peer, kHeaderTag, comm_,
                  header_requests.Add("the header from rank " + std::to_string(peer), peer)),
        what + ": MPI_Irecv of a header from rank " + std::to_string(peer));
  }
  for (size_t i = 0; i < sends.size(); ++i) {
    const int peer = sends[i].peer;
    out_headers[i] = MakeHeader(info, sequence_, TotalBytes(sends[i].pieces));
    inside.Enter("MPI_Isend of a header", peer);
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Isend(&out_headers[i], sizeof(Header), MPI_BYTE, peer, kHeaderTag, comm_,
                  header_requests.Add("the header to rank " + std::to_string(peer), peer)),
        what + ": MPI_Isend of a header to rank " + std::to_string(peer));
  }
  const size_t chunk_bytes =
      streaming ? std::min(streaming->chunk_bytes, max_message_bytes_) : max_message_bytes_;
  // The data requests of receive i are [recv_first[i], recv_first[i + 1]).
  std::vector<size_t> recv_first;
  auto post_data = [&](const auto& pieces, int peer, bool send) -> ffi::Error {
    for (const auto& chunk : Chunks(Runs(pieces), chunk_bytes)) {
      if (timed) data_peers.push_back(peer);
      MPI_Request* request = data_requests.Add(
          (send ? "the send to rank " : "data from rank ") + std::to_string(peer), peer);
      inside.Enter(send ? "MPI_Isend of data" : "MPI_Irecv of data", peer);
      JAXFOG_RETURN_IF_MPI_ERROR(
          PostChunk(chunk, send, peer, comm_, request),
          what + (send ? ": MPI_Isend to rank " : ": MPI_Irecv from rank ") + std::to_string(peer));
    }
    return ffi::Error::Success();
  };
  for (const RecvSpec& recv : recvs) {
    recv_first.push_back(data_requests.size());
    if (with_data) JAXFOG_RETURN_IF_ERROR(post_data(recv.pieces, recv.peer, false));
  }
  recv_first.push_back(data_requests.size());
  for (const SendSpec& send : sends) {
    if (with_data) JAXFOG_RETURN_IF_ERROR(post_data(send.pieces, send.peer, true));
  }
  inside.Leave();
  const int64_t posted = post.End();  // the waits start here
  std::vector<int64_t> header_done, data_done;
  // Headers first: a peer in another op, or with another shape, is named
  // before any data of the wrong size is waited for.
  JAXFOG_RETURN_IF_ERROR(header_requests.WaitAll(scope_, what, timed ? &header_done : nullptr));
  JAXFOG_RETURN_IF_ERROR(CheckReceived(info, sequence_, rank_, recvs, in_headers, what));
  JAXFOG_RETURN_IF_ERROR(data_requests.WaitAll(
      scope_, what, timed ? &data_done : nullptr,
      streaming ? StreamArrivals(*streaming, recv_first, chunk_bytes) : RequestSet::Finished()));
  if (streaming) JAXFOG_RETURN_IF_ERROR(streaming->arrived(Streaming::kAll));
  if (with_data && send_receipts.load()) {
    JAXFOG_RETURN_IF_ERROR(ExchangeReceipts(sends, recvs, what));
  }
  if (!timed) return ffi::Error::Success();
  // One "wait <peer>" span per peer: from the end of posting until the last
  // message to or from it (header or data) completed.
  std::vector<std::pair<int, int64_t>> peer_done;  // in recv, then send order
  auto done = [&](int peer, int64_t at) {
    for (auto& [p, t] : peer_done) {
      if (p == peer) {
        t = std::max(t, at);
        return;
      }
    }
    peer_done.emplace_back(peer, at);
  };
  for (size_t i = 0; i < recvs.size(); ++i) done(recvs[i].peer, header_done[i]);
  for (size_t i = 0; i < sends.size(); ++i) done(sends[i].peer, header_done[recvs.size() + i]);
  for (size_t i = 0; i < data_peers.size(); ++i) done(data_peers[i], data_done[i]);
  for (const auto& [peer, at] : peer_done) timeline::Record("wait", peer, posted, at);
  return ffi::Error::Success();
}

void SetSendReceipts(bool on) { send_receipts.store(on); }

// Every peer this rank received from gets an empty message, and one is
// awaited from every peer it sent to. Posted only once this rank's own data
// has all arrived, so no rank waits in a cycle: a send's receipt comes when
// its receiver's data is in, which depends on data alone.
ffi::Error MpiTransport::ExchangeReceipts(const std::vector<SendSpec>& sends,
                                          const std::vector<RecvSpec>& recvs,
                                          const std::string& what) {
  timeline::Span span("receipts");
  RequestSet receipts;
  for (const SendSpec& send : sends) {
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Irecv(nullptr, 0, MPI_BYTE, send.peer, kReceiptTag, comm_,
                  receipts.Add("the receipt from rank " + std::to_string(send.peer), send.peer)),
        what + ": MPI_Irecv of a receipt from rank " + std::to_string(send.peer));
  }
  for (const RecvSpec& recv : recvs) {
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Isend(nullptr, 0, MPI_BYTE, recv.peer, kReceiptTag, comm_,
                  receipts.Add("the receipt to rank " + std::to_string(recv.peer), recv.peer)),
        what + ": MPI_Isend of a receipt to rank " + std::to_string(recv.peer));
  }
  return receipts.WaitAll(scope_, what);
}

ffi::Error MpiTransport::Allreduce(const OpInfo& info, const void* in, void* out, size_t count,
                                   ffi::DataType type) {
  Begin(info.op);
  const std::string what = Describe(info);
  const MPI_Datatype mpi_type = MpiType(type);
  if (mpi_type == MPI_DATATYPE_NULL) {
    return ffi::Error::InvalidArgument(what + ": unsupported dtype " + DTypeName(type));
  }
  const size_t width = ffi::ByteWidth(type);
  JAXFOG_RETURN_IF_ERROR(CheckFailedPeers(scope_, what));
  JAXFOG_RETURN_IF_ERROR(Agree(comm_, rank_, size_, scope_, info, sequence_, count * width, what));
  // What a bandwidth-optimal (ring) allreduce sends per rank.
  traffic::Add(info.op, 2 * (size_ - 1),
               static_cast<int64_t>(2 * (size_ - 1) * count * width / std::max(size_, 1)));
  MPI_Op op = type == ffi::DataType::F16    ? half_sum_
              : type == ffi::DataType::BF16 ? bfloat16_sum_
                                            : MPI_SUM;
  timeline::Span span("MPI_Iallreduce");
  const size_t per_call = std::max<size_t>(1, max_message_bytes_ / width);
  RequestSet requests("the other ranks");
  for (size_t start = 0; start < count; start += per_call) {
    const size_t n = std::min(per_call, count - start);
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Iallreduce(static_cast<const char*>(in) + start * width,
                       static_cast<char*>(out) + start * width, static_cast<int>(n), mpi_type, op,
                       comm_, requests.Add()),
        what + ": MPI_Iallreduce");
  }
  return requests.WaitAll(scope_, what);
}

ffi::Error MpiTransport::Broadcast(const OpInfo& info, void* data, size_t bytes, int root,
                                   const std::function<void()>& meanwhile) {
  Begin(info.op);
  const std::string what = Describe(info);
  JAXFOG_RETURN_IF_ERROR(CheckFailedPeers(scope_, what));
  JAXFOG_RETURN_IF_ERROR(Agree(comm_, rank_, size_, scope_, info, sequence_, bytes, what));
  const int64_t peers = rank_ == root ? size_ - 1 : 0;  // the root sends to every other rank
  traffic::Add(info.op, peers, peers * static_cast<int64_t>(bytes));
  timeline::Span span("MPI_Ibcast");
  RequestSet requests("rank " + std::to_string(root) + " (the root)");
  for (size_t start = 0; start < bytes; start += max_message_bytes_) {
    const size_t n = std::min(max_message_bytes_, bytes - start);
    JAXFOG_RETURN_IF_MPI_ERROR(MPI_Ibcast(static_cast<char*>(data) + start, static_cast<int>(n),
                                          MPI_BYTE, root, comm_, requests.Add()),
                               what + ": MPI_Ibcast");
  }
  if (meanwhile) meanwhile();
  return requests.WaitAll(scope_, what);
}

ffi::Error MpiTransport::Allgather(const OpInfo& info, const void* in, void* out, size_t bytes) {
  Begin(info.op);
  const std::string what = Describe(info);
  JAXFOG_RETURN_IF_ERROR(CheckFailedPeers(scope_, what));
  JAXFOG_RETURN_IF_ERROR(Agree(comm_, rank_, size_, scope_, info, sequence_, bytes, what));
  if (bytes > max_message_bytes_) {
    return ffi::Error::InvalidArgument(what + ": " + std::to_string(bytes) +
                                       " bytes per rank is more than one MPI "
                                       "message can carry here (" +
                                       std::to_string(max_message_bytes_) +
                                       " bytes); gather a pytree of smaller leaves instead");
  }
  // Every rank's block reaches every other rank.
  traffic::Add(info.op, size_ - 1, static_cast<int64_t>(size_ - 1) * static_cast<int64_t>(bytes));
  timeline::Span span("MPI_Iallgather");
  RequestSet requests("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(
      MPI_Iallgather(in, static_cast<int>(bytes), MPI_BYTE, out, static_cast<int>(bytes), MPI_BYTE,
                     comm_, requests.Add()),
      what + ": MPI_Iallgather");
  return requests.WaitAll(scope_, what);
}

}  // namespace jaxfog
