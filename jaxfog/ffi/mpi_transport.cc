#include "mpi_transport.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtype.h"
#include "mpi_status.h"
#include "timeline.h"
#include "traffic.h"

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
  LayoutText layout;  // read only when the signatures or sizes differ
};
// Every message pays for it (comm_stats counts it as header_bytes).
static_assert(sizeof(Header) == 128, "keep message headers small");

bool SameLayout(const Header& a, const Header& b) {
  return a.signature == b.signature && a.bytes == b.bytes;
}

// "rank 2", "ranks 0 and 2", "ranks 0, 2 and 3"; without `noun`, the numbers.
std::string RankList(const std::vector<int>& ranks, bool noun = true) {
  std::string text = !noun ? "" : ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += i + 1 == ranks.size() ? " and " : ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

// `ranks` in words, this rank (`self`) first: "this rank (1) and ranks 0 and 2".
std::string Who(const std::vector<int>& ranks, int self, bool with_number) {
  std::vector<int> others;
  for (int r : ranks) {
    if (r != self) others.push_back(r);
  }
  if (others.size() == ranks.size()) return RankList(others);
  std::string text = "this rank";
  if (with_number) text += " (" + std::to_string(self) + ")";
  return others.empty() ? text : text + " and " + RankList(others);
}

// Why the layouts in `seen` (rank, header; this rank, `self`, among them)
// differ: the ranks outside the strict majority layout when there is one,
// then each layout with its ranks, the odd ones first. `neighbours`: `seen`
// is this rank's neighbours, not every rank.
std::string LayoutMismatch(int self, std::vector<std::pair<int, Header>> seen,
                           bool neighbours) {
  std::sort(seen.begin(), seen.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  struct Group {
    const Header* header;
    std::vector<int> ranks;
    bool has_self;
  };
  std::vector<Group> groups;  // in order of their lowest rank: deterministic
  for (const auto& [rank, header] : seen) {
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const Group& g) { return SameLayout(*g.header, header); });
    if (group == groups.end()) {
      groups.push_back({&header, {}, false});
      group = groups.end() - 1;
    }
    group->ranks.push_back(rank);
    group->has_self |= rank == self;
  }
  const Group* majority = nullptr;  // none on a tie: nobody to blame
  for (const Group& g : groups) {
    if (!majority || g.ranks.size() > majority->ranks.size()) {
      majority = &g;
    } else if (g.ranks.size() == majority->ranks.size()) {
      majority = nullptr;
      break;
    }
  }
  std::string text = "shapes or dtypes differ between ranks: ";
  std::vector<const Group*> order;
  for (bool first : {true, false}) {  // this rank's layout first, unless it is the majority's
    for (const Group& g : groups) {
      if (&g != majority && g.has_self == first) order.push_back(&g);
    }
  }
  if (majority) {
    std::vector<int> odd;
    for (const Group* g : order) odd.insert(odd.end(), g->ranks.begin(), g->ranks.end());
    std::sort(odd.begin(), odd.end());
    if (odd == std::vector<int>{self}) {
      text += "this rank differs from " +
              (neighbours ? "its neighbours " + RankList(majority->ranks, false)
                          : RankList(majority->ranks));
    } else {
      text += Who(odd, self, false) + (odd.size() == 1 ? " differs" : " differ") + " from " +
              Who(majority->ranks, self, false);
    }
    text += ": ";
    order.push_back(majority);
  }
  bool alike = false;  // a long layout cut where two differ only further on
  for (size_t i = 0; i < order.size(); ++i) {
    const std::string layout = order[i]->header->layout.str();
    for (size_t j = 0; j < i; ++j) alike |= order[j]->header->layout.str() == layout;
    text += (i ? "; " : "") + Who(order[i]->ranks, self, true) +
            (order[i]->ranks.size() == 1 ? " has " : " have ") + layout;
  }
  if (alike) text += " (they differ in leaves past those shown)";
  return text;
}

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

// The rank of an owner whose requests wait for every other rank of the
// communicator (a collective).
constexpr int kEveryone = -1;

// MPI requests, owned until they complete. Owners say what the requests are
// for, so that a timeout says which peers never answered and a long wait
// knows which ranks it waits for: request i is for owners[min(i, last)]
// (requests that all wait for the same ranks name them once).
//
// Destroying a set with requests still pending (an error path) abandons
// them. Their receive buffers are about to be reused, so cancellations are
// given up to a second to complete (a cancelled receive completes at once);
// what is still pending after that (a send that cannot be cancelled) is
// released to finish on its own. Declare a set after the buffers it uses.
class RequestSet {
 public:
  using Finished = std::function<ffi::Error(const int* indices, int count)>;
  struct Owner {
    std::string text;
    int rank;  // in the communicator, or kEveryone
  };

  RequestSet() = default;
  explicit RequestSet(std::string owner, int rank = kEveryone) {
    owners_.push_back({std::move(owner), rank});
  }
  RequestSet(const RequestSet&) = delete;
  RequestSet& operator=(const RequestSet&) = delete;
  ~RequestSet();

  // A null request to post into, for the last owner given.
  MPI_Request* Add() { return &requests_.emplace_back(MPI_REQUEST_NULL); }
  MPI_Request* Add(std::string owner, int rank) {
    owners_.push_back({std::move(owner), rank});
    return Add();
  }
  size_t size() const { return requests_.size(); }

  // Completes every request (each becomes MPI_REQUEST_NULL), or fails once
  // `scope.timeout_seconds` (> 0) have passed, or soon after a rank that a
  // pending request waits for has left (with `scope.watch`). With
  // `done_at`, it also records when each request completed (timeline::Now();
  // for the timeline). `finished(indices, count)`, when given, runs as
  // requests complete.
  ffi::Error WaitAll(const WaitScope& scope, const std::string& what,
                     std::vector<int64_t>* done_at = nullptr,
                     const Finished& finished = nullptr);

 private:
  using Clock = std::chrono::steady_clock;
  // The owners of the requests still pending, in words ("rank 1, the header
  // to rank 2").
  std::string Waiting() const;
  // The first rank a pending request waits for that has left, after a
  // moment's grace for its last messages, as an error; success otherwise.
  ffi::Error CheckDepartures(const WaitScope& scope, const std::string& what,
                             Clock::time_point start) const;

  std::vector<MPI_Request> requests_;
  std::vector<Owner> owners_;
};

// MPI results are ignored here: a destructor has no one to tell, and the
// error that brought us here is already on its way.
RequestSet::~RequestSet() {
  if (std::all_of(requests_.begin(), requests_.end(),
                  [](MPI_Request r) { return r == MPI_REQUEST_NULL; })) {
    return;  // completed (or never posted)
  }
  for (MPI_Request& request : requests_) {
    if (request != MPI_REQUEST_NULL) MPI_Cancel(&request);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                MPI_STATUSES_IGNORE);
  }
  for (MPI_Request& request : requests_) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  }
}

std::string RequestSet::Waiting() const {
  std::string waiting;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    const std::string& owner = owners_[std::min(i, owners_.size() - 1)].text;
    if (waiting.find(owner) == std::string::npos) {
      waiting += (waiting.empty() ? "" : ", ") + owner;
    }
  }
  return waiting;
}

// Why `comm_rank` (world rank `world_rank`) left, as the sentence an error
// shows: who, why, after which op on this communicator, and what it means
// for this op (number `sequence`).
std::string Departed(const WaitScope& scope, int comm_rank, int world_rank,
                     const PeerWatch::Departure& departure, uint64_t sequence) {
  std::string text = "rank " + std::to_string(comm_rank);
  if (world_rank != comm_rank) text += " (world rank " + std::to_string(world_rank) + ")";
  text += departure.reason == PeerWatch::Reason::kShutdown
              ? " has left: it called jaxfog.shutdown()"
              : " has left: its program ended (jaxfog.shutdown at exit)";
  const PeerWatch::LastOp* last = nullptr;
  for (const PeerWatch::LastOp& op : departure.last) {
    if (op.comm_id == scope.comm_id) last = &op;
  }
  if (last == nullptr) return text + ", and this op waits for it";
  text += last->sequence == 0
              ? " before any op on this communicator"
              : " after its op #" + std::to_string(last->sequence) + " (" + OpName(last->op) +
                    ") on this communicator";
  text += ", and this op waits for it";
  if (last->sequence < sequence) {
    text += ". It never called this op: an op called on some ranks only (under `if rank "
            "== ...`?), or an error on that rank before it";
  }
  return text;
}

ffi::Error RequestSet::CheckDepartures(const WaitScope& scope, const std::string& what,
                                       Clock::time_point start) const {
  // A rank that left had completed its sends, but they may still be on the
  // way (MPI orders no messages across communicators): fail only once they
  // had this long to arrive since the goodbye came, or since this wait began.
  constexpr auto kGrace = std::chrono::seconds(1);
  JAXFOG_RETURN_IF_ERROR(scope.watch->Poll());
  const Clock::time_point now = Clock::now();
  auto check = [&](int comm_rank) -> ffi::Error {
    if (comm_rank == scope.rank || comm_rank < 0 ||
        static_cast<size_t>(comm_rank) >= scope.world_ranks.size()) {
      return ffi::Error::Success();
    }
    const int world_rank = scope.world_ranks[comm_rank];
    std::optional<PeerWatch::Departure> gone = scope.watch->Gone(world_rank);
    if (!gone || now - std::max(gone->seen, start) < kGrace) return ffi::Error::Success();
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      what + ": " + Departed(scope, comm_rank, world_rank, *gone,
                                             scope.sequence ? *scope.sequence : 0) +
                          " (still waiting for " + Waiting() + ")");
  };
  bool everyone = false;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    const int rank = owners_[std::min(i, owners_.size() - 1)].rank;
    if (rank == kEveryone) {
      everyone = true;
    } else {
      JAXFOG_RETURN_IF_ERROR(check(rank));
    }
  }
  if (everyone) {
    for (int rank = 0; rank < static_cast<int>(scope.world_ranks.size()); ++rank) {
      JAXFOG_RETURN_IF_ERROR(check(rank));
    }
  }
  return ffi::Error::Success();
}

ffi::Error RequestSet::WaitAll(const WaitScope& scope, const std::string& what,
                               std::vector<int64_t>* done_at, const Finished& on_finished) {
  const auto start = Clock::now();
  // MPI makes progress only while polled, so keep polling; yield the core
  // between polls (ranks may outnumber cores), and only sleep once a wait has
  // lasted long enough that latency no longer matters.
  constexpr double kSleepAfterSeconds = 0.05;
  constexpr auto kPause = std::chrono::microseconds(100);
  // A wait this long is no longer the common quick one: from then on it
  // checks now and then whether a rank it waits for has left, and says what
  // it waits for once JAXFOG_WARN_AFTER has passed.
  constexpr double kWatchAfterSeconds = 0.25;
  constexpr auto kWatchEvery = std::chrono::milliseconds(100);
  Clock::time_point next_check = start;
  bool warned = false;
  const double timeout_seconds = scope.timeout_seconds;
  // Testsome rather than Testall: it completes (and nulls) each request as it
  // finishes, so we know which finished when, and a timeout names only the
  // requests still pending.
  const int n = static_cast<int>(requests_.size());
  int pending = static_cast<int>(
      std::count_if(requests_.begin(), requests_.end(),
                    [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
  int few[8];  // indices of finished requests; no allocation for the usual few
  std::vector<int> many(requests_.size() > 8 ? requests_.size() : 0);
  int* finished = many.empty() ? few : many.data();
  if (done_at != nullptr) done_at->assign(requests_.size(), timeline::Now());
  for (int polls = 0;; ++polls) {
    if (pending == 0) return ffi::Error::Success();
    int count = 0;
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Testsome(n, requests_.data(), &count, finished, MPI_STATUSES_IGNORE), what);
    if (count == MPI_UNDEFINED) return ffi::Error::Success();  // none left active
    if (count > 0) {
      pending -= count;
      if (done_at != nullptr) {
        const int64_t now = timeline::Now();
        for (int i = 0; i < count; ++i) (*done_at)[finished[i]] = now;
      }
      if (on_finished) JAXFOG_RETURN_IF_ERROR(on_finished(finished, count));
      continue;  // poll again at once: more may have finished
    }
    if ((polls & 63) != 63) continue;  // the clock and the rest, now and then
    const Clock::time_point now = Clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    if (timeout_seconds > 0 && waited > timeout_seconds) {
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        what + " timed out after " + Seconds(timeout_seconds) +
                            " s (JAXFOG_TIMEOUT) waiting for " + Waiting() +
                            ": a peer died, or ranks called different operations or "
                            "disagree on who sends to whom");
    }
    if (scope.watch != nullptr && waited > kWatchAfterSeconds && now >= next_check) {
      next_check = now + kWatchEvery;
      JAXFOG_RETURN_IF_ERROR(CheckDepartures(scope, what, start));
      const double warn_after = scope.watch->warn_after_seconds();
      if (!warned && warn_after > 0 && waited > warn_after) {
        warned = true;  // once per wait: a stuck rank says where it is stuck
        std::string rank = scope.world_ranks.empty() ||
                                   scope.world_ranks[scope.rank] == scope.rank
                               ? ""
                               : " (world rank " + std::to_string(scope.world_ranks[scope.rank]) +
                                     ")";
        const std::string line =
            what + rank + " is still waiting after " + Seconds(warn_after) +
            " s (JAXFOG_WARN_AFTER) for " + Waiting() + "; it fails " +
            (timeout_seconds > 0 ? "after " + Seconds(timeout_seconds) + " s" : "never") +
            " (JAXFOG_TIMEOUT) unless they come\n";
        std::fputs(line.c_str(), stderr);  // one write: ranks' lines stay whole
        std::fflush(stderr);
      }
    }
    if (waited > kSleepAfterSeconds) {
      std::this_thread::sleep_for(kPause);
    } else {
      std::this_thread::yield();
    }
  }
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

ffi::ErrorOr<std::unique_ptr<MpiTransport>> MpiTransport::Create(
    MPI_Comm comm, double timeout_seconds, size_t max_message_bytes,
    std::shared_ptr<PeerWatch> watch, int64_t comm_id) {
  std::unique_ptr<MpiTransport> transport(new MpiTransport(
      comm, timeout_seconds, max_message_bytes, std::move(watch), comm_id));
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
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Op_create(&HalfSum, /*commute=*/1, &half_sum_),
                             "MPI_Op_create");
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
  RequestSet requests("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Ibarrier(comm_, requests.Add()), "MPI_Ibarrier");
  return requests.WaitAll(scope_, "jaxfog barrier on rank " + std::to_string(rank_));
}

ffi::Error MpiTransport::Exchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                  const std::vector<RecvSpec>& recvs,
                                  const Streaming* streaming) {
  return Messages(info, sends, recvs, streaming, /*with_data=*/true);
}

ffi::Error MpiTransport::CheckExchange(const OpInfo& info, const std::vector<SendSpec>& sends,
                                       const std::vector<RecvSpec>& recvs) {
  return Messages(info, sends, recvs, /*streaming=*/nullptr, /*with_data=*/false);
}

ffi::Error MpiTransport::CheckCollective(const OpInfo& info, uint64_t bytes) {
  Begin(info.op);
  return Agree(info, bytes, Describe(info));
}

ffi::Error MpiTransport::Messages(const OpInfo& info, const std::vector<SendSpec>& sends,
                                  const std::vector<RecvSpec>& recvs,
                                  const Streaming* streaming, bool with_data) {
  Begin(info.op);
  const std::string what = Describe(info);
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
  const bool timed = static_cast<bool>(post);  // the one check for the whole exchange
  std::vector<int> data_peers;                 // peer of each data request, when timed
  // Receives first, so that eager sends find them posted.
  for (size_t i = 0; i < recvs.size(); ++i) {
    const int peer = recvs[i].peer;
    JAXFOG_RETURN_IF_MPI_ERROR(
        MPI_Irecv(&in_headers[i], sizeof(Header), MPI_BYTE, peer, kHeaderTag, comm_,
                  header_requests.Add("the header from rank " + std::to_string(peer), peer)),
        what + ": MPI_Irecv of a header from rank " + std::to_string(peer));
  }
  for (size_t i = 0; i < sends.size(); ++i) {
    const int peer = sends[i].peer;
    out_headers[i] = {kMagic, static_cast<uint64_t>(info.op), sequence_, info.signature,
                      TotalBytes(sends[i].pieces), info.layout};
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
      JAXFOG_RETURN_IF_MPI_ERROR(PostChunk(chunk, send, peer, comm_, request),
                                 what + (send ? ": MPI_Isend to rank " : ": MPI_Irecv from rank ") +
                                     std::to_string(peer));
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
  const int64_t posted = post.End();  // the waits start here
  std::vector<int64_t> header_done, data_done;
  // Headers first: a peer in another op, or with another shape, is named
  // before any data of the wrong size is waited for.
  JAXFOG_RETURN_IF_ERROR(
      header_requests.WaitAll(scope_, what, timed ? &header_done : nullptr));
  bool layouts_differ = false;
  for (size_t i = 0; i < recvs.size(); ++i) {
    const Header& got = in_headers[i];
    std::string problem;
    if (got.magic != kMagic) {
      problem = "sent a message that is not from a jaxfog op";
    } else if (got.op != static_cast<uint64_t>(info.op) || got.sequence != sequence_) {
      problem = std::string("is in ") + OpName(static_cast<OpCode>(got.op)) + " (its op #" +
                std::to_string(got.sequence) + "): ranks called different operations, or in "
                "a different order";
    }
    if (!problem.empty()) {
      return ffi::Error::InvalidArgument(what + ": rank " + std::to_string(recvs[i].peer) +
                                         " " + problem);
    }
    layouts_differ |= got.bytes != TotalBytes(recvs[i].pieces) || got.signature != info.signature;
  }
  if (layouts_differ) {
    // Every header this rank receives is in: judge by all of them, so that
    // the rank that differs from the others is the one named.
    std::vector<std::pair<int, Header>> seen;
    seen.emplace_back(rank_, Header{kMagic, static_cast<uint64_t>(info.op), sequence_,
                                    info.signature, TotalBytes(recvs[0].pieces), info.layout});
    for (size_t i = 0; i < recvs.size(); ++i) seen.emplace_back(recvs[i].peer, in_headers[i]);
    return ffi::Error::InvalidArgument(what + ": " + LayoutMismatch(rank_, std::move(seen),
                                                                    /*neighbours=*/true));
  }
  JAXFOG_RETURN_IF_ERROR(data_requests.WaitAll(
      scope_, what, timed ? &data_done : nullptr,
      streaming ? StreamArrivals(*streaming, recv_first, chunk_bytes) : RequestSet::Finished()));
  if (streaming) JAXFOG_RETURN_IF_ERROR(streaming->arrived(Streaming::kAll));
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
  RequestSet requests("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(
      MPI_Iallreduce(send, recv, 8, MPI_INT64_T, MPI_MAX, comm_, requests.Add()),
      what + ": MPI_Iallreduce");
  JAXFOG_RETURN_IF_ERROR(requests.WaitAll(scope_, what));
  auto differs = [&](int i) { return recv[i] != -recv[i + 4]; };
  if (differs(0) || differs(1)) {
    return ffi::Error::InvalidArgument(
        what + ": ranks called different operations, or in a different order");
  }
  if (!differs(2) && !differs(3)) return ffi::Error::Success();
  // Every rank saw the same extremes, so all take this path together (no
  // hang): one allgather of the headers, only here, names who differs.
  const Header header{kMagic, static_cast<uint64_t>(info.op), sequence_, info.signature, bytes,
                      info.layout};
  std::vector<Header> headers(size_);
  RequestSet gather("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Iallgather(&header, sizeof(Header), MPI_BYTE, headers.data(),
                                            sizeof(Header), MPI_BYTE, comm_, gather.Add()),
                             what + ": MPI_Iallgather of the layouts");
  JAXFOG_RETURN_IF_ERROR(gather.WaitAll(scope_, what));
  std::vector<std::pair<int, Header>> seen;
  for (int r = 0; r < size_; ++r) seen.emplace_back(r, headers[r]);
  return ffi::Error::InvalidArgument(what + ": " + LayoutMismatch(rank_, std::move(seen),
                                                                  /*neighbours=*/false));
}

ffi::Error MpiTransport::Allreduce(const OpInfo& info, const void* in, void* out,
                                   size_t count, ffi::DataType type) {
  Begin(info.op);
  const std::string what = Describe(info);
  const MPI_Datatype mpi_type = MpiType(type);
  if (mpi_type == MPI_DATATYPE_NULL) {
    return ffi::Error::InvalidArgument(what + ": unsupported dtype " + DTypeName(type));
  }
  const size_t width = ffi::ByteWidth(type);
  JAXFOG_RETURN_IF_ERROR(Agree(info, count * width, what));
  // What a bandwidth-optimal (ring) allreduce sends per rank.
  traffic::Add(info.op, 2 * (size_ - 1), static_cast<int64_t>(2 * (size_ - 1) * count * width /
                                                              std::max(size_, 1)));
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
                       static_cast<char*>(out) + start * width, static_cast<int>(n), mpi_type,
                       op, comm_, requests.Add()),
        what + ": MPI_Iallreduce");
  }
  return requests.WaitAll(scope_, what);
}

ffi::Error MpiTransport::Broadcast(const OpInfo& info, void* data, size_t bytes, int root) {
  Begin(info.op);
  const std::string what = Describe(info);
  JAXFOG_RETURN_IF_ERROR(Agree(info, bytes, what));
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
  return requests.WaitAll(scope_, what);
}

ffi::Error MpiTransport::Allgather(const OpInfo& info, const void* in, void* out,
                                   size_t bytes) {
  Begin(info.op);
  const std::string what = Describe(info);
  JAXFOG_RETURN_IF_ERROR(Agree(info, bytes, what));
  if (bytes > max_message_bytes_) {
    return ffi::Error::InvalidArgument(
        what + ": " + std::to_string(bytes) + " bytes per rank is more than one MPI "
        "message can carry here (" + std::to_string(max_message_bytes_) +
        " bytes); gather a pytree of smaller leaves instead");
  }
  // Every rank's block reaches every other rank.
  traffic::Add(info.op, size_ - 1, static_cast<int64_t>(size_ - 1) * static_cast<int64_t>(bytes));
  timeline::Span span("MPI_Iallgather");
  RequestSet requests("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Iallgather(in, static_cast<int>(bytes), MPI_BYTE, out,
                                            static_cast<int>(bytes), MPI_BYTE, comm_,
                                            requests.Add()),
                             what + ": MPI_Iallgather");
  return requests.WaitAll(scope_, what);
}

}  // namespace jaxfog
