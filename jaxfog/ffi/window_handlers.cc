// The one-sided window ops' handlers (see handler.h and window.h): win_put
// and win_accumulate into other ranks' slots, win_get from their published
// values, win_update (the weighted sum of this rank's value and its slots),
// and win_state (version counters and push-sum weight).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "handler.h"
#include "kernels.h"
#include "window.h"

namespace jaxfog {
namespace {

// A window op's call: the window and its leaves (which must have the window's
// layout: the same count, dtypes and sizes, in order).
struct WindowCall {
  Window* window;
  std::vector<Leaf> in, out;
};

ffi::ErrorOr<WindowCall> DecodeWindow(Staging* staging, int64_t win_id, ffi::RemainingArgs args,
                                      ffi::RemainingRets rets, OpCode op) {
  JAXFOG_ASSIGN_OR_RETURN(window, LookupWindow(win_id));
  JAXFOG_ASSIGN_OR_RETURN(in, Inputs(staging, args, OpName(op)));
  JAXFOG_ASSIGN_OR_RETURN(out, Outputs(staging, rets));
  if (staging == nullptr) {
    for (const Leaf& leaf : out) AdviseHugePages(leaf.out, leaf.bytes);
  }
  const auto& leaves = window->layout().leaves;
  bool same = in.size() == leaves.size();
  for (size_t l = 0; same && l < in.size(); ++l) {
    same = in[l].type == leaves[l].type && in[l].bytes == leaves[l].bytes;
  }
  if (!same) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        std::string("jaxfog ") + OpName(op) + ": the value does not have the window's layout"));
  }
  return WindowCall{window, std::move(in), std::move(out)};
}

ffi::Error Malformed(OpCode op) {
  return ffi::Error::InvalidArgument(std::string("jaxfog ") + OpName(op) + ": malformed peers");
}

std::vector<int> Ranks(I64s ranks) { return std::vector<int>(ranks.begin(), ranks.end()); }

double& WeightAt(const WindowLayout& layout, char* region) {
  return *reinterpret_cast<double*>(region + layout.weight_offset);
}

// dst = w * src over a whole region: every leaf and the weight (may alias).
ffi::Error ScaleRegion(const WindowLayout& layout, char* dst, const char* src, double w) {
  for (const WindowLayout::Leaf& leaf : layout.leaves) {
    JAXFOG_RETURN_IF_ERROR(WeightedSum(leaf.type, leaf.bytes / ffi::ByteWidth(leaf.type),
                                       dst + leaf.offset, src + leaf.offset, w, {}, {}));
  }
  if (layout.weight_offset >= 0) {
    WeightAt(layout, dst) = w * WeightAt(layout, const_cast<char*>(src));
  }
  return ffi::Error::Success();
}

// win_put / win_accumulate: w_j * (x, p) into (or onto) my slot on each
// destination j; a put counts a version there. My published value := x,
// my p := self_weight * p. No results: the op's value, self_weight * x, is
// XLA's to compute (fused, or x itself), not a copy made here.
template <bool kAccumulate>
ffi::ErrorOr<Job> WinPutJob(Staging* staging, int64_t win_id, double self_weight, I64s dst_ranks,
                            I64s dst_regions, F64s dst_weights, bool require_mutex, ffi::Token,
                            ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                            ffi::RemainingRets rets) {
  constexpr OpCode kOp = kAccumulate ? OpCode::kWinAccumulate : OpCode::kWinPut;
  JAXFOG_ASSIGN_OR_RETURN(call, DecodeWindow(staging, win_id, args, rets, kOp));
  if (dst_ranks.size() != dst_regions.size() || dst_ranks.size() != dst_weights.size()) {
    return ffi::Unexpected<ffi::Error>(Malformed(kOp));
  }
  std::vector<int> ranks = Ranks(dst_ranks);
  std::vector<int64_t> regions(dst_regions.begin(), dst_regions.end());
  std::vector<double> weights(dst_weights.begin(), dst_weights.end());
  // Region 0 is a destination's published value: an accumulate onto it changes
  // that rank's value (AD-PSGD's pairwise average), so the sender's own value
  // and weight stay as they are. Region 0's control word is the mutex: never
  // counted, never put.
  const bool into_values =
      !regions.empty() &&
      std::all_of(regions.begin(), regions.end(), [](int64_t region) { return region == 0; });
  if (!into_values && std::find(regions.begin(), regions.end(), 0) != regions.end()) {
    return ffi::Unexpected<ffi::Error>(Malformed(kOp));
  }
  if (into_values && !kAccumulate) return ffi::Unexpected<ffi::Error>(Malformed(kOp));
  return Job{
      kOp, TotalBytes(call.in), [=]() -> ffi::Error {
        timeline::Span span(OpName(kOp), timeline::Span::kOp);
        Window* window = call.window;
        const WindowLayout& layout = window->layout();
        const std::vector<Leaf>& in = call.in;
        ScopedMutex mutex(window, require_mutex ? ranks : std::vector<int>{});
        JAXFOG_RETURN_IF_ERROR(mutex.status());
        double p = 0.0;
        if (window->has_weight()) {
          JAXFOG_RETURN_IF_ERROR(window->Local([&](char* base) {
            p = WeightAt(layout, base);
            return ffi::Error::Success();
          }));
        }
        // A scaled copy only when some destination's weight is not 1.
        const bool scales =
            std::any_of(weights.begin(), weights.end(), [](double w) { return w != 1.0; });
        ScratchPool::Lease scaled =
            ScratchPool::Global().Acquire(scales ? layout.message_bytes : 0);
        for (size_t d = 0; d < ranks.size(); ++d) {
          std::vector<TypedRun> runs;
          for (size_t l = 0; l < in.size(); ++l) {
            const size_t offset = layout.leaves[l].offset;
            const void* data = in[l].in;
            if (weights[d] != 1.0) {
              JAXFOG_RETURN_IF_ERROR(WeightedSum(in[l].type, in[l].count, scaled.data() + offset,
                                                 in[l].in, weights[d], {}, {}));
              data = scaled.data() + offset;
            }
            runs.push_back({in[l].type, offset, data, in[l].bytes});
          }
          const double sent_weight = weights[d] * p;
          if (window->has_weight()) {
            runs.push_back({ffi::DataType::F64, static_cast<size_t>(layout.weight_offset),
                            &sent_weight, sizeof(double)});
          }
          JAXFOG_RETURN_IF_ERROR(
              window->Put(ranks[d], regions[d], runs, kAccumulate, /*count=*/!kAccumulate));
        }
        JAXFOG_RETURN_IF_ERROR(mutex.Release());
        if (into_values) return ffi::Error::Success();
        JAXFOG_RETURN_IF_ERROR(window->Local([&](char* base) {
          for (size_t l = 0; l < in.size(); ++l) {
            if (in[l].bytes) std::memcpy(base + layout.leaves[l].offset, in[l].in, in[l].bytes);
          }
          if (window->has_weight()) WeightAt(layout, base) = self_weight * p;
          return ffi::Error::Success();
        }));
        return ffi::Error::Success();
      }};
}

// Every window op starts with its window and the weight of the local value.
auto WindowOp() { return ffi::Ffi::Bind().Attr<int64_t>("win_id").Attr<double>("self_weight"); }

auto WinPutBinding() {
  return PytreeOp(WindowOp()
                      .Attr<I64s>("dst_ranks")
                      .Attr<I64s>("dst_regions")
                      .Attr<F64s>("dst_weights")
                      .Attr<bool>("require_mutex"));
}

// win_get: my slot for j := w_j * (j's published value and p), for each
// source j; counts a version on each slot written.
ffi::ErrorOr<Job> WinGetJob(Staging* staging, int64_t win_id, double, I64s src_ranks,
                            I64s src_regions, F64s src_weights, bool require_mutex, ffi::Token,
                            ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                            ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(window, LookupWindow(win_id));
  JAXFOG_ASSIGN_OR_RETURN(out, Outputs(staging, rets));  // none (a start's handle id aside)
  if (args.size() || !out.empty() || src_ranks.size() != src_regions.size() ||
      src_ranks.size() != src_weights.size()) {
    return ffi::Unexpected<ffi::Error>(Malformed(OpCode::kWinGet));
  }
  for (int64_t region : src_regions) {
    if (region < 1 || region > window->slots()) {
      return ffi::Unexpected<ffi::Error>(Malformed(OpCode::kWinGet));
    }
  }
  std::vector<int> ranks = Ranks(src_ranks);
  std::vector<int64_t> regions(src_regions.begin(), src_regions.end());
  std::vector<double> weights(src_weights.begin(), src_weights.end());
  return Job{OpCode::kWinGet, window->region_bytes() * ranks.size(), [=]() -> ffi::Error {
               timeline::Span span("win_get", timeline::Span::kOp);
               const size_t region_bytes = window->region_bytes();
               ScopedMutex mutex(window, require_mutex ? ranks : std::vector<int>{});
               JAXFOG_RETURN_IF_ERROR(mutex.status());
               ScratchPool::Lease fetched =
                   ScratchPool::Global().Acquire(region_bytes * ranks.size());
               for (size_t s = 0; s < ranks.size(); ++s) {
                 char* into = fetched.data() + s * region_bytes;
                 JAXFOG_RETURN_IF_ERROR(window->Get(ranks[s], 0, into));
                 if (weights[s] != 1.0) {  // the default weight: no pass over the data
                   JAXFOG_RETURN_IF_ERROR(ScaleRegion(window->layout(), into, into, weights[s]));
                 }
               }
               JAXFOG_RETURN_IF_ERROR(mutex.Release());
               JAXFOG_RETURN_IF_ERROR(window->Local([&](char* base) {
                 for (size_t s = 0; s < ranks.size(); ++s) {
                   std::memcpy(base + regions[s] * region_bytes, fetched.data() + s * region_bytes,
                               region_bytes);
                 }
                 return ffi::Error::Success();
               }));
               for (int64_t region : regions) {
                 JAXFOG_RETURN_IF_ERROR(window->CountVersion(window->rank(), region));
               }
               return ffi::Error::Success();
             }};
}

// win_update: self_weight * (x, p) + sum_j w_j * slot_j (under this rank's
// mutex with `require_mutex`, which keeps mutex-protected writes out); my
// published value and p := the result; the versions of the slots read := 0;
// `reset` zeroes those slots.
ffi::ErrorOr<Job> WinUpdateJob(Staging* staging, int64_t win_id, double self_weight,
                               I64s src_regions, F64s src_weights, bool reset, bool require_mutex,
                               ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                               ffi::RemainingRets rets) {
  JAXFOG_ASSIGN_OR_RETURN(call, DecodeWindow(staging, win_id, args, rets, OpCode::kWinUpdate));
  Window* window = call.window;
  if (src_regions.size() != src_weights.size()) {
    return ffi::Unexpected<ffi::Error>(Malformed(OpCode::kWinUpdate));
  }
  std::vector<int64_t> regions(src_regions.begin(), src_regions.end());
  std::vector<double> weights(src_weights.begin(), src_weights.end());
  for (int64_t region : regions) {
    if (region < 1 || region > window->slots()) {
      return ffi::Unexpected<ffi::Error>(Malformed(OpCode::kWinUpdate));
    }
  }
  return Job{OpCode::kWinUpdate, TotalBytes(call.in), [=]() -> ffi::Error {
               timeline::Span span("win_update", timeline::Span::kOp);
               const WindowLayout& layout = window->layout();
               const size_t region_bytes = window->region_bytes();
               const std::vector<Leaf>& in = call.in;
               ScopedMutex mutex(
                   window, require_mutex ? std::vector<int>{window->rank()} : std::vector<int>{});
               JAXFOG_RETURN_IF_ERROR(mutex.status());
               JAXFOG_RETURN_IF_ERROR(window->Local([&](char* base) {
                 // In chunks that stay in cache between the sum and its copy into the
                 // published region (one pass over the data, not two).
                 constexpr size_t kChunkBytes = 64 << 10;
                 std::vector<const void*> others(regions.size());
                 for (size_t l = 0; l < in.size(); ++l) {
                   const size_t width = ffi::ByteWidth(in[l].type);
                   const size_t chunk = std::max<size_t>(1, kChunkBytes / width);
                   for (size_t start = 0; start < in[l].count; start += chunk) {
                     const size_t count = std::min(chunk, in[l].count - start);
                     const size_t at = layout.leaves[l].offset + start * width;
                     for (size_t j = 0; j < regions.size(); ++j) {
                       others[j] = base + regions[j] * region_bytes + at;
                     }
                     char* out = static_cast<char*>(call.out[l].out) + start * width;
                     JAXFOG_RETURN_IF_ERROR(WeightedSum(
                         in[l].type, count, out, static_cast<const char*>(in[l].in) + start * width,
                         self_weight, others, weights));
                     std::memcpy(base + at, out, count * width);
                   }
                 }
                 if (window->has_weight()) {
                   double p = self_weight * WeightAt(layout, base);
                   for (size_t j = 0; j < regions.size(); ++j) {
                     p += weights[j] * WeightAt(layout, base + regions[j] * region_bytes);
                   }
                   WeightAt(layout, base) = p;
                 }
                 for (int64_t region : regions) {
                   if (reset) std::memset(base + region * region_bytes, 0, region_bytes);
                 }
                 return ffi::Error::Success();
               }));
               JAXFOG_RETURN_IF_ERROR(window->ResetVersions(regions));
               return mutex.Release();
             }};
}

// win_version / win_weight inside a trace: this rank's version counters (one
// per slot, int32 or int64) and push-sum weight (float32 or float64; 0
// without one), read under the local locks in program order.
ffi::ErrorOr<Job> WinStateJob(Staging* staging, int64_t win_id, ffi::Token, ffi::Result<ffi::Token>,
                              ffi::Result<ffi::AnyBuffer> versions,
                              ffi::Result<ffi::AnyBuffer> weight) {
  JAXFOG_ASSIGN_OR_RETURN(window, LookupWindow(win_id));
  const ffi::DataType count_type = versions->element_type();
  const ffi::DataType weight_type = weight->element_type();
  if (versions->element_count() != static_cast<size_t>(window->slots()) ||
      (count_type != ffi::DataType::S32 && count_type != ffi::DataType::S64) ||
      (weight_type != ffi::DataType::F32 && weight_type != ffi::DataType::F64)) {
    return ffi::Unexpected<ffi::Error>(Malformed(OpCode::kWinState));
  }
  void* counts = OutputAt(staging, versions->untyped_data(), versions->size_bytes());
  void* p = OutputAt(staging, weight->untyped_data(), weight->size_bytes());
  return Job{OpCode::kWinState, 0, [=]() -> ffi::Error {
               std::vector<int64_t> read(window->slots());
               JAXFOG_RETURN_IF_ERROR(window->ReadVersions(read.data()));
               for (int64_t s = 0; s < window->slots(); ++s) {
                 if (count_type == ffi::DataType::S32) {
                   static_cast<int32_t*>(counts)[s] = static_cast<int32_t>(read[s]);
                 } else {
                   static_cast<int64_t*>(counts)[s] = read[s];
                 }
               }
               return window->Local([&](char* base) {
                 const double value = window->has_weight() ? WeightAt(window->layout(), base) : 0.0;
                 if (weight_type == ffi::DataType::F32) {
                   *static_cast<float*>(p) = static_cast<float>(value);
                 } else {
                   *static_cast<double*>(p) = value;
                 }
                 return ffi::Error::Success();
               });
             }};
}

}  // namespace

// The handlers of this file's ops (Handler, handler.h), then their exported
// forms (Exports, handler.h).
template <>
struct Handler<OpCode::kWinPut> : OnCommThread<WinPutJob<false>> {
  static auto Bind() { return WinPutBinding(); }
};
template <>
struct Handler<OpCode::kWinAccumulate> : OnCommThread<WinPutJob<true>> {
  static auto Bind() { return WinPutBinding(); }
};

template <>
struct Handler<OpCode::kWinGet> : OnCommThread<WinGetJob> {
  static auto Bind() {
    return PytreeOp(WindowOp()
                        .Attr<I64s>("src_ranks")
                        .Attr<I64s>("src_regions")
                        .Attr<F64s>("src_weights")
                        .Attr<bool>("require_mutex"));
  }
};

template <>
struct Handler<OpCode::kWinUpdate> : OnCommThread<WinUpdateJob> {
  static auto Bind() {
    return PytreeOp(WindowOp()
                        .Attr<I64s>("src_regions")
                        .Attr<F64s>("src_weights")
                        .Attr<bool>("reset")
                        .Attr<bool>("require_mutex"));
  }
};

template <>
struct Handler<OpCode::kWinState> : OnCommThread<WinStateJob> {
  static auto Bind() {
    return ffi::Ffi::Bind()
        .Attr<int64_t>("win_id")
        .Arg<ffi::Token>()
        .Ret<ffi::Token>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>();
  }
};

JAXFOG_DEFINE_EXPORTS(WinPut)
JAXFOG_DEFINE_EXPORTS(WinAccumulate)
JAXFOG_DEFINE_EXPORTS(WinGet)
JAXFOG_DEFINE_EXPORTS(WinUpdate)
JAXFOG_DEFINE_EXPORTS(WinState)
JAXFOG_DEFINE_START_EXPORTS(WinPut)
JAXFOG_DEFINE_START_EXPORTS(WinAccumulate)
JAXFOG_DEFINE_START_EXPORTS(WinGet)

}  // namespace jaxfog
