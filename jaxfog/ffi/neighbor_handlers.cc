// The neighbour ops' handlers (see handler.h): neighbor_allreduce (a weighted
// average over a communication plan, large messages summed piece by piece as
// they arrive), neighbor_allgather and its transpose, neighbor_reduce_scatter.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "handler.h"
#include "kernels.h"
#include "plan_table.h"

namespace jaxfog {
namespace {

std::vector<Piece> PiecesAt(char* base, const std::vector<Leaf>& leaves,
                            const std::vector<size_t>& offsets) {
  std::vector<Piece> pieces;
  for (size_t i = 0; i < leaves.size(); ++i) pieces.push_back({base + offsets[i], leaves[i].bytes});
  return pieces;
}

std::vector<ConstPiece> ConstPiecesAt(const char* base, const std::vector<Leaf>& leaves,
                                      const std::vector<size_t>& offsets) {
  std::vector<ConstPiece> pieces;
  for (size_t i = 0; i < leaves.size(); ++i) pieces.push_back({base + offsets[i], leaves[i].bytes});
  return pieces;
}

// One entry of a (possibly periodic) communication plan, chosen by `step`.
struct Entry {
  double self_weight;
  std::vector<int> send_ranks;
  std::vector<double> send_weights;
  std::vector<int> recv_ranks;
  std::vector<double> recv_weights;
};

ffi::ErrorOr<Entry> SelectEntry(int64_t step, const PlanTables& plan, int size) {
  const int64_t period = static_cast<int64_t>(plan.self_weights.size());  // >= 1: DefinePlan
  const int64_t t = ((step % period) + period) % period;
  Entry entry{plan.self_weights[t], {}, {}, {}, {}};
  auto out_of_range = [size](const char* kind, int64_t rank) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        std::string("jaxfog: the communication plan ") + kind + " rank " + std::to_string(rank) +
        ", out of range for " + std::to_string(size) + " ranks"));
  };
  for (int64_t i = plan.send_offsets[t]; i < plan.send_offsets[t + 1]; ++i) {
    if (plan.send_ranks[i] < 0 || plan.send_ranks[i] >= size) {
      return out_of_range("sends to", plan.send_ranks[i]);
    }
    entry.send_ranks.push_back(static_cast<int>(plan.send_ranks[i]));
    entry.send_weights.push_back(plan.send_weights[i]);
  }
  for (int64_t i = plan.recv_offsets[t]; i < plan.recv_offsets[t + 1]; ++i) {
    if (plan.recv_ranks[i] < 0 || plan.recv_ranks[i] >= size) {
      return out_of_range("receives from", plan.recv_ranks[i]);
    }
    entry.recv_ranks.push_back(static_cast<int>(plan.recv_ranks[i]));
    entry.recv_weights.push_back(plan.recv_weights[i]);
  }
  return entry;
}

// Messages of at least this size are summed piece by piece as they arrive.
constexpr size_t kStreamMinBytes = size_t{4} << 20;
constexpr size_t kStreamChunkBytes = size_t{1} << 20;

// The weighted sum of neighbor averaging over a growing prefix of the
// message: a message is its leaves' bytes back to back; leaf l lies in the
// receive buffers at `offsets[l]` (stride apart per peer).
class PartialSums {
 public:
  PartialSums(const std::vector<Leaf>& in, const std::vector<Leaf>& out,
              const std::vector<size_t>& offsets, const char* received, size_t stride,
              const Entry& entry)
      : in_(in),
        out_(out),
        offsets_(offsets),
        received_(received),
        stride_(stride),
        entry_(entry),
        done_(in.size(), 0) {}

  // Sums every element that lies wholly within the first `bytes` of the message.
  ffi::Error UpTo(size_t bytes) {
    const size_t k = entry_.recv_ranks.size();
    std::vector<const void*> others(k);
    size_t start = 0;  // of leaf l in the message
    for (size_t l = 0; l < in_.size(); start += in_[l].bytes, ++l) {
      const Leaf& leaf = in_[l];
      if (bytes <= start || done_[l] == leaf.count) continue;
      const size_t width = leaf.count ? leaf.bytes / leaf.count : 1;
      const size_t ready = std::min(leaf.count, (bytes - start) / width);
      if (ready <= done_[l]) continue;
      const size_t at = done_[l] * width;
      for (size_t j = 0; j < k; ++j) others[j] = received_ + j * stride_ + offsets_[l] + at;
      JAXFOG_RETURN_IF_ERROR(WeightedSum(
          leaf.type, ready - done_[l], static_cast<char*>(out_[l].out) + at,
          static_cast<const char*>(leaf.in) + at, entry_.self_weight, others, entry_.recv_weights));
      done_[l] = ready;
    }
    return ffi::Error::Success();
  }

 private:
  const std::vector<Leaf>& in_;
  const std::vector<Leaf>& out_;
  const std::vector<size_t>& offsets_;
  const char* received_;
  size_t stride_;
  const Entry& entry_;
  std::vector<size_t> done_;  // elements summed, per leaf
};

// out_i = self_weight * x_i + sum_{j in recv} recv_weight_j * (x_j as sent by j),
// where a sender scales what it sends by its send weight. All leaves of a
// pytree travel as one message per peer; the sum is one pass per leaf.
ffi::Error NeighborAllreduce(Transport* transport, const OpInfo& info, const Entry& entry,
                             const std::vector<Leaf>& in, const std::vector<Leaf>& out) {
  std::vector<size_t> offsets;
  const size_t stride = Layout(in, &offsets);
  ScratchPool& pool = ScratchPool::Global();

  // Senders with a weight other than 1 send a scaled copy.
  std::vector<ScratchPool::Lease> scaled;
  std::vector<SendSpec> sends;
  for (size_t s = 0; s < entry.send_ranks.size(); ++s) {
    SendSpec send{entry.send_ranks[s], {}};
    if (entry.send_weights[s] == 1.0) {
      for (const Leaf& leaf : in) send.pieces.push_back({leaf.in, leaf.bytes});
    } else {
      scaled.push_back(pool.Acquire(stride));
      char* base = scaled.back().data();
      timeline::Span span("scale");
      for (size_t l = 0; l < in.size(); ++l) {
        JAXFOG_RETURN_IF_ERROR(WeightedSum(in[l].type, in[l].count, base + offsets[l], in[l].in,
                                           entry.send_weights[s], {}, {}));
      }
      send.pieces = ConstPiecesAt(base, in, offsets);
    }
    sends.push_back(std::move(send));
  }
  const size_t k = entry.recv_ranks.size();
  ScratchPool::Lease received = pool.Acquire(stride * k);
  std::vector<RecvSpec> recvs;
  for (size_t j = 0; j < k; ++j) {
    recvs.push_back({entry.recv_ranks[j], PiecesAt(received.data() + j * stride, in, offsets)});
  }
  PartialSums sums(in, out, offsets, received.data(), stride, entry);
  // Streamed or not depends on the message size alone: a sender and its
  // receivers must cut the message into the same pieces.
  if (stride < kStreamMinBytes) {
    JAXFOG_RETURN_IF_ERROR(transport->Exchange(info, sends, recvs));
    timeline::Span span("weighted sum");
    return sums.UpTo(Streaming::kAll);
  }
  // Large messages: sum each piece as soon as it is in from every peer, while
  // the next pieces travel, and while it is still in cache.
  const Streaming streaming{kStreamChunkBytes, [&sums](size_t bytes) {
                              timeline::Span span("weighted sum");
                              return sums.UpTo(bytes);
                            }};
  return transport->Exchange(info, sends, recvs, &streaming);
}

ffi::ErrorOr<Job> NeighborAllreduceJob(Staging* staging, int64_t comm_id, int64_t signature,
                                       std::string_view layout, int64_t plan_id, ffi::Token,
                                       ffi::BufferR0<ffi::S32> step, ffi::RemainingArgs args,
                                       ffi::Result<ffi::Token>, ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(call, Decode(staging, comm_id, args, rets, OpCode::kNeighborAllreduce));
  JAXFOG_ASSIGN_OR_RETURN(at, InputScalar<int32_t>(staging, step.typed_data()));
  JAXFOG_ASSIGN_OR_RETURN(plan, FindPlan(plan_id));
  JAXFOG_ASSIGN_OR_RETURN(entry, SelectEntry(at, *plan, call.transport->size()));
  const OpInfo info = Info(OpCode::kNeighborAllreduce, signature, layout);
  return TracedJob(OpCode::kNeighborAllreduce, comm_id, call.transport, signature,
                   TotalBytes(call.in), [=](timeline::OpArgs* trace) {
                     if (trace) trace->Peers(entry.send_ranks, entry.recv_ranks);
                     return NeighborAllreduce(call.transport, info, entry, call.in, call.out);
                   });
}

// out = concat over recv_ranks (in that order) of x_j along axis 0; the
// message from j lands directly in its block of every output leaf.
ffi::Error NeighborAllgather(Transport* transport, const OpInfo& info,
                             const std::vector<int64_t>& send_ranks,
                             const std::vector<int64_t>& recv_ranks, const std::vector<Leaf>& in,
                             const std::vector<Leaf>& out) {
  std::vector<SendSpec> sends;
  for (int64_t peer : send_ranks) {
    SendSpec send{static_cast<int>(peer), {}};
    for (const Leaf& leaf : in) send.pieces.push_back({leaf.in, leaf.bytes});
    sends.push_back(std::move(send));
  }
  std::vector<RecvSpec> recvs;
  for (size_t j = 0; j < recv_ranks.size(); ++j) {
    RecvSpec recv{static_cast<int>(recv_ranks[j]), {}};
    for (size_t l = 0; l < in.size(); ++l) {
      recv.pieces.push_back({static_cast<char*>(out[l].out) + j * in[l].bytes, in[l].bytes});
    }
    recvs.push_back(std::move(recv));
  }
  return transport->Exchange(info, sends, recvs);
}

// The adjoint of neighbor_allgather: block i of every input leaf goes back to
// send_ranks[i]; the output is the sum of the blocks received.
ffi::Error NeighborReduceScatter(Transport* transport, const OpInfo& info,
                                 const std::vector<int64_t>& send_ranks,
                                 const std::vector<int64_t>& recv_ranks,
                                 const std::vector<Leaf>& in, const std::vector<Leaf>& out) {
  std::vector<SendSpec> sends;
  for (size_t i = 0; i < send_ranks.size(); ++i) {
    SendSpec send{static_cast<int>(send_ranks[i]), {}};
    for (size_t l = 0; l < out.size(); ++l) {
      send.pieces.push_back({static_cast<const char*>(in[l].in) + i * out[l].bytes, out[l].bytes});
    }
    sends.push_back(std::move(send));
  }
  std::vector<size_t> offsets;
  const size_t stride = Layout(out, &offsets);
  const size_t k = recv_ranks.size();
  ScratchPool::Lease received = ScratchPool::Global().Acquire(stride * k);
  std::vector<RecvSpec> recvs;
  for (size_t j = 0; j < k; ++j) {
    recvs.push_back(
        {static_cast<int>(recv_ranks[j]), PiecesAt(received.data() + j * stride, out, offsets)});
  }
  JAXFOG_RETURN_IF_ERROR(transport->Exchange(info, sends, recvs));
  timeline::Span span("weighted sum");
  std::vector<const void*> others(k);
  const std::vector<double> ones(k, 1.0);
  for (size_t l = 0; l < out.size(); ++l) {
    for (size_t j = 0; j < k; ++j) others[j] = received.data() + j * stride + offsets[l];
    JAXFOG_RETURN_IF_ERROR(
        WeightedSum(out[l].type, out[l].count, out[l].out, nullptr, 0.0, others, ones));
  }
  return ffi::Error::Success();
}

// neighbor_allgather and its adjoint take the same arguments; the adjoint's
// message is the size of its output.
template <OpCode op>
ffi::ErrorOr<Job> NeighborGatherJob(Staging* staging, int64_t comm_id, int64_t signature,
                                    std::string_view layout, I64s send_ranks, I64s recv_ranks,
                                    ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                                    ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(call, Decode(staging, comm_id, args, rets, op));
  std::vector<int64_t> sends(send_ranks.begin(), send_ranks.end());
  std::vector<int64_t> recvs(recv_ranks.begin(), recv_ranks.end());
  constexpr bool adjoint = op == OpCode::kNeighborReduceScatter;
  const OpInfo info = Info(op, signature, layout);
  return TracedJob(op, comm_id, call.transport, signature, TotalBytes(adjoint ? call.out : call.in),
                   [=](timeline::OpArgs* trace) {
                     if (trace) trace->Peers(sends, recvs);
                     return (adjoint ? NeighborReduceScatter : NeighborAllgather)(
                         call.transport, info, sends, recvs, call.in, call.out);
                   });
}

template <OpCode op>
struct NeighborGather : OnCommThread<NeighborGatherJob<op>> {
  static auto Bind() { return PytreeOp(Peers(Keyed())); }
};

}  // namespace

// The handlers of this file's ops (Handler, handler.h), then their exported
// forms (Exports, handler.h).
template <>
struct Handler<OpCode::kNeighborAllreduce> : OnCommThread<NeighborAllreduceJob> {
  static auto Bind() {
    return Keyed()
        .Attr<int64_t>("plan_id")
        .Arg<ffi::Token>()
        .Arg<ffi::BufferR0<ffi::S32>>()
        .RemainingArgs()
        .Ret<ffi::Token>()
        .RemainingRets();
  }
};

template <>
struct Handler<OpCode::kNeighborAllgather> : NeighborGather<OpCode::kNeighborAllgather> {};
template <>
struct Handler<OpCode::kNeighborReduceScatter> : NeighborGather<OpCode::kNeighborReduceScatter> {};

JAXFOG_DEFINE_EXPORTS(NeighborAllreduce)
JAXFOG_DEFINE_EXPORTS(NeighborAllgather)
JAXFOG_DEFINE_EXPORTS(NeighborReduceScatter)
JAXFOG_DEFINE_START_EXPORTS(NeighborAllreduce)
JAXFOG_DEFINE_START_EXPORTS(NeighborAllgather)
JAXFOG_DEFINE_START_EXPORTS(NeighborReduceScatter)

}  // namespace jaxfog
