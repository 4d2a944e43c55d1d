#include "mpi_transport.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "dtype.h"
#include "status.h"
#include "timeline.h"

namespace jaxfog {

namespace {

constexpr int kHeaderTag = 1;
constexpr int kDataTag = 2;
constexpr uint64_t kMagic = 0x6a6178666f67ull;  // "jaxfog"

struct Header {
  uint64_t magic;
  uint64_t op;
  uint64_t sequence;
  uint64_t signature;
  uint64_t bytes;
};

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
  MPI_Datatype type;
  if (int rc = MPI_Type_create_hindexed(static_cast<int>(runs.size()), lengths.data(),
                                        displacements.data(), MPI_BYTE, &type);
      rc != MPI_SUCCESS) {
    return rc;
  }
  if (int rc = MPI_Type_commit(&type); rc != MPI_SUCCESS) return rc;
  int rc = send ? MPI_Isend(MPI_BOTTOM, 1, type, peer, kDataTag, comm, request)
                : MPI_Irecv(MPI_BOTTOM, 1, type, peer, kDataTag, comm, request);
  MPI_Type_free(&type);  // freed by MPI once the request completes
  return rc;
}

// Turns completed data requests into Streaming::arrived calls: receive i
// (requests [first[i], first[i + 1]), chunks in message order) has its first
// `done * chunk_bytes` bytes once its first `done` chunks completed (MPI
// matches messages between two ranks in order, but may complete them in any).
std::function<ffi::Error(const int*, int)> StreamArrivals(const Streaming& streaming,
                                      const std::vector<size_t>& first, size_t chunk_bytes) {
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

std::string Seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds);
  return text;
}

// Abandons pending requests after an error. Their receive buffers are about
// to be reused, so cancellations are given up to a second to complete (a
// cancelled receive completes at once); what is still pending after that (a
// send that cannot be cancelled) is released to finish on its own.
void Abandon(std::vector<MPI_Request>& requests) {
  for (MPI_Request& request : requests) {
    if (request != MPI_REQUEST_NULL) MPI_Cancel(&request);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                MPI_STATUSES_IGNORE);
  }
  for (MPI_Request& request : requests) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  }
}

MPI_Datatype MpiType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return MPI_FLOAT;
    case ffi::DataType::F64: return MPI_DOUBLE;
    case ffi::DataType::C64: return MPI_C_FLOAT_COMPLEX;
    case ffi::DataType::C128: return MPI_C_DOUBLE_COMPLEX;
    case ffi::DataType::S32: return MPI_INT32_T;
    case ffi::DataType::S64: return MPI_INT64_T;
    case ffi::DataType::F16:
    case ffi::DataType::BF16: return MPI_UINT16_T;
    default: return MPI_DATATYPE_NULL;
  }
}

}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm, double timeout_seconds, size_t max_message_bytes)
    : comm_(comm),
      timeout_seconds_(timeout_seconds),
      max_message_bytes_(std::clamp<size_t>(max_message_bytes, 1, INT_MAX)) {
  // Validity of `comm` was checked by the registry before construction.
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Op_create(&HalfSum, /*commute=*/1, &half_sum_);
  MPI_Op_create(&BFloat16Sum, /*commute=*/1, &bfloat16_sum_);
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  MPI_Op_free(&half_sum_);
  MPI_Op_free(&bfloat16_sum_);
}

std::string MpiTransport::Describe(const OpInfo& info) const {
  return std::string("jaxfog ") + OpName(info.op) + " (op #" + std::to_string(sequence_) +
         " on rank " + std::to_string(rank_) + ")";
}

ffi::Error MpiTransport::Barrier() {
  timeline::Span span("MPI_Ibarrier");
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  if (ffi::Error err = CheckMpi(MPI_Ibarrier(comm_, &requests[0]), "MPI_Ibarrier");
      !err.success()) {
    return err;
  }
  return WaitAll(requests, {"the other ranks"}, "jaxfog barrier on rank " +
                                                    std::to_string(rank_));
}

ffi::Error MpiTransport::WaitAll(std::vector<MPI_Request>& requests,
                                 const std::vector<std::string>& owners,
                                 const std::string& what, std::vector<int64_t>* done_at,
                                 const Finished& on_finished) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // MPI makes progress only while polled, so keep polling; yield the core
  // between polls (ranks may outnumber cores), and only sleep once a wait has
  // lasted long enough that latency no longer matters.
  constexpr double kSleepAfterSeconds = 0.05;
  constexpr auto kPause = std::chrono::microseconds(100);
  // Testsome rather than Testall: it completes (and nulls) each request as it
  // finishes, so we know which finished when, and a timeout names only the
  // requests still pending.
  const int n = static_cast<int>(requests.size());
  int pending = static_cast<int>(
      std::count_if(requests.begin(), requests.end(),
                    [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
  int few[8];  // indices of finished requests; no allocation for the usual few
  std::vector<int> many(requests.size() > 8 ? requests.size() : 0);
  int* finished = many.empty() ? few : many.data();
  if (done_at != nullptr) done_at->assign(requests.size(), timeline::Now());
  for (int polls = 0;; ++polls) {
    if (pending == 0) return ffi::Error::Success();
    int count = 0;
    int code = MPI_Testsome(n, requests.data(), &count, finished, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      Abandon(requests);
      return CheckMpi(code, what);
    }
    if (count == MPI_UNDEFINED) return ffi::Error::Success();  // none left active
    if (count > 0) {
      pending -= count;
      if (done_at != nullptr) {
        const int64_t now = timeline::Now();
        for (int i = 0; i < count; ++i) (*done_at)[finished[i]] = now;
      }
      if (on_finished) {
        if (ffi::Error err = on_finished(finished, count); !err.success()) {
          Abandon(requests);
          return err;
        }
      }
      continue;  // poll again at once: more may have finished
    }
    if (timeout_seconds_ > 0 &&
        std::chrono::duration<double>(Clock::now() - start).count() > timeout_seconds_) {
      std::string waiting;
      for (size_t i = 0; i < requests.size(); ++i) {
        if (requests[i] == MPI_REQUEST_NULL) continue;
        const std::string& owner = owners[std::min(i, owners.size() - 1)];
        if (waiting.find(owner) == std::string::npos) {
          waiting += (waiting.empty() ? "" : ", ") + owner;
        }
      }
      Abandon(requests);
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        what + " timed out after " + Seconds(timeout_seconds_) +
                            " s (JAXFOG_TIMEOUT) waiting for " + waiting +
                            ": a peer died, or ranks called different operations or "
                            "disagree on who sends to whom");
    }
    if ((polls & 63) == 63) {
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited > kSleepAfterSeconds) {
        std::this_thread::sleep_for(kPause);
      } else {
        std::this_thread::yield();
      }
    }
  }
}

ffi::Error MpiTransport::Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                  const std::vector<RecvSpec>& recvs,
                                  const Streaming* streaming) {
  ++sequence_;
  const std::string what = Describe(info);
  std::vector<Header> out_headers(sends.size());
  std::vector<Header> in_headers(recvs.size());
  std::vector<MPI_Request> header_requests;
  std::vector<std::string> header_owners;
  std::vector<MPI_Request> data_requests;
  std::vector<std::string> data_owners;
  auto fail = [&](int code, const std::string& call) {
    Abandon(header_requests);
    Abandon(data_requests);
    return CheckMpi(code, what + ": " + call);
  };
  timeline::Span post("post");
  const bool timed = static_cast<bool>(post);  // the one check for the whole exchange
  std::vector<int> data_peers;                 // peer of each data request, when timed
  // Receives first, so that eager sends find them posted.
  for (size_t i = 0; i < recvs.size(); ++i) {
    header_requests.emplace_back(MPI_REQUEST_NULL);
    header_owners.push_back("the header from rank " + std::to_string(recvs[i].peer));
    if (int rc = MPI_Irecv(&in_headers[i], sizeof(Header), MPI_BYTE, recvs[i].peer,
                           kHeaderTag, comm_, &header_requests.back());
        rc != MPI_SUCCESS) {
      return fail(rc, "MPI_Irecv of a header from rank " + std::to_string(recvs[i].peer));
    }
  }
  for (size_t i = 0; i < sends.size(); ++i) {
    out_headers[i] = {kMagic, static_cast<uint64_t>(info.op), sequence_, info.signature,
                      TotalBytes(sends[i].pieces)};
    header_requests.emplace_back(MPI_REQUEST_NULL);
    header_owners.push_back("the header to rank " + std::to_string(sends[i].peer));
    if (int rc = MPI_Isend(&out_headers[i], sizeof(Header), MPI_BYTE, sends[i].peer,
                           kHeaderTag, comm_, &header_requests.back());
        rc != MPI_SUCCESS) {
      return fail(rc, "MPI_Isend of a header to rank " + std::to_string(sends[i].peer));
    }
  }
  const size_t chunk_bytes =
      streaming ? std::min(streaming->chunk_bytes, max_message_bytes_) : max_message_bytes_;
  // The data requests of receive i are [recv_first[i], recv_first[i + 1]).
  std::vector<size_t> recv_first;
  auto post_data = [&](const auto& pieces, int peer, bool send) -> int {
    for (const auto& chunk : Chunks(Runs(pieces), chunk_bytes)) {
      data_requests.emplace_back(MPI_REQUEST_NULL);
      data_owners.push_back((send ? "the send to rank " : "data from rank ") +
                            std::to_string(peer));
      if (timed) data_peers.push_back(peer);
      if (int rc = PostChunk(chunk, send, peer, comm_, &data_requests.back());
          rc != MPI_SUCCESS) {
        return rc;
      }
    }
    return MPI_SUCCESS;
  };
  for (const RecvSpec& recv : recvs) {
    recv_first.push_back(data_requests.size());
    if (int rc = post_data(recv.pieces, recv.peer, false); rc != MPI_SUCCESS) {
      return fail(rc, "MPI_Irecv from rank " + std::to_string(recv.peer));
    }
  }
  recv_first.push_back(data_requests.size());
  for (const SendSpec& send : sends) {
    if (int rc = post_data(send.pieces, send.peer, true); rc != MPI_SUCCESS) {
      return fail(rc, "MPI_Isend to rank " + std::to_string(send.peer));
    }
  }
  const int64_t posted = post.End();  // the waits start here
  std::vector<int64_t> header_done, data_done;
  // Headers first: a peer in another op, or with another shape, is named
  // before any data of the wrong size is waited for.
  if (ffi::Error err = WaitAll(header_requests, header_owners, what,
                               timed ? &header_done : nullptr);
      !err.success()) {
    Abandon(data_requests);
    return err;
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    const Header& got = in_headers[i];
    const uint64_t expected_bytes = TotalBytes(recvs[i].pieces);
    std::string problem;
    if (got.magic != kMagic) {
      problem = "sent a message that is not from a jaxfog op";
    } else if (got.op != static_cast<uint64_t>(info.op) || got.sequence != sequence_) {
      problem = std::string("is in ") + OpName(static_cast<OpCode>(got.op)) + " (its op #" +
                std::to_string(got.sequence) + "): ranks called different operations, or in "
                "a different order";
    } else if (got.bytes != expected_bytes || got.signature != info.signature) {
      problem = "sent " + std::to_string(got.bytes) + " bytes where " +
                std::to_string(expected_bytes) +
                " were expected: shapes or dtypes differ between ranks";
    }
    if (!problem.empty()) {
      Abandon(data_requests);
      return ffi::Error::InvalidArgument(what + ": rank " + std::to_string(recvs[i].peer) +
                                         " " + problem);
    }
  }
  if (ffi::Error err = WaitAll(data_requests, data_owners, what, timed ? &data_done : nullptr,
                               streaming ? StreamArrivals(*streaming, recv_first, chunk_bytes)
                                         : Finished());
      !err.success()) {
    return err;
  }
  if (streaming) {
    if (ffi::Error err = streaming->arrived(Streaming::kAll); !err.success()) return err;
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

ffi::Error MpiTransport::Agree(const OpInfo& info, uint64_t bytes, const std::string& what) {
  timeline::Span span("agree");
  // One MAX-allreduce of (x, -x) gives every rank both max and min of x.
  constexpr int64_t kMask = INT64_MAX;
  const int64_t mine[4] = {static_cast<int64_t>(info.op), static_cast<int64_t>(sequence_),
                           static_cast<int64_t>(info.signature & kMask),
                           static_cast<int64_t>(bytes)};
  int64_t send[8], recv[8];
  for (int i = 0; i < 4; ++i) {
    send[i] = mine[i];
    send[i + 4] = -mine[i];
  }
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  if (int rc = MPI_Iallreduce(send, recv, 8, MPI_INT64_T, MPI_MAX, comm_, &requests[0]);
      rc != MPI_SUCCESS) {
    return CheckMpi(rc, what + ": MPI_Iallreduce");
  }
  if (ffi::Error err = WaitAll(requests, {"the other ranks"}, what); !err.success()) {
    return err;
  }
  auto differs = [&](int i) { return recv[i] != -recv[i + 4]; };
  if (differs(0) || differs(1)) {
    return ffi::Error::InvalidArgument(
        what + ": ranks called different operations, or in a different order");
  }
  if (differs(2) || differs(3)) {
    return ffi::Error::InvalidArgument(
        what + ": shapes or dtypes differ between ranks (this rank has " +
        std::to_string(bytes) + " bytes; the ranks have between " + std::to_string(-recv[7]) +
        " and " + std::to_string(recv[3]) + ")");
  }
  return ffi::Error::Success();
}

ffi::Error MpiTransport::Allreduce(const OpInfo& info, const void* in, void* out,
                                   size_t count, ffi::DataType type) {
  ++sequence_;
  const std::string what = Describe(info);
  const MPI_Datatype mpi_type = MpiType(type);
  if (mpi_type == MPI_DATATYPE_NULL) {
    return ffi::Error::InvalidArgument(what + ": unsupported dtype " + DTypeName(type));
  }
  const size_t width = ffi::ByteWidth(type);
  if (ffi::Error err = Agree(info, count * width, what); !err.success()) return err;
  MPI_Op op = type == ffi::DataType::F16    ? half_sum_
              : type == ffi::DataType::BF16 ? bfloat16_sum_
                                            : MPI_SUM;
  timeline::Span span("MPI_Iallreduce");
  const size_t per_call = std::max<size_t>(1, max_message_bytes_ / width);
  std::vector<MPI_Request> requests;
  for (size_t start = 0; start < count; start += per_call) {
    const size_t n = std::min(per_call, count - start);
    requests.emplace_back(MPI_REQUEST_NULL);
    if (int rc = MPI_Iallreduce(static_cast<const char*>(in) + start * width,
                                static_cast<char*>(out) + start * width, static_cast<int>(n),
                                mpi_type, op, comm_, &requests.back());
        rc != MPI_SUCCESS) {
      Abandon(requests);
      return CheckMpi(rc, what + ": MPI_Iallreduce");
    }
  }
  return WaitAll(requests, {"the other ranks"}, what);
}

ffi::Error MpiTransport::Broadcast(const OpInfo& info, void* data, size_t bytes, int root) {
  ++sequence_;
  const std::string what = Describe(info);
  if (ffi::Error err = Agree(info, bytes, what); !err.success()) return err;
  timeline::Span span("MPI_Ibcast");
  std::vector<MPI_Request> requests;
  for (size_t start = 0; start < bytes; start += max_message_bytes_) {
    const size_t n = std::min(max_message_bytes_, bytes - start);
    requests.emplace_back(MPI_REQUEST_NULL);
    if (int rc = MPI_Ibcast(static_cast<char*>(data) + start, static_cast<int>(n), MPI_BYTE,
                            root, comm_, &requests.back());
        rc != MPI_SUCCESS) {
      Abandon(requests);
      return CheckMpi(rc, what + ": MPI_Ibcast");
    }
  }
  return WaitAll(requests, {"rank " + std::to_string(root) + " (the root)"}, what);
}

ffi::Error MpiTransport::Allgather(const OpInfo& info, const void* in, void* out,
                                   size_t bytes) {
  ++sequence_;
  const std::string what = Describe(info);
  if (ffi::Error err = Agree(info, bytes, what); !err.success()) return err;
  if (bytes > max_message_bytes_) {
    return ffi::Error::InvalidArgument(
        what + ": " + std::to_string(bytes) + " bytes per rank is more than one MPI "
        "message can carry here (" + std::to_string(max_message_bytes_) +
        " bytes); gather a pytree of smaller leaves instead");
  }
  timeline::Span span("MPI_Iallgather");
  std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
  if (int rc = MPI_Iallgather(in, static_cast<int>(bytes), MPI_BYTE, out,
                              static_cast<int>(bytes), MPI_BYTE, comm_, &requests[0]);
      rc != MPI_SUCCESS) {
    return CheckMpi(rc, what + ": MPI_Iallgather");
  }
  return WaitAll(requests, {"the other ranks"}, what);
}

}  // namespace jaxfog
