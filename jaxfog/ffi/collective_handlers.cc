// The collective ops' handlers (see handler.h): a communicator's rank and
// size, barrier, fence, and the pytree collectives allreduce (sum or mean,
// integers averaged in float64), broadcast and allgather.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "handler.h"
#include "kernels.h"

namespace jaxfog {
namespace {

// rank and size: a property of communicator `comm_id`, as an int32 scalar.
template <int (Transport::*Get)() const>
struct Property {
  static ffi::Error Run(Staging* staging, int64_t comm_id,
                        ffi::Result<ffi::BufferR0<ffi::S32>> out) {
    ffi::ErrorOr<Transport*> transport = LookupTransport(comm_id);
    if (transport.has_error()) return transport.error();
    *static_cast<int32_t*>(OutputAt(staging, out->typed_data(), sizeof(int32_t))) =
        ((*transport)->*Get)();
    return ffi::Error::Success();
  }
  static ffi::Error Handle(int64_t comm_id, ffi::Result<ffi::BufferR0<ffi::S32>> out) {
    return Run(nullptr, comm_id, out);
  }
  static auto Bind() {
    return ffi::Ffi::Bind().Attr<int64_t>("comm_id").Ret<ffi::BufferR0<ffi::S32>>();
  }
};

ffi::ErrorOr<Job> BarrierJob(Staging*, int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>) {
  JAXFOG_ASSIGN_OR_RETURN(transport, LookupTransport(comm_id));
  return Job{OpCode::kBarrier, 0, [transport, comm_id] {
               timeline::Span span(OpName(OpCode::kBarrier), timeline::Span::kOp);
               if (span) span.args().comm = comm_id;  // not sequenced: no headers, no seq
               return transport->Barrier();
             }};
}

// Packs leaves into `base` at `offsets` (when a pytree must be one message).
void Pack(const std::vector<Leaf>& in, char* base, const std::vector<size_t>& offsets) {
  for (size_t l = 0; l < in.size(); ++l) {
    if (in[l].bytes) std::memcpy(base + offsets[l], in[l].in, in[l].bytes);
  }
}

// Integer leaves of one dtype as float64, back to back.
template <typename Int>
void IntegersToDoubles(const std::vector<size_t>& members, const std::vector<Leaf>& in,
                       double* to) {
  for (size_t l : members) {
    const Int* from = static_cast<const Int*>(in[l].in);
    for (size_t i = 0; i < in[l].count; ++i) *to++ = static_cast<double>(from[i]);
  }
}

template <typename Int>
void DoublesToIntegers(const double* from, double scale, const std::vector<size_t>& members,
                       const std::vector<Leaf>& out) {
  for (size_t l : members) {
    Int* to = static_cast<Int*>(out[l].out);
    // nearbyint: the default rounding mode, to nearest with ties to even.
    for (size_t i = 0; i < out[l].count; ++i) {
      to[i] = static_cast<Int>(std::nearbyint(*from++ * scale));
    }
  }
}

// The mean of integer leaves, summed in float64 like every integer average:
// an int32 sum over the ranks need not fit in int32.
ffi::Error IntegerMean(Transport* transport, const OpInfo& info, double scale, ffi::DataType type,
                       const std::vector<size_t>& members, const std::vector<Leaf>& in,
                       const std::vector<Leaf>& out) {
  size_t count = 0;
  for (size_t l : members) count += in[l].count;
  ScratchPool::Lease values = ScratchPool::Global().Acquire(count * sizeof(double));
  ScratchPool::Lease sums = ScratchPool::Global().Acquire(count * sizeof(double));
  auto* packed = reinterpret_cast<double*>(values.data());
  auto* summed = reinterpret_cast<double*>(sums.data());
  const bool is32 = type == ffi::DataType::S32;
  if (is32) {
    IntegersToDoubles<int32_t>(members, in, packed);
  } else {
    IntegersToDoubles<int64_t>(members, in, packed);
  }
  JAXFOG_RETURN_IF_ERROR(transport->Allreduce(info, packed, summed, count, ffi::DataType::F64));
  if (is32) {
    DoublesToIntegers<int32_t>(summed, scale, members, out);
  } else {
    DoublesToIntegers<int64_t>(summed, scale, members, out);
  }
  return ffi::Error::Success();
}

// Sum or mean over all ranks, leaf by leaf in one call (one message for a
// single leaf; a pytree is packed per dtype so each dtype is one message).
ffi::Error Allreduce(Transport* transport, const OpInfo& info, bool mean,
                     const std::vector<Leaf>& in, const std::vector<Leaf>& out) {
  const double scale = mean ? 1.0 / transport->size() : 1.0;
  // Group leaves by dtype, preserving order.
  std::vector<ffi::DataType> types;
  for (const Leaf& leaf : in) {
    if (std::find(types.begin(), types.end(), leaf.type) == types.end()) types.push_back(leaf.type);
  }
  for (ffi::DataType type : types) {
    std::vector<size_t> members;
    size_t count = 0;
    for (size_t l = 0; l < in.size(); ++l) {
      if (in[l].type == type) {
        members.push_back(l);
        count += in[l].count;
      }
    }
    if (mean && (type == ffi::DataType::S32 || type == ffi::DataType::S64)) {
      JAXFOG_RETURN_IF_ERROR(IntegerMean(transport, info, scale, type, members, in, out));
      continue;
    }
    const size_t width = ffi::ByteWidth(type);
    if (members.size() == 1) {  // in place into XLA's output: no packing pass
      const size_t l = members[0];
      JAXFOG_RETURN_IF_ERROR(transport->Allreduce(info, in[l].in, out[l].out, count, type));
      if (mean) {
        JAXFOG_RETURN_IF_ERROR(WeightedSum(type, count, out[l].out, out[l].out, scale, {}, {}));
      }
      continue;
    }
    ScratchPool::Lease packed = ScratchPool::Global().Acquire(count * width);
    size_t at = 0;
    for (size_t l : members) {
      if (in[l].bytes) std::memcpy(packed.data() + at, in[l].in, in[l].bytes);
      at += in[l].bytes;
    }
    ScratchPool::Lease summed = ScratchPool::Global().Acquire(count * width);
    JAXFOG_RETURN_IF_ERROR(transport->Allreduce(info, packed.data(), summed.data(), count, type));
    at = 0;
    for (size_t l : members) {
      if (!mean) {  // a copy: int64 sums stay exact
        if (out[l].bytes) std::memcpy(out[l].out, summed.data() + at, out[l].bytes);
      } else {
        JAXFOG_RETURN_IF_ERROR(
            WeightedSum(type, out[l].count, out[l].out, summed.data() + at, scale, {}, {}));
      }
      at += out[l].bytes;
    }
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<Job> AllreduceJob(Staging* staging, int64_t comm_id, int64_t signature,
                               std::string_view layout, bool mean, ffi::Token,
                               ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                               ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(call, Decode(staging, comm_id, args, rets, OpCode::kAllreduce));
  const OpInfo info = Info(OpCode::kAllreduce, signature, layout);
  return TracedJob(
      OpCode::kAllreduce, comm_id, call.transport, signature, TotalBytes(call.in),
      [=](timeline::OpArgs*) { return Allreduce(call.transport, info, mean, call.in, call.out); });
}

// Every rank gets root's value (one message for the whole pytree). The root
// sends from its input (MPI only reads it there) and copies it to its output
// while the messages move.
ffi::Error Broadcast(Transport* transport, const OpInfo& info, int64_t root,
                     const std::vector<Leaf>& in, const std::vector<Leaf>& out) {
  const bool is_root = transport->rank() == root;
  auto copy_in_to_out = [&in, &out] {
    for (size_t l = 0; l < out.size(); ++l) {
      if (out[l].bytes) std::memcpy(out[l].out, in[l].in, out[l].bytes);
    }
  };
  if (in.size() == 1) {
    if (!is_root) return transport->Broadcast(info, out[0].out, out[0].bytes, int(root));
    return transport->Broadcast(info, const_cast<void*>(in[0].in), in[0].bytes, int(root),
                                copy_in_to_out);
  }
  std::vector<size_t> offsets;
  const size_t total = Layout(in, &offsets, 1);
  ScratchPool::Lease packed = ScratchPool::Global().Acquire(total);
  if (is_root) {
    Pack(in, packed.data(), offsets);
    return transport->Broadcast(info, packed.data(), total, int(root), copy_in_to_out);
  }
  JAXFOG_RETURN_IF_ERROR(transport->Broadcast(info, packed.data(), total, int(root)));
  for (size_t l = 0; l < out.size(); ++l) {
    if (out[l].bytes) std::memcpy(out[l].out, packed.data() + offsets[l], out[l].bytes);
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<Job> BroadcastJob(Staging* staging, int64_t comm_id, int64_t signature,
                               std::string_view layout, int64_t root, ffi::Token,
                               ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                               ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(call, Decode(staging, comm_id, args, rets, OpCode::kBroadcast));
  const OpInfo info = Info(OpCode::kBroadcast, signature, layout);
  return TracedJob(OpCode::kBroadcast, comm_id, call.transport, signature, TotalBytes(call.in),
                   [=](timeline::OpArgs* trace) {
                     if (trace) trace->root = root;
                     return Broadcast(call.transport, info, root, call.in, call.out);
                   });
}

// out = concat over ranks 0..n-1 of x along axis 0 (one message per leaf set).
ffi::Error Allgather(Transport* transport, const OpInfo& info, const std::vector<Leaf>& in,
                     const std::vector<Leaf>& out) {
  if (in.size() == 1) return transport->Allgather(info, in[0].in, out[0].out, in[0].bytes);
  std::vector<size_t> offsets;
  const size_t total = Layout(in, &offsets, 1);
  const size_t n = static_cast<size_t>(transport->size());
  ScratchPool::Lease packed = ScratchPool::Global().Acquire(total);
  ScratchPool::Lease gathered = ScratchPool::Global().Acquire(total * n);
  Pack(in, packed.data(), offsets);
  JAXFOG_RETURN_IF_ERROR(transport->Allgather(info, packed.data(), gathered.data(), total));
  for (size_t r = 0; r < n; ++r) {
    for (size_t l = 0; l < out.size(); ++l) {
      if (in[l].bytes) {
        std::memcpy(static_cast<char*>(out[l].out) + r * in[l].bytes,
                    gathered.data() + r * total + offsets[l], in[l].bytes);
      }
    }
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<Job> AllgatherJob(Staging* staging, int64_t comm_id, int64_t signature,
                               std::string_view layout, ffi::Token, ffi::RemainingArgs args,
                               ffi::Result<ffi::Token>, ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(call, Decode(staging, comm_id, args, rets, OpCode::kAllgather));
  const OpInfo info = Info(OpCode::kAllgather, signature, layout);
  return TracedJob(
      OpCode::kAllgather, comm_id, call.transport, signature, TotalBytes(call.in),
      [=](timeline::OpArgs*) { return Allgather(call.transport, info, call.in, call.out); });
}

}  // namespace

// The handlers of this file's ops (Handler, handler.h), then their exported
// forms (Exports, handler.h).
template <>
struct Handler<OpCode::kRank> : Property<&Transport::rank> {};
template <>
struct Handler<OpCode::kSize> : Property<&Transport::size> {};

template <>
struct Handler<OpCode::kBarrier> : OnCommThread<BarrierJob> {
  static auto Bind() {
    return ffi::Ffi::Bind().Attr<int64_t>("comm_id").Arg<ffi::Token>().Ret<ffi::Token>();
  }
};

template <>
struct Handler<OpCode::kFence> {
  // Completes once every op handed to the communication thread before it has
  // finished; `done` is a result to wait on (always 0).
  static ffi::Future Run(Staging* staging, ffi::Token, ffi::Result<ffi::Token>,
                         ffi::Result<ffi::BufferR0<ffi::S32>> done) {
    *static_cast<int32_t*>(OutputAt(staging, done->typed_data(), sizeof(int32_t))) = 0;
    return CommThread::Global().Fence();
  }
  static ffi::Future Handle(ffi::Token token, ffi::Result<ffi::Token> out,
                            ffi::Result<ffi::BufferR0<ffi::S32>> done) {
    return Run(nullptr, token, out, done);
  }
  static auto Bind() {
    return ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>().Ret<ffi::BufferR0<ffi::S32>>();
  }
};

template <>
struct Handler<OpCode::kAllreduce> : OnCommThread<AllreduceJob> {
  static auto Bind() { return PytreeOp(Keyed().Attr<bool>("mean")); }
};

template <>
struct Handler<OpCode::kBroadcast> : OnCommThread<BroadcastJob> {
  static auto Bind() { return PytreeOp(Keyed().Attr<int64_t>("root")); }
};

template <>
struct Handler<OpCode::kAllgather> : OnCommThread<AllgatherJob> {
  static auto Bind() { return PytreeOp(Keyed()); }
};

JAXFOG_DEFINE_EXPORTS(Rank)
JAXFOG_DEFINE_EXPORTS(Size)
JAXFOG_DEFINE_EXPORTS(Barrier)
JAXFOG_DEFINE_EXPORTS(Fence)
JAXFOG_DEFINE_EXPORTS(Allreduce)
JAXFOG_DEFINE_EXPORTS(Broadcast)
JAXFOG_DEFINE_EXPORTS(Allgather)
JAXFOG_DEFINE_START_EXPORTS(Allreduce)
JAXFOG_DEFINE_START_EXPORTS(Broadcast)
JAXFOG_DEFINE_START_EXPORTS(Allgather)

}  // namespace jaxfog
